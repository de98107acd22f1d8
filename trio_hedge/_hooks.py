"""Calling the Hedger's ``on_event`` hooks with [`HedgeEvent`][trio_hedge.events.HedgeEvent]s.

Like stamina's instrumentation hooks: a plain list of callables, each called synchronously
with one [`HedgeEvent`][trio_hedge.events.HedgeEvent]. Keep callbacks quick (they run inside the
race); an exception in one is logged on the ``trio_hedge`` logger and otherwise ignored, so
instrumentation can never break a request.

A hook may also return a context manager (as stamina's ``RetryHook`` may, since 25.1): it is
entered at once and exited when what the event began ends. For ``attempt_started`` that is the
attempt's end (its ``attempt_failed`` event, with the [`AttemptError`][trio_hedge.AttemptError] as
the exception; its ``attempt_cancelled`` event; or, for the winner, the ``request_finished`` event,
with the request's error if it has one), so a span or a timer wraps an attempt. A context
manager returned for any other event is exited at once. Hooks that return ``None`` work as
before. The context manager is entered and exited in whichever Trio task emits the events, so
it must not set context variables it expects to reset (OpenTelemetry's ``use_span``): start
and end a span explicitly instead (see
[`OpenTelemetryHook`][trio_hedge.instrumentation.OpenTelemetryHook]).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager

from .events import EventHook, EventKind, HedgeEvent

__all__ = ["Scopes", "emit"]

logger = logging.getLogger("trio_hedge")


_Scope = tuple[EventHook, AbstractContextManager[object]]
#: The context managers open for one request's attempts: {attempt number: [(hook, cm)]}. The
#: request owns it (its planner), not its id: two requests may carry the same id (a client's
#: ``X-Request-ID``), and one's end must not close the other's spans. An entry lives from an
#: attempt's start to its end (at the latest the request's end).
Scopes = dict[int, list[_Scope]]

_ATTEMPT_ENDS = frozenset({EventKind.ATTEMPT_FAILED, EventKind.ATTEMPT_CANCELLED})


def emit(hooks: Sequence[EventHook], event: HedgeEvent, scopes: Scopes | None = None) -> None:
    """Call every hook with ``event``; log and swallow their exceptions. Enter the context
    managers hooks return; keep those an ``attempt_started`` event begins in ``scopes`` (the
    request's own; without it they are exited at once, like every other event's), and exit
    those whose attempt (or request) ``event`` ends, after every hook has seen it."""
    kind = event.kind
    record = event.record
    for hook in hooks:
        try:
            result = hook(event)
        except Exception:
            logger.exception("trio_hedge on_event hook %r failed", hook)
            continue
        if result is None or not hasattr(result, "__exit__"):
            continue
        try:
            result.__enter__()
        except Exception:
            logger.exception("trio_hedge on_event hook %r: entering its context failed", hook)
            continue
        if kind is EventKind.ATTEMPT_STARTED and record is not None and scopes is not None:
            scopes.setdefault(record.number, []).append((hook, result))
        else:
            _exit(hook, result, None)
    if not scopes:
        return
    if kind in _ATTEMPT_ENDS and record is not None:
        failure = record.error if kind is EventKind.ATTEMPT_FAILED else None
        for hook, manager in reversed(scopes.pop(record.number, [])):
            _exit(hook, manager, failure)
    elif kind is EventKind.REQUEST_FINISHED:
        report = event.report
        error = report.error if report is not None else None
        for number in sorted(scopes, reverse=True):
            for hook, manager in reversed(scopes[number]):
                _exit(hook, manager, error)
        scopes.clear()


def _exit(
    hook: EventHook, manager: AbstractContextManager[object], error: BaseException | None
) -> None:
    try:
        if error is None:
            manager.__exit__(None, None, None)
        else:
            manager.__exit__(type(error), error, error.__traceback__)
    except Exception:
        logger.exception("trio_hedge on_event hook %r: exiting its context failed", hook)
