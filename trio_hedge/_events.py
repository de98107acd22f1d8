"""Typed stream events: what one chunk of a streamed answer carries.

One :class:`Delta` is made per SSE data event (not per field), because this is the hot path:
a UI streams thousands of them and a gateway millions.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

__all__ = ["Delta", "FirstToken", "ToolCallDelta", "counts_as_first_token"]


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
