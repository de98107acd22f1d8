"""How many backups may be sent: a ratio budget and a failure throttle.

Why: a hedge delay at the P90 sends backups for ~10% of requests *only while the latency
distribution stays put*. When every replica slows down at once (overload), every request
crosses the delay and a hedger without a budget doubles the load exactly when there is no
capacity for it: a hedge storm. Two independent brakes, both checked at the moment a backup
would be sent (never reserved earlier):

* :class:`HedgeBudget` — backups may be at most ``ratio`` of the requests seen in the last
  ``window`` seconds, plus a floor of ``min_per_second`` (Envoy's retry budget,
  ``budget_percent`` / ``min_retry_concurrency``; Finagle's ``RetryBudget``, whose
  ``minRetriesPerSec × ttl`` is our floor).
* :class:`RetryThrottle` — gRPC's retry throttling (gRFC A6): a token count starts at
  ``max_tokens``; each failed attempt takes one token, each success gives back
  ``token_ratio``; hedging stops while the count is at or below ``max_tokens / 2`` and
  resumes once successes have refilled it.
"""

from __future__ import annotations

import math
from collections import deque

import attrs

from ._delay import _fraction, _number

__all__ = ["HedgeBudget", "RetryThrottle"]


@attrs.frozen
class HedgeBudget:
    """At most ``ratio`` backups per request, plus a floor, over a sliding window.

    A backup may be sent at time ``t`` when, counting over ``[t − window, t]``::

        backups + 1 <= ratio × requests + min_per_second × window

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

    Raises:
        TypeError, ValueError: on a bad field.
    """

    ratio: float = attrs.field(default=0.1, validator=_number(0.0, open_lo=True))
    min_per_second: float = attrs.field(default=0.5, validator=_number(0.0))
    window: float = attrs.field(default=60.0, validator=_number(0.0, open_lo=True))
    slots: int = attrs.field(default=10)

    @ratio.validator
    def _check_ratio(self, attribute: attrs.Attribute[float], value: float) -> None:
        if value > 1.0:
            raise ValueError(f"ratio must be <= 1, not {value!r}")

    @slots.validator
    def _check_slots(self, attribute: attrs.Attribute[int], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"slots must be an int, not {value!r}")
        if value < 1:
            raise ValueError(f"slots must be >= 1, not {value!r}")


class BudgetState:
    """The counters behind a :class:`HedgeBudget` (internal; bounded to ``slots`` entries)."""

    __slots__ = ("_backups", "_config", "_requests", "_slot_width", "_slots")

    def __init__(self, config: HedgeBudget) -> None:
        self._config = config
        self._slot_width = config.window / config.slots
        # (slot index, requests, backups)
        self._slots: deque[list[int]] = deque()
        self._requests = 0
        self._backups = 0

    def _current(self, now: float) -> list[int]:
        index = math.floor(now / self._slot_width)
        slots = self._slots
        oldest = index - self._config.slots + 1
        while slots and slots[0][0] < oldest:
            _, requests, backups = slots.popleft()
            self._requests -= requests
            self._backups -= backups
        if not slots or slots[-1][0] != index:
            slots.append([index, 0, 0])
        return slots[-1]

    def request(self, now: float) -> None:
        """Count one request (a deposit)."""
        self._current(now)[1] += 1
        self._requests += 1

    def allowance(self, now: float) -> float:
        """How many more backups the budget would allow right now."""
        self._current(now)
        c = self._config
        return c.ratio * self._requests + c.min_per_second * c.window - self._backups

    def try_backup(self, now: float) -> bool:
        """Spend one backup if the budget allows it now; ``False`` (nothing spent) if not."""
        if self.allowance(now) < 1.0 - 1e-9:
            return False
        self._current(now)[2] += 1
        self._backups += 1
        return True

    def counts(self, now: float) -> tuple[int, int]:
        """``(requests, backups)`` in the window."""
        self._current(now)
        return self._requests, self._backups


@attrs.frozen
class RetryThrottle:
    """gRPC's retry throttle (gRFC A6, "retryThrottling").

    Attributes:
        max_tokens: the bucket size and the starting count, in ``(0, 1000]``. Default 10.
        token_ratio: tokens a successful attempt gives back, in ``(0, 1)``. Default 0.1.

    Hedging is allowed while ``tokens > max_tokens / 2``. Each attempt that fails with a
    retryable error takes one token (down to 0); each attempt that gets a first token adds
    ``token_ratio`` (up to ``max_tokens``).

    Raises:
        TypeError, ValueError: on a bad field.
    """

    max_tokens: float = attrs.field(default=10.0, validator=_number(0.0, open_lo=True))
    token_ratio: float = attrs.field(default=0.1, validator=_fraction)

    @max_tokens.validator
    def _check_max(self, attribute: attrs.Attribute[float], value: float) -> None:
        if value > 1000:
            raise ValueError(f"max_tokens must be <= 1000 (gRFC A6), not {value!r}")


class ThrottleState:
    """The token count behind a :class:`RetryThrottle` (internal). Counted in thousandths
    of a token, as gRPC does, so ``token_ratio`` adds up without rounding drift."""

    __slots__ = ("_max", "_milli", "_ratio")

    def __init__(self, config: RetryThrottle) -> None:
        self._max = round(config.max_tokens * 1000)
        self._ratio = max(1, round(config.token_ratio * 1000))
        self._milli = self._max

    @property
    def tokens(self) -> float:
        return self._milli / 1000

    def failure(self) -> None:
        self._milli = max(0, self._milli - 1000)

    def success(self) -> None:
        self._milli = min(self._max, self._milli + self._ratio)

    @property
    def allows(self) -> bool:
        return self._milli * 2 > self._max
