"""An asyncio application that hedges its LLM calls through trio_hedge's asyncio bridge.

The application code (``app``) is plain asyncio: ``asyncio.gather``, ``asyncio.wait_for``,
``async with`` / ``async for``. The only change from an ``asyncio.run`` program is how it
starts: ``trio_asyncio.run(trio_asyncio.aio_as_trio(app), ...)`` runs the asyncio loop on top
of Trio, where trio_hedge's race runs. One :class:`~trio_hedge.aio.AioHedger` is shared by
every asyncio task (learned hedge delay, budget, replica health).

Run:

    .venv/bin/python examples/asyncio_app.py             # against two built-in fake replicas
    .venv/bin/python examples/asyncio_app.py --smoke     # a quick run that exits (what CI runs)
    .venv/bin/python examples/asyncio_app.py --replica http://10.0.0.1:8000/v1 \\
        --replica http://10.0.0.2:8000/v1 --model my-model

Needs the ``asyncio`` extra; from a clone of the repository:
``.venv/bin/pip install -c constraints.txt -e ".[asyncio]"`` (once released:
``pip install "trio-hedge[asyncio]"``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import trio_asyncio

import trio_hedge as th
from trio_hedge.aio import AioHedger
from trio_hedge.testing import Behaviour, RequestRecord, fake_replicas

QUESTIONS = [
    "What is tail latency?",
    "Why does a queue make the first token slow?",
    "What does a backup request cost?",
    "When should a request never be hedged?",
]


# -- the asyncio application ---------------------------------------------------------------------


async def ask(hedger: AioHedger, model: str, question: str) -> str:
    request = {"model": model, "messages": [{"role": "user", "content": question}]}
    stream = hedger.stream(request)

    async def read() -> str:
        async with stream:
            return "".join([token async for token in stream])

    # A timeout (or any asyncio cancellation) closes every upstream response.
    answer = await asyncio.wait_for(read(), timeout=30)
    report = stream.report
    return (
        f"{question!r}: {len(answer)} chars from {report.winner_replica} "
        f"(attempt {report.winner}, TTFT {report.ttft:.2f} s, hedged: {report.hedged})"
    )


async def app(urls: list[str], model: str, rounds: int) -> int:
    replicas = [th.Replica(url, name=f"replica{i}") for i, url in enumerate(urls)]
    config = th.HedgerConfig(hedge_after=0.25)
    async with AioHedger(replicas, config) as hedger:
        for _ in range(rounds):
            lines = await asyncio.gather(*(ask(hedger, model, q) for q in QUESTIONS))
            print(*lines, sep="\n")
        stats = hedger.statistics()
        print(
            f"{stats.requests} requests, {stats.hedges_sent} hedged, "
            f"{stats.backup_wins} won by a backup, TTFT P50 {stats.ttft_p50:.2f} s"
        )
    return 0


# -- starting it ---------------------------------------------------------------------------------


def _slow_every_third(record: RequestRecord) -> Behaviour:
    # Every third request waits behind another tenant's long prompt.
    return Behaviour(ttft=1.5 if record.index % 3 == 1 else 0.05, token_delay=0.005, tokens=30)


async def with_fakes(model: str, rounds: int) -> int:
    """Trio: start two fake replicas, then run the asyncio app against them."""
    fast = Behaviour(ttft=0.08, token_delay=0.005, tokens=30)
    async with fake_replicas(_slow_every_third, fast) as fakes:
        return await trio_asyncio.aio_as_trio(app)([f.url for f in fakes], model, rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one round, then exit")
    parser.add_argument("--replica", action="append", help="an OpenAI-compatible base URL")
    parser.add_argument("--model", default="fake-model", help="model name (default: %(default)s)")
    args = parser.parse_args()
    rounds = 1 if args.smoke else 3
    if args.replica:
        # A plain asyncio program: the only change from asyncio.run(app(...)).
        return trio_asyncio.run(trio_asyncio.aio_as_trio(app), args.replica, args.model, rounds)
    return trio_asyncio.run(with_fakes, args.model, rounds)


if __name__ == "__main__":
    sys.exit(main())
