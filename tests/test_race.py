"""The race engine in virtual time: scenario tables with exact times."""

from __future__ import annotations

import sys
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import HedgePolicy
from trio_hedge.errors import ErrorKind
from trio_hedge.policy import Backoff
from trio_hedge.policy._backoff import backoff_delay, jitter_draw
from trio_hedge.report import AttemptOutcome as O

from .scripted import Ledger, Script, interrupting, sources

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup


@attrs.frozen
class Case:
    name: str
    scripts: tuple[Script, ...]
    policy: HedgePolicy
    winner: int | None
    starts: tuple[float, ...]  # attempt start times
    outcomes: tuple[O, ...]
    ttft: float | None
    triggers: tuple[str, ...]
    error: type[BaseException] | None = None


SLOW = Script(ttft=5.0)
FAST = Script(ttft=0.5)
P1 = HedgePolicy(hedge_after=1.0)

CASES = [
    Case("primary wins before the hedge", (FAST, FAST), P1, 1, (0.0,), (O.WON,), 0.5, ("primary",)),
    Case(
        "backup wins after the hedge",
        (SLOW, FAST),
        P1,
        2,
        (0.0, 1.0),
        (O.CANCELLED, O.WON),
        1.5,
        ("primary", "hedge"),
    ),
    Case(
        "primary still wins after the hedge",
        (Script(ttft=1.2), SLOW),
        P1,
        1,
        (0.0, 1.0),
        (O.WON, O.CANCELLED),
        1.2,
        ("primary", "hedge"),
    ),
    Case(
        "primary fails at 0.1: backup starts at 0.1, not at hedge_after",
        (Script(fail_at=0.1), FAST),
        P1,
        2,
        (0.0, 0.1),
        (O.FAILED, O.WON),
        0.6,
        ("primary", "failover"),
    ),
    Case(
        "connection error fails over at once",
        (Script(fail_at=0.0, fail_kind=ErrorKind.CONNECTION), FAST),
        P1,
        2,
        (0.0, 0.0),
        (O.FAILED, O.WON),
        0.5,
        ("primary", "failover"),
    ),
    Case(
        "fatal 400: no backup",
        (Script(fail_at=0.1, fail_kind=ErrorKind.INVALID_REQUEST), FAST),
        P1,
        None,
        (0.0,),
        (O.FAILED,),
        None,
        ("primary",),
        th.FatalAttemptError,
    ),
    Case(
        "fatal error on the backup cancels the primary",
        (SLOW, Script(fail_at=0.2, fail_kind=ErrorKind.CONTEXT_LENGTH_EXCEEDED)),
        P1,
        None,
        (0.0, 1.0),
        (O.CANCELLED, O.FAILED),
        None,
        ("primary", "hedge"),
        th.FatalAttemptError,
    ),
    Case(
        "all fail",
        (Script(fail_at=0.1), Script(fail_at=0.3)),
        P1,
        None,
        (0.0, 0.1),
        (O.FAILED, O.FAILED),
        None,
        ("primary", "failover"),
        th.AllAttemptsFailed,
    ),
    Case(
        "first token exactly at hedge_after wins without a hedge",
        (Script(ttft=1.0), FAST),
        P1,
        1,
        (0.0,),
        (O.WON,),
        1.0,
        ("primary",),
    ),
    Case(
        "three replicas staggered",
        (SLOW, SLOW, FAST),
        P1,
        3,
        (0.0, 1.0, 2.0),
        (O.CANCELLED, O.CANCELLED, O.WON),
        2.5,
        ("primary", "hedge", "hedge"),
    ),
    Case(
        "backup failure starts the third at once",
        (SLOW, Script(fail_at=0.25), FAST),
        P1,
        3,
        (0.0, 1.0, 1.25),
        (O.CANCELLED, O.FAILED, O.WON),
        1.75,
        ("primary", "hedge", "failover"),
    ),
    Case(
        "hedge_after=None is a plain failover",
        (SLOW, FAST),
        HedgePolicy(hedge_after=None),
        1,
        (0.0,),
        (O.WON,),
        5.0,
        ("primary",),
    ),
    Case(
        "hedge=False never hedges on time",
        (SLOW, FAST),
        HedgePolicy(hedge=False),
        1,
        (0.0,),
        (O.WON,),
        5.0,
        ("primary",),
    ),
    Case(
        "max_attempts=1 caps the race",
        (Script(fail_at=0.1), FAST),
        HedgePolicy(max_attempts=1),
        None,
        (0.0,),
        (O.FAILED,),
        None,
        ("primary",),
        th.AllAttemptsFailed,
    ),
    Case(
        "attempts_per_replica=2 retries the same replica after its back-off",
        (Script(fail_at=0.1),),
        HedgePolicy(attempts_per_replica=2, backoff=Backoff(jitter=False)),
        None,
        (0.0, 0.2),  # failed at 0.1, then the first back-off: 0.1 s
        (O.FAILED, O.FAILED),
        None,
        ("primary", "failover"),
        th.AllAttemptsFailed,
    ),
    Case(
        "attempts_per_replica=2 without a back-off retries at once",
        (Script(fail_at=0.1),),
        HedgePolicy(attempts_per_replica=2, backoff=None),
        None,
        (0.0, 0.1),
        (O.FAILED, O.FAILED),
        None,
        ("primary", "failover"),
        th.AllAttemptsFailed,
    ),
    Case(
        "first_token_timeout over all attempts",
        (SLOW, SLOW),
        HedgePolicy(first_token_timeout=3.0),
        None,
        (0.0, 1.0),
        (O.TIMEOUT, O.TIMEOUT),
        None,
        ("primary", "hedge"),
        th.AllAttemptsFailed,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_race_scenarios(case: Case, autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()
    stream = th.hedged_stream(None, sources(ledger, *case.scripts), case.policy)
    t0 = trio.current_time()
    tokens: list[str] = []
    if case.error is not None:
        with pytest.raises(case.error) as info:
            async with stream:
                pytest.fail("entered a failed stream")
        report = info.value.report
        assert report is not None
        assert report.error is info.value
        assert len(info.value.errors) == sum(o is O.FAILED for o in case.outcomes) + (
            1 if case.policy.first_token_timeout else 0
        )
    else:
        async with stream:
            async for token in stream:
                tokens.append(token)
        report = stream.report
        assert report.finished
        assert report.total == pytest.approx(case.ttft + 0.2)
    assert ledger.open_now == 0, "every opened attempt was closed"
    assert [a.started_at for a in report.attempts] == list(case.starts)
    assert tuple(a.outcome for a in report.attempts) == case.outcomes
    assert tuple(a.trigger for a in report.attempts) == case.triggers
    assert report.winner == case.winner
    assert report.ttft == case.ttft
    assert report.hedged == ("hedge" in case.triggers)
    if case.winner is not None:
        winner = case.scripts[case.winner - 1]
        name = report.winner_replica
        assert tokens == [f"{name}:{i} " for i in range(winner.tokens)]
        assert report.token_count == winner.tokens
        assert report.attempts[case.winner - 1].tokens_received == winner.tokens
        assert report.completed
        assert report.text == "".join(tokens)
        assert report.tpot_mean == pytest.approx(winner.gap)
        assert report.max_gap == pytest.approx(winner.gap)
        # losers were closed at the commit, not later
        for number, a in enumerate(report.attempts, 1):
            if a.outcome is O.CANCELLED:
                assert a.ended_at == case.ttft
                assert (a.replica, number, t0 + case.ttft) in ledger.closed


async def test_all_failed_error_carries_each_cause(autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()
    scripts = (Script(fail_at=0.1, fail_kind=ErrorKind.RATE_LIMIT), Script(fail_at=0.2))
    with pytest.raises(th.AllAttemptsFailed) as info:
        async with th.hedged_stream(None, sources(ledger, *scripts)):
            pass
    assert str(info.value) == (
        "all 2 attempts failed: rate_limit at primary; server_error at backup"
    )
    kinds = [e.kind for e in info.value.errors]
    assert kinds == [ErrorKind.RATE_LIMIT, ErrorKind.SERVER_ERROR]
    assert [e.replica for e in info.value.errors] == ["primary", "backup"]
    cause = info.value.__cause__
    assert isinstance(cause, ExceptionGroup)
    assert list(cause.exceptions) == list(info.value.errors)


# -- the caller leaves: break and cancel in every phase ---------------------------------------

PHASES = [
    # (name, cancel at, expected attempts started, what the attempts were doing)
    ("before the hedge", 0.5, 1),
    ("after the hedge", 1.2, 2),
    ("after the commit", 1.55, 2),
]


@pytest.mark.parametrize(("phase", "cancel_at", "started"), PHASES, ids=[p[0] for p in PHASES])
async def test_caller_cancel_in_every_phase(
    phase: str, cancel_at: float, started: int, autojump_clock: trio.testing.MockClock
) -> None:
    ledger = Ledger()
    stream = th.hedged_stream(None, sources(ledger, SLOW, Script(ttft=0.5, tokens=10)), P1)
    t0 = trio.current_time()
    got: list[str] = []
    with trio.move_on_after(cancel_at) as scope:
        async with stream:
            async for token in stream:
                got.append(token)
    assert scope.cancelled_caught
    assert trio.current_time() - t0 == cancel_at
    assert ledger.open_now == 0
    assert all(closed_at == t0 + cancel_at for *_, closed_at in ledger.closed[-1:])
    report = stream.report
    assert len(report.attempts) == started
    assert report.finished
    assert report.total == cancel_at
    if phase == "after the commit":
        assert got == ["backup:0 "]  # tokens at 1.5 and 1.6: the cancel at 1.55 falls between
        assert [a.outcome for a in report.attempts] == [O.CANCELLED, O.WON]
    else:
        assert got == []
        assert all(a.outcome is O.CANCELLED for a in report.attempts)


async def test_caller_break_after_commit(autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()
    stream = th.hedged_stream(None, sources(ledger, SLOW, Script(ttft=0.5, tokens=10)), P1)
    async with stream:
        async for token in stream:
            assert token == "backup:0 "
            break
    assert ledger.open_now == 0
    assert stream.report.text == "backup:0 "
    assert stream.report.attempts[1].outcome is O.WON
    assert stream.report.finished
    assert not stream.report.completed  # the caller left early


async def test_caller_exception_passes_through_unwrapped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    with pytest.raises(KeyError):
        async with th.hedged_stream(None, sources(ledger, FAST)) as stream:
            async for _ in stream:
                raise KeyError("caller's own")
    assert ledger.open_now == 0


async def test_error_after_commit_keeps_partial_text(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    script = Script(ttft=0.5, tokens=5, fail_after_tokens=2)
    got: list[str] = []
    with pytest.raises(th.StreamInterrupted) as info:
        async with th.hedged_stream(None, sources(ledger, script)) as stream:
            async for token in stream:
                got.append(token)
    assert got == ["primary:0 ", "primary:1 "]
    assert info.value.text == "primary:0 primary:1 "
    assert info.value.error.kind is ErrorKind.STREAM_TRUNCATED
    assert info.value.report is not None
    assert info.value.report.text == info.value.text
    assert stream.report.error is info.value
    assert ledger.open_now == 0


STALLS = [
    # (name, script, stall_timeout, tokens before the error or None, error time)
    ("silent winner", Script(ttft=0.5, tokens=5, stall_after_tokens=2), 2.0, 2, 0.6 + 2.0),
    ("slow but steady winner", Script(ttft=0.5, tokens=5, gap=1.5), 2.0, None, None),
]


@pytest.mark.parametrize(("name", "script", "stall", "n", "at"), STALLS, ids=[s[0] for s in STALLS])
async def test_stall_timeout(
    name: str,
    script: Script,
    stall: float,
    n: int | None,
    at: float | None,
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    t0 = trio.current_time()
    got: list[str] = []
    policy = HedgePolicy(stall_timeout=stall)
    if n is None:
        async with th.hedged_stream(None, sources(ledger, script), policy) as stream:
            got = [t async for t in stream]
        assert len(got) == script.tokens
    else:
        with pytest.raises(th.StreamInterrupted) as info:
            async with th.hedged_stream(None, sources(ledger, script), policy) as stream:
                async for token in stream:
                    got.append(token)
        assert len(got) == n
        assert info.value.error.kind is ErrorKind.STALL
        assert trio.current_time() - t0 == at
    assert ledger.open_now == 0


async def test_report_is_live_during_the_stream(autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()
    async with th.hedged_stream(None, sources(ledger, SLOW, FAST), P1) as stream:
        first = stream.report
        assert first.ttft == 1.5
        assert first.token_count == 1
        assert not first.finished
        assert first.winner == 2
        rest = [t async for t in stream]
    assert rest == ["backup:0 ", "backup:1 ", "backup:2 "]
    assert stream.report.finished


async def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="hedge_after"):
        HedgePolicy(hedge_after=-1)
    with pytest.raises(TypeError, match="hedge_after"):
        HedgePolicy(hedge_after="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_attempts"):
        HedgePolicy(max_attempts=0)
    with pytest.raises(ValueError):
        HedgePolicy(first_token="tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        th.hedged_stream(None, [])
    with pytest.raises(TypeError, match="Replica or Source"):
        th.hedged_stream(None, ["http://x"])  # type: ignore[list-item]


async def test_keyboard_interrupt_during_the_race(autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()
    replicas = [*sources(ledger, SLOW), interrupting("backup", 0.2, ledger)]
    with pytest.raises(KeyboardInterrupt):  # as itself, not wrapped in a group
        async with th.hedged_stream(None, replicas, P1):
            pytest.fail("entered")
    assert len(ledger.opened) == 2
    assert ledger.open_now == 0


async def test_keyboard_interrupt_after_commit(autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()
    with pytest.raises(KeyboardInterrupt):
        async with th.hedged_stream(None, sources(ledger, SLOW, FAST), P1) as stream:
            async for _ in stream:
                raise KeyboardInterrupt
    assert ledger.open_now == 0
    assert stream.report.finished


# -- hedged_stream's repeats back off, and wait for Retry-After (issue 16) -----------------------


async def test_repeats_on_dead_replicas_back_off_by_default(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Issue 16: attempts_per_replica=500 against two replicas that fail at once sent all
    # 1,000 attempts in 0 s. With the default back-off (0.1 s doubling to 5 s, full jitter
    # drawn from the request id) each replica's repeats are paced on their own.
    ledger = Ledger()
    dead = sources(ledger, Script(fail_at=0.0), Script(fail_at=0.0))
    policy = HedgePolicy(attempts_per_replica=500)
    t0 = trio.current_time()
    with pytest.raises(th.AllAttemptsFailed):
        async with th.hedged_stream(None, dead, policy, request_id="r"):
            pass
    expected = []
    for name in ("primary", "backup"):
        at = 0.0
        for repeat in range(500):
            if repeat:
                at += backoff_delay(repeat, Backoff(), jitter_draw("r", name, repeat))
            expected.append((at, name))
    expected.sort(key=lambda e: e[0])
    assert [name for name, _, _ in ledger.opened] == [name for _, name in expected]
    starts = [t - t0 for _, _, t in ledger.opened]
    assert starts == pytest.approx([at for at, _ in expected], abs=1e-9)
    assert sum(1 for at in starts if at < 1.0) < 20  # not 1,000 in 0 s
    assert trio.current_time() - t0 > 1000.0  # about 2.5 s a repeat past the fifth


class _PushedBack:
    """A source whose attempts fail with ``kind`` asking for ``retry_after`` seconds; the
    times its attempts opened are in ``opened``."""

    def __init__(self, retry_after: float | None, kind: ErrorKind = ErrorKind.RATE_LIMIT) -> None:
        self.retry_after, self.kind = retry_after, kind
        self.opened: list[float] = []

    def source(self) -> th.sources.Source:
        async def fail(_info: th.sources.AttemptInfo) -> Any:
            self.opened.append(trio.current_time())
            raise th.AttemptError(self.kind, "pushed back", retry_after=self.retry_after)
            yield  # an async generator

        return th.iterator_source(fail, name="pushed")


PUSHBACK_CASES = [
    # (name, Retry-After, policy, the attempts' start times)
    (
        "Retry-After 2 s: the repeat waits it",
        2.0,
        HedgePolicy(attempts_per_replica=2, backoff=None),
        [0.0, 2.0],
    ),
    (
        "beyond max_pushback_wait: not repeated",
        30.0,
        HedgePolicy(attempts_per_replica=2, backoff=None),
        [0.0],
    ),
    (
        "max_pushback_wait=None waits it",
        30.0,
        HedgePolicy(attempts_per_replica=2, backoff=None, max_pushback_wait=None),
        [0.0, 30.0],
    ),
    (
        "the longer of back-off and Retry-After",
        0.2,
        HedgePolicy(attempts_per_replica=3, backoff=Backoff(initial=0.5, jitter=False)),
        [0.0, 0.5, 1.5],
    ),
    (
        "no Retry-After, no back-off: at once",
        None,
        HedgePolicy(attempts_per_replica=2, backoff=None),
        [0.0, 0.0],
    ),
]


@pytest.mark.parametrize(
    ("name", "retry_after", "policy", "starts"), PUSHBACK_CASES, ids=[c[0] for c in PUSHBACK_CASES]
)
async def test_a_repeat_waits_for_the_replicas_retry_after(
    name: str,
    retry_after: float | None,
    policy: HedgePolicy,
    starts: list[float],
    autojump_clock: trio.testing.MockClock,
) -> None:
    pushed = _PushedBack(retry_after)
    t0 = trio.current_time()
    with pytest.raises(th.AllAttemptsFailed) as info:
        async with th.hedged_stream(None, [pushed.source()], policy):
            pass
    assert [t - t0 for t in pushed.opened] == starts
    assert [e.retry_after for e in info.value.errors] == [retry_after] * len(starts)
