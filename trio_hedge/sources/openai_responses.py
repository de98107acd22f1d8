"""The OpenAI Responses API (``POST /v1/responses``) over httpx, as OpenAI, Azure OpenAI and
compatible servers (vLLM, llama.cpp, LiteLLM, Ollama) serve it.

- [`ResponsesReplica`][trio_hedge.sources.openai_responses.ResponsesReplica]: a
  [`Replica`][trio_hedge.sources.Replica] that speaks this API (``/responses``); the request is
  the Responses JSON body.
- [`ResponsesSource`][trio_hedge.sources.openai_responses.ResponsesSource]: one request bound
  to one such replica (the transport, errors and redaction of the chat source).
- [`ResponsesDecoder`][trio_hedge.sources.openai_responses.ResponsesDecoder]: response bytes
  in, [`Delta`][trio_hedge.events.Delta]s out.

What the events mean:

* ``response.output_text.delta`` is answer text (``content``); the copies in
  ``output_text.done``, ``content_part.done``, ``output_item.done`` and the final response are
  not appended again (an item whose text came with no delta at all gets its
  ``output_text.done`` text as one token). ``response.reasoning_summary_text.delta`` and
  ``response.reasoning_text.delta`` are ``reasoning``.
* A ``function_call`` item is one tool call: ``response.output_item.added`` gives a
  [`ToolCallDelta`][trio_hedge.events.ToolCallDelta] with its ``call_id`` and name (``index``
  counts function calls from 0), each ``response.function_call_arguments.delta`` an arguments
  fragment, joined by ``item_id`` (the ``.done`` string only when no fragment came).
* ``response.created``, ``response.in_progress``, ``response.queued``, item and part
  announcements carry no output: their Delta has only ``raw``. Keep-alive events are
  dropped.
* Terminal events: ``response.completed`` (finish reason ``"completed"``, usage),
  ``response.incomplete`` (a well-formed end that did not finish: finish reason
  ``incomplete_details.reason``, e.g. ``max_output_tokens``, ``content_filter``; so is a
  ``response.completed`` whose response has ``status: "incomplete"``, as vLLM sends a
  response cut by ``max_output_tokens``), ``response.failed`` (raises the classified
  ``response.error``: ``rate_limit_exceeded``, ``server_error``,
  ``context_length_exceeded``…) and ``error`` (raises its fields, nested under ``error`` or
  flat). A stream that ends before one is ``STREAM_TRUNCATED``
  (``EMPTY_STREAM`` when nothing came).

Stateful requests, which create server-side state per attempt, are not blindly duplicated
(``docs/agent-apis.md``): ``background: true`` and ``conversation`` are refused before any
I/O; with ``previous_response_id`` a replica that does not hold the previous response fails
alone (``previous_response_not_found`` is the replica's fault, not the request's); with
``store`` on (the API's default) the stored response of each attempt that closes before its
end without having sent answer text -- every loser -- is deleted
(``DELETE {base_url}/responses/{id}``, best effort, within the close's bound).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import httpx
import trio

from .._redact import Redactor
from ..events import Delta, ToolCallDelta
from ._event_stream import EventDecoder, decode_whole
from .openai._errors import Redact, _in_band_error, _no_redact
from .openai._http import (
    HeaderNames,
    HTTPAttempt,
    HTTPSource,
    Replica,
    TransportErrors,
    _check_path,
)
from .openai._sse import DEFAULT_MAX_EVENT_SIZE

__all__ = ["ResponsesDecoder", "ResponsesReplica", "ResponsesSource"]

#: How long deleting a loser's stored response may take (seconds), within the close's own
#: bound (``HedgePolicy.close_timeout``).
CLEANUP_TIMEOUT = 1.0

_TEXT_DELTA = "response.output_text.delta"
_REASONING_DELTAS = frozenset(
    {"response.reasoning_summary_text.delta", "response.reasoning_text.delta"}
)


def _str(value: Any) -> str | None:
    return value if type(value) is str and value else None


class ResponsesDecoder(EventDecoder):
    """Per-response decoder of a Responses event stream (the rules are the module's).

    Args:
        max_event_size: bound on one SSE event (characters).
        redact: masks secrets the server quoted back in an error event.
        sent: the request's body, whose words an error event may quote back: they never
            make the error the replica's (see
            [`classify_http_error`][trio_hedge.sources.openai.classify_http_error]; default
            empty).

    Attributes:
        done: a terminal event (``response.completed`` / ``incomplete``) was seen.
        data_events: data events seen (keep-alives and errors count).
        error: the [`AttemptError`][trio_hedge.AttemptError] raised or to be raised next.
        finish_reason: ``"completed"``, the ``incomplete_details`` reason of an incomplete
            response, or ``None``.
        usage: the terminal response's usage, or ``None``.
        response_id: the response's id (from ``response.created``), or ``None``.
        sent_text: whether any answer text was decoded.
    """

    __slots__ = ("_args", "_calls", "_text_item", "_text_items", "response_id", "sent_text")

    KEEPALIVE_TYPES: ClassVar[frozenset[str]] = frozenset(
        {"keepalive", "response.keepalive", "ping"}
    )
    TERMINAL: ClassVar[str] = "response.completed"

    def __init__(
        self,
        max_event_size: int = DEFAULT_MAX_EVENT_SIZE,
        *,
        redact: Redact = _no_redact,
        sent: bytes = b"",
    ) -> None:
        super().__init__(max_event_size, redact=redact, sent=sent)
        self._calls: dict[Any, int] = {}  # function_call item id -> tool call index
        self._args: set[Any] = set()  # function_call items whose arguments came
        self._text_items: set[Any] = set()  # items whose text came as deltas
        self._text_item: Any = None  # the last of them (the hot path skips the set)
        self.response_id: str | None = None
        self.sent_text = False

    def _typed_event(self, kind: str, obj: dict[str, Any], raw: str) -> Delta | None:
        if kind == _TEXT_DELTA:
            text = obj.get("delta")
            item = obj.get("item_id")
            if item != self._text_item:
                self._text_item = item
                self._text_items.add(item)
            if type(text) is str and text:
                self.sent_text = True
                return Delta(text, raw=raw)
            return Delta(raw=raw)
        if kind in _REASONING_DELTAS:
            text = obj.get("delta")
            return Delta(reasoning=text if type(text) is str else "", raw=raw)
        if kind == "response.function_call_arguments.delta":
            fragment = obj.get("delta")
            if type(fragment) is str and fragment:
                item = obj.get("item_id")
                self._args.add(item)
                return Delta(
                    tool_calls=(ToolCallDelta(self._call(item), arguments=fragment),), raw=raw
                )
            return Delta(raw=raw)
        if kind == "response.output_item.added" or kind == "response.output_item.done":
            return self._item(obj, raw, added=kind.endswith("added"))
        if kind == "response.function_call_arguments.done":
            item = obj.get("item_id")
            return Delta(tool_calls=self._whole_arguments(item, obj.get("arguments")), raw=raw)
        if kind == "response.output_text.done":
            text = _str(obj.get("text"))
            if text is not None and obj.get("item_id") not in self._text_items:
                self._text_items.add(obj.get("item_id"))
                self.sent_text = True
                return Delta(text, raw=raw)
            return Delta(raw=raw)
        if kind in ("response.created", "response.in_progress", "response.queued"):
            response = obj.get("response")
            if type(response) is dict and self.response_id is None:
                self.response_id = _str(response.get("id"))
            return Delta(raw=raw)
        if kind == "response.completed" or kind == "response.incomplete":
            return self._terminal(kind, obj, raw)
        if kind == "response.failed":
            response = obj.get("response")
            error = response.get("error") if type(response) is dict else None
            raise _in_band_error(
                {"error": error} if type(error) is dict else "the response failed",
                redact=self._redact,
                sent=self._sent,
            )
        if kind == "error":
            raise _in_band_error(obj, redact=self._redact, sent=self._sent)
        return Delta(raw=raw)  # an unknown event: relayed, never an error

    def _call(self, item: Any) -> int:
        call = self._calls.get(item)
        if call is None:
            call = self._calls[item] = len(self._calls)
        return call

    def _whole_arguments(self, item: Any, arguments: Any) -> tuple[ToolCallDelta, ...]:
        """The whole arguments of a call none of whose fragments came, else nothing."""
        if item in self._args or type(arguments) is not str or not arguments:
            return ()
        self._args.add(item)
        return (ToolCallDelta(self._call(item), arguments=arguments),)

    def _item(self, obj: dict[str, Any], raw: str, *, added: bool) -> Delta:
        item = obj.get("item")
        if type(item) is not dict or item.get("type") != "function_call":
            return Delta(raw=raw)
        item_id = item.get("id")
        if added or item_id not in self._calls:
            fragment = ToolCallDelta(
                self._call(item_id), _str(item.get("call_id")), _str(item.get("name"))
            )
            rest = self._whole_arguments(item_id, item.get("arguments"))
            if rest:
                fragment = attrs.evolve(fragment, arguments=rest[0].arguments)
            return Delta(tool_calls=(fragment,), raw=raw)
        return Delta(tool_calls=self._whole_arguments(item_id, item.get("arguments")), raw=raw)

    def _terminal(self, kind: str, obj: dict[str, Any], raw: str) -> Delta:
        self.done = True
        response = obj.get("response")
        if type(response) is not dict:
            response = {}
        if self.response_id is None:
            self.response_id = _str(response.get("id"))
        usage = response.get("usage")
        if type(usage) is dict:
            self.usage = usage
        # vLLM ends a response cut by max_output_tokens with response.completed whose status
        # is "incomplete" (OpenAI sends response.incomplete): the status says which it is.
        if kind == "response.completed" and response.get("status") != "incomplete":
            self.finish_reason = "completed"
        else:
            details = response.get("incomplete_details")
            reason = details.get("reason") if type(details) is dict else None
            self.finish_reason = _str(reason) or "incomplete"
        return Delta(finish_reason=self.finish_reason, usage=self.usage, raw=raw)

    def _whole(self, body: bytes) -> list[Delta]:
        return decode_response_body(200, {}, body, redact=self._redact)


def _response_answer(obj: dict[str, Any]) -> list[Delta] | None:
    """The one Delta of a whole (non-streamed) response object."""
    output = obj.get("output")
    if obj.get("object") != "response" and type(output) is not list:
        return None
    status = obj.get("status")
    if status == "failed" or type(obj.get("error")) is dict:
        error = obj.get("error")
        raise _in_band_error({"error": error} if type(error) is dict else "the response failed")
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallDelta] = []
    for item in output if type(output) is list else ():
        if type(item) is not dict:
            continue
        itype = item.get("type")
        if itype == "message":
            for part in item.get("content") or ():
                if type(part) is dict and part.get("type") == "output_text":
                    text.append(part.get("text") or "")
        elif itype == "reasoning":
            for key in ("summary", "content"):
                for part in item.get(key) or ():
                    if type(part) is dict and type(part.get("text")) is str:
                        reasoning.append(part["text"])
        elif itype == "function_call":
            arguments = item.get("arguments")
            calls.append(
                ToolCallDelta(
                    len(calls),
                    _str(item.get("call_id")),
                    _str(item.get("name")),
                    arguments if type(arguments) is str else "",
                )
            )
    finish: str | None = "completed" if status == "completed" else None
    if status == "incomplete":
        details = obj.get("incomplete_details")
        finish = (_str(details.get("reason")) if type(details) is dict else None) or "incomplete"
    usage = obj.get("usage")
    return [
        Delta(
            "".join(text),
            "".join(reasoning),
            tuple(calls),
            finish,
            usage if type(usage) is dict else None,
            "assistant",
        )
    ]


def decode_response_body(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    redact: Redact = _no_redact,
    sent: bytes = b"",
) -> list[Delta]:
    """Decode a whole ``application/json`` answer to a streaming Responses request: an error
    (or a failed response) raises its classified [`AttemptError`][trio_hedge.AttemptError]; a
    response object (the server ignored ``stream: true``) becomes one Delta."""
    return decode_whole(
        status,
        headers,
        body,
        redact=redact,
        sent=sent,
        stream=lambda size: ResponsesDecoder(size, redact=redact, sent=sent),
        answer=_response_answer,
        what="a response",
    )


#: Request fields that make each attempt start server-side work no cancel stops: refused.
_REFUSED = {
    "background": "a background response keeps running on the server after its stream "
    "closes, so a losing attempt could not be stopped; send it without hedging",
    "conversation": "each attempt would add its items to the conversation, the losers' "
    "too; chain turns with previous_response_id instead",
}


def _refuse_stateful(fields: Mapping[str, Any], where: str) -> None:
    """``ValueError`` naming the first `_REFUSED` field set in ``fields`` (``where``: the
    request, or a replica's overrides)."""
    for field, why in _REFUSED.items():
        if fields.get(field) not in (None, False):
            raise ValueError(f"{where} field {field!r} cannot be hedged: {why}")


@attrs.frozen
class ResponsesReplica(Replica):
    """An endpoint of the OpenAI Responses API (OpenAI, Azure OpenAI, or a compatible server
    such as vLLM, llama.cpp's ``llama-server``, LiteLLM or Ollama).

    The request is the Responses JSON body (``model``, ``input``, ``tools``, …);
    ``"stream": true`` is added. Every field of [`Replica`][trio_hedge.sources.Replica] works
    the same (``api_key`` is sent as ``Authorization: Bearer …``), except:

    Attributes:
        base_url: e.g. ``"https://api.openai.com/v1"``; the attempt posts to
            ``{base_url}/responses``.
        path: default ``"/responses"``.
    """

    path: str = attrs.field(default="/responses", validator=_check_path, kw_only=True)

    api: ClassVar[str] = "responses"

    @staticmethod
    def affinities(request: Mapping[str, Any]) -> tuple[str, ...]:
        """What of ``request`` only some replicas can answer: a ``previous_response_id``
        (the response is stored on the replica that made it). A "not found" for such a
        request is nobody's fault (the judge's "affinity" rule)."""
        return ("previous_response_id",) if request.get("previous_response_id") else ()

    def check_request(self, request: object) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``request`` is a Responses JSON body (a
        mapping that encodes to strict JSON) that can be hedged: ``background`` set or a
        ``conversation`` raise ``ValueError`` naming the field (see the module). The front
        doors call it before any I/O."""
        if not isinstance(request, Mapping):
            raise TypeError("request must be the Responses JSON body (a mapping)")
        super().check_request(request)
        _refuse_stateful(request, "request")


class ResponsesSource(HTTPSource):
    """One Responses request bound to one
    [`ResponsesReplica`][trio_hedge.sources.openai_responses.ResponsesReplica] over one
    ``httpx.AsyncClient``. With ``store`` on (the default), an attempt closed before its end
    without answer text deletes its stored response."""

    def __init__(
        self,
        replica: Replica,
        request: Mapping[str, Any],
        client: httpx.AsyncClient,
        header_names: HeaderNames,
        *,
        extra_headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(replica, request, client, header_names, extra_headers=extra_headers)
        _refuse_stateful(replica.overrides, "overrides")  # an override may set them too
        store = replica.overrides.get("store", request.get("store", True))
        self._stored = store is not False

    _stream_decoder = ResponsesDecoder
    _whole_decoder = staticmethod(decode_response_body)

    def _attempt_kind(self) -> Callable[..., HTTPAttempt] | None:
        if not self._stored:
            return None
        delete = self._delete

        def attempt(*args: Any) -> HTTPAttempt:
            return _ResponsesAttempt(*args, cleanup=delete)

        return attempt

    async def _delete(self, response_id: str) -> None:
        """Delete one stored response (best effort: any failure is ignored)."""
        headers = {k: v for k, v in self._headers.items() if k not in ("accept", "content-type")}
        url = f"{self._url}/{response_id}"
        with trio.move_on_after(CLEANUP_TIMEOUT):
            with contextlib.suppress(httpx.HTTPError):
                await self._client.request("DELETE", url, headers=headers)


class _ResponsesAttempt(HTTPAttempt):
    """An attempt that deletes its stored response if it closes before its end having sent
    no answer text (a loser: under any first-token rule a loser never sent text the caller
    read)."""

    __slots__ = ("_cleanup", "_responses")

    def __init__(
        self,
        response: httpx.Response,
        whole: Sequence[Delta] | None,
        redact: Redactor,
        errors: TransportErrors,
        decoder: ResponsesDecoder,
        *,
        cleanup: Callable[[str], Coroutine[Any, Any, None]],
    ) -> None:
        super().__init__(response, whole, redact, errors, decoder)
        self._responses = decoder
        self._cleanup: Callable[[str], Coroutine[Any, Any, None]] | None = cleanup

    async def aclose(self) -> None:
        complete = self._finished
        cleanup, self._cleanup = self._cleanup, None
        await super().aclose()
        decoder = self._responses
        if cleanup is not None and not complete and not decoder.sent_text and decoder.response_id:
            await cleanup(decoder.response_id)


ResponsesReplica._source_class = ResponsesSource
