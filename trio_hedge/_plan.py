"""Which replica each attempt goes to, when to hedge, and whether a hedge is allowed.

The race asks a [`Planner`][trio_hedge.policy.Planner] at the moment it needs an answer (so a budget
is checked when a backup would be sent, not reserved earlier) and tells it what happened to each
attempt. The planners themselves are policy (`trio_hedge.policy`): the
[`StaticPlanner`][trio_hedge.policy.StaticPlanner] serves a fixed, ordered list with a fixed delay;
the long-lived [`trio_hedge.Hedger`][trio_hedge.Hedger] supplies a learning planner.
"""

from __future__ import annotations

from typing import Protocol

from ._source import Source
from .report import AttemptRecord, Report

__all__ = ["Planner"]


class Planner(Protocol):
    """The race's advisor for one request.

    A planner may set a class attribute ``observes_attempts = False`` when its
    [`attempt_changed`][trio_hedge.policy.Planner.attempt_changed] ignores its calls: the race then
    skips building the records.

    A planner may also have a method ``fails_over(error) -> bool``: asked (after
    ``attempt_changed`` heard of the failure) when an attempt fails with an error that is
    not retryable, whether another attempt may still go instead of the request failing
    ([`Hedger`][trio_hedge.Hedger]'s: a context-length error while a replica declares a larger
    window).

    And a method ``hedge_on_evidence(number) -> float | None``: asked while the race waits
    out attempt ``number``'s hedge delay; ``0.0`` sends the backup now, a positive number
    asks again after that many seconds, ``None`` never asks again (the Hedger's, with load
    probes: a reading that arrived during the wait says the primary's replica is queued).

    And a method ``winner_broke(error) -> bool``: told at once when the committed winner
    fails after the commit (a cut, a stall, an in-band error), before any recovery; returns
    whether a recovery may be tried (without the method: whether ``error`` is retryable)."""

    async def next_source(self, number: int, trigger: str) -> Source | None:
        """The source for attempt ``number`` (``trigger`` says why it starts), or ``None``
        when no further attempt may start. May wait (for a replica's cooldown), unshielded: a
        commit or a fatal error during the wait arrives as ``Cancelled``. A source returned
        after the race was decided is never opened, but a shielded wait still holds up the
        winner's hand-over until it ends."""
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
        final [`Report`][trio_hedge.Report]. Called at most once, never before the race began."""
        ...
