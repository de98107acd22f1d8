"""What a Hedger's fleet publishes to its store and takes in from the fleet's other processes
(``FleetWriter.store``, ``FleetWriter.apply_remote``), in virtual time: each ejection, cooldown
and delay sample it writes is published once, as the contract's value; another process that
applies them avoids the replica, cools it for that model, and learns the same delay; its own
rules still hold (the ejection cap, outlier detection off, its window), and a request whose
failure is its own fault publishes nothing another process's callers could feel.

Two Hedgers stand for two processes; their store here records what is published (the Redis
back end itself is tested against a real redis-server: tests/test_state_redis.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
import trio.testing

import trio_hedge as th
from trio_hedge.errors import ErrorKind
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.state import Cooldown, DelaySample, Ejection, StateChange, StoreStatus

from .fleet import Fail, Fleet, run
from .scripted import Script

FAST = Script(ttft=0.2, tokens=2, gap=0.1)
SLOW = Script(ttft=3.0, tokens=2, gap=0.1)


class Recording:
    """A FleetStore that keeps what is published (``status`` ``"ok"``)."""

    def __init__(self) -> None:
        self.changes: list[StateChange] = []

    @property
    def status(self) -> StoreStatus:
        return "ok"

    def publish(self, change: StateChange) -> None:
        self.changes.append(change)

    async def run(self, apply: Callable[[StateChange], None], **_: Any) -> None:
        raise NotImplementedError


def _hedger(fleet: Fleet, name: str = "g", **config: Any) -> tuple[th.Hedger, Recording]:
    fields: dict[str, Any] = {"hedge_after": 1.0, "pick": "in_order"}
    fields.update(config)
    hedger = th.Hedger(fleet.sources(), th.HedgerConfig(**fields))
    store = Recording()
    hedger._writer.store = store
    hedger._fleet.name = name
    return hedger, store


def _ejected(hedger: th.Hedger) -> dict[str, tuple[str, ...]]:
    return {
        r.name: (
            (("*",) if r.state == "ejected" and not r.ejected_models else ()) + r.ejected_models
        )
        for r in hedger.statistics().replicas
    }


def _replay(changes: list[StateChange], into: th.Hedger) -> None:
    for change in changes:
        into._writer.apply_remote(change, trio.current_time())


async def test_an_ejection_one_process_decides_is_honoured_by_another(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a fails every attempt at process A: after 5 in a row A ejects it whole for 10 s and
    # publishes that once; B, which never saw a fail, takes it in and sends nothing to a.
    def behave(replica: str, _info: th.sources.AttemptInfo) -> Script | Fail:
        return Fail(at=0.05) if replica == "a" else FAST

    a_side, store = _hedger(Fleet(["a", "b"], behave))
    for i in range(5):
        await run(a_side.stream(None, group="m", request_id=f"r{i}"))
    ejections = [c for c in store.changes if isinstance(c, Ejection)]
    assert ejections == [Ejection("g", "a", None, 10.0, "server_error")]
    b_fleet = Fleet(["a", "b"], lambda _r, _i: FAST)
    b_side, _ = _hedger(b_fleet)
    _replay(store.changes, b_side)
    report = await run(b_side.stream(None, group="m", request_id="x"))
    assert [(x.replica, x.outcome) for x in report.attempts] == [("b", O.WON)]
    assert _ejected(b_side) == {"a": ("*",), "b": ()}
    await trio.sleep(10.0)  # the ejection's own length, not a longer one
    report = await run(b_side.stream(None, group="m", request_id="y"))
    assert [(x.replica, x.outcome) for x in report.attempts] == [("a", O.WON)]


async def test_pushback_for_one_model_is_shared_for_that_model_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A Retry-After below max_pushback_wait (10 s) is a wait: a cooldown (a longer one is
    # an outage: an ejection for the model, shared the same way).
    limited = Fail(at=0.05, kind=ErrorKind.RATE_LIMIT, retry_after=5.0)

    def behave(replica: str, info: th.sources.AttemptInfo) -> Script | Fail:
        return limited if replica == "a" and info.request_id.startswith("x") else FAST

    a_side, store = _hedger(Fleet(["a", "b"], behave))
    await run(a_side.stream({"model": "x"}, request_id="x0"))
    assert [c for c in store.changes if not isinstance(c, DelaySample)] == [
        Cooldown("g", "a", "x", 5.0, "rate_limit")
    ]
    b_side, _ = _hedger(Fleet(["a", "b"], lambda _r, _i: FAST))
    _replay(store.changes, b_side)
    report = await run(b_side.stream({"model": "x"}, request_id="x1"))
    assert [x.replica for x in report.attempts] == ["b"]  # x cools at a
    report = await run(b_side.stream({"model": "y"}, request_id="y1"))
    assert [x.replica for x in report.attempts] == ["a"]  # y does not
    assert b_side.statistics().replicas[0].cooling_models == ("x",)


async def test_an_ejection_for_one_model_is_shared_with_its_model(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a answers "not found" for model x while b serves it: a's own fault for x (ejected for
    # x at once), published with the model.
    def behave(replica: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if replica == "a" and info.request_id.startswith("x"):
            return Fail(at=0.05, kind=ErrorKind.NOT_FOUND)
        return FAST

    a_side, store = _hedger(Fleet(["a", "b"], behave))
    await run(a_side.stream({"model": "x"}, request_id="x0"))
    assert [c for c in store.changes if isinstance(c, Ejection)] == [
        Ejection("g", "a", "x", 10.0, "not_found")
    ]
    b_side, _ = _hedger(Fleet(["a", "b"], lambda _r, _i: FAST))
    _replay(store.changes, b_side)
    assert _ejected(b_side) == {"a": ("x",), "b": ()}
    assert [x.replica for x in (await run(b_side.stream({"model": "y"}))).attempts] == ["a"]


async def test_delay_samples_teach_another_process_the_same_delay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A serves 40 requests (TTFT 0.2 s); each sample is published once with its group,
    # class, prompt size and replica. B, which served none, then hedges at A's delay.
    a_side, store = _hedger(Fleet(["a", "b"], lambda _r, _i: FAST), hedge_after=th.LearnedDelay())
    for i in range(40):
        await run(a_side.stream(None, group="m", prompt_tokens=100, request_id=f"r{i}"))
        await trio.sleep(0.5)
    samples = [c for c in store.changes if isinstance(c, DelaySample)]
    assert len(samples) == 40
    assert {
        (s.fleet, s.group, round(s.seconds, 9), s.observed, s.tokens, s.replica) for s in samples
    } == {("g", "m", 0.2, True, 100, "a")}
    b_side, _ = _hedger(Fleet(["a", "b"], lambda _r, _i: FAST), hedge_after=th.LearnedDelay())
    cold = b_side.hedge_delay(prompt_tokens=100, group="m")
    _replay(samples, b_side)
    learned = b_side.hedge_delay(prompt_tokens=100, group="m")
    assert learned == a_side.hedge_delay(prompt_tokens=100, group="m")
    assert learned is not None and cold is not None and learned < cold


async def test_a_sample_keeps_its_age(autojump_clock: trio.testing.MockClock) -> None:
    # A sample 250 s old leaves the 300 s window 50 s from now; one older than the window
    # is not taken in at all.
    b_side, _ = _hedger(Fleet(["a", "b"], lambda _r, _i: FAST), hedge_after=th.LearnedDelay())
    await trio.sleep(1000.0)
    for age in (250.0, 301.0):
        sample = DelaySample("g", "m", 0, 0.2, True, 10, "a", age)
        b_side._writer.apply_remote(sample, trio.current_time())
    model = b_side._fleet.model
    assert model is not None
    assert [
        round(trio.current_time() - at, 6) for _, (at, *_) in model.samples(trio.current_time())
    ] == [250.0]
    await trio.sleep(49.0)
    assert len(model.samples(trio.current_time())) == 1
    await trio.sleep(2.0)
    assert model.samples(trio.current_time()) == []


async def test_the_ejection_cap_holds_for_remote_ejections(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Two processes each eject a different replica of two: B applies the first and not the
    # second (the cap never ejects the last replica), and counts it as capped.
    b_side, store = _hedger(Fleet(["a", "b"], lambda _r, _i: FAST))
    _replay([Ejection("g", "a", None, 10.0, "x"), Ejection("g", "b", None, 10.0, "x")], b_side)
    assert _ejected(b_side) == {"a": ("*",), "b": ()}
    assert b_side.statistics().ejections_capped == 1
    _replay([Ejection("g", "b", "m", 10.0, "x")], b_side)  # for one model: counted the same
    assert _ejected(b_side) == {"a": ("*",), "b": ()}
    assert store.changes == []  # what is applied is never published again


async def test_what_a_process_does_not_do_it_does_not_take_in(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Outlier detection off: no ejection. A replica or a size class it does not have, and a
    # shorter ejection than the one in force: nothing changes.
    off, _ = _hedger(Fleet(["a", "b"], lambda _r, _i: FAST), outlier_detection=None)
    _replay([Ejection("g", "a", None, 10.0, "x")], off)
    assert _ejected(off) == {"a": (), "b": ()}
    on, _ = _hedger(Fleet(["a", "b"], lambda _r, _i: FAST), hedge_after=th.LearnedDelay())
    _replay(
        [
            Ejection("g", "zz", None, 10.0, "x"),
            Cooldown("g", "zz", "m", 10.0, "x"),
            DelaySample("g", "m", 99, 0.2, True, 10, "a"),
            Ejection("g", "a", None, 20.0, "x"),
            Ejection("g", "a", None, 5.0, "x"),
        ],
        on,
    )
    stats = on.statistics()
    assert stats.delays == ()
    assert [(r.name, r.ejected_for) for r in stats.replicas] == [("a", 20.0), ("b", 0.0)]


async def test_a_requests_own_fault_publishes_nothing_another_process_feels(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A caller at A sends bad requests (400 from every replica, the request's fault): A
    # publishes no ejection nor cooldown, and B's measured caller is served exactly as
    # without them.
    def behave(replica: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if info.request_id.startswith("bad"):
            return Fail(at=0.05, kind=ErrorKind.BAD_REQUEST)
        return FAST

    a_side, store = _hedger(Fleet(["a", "b"], behave))
    for i in range(20):
        await run(a_side.stream(None, group="m", request_id=f"bad{i}"))
    assert [c for c in store.changes if not isinstance(c, DelaySample)] == []

    async def measured(changes: list[StateChange]) -> list[tuple[str, ...]]:
        b_side, _ = _hedger(Fleet(["a", "b"], lambda _r, _i: FAST))
        _replay(changes, b_side)
        out = []
        for i in range(5):
            report = await run(b_side.stream(None, group="m", request_id=f"ok{i}"))
            out.append(tuple(x.replica for x in report.attempts))
        return out

    assert await measured(store.changes) == await measured([]) == [("a",)] * 5
