"""What the cancel-safe HTTP/2 transport costs: client CPU per token and per request over h2c.

A :class:`~trio_hedge.testing.FakeReplica` serves h2c **in another process** (so only the
client's CPU is counted). The client is an ``httpx.AsyncClient(http1=False, http2=True)``
with httpx's own transport (the control), or the same client with
``transport=cancel_safe_transport(http1=False, http2=True)``: one pool each, so the
only difference is the hardening (writes shielded, connections guarded; see
``trio_hedge/_cancel_safe.py``). Runs are interleaved; each repetition runs both paths, each
in a fresh event loop with a fresh client warmed by a few requests.

* per token: one ``hedged_stream`` reading ``--tokens`` tokens (default 20,000), CPU µs per
  token (``time.process_time()`` over the stream);
* per request: ``--requests`` sequential one-token requests (default 2,000), CPU µs each.

Run: ``python benchmarks/http2_overhead.py`` (``--quick``: a smoke check, not a measurement).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import trio

import trio_hedge as th
from trio_hedge.testing import Behaviour, FakeReplica

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
POLICY = th.HedgePolicy(hedge_after=None)
CLIENTS: dict[str, Callable[[], httpx.AsyncClient]] = {
    "httpx's transport": lambda: httpx.AsyncClient(http1=False, http2=True),
    "cancel_safe_transport": lambda: httpx.AsyncClient(
        transport=th.transport.cancel_safe_transport(http1=False, http2=True)
    ),
}


async def _serve(tokens: int) -> None:
    behaviour = Behaviour(tokens=tokens, ttft=0.0, token_delay=0.0)
    async with FakeReplica(behaviour, http2=True) as replica:
        print(replica.url, flush=True)
        await trio.sleep_forever()


@contextmanager
def _server(tokens: int) -> Iterator[str]:
    """A FakeReplica answering ``tokens`` tokens, in another process; yields its URL."""
    args = [sys.executable, __file__, "serve", str(tokens)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.terminate()
        proc.wait(timeout=5)


async def _stream(client: httpx.AsyncClient, url: str) -> int:
    async with th.hedged_stream(REQUEST, [th.Replica(url)], POLICY, client=client) as stream:
        return sum([1 async for _ in stream])


async def _per_token(make: Callable[[], httpx.AsyncClient], url: str, tokens: int) -> float:
    async with make() as client:
        await _stream(client, url)
        start = time.process_time()
        read = await _stream(client, url)
        assert read == tokens, read
        return (time.process_time() - start) / tokens * 1e6


async def _per_request(make: Callable[[], httpx.AsyncClient], url: str, requests: int) -> float:
    async with make() as client:
        for _ in range(20):
            await _stream(client, url)
        start = time.process_time()
        for _ in range(requests):
            await _stream(client, url)
        return (time.process_time() - start) / requests * 1e6


def _measure(
    what: str, unit: str, run: Callable[[Callable[[], httpx.AsyncClient]], float], repeat: int
) -> None:
    results: dict[str, list[float]] = {name: [] for name in CLIENTS}
    for _ in range(repeat):
        for name, make in CLIENTS.items():
            results[name].append(run(make))
    for name, values in results.items():
        runs = " ".join(f"{v:.1f}" for v in values)
        print(f"{what:12s} {name:24s} median {statistics.median(values):8.1f} {unit}   runs {runs}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=7, help="interleaved repetitions")
    parser.add_argument("--quick", action="store_true", help="smoke check: tiny runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.requests, args.repeat = 500, 50, 1
    print(
        f"http2_overhead: tokens={args.tokens:,} requests={args.requests:,} "
        f"repeat={args.repeat} python={sys.version.split()[0]} httpx={httpx.__version__}"
    )
    with _server(args.tokens) as url:
        _measure(
            "per token",
            "µs CPU",
            lambda make: trio.run(_per_token, make, url, args.tokens),
            args.repeat,
        )
    with _server(1) as url:
        _measure(
            "per request",
            "µs CPU",
            lambda make: trio.run(_per_request, make, url, args.requests),
            args.repeat,
        )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        trio.run(_serve, int(sys.argv[2]))
    else:
        sys.exit(main())
