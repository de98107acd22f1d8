"""Instrumentation: frozen event records handed to the Hedger's ``on_event`` callbacks.

Like stamina's instrumentation hooks: a plain list of callables, each called synchronously
with one :class:`HedgeEvent`. Keep callbacks quick (they run inside the race); an exception in
one is logged on the ``trio_hedge`` logger and otherwise ignored, so instrumentation can never
break a request.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence

import attrs

from ._report import AttemptRecord, Report

__all__ = ["EventKind", "HedgeEvent"]

logger = logging.getLogger("trio_hedge")


class EventKind(str, enum.Enum):
    """What happened."""

    ATTEMPT_STARTED = "attempt_started"
    #: an attempt produced the first token and won the race.
    COMMITTED = "committed"
    ATTEMPT_FAILED = "attempt_failed"
    ATTEMPT_CANCELLED = "attempt_cancelled"
    #: the hedge delay passed but no backup was sent (budget, throttle, or no healthy replica).
    HEDGE_REFUSED = "hedge_refused"
    #: a replica was put in cooldown by server pushback (``retry_after``).
    REPLICA_COOLING = "replica_cooling"
    #: a replica was ejected by outlier detection.
    REPLICA_EJECTED = "replica_ejected"
    #: the request ended (``report`` is set).
    REQUEST_FINISHED = "request_finished"


@attrs.frozen
class HedgeEvent:
    """One instrumentation event.

    Attributes:
        kind: an :class:`EventKind`.
        time: Trio's clock when it happened (``trio.current_time()``, seconds).
        request_id: the request's id (or ``None`` for replica events without one).
        group: the request's group.
        replica: the replica concerned, or ``None``.
        record: the attempt's :class:`~trio_hedge.AttemptRecord` (attempt events), or ``None``.
        reason: for ``hedge_refused``: ``"budget"``, ``"throttle"`` or ``"no_replica"``; for
            replica events: why; else ``None``.
        until: for replica events: Trio time the cooldown or ejection ends.
        report: for ``request_finished``: the final :class:`~trio_hedge.Report`.
    """

    kind: EventKind
    time: float
    request_id: str | None
    group: str | None = None
    replica: str | None = None
    record: AttemptRecord | None = None
    reason: str | None = None
    until: float | None = None
    report: Report | None = attrs.field(default=None, eq=False)


EventHook = Callable[[HedgeEvent], None]


def emit(hooks: Sequence[EventHook], event: HedgeEvent) -> None:
    """Call every hook with ``event``; log and swallow their exceptions."""
    for hook in hooks:
        try:
            hook(event)
        except Exception:
            logger.exception("trio_hedge on_event hook %r failed", hook)
