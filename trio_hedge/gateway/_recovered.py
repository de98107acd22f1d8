"""One completion across a recovery: the chat chunks after a recovery, rewritten (the other
APIs' events: ``_agent.py``'s ``_continued``, relayed by `relay_recovered` too).

After the commit the relay writes the winner's events byte for byte (``_forward.py``). When
the winner breaks and a recovery takes over (``HedgedStream.recovered``, docs/recovery.md),
the new replica's chunks carry its own ``id``, ``model`` and ``created``, and its usage counts
its own request. From then on, and only then, each chunk is re-encoded here with the first
upstream's ``id``, ``model``, ``created`` and ``system_fingerprint``, and its usage is made to
count what the client got (`recovered_usage`). A stream that needs no recovery never comes
here: the fast path pays nothing for it but one integer read per batch.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import attrs

from .. import HedgedStream, Report
from ..events import Delta
from ._http import Exchange

__all__ = [
    "AGENT_USAGE",
    "CHAT_USAGE",
    "ChunkRewriter",
    "event_of",
    "head_of",
    "recount",
    "recovered_usage",
    "relay_recovered",
]

#: The fields that make chunks one completion (the first upstream's, kept after a recovery).
HEAD_KEYS = ("id", "created", "model", "system_fingerprint")


def event_of(delta: Delta | None) -> dict[str, Any]:
    """A relayed delta's event (its ``raw`` JSON text) as an object; ``{}`` for none, no
    text of its own, or text that is no JSON object."""
    if delta is None or delta.raw is None:
        return {}
    try:
        event = json.loads(delta.raw)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


def head_of(first: Delta | None) -> dict[str, Any]:
    """The ``id``, ``created``, ``model`` and ``system_fingerprint`` of the upstream's first
    chunk (``first.raw``); empty when it had no JSON text of its own (the gateway's own
    encoder made it: its head is what a re-encoded chunk carries anyway)."""
    chunk = event_of(first)
    return {k: chunk[k] for k in HEAD_KEYS if chunk.get(k) is not None}


#: The usage fields of each API: (prompt, completion, total); Messages has no total.
CHAT_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")
AGENT_USAGE = ("input_tokens", "output_tokens", "total_tokens")


def recovered_usage(
    usage: Mapping[str, Any], report: Report, keys: tuple[str, str, str] = CHAT_USAGE
) -> dict[str, Any]:
    """The last upstream's ``usage`` after a recovery, counting what the client got (its one
    usage: what it is charged):

    * completion (``completion_tokens``; ``output_tokens``): the upstream's own count, minus
      the content tokens it generated and were held back (a replay's reproduced prefix, an
      anchor's repeat: ``held_back``), plus the content tokens the client had when the
      recovery started (``tokens``);
    * prompt (``prompt_tokens``; ``input_tokens``): the upstream's own for a replay (the
      original request again); for a continuation or an anchor continuation, whose prompt
      also carried the text so far (and the anchor's instruction), less those tokens
      (``prompt_added``: an estimate, as an engine may tokenise the prefix differently);
    * total: their sum, when the API has one. Other fields (details) are the last upstream's.

    What each model generated for the answer, the tokens the client did not get included, is
    in the report (``Report.tokens_by_model``), the access log and the per-model metric.
    Unchanged when the report's winner is no recovery."""
    record = next((a.recovery for a in report.attempts if a.number == report.winner), None)
    out = dict(usage)
    if record is None:
        return out
    prompt_key, completion_key, total_key = keys
    prompt = usage.get(prompt_key)
    completion = usage.get(completion_key)
    if isinstance(completion, int):
        out[completion_key] = max(completion - record.held_back, 0) + record.tokens
    if isinstance(prompt, int) and record.method != "replay":
        out[prompt_key] = max(prompt - record.prompt_added, 0)
    both = isinstance(out.get(prompt_key), int) and isinstance(out.get(completion_key), int)
    if both and total_key in usage:
        out[total_key] = out[prompt_key] + out[completion_key]
    return out


def recount(deltas: list[Delta], report: Report) -> None:
    """Make the usage of a non-streamed answer assembled across a recovery count what the
    client gets (`recovered_usage`), in place."""
    for i, delta in enumerate(deltas):
        if delta.usage is not None:
            deltas[i] = attrs.evolve(delta, usage=recovered_usage(delta.usage, report))


class ChunkRewriter:
    """SSE bytes for a delta after a recovery: the chunk's JSON (the upstream's own, or made
    by ``chunk`` when the gate split the delta) with the original head and usage."""

    __slots__ = ("_chunk", "_head", "_stream")

    def __init__(
        self,
        head: Mapping[str, Any],
        chunk: Callable[[Delta], dict[str, Any]],
        stream: HedgedStream,
    ) -> None:
        self._head = dict(head)
        self._chunk = chunk
        self._stream = stream

    def encode(self, delta: Delta) -> bytes:
        if not (delta.has_output or delta.finish_reason or delta.usage is not None):
            return b""  # the new upstream's role-only opening: the client had one already
        chunk: Any = None
        if delta.raw is not None:
            try:
                chunk = json.loads(delta.raw)
            except ValueError:
                chunk = None
        if not isinstance(chunk, dict):
            chunk = self._chunk(delta)
        chunk.update(self._head)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            chunk["usage"] = recovered_usage(usage, self._stream.report)
        data = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
        return b"data: " + data.encode() + b"\n\n"


async def relay_recovered(
    ex: Exchange,
    batch: Sequence[Delta],
    batches: AsyncIterator[Sequence[Delta]],
    encode: Callable[[Delta], bytes],
) -> Sequence[Delta]:
    """Write ``batch`` and every batch after it rewritten (``encode``: a `ChunkRewriter`'s,
    or another API's), one write per batch that has something to say; the last batch."""
    data = b"".join(map(encode, batch))
    if data:
        await ex.body(data, more=True)
    async for batch in batches:
        data = b"".join(map(encode, batch))
        if data:
            await ex.body(data, more=True)
    return batch
