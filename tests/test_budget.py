"""The hedge budget (ratio + floor over a window) and the gRFC A6 throttle: unit tables, a
sustained overload with no hedge storm, and a failure burst that stops hedging until
successes refill the throttle."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import EventKind, HedgeBudget, RetryThrottle
from trio_hedge._budget import BudgetState, ThrottleState

from .fleet import Fail, Fleet, run, table
from .scripted import Script

# -- units -------------------------------------------------------------------------------------


def test_budget_arithmetic() -> None:
    budget = BudgetState(HedgeBudget(ratio=0.1, min_per_second=0.5, window=10.0))
    # The floor alone: 0.5/s over 10 s = 5 backups with no requests at all.
    assert [budget.try_backup(1.0) for _ in range(6)] == [True] * 5 + [False]
    # 100 requests add 10 more.
    for _ in range(100):
        budget.request(2.0)
    assert budget.allowance(2.0) == pytest.approx(10.0)
    assert sum(budget.try_backup(2.0) for _ in range(20)) == 10
    assert budget.counts(2.0) == (100, 15)
    # The window slides: at t=11.5 the slot of t=1.x (5 backups) has left it, t=2.x not yet.
    assert budget.counts(11.5) == (100, 10)
    assert budget.allowance(11.5) == pytest.approx(5.0)
    # At t=12.5 everything has left: only the floor again.
    assert budget.counts(12.5) == (0, 0)
    assert budget.allowance(12.5) == pytest.approx(5.0)


THROTTLE_STEPS = [
    # (event, tokens after, hedging allowed after) — gRFC A6 with max_tokens=10, ratio=0.1
    ("failure", 9.0, True),
    ("failure", 8.0, True),
    ("failure", 7.0, True),
    ("failure", 6.0, True),
    ("failure", 5.0, False),  # at max_tokens / 2: throttled
    ("success", 5.1, True),  # above it again
    ("failure", 4.1, False),
    *[("failure", t, False) for t in (3.1, 2.1, 1.1, 0.1, 0.0, 0.0)],  # floors at 0
    *[("success", round(0.1 * k, 1), False) for k in range(1, 51)],  # back to 5.0
    ("success", 5.1, True),
]


def test_throttle_follows_grfc_a6() -> None:
    throttle = ThrottleState(RetryThrottle(max_tokens=10, token_ratio=0.1))
    assert throttle.tokens == 10 and throttle.allows
    for event, tokens, allows in THROTTLE_STEPS:
        throttle.failure() if event == "failure" else throttle.success()
        assert (throttle.tokens, throttle.allows) == (tokens, allows)
    for _ in range(100):
        throttle.success()
    assert throttle.tokens == 10  # capped at max_tokens


def test_validation() -> None:
    with pytest.raises(ValueError, match="ratio"):
        HedgeBudget(ratio=0)
    with pytest.raises(ValueError, match="ratio"):
        HedgeBudget(ratio=1.5)
    with pytest.raises(ValueError, match="min_per_second"):
        HedgeBudget(min_per_second=-1)
    with pytest.raises(TypeError, match="slots"):
        HedgeBudget(slots=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token_ratio"):
        RetryThrottle(token_ratio=1.0)
    with pytest.raises(ValueError, match="max_tokens"):
        RetryThrottle(max_tokens=2000)
    with pytest.raises(TypeError, match="budget"):
        th.HedgerConfig(budget=0.1)  # type: ignore[arg-type]


# -- sustained overload: every replica slow ------------------------------------------------------

RATE = 10  # requests per second
DURATION = 60  # seconds
SLOW = Script(ttft=5.0, tokens=1)


async def _overload(budget: HedgeBudget | None) -> th.HedgerStatistics:
    fleet = Fleet(["a", "b", "c"], table(SLOW))
    config = th.HedgerConfig(hedge_after=1.0, budget=budget, throttle=None, outlier_detection=None)
    hedger = th.Hedger(fleet.sources(), config)
    async with trio.open_nursery() as nursery:
        for _ in range(RATE * DURATION):
            nursery.start_soon(run, hedger.stream(None))
            await trio.sleep(1 / RATE)
    stats = hedger.statistics()
    assert stats.requests == stats.finished == RATE * DURATION
    assert all(r.in_flight == 0 for r in stats.replicas)
    assert fleet.ledger.open_now == 0
    return stats


async def test_overload_stays_within_the_budget(autojump_clock: trio.testing.MockClock) -> None:
    # Without a budget every request crosses the delay: 2 backups each (3 replicas), 200%.
    storm = await _overload(None)
    assert storm.hedges_sent == 2 * RATE * DURATION

    budget = HedgeBudget(ratio=0.1, min_per_second=0.5, window=10.0)
    stats = await _overload(budget)
    requests = RATE * DURATION
    # Over the run: at most ratio × requests + floor × (duration + one window).
    bound = budget.ratio * requests + budget.min_per_second * (DURATION + budget.window)
    assert stats.hedges_sent <= bound
    assert stats.hedges_sent >= budget.ratio * requests  # and the budget was used
    # Exactly: 89 backups (15% of requests, against 200% without a budget); every request
    # met one refusal (its first or, after one backup, its second hedge).
    assert (stats.hedges_sent, bound) == (89, 95.0)
    assert stats.budget_refusals == stats.hedges_refused == 600
    assert stats.throttle_refusals == stats.no_replica_refusals == 0


# -- a failure burst: the throttle stops hedging, successes resume it ----------------------------


async def test_throttle_stops_hedging_under_failures_and_lets_it_resume(
    autojump_clock: trio.testing.MockClock,
) -> None:
    phase: dict[str, Script | Fail] = {"a": Fail(at=0.1)}
    fleet = Fleet(["a", "b"], lambda name, _info: phase.get(name, Script(ttft=0.5, tokens=1)))
    config = th.HedgerConfig(
        hedge_after=1.0,
        budget=None,
        throttle=RetryThrottle(max_tokens=10, token_ratio=0.1),
        outlier_detection=None,
        pick="in_order",
    )
    events: list[th.HedgeEvent] = []
    hedger = th.Hedger(fleet.sources(), config, on_event=[events.append])
    # Phase 1: six requests whose primary fails at once and fails over to b:
    # each takes 1 token and gives back 0.1: 10 − 6 + 0.6 = 4.6 ≤ 5: throttled.
    for _ in range(6):
        report = await run(hedger.stream(None))
        assert [a.trigger for a in report.attempts] == ["primary", "failover"]
    assert hedger.statistics().throttle_tokens == pytest.approx(4.6)

    # Phase 2: a is slow (3 s), b fast. A request would hedge at 1.0 s, but the throttle
    # refuses while tokens ≤ 5: each success on a alone adds 0.1 (4.6 → 5.1 after five).
    phase["a"] = Script(ttft=3.0, tokens=1)
    hedged = []
    for _ in range(8):
        report = await run(hedger.stream(None))
        hedged.append(report.hedged)
        assert report.hedges_refused == (not report.hedged)
    assert hedged == [False] * 5 + [True] * 3
    stats = hedger.statistics()
    assert stats.throttle_refusals == 5
    assert stats.hedges_sent == 3
    refused = [e for e in events if e.kind is EventKind.HEDGE_REFUSED]
    assert [e.reason for e in refused] == ["throttle"] * 5
