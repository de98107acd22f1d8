"""After the commit, liveness is the upstream's, not the caller's (issue 16), in virtual time.

The stall timeout bounds the winner's *silence*: the seconds the caller spends waiting for
its next batch with no output arriving. Time the caller spends between reads (a tool call, a
database write, a slow gateway client) is not the upstream's, and any output (content,
reasoning, tool-call fragments) proves the upstream alive, whatever the first-token rule.

Each replica follows a timeline: deltas due at fixed times after the attempt opens (what
arrives while the caller is away waits, as in a socket buffer), then the end or silence.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import HedgePolicy, HedgerConfig
from trio_hedge.errors import ErrorKind
from trio_hedge.events import Delta, FirstToken, ToolCallDelta
from trio_hedge.policy import OutlierDetection
from trio_hedge.sources import AttemptInfo


@attrs.frozen
class Timeline:
    """``events``: (seconds after the attempt opens, delta); then the end, or silence."""

    events: Sequence[tuple[float, Delta]]
    silent_after: bool = False  # no end: silent forever after the last event


def steady(n: int, *, first: float = 0.5, gap: float = 0.05, then_silent: bool = False) -> Timeline:
    """``n`` content tokens, the first at ``first`` s, then one every ``gap`` s."""
    events = [(first + i * gap, Delta(content=f"t{i} ")) for i in range(n)]
    return Timeline(events, silent_after=then_silent)


def after_content(every: float, n: int, **fields: object) -> Timeline:
    """One content token at 0.5 s (the commit), then ``n`` deltas of ``fields`` every ``every``
    s, then the end."""
    later = [(0.5 + (i + 1) * every, Delta(**fields)) for i in range(n)]  # type: ignore[arg-type]
    return Timeline([(0.5, Delta(content="Let me look that up. ")), *later])


TOOL = ToolCallDelta(index=0, arguments='{"q": ')
#: An agent's answer: a sentence, then a tool call streamed a fragment every 0.8 s.
AGENT = after_content(0.8, 6, tool_calls=(TOOL,))
THINKER = after_content(0.8, 6, reasoning="hmm ")
ROLE_ONLY = after_content(0.4, 10, role="assistant")
USAGE_ONLY = after_content(0.4, 10, usage={"completion_tokens": 1})


class _TimelineIterator:
    """Not a generator: read directly by the caller's task after the commit (the hot path)."""

    def __init__(self, timeline: Timeline) -> None:
        self._timeline = timeline
        self._start = trio.current_time()
        self._next = 0
        self.closed = False

    def __aiter__(self) -> _TimelineIterator:
        return self

    async def __anext__(self) -> Delta:
        events = self._timeline.events
        if self._next == len(events):
            if self._timeline.silent_after:
                await trio.sleep_forever()
            raise StopAsyncIteration
        at, delta = events[self._next]
        await trio.sleep_until(self._start + at)
        self._next += 1
        return delta

    async def aclose(self) -> None:
        self.closed = True


def timeline_source(name: str, timeline: Timeline, *, generator: bool = False) -> th.sources.Source:
    if not generator:
        return th.iterator_source(lambda _info: _TimelineIterator(timeline), name=name)

    async def relayed(_info: AttemptInfo) -> object:  # an async generator: relayed by its task
        async for delta in _TimelineIterator(timeline):
            yield delta

    return th.iterator_source(relayed, name=name)  # type: ignore[arg-type]


async def read(stream: th.HedgedStream, pauses: dict[int, float]) -> list[Delta]:
    """Read every event; after the n-th delta with output, the caller is away ``pauses[n]`` s."""
    got: list[Delta] = []
    async for delta in stream.events():
        got.append(delta)
        pause = pauses.get(sum(1 for d in got if d.has_output))
        if pause is not None and delta.has_output:
            await trio.sleep(pause)
    return got


EVERY_TOKEN = dict.fromkeys(range(1, 11), 2.5)

# (name, timeline, stall_timeout, the caller's pauses, outputs read, stall time or None)
LIVENESS = [
    ("a 2.5 s pause, tokens every 50 ms", steady(100), 2.0, {3: 2.5}, 100, None),
    ("a 2.5 s pause after every token", steady(10), 2.0, EVERY_TOKEN, 10, None),
    ("a 60 s pause, tokens every 50 ms", steady(100), 2.0, {50: 60.0}, 100, None),
    # The upstream goes silent after its 3rd token (at 0.6 s) while the caller reads on: the
    # stall is found 2 s later, as before.
    ("silent upstream, caller waiting", steady(3, then_silent=True), 2.0, {}, 3, 0.6 + 2.0),
    # Silent while the caller is away 1.5 s (back at 2.1 s): only the caller's own waiting
    # counts, so the stall is found 2 s after it came back (silent and back-pressured look
    # alike without a read; a late stall costs this caller only, a false one the replica).
    ("silent upstream, caller away", steady(3, then_silent=True), 2.0, {3: 1.5}, 3, 2.1 + 2.0),
    # Any output proves liveness, whatever the first-token rule (CONTENT here).
    ("tool-call fragments every 0.8 s", AGENT, 2.0, {}, 7, None),
    ("reasoning every 0.8 s", THINKER, 2.0, {}, 7, None),
    # Not output: role-only deltas and usage, however often.
    ("role-only deltas every 0.4 s", ROLE_ONLY, 2.0, {}, 1, 0.5 + 2.0),
    ("usage-only deltas every 0.4 s", USAGE_ONLY, 2.0, {}, 1, 0.5 + 2.0),
]


@pytest.mark.parametrize("generator", [False, True], ids=["direct", "relayed"])
@pytest.mark.parametrize(
    ("name", "timeline", "stall", "pauses", "outputs", "stall_at"),
    LIVENESS,
    ids=[row[0] for row in LIVENESS],
)
async def test_the_stall_clock_is_the_upstreams_silence(
    name: str,
    timeline: Timeline,
    stall: float,
    pauses: dict[int, float],
    outputs: int,
    stall_at: float | None,
    generator: bool,
    autojump_clock: trio.testing.MockClock,
) -> None:
    policy = HedgePolicy(hedge_after=None, stall_timeout=stall, first_token=FirstToken.CONTENT)
    replicas = [timeline_source("r", timeline, generator=generator)]
    t0 = trio.current_time()
    stream = th.hedged_stream(None, replicas, policy)
    got: list[Delta] = []
    try:
        async with stream:
            got = await read(stream, pauses)
    except th.StreamInterrupted as exc:
        assert exc.error.kind is ErrorKind.STALL
        assert trio.current_time() - t0 == pytest.approx(stall_at, abs=1e-9)
        assert exc.report is not None
        assert sum(1 for a in exc.report.attempts if a.error is not None) == 1
    else:
        assert stall_at is None
        assert stream.report.error is None and stream.report.completed
    assert stream.report.token_count == sum(1 for d in timeline.events if d[1].content)
    if stall_at is None:
        assert sum(1 for d in got if d.has_output) == outputs


# -- shared state: one caller's pause never blames the replica for another --------------------

#: Eject at the first failure, a as the preferred primary: any blame shows in the next request.
SHARED = HedgerConfig(
    hedge_after=1.0,
    stall_timeout=2.0,
    budget=None,
    throttle=None,
    pick="in_order",
    outlier_detection=OutlierDetection(consecutive_failures=1),
)


def _decisions(report: th.Report) -> list[tuple[str, str, float, float | None]]:
    """What the measured caller got: each attempt's replica, trigger, start and TTFT."""
    return [(a.replica, a.trigger, a.started_at, a.ttft) for a in report.attempts]


async def _measured(hedger: th.Hedger, start: float) -> th.Report:
    await trio.sleep_until(start)
    async with hedger.stream(None) as stream:
        async for _ in stream:
            pass
    return stream.report


async def _pausing(hedger: th.Hedger, pause_after: int, pause: float) -> th.Report:
    try:
        async with hedger.stream(None) as stream:
            await read(stream, {pause_after: pause})
    except th.StreamInterrupted as exc:  # bcbad18: a "stall" (checked below, after caller 2)
        assert exc.report is not None
        return exc.report
    return stream.report


@pytest.mark.parametrize(
    ("name", "timeline", "pauses"),
    [
        ("a 2.5 s pause, tokens every 50 ms", steady(100), (3, 2.5)),
        ("an agent's tool call, a fragment every 0.8 s", AGENT, (1, 0.0)),
    ],
    ids=["caller pause", "tool call"],
)
async def test_a_callers_pause_or_tool_call_never_blames_the_replica(
    name: str,
    timeline: Timeline,
    pauses: tuple[int, float],
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Caller 1 pauses mid-stream (or streams a tool call); caller 2 starts at 3.5 s, while
    # caller 1 is still reading. Caller 2's decisions, hedges and TTFT must be those of a run
    # without caller 1; on bcbad18 caller 1 "stalled" at 3.1 s (2.5 s), a was ejected, and
    # caller 2 went to b.
    def hedger() -> th.Hedger:
        return th.Hedger(
            [timeline_source("a", timeline), timeline_source("b", steady(5, first=0.7))], SHARED
        )

    baseline = await _measured(hedger(), trio.current_time() + 3.5)

    shared = hedger()
    results: dict[str, th.Report] = {}

    async def first() -> None:
        results["first"] = await _pausing(shared, *pauses)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        results["second"] = await _measured(shared, trio.current_time() + 3.5)

    first_report, second = results["first"], results["second"]
    assert _decisions(second) == _decisions(baseline) == [("a", "primary", 0.0, 0.5)]
    assert (second.hedged, second.ttft) == (baseline.hedged, baseline.ttft) == (False, 0.5)
    (a, b) = shared.statistics().replicas
    assert (a.name, a.failures, a.times_ejected, a.state) == ("a", 0, 0, "healthy")
    assert b.failures == 0
    assert first_report.error is None and first_report.completed
