"""The Anthropic Messages API (``POST /v1/messages``) over httpx, as Anthropic, Bedrock and
Vertex relays and Anthropic-compatible servers (vLLM, llama.cpp, LiteLLM) serve it.

- [`AnthropicReplica`][trio_hedge.sources.anthropic.AnthropicReplica]: a
  [`Replica`][trio_hedge.sources.Replica] that speaks this API (``x-api-key``,
  ``anthropic-version``, ``/messages``); the request is the Messages JSON body.
- [`AnthropicSource`][trio_hedge.sources.anthropic.AnthropicSource]: one request bound to one
  such replica (the transport, errors and redaction of the chat source).
- [`MessagesDecoder`][trio_hedge.sources.anthropic.MessagesDecoder]: response bytes in,
  [`Delta`][trio_hedge.events.Delta]s out.

What the events mean (``message_start`` … ``message_stop``):

* ``text_delta`` is answer text (``content``); ``thinking_delta`` is ``reasoning``; a
  ``tool_use`` block is one tool call: its start gives a
  [`ToolCallDelta`][trio_hedge.events.ToolCallDelta] with the id and name (``index`` counts
  ``tool_use`` blocks from 0), each ``input_json_delta`` an arguments fragment (an ``input``
  given whole in the start, with no fragment, comes at the block's stop). Empty deltas are
  not tokens. ``server_tool_use`` blocks run at Anthropic: not tool calls for the caller.
* ``signature_delta``, ``citations_delta``, block starts and stops carry no output: their
  Delta has only ``raw`` (the event's JSON), which is where a caller finds the signature.
* ``ping`` is a keep-alive (never a token, never progress).
* Usage is ``message_start``'s, overlaid key by key by each ``message_delta``'s (cumulative
  counts: replaced, never added); the finish reason is ``message_delta``'s ``stop_reason``
  (``end_turn``, ``tool_use``, ``max_tokens``…).
* Complete at ``message_stop``; leniently also when the body ends cleanly right after a
  ``message_delta`` with a stop reason (some proxies drop ``message_stop``). Otherwise
  ``STREAM_TRUNCATED`` (``EMPTY_STREAM`` when only pings came).
* ``error`` events (``overloaded_error`` after a 200, the in-band form of HTTP 529;
  ``api_error``; vLLM's ``internal_error``…) are terminal and classified like HTTP errors:
  ``overloaded_error`` → overloaded, ``rate_limit_error`` → rate limit, ``api_error`` and
  unknown types → server error, ``invalid_request_error`` → invalid request (context
  overflow and an exhausted credit balance told apart by their message),
  ``authentication_error`` / ``permission_error`` → auth, ``not_found_error`` → not found,
  ``request_too_large`` → invalid request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from .._validate import check_header_value
from ..events import Delta, ToolCallDelta
from ._event_stream import EventDecoder, decode_whole
from .openai._errors import Redact, _in_band_error, _no_redact
from .openai._http import HTTPSource, Replica, _check_path
from .openai._sse import DEFAULT_MAX_EVENT_SIZE

__all__ = ["AnthropicReplica", "AnthropicSource", "MessagesDecoder"]

#: The ``anthropic-version`` sent by default (the only version of the Messages API).
DEFAULT_VERSION = "2023-06-01"


class MessagesDecoder(EventDecoder):
    """Per-response decoder of a Messages event stream (the rules are the module's).

    Args:
        max_event_size: bound on one SSE event (characters).
        redact: masks secrets the server quoted back in an error event.
        sent: the request's body, whose words an error event may quote back: they never
            make the error the replica's (see
            [`classify_http_error`][trio_hedge.sources.openai.classify_http_error]; default
            empty).

    Attributes:
        done: ``message_stop`` was seen.
        data_events: data events seen (pings and errors count).
        error: the [`AttemptError`][trio_hedge.AttemptError] raised or to be raised next.
        finish_reason: the last ``stop_reason``, or ``None``.
        usage: the usage so far (``message_start``'s overlaid by ``message_delta``'s).
    """

    __slots__ = ("_calls", "_inputs", "_stopped")

    KEEPALIVE_TYPES: ClassVar[frozenset[str]] = frozenset({"ping"})
    TERMINAL: ClassVar[str] = "message_stop"

    def __init__(
        self,
        max_event_size: int = DEFAULT_MAX_EVENT_SIZE,
        *,
        redact: Redact = _no_redact,
        sent: bytes = b"",
    ) -> None:
        super().__init__(max_event_size, redact=redact, sent=sent)
        self._calls: dict[Any, int] = {}  # block index -> tool call index
        self._inputs: dict[Any, Any] = {}  # block index -> input given whole, no fragment yet
        self._stopped = False  # the last event was a message_delta with a stop reason

    def _typed_event(self, kind: str, obj: dict[str, Any], raw: str) -> Delta | None:
        self._stopped = False
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if type(delta) is not dict:
                return Delta(raw=raw)
            dtype = delta.get("type")
            if dtype == "text_delta":
                text = delta.get("text")
                if type(text) is str and text:
                    return Delta(text, raw=raw)
            elif dtype == "thinking_delta":
                text = delta.get("thinking")
                if type(text) is str and text:
                    return Delta(reasoning=text, raw=raw)
            elif dtype == "input_json_delta":
                block = obj.get("index")
                call = self._calls.get(block)
                fragment = delta.get("partial_json")
                if call is not None and type(fragment) is str and fragment:
                    self._inputs.pop(block, None)
                    return Delta(tool_calls=(ToolCallDelta(call, arguments=fragment),), raw=raw)
            return Delta(raw=raw)
        if kind == "content_block_start":
            return self._block_start(obj, raw)
        if kind == "content_block_stop":
            given = self._inputs.pop(obj.get("index"), None)
            if given is not None:
                call = self._calls[obj.get("index")]
                arguments = json.dumps(given, ensure_ascii=False)
                return Delta(tool_calls=(ToolCallDelta(call, arguments=arguments),), raw=raw)
            return Delta(raw=raw)
        if kind == "message_delta":
            return self._message_delta(obj, raw)
        if kind == "message_start":
            message = obj.get("message")
            role = "assistant"
            if type(message) is dict:
                usage = message.get("usage")
                if type(usage) is dict:
                    self.usage = dict(usage)
                if type(message.get("role")) is str and message["role"]:
                    role = message["role"]
            return Delta(role=role, usage=self.usage, raw=raw)
        if kind == "message_stop":
            self.done = True
            return Delta(raw=raw)
        if kind == "error":
            raise _in_band_error(obj, redact=self._redact, sent=self._sent)
        return Delta(raw=raw)  # an unknown event: relayed, never an error

    def _block_start(self, obj: dict[str, Any], raw: str) -> Delta:
        block = obj.get("content_block")
        if type(block) is not dict:
            return Delta(raw=raw)
        btype = block.get("type")
        if btype == "text":
            text = block.get("text")
            if type(text) is str and text:
                return Delta(text, raw=raw)
        elif btype == "thinking":
            text = block.get("thinking")
            if type(text) is str and text:
                return Delta(reasoning=text, raw=raw)
        elif btype == "tool_use":
            index = obj.get("index")
            call = self._calls[index] = len(self._calls)
            given = block.get("input")
            if type(given) is dict and given:
                self._inputs[index] = given
            call_id, name = block.get("id"), block.get("name")
            fragment = ToolCallDelta(
                call,
                call_id if type(call_id) is str and call_id else None,
                name if type(name) is str and name else None,
            )
            return Delta(tool_calls=(fragment,), raw=raw)
        return Delta(raw=raw)

    def _message_delta(self, obj: dict[str, Any], raw: str) -> Delta:
        finish = None
        delta = obj.get("delta")
        if type(delta) is dict:
            reason = delta.get("stop_reason")
            if type(reason) is str and reason:
                finish = self.finish_reason = reason
                self._stopped = True
        usage = obj.get("usage")
        if type(usage) is dict:
            self.usage = {**(self.usage or {}), **usage}
        return Delta(finish_reason=finish, usage=self.usage, raw=raw)

    def _complete_at_eof(self) -> bool:
        return self._stopped

    def _whole(self, body: bytes) -> list[Delta]:
        return decode_message_body(200, {}, body, redact=self._redact)


def _message_answer(obj: dict[str, Any]) -> list[Delta] | None:
    """The one Delta of a whole (non-streamed) Message."""
    content = obj.get("content")
    if obj.get("type") != "message" and type(content) is not list:
        return None
    text: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCallDelta] = []
    for block in content if type(content) is list else ():
        if type(block) is not dict:
            continue
        btype = block.get("type")
        if btype == "text" and type(block.get("text")) is str:
            text.append(block["text"])
        elif btype == "thinking" and type(block.get("thinking")) is str:
            thinking.append(block["thinking"])
        elif btype == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                ToolCallDelta(
                    len(calls),
                    call_id if type(call_id) is str else None,
                    name if type(name) is str else None,
                    arguments,
                )
            )
    reason = obj.get("stop_reason")
    usage = obj.get("usage")
    return [
        Delta(
            "".join(text),
            "".join(thinking),
            tuple(calls),
            reason if type(reason) is str and reason else None,
            usage if type(usage) is dict else None,
            "assistant",
        )
    ]


def decode_message_body(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    redact: Redact = _no_redact,
    sent: bytes = b"",
) -> list[Delta]:
    """Decode a whole ``application/json`` answer to a streaming Messages request: an error
    raises its classified [`AttemptError`][trio_hedge.AttemptError]; a Message (the server
    ignored ``stream: true``) becomes one Delta."""
    return decode_whole(
        status,
        headers,
        body,
        redact=redact,
        sent=sent,
        stream=lambda size: MessagesDecoder(size, redact=redact, sent=sent),
        answer=_message_answer,
        what="a message",
    )


def _check_version(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_header_value(value, attribute.name, allow_empty=False)


@attrs.frozen
class AnthropicReplica(Replica):
    """An endpoint of the Anthropic Messages API (Anthropic, a relay, or an
    Anthropic-compatible server such as vLLM or llama.cpp's ``llama-server``).

    The request is the Messages JSON body (``model``, ``max_tokens``, ``messages``, …);
    ``"stream": true`` is added. Every field of [`Replica`][trio_hedge.sources.Replica] works
    the same, except:

    Attributes:
        base_url: e.g. ``"https://api.anthropic.com/v1"``; the attempt posts to
            ``{base_url}/messages``.
        api_key: sent as ``x-api-key`` (never shown in reprs, reports, logs or errors).
            Default ``None`` (no header; an ``Authorization`` header in ``headers`` works
            for servers that take a bearer token).
        anthropic_version: the ``anthropic-version`` header. Default ``"2023-06-01"``; a
            request's own header (the gateway forwards the client's) replaces it.
        path: default ``"/messages"``.

    Raises:
        TypeError, ValueError: as [`Replica`][trio_hedge.sources.Replica]; also both
            ``api_key`` and an ``x-api-key`` header, or a bad ``anthropic_version``.
    """

    path: str = attrs.field(default="/messages", validator=_check_path, kw_only=True)
    anthropic_version: str = attrs.field(
        default=DEFAULT_VERSION, validator=_check_version, kw_only=True
    )

    api: ClassVar[str] = "anthropic"
    _key_header: ClassVar[str] = "x-api-key"

    def _key_headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"x-api-key": self.api_key}

    def _default_headers(self) -> dict[str, str]:
        return {**super()._default_headers(), "anthropic-version": self.anthropic_version}

    def check_request(self, request: object) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``request`` is a Messages JSON body (a
        mapping that encodes to strict JSON); the message names the field, never the
        value. The front doors call it before any I/O."""
        if not isinstance(request, Mapping):
            raise TypeError("request must be the Messages JSON body (a mapping)")
        super().check_request(request)


class AnthropicSource(HTTPSource):
    """One Messages request bound to one
    [`AnthropicReplica`][trio_hedge.sources.anthropic.AnthropicReplica] over one
    ``httpx.AsyncClient``."""

    _stream_decoder = MessagesDecoder
    _whole_decoder = staticmethod(decode_message_body)
    _continue_limits = ("max_tokens",)


AnthropicReplica._source_class = AnthropicSource
