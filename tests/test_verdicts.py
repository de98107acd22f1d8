"""One verdict per request (issue 27): each case the issue found on ``c6222d8``, end to end
through a shared Hedger, in virtual time. Where the point is shared state, a second caller's
trace is compared with its run alone: the first one's input must not change it."""

from __future__ import annotations

from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.errors import ErrorKind
from trio_hedge.policy import HedgerConfig
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.sources.openai_responses import ResponsesReplica
from trio_hedge.testing import Behaviour, MockReplicas

from .fleet import Fail, Fleet, run, table
from .scripted import Script
from .test_blame import Trace, _trace, _with_and_without

FAST = Script(ttft=0.2, tokens=2)
N = 12
REQUEST: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
FULL = "".join(f"tok{i} " for i in range(N))


# -- a replica that breaks every stream ---------------------------------------------------------


async def test_a_replica_that_breaks_every_stream_is_ejected(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a answers first and cuts every answer after 3 tokens; b is a little slower and whole.
    # Each answer is recovered on b (replayed, verified). On c6222d8 each commit reset the
    # run the break added to at the request's end: a stayed the primary of 18 of 20
    # requests, each paying a cut and a replay. A success is final only when the request
    # ends unbroken: five breaks in a row eject a.
    mock = MockReplicas(
        {
            "a": Behaviour(tokens=N, ttft=0.1, cut_after=3),
            "b": Behaviour(tokens=N, ttft=0.3),
        }
    )
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    config = HedgerConfig(hedge_after=1.0, pick="in_order")
    primaries = []
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, config, client=client) as hedger:
            for _ in range(20):
                async with hedger.stream(REQUEST) as stream:
                    assert "".join([t async for t in stream]) == FULL
                primaries.append(stream.report.attempts[0].replica)
                await trio.sleep(0.5)
            a = hedger.statistics().replicas[0]
    # Ejected for 10 s at the fifth break (12 requests), back at 14.5 s, breaking again.
    assert primaries == ["a"] * 5 + ["b"] * 12 + ["a"] * 3
    assert (a.failures, a.times_ejected, a.consecutive_failures) == (8, 1, 3)


# -- the request's own fault after the commit --------------------------------------------------


async def test_the_requests_own_fault_after_the_commit_is_not_recovered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # An in-band error the library classes as the request's (a usage-policy refusal: not
    # retryable) ends the stream as before the commit: typed, the partial text kept, no
    # replay on another replica (on c6222d8 it was replayed and the report said completed).
    refusal = Script(ttft=0.1, tokens=5, fail_after_tokens=2, cut_kind=ErrorKind.INVALID_REQUEST)
    fleet = Fleet(["a", "b"], table(FAST, a=refusal))
    hedger = th.Hedger(fleet.sources(), HedgerConfig(hedge_after=1.0, pick="in_order"))
    with pytest.raises(th.StreamInterrupted) as info:
        async with hedger.stream(None) as stream:
            [t async for t in stream]
    assert info.value.error.kind is ErrorKind.INVALID_REQUEST
    assert info.value.text == "a:0 a:1 "
    report = stream.report
    assert [(a.replica, a.trigger) for a in report.attempts] == [("a", "primary")]
    assert not report.completed
    a = hedger.statistics().replicas[0]
    assert (a.failures, a.consecutive_failures) == (0, 0)  # nobody's fault but the request's


# -- affinity: a second Responses turn -----------------------------------------------------------


def _responses_fleet() -> MockReplicas:
    """Two Responses replicas, each holding its own stored responses (``resp_a…``,
    ``resp_b…``): a ``previous_response_id`` the other one made gets 404, as OpenAI's API
    answers a response it does not hold."""

    def holder(name: str) -> Any:
        def behave(record: Any) -> Behaviour:
            previous = record.json.get("previous_response_id")
            if previous and not previous.startswith(f"resp_{name}"):
                return Behaviour(
                    status=404,
                    error_message=f"Previous response with id '{previous}' not found.",
                )
            return Behaviour(tokens=2, ttft=0.1)

        return behave

    return MockReplicas({"a": holder("a"), "b": holder("b")})


def _turn(previous: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "input": "hi", "stream": True}
    if previous is not None:
        body["previous_response_id"] = previous
    return body


async def test_a_second_turn_ejects_nobody(autojump_clock: trio.testing.MockClock) -> None:
    # Caller 1's second turn continues a response b stored; its primary (a) answers 404 and
    # b serves it. On c6222d8 the 404 was settled as a's fault (another replica served the
    # request) and ejected a for the model: caller 2's primary moved, and caller 3, whose
    # conversation lives on a, got AllAttemptsFailed. A "not found" for state only one
    # replica holds is nobody's fault.
    async def callers(with_second_turn: bool) -> list[tuple[str | None, str | None]]:
        mock = _responses_fleet()
        replicas = [ResponsesReplica(mock.url(n), name=n) for n in "ab"]
        config = HedgerConfig(hedge_after=1.0, pick="in_order")
        out: list[tuple[str | None, str | None]] = []
        async with httpx.AsyncClient(transport=mock.transport) as client:
            async with th.Hedger(replicas, config, client=client) as hedger:
                for _ in range(6):
                    if with_second_turn:
                        async with hedger.stream(_turn("resp_b_1")) as s:
                            [t async for t in s]
                        assert s.report.winner_replica == "b"
                    for previous in (None, "resp_a_1"):  # callers 2 and 3
                        async with hedger.stream(_turn(previous)) as s:
                            [t async for t in s]
                        out.append((s.report.attempts[0].replica, s.report.winner_replica))
                    await trio.sleep(1.0)
                assert hedger.statistics().ejected == ()
        return out

    alone = await callers(False)
    assert alone == [("a", "a"), ("a", "a")] * 6
    assert await callers(True) == alone


# -- a context window learned from a guess ------------------------------------------------------


@pytest.mark.parametrize("states", [True, False], ids=["stated", "not stated"])
async def test_a_window_is_learned_only_from_a_stated_size(
    states: bool, autojump_clock: trio.testing.MockClock
) -> None:
    # A Responses request's input is not counted by the size estimate (0 tokens). a answers
    # an oversized one 400 context-length; b, a larger model, takes it. On c6222d8 the
    # window was learned from the request's estimated size, 0: every later request for the
    # model avoided a. Only a size the server states teaches a window.
    message = (
        "This model's maximum context length is 500 tokens. However, you requested 4000 tokens."
        if states
        else "context length exceeded"
    )

    def small(record: Any) -> Behaviour:
        if len(str(record.json.get("input", ""))) > 1000:
            return Behaviour(status=400, error_message=message)
        return Behaviour(tokens=2, ttft=0.1)

    async def second_caller(with_oversized: bool) -> list[str | None]:
        mock = MockReplicas({"a": small, "b": Behaviour(tokens=2, ttft=0.3)})
        replicas = [
            ResponsesReplica(mock.url("a"), name="a"),
            ResponsesReplica(mock.url("b"), name="b", context_window=100_000),
        ]
        config = HedgerConfig(hedge_after=None, pick="in_order")
        out: list[str | None] = []
        async with httpx.AsyncClient(transport=mock.transport) as client:
            async with th.Hedger(replicas, config, client=client) as hedger:
                if with_oversized:
                    big = {"model": "m", "input": "w " * 2000, "stream": True}
                    async with hedger.stream(big) as s:
                        [t async for t in s]
                    assert s.report.winner_replica == "b"
                    learned = hedger._fleet.models.get(0, "m")
                    assert (learned.window if learned else None) == (500 if states else None)
                for _ in range(3):
                    async with hedger.stream(_turn(None)) as s:
                        [t async for t in s]
                    out.append(s.report.winner_replica)
        return out

    assert await second_caller(False) == ["a"] * 3
    assert await second_caller(True) == ["a"] * 3


# -- a 429 without Retry-After ------------------------------------------------------------------


async def test_a_429_without_retry_after_moves_the_primary(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a rate-limits every request and says nothing of when to come back. On c6222d8 it
    # neither cooled nor counted in the pick: the first attempt of 30 requests in 30. It
    # cools for rate_limit_cooldown (1 s) and its latency estimate is at least that, so the
    # pick moves off it until the estimate decays below b's.
    fleet = Fleet(["a", "b"], table(FAST, a=Fail(at=0.05, kind=ErrorKind.RATE_LIMIT)))
    hedger = th.Hedger(fleet.sources(), HedgerConfig(hedge_after=1.0))
    first = []
    for _ in range(30):
        report = await run(hedger.stream(None))
        assert report.error is None and report.winner_replica == "b"
        first.append(report.attempts[0].replica)
        await trio.sleep(2.0)
    assert first.count("a") == 4
    a = hedger.statistics().replicas[0]
    assert (a.failures, a.consecutive_failures) == (0, 0)  # pushback, not a failure


async def test_a_long_retry_after_is_an_outage(autojump_clock: trio.testing.MockClock) -> None:
    # A Retry-After past max_pushback_wait (10 s) is an outage of that replica for that
    # model, for what it asked up to max_ejection (300 s): ejected for the model (not a
    # wait a request could sit in), the other models still served there.
    def behave(name: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if name == "a" and info.request_id.startswith("x"):
            return Fail(at=0.05, kind=ErrorKind.RATE_LIMIT, retry_after=3600.0)
        return FAST

    events: list[th.events.HedgeEvent] = []
    fleet = Fleet(["a", "b"], behave)
    config = HedgerConfig(hedge_after=1.0, pick="in_order")
    hedger = th.Hedger(fleet.sources(), config, on_event=[events.append])
    report = await run(hedger.stream(None, group="x", request_id="x0"))
    assert report.winner_replica == "b"
    a = hedger.statistics().replicas[0]
    assert (a.state, a.ejected_models) == ("degraded", ("x",))
    (ejected,) = [e for e in events if e.kind is th.events.EventKind.REPLICA_EJECTED]
    assert (ejected.replica, ejected.reason) == ("a", "rate_limit")
    assert ejected.until == pytest.approx(0.05 + 300.0)
    report = await run(hedger.stream(None, group="y", request_id="y0"))
    assert report.attempts[0].replica == "a"  # another model is still served there


# -- the throttle decides at the failure -------------------------------------------------------


async def test_a_burst_of_fast_failures_is_served(autojump_clock: trio.testing.MockClock) -> None:
    # 20 concurrent requests whose first attempt gets a quick 503 (every replica), every
    # later attempt streams. On c6222d8: 20 of 20 AllAttemptsFailed, 0 failovers, 20
    # throttle refusals (each attempt's task debited the throttle as it failed, the caller's
    # task decided the failover one scheduler batch later), and a slow request sent next was
    # not hedged (3.0 s). Decided at the failure, each request's first failure on credit:
    # all served, nothing debited, and the slow request is hedged at 0.5 s.
    slow = False

    def behave(_name: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if slow:
            return Script(ttft=3.0 if info.number == 1 else 0.1, tokens=2)
        return Fail(at=0.05, kind=ErrorKind.OVERLOADED, status=503) if info.number == 1 else FAST

    hedger = th.Hedger(Fleet(["a", "b"], behave).sources(), HedgerConfig(hedge_after=0.5))
    reports: list[th.Report] = []

    async def one() -> None:
        reports.append(await run(hedger.stream(None)))

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(one)
    assert [r.error for r in reports] == [None] * 20
    stats = hedger.statistics()
    assert (stats.failovers, stats.failovers_refused, stats.throttle_tokens) == (20, 0, 10.0)
    assert stats.ejected == ()  # both replicas failed alike: neither is worse
    slow = True
    report = await run(hedger.stream(None))
    assert report.hedged and report.ttft == pytest.approx(0.6)


@pytest.mark.parametrize("concurrent", [20, 100])
async def test_a_failing_fleet_stays_within_the_storm_bound(
    concurrent: int, autojump_clock: trio.testing.MockClock
) -> None:
    # Every attempt fails at once (every replica 503). The credit is bounded by the hedge
    # budget (10% of the requests in its window plus its floor of 0.5/s x 60 s = 30): beyond
    # it a failure takes its token at once, and failovers stop at half the throttle's
    # tokens. So the extra attempts of a burst are at most the budget's allowance plus the
    # throttle's 4 (10 -> 6 decided before half): 20 requests, 20 failovers (32 allowed);
    # 100 requests, 40 + 4.
    fleet = Fleet(["a", "b"], table(Fail(at=0.05, kind=ErrorKind.OVERLOADED, status=503)))
    hedger = th.Hedger(fleet.sources(), HedgerConfig(hedge_after=1.0))
    reports: list[th.Report] = []

    async def one() -> None:
        reports.append(await run(hedger.stream(None)))

    async with trio.open_nursery() as nursery:
        for _ in range(concurrent):
            nursery.start_soon(one)
    stats = hedger.statistics()
    cap = 30 + concurrent // 10
    extra = stats.attempts - concurrent
    assert extra == min(concurrent, cap + 4)
    assert all(r.error is not None for r in reports)
    assert stats.throttle_tokens == 0.0  # every credit debited: the throttle is closed
    # Once closed, one attempt per request.
    report = await run(hedger.stream(None))
    assert report.attempts_sent == 1


# -- a query of death ---------------------------------------------------------------------------


async def test_a_query_of_death_leaves_another_callers_rescues(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The measured caller's primary (a) is stuck; a hedge to b rescues each request. The
    # misbehaving caller sends, every 5 s, a request every replica answers 500. On c6222d8
    # it cut the measured caller's rescues to 6 of 50 (a run of failures on both replicas,
    # one ejected; the throttle drained). A 500 from every replica tried, while they serve
    # other requests, is a query of death: the request's fault, no failure, no token.
    def behave(name: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if info.request_id.startswith("qod"):
            return Fail(at=0.05, kind=ErrorKind.SERVER_ERROR, status=500)
        return Script(ttft=5.0 if name == "a" else 0.2, tokens=2)

    def make() -> th.Hedger:
        # (No hedge budget: the measured caller hedges every request, more than its share;
        # this is about health and the throttle.)
        config = HedgerConfig(hedge_after=1.0, pick="in_order", budget=None)
        return th.Hedger(Fleet(["a", "b"], behave).sources(), config)

    async def measured(hedger: th.Hedger, out: list[Trace]) -> None:
        t0 = trio.current_time()
        for i in range(50):
            await trio.sleep_until(t0 + 1.0 * i + 0.5)
            out.append(_trace(await run(hedger.stream(None, request_id=f"m{i}"))))

    async def misbehaving(hedger: th.Hedger) -> None:
        await trio.sleep(3.0)  # the fleet is serving the measured caller
        for i in range(10):
            report = await run(hedger.stream(None, request_id=f"qod{i}"))
            assert report.attempts_sent == 2 and report.error is not None
            await trio.sleep(5.0)

    alone, beside, hedger = await _with_and_without(make, measured, misbehaving)
    assert alone == beside
    assert [ttft for _, ttft in alone] == [pytest.approx(1.2)] * 50
    stats = hedger.statistics()
    assert stats.ejected == () and [r.failures for r in stats.replicas] == [0, 0]


# -- the delay learner --------------------------------------------------------------------------


async def test_requests_that_could_not_hedge_do_not_raise_the_delay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a takes 3 s, b 0.2 s; the budget allows one backup per ten requests (no floor), so
    # most requests have nowhere to hedge. On c6222d8 their 3 s TTFTs were exact samples: the
    # delay learned 3 s from them, and even the backups the budget allowed then came too
    # late (none sent in 30 requests). Censored at their delay, they leave it at 1 s: the
    # allowed backups go, and rescue.
    behaviour = {"a": Script(ttft=3.0, tokens=2), "b": Script(ttft=0.2, tokens=2)}
    config = HedgerConfig(
        hedge_after=th.LearnedDelay(min_samples=5),
        pick="in_order",
        budget=th.policy.HedgeBudget(ratio=0.1, min_per_second=0.0),
        throttle=None,
    )
    hedger = th.Hedger(Fleet(["a", "b"], lambda n, _i: behaviour[n]).sources(), config)
    hedged = []
    for _ in range(30):
        report = await run(hedger.stream(None, group="m"))
        if report.hedged:
            assert report.ttft == pytest.approx(1.2)  # rescued at the 1 s delay
            hedged.append(len(hedged))
        await trio.sleep(1.0)
    # One backup per ten requests in the budget's 60 s window (a request takes 4 s here).
    assert len(hedged) == 2
    (row,) = hedger.statistics().delays
    assert row.learned and row.delay == pytest.approx(1.0)  # not a's 3 s


async def test_loser_censoring_does_not_ratchet_the_delay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a answers in 1.5 s, b in 0.2 s; every request's primary is a and is hedged at the
    # fallback delay (1.0 s). Censored at its cancel (1.2 s) every loser told the learner
    # "at least 1.2 s", the largest time seen became the delay, the next loser was censored
    # at 1.4 s...: on c6222d8 the delay climbed to a's own 1.5 s and 19 of 30 requests waited
    # for a. Censored when its backup was sent, the delay stays where the fleet hedges.
    behaviour = {"a": Script(ttft=1.5, tokens=2), "b": Script(ttft=0.2, tokens=2)}
    fleet = Fleet(["a", "b"], lambda name, _info: behaviour[name])
    # The fallback throughout (no cold rule: it would hedge sooner, at 3 × the samples'
    # median, and this test is about what the losers' censoring does to the delay).
    config = HedgerConfig(
        hedge_after=th.LearnedDelay(cold_samples=None),
        pick="in_order",
        budget=None,
        throttle=None,
    )
    hedger = th.Hedger(fleet.sources(), config)
    ttfts = []
    for _ in range(30):
        ttfts.append((await run(hedger.stream(None, group="m"))).ttft)
        await trio.sleep(3.0)
    assert ttfts == [pytest.approx(1.2)] * 30
    (row,) = hedger.statistics().delays
    assert row.delay == pytest.approx(1.0)


# -- probe evidence adds to what the Hedger saw -------------------------------------------------


async def test_probe_evidence_adds_to_the_known_latency(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a is known to take 2 s (b 0.1 s); both engines' pages say idle. On c6222d8 a fresh
    # reading replaced the pick's cost with the predicted queue wait (0 for both): a became
    # the primary of 10 requests in 20 instead of 2. The reading adds to the latency.
    from trio_hedge.sources.probes import LoadProbe, LoadReading

    async def idle() -> LoadReading:
        return LoadReading("llama.cpp", slots=4)

    behaviour = {"a": Script(ttft=2.0, tokens=2), "b": Script(ttft=0.1, tokens=2)}
    fleet = Fleet(["a", "b"], lambda name, _info: behaviour[name])
    probes = {n: LoadProbe("llama.cpp", reader=idle) for n in "ab"}

    async def primaries(probed: bool) -> int:
        config = HedgerConfig(hedge_after=5.0, budget=None, throttle=None)
        async with th.Hedger(fleet.sources(), config, probes=probes if probed else None) as h:
            await trio.sleep(0.01)
            first = []
            for _ in range(20):
                first.append((await run(h.stream(None))).attempts[0].replica)
                await trio.sleep(1.0)
        return first.count("a")

    unprobed = await primaries(False)
    assert unprobed <= 2
    assert await primaries(True) == unprobed


# -- the outage rule does not forget pushback when the ejection cap holds a replica in ---------


async def test_an_outage_held_in_by_the_cap_still_cools(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = HedgerConfig(hedge_after=1.0, pick="in_order")
    fleet = Fleet(["a", "b"], table(Fail(at=0.05, kind=ErrorKind.RATE_LIMIT, retry_after=600)))
    hedger = th.Hedger(fleet.sources(), config)
    report = await run(hedger.stream(None, group="x"))
    assert [a.outcome for a in report.attempts] == [O.FAILED, O.FAILED]
    a, b = hedger.statistics().replicas
    assert (a.ejected_models, b.ejected_models, b.cooling_models) == (("x",), (), ("x",))
    assert attrs.has(type(a))


# -- one fleet view per group, whatever the route ------------------------------------------------


async def test_hedgers_of_one_fleet_share_what_they_learn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The gateway's chat, Messages and Responses routes reach the same servers: a replica
    # the chat route found dead is out for the others, and they learn one delay and spend
    # one budget (issue 29: on c6222d8 each route had its own Hedger and state).
    down = Fail(at=0.05, kind=ErrorKind.CONNECTION)
    chat_fleet = Fleet(["a", "b"], table(FAST, a=down))
    other_fleet = Fleet(["a", "b"], table(FAST, a=down))
    config = HedgerConfig(hedge_after=1.0, pick="in_order")
    chat = th.Hedger(chat_fleet.sources(), config)
    messages = th.Hedger(other_fleet.sources(), fleet_of=chat)
    for _ in range(5):
        await run(chat.stream(None))
    assert chat.statistics().ejected == messages.statistics().ejected == ("a",)
    report = await run(messages.stream(None))
    assert [a.replica for a in report.attempts] == ["b"]
    assert other_fleet.infos[0][0] == "b"  # a was never asked on the other route
    assert messages.statistics().requests == chat.statistics().requests == 6
    with pytest.raises(ValueError, match="names"):
        th.Hedger(Fleet(["a", "c"], table(FAST)).sources(), fleet_of=chat)
    with pytest.raises(ValueError, match="config"):
        th.Hedger(other_fleet.sources(), HedgerConfig(hedge_after=2.0), fleet_of=chat)
    with pytest.raises(ValueError, match="probes"):
        th.Hedger(other_fleet.sources(), fleet_of=chat, probes={})


# -- found by attacking the judge (each failed on 5513b02) ----------------------------------------


def _content(record: Any) -> str:
    messages = record.json.get("messages") or [{}]
    return str(messages[-1].get("content", ""))


# -- a query of death after the commit ----------------------------------------------------------


async def test_a_query_of_death_after_the_commit_leaves_another_callers_rescues(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # As test_a_query_of_death_leaves_another_callers_rescues, but the request that crashes
    # every server does so after its first token (an in-band 500 mid-answer: a prompt that
    # crashes the decode, not the prefill). The measured caller's primary (a) is stuck and a
    # hedge to b rescues it at 1.2 s.
    def make() -> tuple[th.Hedger, MockReplicas]:
        def holder(name: str) -> Any:
            def behave(record: Any) -> Behaviour:
                if _content(record) == "qod":
                    return Behaviour(tokens=6, ttft=0.1, inband_error_after=1)
                return Behaviour(tokens=2, ttft=5.0 if name == "a" else 0.2)

            return behave

        mock = MockReplicas({"a": holder("a"), "b": holder("b")})
        config = HedgerConfig(hedge_after=1.0, pick="in_order", budget=None)
        replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
        client = httpx.AsyncClient(transport=mock.transport)
        return th.Hedger(replicas, config, client=client), mock

    def request(content: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": content}]}

    async def measured(hedger: th.Hedger, out: list[Trace]) -> None:
        t0 = trio.current_time()
        for i in range(50):
            await trio.sleep_until(t0 + 1.0 * i + 0.5)
            out.append(_trace(await run(hedger.stream(request("hi"), request_id=f"m{i}"))))

    async def misbehaving(hedger: th.Hedger) -> None:
        await trio.sleep(3.0)
        for i in range(10):
            report = await run(hedger.stream(request("qod"), request_id=f"qod{i}"))
            assert report.error is not None
            await trio.sleep(5.0)

    alone, beside, _ = await _with_and_without(lambda: make()[0], measured, misbehaving)
    assert [ttft for _, ttft in alone] == [pytest.approx(1.2)] * 50
    # On 5513b02: from the fourth crash on (15.5 s) the throttle was at or below half, and
    # the measured caller's 35 remaining requests waited 5.0 s for a (throttle 2.9 at the
    # end; failures a 10, b 4).
    assert alone == beside


# -- a fleet that fails whole with 500s, just after serving ------------------------------------


@pytest.mark.parametrize(("status", "extra"), [(503, 3), (500, 4)])
async def test_a_fleet_failing_whole_right_after_serving_gets_one_attempt_per_request(
    status: int, extra: int, autojump_clock: trio.testing.MockClock
) -> None:
    # docs/guarantees.md: "a fleet where every replica fails gets one attempt per request
    # once the throttle closes (... 3 of 50 requests with two replicas)". Both replicas serve,
    # then answer every request with an error, 50 requests one after another (5 s). With
    # 503s: 3 failovers, the throttle closed. With 500s, on 5513b02: 50 of 50 failed over and
    # the throttle stayed full (10.0): the fleet had served a first token less than
    # QUERY_OF_DEATH_WINDOW (10 s) before, so every request's 500s were "a query of death",
    # nobody's -- for the first 10 s of every fleet-wide outage. Now a replica serves others
    # only if it has not answered a 500 since: the outage's first request is judged a query
    # of death (nothing yet tells them apart), the rest are the replicas'.
    down = False
    kind = ErrorKind.OVERLOADED if status == 503 else ErrorKind.SERVER_ERROR

    def behave(_name: str, _info: th.sources.AttemptInfo) -> Script | Fail:
        return Fail(at=0.05, kind=kind, status=status) if down else Script(ttft=0.1, tokens=2)

    hedger = th.Hedger(Fleet(["a", "b"], behave).sources(), HedgerConfig(hedge_after=1.0))
    assert (await run(hedger.stream(None))).error is None
    down = True
    sent = 0
    for _ in range(50):
        report = await run(hedger.stream(None))
        assert report.error is not None
        sent += report.backups_sent
    assert sent == extra
    assert hedger.statistics().throttle_tokens == 0.0


# -- a caller's deadline ends a stalled winner: credited as served -------------------------------


async def test_a_stalled_winner_the_caller_left_is_not_a_success(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a answers first; it cuts every "cut" answer after 3 tokens (recovered on b), and goes
    # silent forever after 2 tokens of a "stall" answer (no stall_timeout: the default).
    # Caller X sends "cut" requests: alone, five breaks in a row eject a and X's primary
    # moves to b (test_a_replica_that_breaks_every_stream_is_ejected). Caller Y sends
    # "stall" requests under its own 2 s deadline (trio.move_on_after): a never finished
    # Y's answer. On 5513b02 each of Y's requests ended with a's outcome WON and the judge's
    # "served" reset a's run: a was never ejected and X paid a cut and a replay every time.
    # Now a caller that leaves before the end credits nobody (the judge's "left").
    def holder(record: Any) -> Behaviour:
        if _content(record) == "stall":
            return Behaviour(tokens=N, ttft=0.1, stall_after=2)
        return Behaviour(tokens=N, ttft=0.1, cut_after=3)

    def request(content: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": content}]}

    async def x_primaries(with_y: bool) -> list[str]:
        mock = MockReplicas({"a": holder, "b": Behaviour(tokens=N, ttft=0.3)})
        replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
        config = HedgerConfig(hedge_after=1.0, pick="in_order")
        primaries = []
        async with httpx.AsyncClient(transport=mock.transport) as client:
            async with th.Hedger(replicas, config, client=client) as hedger:
                for _ in range(10):
                    async with hedger.stream(request("cut")) as stream:
                        assert "".join([t async for t in stream]) == FULL
                    primaries.append(stream.report.attempts[0].replica)
                    if with_y:
                        with trio.move_on_after(2.0):
                            async with hedger.stream(request("stall")) as y:
                                async for _ in y:
                                    pass
                    await trio.sleep(0.5)
        return primaries

    alone = await x_primaries(False)
    assert alone == ["a"] * 5 + ["b"] * 5
    assert await x_primaries(True) == alone


# -- readiness: one model's pushback takes every model out -----------------------------------


@pytest.mark.parametrize("retry_after", [5.0, 3600.0])
async def test_one_models_pushback_leaves_the_gateway_ready_for_the_others(
    retry_after: float, autojump_clock: trio.testing.MockClock
) -> None:
    # One group serves models x and y (a gateway group's `models = ["x", "y"]`). A caller's
    # requests for x get the provider's per-model rate limit on both replicas (429 with
    # Retry-After); y is served by both. /readyz's `readiness` says 503 "no eligible
    # replica" -- the load balancer takes the instance out, and every instance sees the
    # same upstream, so every caller of y loses the gateway -- while y is served at that
    # very moment (for 5 s; with an hourly quota reset, Retry-After 3600: a is ejected
    # for x as an outage and b, held in by the cap, cools as long: 300 s). So it was on
    # 5513b02; now the body lists x as out and the gateway stays ready.
    from trio_hedge.gateway._app import readiness

    def behave(record: Any) -> Behaviour:
        if record.json.get("model") == "x":
            return Behaviour(status=429, retry_after=retry_after)
        return Behaviour(tokens=2, ttft=0.1)

    mock = MockReplicas({"a": behave, "b": behave})
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    config = HedgerConfig(hedge_after=1.0, pick="in_order")
    x = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    y = {"model": "y", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, config, client=client) as hedger:
            assert (await run(hedger.stream(y))).error is None
            assert (await run(hedger.stream(x))).error is not None
            served = await run(hedger.stream(y))
            status, body = readiness(
                {"chat": {"default": hedger.statistics().replicas}}, draining=False
            )
    assert (served.error, served.winner_replica) == (None, "a")
    assert status == "ready"
    assert body["models_out"] == {"default": ["x"]}
