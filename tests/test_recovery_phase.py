"""The recovery phase after the commit has a clock and a hedge of its own (issue 28): a recovery
on a replica that never answers is abandoned at its first-token deadline and the next one
tried, or a second recovery hedged while the first is slow; a recovery's prefill is held to
that deadline, never called a stall; ``stall_timeout`` still bounds silence after a first
output. Every case in virtual time over ``MockReplicas``: exact times, the report's records
and the evidence the judge reads (``RecoveryRecord.deadline``, ``hedged``, ``first_output``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.errors import ErrorKind
from trio_hedge.policy import HedgeBudget, HedgerConfig, OutlierDetection, RecoveryPolicy
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.testing import Behaviour, MockReplicas

REQUEST: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
N = 12
FULL = "".join(f"tok{i} " for i in range(N))
TIMED = {"ttft": 0.5, "token_delay": 0.1}
#: Cut when its 6th token is due: 5 tokens at 0.5..0.9 s, the cut at 1.0 s.
CUT = Behaviour(tokens=N, cut_after=5, **TIMED)
GOOD = Behaviour(tokens=N, **TIMED)
NEVER = Behaviour(tokens=N, ttft=3600.0)  # headers at once, no token for an hour
#: Failover-only requests would hedge nothing: a fixed 1 s delay, every replica in order.
FIXED = HedgerConfig(hedge_after=1.0, pick="in_order", outlier_detection=None)


def prefix(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


@attrs.frozen
class Attempt:
    """What one attempt's record must say (times from the request's start)."""

    replica: str
    trigger: str
    outcome: O
    started_at: float
    error: ErrorKind | None = None
    hedged: bool = False
    deadline: float | None = None
    first_output: float | None = None


@attrs.frozen
class Case:
    name: str
    behaviours: dict[str, Behaviour]
    config: HedgerConfig
    attempts: Sequence[Attempt]
    text: str = FULL
    error: ErrorKind | None = None  # the StreamInterrupted's (the original failure's)
    hedge: bool = True  # the request's own hedge switch
    gap: float | None = None  # the caller's wait between token 5 and token 6


CASES = [
    Case(
        "a recovery on a replica that never answers: a third replica hedged after 1 s",
        {"a": CUT, "b": NEVER, "c": GOOD},
        FIXED,
        [
            Attempt("a", "primary", O.WON, 0.0, ErrorKind.STREAM_TRUNCATED),
            Attempt("b", "recovery", O.CANCELLED, 1.0, deadline=3.0),
            Attempt("c", "recovery", O.WON, 2.0, hedged=True, deadline=3.0, first_output=0.5),
        ],
        # c starts at 2.0, reproduces 5 tokens from 2.5 to 2.9, its 6th at 3.0.
        gap=3.0 - 0.9,
    ),
    Case(
        "the same, not hedged (hedge=False): abandoned at its 3 s deadline, the third tried",
        {"a": CUT, "b": NEVER, "c": GOOD},
        FIXED,
        [
            Attempt("a", "primary", O.WON, 0.0, ErrorKind.STREAM_TRUNCATED),
            Attempt("b", "recovery", O.FAILED, 1.0, ErrorKind.TIMEOUT, deadline=3.0),
            Attempt("c", "recovery", O.WON, 4.0, deadline=3.0, first_output=0.5),
        ],
        hedge=False,
        gap=5.0 - 0.9,
    ),
    Case(
        "the default config (learned delay, stall_timeout=None): hedged at the 1 s fallback",
        {"a": CUT, "b": NEVER, "c": GOOD},
        HedgerConfig(pick="in_order"),
        [
            Attempt("a", "primary", O.WON, 0.0, ErrorKind.STREAM_TRUNCATED),
            Attempt("b", "recovery", O.CANCELLED, 1.0, deadline=3.0),
            Attempt("c", "recovery", O.WON, 2.0, hedged=True, deadline=3.0, first_output=0.5),
        ],
        gap=3.0 - 0.9,
    ),
    Case(
        "no budget for a hedge: the never-answering recovery is abandoned at its deadline",
        {"a": CUT, "b": NEVER, "c": GOOD},
        attrs.evolve(FIXED, budget=HedgeBudget(ratio=0.1, min_per_second=0.0)),
        [
            Attempt("a", "primary", O.WON, 0.0, ErrorKind.STREAM_TRUNCATED),
            Attempt("b", "recovery", O.FAILED, 1.0, ErrorKind.TIMEOUT, deadline=3.0),
            Attempt("c", "recovery", O.WON, 4.0, deadline=3.0, first_output=0.5),
        ],
        gap=5.0 - 0.9,
    ),
    Case(
        "one recovery allowed: no hedge, the deadline ends it, the cut is the error",
        {"a": CUT, "b": NEVER, "c": GOOD},
        attrs.evolve(FIXED, max_recoveries=1),
        [
            Attempt("a", "primary", O.WON, 0.0, ErrorKind.STREAM_TRUNCATED),
            Attempt("b", "recovery", O.FAILED, 1.0, ErrorKind.TIMEOUT, deadline=3.0),
        ],
        text=prefix(5),
        error=ErrorKind.STREAM_TRUNCATED,
    ),
    Case(
        "a recovery's 3 s prefill is no stall (stall_timeout 2, hedge_after 5)",
        {"a": CUT, "b": attrs.evolve(GOOD, ttft=3.0)},
        attrs.evolve(FIXED, hedge_after=5.0, stall_timeout=2.0),
        [
            Attempt("a", "primary", O.WON, 0.0, ErrorKind.STREAM_TRUNCATED),
            Attempt("b", "recovery", O.WON, 1.0, deadline=15.0, first_output=3.0),
        ],
        # b's first output at 4.0, the reproduced prefix to 4.4, its 6th token at 4.5.
        gap=4.5 - 0.9,
    ),
    Case(
        "silence after a recovery's first output is a stall: stall_timeout still bounds it",
        {"a": CUT, "b": Behaviour(tokens=N, stall_after=2, **TIMED), "c": GOOD},
        attrs.evolve(FIXED, hedge_after=5.0, stall_timeout=2.0),
        [
            Attempt("a", "primary", O.WON, 0.0, ErrorKind.STREAM_TRUNCATED),
            # Output at 1.5 and 1.6 s, then silence: a stall at 3.6 s.
            Attempt(
                "b", "recovery", O.FAILED, 1.0, ErrorKind.STALL, deadline=15.0, first_output=0.5
            ),
            Attempt("c", "recovery", O.WON, 3.6, deadline=15.0, first_output=0.5),
        ],
        gap=4.6 - 0.9,
    ),
    Case(
        "a recovery that answers before its hedge delay: no hedge, no second attempt",
        {"a": CUT, "b": GOOD, "c": GOOD},
        FIXED,
        [
            Attempt("a", "primary", O.WON, 0.0, ErrorKind.STREAM_TRUNCATED),
            Attempt("b", "recovery", O.WON, 1.0, deadline=3.0, first_output=0.5),
        ],
        gap=2.0 - 0.9,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_the_recovery_phase(case: Case, autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas(case.behaviours)
    replicas = [th.Replica(mock.url(n), name=n) for n in case.behaviours]
    times: list[float] = []
    error: th.StreamInterrupted | None = None
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, case.config, client=client) as hedger:
            t0 = trio.current_time()
            with trio.fail_after(600):  # on c6222d8 the first cases wait an hour here
                try:
                    async with hedger.stream(REQUEST, hedge=case.hedge) as stream:
                        async for _ in stream:
                            times.append(trio.current_time() - t0)
                except th.StreamInterrupted as exc:
                    error = exc
            stats = hedger.statistics()
        for name in case.behaviours:  # every response closed
            for record in mock.requests[name]:
                assert record.finished, name
    report = stream.report
    assert report.text == case.text
    if case.error is None:
        assert error is None and report.completed
    else:
        assert error is not None and error.error.kind is case.error
    got = [
        Attempt(
            a.replica,
            a.trigger,
            a.outcome,
            pytest.approx(a.started_at),  # type: ignore[arg-type]
            None if a.error is None else a.error.kind,
            a.recovery.hedged if a.recovery else False,
            None if a.recovery is None else pytest.approx(a.recovery.deadline),  # type: ignore[arg-type]
            None if a.recovery is None or a.recovery.first_output is None
            else pytest.approx(a.recovery.first_output),  # type: ignore[arg-type]
        )
        for a in report.attempts
    ]  # fmt: skip
    assert got == list(case.attempts)
    if case.gap is not None:
        assert times[5] - times[4] == pytest.approx(case.gap)
    assert report.ttft == pytest.approx(0.5)  # the first commit's, whatever followed
    hedged = sum(1 for a in case.attempts if a.hedged)
    assert (stats.recoveries, stats.recovery_hedges) == (len(case.attempts) - 1, hedged)


def test_the_deadline_is_bounded() -> None:
    # (expected TTFT) -> deadline: 3 × expected, within [2, 30]; unknown: the ceiling.
    policy = RecoveryPolicy()
    table = {None: 30.0, 0.0: 30.0, 0.1: 2.0, 1.0: 3.0, 4.0: 12.0, 20.0: 30.0}
    assert {x: policy.deadline(x) for x in table} == table
    assert RecoveryPolicy(first_token_ratio=2, min_first_token=0.5).deadline(0.1) == 0.5
    for bad in (
        {"min_first_token": 5.0, "max_first_token": 1.0},
        {"first_token_ratio": 0.5},
        {"min_first_token": 0.0},
    ):
        with pytest.raises(ValueError):
            RecoveryPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RecoveryPolicy(hedge=1)  # type: ignore[arg-type]


async def test_the_deadline_follows_what_the_fleet_learned_of_the_replica(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # b is known to take 4 s to a first token (its peak-EWMA latency, from a request it
    # served after a's 503): a recovery there gets 3 × 4 = 12 s, not the 3 s of a replica
    # the fleet knows nothing of; its 4 s prefill is then no reason to abandon it.
    def a_answers(record: Any) -> Behaviour:
        return Behaviour(status=503) if record.index == 0 else CUT

    mock = MockReplicas({"a": a_answers, "b": attrs.evolve(GOOD, ttft=4.0)})
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    # (No decay of the latency estimate within the test: exact figures.)
    config = HedgerConfig(hedge_after=1.0, outlier_detection=None, latency_decay=1e9)
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, config, client=client) as hedger:
            async with hedger.stream(REQUEST) as first:
                [t async for t in first]
            async with hedger.stream(REQUEST) as stream:
                assert "".join([t async for t in stream]) == FULL
    assert first.report.winner_replica == "b" and first.report.ttft == pytest.approx(4.0)
    (recovery,) = [a for a in stream.report.attempts if a.recovery is not None]
    assert recovery.replica == "b" and recovery.outcome is O.WON
    assert recovery.recovery is not None
    assert recovery.recovery.deadline == pytest.approx(12.0)
    assert recovery.recovery.first_output == pytest.approx(4.0)


async def test_a_continuations_role_only_opening_is_no_first_output(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A vLLM continuation's gate is open from the start (it answers only what follows), and
    # its server sends the role-only opening at once: that is no new text. Before, it
    # committed there, and a continuation on a replica that never answers became the winner
    # of an answer that never came (forever, with stall_timeout=None).
    vllm = {"continuation": "vllm"}
    mock = MockReplicas(
        {"a": CUT, "b": attrs.evolve(NEVER, **vllm), "c": attrs.evolve(GOOD, **vllm)}
    )
    replicas = [
        th.Replica(mock.url(n), name=n, continuation=None if n == "a" else "vllm") for n in "abc"
    ]
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, FIXED, client=client) as hedger:
            with trio.fail_after(600):
                async with hedger.stream(REQUEST) as stream:
                    assert "".join([t async for t in stream]) == FULL
    got = [(a.replica, a.outcome, a.started_at) for a in stream.report.attempts]
    assert got == [
        ("a", O.WON, 0.0),
        ("b", O.CANCELLED, pytest.approx(1.0)),
        ("c", O.WON, pytest.approx(2.0)),
    ]


async def test_a_busy_recovery_replica_is_not_blamed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The judge's "recovery-deadline": b has not begun the recovery's long prompt (the whole
    # answer so far) by its deadline: busy, not broken. With ejection at the first failure,
    # a (which broke) is out, b is not: the next caller is served by b. (Judged a failure,
    # b was ejected too and every later request went to c.)
    mock = MockReplicas({"a": CUT, "b": lambda r: NEVER if r.index == 0 else GOOD, "c": GOOD})
    replicas = [th.Replica(mock.url(n), name=n) for n in "abc"]
    config = attrs.evolve(
        FIXED,
        outlier_detection=OutlierDetection(consecutive_failures=1, max_ejection_percent=100),
        recovery=RecoveryPolicy(hedge=False),  # b is abandoned at its deadline, not raced
    )
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, config, client=client) as hedger:
            async with hedger.stream(REQUEST) as recovered:
                assert "".join([t async for t in recovered]) == FULL
            stats = hedger.statistics()
            async with hedger.stream(REQUEST) as after:
                assert "".join([t async for t in after]) == FULL
    assert [(x.replica, x.outcome, None if x.error is None else x.error.kind)
            for x in recovered.report.attempts] == [
        ("a", O.WON, ErrorKind.STREAM_TRUNCATED),
        ("b", O.FAILED, ErrorKind.TIMEOUT),
        ("c", O.WON, None),
    ]  # fmt: skip
    a, b, _ = stats.replicas
    assert (a.state, a.failures) == ("ejected", 1)
    assert (b.state, b.failures, b.consecutive_failures) == ("healthy", 0, 0)
    assert after.report.winner_replica == "b" and after.report.ttft == pytest.approx(0.5)
