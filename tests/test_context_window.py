"""Context windows (issue 17): a context-length error fails over to a replica that declares a
larger window (a larger model as backup) and is fatal only when none does; a replica's window,
declared or learned from its context-length errors, keeps requests too large for it away when
another replica can take them, and a caller's huge ``max_tokens`` teaches only that a request
that large does not fit. Fake replicas over loopback whose window counts the prompt's words
plus ``max_tokens`` (the Hedger estimates ~4 characters per token: the sizes below are far from
every window, so both counts agree on what fits).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

import trio_hedge as th
from trio_hedge.errors import ErrorKind
from trio_hedge.policy import HedgerConfig
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.testing import Behaviour, FakeReplica

CONFIG = HedgerConfig(hedge_after=None, pick="in_order")


def body(words: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "w " * words}], **extra}


SMALL, LARGE = body(10), body(3000)  # ~5 and ~1,500 estimated tokens; 10 and 3,000 words


@contextlib.asynccontextmanager
async def _two(
    small: int | None, large: int | None, *, backup_window: int = 100_000
) -> AsyncIterator[tuple[th.Hedger, FakeReplica, FakeReplica]]:
    """``a``: a small model (a 500-token window, ``small`` declared), ``b``: a large one."""
    async with (
        FakeReplica(Behaviour(tokens=3, context_window=500), name="a") as a,
        FakeReplica(Behaviour(tokens=3, context_window=backup_window), name="b") as b,
    ):
        replicas = [
            th.Replica(a.url, name="a", context_window=small),
            th.Replica(b.url, name="b", context_window=large),
        ]
        async with th.Hedger(replicas, CONFIG) as hedger:
            yield hedger, a, b


async def _run(hedger: th.Hedger, request: dict[str, Any]) -> th.Report:
    async with hedger.stream(request) as stream:
        assert "".join([t async for t in stream]) == "tok0 tok1 tok2 "
    return stream.report


def _chat(replica: FakeReplica) -> int:
    return sum(1 for r in replica.requests if r.path.endswith("/chat/completions"))


async def test_a_context_length_error_fails_over_to_a_larger_window() -> None:
    async with _two(None, 100_000) as (hedger, a, b):
        report = await _run(hedger, LARGE)
        first, second = report.attempts
        assert first.outcome is O.FAILED and first.error is not None
        assert first.error.kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED
        assert (second.replica, second.trigger, second.outcome) == ("b", "failover", O.WON)
        # Learned for this model: the next request that large goes to b at once, ...
        assert (await _run(hedger, LARGE)).attempts_sent == 1
        # ... and a request that fits still goes to a (the first choice).
        assert (await _run(hedger, SMALL)).winner_replica == "a"
        stats = hedger.statistics()
    assert [r.failures for r in stats.replicas] == [0, 0]  # nobody's fault
    assert (_chat(a), _chat(b)) == (2, 2)


async def test_fatal_only_when_no_replica_declares_room() -> None:
    # b's window is unknown: after a's context-length error nothing is tried blindly.
    async with _two(None, None) as (hedger, a, b):
        with pytest.raises(th.FatalAttemptError) as info:
            await _run(hedger, LARGE)
        assert info.value.error.kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED
        assert info.value.report is not None and info.value.report.attempts_sent == 1
    assert (_chat(a), _chat(b)) == (1, 0)
    # b declares a window, but one smaller than a's: no use either.
    async with _two(1000, 400, backup_window=400) as (hedger, a, b):
        with pytest.raises(th.FatalAttemptError):
            await _run(hedger, body(800))
    assert (_chat(a), _chat(b)) == (1, 0)


async def test_a_declared_window_sends_a_large_request_elsewhere_first() -> None:
    async with _two(500, 100_000) as (hedger, a, b):
        assert (await _run(hedger, LARGE)).attempts_sent == 1
        assert (await _run(hedger, SMALL)).winner_replica == "a"
    assert (_chat(a), _chat(b)) == (1, 1)


async def test_an_estimate_never_empties_the_plan() -> None:
    # Every declared window is below the estimate: the servers decide (here: a serves it).
    async with (
        FakeReplica(Behaviour(tokens=3), name="a") as a,
        FakeReplica(Behaviour(tokens=3), name="b") as b,
    ):
        replicas = [
            th.Replica(a.url, name="a", context_window=100),
            th.Replica(b.url, name="b", context_window=100),
        ]
        async with th.Hedger(replicas, CONFIG) as hedger:
            assert (await _run(hedger, LARGE)).winner_replica == "a"


async def test_a_huge_max_tokens_changes_nothing_for_another_caller() -> None:
    # The first caller asks a for 10**6 tokens of answer: a refuses, b serves it. What a
    # learns is that a request that large does not fit: the second caller's small requests
    # still go to a, exactly as without the first caller.
    async with _two(None, None, backup_window=10**7) as (hedger, _, _):
        with pytest.raises(th.FatalAttemptError):  # b declares no window: not tried
            await _run(hedger, body(10, max_tokens=10**6))
        for _ in range(3):
            report = await _run(hedger, SMALL)
            assert (report.winner_replica, report.attempts_sent) == ("a", 1)
            assert (await _run(hedger, body(400))).winner_replica == "a"  # ~200 tokens
    async with _two(None, 10**7, backup_window=10**7) as (hedger, _, _):
        served = await _run(hedger, body(10, max_tokens=10**6))
        assert served.winner_replica == "b"
        for _ in range(3):
            assert (await _run(hedger, SMALL)).winner_replica == "a"
