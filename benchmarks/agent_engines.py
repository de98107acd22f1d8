"""The agent APIs hedged on real engines: Anthropic Messages and OpenAI Responses (and chat
completions, for comparison) raced across two llama-server or vLLM replicas (issue 18).

What it runs. Two replicas of one engine of ``../shared/engine2/`` (llama.cpp's C++
``llama-server`` with ``-np 4``, or vLLM 0.32 on CPU; the tiny random-weight model, model name
``tiny``), started with that directory's start scripts on free loopback ports and stopped on
exit. ``--engine llama|vllm`` chooses (default: llama-server if built, else vLLM). Without
the engine it prints ``SKIP: …`` and exits 0 (CI builds neither); ``--quick`` without an
engine runs against two ``trio_hedge.testing.FakeReplica`` servers instead, which queue
prompts like an engine (a prompt waits for the ones sent before it: ~1,500 words/s), so the
code path is exercised. ``--replica URL`` (twice) runs against any two servers that speak
the APIs (the engine is recognised by ``/slots`` or ``/metrics``).

The schedule is ``benchmarks/real_engine.py``'s (seeded, the same for every API and
strategy): Poisson arrivals, short prompts of 20-80 words (one word = one token) and
``--long-fraction`` long prompts of ``--long-words`` words sent by **another tenant**: a
plain httpx client, over the same API, straight to a random replica, unseen by the library.
Per API, on idle replicas each time:

* no hedging: one attempt to a random (seeded) replica;
* the ``Hedger`` with its defaults over ``AnthropicReplica`` / ``ResponsesReplica`` /
  ``Replica`` pairs (cold: it starts knowing nothing, the warm part is reported apart);
* double send: ``hedge_after=0``, both replicas at once, the first token wins.

Reported per API and strategy: the library's short-request TTFT P50/P99/max over all of them
(cold start included) and over the warm part (from the ``--warm-from``-th request of the
schedule on), extra requests, hedges with the primary's replica busy with a long prompt /
idle, the library's own long prompts hedged (``--tenants self``), and **whether the losers
were cancelled at the engine**: the losers the library cancelled, and from the engine's own
counters (``/metrics``: llama-server's ``llamacpp:tokens_predicted_total``, vLLM's
``vllm:generation_tokens_total`` and ``vllm:request_success_total``) the tokens generated
beyond the ones the callers read (every answer is ``max_tokens`` long: the tiny model never
stops early), i.e. the loser's wasted tokens; a loser run to its end would add
``max_tokens``. The fakes count what they sent and which requests saw their client go.

Run: ``python benchmarks/agent_engines.py --engine llama`` (40 requests per API and strategy,
~8 minutes), ``--apis messages,responses`` to leave chat out, ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from rich.console import Console
from rich.table import Table

import trio_hedge as th
from trio_hedge.sources.anthropic import AnthropicReplica
from trio_hedge.sources.openai_responses import ResponsesReplica
from trio_hedge.testing import Behaviour, FakeReplica, RequestRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import percentile
from _engines import Counters, Engine, detect, missing, started
from real_engine import (
    MakeBody,
    Outcome,
    Params,
    Send,
    body,
    chat_text,
    cpu_seconds,
    fixed,
    hedger_send,
    make_schedule,
    run_schedule,
    summarize,
    tenant,
    texts,
)

# -- the APIs -----------------------------------------------------------------------------------


def messages_body(p: Params, model: str, text: str) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": p.max_tokens,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0.0,
    }


def responses_body(p: Params, model: str, text: str) -> dict[str, Any]:
    # store: false: nothing is stored per attempt, so no loser's response needs deleting.
    return {
        "model": model,
        "input": text,
        "max_output_tokens": p.max_tokens,
        "temperature": 0.0,
        "store": False,
    }


def messages_text(event: dict[str, Any]) -> bool:
    delta = event.get("delta")
    return event.get("type") == "content_block_delta" and bool(
        type(delta) is dict and delta.get("text")
    )


def responses_text(event: dict[str, Any]) -> bool:
    return event.get("type") == "response.output_text.delta" and bool(event.get("delta"))


@attrs.frozen
class Api:
    """One API: its replica class, its body, where it posts and which events carry text."""

    name: str
    replica: type[th.Replica]
    make_body: MakeBody
    path: str
    has_text: Callable[[dict[str, Any]], bool]


APIS = {
    "messages": Api("messages", AnthropicReplica, messages_body, "/messages", messages_text),
    "responses": Api("responses", ResponsesReplica, responses_body, "/responses", responses_text),
    "chat": Api("chat", th.Replica, body, "/chat/completions", chat_text),
}

NONE, HEDGER, DOUBLE = "no hedging", "Hedger (defaults)", "double send"
STRATEGIES = {"none": NONE, "hedger": HEDGER, "double": DOUBLE}


# -- the engines --------------------------------------------------------------------------------


# -- the fake engine (--quick without an engine) ------------------------------------------------


def _words(body: Any) -> int:
    if not isinstance(body, dict):
        return 0
    given = body.get("input")
    text = given if isinstance(given, str) else ""
    for message in body.get("messages") or ():
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            text += " " + message["content"]
    return len(text.split())


@attrs.define
class FakePrefill:
    """A fake replica's prefill queue: a prompt's first token comes once every prompt sent
    before it has been prefilled at ``rate`` words per second (a cancelled one included, as
    a real engine that had already started it)."""

    rate: float = 1_500.0
    free_at: float = 0.0

    def __call__(self, record: RequestRecord) -> Behaviour:
        now = trio.current_time()
        body = record.json if isinstance(record.json, dict) else {}
        self.free_at = max(now, self.free_at) + _words(body) / self.rate
        tokens = body.get("max_tokens") or body.get("max_output_tokens") or 8
        return Behaviour(ttft=self.free_at - now + 0.003, tokens=int(tokens), token_delay=0.002)


@asynccontextmanager
async def fake_engine() -> AsyncIterator[Engine]:
    async with (
        FakeReplica(FakePrefill(), name="fake0") as a,
        FakeReplica(FakePrefill(), name="fake1") as b,
    ):
        yield Engine("fake", [a.url, b.url], fakes=[a, b])


# -- measuring ----------------------------------------------------------------------------------


@attrs.frozen
class AgentRow:
    api: str
    name: str
    ttft: tuple[float, float, float]  # P50, P99, max over short requests, cold start included
    warm: tuple[float, float, float]  # the same from the warm-from-th request on
    short: tuple[int, int]  # (all, warm) short requests
    extra: float  # %
    errors: int
    hedged_busy: tuple[int, int]
    hedged_idle: tuple[int, int]
    long_hedged: tuple[int, int]
    losers: tuple[int, int, int]  # (cancelled by the library, failed on their own, all)
    wasted: float | None  # engine tokens generated beyond the ones the callers read
    finished_extra: float | None  # requests the engine ran to their end beyond the callers'
    server_cpu: float | None
    load: float


def _stats(values: Sequence[float]) -> tuple[float, float, float]:
    if not values:
        return (math.nan, math.nan, math.nan)
    return (percentile(values, 50), percentile(values, 99), max(values))


def measure(
    api: str, name: str, outcomes: Sequence[Outcome], p: Params, warm_from: int,
    before: Counters, after: Counters, cpu: float | None,
) -> AgentRow:  # fmt: skip
    row = summarize(name, outcomes, cpu)
    short = [o for o in outcomes if not o.item.tenant and not o.item.long]
    ttfts = [o.ttft if o.ttft is not None else math.inf for o in short]
    warm = [t for o, t in zip(short, ttfts, strict=True) if o.item.index >= warm_from]
    read = [o for o in outcomes if o.error is None]  # every answer is max_tokens long
    wasted = finished = None
    if after.generated is not None and before.generated is not None:
        wasted = after.generated - before.generated - len(read) * p.max_tokens
    if after.finished is not None and before.finished is not None:
        finished = after.finished - before.finished - len(read)
    return AgentRow(
        api=api,
        name=name,
        ttft=_stats(ttfts),
        warm=_stats(warm),
        short=(len(ttfts), len(warm)),
        extra=row.extra,
        errors=row.errors,
        hedged_busy=row.hedged_busy,
        hedged_idle=row.hedged_idle,
        long_hedged=row.long_hedged,
        losers=(
            sum(o.cancelled for o in outcomes),
            sum(o.failed for o in outcomes if o.error is None),
            sum(o.attempts - 1 for o in outcomes),
        ),
        wasted=wasted,
        finished_extra=finished,
        server_cpu=cpu,
        load=row.load,
    )


async def run_api(
    api: Api, engine: Engine, client: httpx.AsyncClient, p: Params, model: str,
    names: Sequence[str], warm_from: int, number: int, console: Console,
) -> list[AgentRow]:  # fmt: skip
    schedule = make_schedule(p, p.requests, p.seed)
    replicas = [api.replica(url, name=f"r{i}") for i, url in enumerate(engine.urls)]
    send_tenant = partial(_tenant, api, p, model)
    rows = []
    for k, name in enumerate(names):
        # Fresh words per API and strategy: engines reuse the KV cache of a repeated prefix.
        prompts = texts(schedule, p.seed * 1000 + 10 * number + k)
        send: Send
        hedger = None
        if name == HEDGER:
            config = th.HedgerConfig(first_token_timeout=120.0)
            hedger = th.Hedger(replicas, config, client=client)
            send = hedger_send(hedger, p, model, prompts, api.make_body)
        else:
            delay = None if name == NONE else 0.0
            send = fixed(replicas, client, p, model, delay, prompts, api.make_body)
        await engine.wait_idle(client, model)
        before = await engine.counters(client)
        cpu_before = cpu_seconds(engine.pids) if engine.pids else None
        began = time.monotonic()
        outcomes = await run_schedule(
            schedule, send, client, engine.urls, p, model, prompts, send_tenant
        )
        await engine.wait_idle(client, model)
        cpu_after = cpu_seconds(engine.pids) if engine.pids else None
        after = await engine.counters(client)
        cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
        row = measure(api.name, name, outcomes, p, warm_from, before, after, cpu)
        rows.append(row)
        for o in outcomes:  # a loser not cancelled, or an error: show its attempts
            if o.error is not None or o.cancelled + o.failed != o.attempts - 1 or o.failed:
                console.print(f"    #{o.item.index} {o.error or ''} attempts: {o.trace}")
        console.print(
            f"  {api.name} / {name}: {time.monotonic() - began:.0f} s, P99 {row.ttft[1]:.3f} s"
            f", extra {row.extra:.1f}%, losers cancelled {_losers(row.losers)}, "
            f"wasted tokens {_opt(row.wasted)}, load {row.load:.2f}" + _delays(hedger)
        )
    return rows


async def _tenant(
    api: Api, p: Params, model: str, client: httpx.AsyncClient, url: str, item: Any, text: str
) -> Outcome:
    return await tenant(client, url, p, model, item, text, api.make_body, api.path, api.has_text)


def _delays(hedger: th.Hedger | None) -> str:
    """The hedge delays the Hedger ended with, per prompt-size class."""
    if hedger is None:
        return ""
    delays = ", ".join(
        f"class {d.size_class}: {d.delay:.3f} s{'' if d.learned else ' (model)'}"
        for d in hedger.statistics().delays
    )
    return f"; delays {delays}"


def _losers(losers: tuple[int, int, int]) -> str:
    cancelled, failed, total = losers
    return f"{cancelled} of {total}" + (f" ({failed} failed)" if failed else "")


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def print_table(console: Console, rows: Sequence[AgentRow], p: Params, engine: str) -> None:
    table = Table(
        title=f"Short-request TTFT per API on two {engine} replicas ({p.requests} requests at "
        f"{p.rate:g}/s, {p.long_fraction:.0%} long prompts of {p.long_words} words from "
        f"{'another tenant' if p.tenants == 'others' else 'this client'})"
    )
    table.add_column("API")
    table.add_column("strategy", no_wrap=True)
    for column in ("TTFT P50 / P99 / max (s)", "warm P50 / P99 / max (s)"):
        table.add_column(column, justify="right", no_wrap=True)
    for column in ("extra", "hedged | busy", "hedged | idle", "long hedged", "losers cancelled",
                   "wasted tokens", "losers run to end", "server CPU (s)", "load"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r.api,
            r.name.removesuffix(" (defaults)") + (f" ({r.errors} errors)" if r.errors else ""),
            " / ".join(f"{v:.3f}" for v in r.ttft),
            " / ".join(f"{v:.3f}" for v in r.warm),
            f"{r.extra:.1f}%",
            f"{r.hedged_busy[0]} of {r.hedged_busy[1]}",
            f"{r.hedged_idle[0]} of {r.hedged_idle[1]}",
            f"{r.long_hedged[0]} of {r.long_hedged[1]}",
            _losers(r.losers),
            _opt(r.wasted),
            _opt(r.finished_extra),
            "-" if r.server_cpu is None else f"{r.server_cpu:.1f}",
            f"{r.load:.2f}",
        )
    console.print(table)


def check(console: Console, rows: Sequence[AgentRow], p: Params) -> bool:
    """Every loser cancelled: the library cancelled each, and the engine ran none to its
    end (no more wasted tokens than a loser could make before the winner's first token, at
    most ``max_tokens - 1`` each)."""
    ok = True
    for r in rows:
        cancelled, failed, total = r.losers
        checks = [
            (
                f"{_losers(r.losers)} losers cancelled (a loser that failed on its own before "
                "the commit has nothing to cancel)",
                cancelled + failed == total,
            )
        ]
        if r.finished_extra is not None:
            checks.append((f"{r.finished_extra:g} losers run to the end", r.finished_extra <= 0))
        if r.wasted is not None:
            bound = total * (p.max_tokens - 1)
            checks.append((f"{r.wasted:g} wasted tokens <= {bound}", r.wasted <= bound))
        for text, good in checks:
            ok &= good
            mark = "[green]PASS[/]" if good else "[red]FAIL[/]"
            console.print(f"{mark} {r.api} / {r.name}: {text}")
    return ok


# -- main ---------------------------------------------------------------------------------------


async def run_all(
    engine: Engine | None, p: Params, model: str, apis: Sequence[Api], names: Sequence[str],
    warm_from: int, console: Console,
) -> tuple[str, list[AgentRow]]:  # fmt: skip
    rows: list[AgentRow] = []
    async with (
        fake_engine() if engine is None else _given(engine) as running,
        th.transport.make_client() as client,
    ):
        for number, api in enumerate(apis):
            rows += await run_api(api, running, client, p, model, names, warm_from, number,
                                  console)  # fmt: skip
        return running.kind, rows


@asynccontextmanager
async def _given(engine: Engine) -> AsyncIterator[Engine]:
    yield engine


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--engine", choices=("auto", "llama", "vllm", "fake"), default="auto")
    parser.add_argument("--replica", action="append", metavar="URL", help="use these servers")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--apis", default="messages,responses,chat")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--long-words", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--warm-from",
        type=int,
        default=20,  # the learned delay's min_samples: the Hedger is warm from there
        metavar="N",
        help="the warm part: short requests from the N-th of the schedule on",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tenants", choices=("others", "self"), default="others")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run (on the fakes when no engine is given)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the engines
    console = Console(width=200)
    apis = [APIS[a.strip()] for a in args.apis.split(",") if a.strip()]
    names = [STRATEGIES[s.strip()] for s in args.strategies.split(",") if s.strip()]
    kind = args.engine
    if args.replica is None and kind == "auto":
        kind = "fake" if args.quick else ("llama" if missing("llama") is None else "vllm")
    fake = args.replica is None and kind == "fake"
    p = Params(
        requests=(20 if fake else 16) if args.quick else args.requests,
        rate=10.0 if fake else args.rate,
        long_fraction=0.15 if fake else args.long_fraction,
        long_words=2000 if fake else args.long_words,
        max_tokens=8 if fake else args.max_tokens,
        warmup=0,
        seed=args.seed,
        tenants=args.tenants,
    )
    warm_from = min(args.warm_from, p.requests // 2)
    console.print(
        f"parameters: {attrs.asdict(p)}; warm from request {warm_from}; load average "
        f"{os.getloadavg()}, nproc {os.cpu_count()}"
    )
    run = partial(run_all, p=p, model=args.model, apis=apis, names=names,
                  warm_from=warm_from, console=console)  # fmt: skip
    if args.replica:
        if len(args.replica) != 2:
            console.print("give --replica exactly twice (two replicas)")
            return 2
        engine_kind, rows = trio.run(partial(run, Engine(detect(args.replica), args.replica)))
    elif fake:
        console.print("no engine: two trio_hedge.testing fakes that queue prompts (--quick)")
        engine_kind, rows = trio.run(partial(run, None))
    else:
        why = missing(kind)
        if why is not None:
            console.print(f"SKIP: {why}, and no --replica URL given: nothing to measure.")
            return 0
        with started(kind, console) as engine:
            engine_kind, rows = trio.run(partial(run, engine))
    label = {"llama": "llama-server", "vllm": "vLLM CPU", "fake": "fake"}.get(engine_kind, "")
    print_table(console, rows, p, label)
    return 0 if check(console, rows, p) else 1


if __name__ == "__main__":
    sys.exit(main())
