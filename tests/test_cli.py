"""The ``trio-hedge`` command, run as a user runs it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from trio_hedge import cli
from trio_hedge.testing import Behaviour, fake_replicas

from .threaded import serve_in_thread


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trio_hedge", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_demo_json_shows_the_backup_winning_and_the_primary_cancelled() -> None:
    done = _run("demo", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["winner_replica"] == "backup"
    assert report["hedged"] is True
    assert [a["outcome"] for a in report["attempts"]] == ["cancelled", "won"]
    assert [a["trigger"] for a in report["attempts"]] == ["primary", "hedge"]
    # Real time on a loaded machine: the first token is due at 1.0 + 0.5 s.
    assert 1.5 <= report["ttft"] < 2.5
    assert report["text"].startswith("A hedged request")
    assert 0 <= report["primary_saw_cancel_at"] - report["ttft"] < 0.05


def test_demo_text_streams_then_reports() -> None:
    done = _run("demo")
    assert done.returncode == 0, done.stderr
    # As with `stream`: the answer on stdout, the report on stderr.
    assert done.stdout.startswith("A hedged request")
    assert "winner" not in done.stdout
    assert "winner          attempt 2 (backup)" in done.stderr
    assert "primary saw its request cancelled" in done.stderr


def test_version_and_help() -> None:
    from trio_hedge import __version__

    done = _run("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"trio-hedge {__version__}")
    help_text = _run("stream", "--help").stdout
    assert "(default: 1.0)" in help_text  # --hedge-after, in seconds
    assert "(default: 120; 0: wait forever)" in help_text  # --first-token-timeout
    assert "Exit status" in help_text
    assert "fake replicas on loopback" in _run("demo", "--help").stdout


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["demo", "stream", "serve", "fake", "tune"])
def test_every_option_of_every_subcommand_says_what_it_is(command: str) -> None:
    parser = _subcommands()[command]
    assert "``" not in (parser.description or "")  # plain text, not reStructuredText
    for action in parser._actions:
        name = action.option_strings[-1] if action.option_strings else action.dest
        assert action.help, f"{command} {name} has no help"
        shown = parser._get_formatter()._expand_help(action)
        # A flag (bool) or a repeatable option (empty list) has nothing to show.
        if action.default not in (None, [], argparse.SUPPRESS) and not isinstance(
            action.default, bool
        ):
            assert "default: " in shown, f"{command} {name}: {shown!r} hides its default"


@pytest.mark.parametrize(
    ("command", "option", "says"),
    [
        ("tune", "--window", "seconds of observations it keeps (LearnedDelay.window; default: 300"),
        ("tune", "--min-samples", "(LearnedDelay.min_samples; default: 20)"),
        ("tune", "--seed", "(default: 0)"),
        ("tune", "--chars-per-token", "(default: 4.0)"),
        # Unset, the gateway leaves both off (DEFAULT_HEDGER): only the request deadline.
        ("serve", "--first-token-timeout", "(default: none: only --request-timeout bounds it)"),
        ("serve", "--stall-timeout", "(default: none: only --request-timeout bounds it)"),
        ("serve", "--log-level", "(default: info)"),
        ("stream", "prompt", "the user message"),
    ],
)
def test_help_gives_defaults_and_units(command: str, option: str, says: str) -> None:
    parser = _subcommands()[command]
    (action,) = (a for a in parser._actions if option in (*a.option_strings, a.dest))
    assert says in parser._get_formatter()._expand_help(action)


def test_serves_help_states_the_gateways_real_defaults() -> None:
    from trio_hedge.gateway._config import DEFAULT_HEDGER, Limits

    assert DEFAULT_HEDGER.first_token_timeout is None
    assert DEFAULT_HEDGER.stall_timeout is None
    help_text = " ".join(_run("serve", "--help").stdout.split())
    assert f"(default: {Limits().request_timeout:g})" in help_text
    assert f"(default: {Limits().drain_timeout:g})" in help_text
    assert f"(default: {Limits().max_concurrent})" in help_text


def test_tunes_help_is_plain_text_and_names_the_log_formats() -> None:
    help_text = " ".join(_run("tune", "--help").stdout.split())
    assert "``" not in help_text
    assert "Hedger.samples()" in help_text
    assert "LoggingHook" in help_text
    assert "docs/tuning.md" in help_text


def test_a_failed_request_leads_with_its_error() -> None:
    port = _dead_port()
    done = _run("stream", "--replica", f"http://127.0.0.1:{port}/v1", "--model", "m", "hi")
    assert done.returncode == 1
    first = done.stderr.splitlines()[0]
    assert first.startswith("error           AllAttemptsFailed: the only attempt failed")
    assert "winner" not in done.stderr and "caller TTFT" not in done.stderr


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_stream_failure_prints_the_error_and_exits_non_zero() -> None:
    port = _dead_port()
    done = _run(
        *("stream", "--replica", f"http://127.0.0.1:{port}/v1", "--model", "m"),
        *("--json", "--api-key-env", "TH_KEY", "hi"),
        env={"TH_KEY": "sk-never-shown"},
    )
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["error"]["type"] == "AllAttemptsFailed"
    assert report["attempts"][0]["error"]["kind"] == "connection"
    assert "sk-never-shown" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (
                "stream",
                "--replica",
                "http://x/v1",
                "--model",
                "m",
                "--api-key-env",
                "TH_NOPE",
                "hi",
            ),
            "TH_NOPE is not set",
        ),
        (("stream", "--replica", "ftp://x", "--model", "m", "hi"), "http(s) URL"),
        (
            ("stream", "--replica", "http://x/v1", "--model", "m", "--hedge-after", "-1", "hi"),
            "hedge_after",
        ),
    ],
)
def test_bad_usage_exits_2(args: tuple[str, ...], message: str) -> None:
    done = _run(*args)
    assert done.returncode == 2
    assert message in done.stderr


# -- never hanging, and Ctrl-C, run in-process against fake replicas in a server thread -------


def test_stream_never_waits_forever_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """The failing case on the old code: no first-token or stall timeout unless asked, so a
    replica that accepts the request and never answers hung the command forever."""
    args = cli._parser().parse_args(["stream", "--replica", "http://x/v1", "--model", "m", "hi"])
    assert args.first_token_timeout == cli.DEFAULT_FIRST_TOKEN_TIMEOUT > 0
    assert args.stall_timeout == cli.DEFAULT_STALL_TIMEOUT > 0
    with pytest.raises(SystemExit):
        cli.main(["stream", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--first-token-timeout SECONDS" in help_text
    assert f"(default: {cli.DEFAULT_FIRST_TOKEN_TIMEOUT:g}; 0: wait forever)" in help_text


@pytest.mark.parametrize(
    ("behaviour", "flag", "message"),
    [
        (Behaviour(ttft=3600), "--first-token-timeout", "no first token within"),
        (Behaviour(tokens=5, stall_after=2), "--stall-timeout", "stall_timeout"),
    ],
    ids=["first-token", "stall"],
)
def test_the_timeout_flags_end_a_silent_replica(
    behaviour: Behaviour, flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with serve_in_thread(lambda: fake_replicas(behaviour)) as [server]:
        status = cli.main(
            ["stream", "--replica", server.url, "--model", "m", flag, "0.2", "--json", "hi"]
        )
    assert status == 1
    report = json.loads(capsys.readouterr().out)
    assert message in report["error"]["message"]


def _interrupt_when(condition: Callable[[], bool]) -> threading.Thread:
    """Send Ctrl-C (SIGINT) to this process once ``condition()`` holds (checked every 5 ms),
    or after 10 s if it never does (the test then fails on what it finds, instead of
    streaming on)."""

    def watch() -> None:
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def python_sigint_handler() -> Iterator[None]:
    """Python's own SIGINT handler for the test, as a terminal gives the CLI. A runner started
    in the background by a non-interactive shell inherits SIGINT ignored (POSIX), Python and
    Trio then leave it so, and a Ctrl-C sent by the test would be lost (the stream ran on)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("python_sigint_handler")
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_ctrl_c_prints_what_it_had_and_exits_130(
    as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """The failing case on the old code: Ctrl-C exited 130 and printed nothing more, the
    report (which replica, how far) was lost."""
    endless = Behaviour(token_delay=0.02, tokens=100_000)  # never ends by itself
    with serve_in_thread(lambda: fake_replicas(endless)) as [server]:
        watcher = _interrupt_when(
            lambda: bool(server.requests) and server.requests[-1].tokens_sent >= 3
        )
        args = ["stream", "--replica", server.url, "--model", "m", "hi"]
        status = cli.main([*args, "--json"] if as_json else args)
        watcher.join()
        record = server.requests[-1]
        deadline = time.monotonic() + 5
        while record.finished_at is None and time.monotonic() < deadline:
            time.sleep(0.005)  # the server thread notices the disconnect on its own
    out = capsys.readouterr()
    assert status == cli.EXIT_INTERRUPTED == 130
    assert out.err.rstrip().endswith("trio-hedge: interrupted")
    if as_json:
        report = json.loads(out.out)
        assert report["interrupted"] is True
        assert report["winner"] == 1
        text = report["text"]
    else:
        assert "winner          attempt 1" in out.err
        text = out.out
    # What it had: the first tokens the server sent, in order, none made up. (The interrupt
    # comes when the server has sent 3; the third may still be on its way to the client.)
    got = text.split()
    assert 1 <= len(got) <= record.tokens_sent
    assert got == [f"tok{i}" for i in range(len(got))]
    assert record.disconnected_at is not None  # the stream was closed: the server stopped


def test_a_key_read_from_a_file_is_refused_without_showing_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TH_FILE_KEY", "sk-from-a-file-7Hq2\n")  # `export K="$(cat f)\n"`
    args = ["stream", "--replica", "http://127.0.0.1:9/v1", "--model", "m"]
    status = cli.main([*args, "--api-key-env", "TH_FILE_KEY", "hi"])
    out = capsys.readouterr()
    assert status == 2
    assert "api_key contains a line break" in out.err
    assert "7Hq2" not in out.out + out.err
    assert "sk-from" not in out.out + out.err
