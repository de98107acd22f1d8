"""Hooks that return context managers (as stamina's): entered at an attempt's start, exited
at its end with its error; and several PrometheusHooks in one process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.instrumentation import PrometheusHook

from .fleet import Fail, Fleet, run
from .scripted import Script

CONFIG = th.HedgerConfig(hedge_after=1.0, budget=None, throttle=None, outlier_detection=None)


def _fleet() -> Fleet:
    # r0: the primary is slow (the backup wins at 1.5 s); r1: the primary fails at 0.1 s and
    # the request fails over to the backup, which answers at 0.6 s.
    def behave(replica: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if info.request_id == "r1" and info.number == 1:
            return Fail(at=0.1, kind=th.errors.ErrorKind.OVERLOADED)
        return Script(ttft=5.0 if info.number == 1 else 0.5, tokens=2, gap=0.1)

    return Fleet(["a", "b"], behave)


class Scopes:
    """A hook returning a context manager per attempt_started; records enter/exit."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str | None, int, float, str | None]] = []
        self.plain: list[th.events.EventKind] = []

    def __call__(self, event: th.events.HedgeEvent) -> object:
        self.plain.append(event.kind)
        if event.kind is th.events.EventKind.ATTEMPT_STARTED:
            assert event.record is not None
            return self._scope(event.request_id, event.record.number)
        if event.kind is th.events.EventKind.HEDGE_REFUSED:
            return self._scope(event.request_id, 0)  # exited at once
        return None

    @contextmanager
    def _scope(self, request_id: str | None, number: int) -> Iterator[None]:
        self.log.append(("enter", request_id, number, trio.current_time(), None))
        try:
            yield
        except BaseException as exc:
            self.log.append(("exit", request_id, number, trio.current_time(), type(exc).__name__))
            raise
        self.log.append(("exit", request_id, number, trio.current_time(), None))


async def test_a_context_manager_wraps_each_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scopes = Scopes()
    fleet = _fleet()
    hedger = th.Hedger(fleet.sources(), CONFIG, on_event=[scopes])
    t0 = trio.current_time()
    report0 = await run(hedger.stream(None, request_id="r0"))
    t1 = trio.current_time()
    stream = hedger.stream(None, request_id="r1")
    await run(stream)
    log = [
        (what, rid, n, round(t - (t0 if rid == "r0" else t1), 6), exc)
        for what, rid, n, t, exc in scopes.log
    ]
    assert report0.winner == 2
    assert log == [
        ("enter", "r0", 1, 0.0, None),
        ("enter", "r0", 2, 1.0, None),
        ("exit", "r0", 1, 1.5, None),  # the loser: cancelled at the commit
        ("exit", "r0", 2, 1.6, None),  # the winner: at the request's end
        ("enter", "r1", 1, 0.0, None),
        ("exit", "r1", 1, 0.1, "AttemptError"),  # failed: exited with its error
        ("enter", "r1", 2, 0.1, None),
        ("exit", "r1", 2, 0.7, None),
    ]
    assert stream._planner._scopes == {}  # type: ignore[attr-defined]  # nothing kept


async def test_the_winner_scope_sees_the_request_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scopes = Scopes()
    fleet = Fleet(["a"], lambda r, i: Script(ttft=0.1, tokens=5, fail_after_tokens=2))
    hedger = th.Hedger(fleet.sources(), CONFIG, on_event=[scopes])
    await run(hedger.stream(None, request_id="r"))
    assert [(w, n, e) for w, _, n, _, e in scopes.log] == [
        ("enter", 1, None),
        ("exit", 1, "StreamInterrupted"),
    ]


async def test_plain_hooks_and_broken_context_managers_never_break_a_request(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def __enter__(self) -> None:
            raise RuntimeError("enter")

        def __exit__(self, *exc: object) -> None:
            raise AssertionError("never entered, never exited")

    class BrokenExit:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            raise RuntimeError("exit")

    seen: list[th.events.EventKind] = []
    hooks = [
        lambda e: Broken() if e.kind is th.events.EventKind.ATTEMPT_STARTED else None,
        lambda e: BrokenExit() if e.kind is th.events.EventKind.ATTEMPT_STARTED else None,
        lambda e: seen.append(e.kind),  # returns None: the EventHook of before
    ]
    hedger = th.Hedger(_fleet().sources(), CONFIG, on_event=hooks)  # type: ignore[arg-type]
    stream = hedger.stream(None, request_id="r0")
    report = await run(stream)
    assert report.completed and report.winner == 2
    assert seen[-1] is th.events.EventKind.REQUEST_FINISHED
    messages = [r.getMessage() for r in caplog.records]
    assert sum("entering its context failed" in m for m in messages) == 2
    assert sum("exiting its context failed" in m for m in messages) == 2
    assert stream._planner._scopes == {}  # type: ignore[attr-defined]


async def test_a_hedge_refused_scope_is_exited_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scopes = Scopes()
    config = th.HedgerConfig(
        hedge_after=1.0,
        budget=th.policy.HedgeBudget(ratio=0.01, min_per_second=0.0),
        throttle=None,
        outlier_detection=None,
    )
    fleet = _fleet()
    hedger = th.Hedger(fleet.sources(), config, on_event=[scopes])
    await run(hedger.stream(None, request_id="r0"))
    refused = [entry for entry in scopes.log if entry[2] == 0]
    assert [(w, t) for w, _, _, t, _ in refused] == [
        ("enter", refused[0][3]),
        ("exit", refused[0][3]),
    ]


# -- Prometheus: several hooks in one process ------------------------------------------------------


async def test_two_prometheus_hooks_share_one_registry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    first = th.Hedger(_fleet().sources(), CONFIG, on_event=[PrometheusHook(registry)])
    second = th.Hedger(_fleet().sources(), CONFIG, on_event=[PrometheusHook(registry)])
    await run(first.stream(None, request_id="r0"))
    await run(second.stream(None, request_id="r0"))
    value = registry.get_sample_value
    assert value("trio_hedge_requests_total", {"hedged": "true", "outcome": "ok"}) == 2
    assert value("trio_hedge_ttft_seconds_count") == 2


def test_prometheus_hooks_on_the_default_registry_and_apart() -> None:
    prom = pytest.importorskip("prometheus_client")
    # Two hooks on the global registry: this raised "Duplicated timeseries" before.
    PrometheusHook(prefix="trio_hedge_test_twice")
    PrometheusHook(prefix="trio_hedge_test_twice")
    one, two = prom.CollectorRegistry(), prom.CollectorRegistry()
    PrometheusHook(one)._requests.labels("false", "ok").inc()
    PrometheusHook(two)
    assert (
        one.get_sample_value("trio_hedge_requests_total", {"hedged": "false", "outcome": "ok"}) == 1
    )
    assert (
        two.get_sample_value("trio_hedge_requests_total", {"hedged": "false", "outcome": "ok"})
        is None
    )
    with pytest.raises(ValueError, match="prefix"):
        PrometheusHook(one, prefix="")
