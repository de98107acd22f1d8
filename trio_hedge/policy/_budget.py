"""The hedge budget: a ratio of backups to requests over a sliding window, plus a floor.

Why: a hedge delay at the P90 sends backups for ~10% of requests *only while the latency
distribution stays put*. When every replica slows down at once (overload), every request
crosses the delay and a hedger without a budget doubles the load exactly when there is no
capacity for it: a hedge storm.

[`HedgeBudget`][trio_hedge.policy.HedgeBudget]: backups may be at most ``ratio`` of the
requests seen in the last ``window`` seconds, plus a floor of ``min_per_second`` (Envoy's
retry budget, ``budget_percent`` / ``min_retry_concurrency``; Finagle's ``RetryBudget``,
whose ``minRetriesPerSec × ttl`` is our floor). The budget is checked when a backup would be
sent and spent only when it really starts (never reserved earlier). It is one of two brakes
on the fleet's extra requests, checked at the same moment and independent of each other; the
other is the retry throttle (``policy/_throttle.py``).

Priority classes (``Hedger.stream(priority=...)``, a gateway key's class): when the window has
seen requests of a class higher than a request's, that request may bring the budget down to
``priority_reserve`` of its capacity, never below: the rest is kept for the higher classes, so
a flood of low-priority stuck requests cannot spend the backups a high-priority one needs
(llm-d's proposal to hedge only high-priority requests when headroom is thin, llm-d#646).
"""

from __future__ import annotations

import math
from collections import deque

import attrs

from .._validate import MAX_PRIORITY, number

__all__ = ["EARLY_RESERVE", "MAX_PRIORITY", "BudgetState", "HedgeBudget"]

#: The share of a budget's capacity that backups sent before the fleet's own delay (a caller's
#: shorter ``hedge_after``) may not use: kept for the backups the fleet decided.
EARLY_RESERVE = 0.5


@attrs.frozen
class HedgeBudget:
    """At most ``ratio`` backups per request, plus a floor, over a sliding window.

    A backup may be sent at time ``t`` when, counting over ``[t − window, t]``:

    ```text
    backups + 1 <= ratio × requests + min_per_second × window
    ```

    So over any run of ``window`` seconds the backups are bounded by ``ratio`` of the
    requests plus ``min_per_second × window`` (the floor lets a quiet service still hedge).

    Attributes:
        ratio: backups per request, in ``(0, 1]``. Default 0.1 (10%).
        min_per_second: the floor, in backups per second. Default 0.5.
        window: the window, in seconds. Default 60. Finagle's ``ttl`` is 10 s, sized for
            millisecond RPCs; an LLM replica stuck in a 10 s prefill stalls every request
            queued behind it *at once*, and a 10 s budget refused the very hedges that cut
            that tail (``benchmarks/tail.py``: P99 TTFT 3.3 s with 10 s, 2.2 s with 60 s, at
            9% extra requests). Sustained overload is still held to the ratio.
        slots: how many slots the window is counted in (its time resolution is
            ``window / slots``). Default 10.
        priority_reserve: the share of the capacity, in ``[0, 1]``, that requests of a
            lower class than the highest one seen in the window may not use: kept for the
            higher classes. 0: classes share the budget alike. Default 0.5.

    Raises:
        TypeError, ValueError: on a bad field.
    """

    ratio: float = attrs.field(default=0.1, validator=number(0.0, open_lo=True))
    min_per_second: float = attrs.field(default=0.5, validator=number(0.0))
    window: float = attrs.field(default=60.0, validator=number(0.0, open_lo=True))
    slots: int = attrs.field(default=10)
    priority_reserve: float = attrs.field(default=0.5, validator=number(0.0))

    @ratio.validator
    def _check_ratio(self, attribute: attrs.Attribute[float], value: float) -> None:
        if value > 1.0:
            raise ValueError(f"ratio must be <= 1, not {value!r}")

    @priority_reserve.validator
    def _check_reserve(self, attribute: attrs.Attribute[float], value: float) -> None:
        if value > 1.0:
            raise ValueError(f"priority_reserve must be <= 1, not {value!r}")

    @slots.validator
    def _check_slots(self, attribute: attrs.Attribute[int], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"slots must be an int, not {value!r}")
        if value < 1:
            raise ValueError(f"slots must be >= 1, not {value!r}")


class BudgetState:
    """The counters behind a [`HedgeBudget`][trio_hedge.policy.HedgeBudget] (internal; bounded
    to ``slots`` entries)."""

    __slots__ = ("_backups", "_config", "_requests", "_slot_width", "_slots")

    def __init__(self, config: HedgeBudget) -> None:
        self._config = config
        self._slot_width = config.window / config.slots
        # (slot index, requests, backups, the highest priority class of its requests)
        self._slots: deque[list[int]] = deque()
        self._requests = 0
        self._backups = 0

    def _current(self, now: float) -> list[int]:
        index = math.floor(now / self._slot_width)
        slots = self._slots
        oldest = index - self._config.slots + 1
        while slots and slots[0][0] < oldest:
            _, requests, backups, _ = slots.popleft()
            self._requests -= requests
            self._backups -= backups
        if not slots or slots[-1][0] != index:
            slots.append([index, 0, 0, 0])
        return slots[-1]

    def request(self, now: float, priority: int = 0) -> None:
        """Count one request (a deposit) of class ``priority``."""
        slot = self._current(now)
        slot[1] += 1
        if priority > slot[3]:
            slot[3] = priority
        self._requests += 1

    def _capacity(self) -> float:
        """The backups the window allows in all (``ratio`` × requests + the floor)."""
        c = self._config
        return c.ratio * self._requests + c.min_per_second * c.window

    def allowance(self, now: float) -> float:
        """How many more backups the budget would allow right now."""
        self._current(now)
        return self._capacity() - self._backups

    def top_priority(self, now: float) -> int:
        """The highest class of the requests in the window (0 when there are none)."""
        self._current(now)
        return max(slot[3] for slot in self._slots)

    def allows(self, now: float, *, early: bool = False, priority: int | None = None) -> bool:
        """Whether one more backup fits now. Spends nothing (see ``spend``).

        ``early``: a backup sent before the fleet's own hedge delay, at a caller's own
        shorter ``hedge_after`` (the gateway's ``X-Hedge-After``). Those may bring the budget
        down to half its capacity, never below: the other half stays for the backups the
        fleet itself decided, so one caller asking for double sends cannot spend the backups
        every other caller's stuck request needs.

        ``priority``: the request's class; below the highest class in the window, it may
        bring the budget down to ``priority_reserve`` of its capacity, never below (``None``:
        classes are not looked at)."""
        allowance = self.allowance(now)
        reserve = EARLY_RESERVE if early else 0.0
        if priority is not None and priority < self.top_priority(now):
            reserve = max(reserve, self._config.priority_reserve)
        if reserve:
            allowance -= reserve * self._capacity()
        return allowance >= 1.0 - 1e-9

    def spend(self, now: float) -> None:
        """Count one backup that really started."""
        self._current(now)[2] += 1
        self._backups += 1

    def counts(self, now: float) -> tuple[int, int]:
        """``(requests, backups)`` in the window."""
        self._current(now)
        return self._requests, self._backups
