"""The race against a reference model, for any scripts hypothesis can think of (virtual time).

The model is the rule the docs state: attempt 1 starts at 0; attempt k+1 starts when
``hedge_after`` passes after attempt k started, or at once when a running attempt fails,
whichever is first; the first first token commits, and nothing starts after it. Ties between
events are excluded (the engine's tie rules have their own scenario tests).
"""

from __future__ import annotations

import math

import attrs
import pytest
import trio
import trio.testing
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import trio_hedge as th
from trio_hedge import AttemptOutcome as O

from .scripted import Ledger, Script, sources


@attrs.frozen
class Expected:
    starts: tuple[float, ...]
    winner: int | None  # 1-based
    commit: float | None
    events: tuple[float, ...]  # every event time, to exclude ties


def reference(scripts: list[Script], hedge_after: float | None) -> Expected:
    starts = [0.0]
    events: list[float] = []
    consumed = 0.0  # failures at or before this time already woke the loop
    while True:
        ends = [
            (s + (sc.fail_at if sc.fail_at is not None else sc.ttft), sc.fail_at is None)
            for s, sc in zip(starts, scripts, strict=False)
        ]
        commits = [t for t, ok in ends if ok]
        commit = min(commits) if commits else math.inf
        if len(starts) == len(scripts):
            break
        delay_end = starts[-1] + (math.inf if hedge_after is None else hedge_after)
        failures = [t for t, ok in ends if not ok and t > consumed]
        wake = min([delay_end, *failures])
        if commit < wake or wake == math.inf:
            break
        starts.append(wake)
        consumed = wake
        events.append(wake)
    ends = [
        s + (sc.fail_at if sc.fail_at is not None else sc.ttft)
        for s, sc in zip(starts, scripts, strict=False)
    ]
    events += ends
    winner = None
    commit_at: float | None = None
    candidates = [
        (s + sc.ttft, i + 1)
        for i, (s, sc) in enumerate(zip(starts, scripts, strict=False))
        if sc.fail_at is None
    ]
    if candidates:
        commit_at, winner = min(candidates)
    return Expected(tuple(starts), winner, commit_at, tuple(events))


# Times on a 0.1 s grid, nudged apart per attempt so that ties are rare (and excluded).
times = st.integers(min_value=0, max_value=40).map(lambda n: n / 10)


@st.composite
def scripts(draw: st.DrawFn) -> list[Script]:
    n = draw(st.integers(min_value=1, max_value=4))
    out = []
    for i in range(n):
        nudge = (i + 1) * 0.0013
        if draw(st.booleans()) and draw(st.booleans()):  # a quarter of attempts fail
            out.append(Script(fail_at=draw(times) + nudge, tokens=2, gap=0.1))
        else:
            out.append(Script(ttft=draw(times) + nudge, tokens=2, gap=0.1))
    return out


@settings(max_examples=300, deadline=None)
@given(
    scripts=scripts(),
    hedge_after=st.one_of(st.none(), times.map(lambda t: t + 0.0007)),
)
def test_race_matches_the_reference_model(scripts: list[Script], hedge_after: float | None) -> None:
    expected = reference(scripts, hedge_after)
    rounded = [round(t, 9) for t in expected.events if t != math.inf]
    assume(len(rounded) == len(set(rounded)))  # no ties

    async def main() -> tuple[th.Report, BaseException | None, Ledger]:
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

    report, error, ledger = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ledger.open_now == 0
    assert tuple(a.started_at for a in report.attempts) == pytest.approx(expected.starts)
    assert report.winner == expected.winner
    if expected.winner is None:
        assert isinstance(error, th.AllAttemptsFailed)
        assert len(error.errors) == len(expected.starts)
        assert all(a.outcome is O.FAILED for a in report.attempts)
    else:
        assert error is None
        assert report.ttft == pytest.approx(expected.commit)
        for number, attempt in enumerate(report.attempts, 1):
            if number == expected.winner:
                assert attempt.outcome is O.WON
            elif (
                scripts[number - 1].fail_at is not None
                and attempt.ended_at is not None
                and (attempt.error is not None)
            ):
                assert attempt.outcome is O.FAILED
            else:
                assert attempt.outcome is O.CANCELLED
                assert attempt.ended_at == pytest.approx(expected.commit)
