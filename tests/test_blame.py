"""Who is blamed for what (``policy/_blame.py``): many callers share one Hedger, and what one
caller sends never changes what another gets unless the evidence of that request shows a
replica was at fault. Each rule has a scenario table in virtual time, and where the point is
isolation a second, measured caller whose decisions, hedges and TTFT are identical to a run
without the misbehaving one."""

from __future__ import annotations

import contextlib
import json
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.errors import ErrorKind
from trio_hedge.policy import Attribution, OutlierDetection, RetryThrottle
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.testing import Behaviour, FakeReplica, RequestRecord

from . import misbehaving as mb
from .fleet import Fail, Fleet, run
from .scripted import Script

FAST = Script(ttft=0.2, tokens=2, gap=0.1)
#: What the measured caller's requests record: every attempt's replica, trigger, start and
#: outcome, and the TTFT the caller saw.
Trace = tuple[tuple[tuple[str, str, float | None, O], ...], float | None]


def _config(**changes: Any) -> th.HedgerConfig:
    fields: dict[str, Any] = {"hedge_after": 1.0, "pick": "in_order"}
    fields.update(changes)
    return th.HedgerConfig(**fields)


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 9)  # the clock's offset: float noise


def _trace(report: th.Report) -> Trace:
    attempts = tuple(
        (a.replica, a.trigger, _round(a.started_at), a.outcome) for a in report.attempts
    )
    return attempts, _round(report.ttft)


def _every(
    period: float, count: int, *, start: float = 1.0, group: str = "m"
) -> Callable[[th.Hedger, list[Trace]], Awaitable[None]]:
    """A measured caller: ``count`` requests for ``group``, one every ``period`` seconds from
    ``start`` (ids ``<group><i>``), each one's trace appended to ``out``."""

    async def measured(hedger: th.Hedger, out: list[Trace]) -> None:
        t0 = trio.current_time()
        for i in range(count):
            await trio.sleep_until(t0 + period * i + start)
            out.append(
                _trace(await run(hedger.stream(None, group=group, request_id=f"{group}{i}")))
            )

    return measured


async def _with_and_without(
    make: Callable[[], th.Hedger],
    measured: Callable[[th.Hedger, list[Trace]], Awaitable[None]],
    misbehaving: Callable[[th.Hedger], Awaitable[None]],
) -> tuple[list[Trace], list[Trace], th.Hedger]:
    """The measured caller's traces alone, then beside the misbehaving caller (each on a new
    Hedger, from the same virtual time offset)."""
    alone: list[Trace] = []
    await measured(make(), alone)
    start = trio.current_time()
    await trio.sleep_until(start + 1000.0)  # every cooldown and ejection of before is over
    beside: list[Trace] = []
    hedger = make()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(misbehaving, hedger)
        await measured(hedger, beside)
    return alone, beside, hedger


# -- 1. an error is the request's unless the same request's other attempts show otherwise ------

NOT_FOUND = Fail(at=0.05, kind=ErrorKind.NOT_FOUND)
AUTH = Fail(at=0.05, kind=ErrorKind.AUTH)
QUOTA = Fail(at=0.05, kind=ErrorKind.QUOTA_EXCEEDED)
OVERLOADED = Fail(at=0.05, kind=ErrorKind.OVERLOADED)

ATTRIBUTION = [
    # (name, a's answer, b's answer, attribution, a's state, failures (a, b), throttle tokens)
    # An ejection for one model leaves a replica "degraded": it serves the others.
    ("404 everywhere: the caller's", NOT_FOUND, NOT_FOUND, Attribution(), "healthy", (0, 0), 10),
    ("401 everywhere: the caller's", AUTH, AUTH, Attribution(), "healthy", (0, 0), 10),
    ("quota everywhere: the caller's", QUOTA, QUOTA, Attribution(), "healthy", (0, 0), 10),
    ("404 at a, b serves: a's", NOT_FOUND, FAST, Attribution(), "degraded", (1, 0), 10),
    ("401 at a, b serves: a's", AUTH, FAST, Attribution(), "degraded", (1, 0), 10),
    (
        "401 at a, b serves, keys forwarded: the caller's",
        AUTH,
        FAST,
        Attribution(caller={"auth"}),
        "healthy",
        (0, 0),
        10,
    ),
    (
        "404 at a, b overloaded: not known, so nobody's",
        NOT_FOUND,
        OVERLOADED,
        Attribution(),
        "healthy",
        (0, 1),
        9,
    ),
    (
        "404 everywhere, a trusted caller: a's at once",
        NOT_FOUND,
        NOT_FOUND,
        Attribution(replica={ErrorKind.NOT_FOUND}),
        "degraded",
        (1, 1),  # b is the last replica in: never ejected (the cap), still a failure
        10,
    ),
    ("503 everywhere: each replica's", OVERLOADED, OVERLOADED, Attribution(), "healthy", (1, 1), 8),
]


@pytest.mark.parametrize(
    ("name", "a", "b", "attribution", "state", "failures", "tokens"),
    ATTRIBUTION,
    ids=[row[0] for row in ATTRIBUTION],
)
async def test_whose_fault_an_error_is(
    name: str,
    a: Script | Fail,
    b: Script | Fail,
    attribution: Attribution,
    state: str,
    failures: tuple[int, int],
    tokens: float,
    autojump_clock: trio.testing.MockClock,
) -> None:
    answers = {"a": a, "b": b}
    fleet = Fleet(["a", "b"], lambda replica, _info: answers[replica])
    hedger = th.Hedger(fleet.sources(), _config(attribution=attribution))
    report = await run(hedger.stream(None, group="m"))
    assert [x.trigger for x in report.attempts] == ["primary", "failover"]  # at once, as ever
    stats = hedger.statistics()
    replica_a, replica_b = stats.replicas
    assert (replica_a.state, replica_b.state) == (state, "healthy")
    assert replica_a.ejected_models == (("m",) if state == "degraded" else ())
    assert (replica_a.failures, replica_b.failures) == failures
    assert stats.throttle_tokens == pytest.approx(tokens)


async def test_a_bad_request_changes_nothing_another_caller_gets(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a is stuck for the measured caller's model (1.5 s), b answers at once: each measured
    # request is hedged at 1.0 s and b wins. The misbehaving caller asks for a model no
    # replica serves (404 from both) and forwards a key every replica refuses (401), ten
    # times: on bcbad18 the first 404 ejected a, and the throttle (6 tokens) was drained, so
    # the measured requests went elsewhere or were not hedged.
    def behave(replica: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if info.request_id.startswith("bad-404"):
            return NOT_FOUND
        if info.request_id.startswith("bad-401"):
            return AUTH
        return Script(ttft=1.5, tokens=2) if replica == "a" else FAST

    def make() -> th.Hedger:
        config = _config(throttle=RetryThrottle(max_tokens=6))
        return th.Hedger(Fleet(["a", "b"], behave).sources(), config)

    async def measured(hedger: th.Hedger, out: list[Trace]) -> None:
        t0 = trio.current_time()
        for i in range(4):  # (a fifth slow loss in a row would eject a: its own evidence)
            await trio.sleep_until(t0 + 5.0 * i + 0.5)
            out.append(_trace(await run(hedger.stream(None, group="m", request_id=f"m{i}"))))

    async def misbehaving(hedger: th.Hedger) -> None:
        for i in range(10):
            kind = "404" if i % 2 else "401"
            await run(hedger.stream(None, group="m", request_id=f"bad-{kind}-{i}"))
            await trio.sleep(2.0)

    alone, beside, hedger = await _with_and_without(make, measured, misbehaving)
    assert alone == beside
    assert alone[0] == ((("a", "primary", 0.0, O.CANCELLED), ("b", "hedge", 1.0, O.WON)), 1.2)
    stats = hedger.statistics()
    assert stats.ejected == () and stats.throttle_tokens == 6


def test_attribution_is_validated() -> None:
    assert Attribution(caller=["auth", ErrorKind.RATE_LIMIT]).caller == frozenset(
        {ErrorKind.AUTH, ErrorKind.RATE_LIMIT}
    )
    with pytest.raises(ValueError, match="caller unknown error kind"):
        Attribution(caller={"nope"})
    with pytest.raises(TypeError, match="caller must be a collection"):
        Attribution(caller="auth")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^caller holds only kinds another attempt may fix"):
        Attribution(caller={ErrorKind.INVALID_REQUEST})
    with pytest.raises(ValueError, match=r"^replica holds only"):
        Attribution(replica={ErrorKind.SERVER_ERROR})
    with pytest.raises(ValueError, match="must not share"):
        Attribution(caller={"auth"}, replica={"auth"})
    with pytest.raises(TypeError, match="attribution"):
        th.HedgerConfig(attribution={"caller": ["auth"]})  # type: ignore[arg-type]


# -- 2. state that depends on the model is kept per (replica, model), bounded ------------------


async def test_pushback_for_one_model_does_not_cool_another(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a rate-limits model x for 30 s. A request for model y still goes to a first (on
    # bcbad18 it skipped a: the cooldown was per URL); one for x goes to b.
    # (10 s: a wait; past max_pushback_wait it would be an outage, an ejection for x.)
    limited = Fail(at=0.05, kind=ErrorKind.RATE_LIMIT, retry_after=10.0)

    def behave(replica: str, info: th.sources.AttemptInfo) -> Script | Fail:
        return limited if replica == "a" and info.request_id.startswith("x") else FAST

    def make() -> th.Hedger:
        return th.Hedger(Fleet(["a", "b"], behave).sources(), _config())

    async def measured(hedger: th.Hedger, out: list[Trace]) -> None:
        t0 = trio.current_time()
        for i in range(5):
            await trio.sleep_until(t0 + 2.0 * i + 1.0)
            out.append(_trace(await run(hedger.stream(None, group="y", request_id=f"y{i}"))))

    async def misbehaving(hedger: th.Hedger) -> None:
        report = await run(hedger.stream(None, group="x", request_id="x0"))
        assert [x.replica for x in report.attempts] == ["a", "b"]
        assert hedger.statistics().cooling == ("a",)
        await trio.sleep(1.0)
        report = await run(hedger.stream(None, group="x", request_id="x1"))
        assert [x.replica for x in report.attempts] == ["b"]  # x still cools at a

    alone, beside, hedger = await _with_and_without(make, measured, misbehaving)
    assert alone == beside
    assert {attempts for attempts, _ in alone} == {(("a", "primary", 0.0, O.WON),)}
    assert hedger.statistics().replicas[0].cooling_models == ("x",)  # x0's 10 s


async def test_client_chosen_models_never_grow_the_state(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every request names a new model, and a rate-limits each one: the (replica, model)
    # records stay at the cap, the oldest forgotten first; the delay learner's groups too.
    monkeypatch.setattr("trio_hedge.policy._fleet.MODEL_STATES", 8)
    limited = Fail(at=0.05, kind=ErrorKind.RATE_LIMIT, retry_after=10.0)
    fleet = Fleet(["a", "b"], lambda replica, _info: limited if replica == "a" else FAST)
    hedger = th.Hedger(fleet.sources(), th.HedgerConfig(pick="in_order"))
    for i in range(300):
        await run(hedger.stream(None, group=f"model-{i}"))
    assert len(hedger._fleet.models) == 8
    assert hedger.statistics().replicas[0].cooling_models == tuple(
        sorted(f"model-{i}" for i in range(292, 300))
    )
    model = hedger._fleet.model
    assert model is not None and len(model._groups) == 256


async def test_an_ejection_for_another_model_keeps_no_failing_replica_in(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # b answers 503 for everyone's model m, a serves it; a serves no model x, which b does.
    # The misbehaving caller asks for x once, hedged at once: a's 404, b serves, so a is
    # ejected for x (its own evidence, for x). On the merge of issue 16 that ejection filled
    # the fleet-wide cap (1 of 2): b, failing every measured request, was never ejected,
    # and each measured request paid b's 503 before a answered (TTFT 0.25 s, not 0.2 s).
    def behave(replica: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if info.request_id.startswith("x"):
            return NOT_FOUND if replica == "a" else FAST
        return OVERLOADED if replica == "b" else FAST

    def make() -> th.Hedger:
        return th.Hedger(Fleet(["b", "a"], behave).sources(), _config())

    async def misbehaving(hedger: th.Hedger) -> None:
        await run(hedger.stream(None, group="x", request_id="x0", hedge_after=0.0))
        assert hedger.statistics().replicas[1].ejected_models == ("x",)

    alone, beside, hedger = await _with_and_without(make, _every(1.0, 12), misbehaving)
    assert alone == beside
    through_b = (("b", "primary", 0.0, O.FAILED), ("a", "failover", 0.05, O.WON)), 0.25
    straight = (("a", "primary", 0.0, O.WON),), 0.2
    assert alone == [through_b] * 5 + [straight] * 7  # b ejected after its fifth 503
    b, a = hedger.statistics().replicas
    assert (b.times_ejected, a.times_ejected) == (1, 1)  # a for x only


# -- 3. the throttle bounds storms of the fleet, never failover to a replica that answers -------


@pytest.mark.parametrize("outlier", [OutlierDetection(), None], ids=["ejection", "no ejection"])
async def test_one_replica_down_every_request_is_served(
    outlier: OutlierDetection | None, autojump_clock: trio.testing.MockClock
) -> None:
    # The primary answers 503 for 60 s, the fallback is healthy, one request every 4 s. On
    # bcbad18 the primary's failures drained the shared throttle: 7 of 15 requests in the
    # outage got the 503. Now each failure a failover repairs is given back.
    t0 = trio.current_time()

    def behave(replica: str, _info: th.sources.AttemptInfo) -> Script | Fail:
        if replica == "a" and trio.current_time() - t0 < 60.0:
            return OVERLOADED
        return FAST

    hedger = th.Hedger(Fleet(["a", "b"], behave).sources(), _config(outlier_detection=outlier))
    winners: list[tuple[float, str | None]] = []
    for i in range(30):
        await trio.sleep_until(t0 + 4.0 * i)
        report = await run(hedger.stream(None))
        assert report.error is None, i
        winners.append((4.0 * i, report.winner_replica))

    back = min(t for t, winner in winners if winner == "a" and t >= 60.0)
    # Within 30 s of its recovery: at once without ejection; with it, when its second
    # ejection (5 failures at 0-16 s: 10 s; 5 more at 28-44 s: 20 s) ends at 64.05 s.
    assert back - 60.0 == (8.0 if outlier is not None else 0.0)
    assert all(winner == "a" for t, winner in winners if t >= back)
    assert hedger.statistics().failovers_refused == 0


@pytest.mark.parametrize(("replicas", "allowed"), [(2, 3), (4, 4)])
async def test_a_failing_fleet_gets_one_attempt_per_request_once_the_throttle_closes(
    replicas: int, allowed: int, autojump_clock: trio.testing.MockClock
) -> None:
    # Every replica fails: attempts beyond the first stay within the throttle's allowance
    # (failures while tokens > max_tokens / 2: 5 of the default 10, primaries included; no
    # hedges: the failures are fast), plus the credit: each request's first failure goes on
    # credit, decided at the failure, and is debited at its end, unserved. 2 replicas: 10 →
    # 9 → 8, 8 → 7 → 6, 6 → 5 → 4 (the third request's failover allowed at 6 > 5), closed;
    # 4 replicas: 10 → 9 → 8 → 7 → 6, then one more failover at 6 > 5: 5 → 4.
    names = [f"r{i}" for i in range(replicas)]
    hedger = th.Hedger(Fleet(names, lambda *_: OVERLOADED).sources(), _config())
    extra = 0
    for _ in range(50):
        report = await run(hedger.stream(None))
        extra += report.backups_sent
    assert extra == allowed <= 5
    assert hedger.statistics().throttle_tokens == 0


# -- 4. a caller's own shorter hedge delay never makes a replica slow ----------------------------


SLOW = [
    # (name, a's TTFT, the request's hedge_after, a's failures in a row after 5 requests)
    ("X-Hedge-After 0: b first by 1 ms, a not slow", 0.200, 0.0, 0),
    ("hedge_after 0.5 below the fleet's 1.0: a not slow", 1.2, 0.5, 0),
    ("the fleet's own delay: a slow, not ejected: b is all it can hedge to", 1.5, None, 0),
]


@pytest.mark.parametrize(
    ("name", "ttft", "hedge_after", "run_length"), SLOW, ids=[row[0] for row in SLOW]
)
async def test_a_short_hedge_delay_is_the_callers_choice(
    name: str,
    ttft: float,
    hedge_after: float | None,
    run_length: int,
    autojump_clock: trio.testing.MockClock,
) -> None:
    behaviour = {"a": Script(ttft=ttft, tokens=2), "b": Script(ttft=0.199, tokens=2)}
    fleet = Fleet(["a", "b"], lambda replica, _info: behaviour[replica])
    hedger = th.Hedger(fleet.sources(), _config())
    for _ in range(5):
        report = await run(hedger.stream(None, hedge_after=hedge_after))
        assert report.winner_replica == "b" and report.hedged
    a = hedger.statistics().replicas[0]
    # Slow only past the fleet's own delay; never ejected for it with two replicas (busy is
    # not broken: test_busy_replicas_are_not_ejected_for_losing_races).
    slow = 5 if hedge_after is None else 0
    assert (a.state, a.times_ejected, a.slow_attempts) == ("healthy", 0, slow)
    assert (a.consecutive_failures, a.failures, a.lost_races) == (run_length, 0, 5)


async def test_another_callers_double_sends_do_not_move_the_measured_callers_primary(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The misbehaving caller sends X-Hedge-After: 0 on every request; b is first by 1 ms.
    # On bcbad18 five of them ejected a, and the measured caller's primaries went to b.
    def behave(replica: str, info: th.sources.AttemptInfo) -> Script:
        if info.request_id.startswith("zero"):
            return Script(ttft=0.200 if replica == "a" else 0.199, tokens=2)
        return Script(ttft=0.3, tokens=2)

    def make() -> th.Hedger:
        return th.Hedger(Fleet(["a", "b"], behave).sources(), _config())

    async def measured(hedger: th.Hedger, out: list[Trace]) -> None:
        t0 = trio.current_time()
        for i in range(4):
            await trio.sleep_until(t0 + 3.0 * i + 5.0)
            out.append(_trace(await run(hedger.stream(None, request_id=f"m{i}"))))

    async def misbehaving(hedger: th.Hedger) -> None:
        for i in range(12):
            await run(hedger.stream(None, request_id=f"zero{i}", hedge_after=0.0))
            await trio.sleep(0.5)

    alone, beside, _ = await _with_and_without(make, measured, misbehaving)
    assert alone == beside
    assert {attempts for attempts, _ in alone} == {(("a", "primary", 0.0, O.WON),)}


@pytest.mark.parametrize("hostile_per_second", [2.0, 10.0])
async def test_another_callers_double_sends_leave_the_budget_the_measured_caller_needs(
    hostile_per_second: float, autojump_clock: trio.testing.MockClock
) -> None:
    # The hedge budget is shared: a caller sending X-Hedge-After: 0 on every request spent
    # it, and the measured caller's stuck requests (a: TTFT 1.5 s, b: 0.2 s, hedged at the
    # fleet's 1 s) went unhedged: 6 of 20 rescued at 2 req/s, 2 of 20 at 10 req/s. Backups
    # sent before the fleet's own delay may now use only half the budget's capacity.
    def behave(replica: str, info: th.sources.AttemptInfo) -> Script:
        if info.request_id.startswith("zero"):
            return FAST
        return Script(ttft=1.5, tokens=2) if replica == "a" else FAST

    def make() -> th.Hedger:
        return th.Hedger(Fleet(["a", "b"], behave).sources(), _config(outlier_detection=None))

    async def misbehaving(hedger: th.Hedger) -> None:
        async with trio.open_nursery() as nursery:
            for i in range(int(125 * hostile_per_second)):
                nursery.start_soon(
                    run, hedger.stream(None, group="m", request_id=f"zero{i}", hedge_after=0.0)
                )
                await trio.sleep(1 / hostile_per_second)

    alone, beside, hedger = await _with_and_without(
        make, _every(6.0, 20, start=3.0, group="m"), misbehaving
    )
    assert alone == beside
    assert all(len(attempts) == 2 for attempts, _ in alone)  # each one rescued by a backup
    stats = hedger.statistics()
    assert stats.budget_refusals > 0  # the hostile caller's own double sends were held back


# -- 5. a lost race only moves a replica's latency estimate up -----------------------------------


async def test_a_lost_race_never_makes_the_loser_look_fast(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a has a 3 s TTFT, b 0.3 s; then a loses a double send after 50 ms. On bcbad18 that
    # censored 0.05 s pulled a's estimate down to about 0.1 s, below b's, and a (3 s)
    # became the next primary.
    scripts = {"a": Script(ttft=3.0, tokens=1), "b": Script(ttft=0.3, tokens=1)}
    fleet = Fleet(["a", "b"], lambda replica, _info: scripts[replica])
    config = th.HedgerConfig(hedge_after=None, budget=None, outlier_detection=None)
    hedger = th.Hedger(fleet.sources(), config)
    t0 = trio.current_time()
    assert (await run(hedger.stream(None))).winner_replica == "a"  # a tie: the first
    await trio.sleep_until(t0 + 22.6)
    assert (await run(hedger.stream(None))).winner_replica == "b"
    scripts["b"] = Script(ttft=0.05, tokens=1)
    before = hedger.statistics().replicas[0].latency
    started = trio.current_time()
    report = await run(hedger.stream(None, hedge_after=0.0))
    assert [(x.replica, x.outcome) for x in report.attempts] == [
        ("b", O.WON),
        ("a", O.CANCELLED),
    ]
    a, b = hedger.statistics().replicas
    elapsed = trio.current_time() - started
    assert a.latency == pytest.approx(before * math.exp(-elapsed / 10))  # decayed, no lower
    assert a.latency > b.latency
    assert (a.lost_races, a.failures, b.lost_races) == (1, 0, 0)
    scripts["b"] = Script(ttft=0.3, tokens=1)
    assert (await run(hedger.stream(None))).attempts[0].replica == "b"


@pytest.mark.parametrize("cancel_at", [0.0, 0.001, 0.199])
async def test_a_callers_early_cancels_do_not_move_the_learned_delay(
    cancel_at: float, autojump_clock: trio.testing.MockClock
) -> None:
    # a is stuck (1.5 s), b answers in 0.2 s; the delay is learned (fallback 1.0 s). The
    # misbehaving caller cancels each of its requests before the fleet's delay, and before
    # any replica could answer (at once, after 1 ms, 1 ms before b's first token: a request
    # served is data, of its replica, whoever sent it): on the merge of issue 16 each cancel
    # was a censored sample counted toward min_samples, so the class was "learned" after two
    # measured requests instead of eleven and its delay climbed to 1.5 s: 19 of 30 requests
    # were hedged later or not at all (TTFT 1.4-1.5 s, not 1.2 s).
    def behave(replica: str, _info: th.sources.AttemptInfo) -> Script:
        return Script(ttft=1.5, tokens=2) if replica == "a" else FAST

    def make() -> th.Hedger:
        config = _config(hedge_after=th.LearnedDelay())
        return th.Hedger(Fleet(["a", "b"], behave).sources(), config)

    async def misbehaving(hedger: th.Hedger) -> None:
        for i in range(300):
            with trio.move_on_after(cancel_at):
                await run(hedger.stream(None, group="m", request_id=f"c{i}"))
            await trio.sleep(0.3)

    alone, beside, hedger = await _with_and_without(make, _every(3.0, 30), misbehaving)
    assert alone == beside
    assert alone[0] == ((("a", "primary", 0.0, O.CANCELLED), ("b", "hedge", 1.0, O.WON)), 1.2)
    (delays,) = hedger.statistics().delays
    # The measured caller's own: each request hedged at the fallback (1.0 s), a's loss
    # censored there, b's 0.2 s exact. (Censored at the cancel, 1.2 s, the losers once
    # ratcheted the delay up to a's 1.5 s: 19 of 30 requests unhedged at 1.5 s, 41 and 11.)
    assert (delays.observations, delays.censored) == (60, 30)


CANCELS = [
    # (name, the request may hedge, the caller cancels at, (observations, censored) learned)
    ("before the fleet's delay: no sample", True, 0.5, (0, 0)),
    ("past it, hedged: the primary's, not the backup's 0.1 s", True, 1.1, (1, 1)),
    ("past it, no hedge: a sample (the replica was that slow)", False, 1.3, (1, 1)),
    ("before it, no hedge: no sample", False, 0.9, (0, 0)),
]


@pytest.mark.parametrize(
    ("name", "hedge", "cancel_at", "learned"), CANCELS, ids=[row[0] for row in CANCELS]
)
async def test_a_callers_cancel_is_a_delay_sample_only_past_the_fleets_delay(
    name: str,
    hedge: bool,
    cancel_at: float,
    learned: tuple[int, int],
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The fleet's delay is the fallback, 1.0 s; a replica answers in 1.5 s, b in 0.2 s.
    scripts = {"a": Script(ttft=1.5, tokens=2), "b": Script(ttft=0.2, tokens=2)}
    fleet = Fleet(["a", "b"], lambda replica, _info: scripts[replica])
    hedger = th.Hedger(fleet.sources(), _config(hedge_after=th.LearnedDelay()))
    with trio.move_on_after(cancel_at):
        await run(hedger.stream(None, group="m", hedge=hedge))
    delays = hedger.statistics().delays
    assert tuple((d.observations, d.censored) for d in delays) == ((learned,) if learned[0] else ())


# -- 6. hook and span state belongs to the request, not to its id ---------------------------------


async def test_two_requests_with_one_id_keep_their_own_hook_scopes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Two concurrent requests carry the same X-Request-ID: the quick one ends at 0.4 s, the
    # slow one at 2.2 s. On bcbad18 the quick one's end exited the slow one's attempt scope.
    log: list[tuple[str | None, float, float]] = []

    class Scope:
        def __init__(self, group: str | None) -> None:
            self.group = group

        def __enter__(self) -> None:
            self.entered = trio.current_time()

        def __exit__(self, *exc: object) -> None:
            log.append((self.group, self.entered, trio.current_time()))

    def hook(event: th.events.HedgeEvent) -> Scope | None:
        if event.kind is th.events.EventKind.ATTEMPT_STARTED:
            return Scope(event.group)
        return None

    scripts = iter([Script(ttft=2.0, tokens=2), Script(ttft=0.2, tokens=2)])
    fleet = Fleet(["a"], lambda _r, _info: next(scripts))
    config = th.HedgerConfig(hedge_after=None, budget=None)
    hedger = th.Hedger(fleet.sources(), config, on_event=[hook])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, hedger.stream(None, request_id="same", group="slow"))
        await trio.lowlevel.checkpoint()
        nursery.start_soon(run, hedger.stream(None, request_id="same", group="quick"))
    # Each attempt's scope is exited at its own request's end (its stream: 2 tokens, 0.1 s
    # apart), wherever the other is.
    assert sorted((g, round(a, 9), round(b, 9)) for g, a, b in log) == [
        ("quick", 0.0, 0.3),
        ("slow", 0.0, 2.1),
    ]


async def test_two_requests_with_one_id_keep_their_own_back_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The same id on two requests whose only replica fails twice: each repeat waits its own
    # jittered back-off (on bcbad18 both drew the same).
    fleet = Fleet(["a"], lambda _r, info: Fail(at=0.25) if info.number < 3 else FAST)
    backoff = th.policy.Backoff(initial=1.0)
    config = th.HedgerConfig(attempts_per_replica=3, backoff=backoff, throttle=None)
    hedger = th.Hedger(fleet.sources(), config)
    starts = []
    for _ in range(2):
        report = await run(hedger.stream(None, request_id="same"))
        starts.append([_round(x.started_at) for x in report.attempts])
    assert starts[0][0] == starts[1][0] == 0.0
    assert starts[0][1] != starts[1][1] and starts[0][2] != starts[1][2]


def test_the_gateway_says_whose_fault_errors_are() -> None:
    # A [hedger.attribution] table, like every HedgerConfig field; forwarded client keys
    # make a 401, a quota and a rate limit the client's by default.
    from trio_hedge.gateway._config import ConfigError, parse_config

    replicas = [{"base_url": "http://127.0.0.1:1/v1"}]
    config = parse_config({"replicas": replicas}, environ={})
    assert config.groups[0].hedger.attribution == Attribution()
    document = {"replicas": replicas, "auth": {"forward_client_key": True}}
    config = parse_config(document, environ={})
    caller = {ErrorKind.AUTH, ErrorKind.QUOTA_EXCEEDED, ErrorKind.RATE_LIMIT, ErrorKind.NOT_FOUND}
    assert config.groups[0].hedger.attribution.caller == caller
    document["hedger"] = {"attribution": {"caller": ["auth"], "replica": ["not_found"]}}
    config = parse_config(document, environ={})
    assert config.groups[0].hedger.attribution == Attribution(
        caller={ErrorKind.AUTH}, replica={ErrorKind.NOT_FOUND}
    )
    document["hedger"] = {"attribution": {"caller": ["nope"]}}
    with pytest.raises(ConfigError, match=r"^hedger.attribution: caller unknown error kind"):
        parse_config(document, environ={})


async def test_a_forwarded_keys_404_ejects_nothing(autojump_clock: trio.testing.MockClock) -> None:
    # A gateway forwarding clients' keys to a (no key of its own); b has its own key. The
    # misbehaving client's key may not use model m at a's provider: 404 ("does not exist or
    # you do not have access to it"), and b serves it. On the merge of issue 16 that ejected
    # a for m, for every client: the measured one's primaries went to b.
    from trio_hedge.gateway._config import parse_config

    replicas = [{"base_url": "http://127.0.0.1:1/v1"}]
    document = {"replicas": replicas, "auth": {"forward_client_key": True}}
    attribution = parse_config(document, environ={}).groups[0].hedger.attribution

    def behave(replica: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if info.request_id.startswith("restricted") and replica == "a":
            return NOT_FOUND
        return FAST

    def make() -> th.Hedger:
        config = _config(attribution=attribution)
        return th.Hedger(Fleet(["a", "b"], behave).sources(), config)

    async def misbehaving(hedger: th.Hedger) -> None:
        for i in range(5):
            report = await run(hedger.stream(None, group="m", request_id=f"restricted{i}"))
            assert [x.replica for x in report.attempts] == ["a", "b"]  # served, at once
            await trio.sleep(2.0)

    alone, beside, hedger = await _with_and_without(make, _every(2.0, 5), misbehaving)
    assert alone == beside
    assert {attempts for attempts, _ in alone} == {(("a", "primary", 0.0, O.WON),)}
    assert hedger.statistics().ejected == ()


def test_a_flood_of_new_models_does_not_forget_what_was_learned() -> None:
    # The delay learner's groups are the request's model, a client-chosen string: at the
    # cap, a group that has learned nothing goes first (on bcbad18 the least recently used,
    # so 300 one-off names pushed out the models the fleet serves).
    from trio_hedge.policy._delay import DelayModel

    model = DelayModel(th.LearnedDelay(), max_groups=8)
    for i in range(20):
        for served in ("m1", "m2"):
            model.observe(served, 0, float(i), 0.5 + i / 100, True)
    learned = {g: model.delay(g, 0, 20.0) for g in ("m1", "m2")}
    for i in range(300):
        model.observe(f"junk-{i}", 0, 20.0 + i / 100, 0.1, True)
    assert len(model._groups) == 8
    now = 23.0
    assert {g: model.delay(g, 0, now) for g in ("m1", "m2")} == learned
    assert learned["m1"] != th.LearnedDelay().fallback


# -- 7. a caller's own words, quoted back by a server, are no evidence against it -------------


def _echoing(record: RequestRecord) -> Behaviour:
    """A server that validates ``response_format`` as vLLM's pydantic models do: a 400 that
    quotes the caller's bad tag back."""
    body = record.json or {}
    tag = (body.get("response_format") or {}).get("type", "text")
    if tag in ("text", "json_object"):
        return Behaviour(ttft=0.01, tokens=2)
    return Behaviour(status=400, error_message=_quoting(tag))


def _quoting(tag: str) -> str:
    return (
        "1 validation error for ChatCompletionRequest\nresponse_format\n  Input tag "
        f"'{tag}' found using 'type' does not match any of the expected tags: 'text', "
        "'json_object'"
    )


ECHOES = [
    # (name, the caller's tag, on the merge of issue 16)
    ("LiteLLM's words: overloaded", "no healthy deployments", ErrorKind.OVERLOADED),
    ("Gemini's words: a key error", "API key not valid", ErrorKind.AUTH),
    ("a key error's words", "forbidden", ErrorKind.AUTH),
]


@pytest.mark.parametrize("source", ["http", "openai-sdk"])
@pytest.mark.parametrize(("name", "tag", "was"), ECHOES, ids=[row[0] for row in ECHOES])
async def test_a_callers_words_quoted_back_blame_no_replica(
    name: str, tag: str, was: ErrorKind, source: str
) -> None:
    # Both replicas quote a bad response_format tag back in a 400. The misbehaving caller's
    # tag is words the classifier reads as the server's: on the merge of issue 16 five such
    # requests ejected a (each "overloaded" 400 a failure in its run) or made the 400 a key
    # error, retried on b; now each is the request's own 400, fatal at once.
    good = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    bad = {**good, "response_format": {"type": tag}}

    async with (
        FakeReplica(_echoing, name="a") as a,
        FakeReplica(_echoing, name="b") as b,
        contextlib.AsyncExitStack() as clients,
    ):
        replicas: list[Any] = [th.Replica(base_url=r.url, name=r.name) for r in (a, b)]
        if source == "openai-sdk":
            openai = pytest.importorskip("openai")
            from trio_hedge.sources.openai_sdk import sdk_replicas

            made = [openai.AsyncOpenAI(base_url=r.url, api_key="sk-test") for r in (a, b)]
            for client in made:
                await clients.enter_async_context(client)
            replicas = sdk_replicas({"a": made[0], "b": made[1]})
        async with th.Hedger(replicas, _config()) as hedger:
            for _ in range(6):
                report = await run(hedger.stream(bad, request_id=str(uuid.uuid4())))
                assert [x.replica for x in report.attempts] == ["a"]
                assert isinstance(report.error, th.FatalAttemptError)
                assert report.error.error.kind is ErrorKind.INVALID_REQUEST
            served = await run(hedger.stream(good))
            stats = hedger.statistics()
    assert [x.replica for x in served.attempts] == ["a"]
    assert stats.ejected == () and stats.throttle_tokens == 10
    assert [r.failures for r in stats.replicas] == [0, 0]


def test_words_the_request_did_not_send_still_decide() -> None:
    # The same messages are the server's own when the request did not send those words.
    from trio_hedge.sources.openai import classify_http_error

    for _, tag, was in ECHOES:
        body = json.dumps({"message": f"Input tag '{tag}' found", "type": "BadRequestError"})
        sent = json.dumps({"response_format": {"type": tag}}).encode()
        other = json.dumps({"response_format": {"type": "xml"}}).encode()
        assert classify_http_error(400, {}, body.encode(), sent=other).kind is was
        assert classify_http_error(400, {}, body.encode()).kind is was
        quoted = classify_http_error(400, {}, body.encode(), sent=sent)
        assert (quoted.kind, quoted.retryable) == (ErrorKind.INVALID_REQUEST, False)
    # Escaped in the JSON the caller sent, quoted back decoded: still the caller's words.
    sent = b'{"response_format": {"type": "\\u0066orbidden"}}'
    body = b'{"message": "Input tag \'forbidden\' found"}'
    assert classify_http_error(400, {}, body, sent=sent).kind is ErrorKind.INVALID_REQUEST


@pytest.mark.parametrize(("name", "tag", "was"), ECHOES, ids=[row[0] for row in ECHOES])
def test_an_in_band_error_quoting_the_caller_is_the_requests(
    name: str, tag: str, was: ErrorKind
) -> None:
    # vLLM's in-band error (its status in "code"), in a stream and as a whole JSON answer.
    from trio_hedge.sources.openai import ChunkDecoder, decode_json_body

    error = {"object": "error", "message": _quoting(tag), "type": "BadRequestError", "code": 400}
    event = b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
    answer = json.dumps(error).encode()
    sent = json.dumps({"response_format": {"type": tag}}).encode()
    for words, kind in ((b"", was), (sent, ErrorKind.INVALID_REQUEST)):
        with pytest.raises(th.AttemptError) as streamed:
            ChunkDecoder(sent=words).feed(event)
        with pytest.raises(th.AttemptError) as whole:
            decode_json_body(200, {}, answer, sent=words)
        assert streamed.value.kind is whole.value.kind is kind


@pytest.mark.parametrize(("name", "tag", "was"), ECHOES, ids=[row[0] for row in ECHOES])
async def test_a_stream_quoting_the_caller_back_blames_no_replica(
    name: str, tag: str, was: ErrorKind
) -> None:
    # A 200 stream whose first event is vLLM's in-band error quoting the caller's tag (both
    # sources read streams through one decoder). On the merge of issue 16 "overloaded" was
    # a's failure, and a key error was retried.
    error = {"object": "error", "message": _quoting(tag), "type": "BadRequestError", "code": 400}

    async def answer(c: mb.ServerConn) -> None:
        await c.send(mb.SSE_HEAD)
        await c.send_chunks([mb.sse(json.dumps({"error": error}))])
        await c.send(b"0\r\n\r\n")

    bad = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": tag}}
    async with mb.RawServer(answer, name="a") as a, mb.RawServer(answer, name="b") as b:
        replicas = [th.Replica(base_url=r.url, name=r.name) for r in (a, b)]
        async with th.Hedger(replicas, _config()) as hedger:
            report = await run(hedger.stream(bad))
            stats = hedger.statistics()
    assert [x.replica for x in report.attempts] == ["a"]
    assert isinstance(report.error, th.FatalAttemptError)
    assert report.error.error.kind is ErrorKind.INVALID_REQUEST
    assert [r.failures for r in stats.replicas] == [0, 0]
