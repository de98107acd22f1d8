"""The [`StaticPlanner`][trio_hedge.policy.StaticPlanner]: a fixed, ordered list of sources and a
fixed hedge delay, for [`hedged_stream`][trio_hedge.hedged_stream] (no state shared between
requests)."""

from __future__ import annotations

from collections.abc import Sequence

from .._source import Source
from ..report import AttemptRecord, Report
from ._config import HedgePolicy

__all__ = ["StaticPlanner"]


class StaticPlanner:
    """Replicas in the given order, each up to ``policy.attempts_per_replica`` times (round
    robin), capped at ``policy.max_attempts``; a fixed hedge delay; no budget. The plan is
    computed as it goes (``attempts_per_replica=10**9`` costs nothing up front), and a replica
    that failed with an error that is its own fault
    ([`AttemptError.replica_fault`][trio_hedge.AttemptError.replica_fault]: a wrong key, an unknown
    model) is not tried again in the same request."""

    def __init__(self, sources: Sequence[Source], policy: HedgePolicy) -> None:
        self._sources = tuple(sources)
        self._per_replica = policy.attempts_per_replica
        self._max_attempts = policy.max_attempts
        self._used = [0] * len(self._sources)  # attempts each replica took
        self._next = 0  # position in the round robin
        self._delay = policy.hedge_after if policy.hedge else None
        self._dead: set[int] = set()  # ids of sources at fault for this request
        #: The race skips `attempt_changed` (and building its records) when ``False``:
        #: with one attempt per replica, a replica's own fault changes nothing here.
        self.observes_attempts = policy.attempts_per_replica > 1

    async def next_source(self, number: int, trigger: str) -> Source | None:
        if self._max_attempts is not None and number > self._max_attempts:
            return None
        sources, used = self._sources, self._used
        for _ in range(len(sources)):
            index = self._next % len(sources)
            self._next += 1
            source = sources[index]
            if used[index] < self._per_replica and id(source) not in self._dead:
                used[index] += 1
                return source
        return None  # every replica used up, or at fault

    def hedge_delay(self, number: int) -> float | None:
        return self._delay

    def may_hedge(self) -> bool:
        return True

    def attempt_changed(self, source: Source, record: AttemptRecord) -> None:
        if record.error is not None and record.error.replica_fault:
            self._dead.add(id(source))

    def request_finished(self, report: Report) -> None:
        pass
