"""Cold start, in virtual time: does a fleet that is cold everywhere pay the 1 s fallback?

Issue 29: on two llama-server replicas under another tenant's prompts (measured on
``c6222d8``) the default gateway's P99 TTFT over its first 60 requests was 1.04-1.05 s, against
0.24-0.29 s once warm: all of it the first requests' fallback delay (``LearnedDelay.fallback``,
1 s, until a size class has 20 observations). Target: without probes, cold P99 <= 1.5x warm.

The model is ``benchmarks/tail.py``'s (its replicas: one FIFO prefill at a time, parallel
decode; its network; every request through the real ``Hedger``), on the schedule of that
measurement (``benchmarks/real_engine.py --scenario evidence``): the library's short requests
(~50 ms of prefill, a 10 ms round trip) arrive 2 a second, and another tenant's long prompt
(2.5 s of prefill, unseen by the Hedger, not measured) every 6 s from 1 s, alternating between
the two replicas. Per seed, one Hedger serves ``--warmup`` + 60 of the library's own requests
in one run:

* **cold**: the first 60 (the Hedger has seen nothing);
* **warm**: the last 60 (after ``--warmup`` requests).

Two rows: ``cold rule`` (the default: from 3 observations the delay is 3x their median,
``LearnedDelay.cold_samples`` / ``cold_ratio``, and an attempt waiting on a cold delay is
looked at again as samples arrive) and ``fallback`` (``cold_samples=None``: the rule before).
A P99 of 60 requests is decided by one request, so the figure is the mean over ``--seeds``
runs, each row on the same requests.

Run: ``python benchmarks/cold_start.py`` (``--quick``: 3 seeds).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import verdict
from tail import Params, Request, hedger_race, simulate

from trio_hedge import HedgerConfig, LearnedDelay

MEASURED = 60


#: The other tenant: a long prompt every ``TENANT_EVERY`` seconds from ``TENANT_FROM``,
#: alternating between the replicas, each ``TENANT_PREFILL`` seconds of prefill
#: (``benchmarks/real_engine.py --scenario evidence`` on llama-server: 4,000 words every 6 s).
TENANT_EVERY, TENANT_FROM, TENANT_PREFILL = 6.0, 1.0, 2.5
#: The library's own requests per second (Poisson), short: ~50 ms of prefill.
RATE = 2.0


def params(seed: int) -> Params:
    return Params(
        seed=seed,
        network=0.01,
        prefill_rate=2000.0,
        short_median_tokens=100.0,
        short_sigma=0.4,
        output_tokens=(20, 40),
        tpot=0.01,
        block=20,
        tenants="others",
    )


def schedule(p: Params, own: int) -> list[Request]:
    """``own`` short requests of the library's, Poisson at ``RATE``, and the other tenant's
    long prompts between them (``Request.long`` with ``tenants="others"``: sent around the
    library to its replica, ``primary``)."""
    rng = random.Random(p.seed)
    raw: list[tuple[float, int, float, bool, int]] = []
    now = 0.0
    for _ in range(own):
        now += rng.expovariate(RATE)
        tokens = max(1, round(rng.lognormvariate(math.log(p.short_median_tokens), p.short_sigma)))
        prefill = tokens / p.prefill_rate * rng.lognormvariate(0.0, p.jitter_sigma)
        raw.append((now, tokens, prefill, False, rng.randrange(p.replicas)))
    at, k = TENANT_FROM, 0
    while at < now:
        raw.append((at, round(TENANT_PREFILL * p.prefill_rate), TENANT_PREFILL, True, k % 2))
        at, k = at + TENANT_EVERY, k + 1
    raw.sort()
    return [
        Request(i, arrival, tokens, prefill, rng.randint(*p.output_tokens), primary, long)
        for i, (arrival, tokens, prefill, long, primary) in enumerate(raw)
    ]


def p99(values: list[float]) -> float:
    return float(np.percentile(np.asarray(values), 99))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="runs (seeds 1..N)")
    parser.add_argument("--warmup", type=int, default=400, help="own requests before 'warm'")
    parser.add_argument("--quick", action="store_true", help="3 seeds, 200 warm-up requests")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.warmup = 3, 200
    console = Console(width=150)
    console.print(
        f"cold start: {args.seeds} seeds, {MEASURED} measured requests cold and warm, "
        f"{args.warmup} warm-up; load average {os.getloadavg()[0]:.2f} (virtual time: "
        "the figures do not depend on it)"
    )
    rows = {
        "cold rule (default)": HedgerConfig(),
        "fallback (cold_samples=None)": HedgerConfig(hedge_after=LearnedDelay(cold_samples=None)),
    }
    results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in rows}
    for seed in range(1, args.seeds + 1):
        p = params(seed)
        requests = schedule(p, args.warmup + MEASURED)
        for name, config in rows.items():
            result = simulate(name, p, requests, hedger_race(config))
            ttfts = [o.ttft for o in result.outcomes]
            hedged = [o.attempts > 1 for o in result.outcomes]
            cold, warm = ttfts[:MEASURED], ttfts[-MEASURED:]
            results[name].append(
                (
                    p99(cold),
                    p99(warm),
                    100 * sum(hedged[:MEASURED]) / MEASURED,
                    100 * sum(hedged[-MEASURED:]) / MEASURED,
                )
            )
    table = Table(title=f"P99 TTFT of {MEASURED} requests, cold and warm (s), per seed")
    table.add_column("row", justify="left")
    for seed in range(1, args.seeds + 1):
        table.add_column(f"seed {seed}", justify="right")
    table.add_column("mean", justify="right")
    table.add_column("hedged cold / warm", justify="right")
    summary: dict[str, tuple[float, float]] = {}
    for name, runs in results.items():
        cold = [r[0] for r in runs]
        warm = [r[1] for r in runs]
        summary[name] = (statistics.fmean(cold), statistics.fmean(warm))
        hedged = (
            f"{statistics.fmean(r[2] for r in runs):.1f}% / "
            f"{statistics.fmean(r[3] for r in runs):.1f}%"
        )
        table.add_row(
            f"{name}: cold", *(f"{x:.3f}" for x in cold), f"{summary[name][0]:.3f}", hedged
        )
        table.add_row(f"{name}: warm", *(f"{x:.3f}" for x in warm), f"{summary[name][1]:.3f}", "")
    console.print(table)
    cold, warm = summary["cold rule (default)"]
    before, _ = summary["fallback (cold_samples=None)"]
    ok = cold <= 1.5 * warm
    console.print(
        verdict(
            ok,
            f"cold P99 {cold:.3f} s <= 1.5x warm P99 {warm:.3f} s ({cold / warm:.2f}x; "
            f"with the fallback alone {before:.3f} s = {before / warm:.2f}x)",
        )
    )
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
