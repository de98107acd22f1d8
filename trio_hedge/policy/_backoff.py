"""The back-off: paces one request's repeated attempts on the *same* replica.

[`Backoff`][trio_hedge.policy.Backoff] is gRPC's retry back-off (gRFC A6): the ``n``-th
repeat waits ``random(0, min(initial × multiplier^(n−1), maximum))`` seconds after that
replica's last failure (``backoff_delay``, a pure function; the random draw comes from
``jitter_draw``, derived from the request id and the request's number, so a schedule is
reproducible). Unlike the
hedge budget and the retry throttle, it is not shared state: each request's planner applies
it to its own attempts.
"""

from __future__ import annotations

import hashlib

import attrs

from .._validate import number

__all__ = ["Backoff", "backoff_delay", "jitter_draw"]


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
            request (its id and its number in the Hedger, ``jitter_draw``): reproducible for
            one request, spread across requests (also two with the same id), exact in
            virtual time; ``False`` waits the full ceiling.

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


def jitter_draw(request_id: str, replica: str, repeat: int, request: int = 0) -> float:
    """A draw in ``[0, 1)`` for ``backoff_delay``, derived from the request id, the request's
    number in its Hedger (``request``: 1 for its first request), replica and repeat: the same
    request always gets the same schedule (exact in virtual-time tests), different requests
    get independent-looking ones -- also two that carry the same id (a client may choose
    it: ``X-Request-ID``)."""
    key = f"{request_id}\x00{request}\x00{replica}\x00{repeat}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64
