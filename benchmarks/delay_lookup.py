"""The cost of one hedge-delay lookup of a learned delay (``DelayModel.delay``), with no new
data since the last lookup: a class that has learned its own delay, and a class short of data
whose delay comes from the prefill model (issue 16: ``LearnedDelay(refresh=0)`` refitted the
model, and its spread over every observation, on every such lookup).

The model holds 20 observations in each of three size classes and is looked up for a prompt
of the fourth class (unlearned) and of the first (learned), with ``refresh=0`` and with the
default ``refresh=1.0``. Trio's clock is not needed: the lookups pass ``now`` themselves.

Run: ``python benchmarks/delay_lookup.py`` (``--quick``: fewer lookups, a smoke check).
"""

from __future__ import annotations

import argparse
import time

from trio_hedge import LearnedDelay
from trio_hedge.policy._delay import DelayModel


def _model(refresh: float) -> DelayModel:
    model = DelayModel(LearnedDelay(refresh=refresh))
    for size_class, tokens in ((0, 100), (1, 300), (2, 700)):
        for i in range(20):
            ttft = (0.1 + 0.001 * (tokens + i)) * (1.0 + 0.02 * (i % 5))
            model.observe("g", size_class, 0.0, ttft, True, tokens=tokens + i)
    return model


def _per_lookup(model: DelayModel, size_class: int, tokens: int, n: int) -> float:
    """Microseconds per lookup, the first (which fits) left out."""
    model.delay("g", size_class, 1.0, tokens=tokens)
    start = time.perf_counter()
    for _ in range(n):
        model.delay("g", size_class, 1.0, tokens=tokens)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer lookups (a smoke check)")
    args = parser.parse_args()
    n = 200 if args.quick else 20_000
    print(f"hedge-delay lookups, no new data ({n} each): microseconds per lookup")
    print(f"{'refresh':>8} {'learned class':>14} {'unlearned class':>16}")
    for refresh in (0.0, 1.0):
        learned = _per_lookup(_model(refresh), 0, 100, n)
        unlearned = _per_lookup(_model(refresh), 3, 2000, n)
        print(f"{refresh:>8} {learned:>14.2f} {unlearned:>16.2f}")


if __name__ == "__main__":
    main()
