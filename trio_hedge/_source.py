"""The interface the race engine races: a [`Source`][trio_hedge.sources.Source] opens
[`AttemptStream`][trio_hedge.sources.AttemptStream]s.

The engine knows nothing of HTTP: the OpenAI-compatible HTTP source is one implementation of
this interface, and any async-iterator factory is another (`trio_hedge.sources.iterator`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from .events import Delta

__all__ = ["AttemptInfo", "AttemptStream", "Source"]


@attrs.frozen
class AttemptInfo:
    """Who an attempt is, handed to [`Source.open`][trio_hedge.sources.Source.open].

    Attributes:
        request_id: the id shared by every attempt of one request (a UUID4 string).
        number: 1 for the primary, 2 for the first backup, and so on.
        trigger: why it started: ``"primary"``, ``"hedge"`` (the hedge delay passed with no
            first token), ``"failover"`` (an earlier attempt failed before its first token) or
            ``"recovery"`` (the winner broke after the commit: this attempt goes on with the
            answer; see ``continue_from``).
        idempotency_key: the caller's idempotency key, sent unchanged on every attempt of a
            request with side effects (so the server runs it once), or ``None``. Sources that
            talk to an API should forward it (the HTTP source sends ``Idempotency-Key``).
        continue_from: for a recovery by continuation (``trigger="recovery"``), the answer
            text the caller already has: the source sends it as a final assistant message by
            its engine's contract (and only a source whose ``continues`` attribute says how
            is ever given one); else ``None``.
        continue_tokens: the tokens of ``continue_from`` the caller already has (counted as
            the content deltas it was given: an engine streams at least one token per
            chunk, so the count never exceeds the tokens it generated); a source subtracts
            them from its request's token limit (``max_tokens``), so the whole answer keeps
            the caller's limit. 0 when ``continue_from`` is ``None``.
        instruction: for a recovery by the anchor method (a source whose ``continues`` is
            ``"anchor"``), the instruction to send as a user turn after ``continue_from``
            (sent as an assistant turn): go on from where the answer stopped, repeating its
            last characters first (which the engine finds, verifies and trims); else
            ``None``.
    """

    request_id: str
    number: int
    trigger: str
    idempotency_key: str | None = None
    continue_from: str | None = None
    continue_tokens: int = 0
    instruction: str | None = None


@runtime_checkable
class AttemptStream(Protocol):
    """One open attempt. Read by the attempt's task until its first token, then by the
    caller's own task directly (no relay), so implementations must not hold a cancel scope or
    nursery between calls.

    A stream that must stay in the task that opened it (an async generator that keeps a
    cancel scope or nursery open across ``yield``) sets a class attribute
    ``task_bound = True``: its attempt's task then keeps reading it after the commit and
    hands the batches to the caller over a channel (one task switch per batch), and closes it
    itself, without a scope of its own around the close.

    A stream whose server keeps what it answered (the Responses API's stored responses) may
    have a method ``async def discard() -> None``: called, after ``aclose``, when the caller
    does not keep that answer after all -- a recovery that never took over, a winner a
    recovery took over from, a recovery the caller did not read to its end -- to release it
    there (best effort, bounded by the engine)."""

    async def receive(self) -> Sequence[Delta] | None:
        """The next non-empty batch of deltas, or ``None`` when the stream ended cleanly.

        Raises:
            AttemptError: the attempt failed (transport, HTTP or in-band error, truncation).
        """
        ...

    async def aclose(self) -> None:
        """Release everything the attempt holds (close the HTTP response, so the server sees
        the disconnect). Idempotent."""
        ...


@runtime_checkable
class Source(Protocol):
    """Something that can start attempts: a replica bound to one request.

    A source may say how it continues an answer begun elsewhere, with an attribute
    ``continues``: ``"appends"`` (given ``AttemptInfo.continue_from``, its answer is only what
    follows that text: vLLM's ``continue_final_message``), ``"repeats"`` (its answer repeats
    that text first, then goes on: llama.cpp's server; the engine verifies and strips it),
    ``"anchor"`` (it sends that text as an assistant turn and ``AttemptInfo.instruction`` as a
    user turn after it: its answer repeats the text's last characters, then goes on; the
    engine finds the repeat and trims it) or ``None`` (the default: it is never asked, and a
    recovery on it replays the request). A source whose request is under guided decoding (a
    JSON schema, a grammar) should say ``None``: a continuation restarts the constraint at
    its root.

    A source may say, with an attribute ``model``, the model its request asks for (reports
    count each attempt's tokens by it: ``AttemptRecord.model``).

    A source may also say, with an attribute ``token_limit``, the most tokens its request
    lets an answer have (the body's ``max_tokens``, or ``None``: unknown): when the winner
    breaks once the caller has had that many, the answer is complete by length and no
    recovery is made (``docs/recovery.md``)."""

    @property
    def name(self) -> str:
        """A short name for reports and logs (never a credential)."""
        ...

    async def open(self, info: AttemptInfo) -> AttemptStream:
        """Start one attempt and return its stream once it is ready to be read (for HTTP: the
        response headers arrived with a 2xx status). Headers are *not* a first token.

        Raises:
            AttemptError: the attempt failed before any event.
        """
        ...
