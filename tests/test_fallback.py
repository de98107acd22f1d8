"""Peers and fallbacks (issue 17): a replica marked ``fallback=True`` gets an attempt only when
no peer can take it within ``fallback_wait``; a peer's single 500 or short ``Retry-After`` is
retried once before falling back, and the report's attempts say which happened. Virtual time,
``MockReplicas``; each case lists the replica of every attempt and when it started.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.policy import HedgerConfig
from trio_hedge.testing import Behaviour, MockReplicas
from trio_hedge.testing._behaviour import RequestRecord

REQUEST: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
OK = Behaviour(tokens=3)
IN_ORDER = HedgerConfig(hedge_after=None, pick="in_order")


def by_index(*behaviours: Behaviour) -> Callable[[RequestRecord], Behaviour]:
    """The n-th request gets the n-th behaviour (the last one after that)."""
    return lambda record: behaviours[min(record.index, len(behaviours) - 1)]


@attrs.frozen
class Case:
    name: str
    peer: Behaviour | Callable[[RequestRecord], Behaviour]
    attempts: Sequence[tuple[str, float]]  # (replica, started at) of every attempt
    config: HedgerConfig = IN_ORDER


CASES = [
    Case("a peer that answers: the fallback listed first is not used", OK, [("p", 0.0)]),
    Case(
        "a single 500: the peer is retried once, at once",
        by_index(Behaviour(status=500), OK),
        [("p", 0.0), ("p", 0.0)],
    ),
    Case(
        "two 500s: retried once, then the fallback",
        Behaviour(status=500),
        [("p", 0.0), ("p", 0.0), ("f", 0.0)],
    ),
    Case(
        "a 503 (overloaded, no Retry-After): the fallback at once",
        Behaviour(status=503),
        [("p", 0.0), ("f", 0.0)],
    ),
    Case(
        "a 429 with Retry-After 0.5 s: waited out, then the peer again",
        by_index(Behaviour(status=429, retry_after=0.5), OK),
        [("p", 0.0), ("p", 0.5)],
    ),
    Case(
        "a 429 with Retry-After 30 s: the fallback at once",
        by_index(Behaviour(status=429, retry_after=30), OK),
        [("p", 0.0), ("f", 0.0)],
    ),
    Case(
        "a slow peer: the hedge goes to the fallback (no peer can answer in time)",
        Behaviour(ttft=5.0, tokens=3),
        [("p", 0.0), ("f", 1.0)],
        HedgerConfig(hedge_after=1.0, pick="in_order"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_peers_before_fallbacks(case: Case, autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas({"f": OK, "p": case.peer})
    replicas = [
        th.Replica(mock.url("f"), name="f", fallback=True),
        th.Replica(mock.url("p"), name="p"),
    ]
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, case.config, client=client) as hedger:
            async with hedger.stream(REQUEST) as stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 tok2 "
    report = stream.report
    assert [(a.replica, a.started_at) for a in report.attempts] == list(case.attempts)


async def test_a_second_peer_goes_before_a_retry_and_before_the_fallback(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"f": OK, "p": Behaviour(status=500), "q": OK})
    replicas = [
        th.Replica(mock.url("f"), name="f", fallback=True),
        th.Replica(mock.url("p"), name="p"),
        th.Replica(mock.url("q"), name="q"),
    ]
    config = HedgerConfig(hedge_after=None, pick="in_order")
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, config, client=client) as hedger:
            async with hedger.stream(REQUEST) as stream:
                [t async for t in stream]
    assert [a.replica for a in stream.report.attempts] == ["p", "q"]


def test_fallback_fields_are_validated() -> None:
    with pytest.raises(TypeError, match="fallback"):
        th.Replica("http://127.0.0.1:1/v1", fallback="yes")  # type: ignore[arg-type]
    for bad, error in ((-1.0, ValueError), (float("inf"), ValueError), ("1", TypeError)):
        with pytest.raises(error, match="fallback_wait"):
            HedgerConfig(fallback_wait=bad)  # type: ignore[arg-type]
