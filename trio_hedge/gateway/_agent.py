"""``POST /v1/messages`` (Anthropic Messages) and ``POST /v1/responses`` (OpenAI Responses):
the chat route's race (``_forward.py``) in each API's own words.

Each group gets one more [`Hedger`][trio_hedge.Hedger] per API, over the same replicas
speaking that API ([`AnthropicReplica`][trio_hedge.sources.anthropic.AnthropicReplica],
[`ResponsesReplica`][trio_hedge.sources.openai_responses.ResponsesReplica]), so one group of
servers serves all three routes (each API's TTFT is learned on its own). What differs from
chat completions:

* the body is the API's own (a JSON object; ``stream`` a boolean, ``model`` a string; the rest
  is the API's and the replicas' to check; Responses' stateful fields are refused with 400);
* after the commit each of the winner's events is relayed as the server sent it, with its
  ``event:`` line (the SDKs dispatch on it), and the stream ends with the API's own terminal
  event (no ``[DONE]``);
* errors are in the API's shape: Anthropic's ``{"type": "error", "error": {"type", "message"}}``
  (``overloaded`` as 529, as Anthropic answers it, so the SDK raises ``OverloadedError``),
  in-band as ``event: error``; Responses' OpenAI error object, in-band as ``event: error``;
* after a recovery (docs/gateway.md, Streaming) each API goes on with the answer the client
  has (``_continued``): the Responses API's events get the client's response and item ids;
* a non-streamed request is answered with the API's whole JSON: a Message assembled from the
  winner's events, or the Responses API's final response object;
* the client's ``anthropic-version`` and ``anthropic-beta`` headers go upstream, and with
  ``forward_client_key`` its ``x-api-key`` too.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import httpx

from .. import HedgedStream, Hedger, Replica
from ..events import Delta, EventHook
from ..sources.anthropic import AnthropicReplica
from ..sources.openai_responses import ResponsesReplica
from ._config import GatewayConfig
from ._errors import ErrorAnswer
from ._forward import (
    _SSE_HEADERS,
    ChatForwarder,
    Completion,
    Rejected,
    RequestOptions,
    _hedge_headers,
    check_stream_and_model,
    parse_object,
)
from ._http import Exchange
from ._metrics import GatewayMetrics
from ._recovered import event_of, relay_recovered

__all__ = ["agent_forwarder", "agent_hedgers"]

#: The replica class of each API, and its route.
APIS: dict[str, tuple[type[Replica], str]] = {
    "anthropic": (AnthropicReplica, "/v1/messages"),
    "responses": (ResponsesReplica, "/v1/responses"),
}


def as_api(replica: Replica, api: str) -> Replica:
    """``replica`` (a configured chat replica) speaking ``api``: the same URL, key, name,
    overrides, headers, context window, fallback mark, backup priority and probe, the API's
    own path. Not its ``continuation``: the engines' continuation contracts are their chat
    endpoints' (a recovery on another API replays and verifies)."""
    kind, _ = APIS[api]
    return kind(
        replica.base_url,
        api_key=replica.api_key,
        name=replica.name,
        overrides=replica.overrides,
        headers=replica.headers,
        context_window=replica.context_window,
        fallback=replica.fallback,
        backup_priority=replica.backup_priority,
        probe=replica.probe,
    )


def agent_hedgers(
    config: GatewayConfig,
    client: httpx.AsyncClient,
    hooks: Sequence[EventHook],
    chat: Mapping[str, Hedger],
) -> dict[str, dict[str, Hedger]]:
    """Per API, one Hedger per group over the group's replicas speaking that API, sharing
    the fleet state of the group's chat Hedger (``chat``): health, cooldowns, ejections,
    learned delays, the hedge budget, the throttle and the probes' readings belong to the
    (replica, model) and the group, not to the route a request came in on."""
    out: dict[str, dict[str, Hedger]] = {}
    for api in APIS:
        out[api] = {
            group.name: Hedger(
                [as_api(config.replica(name), api) for name in group.replicas],
                group.hedger,
                client=client,
                on_event=list(hooks),
                fleet_of=chat[group.name],
            )
            for group in config.groups
        }
    return out


def _event_name(raw: str) -> str:
    """The ``type`` of one event's JSON text (its first key, as both APIs write it)."""
    if raw.startswith('{"type":"'):
        end = raw.find('"', 9)
        if end > 9:
            return raw[9:end]
    try:
        obj = json.loads(raw)
    except ValueError:
        return "message"
    kind = obj.get("type") if isinstance(obj, dict) else None
    return kind if isinstance(kind, str) and kind else "message"


def typed_event(raw: str, name: str | None = None) -> bytes:
    """One SSE event: ``event: <type>`` and the JSON text as its ``data:``."""
    if "\n" in raw:  # multi-line data: every line needs its own field name
        raw = raw.replace("\n", "\ndata: ")
    return f"event: {name or _event_name(raw)}\ndata: {raw}\n\n".encode()


def _dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# -- errors -----------------------------------------------------------------------------------

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


@attrs.frozen
class AnthropicAnswer(ErrorAnswer):
    """An error in the Anthropic shape."""

    def body(self) -> bytes:
        kind = _ANTHROPIC_TYPES.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error"
        )
        return _dumps({"type": "error", "error": {"type": kind, "message": self.message}}).encode()

    def event(self) -> bytes:
        return typed_event(self.body().decode(), "error")


@attrs.frozen
class ResponsesAnswer(ErrorAnswer):
    """An error in the Responses API's shape (the OpenAI error object; in band as an
    ``error`` event)."""

    def event(self) -> bytes:
        error = json.loads(self.body())["error"]
        return typed_event(_dumps({"type": "error", "error": error, **error}), "error")


# -- non-streamed answers ------------------------------------------------------------------------


class MessageCompletion(Completion):
    """A whole Message assembled from the winner's events (blocks with their signatures,
    citations and tool inputs, usage overlaid as it streams)."""

    def __init__(self) -> None:
        super().__init__()
        self.message: dict[str, Any] = {}
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, str] = {}

    def add(self, delta: Delta) -> None:
        self.deltas.append(delta)
        if delta.raw is None:
            self._split(delta)
            return
        event = json.loads(delta.raw)
        kind, index = event.get("type"), event.get("index")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            self.message = dict(event["message"])
        elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            self._blocks[index] = dict(event["content_block"])
        elif kind == "content_block_delta" and index in self._blocks:
            self._apply(self._blocks[index], index, event.get("delta") or {})
        elif kind == "content_block_stop" and index in self._json:
            # A tool input that does not parse as streamed is left as its block started.
            with contextlib.suppress(ValueError):
                self._blocks[index]["input"] = json.loads(self._json.pop(index) or "{}")
        elif kind == "message_delta":
            for key, value in (event.get("delta") or {}).items():
                self.message[key] = value
            if isinstance(event.get("usage"), dict):
                self.message["usage"] = {**self.message.get("usage", {}), **event["usage"]}

    def _split(self, delta: Delta) -> None:
        """A delta with no event of its own: what follows the prefix a recovery reproduced,
        where it ended inside an event. Its text goes on the open block it continues."""
        for kind, key, text in (
            ("text", "text", delta.content),
            ("thinking", "thinking", delta.reasoning),
        ):
            if not text:
                continue
            open_blocks = [b for b in self._blocks.values() if b.get("type") == kind]
            if open_blocks:
                block = open_blocks[-1]
                block[key] = block.get(key, "") + text

    def _apply(self, block: dict[str, Any], index: int, delta: dict[str, Any]) -> None:
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + delta.get("text", "")
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature", "")
        elif kind == "input_json_delta":
            self._json[index] = self._json.get(index, "") + delta.get("partial_json", "")
        elif kind == "citations_delta":
            block.setdefault("citations", []).append(delta.get("citation"))

    def body(self, request_id: str, model: str | None) -> bytes:
        if not self.message:  # the upstream answered whole: from the deltas
            self.message = {
                "stop_reason": next((d.finish_reason for d in self.deltas if d.finish_reason), None)
            }
            self._blocks = {0: {"type": "text", "text": "".join(d.content for d in self.deltas)}}
        out = {
            "id": f"msg_{request_id}",
            "type": "message",
            "role": "assistant",
            "model": model or "",
            **self.message,
            "content": [self._blocks[i] for i in sorted(self._blocks)],
        }
        out.setdefault("stop_sequence", None)
        return _dumps(out).encode()


class ResponseCompletion(Completion):
    """The Responses API's final response object (its terminal event carries it whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.response: dict[str, Any] | None = None
        # The first response's id and created_at (response.created): after a recovery the
        # final response is the recovery's, and the answer stays the first one.
        self.opening: dict[str, Any] | None = None

    def add(self, delta: Delta) -> None:
        self.deltas.append(delta)
        if self.opening is None:
            response = event_of(delta).get("response")
            self.opening = response if isinstance(response, dict) else {}
        if delta.finish_reason is not None and delta.raw is not None:
            event = json.loads(delta.raw)
            if isinstance(event.get("response"), dict):
                self.response = event["response"]

    def body(self, request_id: str, model: str | None) -> bytes:
        if self.response is not None:
            first: dict[str, Any] = self.opening or {}
            kept: dict[str, Any] = {k: first[k] for k in ("id", "created_at") if k in first}
            answer = {**self.response, **kept}
            return _dumps(answer).encode()
        text = "".join(d.content for d in self.deltas)
        content = [{"type": "output_text", "text": text, "annotations": []}]
        return _dumps(
            {
                "id": f"resp_{request_id}",
                "object": "response",
                "status": "completed",
                "model": model or "",
                "output": [{"type": "message", "role": "assistant", "content": content}],
            }
        ).encode()


# -- the forwarders -----------------------------------------------------------------------------


class AgentForwarder(ChatForwarder):
    """One agent API's route (see the module docstring)."""

    api: ClassVar[str]
    _answer: ClassVar[type[ErrorAnswer]]
    _completion_class: ClassVar[type[Completion]]
    #: Client headers sent upstream (lower-case).
    _forwarded: ClassVar[tuple[bytes, ...]] = ()

    def prepare(
        self, ex: Exchange, body: bytes
    ) -> tuple[dict[str, Any], Any, RequestOptions, bool]:
        try:
            return super().prepare(ex, body)
        except Rejected as rejected:
            raise Rejected(self._style(rejected.answer)) from None

    def _parse(self, body: bytes) -> dict[str, Any]:
        obj = parse_object(body)
        check_stream_and_model(obj)
        return obj

    def _options(self, ex: Exchange) -> RequestOptions:
        options = super()._options(ex)
        headers = dict(options.headers or {})
        secrets = list(options.secrets)
        for name in self._forwarded:
            value = ex.header(name)
            if value is not None:
                headers[name.decode()] = value
        key = ex.header(b"x-api-key")
        if self._config.forward_client_key and key:
            headers["x-api-key"] = key
            secrets.append(key)
        return attrs.evolve(options, headers=headers or None, secrets=tuple(secrets))

    def _upstream(self, request: dict[str, Any], streaming: bool) -> None:
        pass  # upstream always streams (the source adds "stream": true)

    def _completion(self) -> Completion:
        return self._completion_class()

    def _style(self, answer: ErrorAnswer) -> ErrorAnswer:
        return self._answer(
            answer.status,
            answer.message,
            answer.type,
            answer.code,
            answer.param,
            answer.retry_after,
        )

    def _synthesize(self, delta: Delta, first: bool) -> bytes:
        """Events for a delta with no wire form of its own (an upstream that answered
        whole)."""
        raise NotImplementedError

    async def _stream_out(self, ex: Exchange, stream: HedgedStream, model: str | None) -> None:
        """The server's JSON with its ``event:`` line, one ``send`` per read of the winner
        (as the chat route sends)."""
        await ex.start(200, [*_SSE_HEADERS, *_hedge_headers(stream.report)], with_body=True)
        send = ex.send
        first = True
        batches = stream.batches()
        opening = last = None  # the first and the latest events relayed (before any recovery)
        async for batch in batches:
            if stream.recovered:  # another replica goes on: one answer (``_continued``)
                go_on = functools.partial(
                    self._continued, head=event_of(opening), tail=event_of(last)
                )
                await relay_recovered(ex, batch, batches, go_on)
                break
            out = []
            for delta in batch:
                raw = delta.raw
                out.append(typed_event(raw) if raw is not None else self._synthesize(delta, first))
                first = False
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
            opening, last = opening or batch[0], batch[-1]
        await ex.body(b"", more=False)

    def _continued(self, delta: Delta, head: dict[str, Any], tail: dict[str, Any]) -> bytes:
        """A recovery's delta as this API's event(s), going on with the answer the client
        has (``head``, ``tail``: its first and latest events; ``{}`` when unknown)."""
        raise NotImplementedError


class MessagesForwarder(AgentForwarder):
    api = "anthropic"
    _answer = AnthropicAnswer
    _completion_class = MessageCompletion
    _forwarded = (b"anthropic-version", b"anthropic-beta")

    def _style(self, answer: ErrorAnswer) -> ErrorAnswer:
        if answer.status == 503 and answer.code == "overloaded":
            answer = attrs.evolve(answer, status=529)  # Anthropic's overloaded status
        return super()._style(answer)

    def _continued(self, delta: Delta, head: dict[str, Any], tail: dict[str, Any]) -> bytes:
        # The Messages API names the message once (message_start: a replay's is held back
        # with the prefix), so a recovery's events go as they are; the rest of the event the
        # reproduced prefix ended inside goes on the block the client has open.
        if delta.raw is not None:
            return typed_event(delta.raw)
        index = tail.get("index", 0)
        deltas: list[dict[str, Any]] = []
        if delta.reasoning:
            deltas.append({"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            deltas.append({"type": "text_delta", "text": delta.content})
        deltas.extend(
            {"type": "input_json_delta", "partial_json": f.arguments}
            for f in delta.tool_calls
            if f.arguments
        )
        return b"".join(
            typed_event(_dumps({"type": "content_block_delta", "index": index, "delta": d}))
            for d in deltas
        )

    def _synthesize(self, delta: Delta, first: bool) -> bytes:
        message = {"id": "msg", "type": "message", "role": "assistant", "content": []}
        events: list[dict[str, Any]] = []
        if first:
            events.append({"type": "message_start", "message": message})
        events.append(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            }
        )
        events.append(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": delta.content},
            }
        )
        events.append({"type": "content_block_stop", "index": 0})
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": delta.finish_reason},
                "usage": delta.usage or {},
            }
        )
        events.append({"type": "message_stop"})
        return b"".join(typed_event(_dumps(e)) for e in events)


class ResponsesForwarder(AgentForwarder):
    api = "responses"
    _answer = ResponsesAnswer
    _completion_class = ResponseCompletion

    def _continued(self, delta: Delta, head: dict[str, Any], tail: dict[str, Any]) -> bytes:
        # A recovery's response and the item the client has open carry the recovery's own ids:
        # the client's (its response.created, its latest event) instead.
        item_id, index = tail.get("item_id"), tail.get("output_index", 0)
        if delta.raw is None:  # the rest of the event the reproduced prefix ended inside
            if not delta.content:
                return b""
            event: dict[str, Any] = {
                "type": "response.output_text.delta",
                "item_id": item_id or "msg",
                "output_index": index,
                "content_index": tail.get("content_index", 0),
                "delta": delta.content,
            }
            return typed_event(_dumps(event))
        event = event_of(delta)
        if not event:
            return typed_event(delta.raw)
        if item_id is not None and event.get("output_index") == index:
            if "item_id" in event:
                event["item_id"] = item_id
            if isinstance(event.get("item"), dict):
                event["item"] = {**event["item"], "id": item_id}
        first = head.get("response")
        response = event.get("response")
        if isinstance(first, dict) and isinstance(response, dict):
            response = {**response, **{k: first[k] for k in ("id", "created_at") if k in first}}
            output = response.get("output")
            if (
                item_id is not None
                and isinstance(output, list)
                and index < len(output)
                and isinstance(output[index], dict)
            ):
                output = [*output]
                output[index] = {**output[index], "id": item_id}
                response["output"] = output
            event["response"] = response
        return typed_event(_dumps(event))

    def _synthesize(self, delta: Delta, first: bool) -> bytes:
        response = {"id": "resp", "object": "response", "status": "completed", "usage": delta.usage}
        events = [
            {
                "type": "response.output_text.delta",
                "item_id": "msg",
                "output_index": 0,
                "content_index": 0,
                "delta": delta.content,
            },
            {"type": "response.completed", "response": response},
        ]
        return b"".join(typed_event(_dumps(e)) for e in events)


_FORWARDERS: dict[str, type[AgentForwarder]] = {
    "anthropic": MessagesForwarder,
    "responses": ResponsesForwarder,
}


def agent_forwarder(
    api: str,
    config: GatewayConfig,
    hedgers: Mapping[str, Hedger],
    metrics: GatewayMetrics,
    secrets: Sequence[str],
) -> tuple[str, ChatForwarder]:
    """The route and forwarder of ``api`` over its Hedgers (one per group)."""
    return APIS[api][1], _FORWARDERS[api](config, hedgers, metrics, secrets)
