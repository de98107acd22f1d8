"""Cancellation latency: from the commit to the loser's server seeing the disconnect.

Each race: the primary replica is slow to first token (30 s), the backup answers at once,
``hedge_after`` 5 ms; the backup's first token commits and the library cancels and closes the
primary (HTTP/1.1: closes its connection; HTTP/2: sends RST_STREAM on the shared
connection). The replicas are ``trio_hedge.testing.FakeReplica`` **in the same Trio run**, so
the commit time (``stream.started_at + stream.report.ttft``) and the server's
``RequestRecord.disconnected_at`` are on the same clock. Races run one after another on one
client per variant:

* HTTP/1.1 through a plain ``httpx.AsyncClient()`` and through ``make_client()``;
* HTTP/2 with prior knowledge (``http1=False, http2=True`` against ``FakeReplica(...,
  http2=True)``), plain and through ``make_client``.

Targets (loopback): median <= 5 ms, max <= 50 ms, for every variant.

Run: ``python benchmarks/cancel_latency.py`` (``--quick``: 20 races per variant).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import trio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, percentile, verdict

import trio_hedge as th
from trio_hedge.testing import Behaviour, fake_replicas
from trio_hedge.transport import make_client

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SLOW = Behaviour(ttft=30.0, tokens=3)
FAST = Behaviour(ttft=0.0, tokens=3)
HEDGE_AFTER = 0.005

VARIANTS: dict[str, tuple[bool, Callable[[], httpx.AsyncClient]]] = {
    "HTTP/1.1 httpx.AsyncClient()": (False, lambda: httpx.AsyncClient()),
    "HTTP/1.1 make_client()": (False, lambda: make_client()),
    "HTTP/2 httpx.AsyncClient(http2)": (
        True,
        lambda: httpx.AsyncClient(http1=False, http2=True),
    ),
    "HTTP/2 make_client(http2)": (True, lambda: make_client(http1=False, http2=True)),
}


async def run_variant(name: str, races: int) -> list[float]:
    """Latencies (seconds) from commit to the loser's disconnect, one per race."""
    http2, factory = VARIANTS[name]
    out: list[float] = []
    async with fake_replicas(SLOW, FAST, names=["slow", "fast"], http2=http2) as (slow, fast):
        replicas = [th.Replica(slow.url, name="slow"), th.Replica(fast.url, name="fast")]
        policy = th.HedgePolicy(hedge_after=HEDGE_AFTER)
        async with factory() as client:
            for i in range(races):
                stream = th.hedged_stream(REQUEST, replicas, policy, client=client)
                async with stream:
                    text = "".join([t async for t in stream])
                report = stream.report
                if text != "tok0 tok1 tok2 " or report.winner != 2 or report.ttft is None:
                    raise AssertionError(f"{name}: unexpected race {report}")
                commit = stream.started_at + report.ttft
                with trio.fail_after(5):
                    record = await slow.wait_disconnected(i)
                assert record.disconnected_at is not None
                if http2 and record.http_version != "2":
                    raise AssertionError(f"{name}: not HTTP/2 ({record.http_version})")
                if http2 and slow.open_connections != 1:
                    # RST_STREAM keeps the connection; the fallback would have closed it.
                    raise AssertionError(f"{name}: the loser's connection was torn down")
                out.append(record.disconnected_at - commit)
        with trio.fail_after(5):
            await slow.wait_connections(0)
            await fast.wait_connections(0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--races", type=int, default=200, help="races per variant")
    parser.add_argument("--quick", action="store_true", help="smoke check: 20 races")
    args = parser.parse_args(argv)
    if args.quick:
        args.races = 20
    console = Console(width=150)
    console.print(
        f"cancel_latency: races={args.races} per variant, hedge_after={HEDGE_AFTER * 1000:.0f} "
        f"ms, servers=in-process FakeReplica, nproc={os.cpu_count()} "
        f"httpx={httpx.__version__} trio={trio.__version__}"
    )
    results = {name: trio.run(run_variant, name, args.races) for name in VARIANTS}
    table = Table(title="commit → loser's server sees the disconnect (ms)")
    for c in ("variant", "races", "median", "P90", "P99", "max"):
        table.add_column(c, justify="left" if c == "variant" else "right")
    for name, xs in results.items():
        table.add_row(
            name,
            str(len(xs)),
            f"{median(xs) * 1000:.2f}",
            f"{percentile(xs, 90) * 1000:.2f}",
            f"{percentile(xs, 99) * 1000:.2f}",
            f"{max(xs) * 1000:.2f}",
        )
    console.print(table)
    for name, xs in results.items():
        console.print(
            verdict(median(xs) <= 0.005, f"{name}: median {median(xs) * 1000:.2f} ms (<= 5 ms)")
        )
        console.print(verdict(max(xs) <= 0.050, f"{name}: max {max(xs) * 1000:.2f} ms (<= 50 ms)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
