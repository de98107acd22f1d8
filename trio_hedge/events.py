"""What the library tells you, as frozen values.

Stream events -- what one chunk of a streamed answer carries: [`Delta`][trio_hedge.events.Delta]
(content, reasoning, [`ToolCallDelta`][trio_hedge.events.ToolCallDelta] fragments, finish reason,
usage) and [`FirstToken`][trio_hedge.events.FirstToken] (which deltas count as the first token). One
[`Delta`][trio_hedge.events.Delta] is made per SSE data event (not per field), because this is the
hot path: a UI streams thousands of them and a gateway millions.

Hedge events -- what a [`Hedger`][trio_hedge.Hedger] hands its ``on_event`` hooks
([`EventHook`][trio_hedge.events.EventHook]): a [`HedgeEvent`][trio_hedge.events.HedgeEvent] of some
[`EventKind`][trio_hedge.events.EventKind] for every attempt started, committed, failed or
cancelled, hedge or failover refused, replica cooled or ejected, and request finished.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import attrs

from .report import AttemptRecord, Report

__all__ = [
    "Delta",
    "EventHook",
    "EventKind",
    "FirstToken",
    "HedgeEvent",
    "ToolCallDelta",
    "counts_as_first_token",
]


@attrs.frozen(slots=True)
class ToolCallDelta:
    """A fragment of a tool call, as OpenAI streams them: fragments with the same ``index``
    belong to one call; ``arguments`` pieces are concatenated in order.

    Attributes:
        index: which tool call of the choice the fragment belongs to (0-based).
        id: the call's id, usually only on its first fragment, else ``None``.
        name: the function's name, usually only on its first fragment, else ``None``.
        arguments: the next piece of the call's JSON arguments (``""`` when none).
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@attrs.frozen(slots=True)
class Delta:
    """What one streamed chunk adds to the answer.

    Attributes:
        content: answer text (``""`` when the chunk has none).
        reasoning: reasoning ("thinking") text (``""`` when none).
        tool_calls: tool-call fragments, in the order the chunk lists them.
        finish_reason: the choice's finish reason, or ``None`` (an empty string means none).
        usage: the usage object (``prompt_tokens``, ``completion_tokens``, …) when the chunk
            carries one, else ``None``.
        role: the role announced by the chunk, if any (role-only chunks are not output).
        raw: the SSE event's data as the server sent it (the chunk's JSON text, without the
            ``data:`` field names and surrounding whitespace), for relaying it without
            re-encoding (the gateway's byte-for-byte forwarding); ``None`` when the delta has
            no wire form of its own (a whole JSON answer, a generic source). Not part of
            equality or the repr.
    """

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str | None = None
    usage: dict[str, Any] | None = attrs.field(default=None, eq=False)
    role: str | None = None
    raw: str | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def has_output(self) -> bool:
        """Content, reasoning or a tool-call fragment (role, usage and finish do not count)."""
        return bool(self.content or self.reasoning or self.tool_calls)


class FirstToken(str, enum.Enum):
    """What counts as the first token, the event that commits the race.

    Role-only deltas, SSE comments and keep-alives, empty data events and usage-only chunks
    never count: servers send them while the request is still queued.
    """

    CONTENT = "content"
    """answer text only (default)."""
    CONTENT_OR_REASONING = "content_or_reasoning"
    """answer text or reasoning text (for reasoning models whose thinking is shown to users)."""
    ANY_OUTPUT = "any_output"
    """any output, including tool-call fragments (for agents)."""


def counts_as_first_token(delta: Delta, rule: FirstToken) -> bool:
    """Whether ``delta`` commits the race under ``rule``."""
    if delta.content:
        return True
    if rule is FirstToken.CONTENT:
        return False
    if delta.reasoning:
        return True
    return rule is FirstToken.ANY_OUTPUT and bool(delta.tool_calls)


# -- hedge events ----------------------------------------------------------------------------


class EventKind(str, enum.Enum):
    """What happened."""

    ATTEMPT_STARTED = "attempt_started"
    """an attempt started (the primary, a hedge or a failover)."""
    COMMITTED = "committed"
    """an attempt produced the first token and won the race."""
    ATTEMPT_FAILED = "attempt_failed"
    """an attempt failed (``record.error`` says why)."""
    ATTEMPT_CANCELLED = "attempt_cancelled"
    """an attempt was cancelled: it lost the race, a fatal error ended the request, or the
    caller left."""
    HEDGE_REFUSED = "hedge_refused"
    """the hedge delay passed but no backup was sent (budget, the budget's share kept for
    higher priority classes, throttle, or no usable replica)."""
    FAILOVER_REFUSED = "failover_refused"
    """an attempt failed but no failover was sent (throttle, or no usable replica)."""
    REPLICA_COOLING = "replica_cooling"
    """a replica was put in cooldown by server pushback (``retry_after``)."""
    REPLICA_EJECTED = "replica_ejected"
    """a replica was ejected by outlier detection."""
    REQUEST_FINISHED = "request_finished"
    """the request ended (``report`` is set)."""


@attrs.frozen
class HedgeEvent:
    """One instrumentation event.

    Attributes:
        kind: an [`EventKind`][trio_hedge.events.EventKind].
        time: Trio's clock when it happened (``trio.current_time()``, seconds).
        request_id: the request's id (or ``None`` for replica events without one).
        group: the request's group.
        replica: the replica concerned, or ``None``.
        record: the attempt's [`AttemptRecord`][trio_hedge.report.AttemptRecord] (attempt events),
            or ``None``.
        reason: for ``hedge_refused``: ``"budget"``, ``"priority"`` (the budget's share kept
            for requests of a higher class), ``"throttle"`` or ``"no_replica"``; for
            ``failover_refused``: ``"throttle"`` or ``"no_replica"``; for replica events: why
            (the error kind, or ``"slow"``); else ``None``.
        until: for replica events: Trio time the cooldown or ejection ends.
        model: for replica events: the model the cooldown or ejection holds for (a cooldown
            is always for one model); ``None`` for an ejection for every model, and for
            every other event.
        report: for ``request_finished``: the final [`Report`][trio_hedge.Report].
        request_key: an object unique to the request the event belongs to (compare by
            identity, use as a dict key), or ``None``: two requests may carry the same
            ``request_id`` (a client chooses ``X-Request-ID``), never the same key. Keep a
            hook's per-request state under it, not under the id.
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
    model: str | None = None
    request_key: object | None = attrs.field(default=None, eq=False, repr=False)


EventHook = Callable[[HedgeEvent], "AbstractContextManager[object] | None"]
"""An ``on_event`` callback: returns ``None``, or a context manager that wraps what the event
began (an attempt's span, say: it is exited when the attempt ends)."""
