"""Log every [`HedgeEvent`][trio_hedge.events.HedgeEvent] with the standard library's
``logging``."""

from __future__ import annotations

import logging
import time

import trio

from ..events import EventKind, HedgeEvent

__all__ = ["LoggingHook"]

#: Events worth an operator's attention by default; the rest are DEBUG.
_INFO = frozenset(
    {
        EventKind.ATTEMPT_FAILED,
        EventKind.HEDGE_REFUSED,
        EventKind.FAILOVER_REFUSED,
        EventKind.REPLICA_COOLING,
        EventKind.REPLICA_EJECTED,
    }
)


class LoggingHook:
    """An ``on_event`` hook that logs one line per event on ``logger`` (default the
    ``trio_hedge`` logger): failures, refusals, cooldowns and ejections at INFO, the rest at
    DEBUG. Lines carry the event's fields (request id, replica, attempt, error kind, TTFT in
    seconds) as text and as ``extra`` attributes; never a credential (events hold none).

    Every line also carries ``ts`` (the event's time on Trio's clock, shifted to Unix time at
    the hook's first event, seconds: so a virtual-time test logs virtual time), an attempt
    that ended without a
    first token ``ran`` (seconds it ran), and ``request_finished`` the ``prompt_tokens``: with
    the DEBUG lines kept, a log is a record of every attempt's TTFT (or how long it ran
    before it was cancelled) that ``trio-hedge tune`` replays to choose the policy."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger or logging.getLogger("trio_hedge")
        self._unix_offset: float | None = None  # Unix time - Trio time, at the first event

    def __call__(self, event: HedgeEvent) -> None:
        level = logging.INFO if event.kind in _INFO else logging.DEBUG
        if not self._logger.isEnabledFor(level):
            return
        if self._unix_offset is None:
            self._unix_offset = time.time() - trio.current_time()
        fields: dict[str, object] = {
            "ts": round(self._unix_offset + event.time, 3),
            "request_id": event.request_id,
            "replica": event.replica,
            "group": event.group,
        }
        record = event.record
        if record is not None:
            fields["attempt"] = record.number
            fields["trigger"] = record.trigger
            fields["outcome"] = record.outcome.value
            if record.ttft is not None:
                fields["ttft"] = round(record.ttft, 6)
            elif record.started_at is not None and record.ended_at is not None:
                fields["ran"] = round(record.ended_at - record.started_at, 6)
            if record.error is not None:
                fields["error"] = record.error.kind.value
        if event.reason is not None:
            fields["reason"] = event.reason
        if event.until is not None:
            fields["until"] = round(event.until, 6)
        if event.model is not None:
            fields["model"] = event.model
        report = event.report
        if report is not None:
            fields.update(
                winner=report.winner,
                hedged=report.hedged,
                ttft=report.ttft,
                prompt_tokens=report.prompt_tokens,
            )
        text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        self._logger.log(level, "%s %s", event.kind.value, text, extra={"trio_hedge": fields})
