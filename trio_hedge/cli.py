"""The ``trio-hedge`` command: ``demo`` (no set-up), ``stream`` (any OpenAI-compatible servers)
and ``tune`` (choose the policy from a TTFT log: [`trio_hedge.tune`][trio_hedge.tune]).

Exit status: 0 on success, 1 when the request failed (the error is printed, and included in
``--json`` output), 2 on bad usage, 130 when interrupted (Ctrl-C: what arrived so far, the
report and "interrupted" are printed first).

``stream`` never waits forever: by default it gives up without a first token after
[`DEFAULT_FIRST_TOKEN_TIMEOUT`][trio_hedge.cli.DEFAULT_FIRST_TOKEN_TIMEOUT] seconds, and after the
first token when the stream goes quiet for
[`DEFAULT_STALL_TIMEOUT`][trio_hedge.cli.DEFAULT_STALL_TIMEOUT] seconds (``0`` turns either off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import attrs
import trio

from . import __version__, tune
from ._oneshot import hedged_stream
from ._stream import HedgedStream
from .errors import HedgeError
from .policy._config import HedgePolicy
from .report import Report
from .sources.openai._http import Replica

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["DEFAULT_FIRST_TOKEN_TIMEOUT", "DEFAULT_STALL_TIMEOUT", "main"]

DEFAULT_FIRST_TOKEN_TIMEOUT = 120.0
"""Seconds ``stream`` waits for a first token, over all attempts, before giving up."""
DEFAULT_STALL_TIMEOUT = 60.0
"""Seconds ``stream`` lets the winner go without content after its first token."""
#: Exit status after Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130

DEMO_PROMPT = "Why does hedging cut the tail latency of LLM calls?"
DEMO_ANSWER = (
    "A hedged request sends a backup only when the primary is slow to produce its first "
    "token, so the tail shrinks while the extra load stays small. The first stream to "
    "produce a token wins and the loser is cancelled at once."
)


def _format_seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def format_report(report: Report) -> str:
    """A human-readable, multi-line summary of ``report`` (no credentials in it). A failed
    request leads with its error; a request that never committed shows only what it has."""
    lines: list[str] = []
    if report.error is not None:
        lines.append(f"error           {type(report.error).__name__}: {report.error}")
    lines.append(f"request id      {report.request_id}")
    if report.winner is not None:
        lines += [
            f"winner          attempt {report.winner} ({report.winner_replica})",
            f"hedged          {'yes' if report.hedged else 'no'}",
            f"caller TTFT     {_format_seconds(report.ttft)}",
            f"total           {_format_seconds(report.total)}",
            f"tokens          {report.token_count}",
            f"mean TPOT       {_format_seconds(report.tpot_mean)}",
            f"max token gap   {_format_seconds(report.max_gap)}",
            f"wasted tokens   {report.wasted_tokens}",
        ]
    else:
        lines.append(f"total           {_format_seconds(report.total)}")
    lines.append("attempts:")
    for a in report.attempts:
        detail = f"TTFT {_format_seconds(a.ttft)}" if a.ttft is not None else ""
        if a.error is not None:
            detail = f"error {a.error}"
        lines.append(
            f"  #{a.number} {a.replica:<22} {a.trigger:<8} start {a.started_at:.3f} s"
            f"  {a.outcome.value:<10} {detail}"
        )
    return "\n".join(lines)


@attrs.define
class _Progress:
    """What a run had when it was interrupted (filled in inside Trio, read after it)."""

    report: Report | None = None


async def _run_stream(
    stream: HedgedStream, *, live: TextIO | None, progress: _Progress | None = None
) -> Report:
    """Stream to ``live`` (if given) and return the report; a HedgeError is recorded in it.
    On any other exception (Ctrl-C), the report so far goes to ``progress`` first."""
    try:
        async with stream:
            async for token in stream:
                if live is not None:
                    live.write(token)
                    live.flush()
    except HedgeError:
        pass
    except BaseException:
        if progress is not None:
            progress.report = stream.report  # the stream is closed: its report is final
        raise
    if live is not None:
        live.write("\n")
    return stream.report


async def _demo(as_json: bool, out: TextIO, err: TextIO) -> int:
    from .testing import Behaviour, FakeReplica  # only the demo needs them

    words = tuple(w + " " for w in DEMO_ANSWER.split())
    policy = HedgePolicy(hedge_after=1.0)
    async with (
        FakeReplica(Behaviour(ttft=5.0, token_delay=0.02, tokens=words), name="primary") as slow,
        FakeReplica(Behaviour(ttft=0.5, token_delay=0.02, tokens=words), name="backup") as fast,
    ):
        replicas = [Replica(slow.url, name="primary"), Replica(fast.url, name="backup")]
        request = {"model": "demo", "messages": [{"role": "user", "content": DEMO_PROMPT}]}
        if not as_json:
            err.write(
                f"primary {slow.url} answers after 5.0 s; backup {fast.url} after 0.5 s; "
                f"hedge_after = {policy.hedge_after} s\n\n"
            )
        stream = hedged_stream(request, replicas, policy)
        report = await _run_stream(stream, live=None if as_json else out)
        # Let the primary's server notice the disconnect it was sent at commit.
        with trio.move_on_after(1.0):
            await slow.wait_disconnected(0)
        seen = slow.requests[0].disconnected_at if slow.requests else None
        cancel_seen = None if seen is None else seen - stream.started_at
    if as_json:
        payload = report.to_dict()
        payload["primary_saw_cancel_at"] = cancel_seen
        out.write(json.dumps(payload, indent=2) + "\n")
    else:
        # As in ``stream``: the answer on stdout, the report on stderr.
        err.write(format_report(report) + "\n")
        if cancel_seen is not None and report.ttft is not None:
            err.write(
                f"primary saw its request cancelled at {cancel_seen:.3f} s "
                f"({(cancel_seen - report.ttft) * 1000:.1f} ms after commit)\n"
            )
    return 0 if report.error is None else 1


def _seconds_or_off(value: float) -> float | None:
    return None if value == 0 else value


async def _stream(args: argparse.Namespace, out: TextIO, progress: _Progress) -> int:
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if api_key is None:
            sys.stderr.write(f"trio-hedge: environment variable {args.api_key_env} is not set\n")
            return 2
    replicas = [Replica(url, api_key=api_key) for url in args.replica]
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    request: dict[str, Any] = {"model": args.model, "messages": messages}
    if args.max_tokens is not None:
        request["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        request["temperature"] = args.temperature
    policy = HedgePolicy(
        hedge_after=args.hedge_after,
        first_token_timeout=_seconds_or_off(args.first_token_timeout),
        stall_timeout=_seconds_or_off(args.stall_timeout),
    )
    report = await _run_stream(
        hedged_stream(request, replicas, policy),
        live=None if args.json else out,
        progress=progress,
    )
    if args.json:
        out.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        sys.stderr.write(format_report(report) + "\n")
    return 0 if report.error is None else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-hedge",
        description="First-token hedged streaming for LLM calls: send a request to a primary "
        "replica, send a backup when no first token arrives within the hedge delay, relay the "
        "first stream to produce a token and cancel the others. Durations are in seconds.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="race a slow primary and a fast backup on two local fake replicas",
        description="Start two fake replicas on loopback (the primary answers after 5 s, the "
        "backup after 0.5 s), hedge after 1 s, stream the backup's answer to stdout and the "
        "report to stderr. Needs nothing installed beyond trio-hedge.",
    )
    demo.add_argument("--json", action="store_true", help="print the report as one JSON object")
    stream = sub.add_parser(
        "stream",
        help="stream one prompt from OpenAI-compatible replicas",
        description="Stream one chat completion, hedged over the replicas given (primary "
        "first): the answer goes to stdout as it arrives, the report to stderr (or one JSON "
        "object with --json). Exit status: 0 answered, 1 failed, 2 bad usage, 130 Ctrl-C.",
    )
    stream.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="base URL, e.g. http://127.0.0.1:8000/v1 (repeat: primary first)",
    )
    stream.add_argument("--model", required=True, help="the request's model")
    stream.add_argument(
        "--hedge-after",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="send a backup when no first token came within SECONDS (default: 1.0)",
    )
    stream.add_argument(
        "--first-token-timeout",
        type=float,
        default=DEFAULT_FIRST_TOKEN_TIMEOUT,
        metavar="SECONDS",
        help="give up when no first token came within SECONDS, over all attempts "
        f"(default: {DEFAULT_FIRST_TOKEN_TIMEOUT:g}; 0: wait forever)",
    )
    stream.add_argument(
        "--stall-timeout",
        type=float,
        default=DEFAULT_STALL_TIMEOUT,
        metavar="SECONDS",
        help="after the first token, give up when the answer goes quiet for SECONDS "
        f"(default: {DEFAULT_STALL_TIMEOUT:g}; 0: wait forever)",
    )
    stream.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="the answer's length limit, in tokens (default: the server's)",
    )
    stream.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default: the server's)",
    )
    stream.add_argument("--system", default=None, help="a system message (default: none)")
    stream.add_argument(
        "--api-key-env",
        default=None,
        metavar="VAR",
        help="name of the environment variable holding the API key (never printed)",
    )
    stream.add_argument("--json", action="store_true", help="print the report as one JSON object")
    stream.add_argument("prompt", help="the user message to send (quote it in the shell)")
    from .gateway._cli import add_commands  # serve, fake: the gateway's own glue

    add_commands(sub)
    tune.add_parser(sub)
    return parser


def _is_interrupt(exc: BaseException) -> bool:
    """Ctrl-C, alone or inside an exception group (raised in one of the race's tasks)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(KeyboardInterrupt)[0] is not None
    return False


def _interrupted(progress: _Progress, as_json: bool, out: TextIO) -> int:
    """Print what the interrupted run had: the partial answer (already streamed in text
    mode; in the report's ``text`` with ``--json``), the report, and "interrupted"."""
    report = progress.report
    if as_json:
        payload: dict[str, Any] = report.to_dict() if report is not None else {}
        payload["interrupted"] = True
        out.write(json.dumps(payload, indent=2) + "\n")
    else:
        out.write("\n")
        if report is not None:
            sys.stderr.write(format_report(report) + "\n")
    out.flush()
    sys.stderr.write("trio-hedge: interrupted\n")
    return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``trio-hedge`` and ``python -m trio_hedge``."""
    args = _parser().parse_args(argv)
    out = sys.stdout
    if args.command in ("serve", "fake"):
        # What a --workers supervisor starts each worker with (the flags as given).
        args.argv = list(sys.argv[1:] if argv is None else argv)
        from .gateway._cli import run

        return run(args)
    progress = _Progress()
    try:
        if args.command == "demo":
            return trio.run(_demo, args.json, out, sys.stderr)
        if args.command == "tune":
            return tune.run(args, out)
        return trio.run(_stream, args, out, progress)
    except (ValueError, TypeError) as exc:
        sys.stderr.write(f"trio-hedge: {exc}\n")
        return 2
    except BaseException as exc:
        if not _is_interrupt(exc):
            raise
        return _interrupted(progress, args.json, out)
