"""The ``trio-hedge`` command, run as a user runs it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest


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
    out = done.stdout
    assert out.index("A hedged request") < out.index("winner          attempt 2 (backup)")
    assert "primary saw its request cancelled" in out


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
