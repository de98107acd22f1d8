"""The [`StaticPlanner`][trio_hedge.policy.StaticPlanner]: a fixed, ordered list of sources and a
fixed hedge delay, for [`hedged_stream`][trio_hedge.hedged_stream] (no state shared between
requests)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import trio

from .._source import Source
from ..report import AttemptOutcome, AttemptRecord, Report
from ._backoff import backoff_delay, jitter_draw
from ._config import HedgePolicy

__all__ = ["StaticPlanner"]


class StaticPlanner:
    """Replicas in the given order, each up to ``policy.attempts_per_replica`` times (round
    robin), capped at ``policy.max_attempts``; a fixed hedge delay; no budget. The plan is
    computed as it goes (``attempts_per_replica=10**9`` costs nothing up front), and a replica
    that failed with an error that is its own fault
    ([`AttemptError.replica_fault`][trio_hedge.AttemptError.replica_fault]: a wrong key, an unknown
    model) or that said ``x-should-retry: false``
    ([`AttemptError.repeatable`][trio_hedge.AttemptError.repeatable]) is not tried again in the
    same request.

    A repeat on a replica that failed waits, as the Hedger's do: for ``policy.backoff``
    (``backoff_delay``, its jitter drawn from ``request_id`` by ``jitter_draw``) and for the
    ``Retry-After`` the replica answered, when that is within ``policy.max_pushback_wait``
    (a replica that asked for longer is not tried again by this request). When every replica
    left is waiting, the next attempt starts when the first is free.

    A recovery after the commit (``policy.max_recoveries``) gets ``policy.recovery``'s
    first-token deadline for a TTFT expected to be ``hedge_after`` (its ceiling when that is
    ``None``), and a hedge after ``hedge_after`` when the policy hedges. No throughput floor:
    nothing is learned here."""

    def __init__(
        self, sources: Sequence[Source], policy: HedgePolicy, *, request_id: str = ""
    ) -> None:
        self._sources = tuple(sources)
        self._per_replica = policy.attempts_per_replica
        self._max_attempts = policy.max_attempts
        self._used = [0] * len(self._sources)  # attempts each replica took
        self._next = 0  # position in the round robin
        self._delay = policy.hedge_after if policy.hedge else None
        self._recovery = policy.recovery
        self._expected = policy.hedge_after
        self._dead: set[int] = set()  # ids of sources at fault for this request
        self._backoff = policy.backoff
        self._max_wait = policy.max_pushback_wait
        self._request_id = request_id
        #: per replica: when its back-off and its cooldown (Retry-After) end
        self._retry_at = [-math.inf] * len(self._sources)
        self._cooling_until = [-math.inf] * len(self._sources)
        self._index = {id(source): i for i, source in enumerate(self._sources)}
        #: The race skips `attempt_changed` (and building its records) when ``False``:
        #: with one attempt per replica, a failed replica is never tried again anyway.
        self.observes_attempts = policy.attempts_per_replica > 1

    async def next_source(self, number: int, trigger: str) -> Source | None:
        if self._max_attempts is not None and number > self._max_attempts:
            return None
        sources, used = self._sources, self._used
        deadline = math.inf if self._max_wait is None else trio.current_time() + self._max_wait
        while True:
            now = trio.current_time()
            earliest = math.inf
            for _ in range(len(sources)):
                index = self._next % len(sources)
                self._next += 1
                if used[index] >= self._per_replica or id(sources[index]) in self._dead:
                    continue
                cooling = self._cooling_until[index]
                if cooling > deadline:
                    continue  # it asked for longer than this request waits
                at = max(self._retry_at[index], cooling)
                if at <= now:
                    used[index] += 1
                    return sources[index]
                earliest = min(earliest, at)
            if earliest == math.inf:
                return None  # every replica used up, at fault, or cooling beyond the bound
            # Every replica left waits (back-off, pushback): the first free goes (a commit
            # elsewhere cancels this wait).
            await trio.sleep_until(earliest)

    def hedge_delay(self, number: int) -> float | None:
        return self._delay

    def may_hedge(self) -> bool:
        return True

    def recovery_deadline(self, source: Source, added_tokens: int) -> float:
        return self._recovery.deadline(self._expected)

    def recovery_hedge_delay(self, source: Source, added_tokens: int) -> float | None:
        return self._delay if self._recovery.hedge else None

    def attempt_changed(self, source: Source, record: AttemptRecord) -> None:
        error = record.error
        if error is None:
            return
        if not error.repeatable:  # its own fault, or x-should-retry: false
            self._dead.add(id(source))
            return
        if record.outcome is not AttemptOutcome.FAILED:
            return
        index = self._index.get(id(source))
        if index is None:
            return
        now = trio.current_time()
        if error.retry_after is not None and error.retry_after > 0:
            self._cooling_until[index] = max(self._cooling_until[index], now + error.retry_after)
        backoff = self._backoff
        repeat = self._used[index]
        if backoff is not None and repeat < self._per_replica:
            draw = jitter_draw(self._request_id, source.name, repeat) if backoff.jitter else 1.0
            self._retry_at[index] = now + backoff_delay(repeat, backoff, draw)

    def request_finished(self, report: Report) -> None:
        pass
