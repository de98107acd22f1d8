"""The retry throttle: gRPC's retry throttling (gRFC A6, "retryThrottling").

Why: when attempts fail fast (a replica refusing, an overloaded fleet answering 503),
failovers multiply the load as surely as hedges do.
[`RetryThrottle`][trio_hedge.policy.RetryThrottle]: a token count starts at ``max_tokens``;
each failed attempt takes one token, each success gives back ``token_ratio``; hedges *and*
failovers stop while the count is at or below ``max_tokens / 2`` and resume once successes
have refilled it. It is checked when a backup would be sent, independently of the hedge
budget (``policy/_budget.py``).
"""

from __future__ import annotations

import attrs

from .._validate import fraction, number

__all__ = ["RetryThrottle", "ThrottleState"]


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
    """The token count behind a [`RetryThrottle`][trio_hedge.policy.RetryThrottle]
    (internal). Counted in thousandths of a token, as gRPC does, so ``token_ratio`` adds up
    without rounding drift."""

    __slots__ = ("_max", "_milli", "_ratio")

    def __init__(self, config: RetryThrottle) -> None:
        self._max = round(config.max_tokens * 1000)
        self._ratio = max(1, round(config.token_ratio * 1000))
        self._milli = self._max

    @property
    def tokens(self) -> float:
        return self._milli / 1000

    def failure(self) -> int:
        """Take a token for a failed attempt; returns the thousandths taken (less than a
        token near 0), for `refund`."""
        taken = min(1000, self._milli)
        self._milli -= taken
        return taken

    def refund(self, milli: int) -> None:
        """Give back what `failure` took for the attempts of a request another attempt then
        served: the fleet answered it (the throttle bounds storms of a failing *fleet*, not
        failovers to a replica that answers)."""
        self._milli = min(self._max, self._milli + milli)

    def success(self) -> None:
        self._milli = min(self._max, self._milli + self._ratio)

    @property
    def allows(self) -> bool:
        return self._milli * 2 > self._max
