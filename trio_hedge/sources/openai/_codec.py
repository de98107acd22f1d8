"""OpenAI-compatible chat-completion streams: bytes in, [`Delta`][trio_hedge.events.Delta]s out.

What "OpenAI-compatible" means in practice (each rule stands for a kind of real-world server
quirk; see ``/work/shared/sse-cases`` for reproductions):

* SSE framing is the SSE decoder (``_sse``; CR/LF/CRLF, comments, ``data:`` without a space,
  multi-line data, BOM, reads split anywhere).
* ``[DONE]`` ends the stream; everything after it is ignored. A stream is also complete when
  it ends after a non-empty ``finish_reason`` (``""`` means none, as Ollama sends it). Ending
  after data with neither is ``STREAM_TRUNCATED``; with no data event at all, ``EMPTY_STREAM``.
* Chunks with empty or absent ``choices`` (Azure's ``prompt_filter_results``, usage-only
  chunks), choices without ``delta``, empty data events and unknown keys are not errors.
* ``choices`` entries are picked by ``index == 0`` (``n > 1`` streams interleave choices).
* Content is ``delta.content`` (a string, or a list of parts of which only ``text`` parts are
  content and ``thinking``/``reasoning`` parts are reasoning); reasoning is
  ``reasoning_content`` (DeepSeek, vLLM) or ``reasoning`` (OpenRouter, vLLM, Ollama).
* Tool calls stay fragments ([`ToolCallDelta`][trio_hedge.events.ToolCallDelta]);
  [`merge_tool_calls`][trio_hedge.sources.openai.merge_tool_calls] assembles them.
* Usage is taken wherever the server puts it: top level (also on a finish chunk or a
  ``choices: []`` chunk), inside the choice, or Groq's ``x_groq.usage``.
* In-band errors -- ``{"error": {...}}``, ``{"error": "text"}``, ``{"object": "error", ...}``
  (vLLM), ``{"type": "error", ...}`` (Anthropic), a list holding one of those (Gemini), or an
  ``event: error`` frame -- raise an [`AttemptError`][trio_hedge.AttemptError] classified like an
  HTTP error.

JSON is parsed with orjson when importable, else `json`; orjson failures fall back to
`json`, so both give the same results (the one value-level difference, integers beyond
64 bits, cannot change a Delta: see `_index`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ...errors import AttemptError, ErrorKind
from ...events import Delta, ToolCallDelta
from ._errors import (
    Redact,
    _in_band_error,
    _is_error,
    _no_redact,
    _Sent,
    _truncate,
    classify_http_error,
)
from ._framing import FramedDecoder
from ._json import _index, _inexact, _json_loads, _loads
from ._sse import DEFAULT_MAX_EVENT_SIZE, RawEvent

__all__ = ["ChunkDecoder", "decode_json_body", "merge_tool_calls"]


# -- chunk semantics -------------------------------------------------------------------------


def _pick_choice(choices: list[Any]) -> Any:
    """The choice with ``index`` 0 (or without an index)."""
    first = choices[0]
    if type(first) is dict and first.get("index", 0) in (0, None):
        return first
    for choice in choices:
        if type(choice) is dict and choice.get("index", 0) in (0, None):
            return choice
    return None


def _parts(parts: list[Any]) -> tuple[str, str]:
    """(content, reasoning) of list-typed content (Mistral/Magistral, Anthropic-style)."""
    content: list[str] = []
    reasoning: list[str] = []
    for part in parts:
        if type(part) is str:
            content.append(part)
            continue
        if type(part) is not dict:
            continue
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if type(text) is str:
                content.append(text)
        elif kind in ("thinking", "reasoning"):
            for key in ("thinking", "reasoning", "text", "content"):
                inner = part.get(key)
                if type(inner) is str:
                    reasoning.append(inner)
                    break
                if type(inner) is list:
                    reasoning.append("".join(_parts(inner)))
                    break
    return "".join(content), "".join(reasoning)


def _tool_calls(raw: Any) -> tuple[ToolCallDelta, ...]:
    if type(raw) is not list:
        return ()
    out: list[ToolCallDelta] = []
    for position, call in enumerate(raw):
        if type(call) is not dict:
            continue
        function = call.get("function")
        name: Any = None
        arguments: Any = None
        if type(function) is dict:
            name = function.get("name")
            arguments = function.get("arguments")
        call_id = call.get("id")
        if arguments is None:
            arguments = ""
        elif type(arguments) is not str:
            # Some servers send the arguments as a JSON object instead of a string.
            arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        if type(name) is not str or not name:
            name = None
        if type(call_id) is not str or not call_id:
            call_id = None
        if call_id is None and name is None and not arguments:
            continue  # nothing to add (e.g. a bare {"index": 0})
        out.append(ToolCallDelta(_index(call.get("index"), position), call_id, name, arguments))
    return tuple(out)


def _usage(obj: dict[str, Any], choice: Any) -> dict[str, Any] | None:
    usage = obj.get("usage")
    if type(usage) is dict:
        return usage
    if type(choice) is dict:
        usage = choice.get("usage")
        if type(usage) is dict:
            return usage
    groq = obj.get("x_groq")
    if type(groq) is dict:
        usage = groq.get("usage")
        if type(usage) is dict:
            return usage
    return None


def _delta_from(obj: dict[str, Any], key: str, raw: str | None = None) -> Delta | None:
    """The Delta of one chunk (``key="delta"``) or whole completion (``key="message"``);
    ``None`` when it carries nothing. ``raw`` is the event's JSON text, kept on the Delta."""
    choices = obj.get("choices")
    choice = _pick_choice(choices) if type(choices) is list and choices else None
    content = reasoning = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish = role = None
    if choice is not None:
        delta = choice.get(key)
        if delta is None:
            delta = choice.get("message" if key == "delta" else "delta")
        if type(delta) is dict:
            value = delta.get("content")
            if type(value) is str:
                content = value
            elif type(value) is list:
                content, reasoning = _parts(value)
            value = delta.get("reasoning_content") or delta.get("reasoning")
            if type(value) is str:
                reasoning += value
            if "tool_calls" in delta:
                tool_calls = _tool_calls(delta["tool_calls"])
            elif type(delta.get("function_call")) is dict:  # the legacy single-call shape
                tool_calls = _tool_calls([{"index": 0, "function": delta["function_call"]}])
            value = delta.get("role")
            if type(value) is str and value:
                role = value
        elif delta is None and type(choice.get("text")) is str:
            content = choice["text"]  # legacy /v1/completions chunks
        value = choice.get("finish_reason")
        if type(value) is str and value:
            finish = value
    usage = _usage(obj, choice)
    if not (content or reasoning or tool_calls or finish or usage or role):
        return None
    return Delta(content, reasoning, tool_calls, finish, usage, role, raw)


# -- non-SSE answers ----------------------------------------------------------------------

_BOM = b"\xef\xbb\xbf"
_SSE_START = (b"data:", b"data\n", b"data\r", b":", b"event:", b"id:", b"retry:")


def decode_json_body(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    redact: Redact = _no_redact,
    sent: bytes = b"",
) -> list[Delta]:
    """Decode a whole ``application/json`` answer to a streaming request.

    An error object raises its classified [`AttemptError`][trio_hedge.AttemptError]; a
    ``chat.completion`` (the server ignored ``stream: true``) becomes one Delta with its content,
    reasoning, tool calls, finish reason and usage. Tolerated: a body that is really an event stream
    (decoded as one), and ``data: [DONE]`` appended after the JSON.

    ``sent``: the request's body, whose words an error message may quote back (see
    [`classify_http_error`][trio_hedge.sources.openai.classify_http_error]).

    Raises:
        AttemptError: the classified error, ``PROTOCOL`` for a body that is not JSON or not a
            completion, ``EMPTY_STREAM`` for an empty body.
    """
    raw = body.strip()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:].lstrip()
    if not raw:
        raise AttemptError(ErrorKind.EMPTY_STREAM, "empty JSON answer", status_code=status)
    if raw.startswith(_SSE_START):
        decoder = ChunkDecoder(max(len(body) + 1, DEFAULT_MAX_EVENT_SIZE), redact=redact)
        return decoder.feed(body) + decoder.end()
    try:
        obj = _loads(raw)
    except ValueError:
        cut = raw.rfind(b"data:")
        try:
            if cut <= 0 or raw[cut + 5 :].strip() != b"[DONE]":
                raise ValueError
            obj = _loads(raw[:cut])
        except ValueError:
            raise AttemptError(
                ErrorKind.PROTOCOL, "JSON answer does not parse", status_code=status
            ) from None
    if _is_error(obj):
        if status >= 400:  # a caller passing an error status: the status decides
            raise classify_http_error(status, headers, body, redact=redact, sent=sent)
        raise _in_band_error(obj, headers, status=status, redact=redact, sent=_Sent(sent))
    if type(obj) is not dict or "choices" not in obj:
        raise AttemptError(
            ErrorKind.PROTOCOL,
            "JSON answer is neither a completion nor an error",
            status_code=status,
        )
    delta = _delta_from(obj, "message")
    if delta is not None and delta.usage is not None and _inexact(delta.usage):
        delta = _delta_from(_json_loads(raw), "message")
    return [] if delta is None else [delta]


# -- the stream decoder -----------------------------------------------------------------------


class ChunkDecoder(FramedDecoder):
    """Per-response decoder of an OpenAI-compatible chat-completion event stream.

    Args:
        max_event_size: bound on one SSE event (see
            [`SSEDecoder`][trio_hedge.sources.openai.SSEDecoder]).
        redact: masks secrets the server quoted back in an error event (default: none).
        sent: the request's body, whose words an error event may quote back: they never
            make the error the replica's (see
            [`classify_http_error`][trio_hedge.sources.openai.classify_http_error]; default
            empty).

    Attributes:
        done: ``[DONE]`` was seen; later bytes are ignored.
        data_events: data events seen so far: events whose data is non-empty after stripping
            (``[DONE]`` and error events count; comments, ``id:``/``retry:``-only blocks and
            empty ``data:`` keep-alives do not). A body that is one JSON document counts 1.
        error: the [`AttemptError`][trio_hedge.AttemptError] this decoder raised or will raise next,
            or ``None``.
        finish_reason: the last non-empty finish reason seen, or ``None``.
        usage: the last usage object seen, or ``None``.

    A body that starts with ``{`` or ``[`` is not an event stream (a JSON answer under an
    event-stream content type): it is buffered and decoded by
    [`decode_json_body`][trio_hedge.sources.openai.decode_json_body] at
    [`end`][trio_hedge.sources.openai.ChunkDecoder.end].
    """

    __slots__ = ()

    def _end(self) -> list[Delta]:
        if self.done:
            return []
        if self._mode == 2:
            return self._end_json()
        out: list[Delta] = []
        partial = False
        try:
            events = self._sse.end_raw()
        except AttemptError:
            events = []  # cut inside a character: the last line is incomplete
            partial = True
        for event in events:
            try:
                delta = self._event(event, final=True)
            except _Partial:
                partial = True
                break
            if delta is not None:
                out.append(delta)
            if self.done:
                return out
        if self.finish_reason is not None:
            return out
        if self.data_events == 0 and not partial:
            raise AttemptError(ErrorKind.EMPTY_STREAM, "the stream ended without a data event")
        raise AttemptError(
            ErrorKind.STREAM_TRUNCATED,
            "the stream ended without [DONE] or a finish reason"
            + (" (inside an event)" if partial else ""),
        )

    # -- internals ----------------------------------------------------------------------

    def _end_json(self) -> list[Delta]:
        self.data_events = 1
        deltas = decode_json_body(200, {}, bytes(self._json), redact=self._redact)
        self.done = True
        for delta in deltas:
            if delta.finish_reason is not None:
                self.finish_reason = delta.finish_reason
            if delta.usage is not None:
                self.usage = delta.usage
        return deltas

    def _event(self, event: RawEvent, final: bool = False) -> Delta | None:
        kind, data = event[0], event[1]
        text = data.strip()
        if not text:
            return None  # empty keep-alive: not an event for first-token purposes
        if text == "[DONE]":
            self.data_events += 1
            self.done = True
            return None
        try:
            obj = _loads(text)
        except ValueError:
            if final:
                raise _Partial from None  # the last event was cut off mid-way
            self.data_events += 1
            if kind == "error":
                raise _in_band_error(text, redact=self._redact, sent=self._sent) from None
            if text[0] == ":":
                return None  # an SSE comment a proxy re-wrapped as data
            raise AttemptError(
                ErrorKind.PROTOCOL,
                f"event data is not JSON: {_truncate(self._redact(text))[:80]!r}",
            ) from None
        self.data_events += 1
        if type(obj) is not dict:
            if kind == "error" or _is_error(obj):
                raise _in_band_error(obj, redact=self._redact, sent=self._sent)
            return None
        if kind == "error" or obj.get("error") or obj.get("object") == "error":
            raise _in_band_error(obj, redact=self._redact, sent=self._sent)
        choices = obj.get("choices")
        if type(choices) is list and len(choices) == 1 and obj.get("usage") is None:
            # Fast path for the per-token shape {"choices":[{"delta":{"content":"…"}}]}.
            choice = choices[0]
            if type(choice) is dict and not choice.get("finish_reason"):
                delta = choice.get("delta")
                if type(delta) is dict and len(delta) == 1 and not choice.get("index"):
                    content = delta.get("content")
                    if type(content) is str and content and "x_groq" not in obj:
                        return Delta(content, raw=text)
        elif obj.get("type") == "error":
            raise _in_band_error(obj, redact=self._redact, sent=self._sent)
        delta = _delta_from(obj, "delta", text)
        if delta is not None:
            if delta.usage is not None and _inexact(delta.usage):
                delta = _delta_from(_json_loads(text), "delta", text)
                assert delta is not None
            if delta.finish_reason is not None:
                self.finish_reason = delta.finish_reason
            if delta.usage is not None:
                self.usage = delta.usage
        return delta


class _Partial(Exception):
    """The final, unterminated event did not parse: the stream was cut inside it."""


def merge_tool_calls(deltas: Iterable[Delta]) -> list[dict[str, Any]]:
    """Assemble streamed tool-call fragments into whole calls, ordered by ``index``.

    Per index: ``id`` is the first non-null id; ``name`` and ``arguments`` are the
    concatenation of their fragments (nulls skipped). Each call is
    ``{"id": str | None, "type": "function", "name": str | None, "arguments": str}``.
    """
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for fragment in delta.tool_calls:
            call = calls.get(fragment.index)
            if call is None:
                call = calls[fragment.index] = {
                    "id": None,
                    "type": "function",
                    "name": None,
                    "arguments": "",
                }
            if fragment.id is not None and call["id"] is None:
                call["id"] = fragment.id
            if fragment.name is not None:
                call["name"] = (call["name"] or "") + fragment.name
            call["arguments"] += fragment.arguments
    return [calls[index] for index in sorted(calls)]
