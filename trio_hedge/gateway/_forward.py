"""``POST /v1/chat/completions``: validate, race the group's replicas, relay the winner.

The response starts at the commit. Before it, nothing has been sent, so an error answers with
its true status (``_errors.py``). After it, each of the winner's events is written as the
server sent it (``Delta.raw``: no JSON re-encoding per token), and the stream ends with
``[DONE]``, or with an in-band error event and no ``[DONE]`` when the winner fails, the
deadline passes or the gateway shuts down. A non-streaming request is hedged the same way
(upstream streaming, first-token commit) and answered with one ``chat.completion``.

The client leaving cancels everything at once: a watcher task waits on ``receive()`` for
``http.disconnect`` and cancels the request's scope; the hedged stream's ``async with`` then
closes every upstream attempt (shielded, bounded by the Hedger's ``close_timeout``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio

from .. import HedgedStream, HedgeError, Hedger, Report
from ..events import Delta
from ..sources.openai import merge_tool_calls
from ._config import GatewayConfig, Group
from ._errors import ErrorAnswer, answer_for
from ._http import Exchange, Receive
from ._input import MAX_MODEL_CHARS, BadJSON, load_json
from ._metrics import AccessRecord, GatewayMetrics
from ._recovered import ChunkRewriter, head_of, recount, relay_recovered

__all__ = ["ChatForwarder", "Completion", "Rejected", "RequestOptions", "parse_chat"]

_SSE_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell nginx-style proxies not to buffer the stream
)
_DONE = b"data: [DONE]\n\n"


class Rejected(Exception):
    """A request refused before anything is sent upstream."""

    def __init__(self, answer: ErrorAnswer) -> None:
        super().__init__(answer.message)
        self.answer = answer


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> Rejected:
    return Rejected(ErrorAnswer(400, message, code=code, param=param))


def parse_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object (``_input.load_json``: one JSON dialect).

    Raises:
        Rejected: 400 for a body that is not one.
    """
    try:
        obj = load_json(body)
    except BadJSON as exc:
        raise _bad(str(exc), code="invalid_json") from None
    if not isinstance(obj, dict):
        raise _bad("the request body must be a JSON object")
    return obj


def check_stream_and_model(obj: dict[str, Any]) -> None:
    """Raise ``Rejected`` (400) for a non-boolean ``stream`` or a ``model`` that is not a
    string of at most ``MAX_MODEL_CHARS`` characters (every API's body has both)."""
    if not isinstance(obj.get("stream", False), bool):
        raise _bad("'stream' must be true or false", "stream")
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if model is not None and len(model) > MAX_MODEL_CHARS:
        raise _bad(f"'model' must be at most {MAX_MODEL_CHARS} characters", "model")


def parse_chat(body: bytes) -> dict[str, Any]:
    """The chat-completions body, checked enough that no replica is bothered with a request
    every replica would refuse (or that the gateway cannot relay).

    Raises:
        Rejected: 400 for a body that is not a JSON object (``_input.load_json``), no
            non-empty ``messages`` list, a non-boolean ``stream``, a ``model`` that is not a
            string of at most ``MAX_MODEL_CHARS`` characters, or ``n`` other than 1.
    """
    obj = parse_object(body)
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' is required: a non-empty list of messages", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise _bad("each message must be a JSON object", "messages")
    check_stream_and_model(obj)
    n = obj.get("n")
    if n is not None and (type(n) is not int or n != 1):
        # Only choice 0 is relayed: the race commits on one answer.
        raise _bad("'n' other than 1 is not supported by the hedging gateway", "n")
    return obj


@attrs.frozen
class RequestOptions:
    """What the client's headers ask of the race."""

    hedge: bool = True
    hedge_after: float | None = None
    idempotency_key: str | None = None
    headers: Mapping[str, str] | None = attrs.field(default=None, repr=False)
    secrets: tuple[str, ...] = attrs.field(default=(), repr=False)

    @classmethod
    def from_exchange(cls, ex: Exchange, config: GatewayConfig) -> RequestOptions:
        """``X-Hedge: off|on``, ``X-Hedge-After: <seconds>`` (clamped to the configured
        range), ``Idempotency-Key`` (prefixed with the gateway key's name, ``name:key``, so
        tenants' keys never collide upstream), and the client's ``Authorization`` when
        forwarded.

        Raises:
            Rejected: 400 for a value that is not understood.
        """
        hedge = True
        switch = ex.header(b"x-hedge")
        if switch is not None:
            switch = switch.strip().lower()
            if switch not in ("on", "off"):
                raise _bad("X-Hedge must be 'on' or 'off'", "X-Hedge")
            hedge = switch == "on"
        delay: float | None = None
        text = ex.header(b"x-hedge-after")
        if text is not None:
            try:
                delay = float(text)
            except ValueError:
                delay = math.nan
            if not math.isfinite(delay) or delay < 0:
                raise _bad("X-Hedge-After must be seconds (a number >= 0)", "X-Hedge-After")
            limits = config.limits
            delay = min(max(delay, limits.hedge_after_min), limits.hedge_after_max)
        key = ex.header(b"idempotency-key")
        if key is not None and (not key or not key.isascii() or not key.isprintable()):
            raise _bad("Idempotency-Key must be printable ASCII", "Idempotency-Key")
        tenant = ex.record.key
        if key is not None and tenant is not None:
            # Each gateway key's own namespace: two tenants choosing the same key must not
            # collide at the upstream, which sees one client (the gateway's own key).
            key = f"{tenant}:{key}"
        headers = None
        secrets: tuple[str, ...] = ()
        authorization = ex.header(b"authorization")
        if config.forward_client_key and authorization:
            headers = {"authorization": authorization}
            token = authorization.split(" ", 1)[-1]
            secrets = (authorization, token) if len(token) >= 4 else (authorization,)
        return cls(hedge, delay, key, headers, secrets)


class ChunkEncoder:
    """SSE bytes for one event: the server's own JSON text when the delta has it, else a
    ``chat.completion.chunk`` made from the delta (a whole-JSON answer, a generic source)."""

    __slots__ = ("_head",)

    def __init__(self, request_id: str, model: str | None) -> None:
        self._head: dict[str, Any] = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model or "",
        }

    def encode(self, delta: Delta) -> bytes:
        raw = delta.raw
        if raw is not None:
            if "\n" in raw:  # multi-line data: every line needs its own field name
                raw = raw.replace("\n", "\ndata: ")
            return b"data: " + raw.encode() + b"\n\n"
        data = json.dumps(self.chunk(delta), ensure_ascii=False, separators=(",", ":"))
        return b"data: " + data.encode() + b"\n\n"

    def chunk(self, delta: Delta) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if delta.role is not None:
            body["role"] = delta.role
        if delta.content:
            body["content"] = delta.content
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            body["tool_calls"] = [
                {
                    "index": c.index,
                    **({"id": c.id, "type": "function"} if c.id is not None else {}),
                    "function": {
                        **({"name": c.name} if c.name is not None else {}),
                        "arguments": c.arguments,
                    },
                }
                for c in delta.tool_calls
            ]
        choices = []
        if body or delta.finish_reason is not None:
            choices.append({"index": 0, "delta": body, "finish_reason": delta.finish_reason})
        out = {**self._head, "choices": choices}
        if delta.usage is not None:
            out["usage"] = delta.usage
        return out


class Completion:
    """A non-streaming answer assembled from the winner's deltas."""

    def __init__(self) -> None:
        self.deltas: list[Delta] = []
        self.head: dict[str, Any] = {}

    def add(self, delta: Delta) -> None:
        if not self.head and delta.raw is not None:
            # The upstream's id, model, created and fingerprint, from its first chunk.
            try:
                first = json.loads(delta.raw)
            except ValueError:
                first = {}
            if isinstance(first, dict):
                keys = ("id", "created", "model", "system_fingerprint")
                self.head = {k: first[k] for k in keys if first.get(k) is not None}
        self.deltas.append(delta)

    def body(self, request_id: str, model: str | None) -> bytes:
        content = "".join(d.content for d in self.deltas)
        reasoning = "".join(d.reasoning for d in self.deltas)
        finish = usage = None
        for d in self.deltas:
            finish = d.finish_reason or finish
            usage = d.usage if d.usage is not None else usage
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = merge_tool_calls(self.deltas)
        if calls:
            message["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ]
            message["content"] = content or None
        out: dict[str, Any] = {
            "id": f"chatcmpl-{request_id}",
            "created": int(time.time()),
            "model": model or "",
            **self.head,
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            ],
        }
        if usage is not None:
            out["usage"] = usage
        return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()


def _hedge_headers(report: Report) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"x-hedge-attempts", str(report.attempts_sent).encode()),
        (b"x-hedge-hedged", b"true" if report.hedged else b"false"),
    ]
    winner = report.winner_replica
    if winner is not None:
        headers.append((b"x-hedge-replica", winner.encode()))
    if report.ttft is not None:
        headers.append((b"x-hedge-ttft", f"{report.ttft:.6f}".encode()))
    return headers


def _note(record: AccessRecord, report: Report) -> None:
    record.winner = report.winner_replica
    record.attempts = report.attempts_sent
    record.hedged = report.hedged
    record.ttft = report.ttft
    record.tokens = report.token_count
    record.wasted_tokens = report.wasted_tokens


class ChatForwarder:
    """Handles chat completions for one gateway (its Hedgers, limits and metrics)."""

    def __init__(
        self,
        config: GatewayConfig,
        hedgers: Mapping[str, Hedger],
        metrics: GatewayMetrics,
        secrets: Sequence[str] = (),
    ) -> None:
        self._config = config
        self._hedgers = hedgers
        self._metrics = metrics
        self._secrets = tuple(secrets)

    def prepare(
        self, ex: Exchange, body: bytes
    ) -> tuple[dict[str, Any], Group, RequestOptions, bool]:
        """The parsed body, its group, the header options and whether it streams.

        Raises:
            Rejected: 400 (bad body or header) or 404 (no group serves the model).
        """
        request = self._parse(body)
        model = request.get("model")
        group = self._config.group_for(model)
        record = ex.record
        record.model = model
        if group is None:
            raise Rejected(
                ErrorAnswer(
                    404,
                    f"The model {model!r} is not served by this gateway",
                    code="model_not_found",
                    param="model",
                )
            )
        options = self._options(ex)
        streaming = bool(request.get("stream", False))
        record.group, record.stream = group.name, streaming
        if not options.hedge:
            record.hedge = "off"
        elif options.hedge_after is not None:
            record.hedge = f"{options.hedge_after:g}"
        self._upstream(request, streaming)
        return request, group, options, streaming

    # What another API's forwarder (``_agent.py``) says differently.

    def _parse(self, body: bytes) -> dict[str, Any]:
        """The request body, checked (``Rejected`` for one every replica would refuse)."""
        return parse_chat(body)

    def _options(self, ex: Exchange) -> RequestOptions:
        return RequestOptions.from_exchange(ex, self._config)

    def _upstream(self, request: dict[str, Any], streaming: bool) -> None:
        """Adjust the body sent upstream (which always streams)."""
        if not streaming and "stream_options" not in request:
            # Upstream streams even so; ask for the usage the whole answer must carry.
            request["stream_options"] = {"include_usage": True}

    def _completion(self) -> Completion:
        """What assembles a non-streamed answer from the winner's deltas."""
        return Completion()

    def _style(self, answer: ErrorAnswer) -> ErrorAnswer:
        """An error answer in this API's shape."""
        return answer

    async def handle(
        self,
        ex: Exchange,
        request: dict[str, Any],
        group: Group,
        options: RequestOptions,
        streaming: bool,
        admitted: trio.CancelScope,
        deadline_at: float,
    ) -> None:
        """Race and relay one admitted request (see the module docstring) until
        ``deadline_at`` (Trio time: its admission plus ``request_timeout``)."""
        hedger = self._hedgers[group.name]
        limits = self._config.limits
        timeout = limits.request_timeout
        metrics = self._metrics
        metrics.in_flight.inc()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_disconnect, ex, nursery.cancel_scope)
                with admitted:
                    deadline = trio.CancelScope(deadline=deadline_at)
                    with deadline:
                        await self._race(ex, hedger, request, group, options, streaming)
                    if deadline.cancelled_caught:
                        ex.record.error = "request_timeout"
                        message = f"the request took longer than request_timeout={timeout} s"
                        answer = ErrorAnswer(504, message, code="request_timeout")
                        await _cut(ex, self._style(answer))
                if admitted.cancelled_caught:
                    ex.record.error = "shutdown"
                    answer = ErrorAnswer(
                        503,
                        "the gateway is shutting down",
                        code="shutdown",
                        retry_after=limits.retry_after,
                    )
                    await _cut(ex, self._style(answer))
                nursery.cancel_scope.cancel()
        finally:
            metrics.in_flight.dec()
            if ex.record.winner is not None:
                metrics.models.served(ex.record.model)  # a model label from now on
            if ex.record.tokens:
                metrics.tokens.inc(ex.record.tokens)

    async def _race(
        self,
        ex: Exchange,
        hedger: Hedger,
        request: dict[str, Any],
        group: Group,
        options: RequestOptions,
        streaming: bool,
    ) -> None:
        record = ex.record
        try:
            stream = hedger.stream(
                request,
                hedge=options.hedge,
                side_effects=group.side_effects,
                idempotency_key=options.idempotency_key,
                request_id=record.request_id,
                hedge_after=options.hedge_after,
                headers=options.headers,
            )
        except (TypeError, ValueError) as exc:
            await ex.error(self._style(ErrorAnswer(400, str(exc), code="invalid_request")))
            return
        completion = self._completion() if not streaming else None
        report: Report | None = None
        try:
            try:
                async with stream:
                    if completion is None:
                        await self._stream_out(ex, stream, request.get("model"))
                    else:
                        async for delta in stream.events():
                            completion.add(delta)
            finally:
                report = stream.report
                _note(record, report)
        except HedgeError as exc:
            answer = self._style(
                answer_for(
                    exc,
                    secrets=(*self._secrets, *options.secrets),
                    default_retry_after=self._config.limits.retry_after,
                )
            )
            record.error = answer.code
            if ex.started:
                await ex.body(answer.event(), more=False)  # after the commit: in band
            else:
                report = exc.report
                await ex.error(answer, _hedge_headers(report) if report is not None else ())
            return
        if completion is not None:
            assert report is not None
            if stream.recovered:
                recount(completion.deltas, report)
            data = completion.body(record.request_id, request.get("model"))
            await ex.json(200, data, _hedge_headers(report))

    async def _stream_out(self, ex: Exchange, stream: HedgedStream, model: str | None) -> None:
        """The hot path: the server's bytes as they were, one ``send`` per read of the winner
        (the events one read brought go out together: a send costs ~40 µs of hypercorn, h11
        and a syscall, and a model server's burst, or a reader that fell behind, brings
        several events per read)."""
        # The first batch (the events read up to the commit) is ready: one write for both.
        await ex.start(200, [*_SSE_HEADERS, *_hedge_headers(stream.report)], with_body=True)
        encoder = ChunkEncoder(ex.record.request_id, model)
        encode = encoder.encode
        send = ex.send
        batches = stream.batches()
        first: Delta | None = None  # the commit's first event (never a recovery's): its head
        async for batch in batches:
            first = batch[0]
            await send(
                {
                    "type": "http.response.body",
                    "body": b"".join(map(encode, batch)),
                    "more_body": True,
                }
            )
            break
        async for batch in batches:
            if stream.recovered:  # another replica goes on: one completion (``_recovered``)
                rewriter = ChunkRewriter(head_of(first), encoder.chunk, stream)
                await relay_recovered(ex, batch, batches, rewriter.encode)
                break
            data = encode(batch[0]) if len(batch) == 1 else b"".join(map(encode, batch))
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await ex.body(_DONE, more=False)


async def _cut(ex: Exchange, answer: ErrorAnswer) -> None:
    """End a request the gateway stopped: an error answer, or in band after the commit."""
    if ex.finished:
        return
    if ex.started:
        await ex.body(answer.event(), more=False)
    else:
        await ex.error(answer)


async def _watch_disconnect(ex: Exchange, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client goes away (ASGI ``http.disconnect``)."""
    receive: Receive = ex.receive
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not ex.finished:
                ex.record.status = 499  # nginx's "client closed request"
                ex.record.error = "client_disconnected"
                scope.cancel()
            return
