"""What each API's answer looks like on the wire, for the fake replicas: chat completions
(``/v1/chat/completions``), Anthropic Messages (``/v1/messages``) and OpenAI Responses
(``/v1/responses``). The renderer (``._behaviour``) decides *when* each piece goes out; a wire
says what its bytes are. A wire keeps the state of one answer (the open block or item)."""

from __future__ import annotations

import http
import json
from typing import Any

__all__ = ["MALFORMED", "ChatWire", "MessagesWire", "ResponsesWire", "Wire", "sse_event"]


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse_event(payload: object) -> bytes:
    """One SSE data event: ``data: <compact JSON>`` and a blank line."""
    return b"data: " + dumps(payload) + b"\n\n"


def typed_event(payload: dict[str, Any]) -> bytes:
    """One SSE event named by its ``type`` (``event: …`` then ``data: …``)."""
    name: str = payload["type"]
    return b"event: " + name.encode() + b"\n" + sse_event(payload)


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"


def openai_error(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object a status implies (chat completions and Responses); ``code``
    replaces the status's own."""
    kind, default_code = {
        401: ("invalid_request_error", "invalid_api_key"),
        403: ("permission_error", None),
        404: ("invalid_request_error", "not_found"),
        429: ("requests", "rate_limit_exceeded"),
        503: ("server_error", "overloaded"),
    }.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
    return {
        "error": {
            "message": message or f"{_phrase(status)} (fake replica)",
            "type": kind,
            "param": None,
            "code": code if code is not None else default_code,
        }
    }


#: The data event a malformed stream sends (`Behaviour.malformed_after`): not JSON.
MALFORMED = b'data: {"choices": [\n\n'


class Wire:
    """One answer's bytes. ``ident`` names the answer, ``model`` is echoed back."""

    def __init__(self, ident: str, model: str, created: int) -> None:
        self.ident, self.model, self.created = ident, model, created

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        return openai_error(status, message)

    def context_error(self, window: int, size: int) -> dict[str, Any]:
        """The 400 body for a request of ``size`` tokens over a ``window``-token context
        (vLLM's wording, OpenAI's ``context_length_exceeded`` code)."""
        message = (
            f"This model's maximum context length is {window} tokens. However, you "
            f"requested {size} tokens. Please reduce the length of the messages or completion."
        )
        return openai_error(400, message, code="context_length_exceeded")

    def malformed(self) -> bytes:
        """An event whose data is not JSON, as a proxy that mangles a stream sends."""
        return MALFORMED

    def start(self) -> list[bytes]:
        """The events sent with the headers (before the first token: never one)."""
        raise NotImplementedError

    def reasoning(self, text: str) -> bytes:
        raise NotImplementedError

    def content(self, text: str) -> bytes:
        raise NotImplementedError

    def tool_fragments(self, calls: tuple[tuple[str, str], ...]) -> list[bytes]:
        """Per call: its id and name, then its arguments in two pieces (one write each)."""
        raise NotImplementedError

    def inband_error(self, status: int, message: str) -> bytes:
        raise NotImplementedError

    def finish(self, reason: str, usage: dict[str, int] | None, *, end: bool) -> list[bytes]:
        """The end of a complete answer (``end``: with the API's terminal event)."""
        raise NotImplementedError

    def whole(
        self,
        text: str,
        reasoning: str,
        calls: tuple[tuple[str, str], ...],
        reason: str,
        usage: dict[str, int] | None,
    ) -> dict[str, Any]:
        """The non-streamed answer."""
        raise NotImplementedError


def _halves(arguments: str) -> tuple[str, str]:
    half = len(arguments) // 2
    return arguments[:half], arguments[half:]


class ChatWire(Wire):
    """``chat.completion.chunk`` events, ``data: [DONE]`` at the end."""

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse_event(
            {
                "id": self.ident,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )

    def start(self) -> list[bytes]:
        return [self._chunk({"role": "assistant"})]

    def reasoning(self, text: str) -> bytes:
        return self._chunk({"reasoning_content": text})

    def content(self, text: str) -> bytes:
        return self._chunk({"content": text})

    def tool_fragments(self, calls: tuple[tuple[str, str], ...]) -> list[bytes]:
        out = []
        for i, (name, arguments) in enumerate(calls):
            head = {"index": i, "id": f"call_{i}", "type": "function"}
            out.append(
                self._chunk({"tool_calls": [{**head, "function": {"name": name, "arguments": ""}}]})
            )
            for piece in _halves(arguments):
                out.append(
                    self._chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                )
        return out

    def inband_error(self, status: int, message: str) -> bytes:
        return sse_event(openai_error(status, message))

    def finish(self, reason: str, usage: dict[str, int] | None, *, end: bool) -> list[bytes]:
        out = [self._chunk({}, reason)]
        if usage is not None:
            out.append(
                sse_event(
                    {
                        "id": self.ident,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": usage,
                    }
                )
            )
        if end:
            out.append(b"data: [DONE]\n\n")
        return out

    def whole(
        self,
        text: str,
        reasoning: str,
        calls: tuple[tuple[str, str], ...],
        reason: str,
        usage: dict[str, int] | None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["content"] = message["content"] or None
            message["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)
            ]
        body: dict[str, Any] = {
            "id": self.ident,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": reason}],
        }
        if usage is not None:
            body["usage"] = usage
        return body


#: Chat finish reasons in the other APIs' words.
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def _anthropic_usage(usage: dict[str, int] | None) -> dict[str, int]:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}


class MessagesWire(Wire):
    """Anthropic Messages events: ``message_start``, a ``ping``, one content block per kind
    (thinking, text, each tool_use), ``message_delta``, ``message_stop``."""

    def __init__(self, ident: str, model: str, created: int) -> None:
        super().__init__(ident.replace("chatcmpl", "msg"), model, created)
        self._block = -1
        self._open: str | None = None

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        kind = _ANTHROPIC_ERRORS.get(
            status, "invalid_request_error" if status < 500 else "api_error"
        )
        return {
            "type": "error",
            "error": {"type": kind, "message": message or f"{_phrase(status)} (fake replica)"},
        }

    def context_error(self, window: int, size: int) -> dict[str, Any]:
        return self.error_body(400, f"prompt is too long: {size} tokens > {window} maximum")

    def malformed(self) -> bytes:
        return b'event: content_block_delta\ndata: {"type": "content_block_delta", \n\n'

    def _switch(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._block += 1
        self._open = kind
        event = {"type": "content_block_start", "index": self._block, "content_block": block}
        return [*out, typed_event(event)]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [typed_event({"type": "content_block_stop", "index": self._block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return typed_event({"type": "content_block_delta", "index": self._block, "delta": delta})

    def start(self) -> list[bytes]:
        message: dict[str, Any] = {
            "id": self.ident,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 1},
        }
        return [
            typed_event({"type": "message_start", "message": message}),
            typed_event({"type": "ping"}),
        ]

    def reasoning(self, text: str) -> bytes:
        head = (
            []
            if self._open == "thinking"
            else self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        )
        return b"".join([*head, self._delta({"type": "thinking_delta", "thinking": text})])

    def content(self, text: str) -> bytes:
        head = [] if self._open == "text" else self._switch("text", {"type": "text", "text": ""})
        return b"".join([*head, self._delta({"type": "text_delta", "text": text})])

    def tool_fragments(self, calls: tuple[tuple[str, str], ...]) -> list[bytes]:
        out = []
        for i, (name, arguments) in enumerate(calls):
            block = {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {}}
            out.append(b"".join(self._switch("tool_use", block)))
            for piece in _halves(arguments):
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        return out

    def inband_error(self, status: int, message: str) -> bytes:
        return typed_event(self.error_body(status, message))

    def finish(self, reason: str, usage: dict[str, int] | None, *, end: bool) -> list[bytes]:
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": _STOP_REASONS.get(reason, reason), "stop_sequence": None},
            "usage": {"output_tokens": _anthropic_usage(usage)["output_tokens"]},
        }
        out = [*self._close(), typed_event(delta)]
        if end:
            out.append(typed_event({"type": "message_stop"}))
        return out

    def whole(
        self,
        text: str,
        reasoning: str,
        calls: tuple[tuple[str, str], ...],
        reason: str,
        usage: dict[str, int] | None,
    ) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": "sig"})
        if text:
            content.append({"type": "text", "text": text})
        for i, (name, arguments) in enumerate(calls):
            content.append(
                {
                    "type": "tool_use",
                    "id": f"toolu_{i}",
                    "name": name,
                    "input": json.loads(arguments or "{}"),
                }
            )
        return {
            "id": self.ident,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": _STOP_REASONS.get(reason, reason),
            "stop_sequence": None,
            "usage": _anthropic_usage(usage),
        }


def _responses_usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


class ResponsesWire(Wire):
    """OpenAI Responses events: ``response.created``, ``response.in_progress``, one item per
    kind (reasoning, message, each function_call) with its deltas, ``response.completed``
    (``response.incomplete`` for a ``length`` finish)."""

    def __init__(self, ident: str, model: str, created: int) -> None:
        super().__init__(ident.replace("chatcmpl", "resp"), model, created)
        self._items: list[dict[str, Any]] = []  # the output so far, as the final response has it
        self._open: str | None = None
        self._seq = 0

    def malformed(self) -> bytes:
        return b'event: response.output_text.delta\ndata: {"type": "response.output\n\n'

    def _event(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self._seq
        self._seq += 1
        return typed_event(payload)

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        return {
            "id": self.ident,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
            # (Required of every response object by the API's types.)
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            **extra,
        }

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1}

    def _switch(self, kind: str, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._open = kind
        item = {"id": f"item_{self.ident}_{len(self._items)}", **item, "status": "in_progress"}
        self._items.append(item)
        added = {"type": "response.output_item.added", "output_index": len(self._items) - 1}
        return [*out, self._event({**added, "item": json.loads(json.dumps(item))})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        item = self._items[-1]
        item["status"] = "completed"
        done = {"type": "response.output_item.done", "output_index": len(self._items) - 1}
        return [self._event({**done, "item": json.loads(json.dumps(item))})]

    def start(self) -> list[bytes]:
        return [
            self._event({"type": "response.created", "response": self._response("in_progress")}),
            self._event(
                {"type": "response.in_progress", "response": self._response("in_progress")}
            ),
        ]

    def reasoning(self, text: str) -> bytes:
        head: list[bytes] = []
        if self._open != "reasoning":
            head = self._switch("reasoning", {"type": "reasoning", "summary": []})
            self._items[-1]["summary"].append({"type": "summary_text", "text": ""})
            part = {"type": "summary_text", "text": ""}
            added = {"type": "response.reasoning_summary_part.added", "summary_index": 0}
            head.append(self._event({**added, **self._where(), "part": part}))
        self._items[-1]["summary"][0]["text"] += text
        delta = {"type": "response.reasoning_summary_text.delta", "summary_index": 0}
        return b"".join([*head, self._event({**delta, **self._where(), "delta": text})])

    def content(self, text: str) -> bytes:
        head: list[bytes] = []
        if self._open != "message":
            item = {"type": "message", "role": "assistant", "content": []}
            head = self._switch("message", item)
            part = {"type": "output_text", "text": "", "annotations": []}
            self._items[-1]["content"].append(dict(part))
            added = {"type": "response.content_part.added", "content_index": 0, "part": part}
            head.append(self._event({**added, **self._where()}))
        self._items[-1]["content"][0]["text"] += text
        delta = {"type": "response.output_text.delta", "content_index": 0, "logprobs": []}
        return b"".join([*head, self._event({**delta, **self._where(), "delta": text})])

    def tool_fragments(self, calls: tuple[tuple[str, str], ...]) -> list[bytes]:
        out = []
        for i, (name, arguments) in enumerate(calls):
            item = {"type": "function_call", "call_id": f"call_{i}", "name": name, "arguments": ""}
            out.append(b"".join(self._switch("function_call", item)))
            for piece in _halves(arguments):
                self._items[-1]["arguments"] += piece
                delta = {"type": "response.function_call_arguments.delta", "delta": piece}
                out.append(self._event({**delta, **self._where()}))
        return out

    def inband_error(self, status: int, message: str) -> bytes:
        code = {
            429: "rate_limit_exceeded",
            503: "server_is_overloaded",
            529: "server_is_overloaded",
        }.get(status, "server_error")
        error = {"code": code, "message": message or f"{_phrase(status)} (fake replica)"}
        return self._event(
            {"type": "response.failed", "response": self._response("failed", error=error)}
        )

    def finish(self, reason: str, usage: dict[str, int] | None, *, end: bool) -> list[bytes]:
        out = self._close()
        if end:
            if reason == "length":
                response = self._response(
                    "incomplete",
                    incomplete_details={"reason": "max_output_tokens"},
                    usage=_responses_usage(usage),
                    output=self._items,
                )
                out.append(self._event({"type": "response.incomplete", "response": response}))
            else:
                response = self._response(
                    "completed", usage=_responses_usage(usage), output=self._items
                )
                out.append(self._event({"type": "response.completed", "response": response}))
        return out

    def whole(
        self,
        text: str,
        reasoning: str,
        calls: tuple[tuple[str, str], ...],
        reason: str,
        usage: dict[str, int] | None,
    ) -> dict[str, Any]:
        output: list[dict[str, Any]] = []
        if reasoning:
            output.append(
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": reasoning}]}
            )
        if text:
            output.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text}],
                }
            )
        for i, (name, arguments) in enumerate(calls):
            output.append(
                {
                    "type": "function_call",
                    "call_id": f"call_{i}",
                    "name": name,
                    "arguments": arguments,
                }
            )
        status = "incomplete" if reason == "length" else "completed"
        details = {"reason": "max_output_tokens"} if reason == "length" else None
        return self._response(
            status, output=output, usage=_responses_usage(usage), incomplete_details=details
        )
