"""The library's own CPU cost per request, with no I/O: ``hedged_stream`` over an in-memory
iterator source that yields two tokens (one attempt, no hedge). This is what trio_hedge adds
to every request on top of the HTTP work (race nursery, attempt task, cancel scopes, report).

Run: ``python benchmarks/per_request.py`` (``--quick``: fewer requests, a smoke check).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import AsyncIterator

import trio

import trio_hedge as th


async def _two_tokens(info: th.AttemptInfo) -> AsyncIterator[str]:
    yield "a"
    yield "b"


async def _requests(n: int) -> float:
    source = th.iterator_source(_two_tokens, name="memory")
    began = time.process_time()
    for _ in range(n):
        async with th.hedged_stream(None, [source]) as stream:
            async for _token in stream:
                pass
    return (time.process_time() - began) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    n, repeat = (1_000, 1) if args.quick else (args.requests, args.repeat)
    trio.run(_requests, 200)  # warm-up
    runs = sorted(trio.run(_requests, n) for _ in range(repeat))
    print(f"per_request: {n:,} requests x {repeat}, CPU time (time.process_time)")
    print(
        f"library CPU per request: median {runs[len(runs) // 2] * 1e6:.1f} us, "
        f"best {runs[0] * 1e6:.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
