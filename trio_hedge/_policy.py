"""How one request is hedged: the per-request policy (a frozen attrs value)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from ._events import FirstToken

__all__ = ["HedgePolicy"]


def _seconds_or_none(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{attribute.name} must be seconds (a number) or None, not {value!r}")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{attribute.name} must be >= 0 seconds, not {value!r}")
    if math.isinf(value):
        # One rule for every duration, in HedgePolicy and HedgerConfig alike: "never" is None.
        raise ValueError(
            f"{attribute.name} must be finite seconds (None means never), not {value!r}"
        )


def _positive_seconds_or_none(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _seconds_or_none(inst, attribute, value)
    if value is not None and value == 0:
        raise ValueError(f"{attribute.name} must be > 0 seconds, not {value!r}")


def _positive_seconds(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        raise TypeError(f"{attribute.name} must be seconds (a number), not None")
    _positive_seconds_or_none(inst, attribute, value)


def _positive_int_or_none(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int or None, not {value!r}")
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, not {value!r}")


def _positive_int(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int, not {value!r}")
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, not {value!r}")


@attrs.frozen
class HedgePolicy:
    """How a request is hedged. All durations are in seconds.

    The race follows the Happy Eyeballs rule (RFC 8305, as in Trio's ``open_tcp_stream``):
    attempt 1 starts at once; attempt k+1 starts when ``hedge_after`` seconds pass with no
    first token from any running attempt, or at once when a running attempt fails before its
    first token. The first attempt to produce a first token commits (gRPC hedging, gRFC A6,
    commits at the first response; we commit at the first *token*), and every other attempt
    is cancelled.

    Attributes:
        hedge_after: the hedge delay: seconds without a first token before the next backup
            is sent. ``None`` never hedges on time (attempts then start only on failure, a
            plain failover). Default 1.0. Pick it near the P90–P95 of your TTFT ("The Tail at
            Scale", Dean & Barroso 2013); :class:`trio_hedge.Hedger` learns it per request size.
        max_attempts: attempts per request, primary included; ``None`` means one per replica
            times ``attempts_per_replica``. Default ``None``.
        attempts_per_replica: how many attempts of one request may go to the same replica.
            Default 1 (a second attempt on the same replica usually lands in the same queue).
        hedge: ``False`` disables time-based hedging for this request (failover on error
            still happens). Default ``True``.
        first_token: what counts as the first token (:class:`FirstToken`). Default content.
        first_token_timeout: seconds, over all attempts, to wait for a first token before
            failing with :class:`~trio_hedge.AllAttemptsFailed` (``kind="timeout"``); ``None``
            waits as long as the caller's own cancel scope allows. Default ``None``.
        stall_timeout: after commit, seconds the winner may go without content before the
            stream fails with :class:`~trio_hedge.StreamInterrupted` (``kind="stall"``).
            Keep-alive comments, role-only deltas and empty events do not reset it (Envoy's
            ``per_try_idle_timeout``). ``None`` disables it. Default ``None``.
        close_timeout: seconds a loser's close may take before it is abandoned (its socket is
            closed regardless). Default 1.0.

    Raises:
        TypeError, ValueError: on a badly typed or out-of-range field.
    """

    hedge_after: float | None = attrs.field(default=1.0, validator=_seconds_or_none)
    max_attempts: int | None = attrs.field(default=None, validator=_positive_int_or_none)
    attempts_per_replica: int = attrs.field(default=1, validator=_positive_int)
    hedge: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    first_token: FirstToken = attrs.field(
        default=FirstToken.CONTENT,
        converter=FirstToken,
        validator=attrs.validators.in_(tuple(FirstToken)),
    )
    first_token_timeout: float | None = attrs.field(
        default=None, validator=_positive_seconds_or_none
    )
    stall_timeout: float | None = attrs.field(default=None, validator=_positive_seconds_or_none)
    close_timeout: float = attrs.field(default=1.0, validator=_positive_seconds)
