"""Load probes, in virtual time: the Hedger with and without the engines' own queue readings.

The model is ``benchmarks/tail.py``'s (two replicas, one FIFO prefill at a time, parallel
decode, fixed network time, Poisson arrivals; ``--help`` there for every knob), with other
tenants' long prompts (``--tenants others``: sent straight to a random replica, unseen by
the library, not measured) at a higher rate than ``tail.py``'s default, so each replica is
often busy prefilling one: the case issue 21 is about. A probe of a simulated replica reads
what llama-server's ``/slots`` would say: the prompt tokens still to prefill ahead of a new
request (the one prefilling and the queued ones), every ``interval`` seconds, through the
real poller (``LoadProbe(reader=...)``) in the Hedger's own nursery.

Rows, one seeded schedule: no hedging (a random replica); the Hedger without probes (its
defaults; and routing only, ``hedge_after=None``); the Hedger with probes (routing only, and
hedging); double send (``hedge_after=0``, no budget). Printed: the library's short-request
TTFT P50/P99 (the long prompts' own TTFTs left out), extra requests (attempts beyond one per
request, % of requests), primaries sent to a replica busy with a long prompt, and the
library's own long prompts hedged (a second scenario, ``--tenants self``, where the long
prompts are the library's own).

What it does not model: the engines' cancellation rules (the cancel window of llama-server,
``policy/_load.py``), the probes' own cost, a probe's network delay. Those need the real
engines (``benchmarks/real_engine.py``, issue 21's benchmark; not built in CI).

Run: ``python benchmarks/probes.py`` (4,000 requests per row); ``--quick`` for CI (600).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np
import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).parent))

from tail import (
    Cluster,
    Outcome,
    Params,
    Replica,
    Request,
    Result,
    first_token_race,
    hedger_outcome,
    is_tenants,
    make_requests,
    own_requests,
    simulate,
    summarize,
)

from trio_hedge import HedgePolicy, Hedger, HedgerConfig
from trio_hedge.sources.probes import LoadProbe, LoadReading


def reading_of(replica: Replica, p: Params) -> LoadReading:
    """What llama-server's ``/slots`` would say of a simulated replica now: the prompt tokens
    still to prefill (the prefilling one's remainder, and every queued one that arrived)."""
    now = trio.current_time()
    tokens = 0.0
    job = replica._prefilling
    if job is not None and job.prefill_started is not None:
        left = max(0.0, 1.0 - (now - job.prefill_started) / max(job.request.prefill, 1e-9))
        tokens += job.request.prefill * p.prefill_rate * left
    for queued in replica._queue:
        if queued.arrives_at <= now and (queued.gone_at is None or queued.gone_at > now):
            tokens += queued.request.prefill * p.prefill_rate
    running = int(job is not None)
    return LoadReading("llama.cpp", running=running, queued_tokens=round(tokens), slots=1)


def probes_for(cluster: Cluster) -> dict[str, LoadProbe]:
    def reader(replica: Replica) -> LoadProbe:
        async def read() -> LoadReading:
            return reading_of(replica, cluster.p)

        return LoadProbe("llama.cpp", reader=read, prefill_rate=cluster.p.prefill_rate)

    return {r.name: reader(r) for r in cluster.replicas}


async def _simulate_hedger(
    cluster: Cluster, requests: Sequence[Request], config: HedgerConfig, probed: bool
) -> list[Outcome]:
    outcomes: dict[int, Outcome] = {}
    probes = probes_for(cluster) if probed else None

    async def one(hedger: Hedger, request: Request) -> None:
        outcomes[request.index] = await hedger_outcome(hedger, cluster, request)

    async with trio.open_nursery() as servers:
        for replica in cluster.replicas:
            servers.start_soon(replica.serve)
        async with (
            Hedger(cluster.shared_sources(), config, probes=probes) as hedger,
            trio.open_nursery() as callers,
        ):
            for request in requests:
                await trio.sleep_until(request.arrival)
                if is_tenants(cluster.p, request):
                    cluster.replicas[request.primary].submit(request, tenant=True)
                else:
                    callers.start_soon(one, hedger, request)
        servers.cancel_scope.cancel()
    return [outcomes[r.index] for r in own_requests(cluster.p, requests)]


def simulate_hedger(
    name: str, p: Params, requests: Sequence[Request], config: HedgerConfig, probed: bool
) -> Result:
    cluster = Cluster(p)
    outcomes = trio.run(
        _simulate_hedger,
        cluster,
        requests,
        config,
        probed,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    return Result(name, own_requests(p, requests), outcomes, cluster.jobs(), 0.0)


ROWS: tuple[tuple[str, HedgerConfig | None, bool], ...] = (
    ("Hedger, no probes", HedgerConfig(), False),
    ("Hedger, no probes, routing only", HedgerConfig(hedge_after=None), False),
    ("Hedger + probes, routing only", HedgerConfig(hedge_after=None), True),
    ("Hedger + probes, hedging", HedgerConfig(), True),
)


def run_scenario(p: Params) -> list[tuple[str, float, float, float, float, tuple[int, int]]]:
    requests = make_requests(p)
    never = first_token_race(lambda _r: HedgePolicy(hedge_after=None))
    results = [simulate("no hedging", p, requests, never)]
    for name, config, probed in ROWS:
        assert config is not None
        results.append(simulate_hedger(name, p, requests, config, probed))
    results.append(
        simulate(
            "double send",
            p,
            requests,
            first_token_race(lambda _r: HedgePolicy(hedge_after=0, max_attempts=2)),
        )
    )
    rows = []
    for result in results:
        s = summarize(result, p)
        ttfts = np.asarray(
            [o.ttft for r, o in zip(result.requests, result.outcomes, strict=True) if not r.long]
        )
        p50, p99 = (float(v) for v in np.percentile(ttfts, (50, 99)))
        rows.append((s.name, p50, p99, s.extra, s.to_busy, s.long_hedged))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=4_000)
    parser.add_argument("--quick", action="store_true", help="600 requests (CI smoke check)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--load", type=float, default=0.3)
    parser.add_argument("--long-fraction", type=float, default=0.01)
    args = parser.parse_args(argv)
    base = Params(
        requests=600 if args.quick else args.requests,
        seed=args.seed,
        load=args.load,
        long_fraction=args.long_fraction,
    )
    for tenants in ("others", "self"):
        p = attrs.evolve(base, tenants=tenants)
        print(
            f"\n{tenants}: long prompts ({p.long_fraction:.1%}, {p.long_prefill[0]:g}-"
            f"{p.long_prefill[1]:g} s of prefill) from "
            + ("other tenants (not measured)" if tenants == "others" else "the library")
            + f"; {p.requests} requests, load {p.load}, seed {p.seed}"
        )
        print(
            f"{'':34} {'TTFT P50':>9} {'TTFT P99':>9} {'extra':>7} {'to busy':>8} "
            f"{'long hedged':>12}"
        )
        for name, p50, p99, extra, busy, (hedged, seen) in run_scenario(p):
            print(
                f"{name:34} {p50:8.3f}s {p99:8.3f}s {extra:6.1f}% {busy:7.1f}% "
                f"{hedged:>5}/{seen:<6}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
