"""The Hedger's latency-aware pick (peak EWMA, as Finagle's and Linkerd's balancers), in
virtual time: a replica that lost a race is "at least this slow", an attempt still waiting for
its first token says its replica is busy now, a cancelled attempt whose prefill the server
cannot abort still occupies it, and a long prompt's own prefill does not make a replica look
slow."""

from __future__ import annotations

import math

import attrs
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import HedgerConfig, LearnedDelay
from trio_hedge.sources import AttemptInfo

from .fleet import Fleet, run
from .scripted import Script

PLAIN = HedgerConfig(hedge_after=0.2, budget=None, throttle=None, outlier_detection=None)
FAST = 0.05  # an idle replica's TTFT for a short prompt


def _busy_until(busy: dict[str, float]) -> Fleet:
    """Replicas a and b, each prefilling someone else's long prompt until ``busy[name]``
    (a FIFO engine, one request at a time: an attempt started before then waits for it)."""

    def behave(name: str, _info: AttemptInfo) -> Script:
        wait = max(0.0, busy.get(name, 0.0) - trio.current_time())
        return Script(ttft=wait + FAST, tokens=1)

    return Fleet(["a", "b"], behave)


async def _every(hedger: th.Hedger, gap: float, n: int) -> list[th.Report]:
    """``n`` requests ``gap`` seconds apart, each read to its end in its own task."""
    reports: list[th.Report] = []

    async def one() -> None:
        reports.append(await run(hedger.stream(None)))

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
            await trio.sleep(gap)
    return reports


PICKS = [
    # (pick, primaries sent to a while it was busy, hedges)
    ("default", 1, 1),  # peak_ewma
    # The cancelled primary on a looks idle again: every request goes back to a and is
    # hedged (issue 9, measured on llama.cpp: 20 short requests sent to the busy replica).
    ("least_loaded", 8, 8),
]


@pytest.mark.parametrize(("pick", "to_busy", "hedges"), PICKS)
async def test_a_replica_that_lost_a_race_is_avoided(
    pick: str, to_busy: int, hedges: int, autojump_clock: trio.testing.MockClock
) -> None:
    # a is busy with another tenant's long prompt for 2 s; a request every 0.25 s.
    t0 = trio.current_time()
    fleet = _busy_until({"a": t0 + 2.0})
    config = PLAIN if pick == "default" else attrs.evolve(PLAIN, pick=pick)
    hedger = th.Hedger(fleet.sources(), config)
    reports = await _every(hedger, 0.25, 16)
    busy = [r for r in reports if r.attempts[0].replica == "a" and r.ttft and r.ttft > FAST]
    assert len(busy) == to_busy
    assert sum(r.hedged for r in reports) == hedges
    # Every request was answered by 0.2 + 0.05 s at worst: the tail is the same.
    assert max(r.ttft or 0.0 for r in reports) == pytest.approx(0.25, abs=1e-9)


async def test_the_default_pick_learns() -> None:
    assert HedgerConfig().pick == "peak_ewma"


async def test_a_lost_race_counts_as_at_least_this_slow_and_decays(
    autojump_clock: trio.testing.MockClock,
) -> None:
    t0 = trio.current_time()
    fleet = _busy_until({"a": t0 + 2.0})
    hedger = th.Hedger(fleet.sources(), PLAIN)
    report = await run(hedger.stream(None))
    assert [(a.replica, a.outcome) for a in report.attempts] == [
        ("a", th.report.AttemptOutcome.CANCELLED),
        ("b", th.report.AttemptOutcome.WON),
    ]
    # a lost at 0.25 s without a first token: at least 0.25 s slow; b answered in 0.05 s.
    a, b = hedger.statistics().replicas
    assert (a.latency, b.latency) == (pytest.approx(0.25), pytest.approx(0.05))
    # Both decay toward zero with a 10 s time constant (the decay keeps their order) ...
    await trio.sleep(10.0)
    a, b = hedger.statistics().replicas
    assert (a.latency, b.latency) == (pytest.approx(0.25 / math.e), pytest.approx(0.05 / math.e))
    # ... while b's fresh samples keep it near 0.05 s (a request every 0.5 s, from 10.25 s):
    # a is tried again once its decayed estimate is below b's, when
    # 0.25 e^(-(t - 0.25) / 10) < 0.05 e^(-0.5 / 10), i.e. t > 16.84 s: at 17.25 s.
    primaries = []
    for _ in range(20):
        at = round(trio.current_time() - t0, 2)
        report = await run(hedger.stream(None))
        primaries.append((at, report.attempts[0].replica))
        await trio.sleep_until(t0 + at + 0.5)
    assert primaries[0] == (10.25, "b")
    assert next(p for p in primaries if p[1] == "a") == (17.25, "a")


async def test_an_attempt_waiting_for_its_first_token_marks_its_replica_busy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a holds one attempt with no first token for 1 s; b holds one that is streaming its
    # answer (first token at once). Both have one attempt in flight: the fewest-in-flight
    # pick sends the next request to a (the first in order), the latency-aware one to b.
    def behave(name: str, info: AttemptInfo) -> Script:
        if info.request_id == "waiting":
            return Script(ttft=5.0, tokens=1)
        if info.request_id == "streaming":
            return Script(ttft=FAST, tokens=100, gap=0.1)
        return Script(ttft=FAST, tokens=1)

    for pick, expected in [("peak_ewma", "b"), ("least_loaded", "a")]:
        fleet = Fleet(["a", "b"], behave)
        hedger = th.Hedger(fleet.sources(), attrs.evolve(PLAIN, hedge_after=None, pick=pick))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, hedger.stream(None, request_id="waiting"))
            await trio.sleep(0.01)
            nursery.start_soon(run, hedger.stream(None, request_id="streaming"))
            await trio.sleep(1.0)
            assert [r.in_flight for r in hedger.statistics().replicas] == [1, 1]
            report = await run(hedger.stream(None, request_id="next"))
            assert report.attempts[0].replica == expected, pick
            nursery.cancel_scope.cancel()


def _learned() -> HedgerConfig:
    return attrs.evolve(PLAIN, hedge_after=LearnedDelay(min_samples=10, refresh=0))


def _prefill(tokens: int) -> float:
    return 0.01 + 0.001 * tokens  # every replica, idle


class _Sized(dict[str, int]):
    """Prompt tokens per request id (100 when not given)."""

    def __missing__(self, key: str) -> int:
        return 100


def _sized_fleet(tokens: _Sized) -> Fleet:
    return Fleet(
        ["a", "b"], lambda _n, info: Script(ttft=_prefill(tokens[info.request_id]), tokens=1)
    )


async def _train(hedger: th.Hedger, tokens: _Sized, n: int) -> None:
    """``n`` requests of 100 and 1,000 tokens, alternately, 1 s apart."""
    for i in range(n):
        tokens[f"t{i}"] = 1000 if i % 2 else 100
        await run(hedger.stream(None, request_id=f"t{i}", prompt_tokens=tokens[f"t{i}"]))
        await trio.sleep(1.0)


async def test_a_cancelled_prefill_still_occupies_its_replica(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tokens = _Sized()
    hedger = th.Hedger(_sized_fleet(tokens).sources(), _learned())
    await _train(hedger, tokens, 20)
    (fit,) = hedger.statistics().prefill
    assert (fit.intercept, fit.slope) == (pytest.approx(0.01), pytest.approx(0.001))
    # A 5,000-token prompt goes to a (5.01 s of prefill); its caller leaves after 1 s. The
    # server goes on prefilling it (llama.cpp notices the disconnect when the prefill ends).
    tokens["long"] = 5000
    started = trio.current_time()
    stream = hedger.stream(None, request_id="long", prompt_tokens=5000)
    with trio.move_on_after(1.0):
        await run(stream)
    busy = stream.report.attempts[0].replica
    other = "b" if busy == "a" else "a"
    stats = {r.name: r for r in hedger.statistics().replicas}
    assert (stats[busy].in_flight, stats[busy].lingering, stats[other].lingering) == (0, 1, 0)
    # The next short requests go to the other replica while it is still busy with it ...
    for _ in range(3):
        report = await run(hedger.stream(None, prompt_tokens=100))
        assert report.attempts[0].replica == other
        await trio.sleep(1.0)
    # ... until the prefill model's median for 5,000 tokens has passed since it started:
    # its line, 0.01 + 0.001 x 5,000 = 5.01 s (beyond the largest size it learned, 1,000
    # tokens, the line keeps its intercept).
    await trio.sleep_until(started + 5.01 - 1e-6)
    assert sum(r.lingering for r in hedger.statistics().replicas) == 1
    await trio.sleep_until(started + 5.01 + 1e-6)
    assert [r.lingering for r in hedger.statistics().replicas] == [0, 0]


async def test_a_long_prompts_own_prefill_does_not_mark_its_replica_slow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tokens = _Sized()
    hedger = th.Hedger(_sized_fleet(tokens).sources(), _learned())
    await _train(hedger, tokens, 20)
    before = {r.name: r.latency for r in hedger.statistics().replicas}
    tokens["long"] = 5000
    report = await run(hedger.stream(None, request_id="long", prompt_tokens=5000))
    assert report.ttft == pytest.approx(5.01)
    # 5.01 s is what 5,000 tokens cost on any replica: the sample is its excess over the
    # prefill the model predicts (its line at 5,000 tokens less the intercept: 5.01 - 0.01
    # s), the replica's own 0.01 s, so the estimate falls to it instead of jumping to 5.01 s.
    name = report.attempts[0].replica
    after = {r.name: r.latency for r in hedger.statistics().replicas}
    assert after[name] < before[name]
    assert after[name] == pytest.approx(0.01, abs=1e-9)


async def test_a_replica_known_stuck_gets_the_backup_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Both replicas are busy with other tenants' long prompts until 2 s. The first request
    # learns it (its primary waits on a, its backup on b from 0.2 s); the second, at 0.7 s,
    # finds an attempt on its primary's replica waiting for twice the hedge delay (0.5 s on
    # b): its backup goes at once, joining the other queue as early as a double send would.
    for pick, backup_at in [("peak_ewma", 0.0), ("least_loaded", 0.2)]:
        t0 = trio.current_time()
        fleet = _busy_until({"a": t0 + 2.0, "b": t0 + 2.0})
        hedger = th.Hedger(fleet.sources(), attrs.evolve(PLAIN, pick=pick))
        reports: dict[str, th.Report] = {}

        async def one(rid: str, hedger: th.Hedger = hedger, reports: dict = reports) -> None:  # type: ignore[type-arg]
            reports[rid] = await run(hedger.stream(None, request_id=rid))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "first")
            await trio.sleep(0.7)
            nursery.start_soon(one, "second")
        assert [a.started_at for a in reports["first"].attempts] == pytest.approx([0.0, 0.2])
        assert [a.started_at for a in reports["second"].attempts] == pytest.approx(
            [0.0, backup_at]
        ), pick
        await trio.sleep(10.0)


async def test_backups_sent_at_once_still_spend_the_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Sustained overload (every replica 5 s from its first token, 10 requests/s for 60 s):
    # with the latency-aware pick every replica is known stuck, so backups would go at once;
    # the budget holds them to the same bound.
    from .test_budget import DURATION, RATE, _overload

    budget = th.policy.HedgeBudget(ratio=0.1, min_per_second=0.5, window=10.0)
    stats = await _overload(budget, pick="peak_ewma")
    bound = budget.ratio * RATE * DURATION + budget.min_per_second * (DURATION + budget.window)
    assert budget.ratio * RATE * DURATION <= stats.hedges_sent <= bound
