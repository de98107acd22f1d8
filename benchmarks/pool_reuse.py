"""Connection reuse at low load after a burst, and throughput at high load, through
``trio_hedge.transport.make_client()`` (issue 16).

Against the out-of-process SSE server of ``benchmarks/_common.py`` (its CPU is not the
client's), one ``make_client()`` (keep-alive expiry 1 s, so the run is short):

1. **Burst, then low load.** ``--burst`` hedged streams (default 400) at once, each read to
   the end; a pause longer than the keep-alive expiry; then 15 sequential requests, 0.1 s
   apart. Printed: the TCP connections those 15 opened (httpcore's ``trace`` extension
   counts ``connect_tcp``) and the pools left. With pools used in strict rotation each
   request went to another pool, whose connections had expired: 15 connections; the oldest
   pool with room takes every request: 1.
2. **High load.** ``--streams`` hedged streams (default 1,000) at once, each held until all
   have their first token, then read to the end, ``--repeat`` times on the same client:
   seconds to open all (last first token - start), client CPU seconds for it, the P50/P99
   caller-visible TTFT, and the connections each wave opened.

Run: ``python benchmarks/pool_reuse.py`` (``--quick``: a burst of 100, 100 streams, one
repetition).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import percentile, server_process, url

import trio_hedge as th
from trio_hedge.transport import ShardedTransport, make_client

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
EXPIRY = 1.0  # seconds a connection stays idle in its pool
TEXT = "The quick brown fox"


class _Connects:
    """Counts the TCP connections the client opens (httpcore's ``trace`` extension)."""

    def __init__(self) -> None:
        self.count = 0

    async def trace(self, event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            self.count += 1

    async def hook(self, request: httpx.Request) -> None:
        request.extensions["trace"] = self.trace


async def _one(client: httpx.AsyncClient, base: str) -> float:
    """One hedged request read to its end; its caller-visible TTFT."""
    replicas = [th.Replica(base, name="a"), th.Replica(base, name="b")]
    async with th.hedged_stream(
        BODY, replicas, th.HedgePolicy(hedge_after=30.0), client=client
    ) as s:
        text = "".join([t async for t in s])
    if text != TEXT:
        raise AssertionError(f"wrong text {text!r}")
    assert s.report.ttft is not None
    return s.report.ttft


async def _wave(client: httpx.AsyncClient, base: str, n: int) -> tuple[float, float, list[float]]:
    """``n`` streams at once, held until all have a first token; (seconds to open all, CPU
    seconds for it, caller-visible TTFTs)."""
    replicas = [th.Replica(base, name="a"), th.Replica(base, name="b")]
    policy = th.HedgePolicy(hedge_after=30.0)
    everyone = trio.Event()
    ttfts: list[float] = []
    opened_at = [0.0, 0.0]
    start, cpu = trio.current_time(), time.process_time()

    async def one() -> None:
        async with th.hedged_stream(BODY, replicas, policy, client=client) as s:
            assert s.report.ttft is not None
            ttfts.append(s.report.ttft)
            if len(ttfts) == n:
                opened_at[:] = [trio.current_time() - start, time.process_time() - cpu]
                everyone.set()
            await everyone.wait()
            text = "".join([t async for t in s])
        if text != TEXT:
            raise AssertionError(f"wrong text {text!r}")

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return opened_at[0], opened_at[1], ttfts


async def main(burst: int, streams: int, repeat: int) -> None:
    with server_process() as port:
        base = url(port, tokens=4)
        connects = _Connects()
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=None, keepalive_expiry=EXPIRY
        )
        async with make_client(limits=limits, event_hooks={"request": [connects.hook]}) as client:
            transport = client._transport
            assert isinstance(transport, ShardedTransport)
            await _wave(client, base, burst)
            pools_after_burst = transport.shards
            await trio.sleep(EXPIRY + 0.2)
            before = connects.count
            for _ in range(15):
                await _one(client, base)
                await trio.sleep(0.1)
            print(f"burst of {burst} streams: {pools_after_burst} pools")
            print(
                f"then 15 sequential requests opened {connects.count - before} connections; "
                f"{transport.shards} pools left"
            )
        print(f"\nhigh load: {streams} streams at once, {repeat} waves on one make_client()")
        print(
            f"{'wave':>4} {'open all s':>10} {'CPU s':>7} {'P50 ms':>7} {'P99 ms':>7} {'conns':>6}"
        )
        async with make_client(event_hooks={"request": [connects.hook]}) as client:
            for wave in range(1, repeat + 1):
                before = connects.count
                open_s, cpu_s, ttfts = await _wave(client, base, streams)
                p50, p99 = percentile(ttfts, 50) * 1e3, percentile(ttfts, 99) * 1e3
                opened = connects.count - before
                print(
                    f"{wave:>4} {open_s:>10.3f} {cpu_s:>7.3f} {p50:>7.1f} {p99:>7.1f} {opened:>6}"
                )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=400)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke check: 100, 100, 1 wave")
    args = parser.parse_args()
    if args.quick:
        args.burst, args.streams, args.repeat = 100, 100, 1
    trio.run(main, args.burst, args.streams, args.repeat)


if __name__ == "__main__":
    cli()
