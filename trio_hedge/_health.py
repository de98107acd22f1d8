"""Per-replica health: server pushback (cooldown) and outlier ejection.

* Cooldown: an attempt that fails with ``retry_after`` (a 429/503 with ``Retry-After`` or
  ``retry-after-ms``; gRPC's ``grpc-retry-pushback-ms``, gRFC A6) puts its replica in cooldown
  for exactly that many seconds: no new attempt goes there before it ends.
* Ejection (Envoy's outlier detection, ``consecutive_5xx`` / ``base_ejection_time`` /
  ``max_ejection_time``): ``consecutive_failures`` failures in a row (and, with
  ``count_slow``, attempts that were hedged because they had no first token within the hedge
  delay) eject the replica for ``base_ejection × 2^(n−1)`` seconds, ``n`` counting ejections
  since its last success, capped at ``max_ejection``. A success resets both counts.
"""

from __future__ import annotations

from typing import Any

import attrs

from ._delay import _int, _number
from ._errors import AttemptError, ErrorKind

__all__ = ["OutlierDetection"]


@attrs.frozen
class OutlierDetection:
    """When a replica is ejected, and for how long. Durations in seconds.

    Attributes:
        consecutive_failures: failures in a row that eject a replica. Default 5 (Envoy).
        base_ejection: the first ejection's length. Default 10.
        max_ejection: the longest ejection. Default 300 (Envoy).
        count_slow: whether an attempt hedged for lack of a first token within the hedge
            delay counts as a failure of its replica. Default ``True``.

    Failures that count: retryable errors other than a plain rate limit (429 is pushback,
    handled by the cooldown), the winner stalling after commit, and (``count_slow``) first-token
    timeouts. Client errors (400, 401, …) are the request's fault and do not count.

    Raises:
        TypeError, ValueError: on a bad field or ``base_ejection > max_ejection``.
    """

    consecutive_failures: int = attrs.field(default=5, validator=_int(1))
    base_ejection: float = attrs.field(default=10.0, validator=_number(0.0, open_lo=True))
    max_ejection: float = attrs.field(default=300.0, validator=_number(0.0, open_lo=True))
    count_slow: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.base_ejection > self.max_ejection:
            raise ValueError(
                f"base_ejection ({self.base_ejection}) must be <= max_ejection "
                f"({self.max_ejection})"
            )


def counts_against_replica(error: AttemptError) -> bool:
    """Whether an attempt's error says something about its replica's health."""
    return error.retryable and error.kind is not ErrorKind.RATE_LIMIT


@attrs.define(slots=True)
class ReplicaState:
    """One replica's shared state across all requests (internal)."""

    index: int
    name: str
    source: Any  # a Replica or a Source
    in_flight: int = 0
    cooling_until: float = float("-inf")
    ejected_until: float = float("-inf")
    consecutive: int = 0
    ejections: int = 0  # since the last success: drives the growing back-off
    times_ejected: int = 0  # ever, for statistics
    attempts: int = 0
    wins: int = 0
    failures: int = 0

    def cooling(self, now: float) -> bool:
        return self.cooling_until > now

    def ejected(self, now: float) -> bool:
        return self.ejected_until > now

    def available_at(self) -> float:
        return max(self.cooling_until, self.ejected_until)

    def push_back(self, now: float, seconds: float) -> None:
        self.cooling_until = max(self.cooling_until, now + seconds)

    def success(self) -> None:
        self.consecutive = 0
        self.ejections = 0
        self.wins += 1

    def failure(self, now: float, config: OutlierDetection | None) -> bool:
        """Count one failure; returns whether it ejected the replica."""
        self.failures += 1
        if config is None or self.ejected(now):
            return False
        self.consecutive += 1
        if self.consecutive < config.consecutive_failures:
            return False
        self.consecutive = 0
        self.ejections += 1
        self.times_ejected += 1
        growth = 2.0 ** min(self.ejections - 1, 64)
        length = min(config.base_ejection * growth, config.max_ejection)
        self.ejected_until = now + length
        return True
