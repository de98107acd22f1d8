"""The brakes on extra requests: a ratio budget, a failure throttle, and a back-off.

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
  ``token_ratio``; hedges *and* failovers stop while the count is at or below
  ``max_tokens / 2`` and resume once successes have refilled it.

The budget is checked when a backup would be sent and spent only when it really starts.
A third brake paces one request's repeated attempts on the *same* replica:

* :class:`Backoff` — gRPC's retry back-off (gRFC A6): the ``n``-th repeat waits
  ``random(0, min(initial × multiplier^(n−1), maximum))`` seconds after that replica's last
  failure (:func:`backoff_delay`, a pure function; the random draw comes from
  :func:`jitter_draw`, derived from the request id, so a schedule is reproducible).
"""

from __future__ import annotations

import hashlib
import math
from collections import deque

import attrs

from .._validate import fraction, number

__all__ = ["Backoff", "HedgeBudget", "RetryThrottle", "backoff_delay", "jitter_draw"]


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

    ratio: float = attrs.field(default=0.1, validator=number(0.0, open_lo=True))
    min_per_second: float = attrs.field(default=0.5, validator=number(0.0))
    window: float = attrs.field(default=60.0, validator=number(0.0, open_lo=True))
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

    def allows(self, now: float) -> bool:
        """Whether one more backup fits now. Spends nothing (see :meth:`spend`)."""
        return self.allowance(now) >= 1.0 - 1e-9

    def spend(self, now: float) -> None:
        """Count one backup that really started."""
        self._current(now)[2] += 1
        self._backups += 1

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

    Hedges and failovers are allowed while ``tokens > max_tokens / 2`` (a primary always
    is). Each attempt that fails with a retryable error takes one token (down to 0); each
    attempt that gets a first token adds ``token_ratio`` (up to ``max_tokens``).

    Raises:
        TypeError, ValueError: on a bad field.
    """

    max_tokens: float = attrs.field(default=10.0, validator=number(0.0, open_lo=True))
    token_ratio: float = attrs.field(default=0.1, validator=fraction)

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


@attrs.frozen
class Backoff:
    """How long one request waits before it tries a replica it already tried again: gRPC's
    retry back-off (gRFC A6, ``initialBackoff`` / ``backoffMultiplier`` / ``maxBackoff``).
    A failover to a replica the request has not tried yet never waits.

    The ``n``-th repeat on a replica (``n = 1`` for its second attempt) may start
    ``min(initial × multiplier^(n−1), maximum)`` seconds after that replica's last failure,
    times a draw in ``[0, 1)`` with ``jitter`` ("full jitter", as gRPC does) so that the
    requests a blip failed together do not come back together.

    Attributes:
        initial: seconds before the first repeat (before jitter). Default 0.1 (gRFC A6's
            example).
        multiplier: growth per repeat, ``>= 1``. Default 2.
        maximum: the longest wait, in seconds. Default 5 (an LLM replica that failed fast
            five times in a row is not coming back within the request).
        jitter: ``True`` (default) scales each wait by a draw in ``[0, 1)`` derived from the
            request id (:func:`jitter_draw`): reproducible for one request, spread across
            requests, exact in virtual time; ``False`` waits the full ceiling.

    Raises:
        TypeError, ValueError: on a bad field or ``initial > maximum``.
    """

    initial: float = attrs.field(default=0.1, validator=number(0.0, open_lo=True))
    multiplier: float = attrs.field(default=2.0, validator=number(1.0))
    maximum: float = attrs.field(default=5.0, validator=number(0.0, open_lo=True))
    jitter: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.initial > self.maximum:
            raise ValueError(f"initial ({self.initial}) must be <= maximum ({self.maximum})")


def backoff_delay(repeat: int, backoff: Backoff, draw: float = 1.0) -> float:
    """Seconds the ``repeat``-th repeat on one replica waits after its last failure
    (``repeat >= 1``): ``min(initial × multiplier^(repeat−1), maximum)``, times ``draw``
    (in ``[0, 1)``) when ``backoff.jitter`` is set. Pure: the caller supplies the draw."""
    try:
        ceiling = min(backoff.initial * backoff.multiplier ** (repeat - 1), backoff.maximum)
    except OverflowError:  # multiplier^n left the floats long after it passed the maximum
        ceiling = backoff.maximum
    return ceiling * draw if backoff.jitter else ceiling


def jitter_draw(request_id: str, replica: str, repeat: int) -> float:
    """A draw in ``[0, 1)`` for :func:`backoff_delay`, derived from the request id, replica
    and repeat: the same request always gets the same schedule (reproducible from its logs,
    exact in virtual-time tests), different requests get independent-looking ones (request
    ids are UUID4s by default)."""
    key = f"{request_id}\x00{replica}\x00{repeat}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64
