"""The hedge budget (ratio + floor over a window) and the gRFC A6 throttle: unit tables, a
sustained overload with no hedge storm, a failure burst that stops hedging *and failing over*
until successes refill the throttle, and a budget spent only by backups that really start."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.events import EventKind
from trio_hedge.instrumentation import LoggingHook, PrometheusHook
from trio_hedge.policy import HedgeBudget, RetryThrottle
from trio_hedge.policy._budget import BudgetState
from trio_hedge.policy._throttle import ThrottleState

from .fleet import Fail, Fleet, run, table
from .scripted import Script

# -- units -------------------------------------------------------------------------------------


def _try_backup(budget: BudgetState, now: float) -> bool:
    if not budget.allows(now):
        return False
    budget.spend(now)
    return True


def test_budget_arithmetic() -> None:
    budget = BudgetState(HedgeBudget(ratio=0.1, min_per_second=0.5, window=10.0))
    # The floor alone: 0.5/s over 10 s = 5 backups with no requests at all.
    assert [_try_backup(budget, 1.0) for _ in range(6)] == [True] * 5 + [False]
    # Checking spends nothing.
    assert [budget.allows(1.0) for _ in range(3)] == [False] * 3
    assert budget.counts(1.0) == (0, 5)
    # 100 requests add 10 more.
    for _ in range(100):
        budget.request(2.0)
    assert budget.allowance(2.0) == pytest.approx(10.0)
    assert sum(_try_backup(budget, 2.0) for _ in range(20)) == 10
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


async def _overload(
    budget: HedgeBudget | None, pick: str = "least_loaded"
) -> th.policy.HedgerStatistics:
    fleet = Fleet(["a", "b", "c"], table(SLOW))
    config = th.HedgerConfig(
        hedge_after=1.0, budget=budget, throttle=None, outlier_detection=None, pick=pick
    )
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
    phase: dict[str, Script | Fail] = {"a": Fail(at=0.1), "b": Fail(at=0.1)}
    fleet = Fleet(["a", "b"], lambda name, _info: phase.get(name, Script(ttft=0.5, tokens=1)))
    config = th.HedgerConfig(
        hedge_after=1.0,
        budget=None,
        throttle=RetryThrottle(max_tokens=10, token_ratio=0.1),
        outlier_detection=None,
        pick="in_order",
    )
    events: list[th.events.HedgeEvent] = []
    hedger = th.Hedger(fleet.sources(), config, on_event=[events.append])
    # Phase 1: the fleet fails: every attempt fails at once. Each request's first failure
    # goes on credit (its failover decided at that failure, while tokens > 5), its second
    # takes a token, and the credit is debited at its end, unserved: 10 → 8 → 6 → 4. The
    # fourth request's failover is refused (gRFC A6: no retries either) and it fails: 3.
    for i in range(4):
        report = await run(hedger.stream(None))
        triggers = [a.trigger for a in report.attempts]
        assert triggers == (["primary", "failover"] if i < 3 else ["primary"])
        assert isinstance(report.error, th.AllAttemptsFailed)
    stats = hedger.statistics()
    assert stats.throttle_tokens == pytest.approx(3.0)
    assert (stats.failovers, stats.failovers_refused, stats.failover_throttle_refusals) == (3, 1, 1)
    assert stats.throttle_refusals == stats.hedges_refused == 0  # not counted as hedges

    # Phase 2: a is slow (3 s), b fast. A request would hedge at 1.0 s, but the throttle
    # refuses while tokens ≤ 5: each success (on a alone) adds 0.1, and from the 21st
    # (3.0 → 5.1) the requests are hedged again.
    phase["a"] = Script(ttft=3.0, tokens=1)
    del phase["b"]
    hedged = []
    for _ in range(24):
        report = await run(hedger.stream(None))
        hedged.append(report.hedged)
        assert report.hedges_refused == (not report.hedged)
    assert hedged == [False] * 21 + [True] * 3
    stats = hedger.statistics()
    assert stats.throttle_refusals == 21
    assert stats.hedges_sent == 3
    refused = [(e.kind, e.reason) for e in events if e.reason == "throttle"]
    assert (
        refused
        == [(EventKind.FAILOVER_REFUSED, "throttle")] + [(EventKind.HEDGE_REFUSED, "throttle")] * 21
    )


# -- failovers are extra requests too (gRFC A6: no retries at or below half the tokens) ----------

FAILING = Fail(at=0.25)


async def test_failovers_stop_with_the_throttle(autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet(["a", "b", "c", "d"], table(FAILING))
    config = th.HedgerConfig(
        hedge_after=1.0, budget=None, throttle=RetryThrottle(max_tokens=10), outlier_detection=None
    )
    events: list[th.events.HedgeEvent] = []
    hedger = th.Hedger(fleet.sources(), config, on_event=[events.append])
    reports = [await run(hedger.stream(None)) for _ in range(8)]
    # The first request fails over three times, its first failure on credit (10 → 7, and its
    # credit debited at its end: 6); the second's failover is decided at its (credited) first
    # failure, 6 > 5, and its second failure leaves 5: from then on every request gets its
    # primary alone, and each unserved one's credit is debited.
    assert [len(r.attempts) for r in reports] == [4, 2] + [1] * 6
    assert [a.started_at for a in reports[0].attempts] == [0.0, 0.25, 0.5, 0.75]
    assert all(isinstance(r.error, th.AllAttemptsFailed) for r in reports)
    stats = hedger.statistics()
    assert (stats.attempts, stats.failovers, stats.throttle_tokens) == (12, 4, 0.0)
    assert (stats.failovers_refused, stats.failover_throttle_refusals) == (7, 7)
    assert stats.hedges_refused == 0
    refused = [(e.kind, e.reason) for e in events if e.kind is EventKind.FAILOVER_REFUSED]
    assert refused == [(EventKind.FAILOVER_REFUSED, "throttle")] * 7


async def test_drained_throttle_and_ejections_one_attempt_per_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Issue 8's case: 4 failing replicas, the throttle at 0 tokens, outlier detection
    # ejecting all it may: 12 requests made 48 attempts (4 each); now 12.
    fleet = Fleet(["a", "b", "c", "d"], table(FAILING))
    outlier = th.policy.OutlierDetection(
        consecutive_failures=1, base_ejection=300.0, max_ejection=300.0
    )
    config = th.HedgerConfig(
        hedge_after=1.0, budget=None, throttle=RetryThrottle(), outlier_detection=outlier
    )
    hedger = th.Hedger(fleet.sources(), config)
    while hedger.statistics().throttle_tokens:
        await run(hedger.stream(None))
    before = hedger.statistics()
    reports = [await run(hedger.stream(None)) for _ in range(12)]
    after = hedger.statistics()
    assert after.attempts - before.attempts == 12
    assert before.ejected == after.ejected == ("a",)  # at most a third of 4 replicas: one
    assert [[a.replica for a in r.attempts] for r in reports] == [["b"]] * 12
    assert after.failover_throttle_refusals - before.failover_throttle_refusals == 12


async def test_failover_refusals_reach_the_instrumentation(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    fleet = Fleet(["a", "b"], table(FAILING))
    config = th.HedgerConfig(
        hedge_after=1.0, budget=None, throttle=RetryThrottle(max_tokens=2), outlier_detection=None
    )
    hooks = [PrometheusHook(registry), LoggingHook()]
    hedger = th.Hedger(fleet.sources(), config, on_event=hooks)
    caplog.set_level(logging.INFO, logger="trio_hedge")
    # The first request's failover goes on credit; its second failure leaves 1 token, at
    # max_tokens / 2: the second request's failover is refused.
    for _ in range(2):
        await run(hedger.stream(None))
    value = registry.get_sample_value
    assert value("trio_hedge_failovers_refused_total", {"reason": "throttle"}) == 1
    assert value("trio_hedge_hedges_refused_total", {"reason": "throttle"}) is None
    (line,) = [r.getMessage() for r in caplog.records if "failover_refused" in r.getMessage()]
    assert "reason=throttle" in line


async def test_failover_refusals_are_span_events(autojump_clock: trio.testing.MockClock) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from trio_hedge.instrumentation import OpenTelemetryHook

    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    fleet = Fleet(["a", "b"], table(FAILING))
    config = th.HedgerConfig(
        hedge_after=1.0, budget=None, throttle=RetryThrottle(max_tokens=2), outlier_detection=None
    )
    hedger = th.Hedger(fleet.sources(), config, on_event=[OpenTelemetryHook(provider)])
    for _ in range(2):  # the second request's failover is refused (as above)
        await run(hedger.stream(None))
    request = [s for s in spans.get_finished_spans() if s.parent is None][-1]
    events = [(e.name, dict(e.attributes or {})) for e in request.events]
    assert ("failover_refused", {"trio_hedge.reason": "throttle"}) in events


# -- the budget is spent by backups that start, not by checks ------------------------------------


async def test_budget_spent_when_the_backup_starts(autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet(["a", "b"], table(Script(ttft=0.5, tokens=1), a=Script(ttft=5.0, tokens=1)))
    budget = HedgeBudget(ratio=0.1, min_per_second=0.1, window=10.0)  # a floor of 1 backup
    config = th.HedgerConfig(
        hedge_after=1.0, budget=budget, throttle=None, outlier_detection=None, pick="in_order"
    )
    hedger = th.Hedger(fleet.sources(), config)
    # A check that is not followed by a start (the race committed first) costs nothing.
    planner = hedger.stream(None)._planner
    assert [planner.may_hedge() for _ in range(3)] == [True] * 3
    assert hedger.statistics().budget_window == (0, 0)
    # A backup that starts spends it: the floor's one backup is gone.
    report = await run(hedger.stream(None))
    assert [(a.replica, a.trigger) for a in report.attempts] == [("a", "primary"), ("b", "hedge")]
    assert hedger.statistics().budget_window == (1, 1)
    report = await run(hedger.stream(None))
    assert (len(report.attempts), report.hedges_refused) == (1, 1)
    stats = hedger.statistics()
    assert (stats.budget_window, stats.budget_refusals, stats.hedges_sent) == ((2, 1), 1, 1)


async def test_failovers_do_not_spend_the_budget(autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet(["a", "b"], table(Script(ttft=0.5, tokens=1), a=Fail(at=0.25)))
    budget = HedgeBudget(ratio=0.1, min_per_second=0.1, window=10.0)  # a floor of 1 backup
    config = th.HedgerConfig(
        hedge_after=1.0, budget=budget, throttle=None, outlier_detection=None, pick="in_order"
    )
    hedger = th.Hedger(fleet.sources(), config)
    report = await run(hedger.stream(None))
    assert [(a.replica, a.trigger) for a in report.attempts] == [
        ("a", "primary"),
        ("b", "failover"),
    ]
    assert hedger.statistics().budget_window == (1, 0)


async def test_only_retryable_failures_take_throttle_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The request's own fault (a 400) says nothing about the fleet: it takes no token.
    fleet = Fleet(["a", "b"], table(Fail(at=0.1, kind=th.errors.ErrorKind.INVALID_REQUEST)))
    throttle = RetryThrottle(max_tokens=10.0, token_ratio=0.1)
    config = th.HedgerConfig(
        hedge_after=1.0, budget=None, throttle=throttle, outlier_detection=None, pick="in_order"
    )
    hedger = th.Hedger(fleet.sources(), config)
    for _ in range(3):
        report = await run(hedger.stream(None))
        assert isinstance(report.error, th.FatalAttemptError)
    assert hedger.statistics().throttle_tokens == 10.0


@pytest.mark.parametrize(
    ("backups", "early", "allowed"),
    [
        # 100 requests at ratio 0.1, no floor: a capacity of 10 backups in the window.
        (0, True, True),
        (4, True, True),  # the 5th early backup fits: 5 <= 10 / 2
        (5, True, False),  # a 6th early one would eat into the fleet's half
        (5, False, True),  # the fleet's own backups may use the rest
        (9, False, True),
        (10, False, False),
    ],
)
def test_early_backups_use_at_most_half_the_budget(
    backups: int, early: bool, allowed: bool
) -> None:
    state = BudgetState(HedgeBudget(ratio=0.1, min_per_second=0.0, window=60.0))
    for _ in range(100):
        state.request(0.0)
    for _ in range(backups):
        state.spend(0.0)
    assert state.allows(0.0, early=early) is allowed
