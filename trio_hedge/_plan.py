"""Which replica each attempt goes to, when to hedge, and whether a hedge is allowed.

The race asks a :class:`Planner` at the moment it needs an answer (so a budget is checked when
a backup would be sent, not reserved earlier) and tells it what happened to each attempt. The
:class:`StaticPlanner` serves a fixed, ordered list with a fixed delay; the long-lived
:class:`trio_hedge.Hedger` supplies a learning planner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ._policy import HedgePolicy
from ._report import AttemptRecord, Report
from .sources._base import Source

__all__ = ["Planner", "StaticPlanner"]


class Planner(Protocol):
    """The race's advisor for one request.

    A planner may set a class attribute ``observes_attempts = False`` when its
    :meth:`attempt_changed` ignores its calls: the race then skips building the records."""

    async def next_source(self, number: int, trigger: str) -> Source | None:
        """The source for attempt ``number`` (``trigger`` says why it starts), or ``None``
        when no further attempt may start. May wait (for a replica's cooldown)."""
        ...

    def hedge_delay(self, number: int) -> float | None:
        """Seconds after attempt ``number`` starts before the next one is sent as a hedge,
        or ``None`` for never."""
        ...

    def may_hedge(self) -> bool:
        """Whether a hedge may be sent now (the hedge budget). Called at the moment."""
        ...

    def attempt_changed(self, source: Source, record: AttemptRecord) -> None:
        """An attempt started, got its first token, failed or was cancelled."""
        ...

    def request_finished(self, report: Report) -> None:
        """The request ended (its stream closed, or the race failed or was cancelled): the
        final :class:`~trio_hedge.Report`. Called at most once, never before the race began."""
        ...


class StaticPlanner:
    """Replicas in the given order, each up to ``policy.attempts_per_replica`` times (round
    robin), capped at ``policy.max_attempts``; a fixed hedge delay; no budget."""

    #: The race skips :meth:`attempt_changed` (and building its records) when ``False``.
    observes_attempts = False

    def __init__(self, sources: Sequence[Source], policy: HedgePolicy) -> None:
        plan = [s for _ in range(policy.attempts_per_replica) for s in sources]
        if policy.max_attempts is not None:
            plan = plan[: policy.max_attempts]
        self._plan = plan
        self._delay = policy.hedge_after if policy.hedge else None

    async def next_source(self, number: int, trigger: str) -> Source | None:
        return self._plan[number - 1] if number <= len(self._plan) else None

    def hedge_delay(self, number: int) -> float | None:
        return self._delay

    def may_hedge(self) -> bool:
        return True

    def attempt_changed(self, source: Source, record: AttemptRecord) -> None:
        pass

    def request_finished(self, report: Report) -> None:
        pass
