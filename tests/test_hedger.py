"""The Hedger in virtual time: server pushback, ejection and return, never zero attempts,
timeouts from the config, side-effect rules, cost accounting, events, scale."""

from __future__ import annotations

from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import AttemptOutcome as O
from trio_hedge import ErrorKind, EventKind, HedgerConfig, OutlierDetection
from trio_hedge.testing import Behaviour, MockReplicas

from .fleet import Fail, Fleet, run, table
from .scripted import Script

FAST = Script(ttft=0.5, tokens=3)
SLOW = Script(ttft=5.0, tokens=3)
#: No learning, budget, throttle or ejection: each test switches on what it is about.
PLAIN = HedgerConfig(hedge_after=1.0, budget=None, throttle=None, outlier_detection=None)


def _config(**changes: Any) -> HedgerConfig:
    return attrs.evolve(PLAIN, **changes)


def _by_request(default: Script | Fail, **cases: Script | Fail) -> Fleet:
    """Replicas a, b; ``cases["<replica>_<request id>"]`` overrides one attempt's script."""
    return Fleet(["a", "b"], lambda name, info: cases.get(f"{name}_{info.request_id}", default))


def _closed_at(fleet: Fleet, replica: str, request_id: str) -> float:
    """When the attempt of ``request_id`` on ``replica`` was closed (Trio time)."""
    for (name, info, _), (cname, cnumber, at) in zip(fleet.infos, fleet.ledger.opened, strict=True):
        assert name == cname
        if name == replica and info.request_id == request_id:
            for n, number, closed in fleet.ledger.closed:
                if n == name and number == cnumber and closed >= at:
                    return closed
    raise AssertionError("no such attempt")


# -- server pushback ------------------------------------------------------------------------------


async def test_retry_after_is_honoured_to_the_millisecond(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = _by_request(FAST, a_r0=Fail(at=0.1, kind=ErrorKind.RATE_LIMIT, retry_after=1.234))
    events: list[th.HedgeEvent] = []
    hedger = th.Hedger(fleet.sources(), PLAIN, on_event=[events.append])
    report = await run(hedger.stream(None, request_id="r0"))
    assert [(a.replica, a.trigger, a.outcome) for a in report.attempts] == [
        ("a", "primary", O.FAILED),
        ("b", "failover", O.WON),
    ]
    failed_at = _closed_at(fleet, "a", "r0")
    (cooling,) = [e for e in events if e.kind is EventKind.REPLICA_COOLING]
    assert (cooling.replica, cooling.reason) == ("a", "rate_limit")
    assert cooling.until == failed_at + 1.234
    assert hedger.statistics().cooling == ("a",)

    # One millisecond before the cooldown ends, a new request skips a ...
    await trio.sleep_until(failed_at + 1.233)
    report = await run(hedger.stream(None, request_id="r1"))
    assert report.attempts[0].replica == "b"
    # ... and the moment it ends, a takes primaries again.
    await trio.sleep_until(failed_at + 1.234)
    assert hedger.statistics().cooling == ()
    report = await run(hedger.stream(None, request_id="r2"))
    assert report.attempts[0].replica == "a"


async def test_all_cooling_waits_for_the_earliest(autojump_clock: trio.testing.MockClock) -> None:
    fleet = _by_request(
        FAST,
        a_r0=Fail(at=0.1, kind=ErrorKind.RATE_LIMIT, retry_after=2.0),
        b_r0=Fail(at=0.1, kind=ErrorKind.OVERLOADED, retry_after=0.75),
    )
    hedger = th.Hedger(fleet.sources(), PLAIN)
    t0 = trio.current_time()
    report = await run(hedger.stream(None, request_id="r0"))
    assert isinstance(report.error, th.AllAttemptsFailed)
    assert [a.started_at for a in report.attempts] == [0.0, 0.1]
    # a cools until 2.1, b until 0.95 (0.2 + 0.75).
    await trio.sleep_until(t0 + 0.3)
    stream = hedger.stream(None, request_id="r1")
    report = await run(stream)
    (attempt,) = report.attempts
    assert attempt.replica == "b"  # the earliest to come back
    assert attempt.started_at is not None
    assert stream.started_at + attempt.started_at == pytest.approx(t0 + 0.95, abs=1e-9)
    assert report.ttft is not None
    assert report.ttft == pytest.approx(0.65 + 0.5, abs=1e-9)


async def test_all_cooling_wait_is_bounded_by_the_caller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = _by_request(
        FAST,
        a_r0=Fail(at=0.1, kind=ErrorKind.RATE_LIMIT, retry_after=5.0),
        b_r0=Fail(at=0.1, kind=ErrorKind.RATE_LIMIT, retry_after=5.0),
    )
    hedger = th.Hedger(fleet.sources(), PLAIN)
    await run(hedger.stream(None, request_id="r0"))
    t = trio.current_time()
    stream = hedger.stream(None, request_id="r1")
    with trio.move_on_after(1.0) as scope:
        await run(stream)
    assert scope.cancelled_caught
    assert trio.current_time() - t == 1.0
    assert stream.report.attempts == ()
    assert hedger.statistics().requests == 1  # r1 sent nothing


async def test_retry_after_from_http_headers(autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas(
        {
            "a": Behaviour(status=429, retry_after=2.5, error_delay=0.1),
            "b": Behaviour(ttft=0.5, tokens=2),
        }
    )
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=mock.transport) as client:
        replicas = [th.Replica(mock.url(n), name=n) for n in ("a", "b")]
        async with th.Hedger(replicas, PLAIN, client=client) as hedger:
            async with hedger.stream(request) as stream:
                text = "".join([t async for t in stream])
            assert text == "tok0 tok1 "
            (a, _) = stream.report.attempts
            assert a.error is not None and a.error.retry_after == 2.5
            (ra, _) = hedger.statistics().replicas
            # 0.6 s have passed since the request started; a failed at 0.1 + 2.5 s cooldown.
            assert ra.state == "cooling"
            assert ra.cooling_for == pytest.approx(2.0, abs=1e-9)
        assert not client.is_closed  # a client passed in is not the Hedger's to close


# -- replica health ------------------------------------------------------------------------------


async def test_ejection_and_return(autojump_clock: trio.testing.MockClock) -> None:
    phase = {"a": Fail(at=0.1)}
    fleet = Fleet(["a", "b"], lambda name, _i: phase.get(name, FAST))
    outlier = OutlierDetection(consecutive_failures=3, base_ejection=10.0, max_ejection=40.0)
    events: list[th.HedgeEvent] = []
    hedger = th.Hedger(
        fleet.sources(), _config(outlier_detection=outlier), on_event=[events.append]
    )

    async def primary() -> str:
        report = await run(hedger.stream(None))
        assert report.error is None
        return report.attempts[0].replica

    async def ejected_for() -> float:
        return hedger.statistics().replicas[0].ejected_for

    # Three failures in a row eject a for 10 s; b takes every primary meanwhile.
    assert [await primary() for _ in range(3)] == ["a", "a", "a"]
    assert hedger.statistics().ejected == ("a",)
    # (ejected when the third failure came, 0.7 s ago: b's answer took 0.5 + 2 × 0.1 s)
    assert await ejected_for() == pytest.approx(10.0 - 0.7, abs=1e-9)
    assert [await primary() for _ in range(3)] == ["b", "b", "b"]
    # It returns after 10 s; still failing, it is ejected again, for twice as long.
    await trio.sleep(await ejected_for())
    assert hedger.statistics().ejected == ()
    assert [await primary() for _ in range(3)] == ["a", "a", "a"]
    assert await ejected_for() == pytest.approx(20.0 - 0.7, abs=1e-9)
    # Healed: after the ejection it wins again, and a success resets the back-off.
    phase.clear()
    await trio.sleep(await ejected_for())
    assert [await primary() for _ in range(2)] == ["a", "a"]
    a = hedger.statistics().replicas[0]
    assert (a.state, a.times_ejected, a.consecutive_failures, a.failures) == ("healthy", 2, 0, 6)
    kinds = [
        (e.kind, e.replica, e.until is not None)
        for e in events
        if e.kind is EventKind.REPLICA_EJECTED
    ]
    assert kinds == [(EventKind.REPLICA_EJECTED, "a", True)] * 2


async def test_slow_attempts_count_against_their_replica(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet(["a", "b"], table(FAST, a=SLOW))
    outlier = OutlierDetection(consecutive_failures=2, base_ejection=30.0)
    hedger = th.Hedger(fleet.sources(), _config(outlier_detection=outlier))
    for _ in range(2):
        report = await run(hedger.stream(None))
        assert [(a.replica, a.outcome) for a in report.attempts] == [
            ("a", O.CANCELLED),
            ("b", O.WON),
        ]
    assert hedger.statistics().ejected == ("a",)  # two first-token timeouts in a row
    report = await run(hedger.stream(None))
    assert [(a.replica, a.outcome) for a in report.attempts] == [("b", O.WON)]
    assert report.ttft == 0.5


async def test_never_zero_attempts(autojump_clock: trio.testing.MockClock) -> None:
    phase: dict[str, Script | Fail] = {"a": Fail(at=0.1), "b": Fail(at=0.1)}
    fleet = Fleet(["a", "b"], lambda name, _i: phase[name])
    outlier = OutlierDetection(consecutive_failures=1, base_ejection=10.0)
    hedger = th.Hedger(fleet.sources(), _config(outlier_detection=outlier))
    report = await run(hedger.stream(None))
    assert isinstance(report.error, th.AllAttemptsFailed)
    assert hedger.statistics().ejected == ("a", "b")
    # Every replica ejected: the request still goes out, to the least bad (a comes back
    # first), and fails over to b.
    report = await run(hedger.stream(None))
    assert [(a.replica, a.trigger) for a in report.attempts] == [
        ("a", "primary"),
        ("b", "failover"),
    ]
    # A hedge, though, is not sent to an ejected replica: refused, the primary goes on.
    phase["a"] = Script(ttft=3.0, tokens=1)
    report = await run(hedger.stream(None))
    assert [(a.replica, a.outcome) for a in report.attempts] == [("a", O.WON)]
    assert report.hedges_refused == 1
    assert hedger.statistics().no_replica_refusals == 1


# -- timeouts from the config ----------------------------------------------------------------------

STALLS = [
    # (name, script, tokens read, error time or None)
    ("silent winner", Script(ttft=0.5, tokens=5, stall_after_tokens=2), 2, 0.6 + 2.0),
    ("slow but steady winner", Script(ttft=0.5, tokens=5, gap=1.5), 5, None),
]


@pytest.mark.parametrize(("name", "script", "n", "at"), STALLS, ids=[s[0] for s in STALLS])
async def test_stall_timeout_from_config(
    name: str, script: Script, n: int, at: float | None, autojump_clock: trio.testing.MockClock
) -> None:
    fleet = Fleet(["a"], table(script))
    hedger = th.Hedger(fleet.sources(), _config(stall_timeout=2.0))
    t0 = trio.current_time()
    got: list[str] = []
    try:
        async with hedger.stream(None) as stream:
            async for token in stream:
                got.append(token)
    except th.StreamInterrupted as exc:
        assert exc.error.kind is ErrorKind.STALL
        assert trio.current_time() - t0 == at
    else:
        assert at is None
    assert len(got) == n
    assert fleet.ledger.open_now == 0
    (a,) = hedger.statistics().replicas
    assert a.failures == (at is not None)  # a stall counts against the replica
    assert a.in_flight == 0


async def test_first_token_timeout_from_config(autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet(["a", "b"], table(SLOW))
    hedger = th.Hedger(fleet.sources(), _config(first_token_timeout=3.0))
    t0 = trio.current_time()
    with pytest.raises(th.AllAttemptsFailed) as info:
        async with hedger.stream(None):
            pass
    assert trio.current_time() - t0 == 3.0
    assert info.value.errors[-1].kind is ErrorKind.TIMEOUT
    assert [a.started_at for a in stream_attempts(info.value)] == [0.0, 1.0]


def stream_attempts(exc: th.HedgeError) -> tuple[th.AttemptRecord, ...]:
    assert exc.report is not None
    return exc.report.attempts


# -- side effects ----------------------------------------------------------------------------------

SIDE_EFFECT_CASES = [
    # (name, hedge, side_effects, key, attempts started)
    ("plain request: hedged", True, False, None, 2),
    ("hedge=False: never hedged", False, False, None, 1),
    ("side effects, no key: never hedged", True, True, None, 1),
    ("side effects with a key: hedged, key on every attempt", True, True, "order-42", 2),
    ("side effects, key, hedge=False: not hedged", False, True, "order-42", 1),
]


@pytest.mark.parametrize(
    ("name", "hedge", "side_effects", "key", "attempts"),
    SIDE_EFFECT_CASES,
    ids=[c[0] for c in SIDE_EFFECT_CASES],
)
async def test_side_effect_rules(
    name: str,
    hedge: bool,
    side_effects: bool,
    key: str | None,
    attempts: int,
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet = Fleet(["a", "b"], table(FAST, a=SLOW))
    hedger = th.Hedger(fleet.sources(), PLAIN)
    stream = hedger.stream(None, hedge=hedge, side_effects=side_effects, idempotency_key=key)
    report = await run(stream)
    assert len(report.attempts) == attempts
    assert report.ttft == (1.5 if attempts == 2 else 5.0)
    assert [info.idempotency_key for _, info, _ in fleet.infos] == [key] * attempts
    assert {info.request_id for _, info, _ in fleet.infos} == {stream.request_id}
    assert report.idempotency_key == key


async def test_side_effects_still_fail_over(autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet(["a", "b"], table(FAST, a=Fail(at=0.1)))
    hedger = th.Hedger(fleet.sources(), PLAIN)
    report = await run(hedger.stream(None, side_effects=True))
    assert [a.trigger for a in report.attempts] == ["primary", "failover"]


async def test_idempotency_key_header_on_every_http_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"a": Behaviour(ttft=5.0, tokens=2), "b": Behaviour(ttft=0.5, tokens=2)})
    request = {"model": "m", "messages": [{"role": "user", "content": "pay invoice 7"}]}
    async with httpx.AsyncClient(transport=mock.transport) as client:
        replicas = [th.Replica(mock.url(n), name=n) for n in ("a", "b")]
        hedger = th.Hedger(replicas, PLAIN, client=client)
        stream = hedger.stream(request, side_effects=True, idempotency_key="pay-7-v1")
        async with stream:
            assert "".join([t async for t in stream]) == "tok0 tok1 "
        unkeyed = hedger.stream(request, side_effects=True)
        async with unkeyed:
            assert "".join([t async for t in unkeyed]) == "tok0 tok1 "
    (a0, a1), (b0,) = mock.requests["a"], mock.requests["b"]
    assert (a0.headers["idempotency-key"], a0.headers["x-hedge-attempt"]) == ("pay-7-v1", "1")
    assert (b0.headers["idempotency-key"], b0.headers["x-hedge-attempt"]) == ("pay-7-v1", "2")
    assert a0.headers["x-request-id"] == b0.headers["x-request-id"] == stream.request_id
    # Without a key the side-effecting request went to a alone and waited the 5 s.
    assert "idempotency-key" not in a1.headers
    assert unkeyed.report.attempts_sent == 1 and unkeyed.report.ttft == 5.0


# -- accounting, statistics, events ----------------------------------------------------------------


async def test_cost_accounting_and_statistics(autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet(["a", "b"], table(FAST, a=SLOW))
    hedger = th.Hedger(fleet.sources(), PLAIN)
    body = {"model": "gpt-x", "messages": [{"role": "user", "content": "z" * 4000}]}
    report = await run(hedger.stream(body))  # hedged: b wins at 1.5
    assert report.prompt_tokens == 1004  # 4000 chars / 4 + 4 framing
    assert (report.attempts_sent, report.backups_sent, report.prompt_tokens_resent) == (2, 1, 1004)
    assert report.to_dict()["prompt_tokens_resent"] == 1004
    report = await run(hedger.stream(body, hedge=False, prompt_tokens=10))
    assert (report.prompt_tokens, report.prompt_tokens_resent) == (10, 0)
    stats = hedger.statistics()
    assert (stats.requests, stats.finished, stats.attempts) == (2, 2, 3)
    assert (stats.hedges_sent, stats.backup_wins, stats.hedges_refused) == (1, 1, 0)
    assert (stats.prompt_tokens_sent, stats.prompt_tokens_resent) == (1004 * 2 + 10, 1004)
    assert (stats.ttft_p50, stats.ttft_p90) == (1.5, 5.0)
    assert [(r.name, r.attempts, r.wins, r.in_flight) for r in stats.replicas] == [
        ("a", 2, 1, 0),
        ("b", 1, 1, 0),
    ]


async def test_learned_delay_statistics_per_group(autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet(["a", "b"], table(Script(ttft=0.2, tokens=1)))
    config = _config(hedge_after=th.LearnedDelay(min_samples=3, refresh=0, fallback=2.0))
    hedger = th.Hedger(fleet.sources(), config)
    for group, tokens in [("m1", 100)] * 3 + [("m2", 5000)] * 2:
        await run(hedger.stream(None, group=group, prompt_tokens=tokens))
    rows = {(d.group, d.size_class): d for d in hedger.statistics().delays}
    m1, m2 = rows[("m1", 0)], rows[("m2", 5)]
    assert (m1.observations, m1.learned) == (3, True)
    assert m1.delay == pytest.approx(0.2, abs=1e-9)
    assert (m2.observations, m2.learned, m2.delay) == (2, False, 2.0)  # not enough yet
    assert (m2.min_tokens, m2.max_tokens) == (4096, 8192)
    assert hedger.hedge_delay(prompt_tokens=100, group="m1") == m1.delay
    assert hedger.statistics().delay("m1", 0) == m1.delay


async def test_events(autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet(["a", "b"], table(FAST, a=SLOW))
    seen: list[th.HedgeEvent] = []

    def broken(_event: th.HedgeEvent) -> None:
        raise RuntimeError("a broken hook must not break the request")

    hedger = th.Hedger(fleet.sources(), PLAIN, on_event=[broken, seen.append])
    report = await run(hedger.stream({"model": "m1", "messages": []}))
    assert report.error is None
    assert [(e.kind.value, e.replica, e.time) for e in seen] == [
        ("attempt_started", "a", seen[0].time),
        ("attempt_started", "b", seen[0].time + 1.0),
        ("committed", "b", seen[0].time + 1.5),
        ("attempt_cancelled", "a", seen[0].time + 1.5),
        ("request_finished", None, seen[0].time + 1.7),
    ]
    assert {e.group for e in seen} == {"m1"}
    assert {e.request_id for e in seen} == {report.request_id}
    assert seen[-1].report == report


# -- validation and scale ------------------------------------------------------------------------


async def test_validation() -> None:
    fleet = Fleet(["a"], table(FAST))
    with pytest.raises(ValueError, match="empty"):
        th.Hedger([])
    with pytest.raises(ValueError, match="unique"):
        th.Hedger(fleet.sources() * 2)
    with pytest.raises(TypeError, match="Replica or Source"):
        th.Hedger(["http://x"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="config"):
        th.Hedger(fleet.sources(), {"hedge_after": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hedge_after"):
        HedgerConfig(hedge_after=-1)
    with pytest.raises(TypeError, match="hedge_after"):
        HedgerConfig(hedge_after="p90")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pick"):
        HedgerConfig(pick="random")  # type: ignore[arg-type]
    hedger = th.Hedger(fleet.sources())
    with pytest.raises(ValueError, match="idempotency_key"):
        hedger.stream(None, idempotency_key="a\r\nX-Evil: 1")
    with pytest.raises(TypeError, match="prompt_tokens"):
        hedger.stream(None, prompt_tokens=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hedge"):
        hedger.stream(None, hedge="yes")  # type: ignore[arg-type]
    http = th.Hedger([th.Replica("http://x.test/v1")])
    with pytest.raises(TypeError, match="request"):
        http.stream(None)
    await http.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        http.stream({"messages": []})


async def test_owned_client_is_created_once_and_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with th.Hedger([th.Replica("http://x.test/v1")]) as hedger:
        hedger.stream({"messages": []})._planner._bind(hedger._replicas[0])  # type: ignore[attr-defined]
        client = hedger._owned_client
        assert client is not None
        hedger.stream({"messages": []})._planner._bind(hedger._replicas[0])  # type: ignore[attr-defined]
        assert hedger._owned_client is client
    assert client.is_closed


async def test_thousands_of_concurrent_streams(autojump_clock: trio.testing.MockClock) -> None:
    fleet = Fleet(["a", "b", "c"], table(Script(ttft=0.3, tokens=2), a=Script(ttft=2.0)))
    hedger = th.Hedger(
        fleet.sources(),
        HedgerConfig(hedge_after=th.LearnedDelay(min_samples=50), outlier_detection=None),
    )
    reports: list[th.Report] = []

    async def one(i: int) -> None:
        reports.append(await run(hedger.stream(None, group=f"g{i % 300}")))

    async with trio.open_nursery() as nursery:
        for i in range(3000):
            nursery.start_soon(one, i)
    stats = hedger.statistics()
    assert len(reports) == stats.requests == stats.finished == 3000
    assert all(r.error is None for r in reports)
    assert all(r.in_flight == 0 for r in stats.replicas)
    assert fleet.ledger.open_now == 0
    # The primaries were spread over the replicas (least loaded first) ...
    assert {r.name: r.attempts > 900 for r in stats.replicas} == {"a": True, "b": True, "c": True}
    # ... and the per-group state is capped (256 groups kept of 300 seen).
    assert len({d.group for d in stats.delays}) == 256
