"""Hedging by priority: the budget keeps a share for the higher classes in its window, so a
low-priority flood of stuck requests cannot spend the backups a high-priority request needs
(failovers are not touched); ``queued=`` reports a wait before the race, never a TTFT; an
upstream's ``x-should-retry`` is honoured before the status rules."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.errors import ErrorKind
from trio_hedge.events import EventKind, HedgeEvent
from trio_hedge.policy import HedgeBudget
from trio_hedge.policy._budget import BudgetState
from trio_hedge.sources import AttemptInfo
from trio_hedge.sources.openai import classify_http_error

from .fleet import Fail, Fleet, run
from .scripted import Script

# -- the budget's arithmetic ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("priority", "top", "backups", "allowed"),
    [
        # capacity: 0.1 x 100 requests = 10 backups; a lower class may use 5 of them.
        (0, 0, 9, True),  # no higher class in the window: the whole budget
        (0, 3, 4, True),
        (0, 3, 5, False),  # the other half is kept for class 3
        (2, 3, 5, False),  # any class below the top
        (3, 3, 9, True),  # the top class: the whole budget
        (3, 3, 10, False),
        (None, 3, 9, True),  # classes not looked at (the budget check itself)
    ],
)
def test_lower_classes_leave_the_reserve_to_the_top_one(
    priority: int | None, top: int, backups: int, allowed: bool
) -> None:
    state = BudgetState(HedgeBudget(ratio=0.1, min_per_second=0.0, window=60.0))
    for _ in range(99):
        state.request(0.0, 0)
    state.request(0.0, top)
    for _ in range(backups):
        state.spend(0.0)
    assert state.allows(0.0, priority=priority) is allowed


def test_the_top_class_leaves_the_window_with_its_requests() -> None:
    state = BudgetState(HedgeBudget(ratio=0.1, min_per_second=0.0, window=10.0, slots=10))
    state.request(0.0, 5)
    for _ in range(100):
        state.request(5.0, 0)
    assert state.top_priority(9.9) == 5
    assert state.top_priority(10.0) == 0  # the slot of t=0 has left the window
    for _ in range(6):
        state.spend(10.0)
    assert state.allows(10.0, priority=0)


def test_priority_reserve_is_validated() -> None:
    with pytest.raises(ValueError, match="priority_reserve must be <= 1"):
        HedgeBudget(priority_reserve=1.5)
    with pytest.raises(ValueError, match="priority_reserve must be >= 0"):
        HedgeBudget(priority_reserve=-0.1)


# -- a low-priority flood and the high-priority rescues --------------------------------------

STUCK = Script(ttft=30.0, tokens=1)  # a primary behind someone's long prefill
FAST = Script(ttft=0.1, tokens=1)


def _behave(name: str, info: AttemptInfo) -> Script:
    """Replica "a" is every request's primary (in order); the ones named stuck-* are stuck
    there, and "b" answers any backup at once."""
    if name == "b":
        return FAST
    return STUCK if info.request_id.startswith("stuck-") else FAST


async def _flood(priority_reserve: float) -> tuple[int, int, list[HedgeEvent]]:
    """One high-priority request (class 5) that is not stuck, then 100 stuck low-priority
    ones (class 0) 10 ms apart, then 20 stuck high-priority ones: ``(high rescued, low
    rescued, the refusal events)``."""
    budget = HedgeBudget(
        ratio=0.5, min_per_second=0.1, window=60.0, priority_reserve=priority_reserve
    )
    fleet = Fleet(["a", "b"], _behave)
    config = th.HedgerConfig(
        hedge_after=0.5, budget=budget, throttle=None, outlier_detection=None, pick="in_order"
    )
    events: list[HedgeEvent] = []
    hedger = th.Hedger(fleet.sources(), config, on_event=[events.append])
    reports: dict[str, th.Report] = {}

    async def one(request_id: str, priority: int) -> None:
        reports[request_id] = await run(
            hedger.stream(None, request_id=request_id, priority=priority)
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "ok-high", 5)
        await trio.sleep(1.0)
        for i in range(100):
            nursery.start_soon(one, f"stuck-low-{i}", 0)
            await trio.sleep(0.01)
        await trio.sleep(3.0)
        for i in range(20):
            nursery.start_soon(one, f"stuck-high-{i}", 5)
            await trio.sleep(0.01)
    rescued = {
        kind: sum(
            1
            for rid, r in reports.items()
            if rid.startswith(f"stuck-{kind}") and r.winner_replica == "b" and r.hedged
        )
        for kind in ("high", "low")
    }
    refusals = [e for e in events if e.kind is EventKind.HEDGE_REFUSED]
    return rescued["high"], rescued["low"], refusals


async def test_a_high_class_keeps_its_rescues_while_a_low_flood_spends_the_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    high, low, refusals = await _flood(priority_reserve=0.5)
    # Capacity when the flood hedges: 0.5 x 101 requests + 0.1/s x 60 s = 56.5 backups; the
    # low class may take it down to half of that, 28.25: 28 low rescues, and the 20 high
    # requests find 0.5 x 121 + 6 - 28 = 38.5 left for them.
    assert (high, low) == (20, 28)
    reasons = {(e.request_id or "").rsplit("-", 1)[0]: e.reason for e in refusals}
    assert reasons == {"stuck-low": "priority"}
    assert len(refusals) == 72

    # The control: classes sharing the budget alike, the flood spends what the high class
    # needed (fewer than 19 of its 20 stuck requests rescued).
    high, low, refusals = await _flood(priority_reserve=0.0)
    assert (high, low) == (10, 56)
    assert {e.reason for e in refusals} == {"budget"}


async def test_priority_refusals_are_counted(autojump_clock: trio.testing.MockClock) -> None:
    budget = HedgeBudget(ratio=0.1, min_per_second=0.0, window=60.0)
    fleet = Fleet(["a", "b"], _behave)
    config = th.HedgerConfig(
        hedge_after=0.5, budget=budget, throttle=None, outlier_detection=None, pick="in_order"
    )
    hedger = th.Hedger(fleet.sources(), config)
    async with trio.open_nursery() as nursery:
        for i in range(19):
            nursery.start_soon(run, hedger.stream(None, request_id=f"ok-{i}"))
        nursery.start_soon(run, hedger.stream(None, request_id="ok-top", priority=9))
        await trio.sleep(0.01)
        # 20 requests: 2 backups in all, 1 for the lower classes; the first stuck one takes
        # it, the second is refused for the reserve.
        nursery.start_soon(run, hedger.stream(None, request_id="stuck-1"))
        nursery.start_soon(run, hedger.stream(None, request_id="stuck-2"))
    stats = hedger.statistics()
    assert (stats.hedges_sent, stats.priority_refusals, stats.budget_refusals) == (1, 1, 0)
    assert stats.hedges_refused == 1


async def test_failovers_ignore_the_priority_reserve(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A low-class request whose primary fails still fails over with the budget at its
    reserve (the budget bounds hedges, not failovers)."""
    budget = HedgeBudget(ratio=0.1, min_per_second=0.0, window=60.0)

    def behave(name: str, info: AttemptInfo) -> Script | Fail:
        if info.request_id == "failing" and name == "a":
            return Fail(at=0.1)
        return _behave(name, info)

    fleet = Fleet(["a", "b"], behave)
    config = th.HedgerConfig(
        hedge_after=0.5, budget=budget, throttle=None, outlier_detection=None, pick="in_order"
    )
    hedger = th.Hedger(fleet.sources(), config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, hedger.stream(None, request_id="ok-top", priority=9))
        await trio.sleep(0.01)
        report = await run(hedger.stream(None, request_id="failing"))
    assert report.winner_replica == "b" and report.attempts[1].trigger == "failover"


# -- queued: a wait before the race ------------------------------------------------------------


async def test_queued_is_reported_and_is_no_ttft(autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet(["a"], lambda _n, _i: FAST)
    hedger = th.Hedger(fleet.sources(), th.HedgerConfig(hedge_after=None))
    report = await run(hedger.stream(None, queued=1.25))
    assert report.queue_wait == 1.25
    assert report.ttft == pytest.approx(0.1)
    assert report.to_dict()["queue_wait"] == 1.25
    assert (await run(hedger.stream(None))).queue_wait is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"priority": -1}, ValueError, "priority must be from 0 to 9"),
        ({"priority": 10}, ValueError, "priority must be from 0 to 9"),
        ({"priority": True}, TypeError, "priority must be an int"),
        ({"priority": 1.0}, TypeError, "priority must be an int"),
        ({"queued": -0.5}, ValueError, "queued must be finite seconds >= 0"),
        ({"queued": float("nan")}, ValueError, "queued must be finite seconds >= 0"),
        ({"queued": "1"}, TypeError, "queued must be seconds"),
    ],
)
def test_priority_and_queued_are_checked_before_any_io(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    hedger = th.Hedger([th.Replica("http://127.0.0.1:9/v1")])
    with pytest.raises(error, match=match):
        hedger.stream({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, **kwargs)  # type: ignore[arg-type]


# -- x-should-retry ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "header", "retryable", "should_retry", "repeatable"),
    [
        (503, None, True, None, True),
        (503, "false", True, False, False),  # another replica may help; this one, no more
        (503, " False ", True, False, False),
        (400, "true", True, True, True),  # the server says a retry can help
        (400, None, False, None, True),
        (429, "true", True, True, True),
        (503, "maybe", True, None, True),  # not understood: the status rules
        (401, "true", True, True, False),  # a bad key stays its replica's fault
    ],
)
def test_x_should_retry_comes_before_the_status_rules(
    status: int, header: str | None, retryable: bool, should_retry: bool | None, repeatable: bool
) -> None:
    headers = {} if header is None else {"x-should-retry": header}
    error = classify_http_error(status, headers, b'{"error": {"message": "no"}}')
    assert (error.retryable, error.should_retry, error.repeatable) == (
        retryable,
        should_retry,
        repeatable,
    )
    assert error.to_dict()["should_retry"] == should_retry


@pytest.mark.parametrize("should_retry", [None, False])
async def test_a_replica_that_said_do_not_retry_is_not_tried_again(
    autojump_clock: trio.testing.MockClock, should_retry: bool | None
) -> None:
    """Two attempts per replica allowed: a replica that failed with ``x-should-retry:
    false`` takes one; without the header it takes both (the control). The other replica
    is tried either way."""

    def behave(name: str, info: AttemptInfo) -> Fail:
        return Fail(at=0.1, kind=ErrorKind.OVERLOADED, should_retry=should_retry)

    fleet = Fleet(["gw", "other"], behave)
    config = th.HedgerConfig(
        hedge_after=None,
        attempts_per_replica=2,
        budget=None,
        throttle=None,
        outlier_detection=None,
        pick="in_order",
    )
    report = await run(th.Hedger(fleet.sources(), config).stream(None))
    tried = [a.replica for a in report.attempts]
    assert tried == (["gw", "other"] if should_retry is False else ["gw", "other", "gw", "other"])
    # hedged_stream's fixed plan honours it too.
    fleet = Fleet(["gw", "other"], behave)
    policy = th.HedgePolicy(hedge_after=None, attempts_per_replica=2)
    report = await run(th.hedged_stream(None, fleet.sources(), policy))
    tried = [a.replica for a in report.attempts]
    assert tried == (["gw", "other"] if should_retry is False else ["gw", "other", "gw", "other"])
