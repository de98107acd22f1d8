"""A terminal chat over hedged streams (rich): tokens render live, and each answer ends with
which replica won, the hedge delay and the time to first token (TTFT).

Run (two built-in fake replicas; the primary is slow on every other request, as if another
tenant's long prompt were ahead of it in its queue: the first answer comes from the primary,
the second from the backup the hedge sent):

    .venv/bin/python examples/chat.py          # type a message; empty line, Ctrl-D or Ctrl-C quits
    .venv/bin/python examples/chat.py --smoke  # two scripted messages, then exit (what CI runs)
    .venv/bin/python examples/chat.py --replica http://10.0.0.1:8000/v1 \\
        --replica http://10.0.0.2:8000/v1 --model my-model   # real OpenAI-compatible servers

Needs the ``examples`` extra; from a clone of the repository:
``.venv/bin/pip install -c constraints.txt -e ".[examples]"`` (once released:
``pip install "trio-hedge[examples]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import AsyncIterator

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

import trio
from rich.console import Console
from rich.live import Live
from rich.text import Text

import trio_hedge as th
from trio_hedge.testing import Behaviour, RequestRecord, fake_replicas

SMOKE_MESSAGES = ["What is a hedged request?", "Why not send every request twice?"]
ANSWER = (
    "A hedged request goes to one replica first and to a backup only if no first token "
    "arrives within the hedge delay; the first stream to produce a token wins, and the "
    "other is cancelled so its server stops."
)


def _primary(record: RequestRecord) -> Behaviour:
    # Slow on every other request: queued behind someone else's long prompt.
    slow = record.index % 2 == 1
    return Behaviour(ttft=2.0 if slow else 0.08, token_delay=0.01, tokens=ANSWER)


@contextlib.asynccontextmanager
async def _replicas(args: argparse.Namespace) -> AsyncIterator[list[th.Replica]]:
    if args.replica:
        key = os.environ.get(args.api_key_env) if args.api_key_env else None
        yield [th.Replica(url, api_key=key) for url in args.replica]
        return
    backup = Behaviour(ttft=0.1, token_delay=0.01, tokens=ANSWER)
    async with fake_replicas(_primary, backup, names=["primary", "backup"]) as fakes:
        yield [th.Replica(f.url, name=f.name) for f in fakes]


def _summary(report: th.Report) -> Text:
    if report.error is not None:
        return Text(f"failed: {report.error}", style="bold red")
    hedge = next((a for a in report.attempts if a.trigger == "hedge"), None)
    delay = (
        f"hedged after {hedge.started_at:.2f} s"
        if hedge is not None and hedge.started_at is not None
        else "not hedged"
    )
    ttft = f"{report.ttft:.2f} s" if report.ttft is not None else "-"
    return Text.assemble(
        ("winner ", "dim"),
        (f"{report.winner_replica}", "bold green" if report.winner == 1 else "bold yellow"),
        (f" (attempt {report.winner}) · {delay} · TTFT {ttft}", "dim"),
        (f" · {report.token_count} tokens in {report.total or 0:.2f} s", "dim"),
    )


async def _answer(
    hedger: th.Hedger, console: Console, history: list[dict[str, str]], model: str
) -> th.Report:
    stream = hedger.stream({"model": model, "messages": history})
    text = Text()
    try:
        with Live(text, console=console, refresh_per_second=20, transient=False):
            async with stream:
                async for token in stream:
                    text.append(token)
            text.append("\n")
    except th.HedgeError:
        pass  # the report carries the error
    report = stream.report
    history.append({"role": "assistant", "content": report.text})
    console.print(_summary(report))
    return report


async def main(args: argparse.Namespace) -> int:
    console = Console(force_terminal=None if not args.smoke else False, highlight=False)
    # "in_order": the first replica is the preferred primary, the backup is only for when it
    # is slow (your own GPUs first, a fallback provider second). The default pick, "peak_ewma",
    # would learn that the primary is sometimes slow and send the next request to the backup
    # first: here, no answer would show a hedge.
    config = th.HedgerConfig(hedge_after=args.hedge_after, pick="in_order")
    failures = 0
    reports: list[th.Report] = []
    async with _replicas(args) as replicas, th.Hedger(replicas, config) as hedger:
        names = ", ".join(r.name for r in replicas)
        console.print(f"[dim]replicas: {names}; hedge_after = {args.hedge_after} s[/dim]")
        history: list[dict[str, str]] = []
        messages = iter(SMOKE_MESSAGES) if args.smoke else None
        while True:
            if messages is not None:
                message = next(messages, "")
                if message:
                    console.print(f"[bold]you>[/bold] {message}")
            else:
                try:
                    # abandon_on_cancel: Ctrl-C need not wait for a line the user never typed.
                    message = await trio.to_thread.run_sync(
                        console.input, "[bold]you>[/bold] ", abandon_on_cancel=True
                    )
                except EOFError:
                    message = ""
            if not message.strip():
                break
            history.append({"role": "user", "content": message})
            report = await _answer(hedger, console, history, args.model)
            reports.append(report)
            failures += report.error is not None
    if args.smoke and not args.replica and not _shows_hedging(reports):
        console.print("[bold red]smoke: expected the primary, then a hedge won by the backup")
        return 1
    return 1 if failures else 0


def _shows_hedging(reports: list[th.Report]) -> bool:
    """What the smoke run promises with the fake replicas: the first answer from the primary,
    unhedged; the second (the primary slow) from the backup the hedge sent."""
    return [(r.winner_replica, r.hedged) for r in reports] == [
        ("primary", False),
        ("backup", True),
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="two scripted messages, then exit")
    parser.add_argument("--replica", action="append", help="an OpenAI-compatible base URL")
    parser.add_argument(
        "--model", default="fake-model", help="the model name (default: %(default)s)"
    )
    parser.add_argument("--api-key-env", help="environment variable holding the API key")
    parser.add_argument(
        "--hedge-after",
        type=float,
        default=0.3,
        help="hedge delay in seconds (default: %(default)s)",
    )
    return parser


def _interrupted(exc: BaseException) -> bool:
    """Ctrl-C: a ``KeyboardInterrupt``, alone or inside Trio's exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_interrupted(inner) for inner in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


def run() -> int:
    """Run the chat; Ctrl-C ends it (every stream closed on the way out) without a traceback,
    with the shell's status for an interrupt (130)."""
    try:
        return trio.run(main, _parser().parse_args())
    except BaseException as exc:
        if not _interrupted(exc):
            raise
        print("\ninterrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # The thread left in console.input() still holds stdin's lock, on which Python's
        # shutdown would abort: leave at once (trio.run has returned: every stream is closed).
        os._exit(130)


if __name__ == "__main__":
    sys.exit(run())
