"""A cold fleet does not pay the 1 s fallback (issue 29): from ``cold_samples`` observations of
any class a cold group's delay is ``cold_ratio`` × their median TTFT, grown for a longer
prompt and never above the fallback; a request already waiting on a cold delay is looked at
again as the first samples arrive, and its backup goes once it has waited the delay they
give. Scenario tables in virtual time; the effect on a cold P99 is measured in
``benchmarks/cold_start.py``."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import LearnedDelay
from trio_hedge.policy._delay import DelayModel
from trio_hedge.report import AttemptOutcome as O

from .fleet import Fleet, run
from .scripted import Script

#: (observations as (seconds, observed, prompt tokens), request's prompt tokens, config
#: changes, the delay, cold?)
TABLE: list[tuple[str, list[tuple[float, bool, int]], int, dict[str, Any], float, bool]] = [
    ("nothing seen: the fallback", [], 100, {}, 1.0, True),
    ("two seen, three needed: the fallback", [(0.1, True, 100)] * 2, 100, {}, 1.0, True),
    (
        "three seen: 3 × their median",
        [(0.08, True, 100), (0.1, True, 100), (0.12, True, 100)],
        100,
        {},
        0.3,
        True,
    ),
    (
        "a shorter prompt: not shorter than their median prompt's",
        [(0.08, True, 100), (0.1, True, 100), (0.12, True, 100)],
        10,
        {},
        0.3,
        True,
    ),
    (
        "twice their median prompt: twice the delay",
        [(0.08, True, 100), (0.1, True, 100), (0.12, True, 100)],
        200,
        {},
        0.6,
        True,
    ),
    (
        "ten times: capped at the fallback, never later than before",
        [(0.08, True, 100), (0.1, True, 100), (0.12, True, 100)],
        1000,
        {},
        1.0,
        True,
    ),
    (
        "censored ones count (Kaplan–Meier): the median is at least 0.5",
        [(0.1, True, 100), (0.5, False, 100), (0.5, False, 100)],
        100,
        {},
        1.0,
        True,
    ),
    (
        "a ratio of 2, the floor min_delay",
        [(0.01, True, 100)] * 3,
        100,
        {"cold_ratio": 2.0},
        0.05,
        True,
    ),
    (
        "the rule off: the fallback",
        [(0.1, True, 100)] * 3,
        100,
        {"cold_samples": None},
        1.0,
        True,
    ),
    (
        "learned (20 in the class): its own P95, not cold",
        [(0.1, True, 100)] * 20,
        100,
        {},
        0.1,
        False,
    ),
]


@pytest.mark.parametrize(
    ("observations", "tokens", "changes", "delay", "cold"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_the_cold_rule(
    observations: list[tuple[float, bool, int]],
    tokens: int,
    changes: dict[str, Any],
    delay: float,
    cold: bool,
) -> None:
    config = LearnedDelay(refresh=0, **changes)
    model = DelayModel(config)
    for seconds, observed, size in observations:
        model.observe("g", config.classes.of(size), 0.0, seconds, observed, size)
    got = model.estimate("g", config.classes.of(tokens), 0.0, tokens)
    assert got == (pytest.approx(delay), cold)


def test_the_cold_rule_is_validated() -> None:
    with pytest.raises(ValueError, match="cold_samples"):
        LearnedDelay(cold_samples=0)
    with pytest.raises(ValueError, match="cold_ratio"):
        LearnedDelay(cold_ratio=0.5)


FAST = Script(ttft=0.1, tokens=2, gap=0.01)
STUCK = Script(ttft=5.0, tokens=2, gap=0.01)


def _stuck_first(replica: str, info: th.sources.AttemptInfo) -> Script:
    """``r0`` waits behind another tenant's long prompt at ``a``; everything else is fast."""
    return STUCK if replica == "a" and info.request_id == "r0" else FAST


async def _arrivals(hedger: th.Hedger, gap: float, count: int) -> dict[str, th.Report]:
    """``count`` requests ``gap`` seconds apart, each read to its end."""
    reports: dict[str, th.Report] = {}

    async def one(i: int) -> None:
        reports[f"r{i}"] = await run(hedger.stream(None, group="m", request_id=f"r{i}"))

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
            await trio.sleep(gap)
    return reports


@pytest.mark.parametrize(
    ("cold_samples", "hedged_at", "ttft"),
    [(3, 0.45, 0.55), (None, 1.0, 1.1)],
    ids=["the cold rule", "the fallback (control)"],
)
async def test_a_request_stuck_while_the_fleet_is_cold_is_rescued_by_the_first_samples(
    autojump_clock: trio.testing.MockClock,
    cold_samples: int | None,
    hedged_at: float,
    ttft: float,
) -> None:
    # A cold Hedger: r0 goes to a, stuck there 5 s (another tenant's prompt); r1, r2, r3,
    # sent 0.1 s apart, get their first token 0.1 s later (at 0.2, 0.3, 0.4 s). From the
    # third sample the delay is 3 × 0.1 = 0.3 s, which r0 has waited: its backup goes at its
    # next look (every 50 ms), 0.45 s, and its answer comes at 0.55 s. With the rule off it
    # waits the 1 s fallback.
    config = th.HedgerConfig(
        hedge_after=LearnedDelay(cold_samples=cold_samples, refresh=0),
        pick="in_order",
        budget=None,
    )
    hedger = th.Hedger(Fleet(["a", "b"], _stuck_first).sources(), config)
    reports = await _arrivals(hedger, 0.1, 4)
    first = reports["r0"]
    assert [(x.replica, x.trigger, x.outcome) for x in first.attempts] == [
        ("a", "primary", O.CANCELLED),
        ("b", "hedge", O.WON),
    ]
    assert first.attempts[1].started_at == pytest.approx(hedged_at)
    assert first.ttft == pytest.approx(ttft)
    assert all(not reports[f"r{i}"].hedged for i in (1, 2, 3))


async def test_a_cold_fleet_does_not_hedge_requests_that_are_not_stuck(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Every request's first token after 0.1 s: the cold delay (0.3 s) hedges none of them.
    config = th.HedgerConfig(hedge_after=LearnedDelay(refresh=0), pick="in_order")
    hedger = th.Hedger(Fleet(["a", "b"], lambda _r, _i: FAST).sources(), config)
    reports = await _arrivals(hedger, 0.05, 30)
    assert not any(report.hedged for report in reports.values())
