"""The library's own CPU cost per request, with no I/O: ``hedged_stream`` over an in-memory
async iterator that yields two tokens (one attempt, no hedge), read directly like the HTTP
source's stream. This is what trio_hedge adds to every request on top of the HTTP work (race
nursery, attempt task, cancel scopes, report). ``--generator`` makes the source an async
generator, which its attempt's task relays after the commit (a task switch per item: the
price of letting a generator hold a cancel scope across ``yield``). ``--hedger`` measures the
request through a long-lived ``Hedger`` with its default config (learned delay, budget,
throttle, outlier detection, back-off: the planner's work).

Run: ``python benchmarks/per_request.py`` (``--quick``: fewer requests, a smoke check).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import AsyncIterator, Callable

import trio

import trio_hedge as th


class _TwoTokens:
    """An async iterator object (not a generator): read directly by whichever task."""

    def __init__(self, info: th.sources.AttemptInfo) -> None:
        self._left = ["b", "a"]

    def __aiter__(self) -> _TwoTokens:
        return self

    async def __anext__(self) -> str:
        if not self._left:
            raise StopAsyncIteration
        return self._left.pop()


async def _two_tokens(info: th.sources.AttemptInfo) -> AsyncIterator[str]:
    yield "a"
    yield "b"


_FACTORY: Callable[[th.sources.AttemptInfo], AsyncIterator[str]] = _TwoTokens


async def _requests(n: int) -> float:
    source = th.iterator_source(_FACTORY, name="memory")
    began = time.process_time()
    for _ in range(n):
        async with th.hedged_stream(None, [source]) as stream:
            async for _token in stream:
                pass
    return (time.process_time() - began) / n


async def _hedger_requests(n: int) -> float:
    sources = [th.iterator_source(_FACTORY, name=name) for name in ("a", "b", "c")]
    hedger = th.Hedger(sources)
    began = time.process_time()
    for _ in range(n):
        async with hedger.stream(None) as stream:
            async for _token in stream:
                pass
    return (time.process_time() - began) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--hedger", action="store_true", help="through a Hedger (3 replicas, default config)"
    )
    parser.add_argument(
        "--generator", action="store_true", help="an async generator source (relayed)"
    )
    args = parser.parse_args(argv)
    global _FACTORY
    if args.generator:
        _FACTORY = _two_tokens
    n, repeat = (1_000, 1) if args.quick else (args.requests, args.repeat)
    requests = _hedger_requests if args.hedger else _requests
    trio.run(requests, 200)  # warm-up
    runs = sorted(trio.run(requests, n) for _ in range(repeat))
    what = ("Hedger.stream" if args.hedger else "hedged_stream") + (
        ", generator source" if args.generator else ""
    )
    print(f"per_request ({what}): {n:,} requests x {repeat}, CPU time (time.process_time)")
    print(
        f"library CPU per request: median {runs[len(runs) // 2] * 1e6:.1f} us, "
        f"best {runs[0] * 1e6:.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
