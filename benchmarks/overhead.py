"""Cost per token over real sockets: trio_hedge against plain httpx and the openai SDK.

A minimal SSE server runs **in another process** (``benchmarks/_common.py serve``: one SSE
event per HTTP chunk, each written on its own, as LLM servers flush them), so only the
client's CPU is counted. Every client path streams the same answer (``--tokens``, default
20,000 tokens of ~230-byte OpenAI-shaped chunks) and collects the token texts:

* ``httpx aiter_lines + json``: ``client.stream`` + ``aiter_lines`` + ``json.loads`` per
  ``data:`` line, the common baseline (target reference);
* ``httpx aiter_raw + split + orjson``: a hand-tuned loop, for scale;
* ``trio_hedge (1 replica)``: ``hedged_stream`` with one replica;
* ``trio_hedge (1 replica, recovery armed)``: the same with ``max_recoveries=2`` (the
  Hedger's default): what being ready to recover costs a stream that needs none;
* ``trio_hedge Messages`` / ``Responses (1 replica)``: the Anthropic Messages and OpenAI
  Responses sources reading the same tokens as their APIs' events; the target is CPU per
  token within 10% of the chat source's (``trio_hedge (1 replica)``);
* ``trio_hedge (hedged)``: primary slow to first token (``--slow-ms``), backup fast,
  ``hedge_after`` 5 ms: the winner is the backup, the loser is cancelled;
* ``asyncio bridge (1 replica)`` / ``(hedged, backup wins)``: the same two requests made by
  asyncio code through :mod:`trio_hedge.aio` on a trio-asyncio loop; the target is at most
  15 µs of CPU per token above the Trio path reading the same stream;
* ``trio_hedge, paced 1 ms`` / ``asyncio bridge, paced 1 ms`` (**the headline**): the server
  sends ``--paced-tokens`` tokens 1 ms apart, as a model server does (10-50 ms in practice),
  so every token is a hand-over of its own and the process idles between tokens: the regime
  users have; the target is at most 15 µs of CPU per token above the Trio path;
* ``paced source, Trio`` / ``paced source, asyncio bridge``: an in-process source that
  checkpoints before every token, so every token is a hand-over but nothing idles (the
  bridge's hand-over alone);
* ``openai SDK (asyncio)``: ``AsyncOpenAI(...).chat.completions.create(stream=True)``, run in
  its own ``asyncio.run`` loop in the same process, between the Trio runs (no trio-asyncio).

Each repetition runs every path once, in that order (interleaved), each in a fresh event loop
with its client created before the clock starts. Reported per path, median over repetitions:
tokens/s from the first content token to the last (the steady streaming rate; the hedge delay
and connection setup are not a per-token cost), and CPU µs per token
(``time.process_time()`` over the whole request, setup included).

Targets: the asyncio bridge costs <= 15 CPU µs/token above the Trio path, in bursts and paced
(the paced row is printed first, as the headline); both trio_hedge
paths reach >= 0.9x the tokens/s of ``httpx aiter_lines + json`` and
beat the openai SDK.

Run: ``.venv/bin/python benchmarks/overhead.py`` (``--quick``: 2,000 tokens, 200 paced, 3
repetitions;
``--stall-timeout 30``: the trio_hedge paths under a stall timeout, whose clock is read per batch;
``--profile NAME`` prints a cProfile of one run of that path).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson
import trio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, server_process, token_text, url, verdict

import trio_hedge as th
from trio_hedge.sources.anthropic import AnthropicReplica
from trio_hedge.sources.openai_responses import ResponsesReplica
from trio_hedge.transport import shared_ssl_context

BODY: dict[str, Any] = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
}
MESSAGES_BODY: dict[str, Any] = {**BODY, "max_tokens": 1024}
RESPONSES_BODY: dict[str, Any] = {"model": "gpt-4o-mini", "input": "Tell me a long story."}


@attrs.define
class Run:
    tokens: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    cpu: float = 0.0
    text: list[str] = attrs.field(factory=list)

    def note(self, token: str) -> None:
        if not self.tokens:
            self.t_first = time.perf_counter()
        self.tokens += 1
        self.text.append(token)

    @property
    def rate(self) -> float:
        """Tokens per second from the first token to the last."""
        return (self.tokens - 1) / (self.t_end - self.t_first)

    @property
    def cpu_us(self) -> float:
        return self.cpu / self.tokens * 1e6


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=shared_ssl_context(), timeout=httpx.Timeout(30.0, read=None))


# -- the client paths (each returns one Run) -----------------------------------------------------


async def _httpx_lines(base: str) -> Run:
    run = Run()
    async with _client() as client:
        run.t_start, cpu0 = time.perf_counter(), time.process_time()
        loads = json.loads
        async with client.stream("POST", base + "/chat/completions", json=BODY) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                choices = loads(data).get("choices")
                if choices:
                    content = choices[0].get("delta", {}).get("content")
                    if content:
                        run.note(content)
        run.t_end, run.cpu = time.perf_counter(), time.process_time() - cpu0
    return run


async def _httpx_raw(base: str) -> Run:
    run = Run()
    async with _client() as client:
        run.t_start, cpu0 = time.perf_counter(), time.process_time()
        loads = orjson.loads
        buf = b""
        done = False
        async with client.stream("POST", base + "/chat/completions", json=BODY) as response:
            response.raise_for_status()
            async for chunk in response.aiter_raw():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        done = True
                        break
                    choices = loads(data).get("choices")
                    if choices:
                        content = choices[0].get("delta", {}).get("content")
                        if content:
                            run.note(content)
                if done:
                    break
        run.t_end, run.cpu = time.perf_counter(), time.process_time() - cpu0
    return run


async def _hedged(
    replicas: list[th.Replica],
    policy: th.HedgePolicy,
    winner: int,
    body: dict[str, Any] = BODY,
) -> Run:
    run = Run()
    async with _client() as client:
        run.t_start, cpu0 = time.perf_counter(), time.process_time()
        stream = th.hedged_stream(body, replicas, policy, client=client)
        async with stream:
            async for token in stream:
                run.note(token)
        run.t_end, run.cpu = time.perf_counter(), time.process_time() - cpu0
        if stream.report.winner != winner:
            raise AssertionError(f"expected attempt {winner} to win: {stream.report}")
    return run


async def _aio_hedged(
    replicas: list[th.Replica], policy: th.HedgePolicy, winner: int, body: dict[str, Any] = BODY
) -> Run:
    """The same request from asyncio code, through the bridge (trio_hedge.aio)."""
    import trio_asyncio

    from trio_hedge.aio import aio_hedged_stream

    run = Run()

    async def consume(client: httpx.AsyncClient) -> th.Report:
        stream = aio_hedged_stream(body, replicas, policy, client=client)
        async with stream:
            async for token in stream:
                run.note(token)
        return stream.report

    async with trio_asyncio.open_loop(), _client() as client:
        run.t_start, cpu0 = time.perf_counter(), time.process_time()
        report = await trio_asyncio.aio_as_trio(consume)(client)
        run.t_end, run.cpu = time.perf_counter(), time.process_time() - cpu0
    if report.winner != winner:
        raise AssertionError(f"expected attempt {winner} to win: {report}")
    return run


class _Paced:
    """``tokens`` tokens, each after a checkpoint: the consumer waits for every one."""

    def __init__(self, tokens: int) -> None:
        self._i, self._n = 0, tokens

    def __aiter__(self) -> _Paced:
        return self

    async def __anext__(self) -> str:
        await trio.lowlevel.checkpoint()
        if self._i == self._n:
            raise StopAsyncIteration
        self._i += 1
        return token_text(self._i - 1)


def _paced_source(tokens: int) -> th.sources.IteratorSource:
    return th.iterator_source(lambda info: _Paced(tokens), name="paced")


async def _paced_trio(tokens: int) -> Run:
    run = Run()
    run.t_start, cpu0 = time.perf_counter(), time.process_time()
    async with th.hedged_stream(None, [_paced_source(tokens)]) as stream:
        async for token in stream:
            run.note(token)
    run.t_end, run.cpu = time.perf_counter(), time.process_time() - cpu0
    return run


async def _paced_aio(tokens: int) -> Run:
    import trio_asyncio

    from trio_hedge.aio import aio_hedged_stream

    run = Run()

    async def consume() -> None:
        async with aio_hedged_stream(None, [_paced_source(tokens)]) as stream:
            async for token in stream:
                run.note(token)

    async with trio_asyncio.open_loop():
        run.t_start, cpu0 = time.perf_counter(), time.process_time()
        await trio_asyncio.aio_as_trio(consume)()
        run.t_end, run.cpu = time.perf_counter(), time.process_time() - cpu0
    return run


async def _openai_sdk(base: str) -> Run:
    from openai import AsyncOpenAI

    run = Run()
    client = AsyncOpenAI(base_url=base, api_key="sk-bench", max_retries=0)
    try:
        run.t_start, cpu0 = time.perf_counter(), time.process_time()
        stream = await client.chat.completions.create(
            model=BODY["model"], messages=BODY["messages"], stream=True
        )
        async for chunk in stream:
            if chunk.choices:
                content = chunk.choices[0].delta.content
                if content:
                    run.note(content)
        run.t_end, run.cpu = time.perf_counter(), time.process_time() - cpu0
    finally:
        await client.close()
    return run


@attrs.frozen
class Path_:
    name: str
    run: Callable[[], Run]
    tokens: int
    hedged: bool = False
    #: for the asyncio bridge: the Trio path reading the same stream (the µs/token target).
    trio_twin: str | None = None
    #: for another API's source: the chat source's path (CPU per token within 10% of it).
    chat_twin: str | None = None


#: The headline: the bridge at a real server's pace, every token its own hand-over.
HEADLINE = "asyncio bridge, paced 1 ms"


def _paths(
    port: int, tokens: int, slow_ms: int, paced_tokens: int, stall: float | None = None
) -> list[Path_]:
    fast = url(port, tokens=tokens)
    slow = url(port, delay_ms=slow_ms, tokens=tokens)
    one = [th.Replica(fast, name="fast")]
    pair = [th.Replica(slow, name="slow"), th.Replica(fast, name="fast")]
    # The server paces these tokens 1 ms apart (``x_pace_ms``), as a model server sends them.
    paced = [th.Replica(f"http://127.0.0.1:{port}/d0/v1", name="paced")]
    paced_body = {**BODY, "max_tokens": paced_tokens, "x_pace_ms": 1}
    no_hedge = th.HedgePolicy(hedge_after=None, stall_timeout=stall)
    hedge_5ms = th.HedgePolicy(hedge_after=0.005, stall_timeout=stall)
    recovery_armed = th.HedgePolicy(hedge_after=None, stall_timeout=stall, max_recoveries=2)

    def in_trio(fn: Callable[..., Awaitable[Run]], *args: Any) -> Callable[[], Run]:
        return lambda: trio.run(fn, *args)

    return [
        Path_("httpx aiter_lines + json", in_trio(_httpx_lines, fast), tokens),
        Path_("httpx aiter_raw + split + orjson", in_trio(_httpx_raw, fast), tokens),
        Path_("trio_hedge (1 replica)", in_trio(_hedged, one, no_hedge, 1), tokens, hedged=True),
        Path_(
            "trio_hedge (1 replica, recovery armed)",
            in_trio(_hedged, one, recovery_armed, 1),
            tokens,
            hedged=True,
        ),
        Path_(
            "trio_hedge (hedged, backup wins)",
            in_trio(_hedged, pair, hedge_5ms, 2),
            tokens,
            hedged=True,
        ),
        *(
            Path_(
                f"trio_hedge {api} (1 replica)",
                in_trio(_hedged, [kind(fast, name="fast")], no_hedge, 1, body),
                tokens,
                chat_twin="trio_hedge (1 replica)",
            )
            for api, kind, body in (
                ("Messages", AnthropicReplica, MESSAGES_BODY),
                ("Responses", ResponsesReplica, RESPONSES_BODY),
            )
        ),
        Path_(
            "asyncio bridge (1 replica)",
            in_trio(_aio_hedged, one, no_hedge, 1),
            tokens,
            trio_twin="trio_hedge (1 replica)",
        ),
        Path_(
            "asyncio bridge (hedged, backup wins)",
            in_trio(_aio_hedged, pair, hedge_5ms, 2),
            tokens,
            trio_twin="trio_hedge (hedged, backup wins)",
        ),
        Path_("paced source, Trio", in_trio(_paced_trio, tokens), tokens),
        Path_(
            "paced source, asyncio bridge",
            in_trio(_paced_aio, tokens),
            tokens,
            trio_twin="paced source, Trio",
        ),
        Path_(
            "trio_hedge, paced 1 ms",
            in_trio(_hedged, paced, no_hedge, 1, paced_body),
            paced_tokens,
        ),
        Path_(
            HEADLINE,
            in_trio(_aio_hedged, paced, no_hedge, 1, paced_body),
            paced_tokens,
            trio_twin="trio_hedge, paced 1 ms",
        ),
        Path_("openai SDK (asyncio.run)", lambda: asyncio.run(_openai_sdk(fast)), tokens),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--slow-ms", type=int, default=1000, help="the slow primary's TTFT")
    parser.add_argument(
        "--paced-tokens", type=int, default=2_000, help="tokens of the paced (1 ms) rows"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke check: 2,000 tokens (200 paced), 3 reps"
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        metavar="SECONDS",
        help="give the trio_hedge paths a stall timeout (its clock is read per batch; default "
        "none: the winner is read with no timeout at all)",
    )
    parser.add_argument(
        "--profile",
        metavar="NAME",
        help="cProfile one run of the path whose name starts with NAME (e.g. 'trio_hedge (1')",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.paced_tokens, args.repeat = 2_000, 200, 3
    console = Console(width=150)
    console.print(
        f"overhead: tokens={args.tokens:,} paced_tokens={args.paced_tokens:,} "
        f"repeat={args.repeat} slow_ms={args.slow_ms} stall_timeout={args.stall_timeout} "
        f"nproc={os.cpu_count()} python={sys.version.split()[0]} trio={trio.__version__} "
        f"httpx={httpx.__version__}"
    )
    with server_process() as port:
        paths = _paths(port, args.tokens, args.slow_ms, args.paced_tokens, args.stall_timeout)
        for p in paths:  # warm-up: imports, first connections, caches
            p.run()
        if args.profile:
            (p,) = [p for p in paths if p.name.startswith(args.profile)]
            profiler = cProfile.Profile()
            profiler.enable()
            p.run()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            return 0
        runs: dict[str, list[Run]] = {p.name: [] for p in paths}
        for _ in range(args.repeat):
            for p in paths:
                run = p.run()
                if run.text != [token_text(i) for i in range(p.tokens)]:
                    raise AssertionError(f"{p.name}: wrong text ({run.tokens} tokens)")
                runs[p.name].append(run)

    rates = {name: median([r.rate for r in rs]) for name, rs in runs.items()}
    cpus = {name: median([r.cpu_us for r in rs]) for name, rs in runs.items()}
    base = "httpx aiter_lines + json"
    sdk = "openai SDK (asyncio.run)"
    table = Table(title=f"cost per token, {args.tokens:,} tokens, median of {args.repeat}")
    for column in ("client path", "tokens/s", "× baseline", "CPU µs/token", "runs tokens/s"):
        table.add_column(column, justify="left" if column == "client path" else "right")
    for name, rs in runs.items():
        table.add_row(
            name,
            f"{rates[name]:,.0f}",
            f"{rates[name] / rates[base]:.2f}",
            f"{cpus[name]:.1f}",
            " ".join(f"{r.rate / 1000:.0f}k" for r in rs),
        )
    console.print(table)

    def over_trio(p: Path_) -> str:
        assert p.trio_twin is not None
        extra = cpus[p.name] - cpus[p.trio_twin]
        return verdict(extra <= 15.0, f"{p.name}: {extra:+.1f} CPU µs/token over Trio (<= 15)")

    (headline,) = [p for p in paths if p.name == HEADLINE]
    console.print(f"[bold]headline[/bold] (a real server's pace): {over_trio(headline)}")
    for p in paths:
        if p.trio_twin is not None and p is not headline:
            console.print(over_trio(p))
        if p.chat_twin is not None:
            ratio = cpus[p.name] / cpus[p.chat_twin]
            console.print(
                verdict(
                    ratio <= 1.1, f"{p.name}: {ratio:.2f}x the chat source's CPU µs/token (<= 1.1)"
                )
            )
        if p.hedged:
            ratio = rates[p.name] / rates[base]
            console.print(
                verdict(ratio >= 0.9, f"{p.name}: {ratio:.2f}x baseline tokens/s (>= 0.9)")
            )
            console.print(
                verdict(
                    rates[p.name] > rates[sdk],
                    f"{p.name}: {rates[p.name]:,.0f} tokens/s vs openai SDK {rates[sdk]:,.0f}",
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
