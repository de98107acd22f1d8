"""The race against a reference model of its rule, ties included (hypothesis, virtual time).

The rule (``docs/index.md``, "The race, step by step"): attempt 1 starts at 0; attempt k+1
starts when ``hedge_after`` passes after the latest attempt started, or at once when a running
attempt fails before its first token; the first first token commits; nothing starts after
the commit.

**Ties.** Every time below is a multiple of 1/8 s, so sums are exact in floating point and
events land on the very same virtual instant often. What happens at one instant *t* is decided
as one step, in this order:

1. **Commit first.** If any running attempt's first token is due at *t*, the race commits at
   *t*: one of those attempts wins (which one is the scheduler's choice: any of them is right),
   the others with a first token at *t* lose (``cancelled``), attempts whose failure is due at
   *t* end ``failed`` at *t* (they did fail; ``cancelled`` is accepted too, as the commit
   may be seen first), every other running attempt is ``cancelled`` at *t*, and **no attempt
   starts at or after *t*** -- not for a failure at *t*, not for a hedge due at *t* (a first
   token due at the very instant the delay ends wins without a hedge).
2. **Each failure counts.** Otherwise, every attempt whose failure is due at *t* ends
   ``failed`` at *t*, and each of them starts its own failover at *t* (*n* failures at one
   instant start *n* attempts, as long as the plan has attempts left), labelled
   ``"failover"``.
3. **A failure beats the hedge.** If the hedge delay also ends at *t*, the failovers of step 2
   are all that starts: a failure at the instant the hedge delay ends is a failover, not a
   hedge, and spends no hedge.
4. **Hedge.** Otherwise, if the hedge delay ends at *t* and the plan has attempts left, one
   attempt starts at *t*, labelled ``"hedge"``.
5. Whenever attempts start at *t*, the hedge delay restarts from *t*.

If every attempt failed and the plan has none left, the race fails (``AllAttemptsFailed``,
one error per attempt). ``report.hedged`` is whether some attempt is labelled ``"hedge"``;
``backups_sent`` is the number of attempts less one.

No script has an event at the instant its attempt starts (no zero durations), so a step never
feeds itself. Trio picks the order of tasks woken in one tick at random (under hypothesis:
from a seeded random); the tests also draw a number of idle rounds to run first, which shifts
that random sequence, so a tie is tried in more than one order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_hedge as th
from trio_hedge.report import AttemptOutcome as O

from .scripted import Ledger, Script, sources

EIGHTH = 0.125


@attrs.frozen
class Expected:
    starts: tuple[tuple[float, str], ...]  # (start time, trigger) per attempt
    winners: frozenset[int]  # attempts that may win (more than one: a tie); empty: none
    commit: float | None
    failed: frozenset[int]  # attempts that end failed (at their failure time)
    failed_at_commit: frozenset[int]  # failures due at the commit instant (failed or cancelled)


def _event(script: Script) -> float:
    return script.fail_at if script.fail_at is not None else script.ttft


def reference(scripts: Sequence[Script], hedge_after: float | None) -> Expected:
    """The rule with ties (see the module docstring), as a step per instant."""
    hedge = math.inf if hedge_after is None else hedge_after
    starts: list[tuple[float, str]] = [(0.0, "primary")]
    next_hedge = hedge
    failed: set[int] = set()
    while True:
        left = len(scripts) - len(starts)
        running = {
            i: start + _event(scripts[i]) for i, (start, _) in enumerate(starts) if i not in failed
        }
        t = min([*running.values(), next_hedge if left else math.inf])
        if t == math.inf:  # every attempt failed, none left
            numbers = frozenset(i + 1 for i in failed)
            return Expected(tuple(starts), frozenset(), None, numbers, frozenset())
        due = [i for i, at in running.items() if at == t]
        commits = frozenset(i + 1 for i in due if scripts[i].fail_at is None)
        failing = {i for i in due if scripts[i].fail_at is not None}
        if commits:  # step 1
            at_commit = frozenset(i + 1 for i in failing)
            return Expected(tuple(starts), commits, t, frozenset(i + 1 for i in failed), at_commit)
        failed |= failing  # step 2
        failovers = min(len(failing), left)
        if failovers:  # steps 2 and 3
            starts += [(t, "failover")] * failovers
            next_hedge = t + hedge  # step 5
        elif t == next_hedge and left:  # step 4
            starts.append((t, "hedge"))
            next_hedge = t + hedge


async def shift_the_scheduler(rounds: int) -> None:
    """Two tasks checkpointing ``rounds`` times: Trio shuffles each tick's tasks with a random
    generator (seeded per example under hypothesis), and these ticks move that sequence on,
    so the ties that follow run in another order."""

    async def idle() -> None:
        for _ in range(rounds):
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(idle)
        nursery.start_soon(idle)


def run_engine(
    scripts: Sequence[Script], hedge_after: float | None, idle_rounds: int
) -> tuple[th.Report, BaseException | None, Ledger]:
    async def main() -> tuple[th.Report, BaseException | None, Ledger]:
        await shift_the_scheduler(idle_rounds)
        ledger = Ledger()
        stream = th.hedged_stream(
            None, sources(ledger, *scripts), th.HedgePolicy(hedge_after=hedge_after)
        )
        error: BaseException | None = None
        try:
            async with stream:
                async for _ in stream:
                    pass
        except th.HedgeError as exc:
            error = exc
        return stream.report, error, ledger

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


class _Mismatch:
    """Collects what differs from the model, one category at a time: each category raises
    from its own line, so hypothesis reports (and shrinks) each kind of failure apart."""

    def __init__(self, scripts: Sequence[Script], hedge_after: float | None, expected: Expected):
        self.head = f"scripts={list(scripts)} hedge_after={hedge_after}\n  expected {expected}"
        self.problems: list[str] = []

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.problems.append(message)

    def text(self) -> str:
        text = self.head + "\n  " + "\n  ".join(self.problems)
        self.problems = []
        return text


def assert_matches(
    scripts: Sequence[Script],
    hedge_after: float | None,
    expected: Expected,
    report: th.Report,
    error: BaseException | None,
    ledger: Ledger,
    *,
    race: bool = True,
    flags: bool = True,
) -> None:
    """Compare the engine's run with the model: the ``race`` (which attempts started, when
    and why; how each ended) and the report's summary ``flags``."""
    m = _Mismatch(scripts, hedge_after, expected)
    if race:
        _check_race(m, scripts, expected, report, error, ledger)
    if flags:
        # The report's summary flags.
        triggers = [a.trigger for a in report.attempts]
        m.check(
            report.hedged == ("hedge" in triggers), f"hedged={report.hedged}, triggers {triggers}"
        )
        m.check(report.backups_sent == len(report.attempts) - 1, "backups_sent")
        if m.problems:
            raise AssertionError("the report: " + m.text())


def _check_race(
    m: _Mismatch,
    scripts: Sequence[Script],
    expected: Expected,
    report: th.Report,
    error: BaseException | None,
    ledger: Ledger,
) -> None:
    # 1. Which attempts started, when, and why.
    got = [(a.started_at, a.trigger) for a in report.attempts]
    m.check(got == list(expected.starts), f"attempts (start, trigger) {got}")
    if m.problems:
        raise AssertionError("the attempts started: " + m.text())
    # 2. How the race ended and how each attempt ended.
    starts = dict(enumerate((s for s, _ in expected.starts), 1))
    if not expected.winners:
        m.check(isinstance(error, th.AllAttemptsFailed), f"raised {error!r}")
        if isinstance(error, th.AllAttemptsFailed):
            m.check(len(error.errors) == len(expected.starts), f"{len(error.errors)} errors")
        m.check(all(a.outcome is O.FAILED for a in report.attempts), "not all failed")
    else:
        m.check(error is None, f"raised {error!r}")
        m.check(report.winner in expected.winners, f"winner {report.winner}")
        m.check(report.ttft == expected.commit, f"committed at {report.ttft}")
        for a in report.attempts:
            if a.number == report.winner:
                m.check(a.outcome is O.WON, f"the winner is {a.outcome.value}")
                continue
            want: tuple[O, ...] = (O.CANCELLED,)
            at = expected.commit
            if a.number in expected.failed:
                want, at = (O.FAILED,), starts[a.number] + _event(scripts[a.number - 1])
            elif a.number in expected.failed_at_commit:
                want = (O.FAILED, O.CANCELLED)
            m.check(a.outcome in want, f"attempt {a.number} is {a.outcome.value}")
            m.check(a.ended_at == at, f"attempt {a.number} ended at {a.ended_at}, not {at}")
    m.check(ledger.open_now == 0, f"{ledger.open_now} attempts left open")
    if m.problems:
        raise AssertionError("the outcome: " + m.text())


# -- hypothesis: any scripts, on a grid that makes ties common --------------------------------

grid = st.integers(min_value=1, max_value=16).map(lambda n: n * EIGHTH)


@st.composite
def scripts(draw: st.DrawFn) -> list[Script]:
    out = []
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        if draw(st.integers(0, 4)) < 2:  # two in five attempts fail
            out.append(Script(fail_at=draw(grid), tokens=2, gap=EIGHTH))
        else:
            out.append(Script(ttft=draw(grid), tokens=2, gap=EIGHTH))
    return out


races = {
    "scripts": scripts(),
    "hedge_after": st.one_of(st.none(), grid),
    "idle_rounds": st.integers(min_value=0, max_value=12),
}


@settings(max_examples=400, deadline=None)
@given(**races)
def test_race_matches_the_reference_model(
    scripts: list[Script], hedge_after: float | None, idle_rounds: int
) -> None:
    """Which attempts start, when and why, who wins, and how every attempt ends."""
    expected = reference(scripts, hedge_after)
    report, error, ledger = run_engine(scripts, hedge_after, idle_rounds)
    assert_matches(scripts, hedge_after, expected, report, error, ledger, flags=False)


@settings(max_examples=200, deadline=None)
@given(**races)
def test_report_flags_match_the_reference_model(
    scripts: list[Script], hedge_after: float | None, idle_rounds: int
) -> None:
    """``report.hedged`` is whether a backup was really sent on the hedge delay, and
    ``backups_sent`` counts the backups (issue 8: not when the plan had no backup left)."""
    expected = reference(scripts, hedge_after)
    report, error, ledger = run_engine(scripts, hedge_after, idle_rounds)
    assert_matches(scripts, hedge_after, expected, report, error, ledger, race=False)


# -- the ties the rule names, each as a scenario ----------------------------------------------


def ok(ttft: float) -> Script:
    return Script(ttft=ttft, tokens=2, gap=EIGHTH)


def fail(at: float) -> Script:
    return Script(fail_at=at, tokens=2, gap=EIGHTH)


@attrs.frozen
class Tie:
    name: str
    scripts: tuple[Script, ...]
    hedge_after: float | None
    starts: tuple[tuple[float, str], ...]
    winners: frozenset[int]
    commit: float


TIES = [
    Tie(
        "two failures at once start two failovers",
        # The primary fails at 0.5; the backup, hedged at 0.375, fails at 0.5 too.
        (fail(0.5), fail(0.125), ok(1.0), ok(0.5)),
        0.375,
        ((0.0, "primary"), (0.375, "hedge"), (0.5, "failover"), (0.5, "failover")),
        frozenset({4}),
        1.0,
    ),
    Tie(
        "a failure as the hedge delay ends is a failover, not a hedge",
        (fail(1.0), ok(0.5), ok(5.0)),
        1.0,
        ((0.0, "primary"), (1.0, "failover")),
        frozenset({2}),
        1.5,
    ),
    Tie(
        "failures and the hedge delay at once: failovers only",
        (fail(0.5), fail(0.25), ok(1.0), ok(0.5)),
        0.25,
        ((0.0, "primary"), (0.25, "hedge"), (0.5, "failover"), (0.5, "failover")),
        frozenset({4}),
        1.0,
    ),
    Tie(
        "a first token as a failure lands starts nothing",
        # The backup (hedged at 0.625) fails at 1.0, as the primary's first token arrives.
        (ok(1.0), fail(0.375), ok(0.125)),
        0.625,
        ((0.0, "primary"), (0.625, "hedge")),
        frozenset({1}),
        1.0,
    ),
    Tie(
        "a first token, a failure and the hedge delay at once: the commit only",
        (ok(1.0), fail(0.5), ok(0.125)),
        0.5,
        ((0.0, "primary"), (0.5, "hedge")),
        frozenset({1}),
        1.0,
    ),
    Tie(
        "a first token as the hedge delay ends wins without a hedge",
        (ok(1.0), ok(0.125)),
        1.0,
        ((0.0, "primary"),),
        frozenset({1}),
        1.0,
    ),
    Tie(
        "two first tokens at once: one wins, the other is cancelled",
        (ok(1.0), ok(0.5)),
        0.5,
        ((0.0, "primary"), (0.5, "hedge")),
        frozenset({1, 2}),
        1.0,
    ),
]


@pytest.mark.parametrize("tie", TIES, ids=[t.name for t in TIES])
@settings(max_examples=24, deadline=None)
@given(idle_rounds=st.integers(min_value=0, max_value=24))
def test_ties(tie: Tie, idle_rounds: int) -> None:
    expected = reference(tie.scripts, tie.hedge_after)
    # The model says what the scenario says (a check of the model itself)...
    assert expected.starts == tie.starts
    assert expected.winners == tie.winners
    assert expected.commit == tie.commit
    # ...and the engine does it, whichever order Trio runs the tied tasks in.
    report, error, ledger = run_engine(tie.scripts, tie.hedge_after, idle_rounds)
    assert_matches(tie.scripts, tie.hedge_after, expected, report, error, ledger)


# -- a cancel at any instant, the commit's included -------------------------------------------


def instants(scripts: Sequence[Script], hedge_after: float | None) -> list[float]:
    """Every instant after 0 where something happens in the model's race (starts, failures,
    the commit), and one more: an eighth after the commit, while the losers close."""
    expected = reference(scripts, hedge_after)
    out = {start for start, _ in expected.starts}
    out |= {start + _event(scripts[i]) for i, (start, _) in enumerate(expected.starts)}
    if expected.commit is not None:
        out = {t for t in out if t <= expected.commit} | {expected.commit + EIGHTH}
    return sorted(out - {0.0})  # a cancel before anything started is the fuzz's business


#: How the cancel comes. Trio expires deadlines due at one instant in the order they were set:
#: a deadline set at the start expires before an attempt's wake-up due at the same instant
#: (it cancels the attempt's wait too), one set later expires after it (the attempt's wake-up
#: is already scheduled, and the race and the attempt run in either order). Over real sockets
#: the second is the common case: a first token arrives as I/O, before deadlines expire.
CANCELS = (
    "caller's deadline, set at the start",
    "caller's deadline, set late",
    "first_token_timeout",
)


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    closes=st.lists(st.sampled_from([0.0, 2 * EIGHTH]), min_size=4, max_size=4),
    **races,
)
def test_a_cancel_at_any_instant_leaves_nothing_open(
    data: st.DataObject,
    closes: list[float],
    scripts: list[Script],
    hedge_after: float | None,
    idle_rounds: int,
) -> None:
    """The caller's deadline or ``first_token_timeout`` at an instant where something else
    happens too (a start, a failure, the first token that commits) or while the losers close
    (some take 1/4 s): every attempt's stream is closed, every attempt ends final with an end
    time, and a timeout is reported only if no attempt committed (issue 8: a cancel landing
    at the commit dropped the winner unclosed)."""
    scripts = [attrs.evolve(s, close_delay=c) for s, c in zip(scripts, closes, strict=False)]
    at = data.draw(st.sampled_from(instants(scripts, hedge_after)), label="at")
    how = data.draw(st.sampled_from(CANCELS), label="how")

    async def main() -> tuple[th.Report, BaseException | None, Ledger]:
        await shift_the_scheduler(idle_rounds)
        ledger = Ledger()
        timeout = at if how == "first_token_timeout" else None
        policy = th.HedgePolicy(hedge_after=hedge_after, first_token_timeout=timeout)
        stream = th.hedged_stream(None, sources(ledger, *scripts), policy)
        error: BaseException | None = None
        async with trio.open_nursery() as helpers:
            with trio.CancelScope() as scope:
                if how == "caller's deadline, set at the start":
                    scope.deadline = at
                elif how == "caller's deadline, set late":

                    async def set_late() -> None:
                        await trio.sleep_until(at - 1 / 1024)  # after every other wait for `at`
                        scope.deadline = at

                    helpers.start_soon(set_late)
                try:
                    async with stream:
                        async for _ in stream:
                            pass
                except th.HedgeError as exc:
                    error = exc
            helpers.cancel_scope.cancel()
        return stream.report, error, ledger

    report, error, ledger = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    problems = []
    if ledger.open_now:
        problems.append(f"{ledger.open_now} attempt stream(s) left open")
    for a in report.attempts:
        if a.outcome not in (O.WON, O.CANCELLED, O.FAILED, O.TIMEOUT) or a.ended_at is None:
            problems.append(f"attempt {a.number} ended {a.outcome.value!r} at {a.ended_at}")
    if isinstance(error, th.AllAttemptsFailed) and report.winner is not None:
        problems.append(f"{error!r} although attempt {report.winner} committed")
    assert not problems, (
        f"{how} at {at}: scripts={scripts} hedge_after={hedge_after}: " + "; ".join(problems)
    )


class _Gated:
    """An attempt whose first token arrives the way I/O does: another task wakes it (a
    server's bytes becoming readable), not a deadline of its own. Then two more tokens."""

    def __init__(self, gate: trio.Event, ledger: Ledger, info: th.sources.AttemptInfo) -> None:
        self._gate, self._ledger, self._info = gate, ledger, info
        self._sent = 0
        ledger.opened.append(("gated", info.number, trio.current_time()))

    def __aiter__(self) -> _Gated:
        return self

    async def __anext__(self) -> str:
        if self._sent == 0:
            await self._gate.wait()
        elif self._sent == 3:
            raise StopAsyncIteration
        else:
            await trio.sleep(EIGHTH)
        self._sent += 1
        return f"t{self._sent} "

    async def aclose(self) -> None:
        self._ledger.closed.append(("gated", self._info.number, trio.current_time()))


@settings(max_examples=60, deadline=None)
@given(idle_rounds=st.integers(min_value=0, max_value=60))
def test_a_cancel_in_the_tick_of_the_first_token(idle_rounds: int) -> None:
    """The caller's cancel lands in the very tick the first token arrives (over sockets: the
    token is I/O, woken before deadlines expire; the fuzz meets it in ~2% of such races). The
    attempt's wake-up is already scheduled, so it runs after the cancel, in either order with
    the race: whichever runs first, the stream is closed and the report is final."""

    async def main() -> tuple[th.Report, Ledger, int]:
        await shift_the_scheduler(idle_rounds)
        ledger = Ledger()
        gate = trio.Event()
        source = th.iterator_source(lambda info: _Gated(gate, ledger, info), name="gated")
        stream = th.hedged_stream(None, [source], th.HedgePolicy(hedge_after=None))
        async with trio.open_nursery() as helpers:
            with trio.CancelScope() as scope:

                async def server() -> None:
                    await trio.sleep(1.0)
                    gate.set()  # the first token arrives...
                    scope.cancel()  # ...and, in the same tick, the caller's cancel

                helpers.start_soon(server)
                async with stream:
                    async for _ in stream:
                        pass
            helpers.cancel_scope.cancel()
        return stream.report, ledger, len(ledger.opened)

    report, ledger, opened = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert opened == 1
    problems = []
    if ledger.open_now:
        problems.append("the attempt's stream was left open")
    for a in report.attempts:
        if a.outcome not in (O.WON, O.CANCELLED, O.FAILED, O.TIMEOUT) or a.ended_at is None:
            problems.append(f"attempt {a.number} ended {a.outcome.value!r} at {a.ended_at}")
    assert not problems, "; ".join(problems)


class _Empty:
    """An attempt that ends cleanly with no token at all (an empty answer) ``at`` seconds
    after it starts."""

    def __init__(self, at: float, ledger: Ledger, info: th.sources.AttemptInfo) -> None:
        self._end = trio.current_time() + at
        self._ledger, self._info = ledger, info
        ledger.opened.append(("empty", info.number, trio.current_time()))

    def __aiter__(self) -> _Empty:
        return self

    async def __anext__(self) -> str:
        await trio.sleep_until(self._end)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._ledger.closed.append(("empty", self._info.number, trio.current_time()))


@settings(max_examples=60, deadline=None)
@given(idle_rounds=st.integers(min_value=0, max_value=60))
def test_an_empty_answer_and_the_last_failure_in_one_tick(idle_rounds: int) -> None:
    """The primary fails at 0.25 s, the backup (hedged at 0.125 s) ends with an empty answer
    at 0.25 s, and the hedge delay ends then too: nothing else can answer, so the empty answer
    stands, in whichever order the three land (the fuzz met it: the empty answer dropped and
    ``AllAttemptsFailed`` raised, the empty attempt reported ``cancelled``)."""

    async def main() -> tuple[th.Report, BaseException | None, Ledger]:
        await shift_the_scheduler(idle_rounds)
        ledger = Ledger()
        failing = sources(ledger, fail(0.25))[0]
        empty = th.iterator_source(lambda info: _Empty(EIGHTH, ledger, info), name="empty")
        stream = th.hedged_stream(None, [failing, empty], th.HedgePolicy(hedge_after=EIGHTH))
        error: BaseException | None = None
        try:
            async with stream:
                async for _ in stream:
                    pass
        except th.HedgeError as exc:
            error = exc
        return stream.report, error, ledger

    report, error, ledger = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    outcomes = [a.outcome.value for a in report.attempts]
    assert error is None, f"{error!r}; attempts ended {outcomes}"
    assert report.winner == 2
    assert outcomes == ["failed", "won"]
    assert report.completed and report.text == ""
    assert ledger.open_now == 0
