"""One regression test per edge where the race broke its promises (issue "Guarantees that hold
at every edge", sections 1 and 3), in virtual time.

Ties (two events in one scheduling tick) depend on the order Trio runs the woken tasks in,
which it randomises; those tests run under many seeds of Trio's scheduler so that every order
is tried, deterministically.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import AttemptError, HedgePolicy
from trio_hedge.errors import ErrorKind
from trio_hedge.events import Delta, FirstToken
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.sources import AttemptInfo

from .scripted import Ledger, Script, scripted, sources

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

T = TypeVar("T")
SEEDS = range(40)


def run_seeded(main: Callable[[], Awaitable[T]], seed: int) -> T:
    """``trio.run(main)`` in virtual time with Trio's scheduler seeded: ties resolve in an
    order chosen by ``seed``."""
    trio._core._run._r.seed(seed)  # type: ignore[attr-defined]
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def read_all(stream: th.HedgedStream) -> list[str]:
    async with stream:
        return [token async for token in stream]


# -- 1. ownership ---------------------------------------------------------------------------


@pytest.mark.parametrize("cancel_at", [0.55, 0.7, 1.4])
async def test_outside_cancel_after_the_commit_closes_the_winner(
    cancel_at: float, autojump_clock: trio.testing.MockClock
) -> None:
    # The loser's close takes 1 s; the caller's deadline lands while it closes. The winner
    # must be closed too (it was dropped unclosed while the race waited for the loser).
    ledger = Ledger()
    replicas = sources(
        ledger, Script(ttft=5.0, close_delay=0.9), Script(ttft=0.1, tokens=20, gap=0.1)
    )
    t0 = trio.current_time()
    with trio.move_on_after(cancel_at):
        async with th.hedged_stream(None, replicas, HedgePolicy(hedge_after=0.4)) as stream:
            async for _ in stream:
                pass
    assert ledger.open_now == 0
    winner_closed = [at for name, _, at in ledger.closed if name == "backup"]
    assert winner_closed == [t0 + cancel_at]
    report = stream.report
    assert [a.outcome for a in report.attempts] == [O.CANCELLED, O.WON]
    assert all(a.ended_at is not None for a in report.attempts)


async def test_first_token_timeout_after_the_commit_is_not_a_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The commit at 0.5 s comes before first_token_timeout=0.7 s; the loser's close runs past
    # it. Today: AllAttemptsFailed("no first token…") although an attempt committed.
    ledger = Ledger()
    replicas = sources(ledger, Script(ttft=5.0, close_delay=0.9), Script(ttft=0.1, tokens=3))
    policy = HedgePolicy(hedge_after=0.4, first_token_timeout=0.7)
    tokens = await read_all(th.hedged_stream(None, replicas, policy))
    assert tokens == ["backup:0 ", "backup:1 ", "backup:2 "]
    assert ledger.open_now == 0


async def test_the_first_token_comes_at_the_commit_not_after_the_losers_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    replicas = sources(ledger, Script(ttft=5.0, close_delay=0.9), Script(ttft=0.1, tokens=3))
    t0 = trio.current_time()
    got: list[tuple[str, float]] = []
    async with th.hedged_stream(None, replicas, HedgePolicy(hedge_after=0.1)) as stream:
        async for token in stream:
            got.append((token, trio.current_time() - t0))
    assert got == [("backup:0 ", 0.2), ("backup:1 ", pytest.approx(0.3)), ("backup:2 ", 0.4)]
    report = stream.report
    assert report.ttft == 0.2
    assert report.tpot_mean == pytest.approx(0.1)
    # ... and the loser was still closed before the block exited.
    assert ledger.open_now == 0
    assert trio.current_time() - t0 == pytest.approx(0.2 + 0.9)  # its close took 0.9 s
    assert report.attempts[0].ended_at == 0.2


@pytest.mark.parametrize("seed", SEEDS)
def test_no_attempt_starts_after_the_commit(seed: int) -> None:
    # The primary fails at 1.0 s, the very tick the backup's first token commits.
    async def main() -> tuple[th.Report, Ledger]:
        ledger = Ledger()
        replicas = sources(
            ledger, Script(fail_at=1.0), Script(ttft=0.5, tokens=2), Script(ttft=0.1)
        )
        async with th.hedged_stream(None, replicas, HedgePolicy(hedge_after=0.5)) as stream:
            async for _ in stream:
                pass
        return stream.report, ledger

    report, ledger = run_seeded(main, seed)
    assert [name for name, *_ in ledger.opened] == ["primary", "backup"]
    assert len(report.attempts) == 2
    assert report.winner == 2
    assert ledger.open_now == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_failures_landing_together_each_start_an_attempt(seed: int) -> None:
    # Primary (started 0.0) and backup (hedged at 0.3) both fail at 0.5: two failovers at
    # once, not one failover now and a "hedge" later.
    async def main() -> th.Report:
        ledger = Ledger()
        replicas = sources(
            ledger, Script(fail_at=0.5), Script(fail_at=0.2), Script(ttft=1.0), Script(ttft=0.4)
        )
        async with th.hedged_stream(None, replicas, HedgePolicy(hedge_after=0.3)) as stream:
            async for _ in stream:
                pass
        return stream.report

    report = run_seeded(main, seed)
    assert [(a.started_at, a.trigger) for a in report.attempts] == [
        (0.0, "primary"),
        (0.3, "hedge"),
        (0.5, "failover"),
        (0.5, "failover"),
    ]
    assert report.winner == 4


@pytest.mark.parametrize("seed", SEEDS)
def test_a_failure_as_the_hedge_delay_ends_is_a_failover(seed: int) -> None:
    async def main() -> tuple[th.Report, int]:
        ledger = Ledger()
        replicas = sources(ledger, Script(fail_at=1.0), Script(ttft=0.2))
        config = th.HedgerConfig(hedge_after=1.0, throttle=None, outlier_detection=None)
        hedger = th.Hedger(replicas, config)
        stream = hedger.stream(None)
        async with stream:
            async for _ in stream:
                pass
        return stream.report, hedger.statistics().hedges_sent

    report, hedges_sent = run_seeded(main, seed)
    assert [(a.started_at, a.trigger) for a in report.attempts] == [
        (0.0, "primary"),
        (1.0, "failover"),
    ]
    assert not report.hedged
    assert hedges_sent == 0  # no hedge budget spent


class _PendingConnect:
    """A source whose open() waits inside a nursery, as Trio's ``open_tcp_stream`` does
    while a connect is pending: cancelled there, it raises ``Cancelled`` inside a group."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def open(self, info: AttemptInfo) -> th.sources.AttemptStream:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_a_loser_cancelled_inside_a_group_is_recorded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[th.events.HedgeEvent] = []
    ledger = Ledger()
    delay = th.LearnedDelay(fallback=0.1)
    config = th.HedgerConfig(hedge_after=delay, budget=None, throttle=None)
    hedger = th.Hedger(
        [_PendingConnect("connecting"), scripted("fast", Script(ttft=0.15), ledger)],
        config,
        on_event=[events.append],
    )
    stream = hedger.stream(None)
    assert await read_all(stream) == ["fast:0 ", "fast:1 ", "fast:2 "]
    loser = stream.report.attempts[0]
    assert (loser.outcome, loser.ended_at) == (O.CANCELLED, 0.25)
    kinds = [(e.kind, e.replica) for e in events]
    assert (th.events.EventKind.ATTEMPT_CANCELLED, "connecting") in kinds
    # ... and the learned delay got its censored sample.
    (row,) = hedger.statistics().delays
    assert (row.observations, row.censored) == (2, 1)


async def test_a_single_error_group_from_a_source_is_classified(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def grouped(info: AttemptInfo) -> AsyncIterator[str]:
        await trio.sleep(0.1)
        raise ExceptionGroup("from a nursery", [AttemptError(ErrorKind.OVERLOADED, "busy")])
        yield ""  # pragma: no cover

    ledger = Ledger()
    replicas = [th.iterator_source(grouped, name="grouped"), scripted("b", Script(), ledger)]
    stream = th.hedged_stream(None, replicas)
    assert await read_all(stream) == ["b:0 ", "b:1 ", "b:2 "]
    first = stream.report.attempts[0]
    assert first.error is not None and first.error.kind is ErrorKind.OVERLOADED
    assert stream.report.attempts[1].trigger == "failover"


async def test_a_group_with_a_fatal_error_is_fatal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def grouped(info: AttemptInfo) -> AsyncIterator[str]:
        await trio.sleep(0.1)
        raise ExceptionGroup(
            "two", [OSError("reset"), AttemptError(ErrorKind.INVALID_REQUEST, "bad")]
        )
        yield ""  # pragma: no cover

    ledger = Ledger()
    replicas = [th.iterator_source(grouped, name="grouped"), scripted("b", Script(), ledger)]
    with pytest.raises(th.FatalAttemptError) as info:
        await read_all(th.hedged_stream(None, replicas))
    assert info.value.error.kind is ErrorKind.INVALID_REQUEST
    assert isinstance(info.value.error.__cause__, ExceptionGroup)


# Generators that keep a cancel scope or a nursery open across ``yield``: read by another
# task after the commit, they broke ("cancel scope stack corrupted", deadlines ignored).


async def _with_deadline(info: AttemptInfo) -> AsyncIterator[str]:
    with trio.move_on_after(0.35):  # the generator's own deadline ends its answer
        for i in range(10):
            await trio.sleep(0.1)
            yield f"t{i} "


async def _with_nursery(info: AttemptInfo) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)
        for i in range(3):
            await trio.sleep(0.1)
            yield f"n{i} "
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("factory", "expected"),
    [(_with_deadline, ["t0 ", "t1 ", "t2 "]), (_with_nursery, ["n0 ", "n1 ", "n2 "])],
)
async def test_generator_sources_may_hold_scopes_across_yield(
    factory: Callable[[AttemptInfo], AsyncIterator[str]],
    expected: list[str],
    autojump_clock: trio.testing.MockClock,
) -> None:
    replicas = [th.iterator_source(factory, name="gen")]
    stream = th.hedged_stream(None, replicas)
    assert await read_all(stream) == expected
    assert stream.report.completed


async def test_a_generator_loser_and_an_early_break_are_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    closed: list[str] = []

    def factory(name: str, delay: float) -> Callable[[AttemptInfo], AsyncIterator[str]]:
        async def generate(info: AttemptInfo) -> AsyncIterator[str]:
            try:
                with trio.CancelScope():
                    for i in range(100):
                        await trio.sleep(delay)
                        yield f"{name}{i} "
            finally:
                closed.append(name)

        return generate

    replicas = [
        th.iterator_source(factory("slow", 5.0), name="slow"),
        th.iterator_source(factory("fast", 0.1), name="fast"),
    ]
    async with th.hedged_stream(None, replicas, HedgePolicy(hedge_after=1.0)) as stream:
        async for token in stream:
            assert token == "fast0 "
            break
    assert sorted(closed) == ["fast", "slow"]


async def test_keyboard_interrupt_keeps_its_cause(autojump_clock: trio.testing.MockClock) -> None:
    async def interrupted(info: AttemptInfo) -> AsyncIterator[str]:
        await trio.sleep(0.1)
        try:
            raise ValueError("the reason")
        except ValueError as reason:
            raise KeyboardInterrupt from reason
        yield ""  # pragma: no cover

    with pytest.raises(KeyboardInterrupt) as info:
        await read_all(th.hedged_stream(None, [th.iterator_source(interrupted, name="ki")]))
    assert isinstance(info.value.__cause__, ValueError)


# -- 3. truthful reports ----------------------------------------------------------------------


async def test_hedged_only_when_a_backup_was_sent(autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()
    stream = th.hedged_stream(None, sources(ledger, Script(ttft=2.0)), HedgePolicy(hedge_after=0.5))
    await read_all(stream)
    assert (stream.report.hedged, stream.report.backups_sent) == (False, 0)


async def test_a_budget_refusal_is_not_a_hedge(autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()
    budget = th.policy.HedgeBudget(ratio=0.1, min_per_second=0.0)  # no floor: nothing to spend
    config = th.HedgerConfig(hedge_after=0.5, budget=budget, throttle=None)
    hedger = th.Hedger(sources(ledger, Script(ttft=2.0), Script()), config)
    stream = hedger.stream(None)
    await read_all(stream)
    report = stream.report
    assert (report.hedged, report.backups_sent, report.hedges_refused) == (False, 0, 1)


async def test_a_first_token_timeout_reports_timeouts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    policy = HedgePolicy(hedge_after=0.5, first_token_timeout=2.0)
    with pytest.raises(th.AllAttemptsFailed) as info:
        await read_all(th.hedged_stream(None, sources(ledger, Script(ttft=9.0)), policy))
    report = info.value.report
    assert report is not None
    assert (report.hedged, report.backups_sent) == (False, 0)
    assert [(a.outcome, a.ended_at) for a in report.attempts] == [(O.TIMEOUT, 2.0)]
    assert info.value.errors[-1].kind is ErrorKind.TIMEOUT
    assert report.to_dict()["error"]["kind"] == "timeout"


def _failing(at: float, kind: ErrorKind) -> Callable[[AttemptInfo], AsyncIterator[str]]:
    """Fails ``at`` seconds after opening, like a response that already arrived: the wait is
    shielded, so a cancel in the same tick does not turn the error into a cancellation."""

    async def fail(info: AttemptInfo) -> AsyncIterator[str]:
        with trio.CancelScope(shield=True):
            await trio.sleep(at)
        raise AttemptError(kind, f"scripted {kind.value}")
        yield ""  # pragma: no cover

    return fail


@pytest.mark.parametrize("seed", SEEDS)
def test_the_fatal_error_is_the_one_reported(seed: int) -> None:
    # A 400 and another replica's 503 land in the same tick.
    async def main() -> th.FatalAttemptError:
        replicas = [
            th.iterator_source(_failing(1.0, ErrorKind.INVALID_REQUEST), name="a"),
            th.iterator_source(_failing(0.5, ErrorKind.OVERLOADED), name="b"),
        ]
        with pytest.raises(th.FatalAttemptError) as info:
            await read_all(th.hedged_stream(None, replicas, HedgePolicy(hedge_after=0.5)))
        return info.value

    error = run_seeded(main, seed)
    assert error.error.kind is ErrorKind.INVALID_REQUEST
    assert error.report is not None
    assert error.report.to_dict()["error"]["kind"] == "invalid_request"


async def test_report_to_dict_carries_every_documented_field(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    stream = th.hedged_stream(None, sources(ledger, Script(ttft=2.0), Script()))
    await read_all(stream)
    data = stream.report.to_dict()
    for name in (
        "attempts_sent",
        "backups_sent",
        "prompt_tokens",
        "prompt_tokens_resent",
        "idempotency_key",
        "wasted_tokens",
        "winner_replica",
    ):
        assert name in data
    assert (data["attempts_sent"], data["backups_sent"]) == (2, 1)


async def test_events_continue_where_async_for_stopped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    async with th.hedged_stream(None, sources(ledger, Script(tokens=5))) as stream:
        first = [await stream.__anext__(), await stream.__anext__()]
        rest = [d.content async for d in stream.events() if d.content]
    assert first == ["primary:0 ", "primary:1 "]
    assert rest == ["primary:2 ", "primary:3 ", "primary:4 "]


async def test_async_for_continues_where_events_stopped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    async with th.hedged_stream(None, sources(ledger, Script(tokens=4))) as stream:
        async for delta in stream.events():
            assert delta.content == "primary:0 "
            break
        rest = [t async for t in stream]
    assert rest == ["primary:1 ", "primary:2 ", "primary:3 "]


def _empty_then_done(end_at: float) -> Callable[[AttemptInfo], AsyncIterator[Delta]]:
    async def answer(info: AttemptInfo) -> AsyncIterator[Delta]:
        await trio.sleep(end_at)
        yield Delta(finish_reason="stop")  # a complete answer with no token

    return answer


async def test_an_empty_answer_does_not_beat_a_running_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    replicas = [
        th.iterator_source(_empty_then_done(0.1), name="empty"),
        scripted("content", Script(ttft=0.25), ledger),
    ]
    stream = th.hedged_stream(None, replicas, HedgePolicy(hedge_after=0.05))
    assert await read_all(stream) == ["content:0 ", "content:1 ", "content:2 "]
    assert stream.report.winner == 2
    assert stream.report.ttft == 0.3


async def test_an_empty_answer_commits_when_nothing_else_can_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    replicas = [
        th.iterator_source(_empty_then_done(0.1), name="empty"),
        scripted("failing", Script(fail_at=0.2), ledger),
    ]
    stream = th.hedged_stream(None, replicas, HedgePolicy(hedge_after=0.05))
    async with stream:
        events = [d async for d in stream.events()]
    assert events == [Delta(finish_reason="stop")]
    report = stream.report
    assert (report.winner, report.ttft, report.completed) == (1, 0.25, True)
    assert [a.outcome for a in report.attempts] == [O.WON, O.FAILED]
    # Alone, an empty answer commits at once: no backup is sent for it.
    stream = th.hedged_stream(None, [th.iterator_source(_empty_then_done(0.1), name="e")])
    assert await read_all(stream) == []
    assert (stream.report.ttft, stream.report.backups_sent) == (pytest.approx(0.1), 0)


async def test_a_hedger_takes_an_empty_answer_too(autojump_clock: trio.testing.MockClock) -> None:
    # The winner has no TTFT to learn from: nothing is observed, nothing breaks.
    hedger = th.Hedger([th.iterator_source(_empty_then_done(0.1), name="e")])
    stream = hedger.stream(None)
    assert await read_all(stream) == []
    assert stream.report.winner == 1
    stats = hedger.statistics()
    assert (stats.finished, stats.failed, stats.ttft_p50) == (1, 0, None)


async def test_reasoning_resets_the_stall_clock_under_its_rule(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    thinker = Script(ttft=0.5, tokens=20, gap=0.5, reasoning=True)  # 10 s of steady thought
    policy = HedgePolicy(first_token=FirstToken.CONTENT_OR_REASONING, stall_timeout=5.0)
    async with th.hedged_stream(None, sources(ledger, thinker), policy) as stream:
        thoughts = [d.reasoning async for d in stream.events()]
    assert len(thoughts) == 20
    assert stream.report.error is None


def test_scheduler_seeding_changes_tie_order() -> None:
    # The seeded tests above only prove something if the seeds really vary the order.
    async def main() -> list[str]:
        order: list[str] = []

        async def mark(name: str) -> None:
            await trio.sleep(1.0)
            order.append(name)

        async with trio.open_nursery() as nursery:
            for name in "abcd":
                nursery.start_soon(mark, name)
        return order

    orders = {tuple(run_seeded(main, seed)) for seed in SEEDS}
    assert len(orders) > 1
    random.seed()  # leave the global RNG as pytest found it


assert BaseExceptionGroup  # imported for Python 3.10 type checkers


# -- 4. safe inputs (the plan) ----------------------------------------------------------------


async def test_a_huge_attempts_per_replica_is_planned_lazily(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Today the whole plan is built up front: 10**9 entries (a MemoryError after 27 s).
    ledger = Ledger()
    policy = HedgePolicy(attempts_per_replica=10**9, max_attempts=3)
    replicas = sources(ledger, Script(fail_at=0.1), Script(fail_at=0.1))
    with pytest.raises(th.AllAttemptsFailed) as info:
        await read_all(th.hedged_stream(None, replicas, policy))
    assert len(info.value.errors) == 3


def test_duplicate_replicas_are_refused() -> None:
    ledger = Ledger()
    (one,) = sources(ledger, Script())
    with pytest.raises(ValueError, match="unique"):
        th.hedged_stream(None, [one, one])
    with pytest.raises(ValueError, match="unique"):
        th.hedged_stream({}, [th.Replica("http://h:1/v1"), th.Replica("http://h:1/v1/")])
    with pytest.raises(ValueError, match="unique"):
        th.Hedger([one, one])


async def test_a_replica_at_fault_is_not_tried_again_in_the_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    replicas = sources(ledger, Script(fail_at=0.1, fail_kind=ErrorKind.AUTH), Script(fail_at=0.2))
    policy = HedgePolicy(attempts_per_replica=3)
    with pytest.raises(th.AllAttemptsFailed) as info:
        await read_all(th.hedged_stream(None, replicas, policy))
    assert [e.replica for e in info.value.errors] == ["primary", "backup", "backup", "backup"]


@pytest.mark.parametrize("seed", SEEDS)
def test_an_empty_answer_in_the_tick_the_caller_leaves_is_not_half_committed(seed: int) -> None:
    # The empty answer ends at 0.1 s, the very tick the caller cancels its scope. The parent
    # loop read the queued news without a checkpoint and committed the answer after its
    # attempt's task, cancelled, had already taken its stream back: the hand-over raised
    # KeyError (hidden by the cancel), the attempt said WON and the report had no winner (the
    # cancellation fuzz: "winner != the WON attempt", 1 race in 10,000).
    async def main() -> th.Report:
        replicas = [th.iterator_source(_empty_then_done(0.1), name="empty")]
        stream = th.hedged_stream(None, replicas, HedgePolicy(hedge_after=None))
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as scope:

                async def leave() -> None:
                    await trio.sleep(0.1)
                    scope.cancel()

                nursery.start_soon(leave)
                await read_all(stream)
        return stream.report

    report = run_seeded(main, seed)
    won = [a.number for a in report.attempts if a.outcome is O.WON]
    assert won == ([report.winner] if report.winner is not None else [])
    assert all(a.ended_at is not None for a in report.attempts)


async def test_a_failover_is_not_a_hedge(autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()
    replicas = sources(ledger, Script(fail_at=0.1), Script(ttft=0.2))
    stream = th.hedged_stream(None, replicas, HedgePolicy(hedge_after=0.5))
    await read_all(stream)
    report = stream.report
    assert [a.trigger for a in report.attempts] == ["primary", "failover"]
    assert (report.hedged, report.backups_sent) == (False, 1)


async def test_a_failover_never_waits_for_a_close(autojump_clock: trio.testing.MockClock) -> None:
    # The failed primary's close takes 0.9 s: the failover starts at the failure, not after.
    ledger = Ledger()
    replicas = sources(ledger, Script(fail_at=0.1, close_delay=0.9), Script(ttft=0.2))
    stream = th.hedged_stream(None, replicas, HedgePolicy(hedge_after=0.5))
    await read_all(stream)
    report = stream.report
    assert [(a.trigger, a.started_at) for a in report.attempts] == [
        ("primary", 0.0),
        ("failover", 0.1),
    ]
    assert report.ttft == pytest.approx(0.3)
    assert ledger.open_now == 0


async def test_role_only_deltas_do_not_reset_the_stall_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # After one token, the winner sends only role-only deltas every 0.4 s for 4 s: no
    # progress, so the stall timeout (1 s) fires 1 s after the token.
    async def chatty(info: AttemptInfo) -> AsyncIterator[str | Delta]:
        await trio.sleep(0.1)
        yield "tok "
        for _ in range(10):
            await trio.sleep(0.4)
            yield Delta(role="assistant")

    replicas = [th.iterator_source(chatty, name="chatty")]
    policy = HedgePolicy(hedge_after=None, stall_timeout=1.0)
    with pytest.raises(th.StreamInterrupted) as info:
        await read_all(th.hedged_stream(None, replicas, policy))
    assert info.value.error.kind is ErrorKind.STALL
    assert info.value.text == "tok "
    report = info.value.report
    assert report is not None and report.total == pytest.approx(1.1)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_first_token_at_the_first_token_timeout_wins(seed: int) -> None:
    # The first token lands in the very tick first_token_timeout expires: under every order
    # of Trio's scheduler, the token wins (as a token at the hedge delay wins without a hedge).
    async def main() -> tuple[list[str], Ledger]:
        ledger = Ledger()
        policy = HedgePolicy(hedge_after=None, first_token_timeout=0.7)
        stream = th.hedged_stream(None, sources(ledger, Script(ttft=0.7, tokens=2)), policy)
        return await read_all(stream), ledger

    tokens, ledger = run_seeded(main, seed)
    assert tokens == ["primary:0 ", "primary:1 "]
    assert ledger.open_now == 0


async def test_the_report_dict_lists_every_failure_kind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    replicas = [
        th.iterator_source(_failing(0.1, ErrorKind.SERVER_ERROR), name="a"),
        th.iterator_source(_failing(0.1, ErrorKind.OVERLOADED), name="b"),
    ]
    with pytest.raises(th.AllAttemptsFailed) as info:
        await read_all(th.hedged_stream(None, replicas, HedgePolicy(hedge_after=1.0)))
    report = info.value.report
    assert report is not None
    error = report.to_dict()["error"]
    assert (error["kinds"], error["kind"]) == (["server_error", "overloaded"], "overloaded")


class _ShieldedPlanner:
    """A custom planner that hedges after 0.2 s, then decides the backup's source in a
    shielded wait until ``returns_at``: the race's cancel (a commit, a fatal error) does not
    reach it, so it hands back a source after the race was decided."""

    def __init__(self, primary: th.sources.Source, late: th.sources.Source) -> None:
        self._primary, self._late = primary, late
        self.returns_at = 1.0
        self.asked: list[tuple[int, str]] = []
        self.records: list[tuple[str, int, O]] = []  # (replica, attempt, outcome) per change
        self.finished: list[th.Report] = []

    async def next_source(self, number: int, trigger: str) -> th.sources.Source | None:
        self.asked.append((number, trigger))
        if number == 1:
            return self._primary
        with trio.CancelScope(shield=True):
            await trio.sleep_until(self.returns_at)
        return self._late

    def hedge_delay(self, number: int) -> float | None:
        return 0.2

    def may_hedge(self) -> bool:
        return True

    def attempt_changed(self, source: th.sources.Source, record: th.AttemptRecord) -> None:
        self.records.append((source.name, record.number, record.outcome))

    def request_finished(self, report: th.Report) -> None:
        self.finished.append(report)


@pytest.mark.parametrize(
    ("primary", "outcome"),
    [
        (Script(ttft=0.5, tokens=2), O.WON),
        (Script(fail_at=0.5, fail_kind=ErrorKind.INVALID_REQUEST), O.FAILED),
    ],
    ids=["commit", "fatal error"],
)
async def test_no_attempt_starts_after_the_commit_for_a_custom_planner(
    autojump_clock: trio.testing.MockClock, primary: Script, outcome: O
) -> None:
    # The hedge is due at 0.2 s; the primary commits (or fails fatally) at 0.5 s while the
    # planner waits, shielded, for the backup's source; it returns one at 1.0 s. The race
    # is decided: that source is never opened and no attempt is added.
    ledger = Ledger()
    planner = _ShieldedPlanner(
        scripted("primary", primary, ledger), scripted("late", Script(ttft=0.1), ledger)
    )
    stream = th.HedgedStream(planner, HedgePolicy(hedge_after=0.2))
    t0 = trio.current_time()
    tokens: list[str] = []
    with contextlib.suppress(th.FatalAttemptError):
        async with stream:
            tokens = [token async for token in stream]
    assert [name for name, *_ in ledger.opened] == ["primary"]  # the late source never opened
    assert planner.asked == [(1, "primary"), (2, "hedge")]
    assert planner.records == [("primary", 1, O.RUNNING), ("primary", 1, outcome)]
    (report,) = planner.finished
    assert [(a.number, a.replica, a.trigger, a.outcome) for a in report.attempts] == [
        (1, "primary", "primary", outcome)
    ]
    assert (report.attempts_sent, report.backups_sent, report.hedged) == (1, 0, False)
    assert report.winner == (1 if outcome is O.WON else None)
    assert stream.report == report
    assert tokens == (["primary:0 ", "primary:1 "] if outcome is O.WON else [])
    assert ledger.open_now == 0
    # (the race waits for its planner: the primary's last token, due at 0.6 s, was read by then)
    assert trio.current_time() - t0 == 1.0
