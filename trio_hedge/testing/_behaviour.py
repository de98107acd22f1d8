"""What a fake replica does with one request, and what it recorded about it.

[`Behaviour`][trio_hedge.testing.Behaviour] holds the knobs (all times in seconds).
[`render_response`][trio_hedge.testing.render_response] turns a request and a behaviour into a list
of *steps* (wait, send headers, send one chunk, stall, cut); it is pure, so the loopback servers
(`._server`) and the in-process mock (`._mock`) share one SSE generator and differ only in how they
carry the steps out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import attrs
import trio

from ._wire import ChatWire, MessagesWire, ResponsesWire, Wire, dumps, openai_error, sse_event

__all__ = [
    "KEEPALIVE",
    "Behaviour",
    "BehaviourSource",
    "Chunk",
    "Cut",
    "Head",
    "RequestRecord",
    "Stall",
    "Step",
    "Wait",
    "render_response",
    "sse_event",
]

#: The SSE comment sent while stalled (comments never carry data: clients must ignore them).
KEEPALIVE = b": keep-alive\n\n"


#: Header names whose values never appear in a repr (credentials).
_SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "api-key", "x-api-key", "cookie", "set-cookie"}
)


# --------------------------------------------------------------------------------------------
# Behaviour


def _tokens(value: int | str | Sequence[str]) -> int | tuple[str, ...]:
    """``int`` stays a count; a string is split into words (each keeps its trailing space,
    so the tokens join back into the text); any other sequence becomes a tuple."""
    if isinstance(value, bool):
        raise TypeError("tokens must be an int, a str or a sequence of str, not a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        return tuple(re.findall(r"\s*\S+\s*", value)) or ((value,) if value else ())
    return tuple(value)


def _tool_calls(value: Sequence[Sequence[str]]) -> tuple[tuple[str, str], ...]:
    calls = tuple(tuple(call) for call in value)
    for call in calls:
        if len(call) != 2 or not all(isinstance(part, str) for part in call):
            raise TypeError(f"tool_calls must be (name, arguments) pairs of str, not {call!r}")
    return calls  # type: ignore[return-value]


def _non_negative(_inst: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is None:
        return
    if math.isnan(value) or value < 0:
        raise ValueError(f"{attribute.name} must be >= 0 seconds, got {value!r}")


def _non_negative_count(_inst: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen
class Behaviour:
    """How a fake replica answers one request (chat completions, Anthropic Messages or OpenAI
    Responses: the path says which; each streams in its API's own events). Times are in
    seconds.

    A streaming 200 answer sends the response headers and a role-only chunk at once (real
    servers answer 200 while the request is still queued: headers are not a first token),
    then the first content token after ``ttft``, then one token every ``token_delay``, then a
    chunk with ``finish_reason``, a usage chunk (if ``usage``) and ``data: [DONE]`` (if
    ``send_done``). Every SSE event is written (and flushed) on its own.

    Attributes:
        ttft: seconds from receiving the request to the first content token. For a non-stream
            request (``"stream": false``) the whole JSON answer is sent when the last token
            would have been, ``ttft + (n - 1) * token_delay``.
        token_delay: seconds between two tokens.
        tokens: an ``int`` *n* gives the tokens ``"tok0 "``, ``"tok1 "``, …; a string is split
            into words (each keeps its trailing whitespace); a sequence of strings is used as is.
        status: the HTTP status. Non-2xx sends an OpenAI-style JSON error (no stream) after
            ``error_delay``.
        error_delay: seconds before an error answer (headers and body together).
        error_message: the error's ``message`` (default: the status' reason phrase).
        error_code: the error's ``code`` (OpenAI shapes; default the status's own, e.g.
            ``"not_found"``), as an API names its own (``"previous_response_not_found"``).
        error_param: the error's ``param`` (OpenAI shapes), e.g. ``"previous_response_id"``.
        retry_after: seconds for a ``Retry-After`` header on an error (``None``: no header).
            Non-integers are sent as decimals (``"0.5"``), which is non-standard but keeps
            tests fast.
        slow_after: send that many tokens at ``token_delay``, then the rest one every
            ``slow_token_delay`` seconds (a stream that crawls but stays alive). ``None``:
            never.
        slow_token_delay: seconds between tokens once ``slow_after`` were sent. Default 1.
        stall_after: send that many tokens, then stall forever (no finish, no ``[DONE]``).
        keepalive_interval: while stalled, send a ``: keep-alive`` SSE comment every so many
            seconds (``None``: stall silently).
        cut_after: send that many tokens, then close the connection abruptly (no finish, no
            ``[DONE]``) at the moment the next token was due (``ttft`` for 0). On HTTP/2 the
            stream is reset instead; the mock raises ``httpx.RemoteProtocolError``.
        inband_error_after: send that many tokens, then (when the next token was due) an
            in-band error event ``data: {"error": {...}}`` with ``error_message`` and the
            error ``type``/``code`` that ``inband_error_status`` implies, and end the body, as
            servers do when generation fails after the 200 was sent. ``None``: never.
        cut_after_fragments: send that many tool-call fragments (of ``tool_calls``, in the
            route's events), then close the connection as ``cut_after`` does. ``None``: never.
        malformed_after: send that many tokens, then (when the next token was due) a data
            event that is not JSON (chat: ``data: {"choices": [``; the Messages and Responses
            APIs: a named event with cut-off data), then stall, as a proxy that mangles a
            stream does. ``None``: never.
        inband_error_status: the status whose OpenAI error shape the in-band error takes
            (e.g. 429 for a rate limit, 500 for a server error). Default 500.
        send_done: end a complete stream with ``data: [DONE]``.
        finish_reason: the finish reason of the last chunk.
        usage: send a final usage chunk (``"choices": []``), as with
            ``stream_options.include_usage``.
        reasoning: reasoning ("thinking") tokens sent as ``delta.reasoning_content`` before
            the content, like ``tokens`` (an ``int`` *n* gives ``"think0 "``, …). Default none.
        tool_calls: ``(name, arguments)`` pairs (``arguments`` a JSON text) streamed after the
            content as OpenAI tool-call fragments: the id and name first, then the arguments
            in two pieces, one chunk each, ``token_delay`` apart. Set
            ``finish_reason="tool_calls"`` to say so at the end. Default none.
        continuation: which engine's continuation contract the replica mimics when the
            request's last message is the assistant's (a recovery by continuation):
            ``"vllm"``: with ``continue_final_message: true`` it answers only what follows
            that message's text in its own answer (the tokens after as many characters, the
            first one cut if the text ends inside it); ``"llama.cpp"`` or ``None`` (default):
            it answers its whole answer, repeating the prefix, as llama.cpp's server does.
            ``"anchor"``: a model that follows the anchor method's instruction (an assistant
            turn, then a user turn quoting its last characters between ``<<<`` and ``>>>``;
            any API): it repeats them as ``anchor_echo`` says, then answers what follows the
            assistant turn's text in its own answer.
        anchor_echo: how an ``"anchor"`` replica repeats the anchor: ``"keep"`` (exactly),
            ``"trim"`` (the boundary whitespace dropped), ``"space"`` (whitespace runs and
            line breaks of its own), ``"curly"`` (typographic quotes for plain ones),
            ``"preamble"`` (a short sentence first), ``"lose"`` (its last non-space
            character dropped), ``"twice"`` (repeated twice), ``"none"`` (no repeat at all,
            as a model that does not follow instructions). Default ``"keep"``.
        context_window: answer 400 ``context_length_exceeded`` (vLLM's wording; on
            ``/v1/messages`` Anthropic's ``prompt is too long``) to a request whose prompt
            (the words of its messages) plus ``max_tokens`` (or ``max_completion_tokens``,
            ``max_output_tokens``) exceeds this many tokens. ``None`` (default): any size fits.
        rejects_prefill: answer 400 (``invalid_request_error``, Anthropic's message, in the
            route's error shape) to a request whose last message is the assistant's, as hosted
            APIs that refuse assistant prefill do. Default ``False``.

    With ``reasoning`` or ``tool_calls``, the first output chunk of any kind comes after
    ``ttft`` and every later one ``token_delay`` after the previous.
    """

    ttft: float = attrs.field(default=0.0, validator=_non_negative)
    token_delay: float = attrs.field(default=0.0, validator=_non_negative)
    tokens: int | tuple[str, ...] = attrs.field(default=8, converter=_tokens)
    status: int = attrs.field(default=200)
    error_delay: float = attrs.field(default=0.0, validator=_non_negative)
    error_message: str = ""
    error_code: str | None = None
    error_param: str | None = None
    retry_after: float | None = attrs.field(default=None, validator=_non_negative)
    slow_after: int | None = attrs.field(default=None, validator=_non_negative_count)
    slow_token_delay: float = attrs.field(default=1.0, validator=_non_negative)
    stall_after: int | None = attrs.field(default=None, validator=_non_negative_count)
    keepalive_interval: float | None = attrs.field(default=None)
    cut_after: int | None = attrs.field(default=None, validator=_non_negative_count)
    inband_error_after: int | None = attrs.field(default=None, validator=_non_negative_count)
    malformed_after: int | None = attrs.field(default=None, validator=_non_negative_count)
    cut_after_fragments: int | None = attrs.field(default=None, validator=_non_negative_count)
    inband_error_status: int = 500
    send_done: bool = True
    finish_reason: str = "stop"
    usage: bool = True
    reasoning: int | tuple[str, ...] = attrs.field(default=0, converter=_tokens)
    tool_calls: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_tool_calls)
    continuation: str | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.in_(("vllm", "llama.cpp", "anchor"))),
    )
    anchor_echo: str = attrs.field(
        default="keep",
        validator=attrs.validators.in_(
            ("keep", "trim", "space", "curly", "preamble", "lose", "twice", "none")
        ),
    )
    rejects_prefill: bool = False
    context_window: int | None = attrs.field(default=None, validator=_non_negative_count)

    @tokens.validator
    def _check_tokens(self, _attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"tokens must be >= 0, got {value!r}")

    @status.validator
    def _check_status(self, _attribute: attrs.Attribute[Any], value: int) -> None:
        if not 200 <= value <= 599:
            raise ValueError(f"status must be in 200..599, got {value!r}")

    @keepalive_interval.validator
    def _check_keepalive(self, _attribute: attrs.Attribute[Any], value: float | None) -> None:
        if value is not None and not value > 0:  # also rejects NaN
            raise ValueError(f"keepalive_interval must be > 0 seconds, got {value!r}")

    def __attrs_post_init__(self) -> None:
        if self.stall_after is not None and self.cut_after is not None:
            raise ValueError("set at most one of stall_after and cut_after")

    @property
    def reasoning_texts(self) -> tuple[str, ...]:
        """The reasoning tokens' texts, in order."""
        if isinstance(self.reasoning, int):
            return tuple(f"think{i} " for i in range(self.reasoning))
        return self.reasoning

    @property
    def token_texts(self) -> tuple[str, ...]:
        """The tokens' texts, in order."""
        if isinstance(self.tokens, int):
            return tuple(f"tok{i} " for i in range(self.tokens))
        return self.tokens

    @property
    def is_error(self) -> bool:
        """Whether the status is not 2xx."""
        return not 200 <= self.status <= 299


# --------------------------------------------------------------------------------------------
# RequestRecord


def _redacted(headers: dict[str, str]) -> str:
    return repr({k: ("<redacted>" if k in _SECRET_HEADERS else v) for k, v in headers.items()})


@attrs.define(eq=False)
class RequestRecord:
    """What a fake replica saw and did for one request. Times are ``trio.current_time()``
    seconds (virtual under a ``MockClock``).

    Attributes:
        index: 0-based position among the replica's requests (all paths).
        received_at: when the whole request had arrived.
        method: the HTTP method, e.g. ``"POST"``.
        path: the request path, e.g. ``"/v1/chat/completions"``.
        headers: request headers, lower-case names (the repr redacts credentials).
        json: the parsed JSON body, or ``None``.
        http_version: ``"1.1"``, ``"1.0"`` or ``"2"``.
        replica: the replica's name.
        behaviour: the [`Behaviour`][trio_hedge.testing.Behaviour] used (chat completions only).
        status: the status sent, ``None`` until the headers are sent.
        tokens_sent: content tokens sent.
        token_times: when each token-carrying chunk was sent.
        first_token_at: when the first content token was sent, or ``None``.
        finished_at: when the replica stopped working on the request, whatever the reason.
        disconnected_at: when the replica saw the client go away before the answer was
            complete (socket EOF/reset, HTTP/2 RST_STREAM or GOAWAY, mock stream closed),
            else ``None``.
        completed: whether the whole answer was sent.
    """

    index: int
    received_at: float
    method: str
    path: str
    headers: dict[str, str] = attrs.field(factory=dict, repr=_redacted)
    json: Any = None
    http_version: str = "1.1"
    replica: str = ""
    behaviour: Behaviour | None = None
    status: int | None = None
    tokens_sent: int = 0
    token_times: list[float] = attrs.field(factory=list)
    first_token_at: float | None = None
    finished_at: float | None = None
    disconnected_at: float | None = None
    completed: bool = False
    _finished: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)

    @property
    def stream(self) -> bool:
        """Whether the body asked for a stream (OpenAI's default is no stream)."""
        return isinstance(self.json, dict) and bool(self.json.get("stream", False))

    @property
    def finished(self) -> bool:
        """Whether the replica is done with this request."""
        return self.finished_at is not None

    def note_sent(self, tokens: int) -> None:
        """Record that a chunk carrying ``tokens`` content tokens was just sent."""
        if tokens:
            now = trio.current_time()
            self.tokens_sent += tokens
            self.token_times.append(now)
            if self.first_token_at is None:
                self.first_token_at = now

    def note_finished(self, *, completed: bool = False, disconnected: bool = False) -> None:
        """Record the end of the request; only the first call counts."""
        if self.finished_at is not None:
            return
        now = trio.current_time()
        self.finished_at = now
        self.completed = completed
        if disconnected:
            self.disconnected_at = now
        self._finished.set()

    async def wait_finished(self) -> None:
        """Wait until the replica is done with this request."""
        await self._finished.wait()


BehaviourSource: TypeAlias = "Behaviour | Callable[[RequestRecord], Behaviour]"
"""A fixed behaviour, or a function choosing one per request (by index, header, body…)."""


class RequestLog:
    """The requests one replica received, with helpers to wait for them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.records: list[RequestRecord] = []
        self._changed = trio.Event()

    def new(
        self,
        *,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        http_version: str,
    ) -> RequestRecord:
        try:
            parsed: Any = json.loads(body) if body else None
        except ValueError:
            parsed = None
        record = RequestRecord(
            index=len(self.records),
            received_at=trio.current_time(),
            method=method,
            path=path,
            headers=headers,
            json=parsed,
            http_version=http_version,
            replica=self.name,
        )
        self.records.append(record)
        self._changed.set()
        self._changed = trio.Event()
        return record

    async def wait_request(self, index: int) -> RequestRecord:
        """Wait until request ``index`` has arrived; return its record."""
        while len(self.records) <= index:
            await self._changed.wait()
        return self.records[index]

    async def wait_finished(self, index: int) -> RequestRecord:
        """Wait until the replica is done with request ``index``."""
        record = await self.wait_request(index)
        await record.wait_finished()
        return record

    async def wait_disconnected(self, index: int) -> RequestRecord:
        """Wait until request ``index`` ends; raise ``AssertionError`` if it ended without a
        client disconnect (completed, cut, or server shut down). Wrap in ``trio.fail_after``."""
        record = await self.wait_finished(index)
        if record.disconnected_at is None:
            raise AssertionError(
                f"request {index} to {self.name!r} finished without a client disconnect "
                f"(completed={record.completed}, tokens_sent={record.tokens_sent})"
            )
        return record


# --------------------------------------------------------------------------------------------
# Steps and rendering


@attrs.frozen
class Wait:
    """Sleep ``seconds``."""

    seconds: float


@attrs.frozen
class Head:
    """Send the status line and headers (names lower-case)."""

    status: int
    headers: tuple[tuple[str, str], ...]


@attrs.frozen
class Chunk:
    """Send ``data`` as one write (one SSE event, or a whole JSON body); it carries
    ``tokens`` content tokens."""

    data: bytes
    tokens: int = 0


@attrs.frozen
class Stall:
    """Send nothing more, forever; if headers were sent and ``keepalive_interval`` is set,
    send `KEEPALIVE` every ``keepalive_interval`` seconds."""

    keepalive_interval: float | None


@attrs.frozen
class Cut:
    """Close the connection (HTTP/2: reset the stream) without finishing the answer."""


Step: TypeAlias = "Wait | Head | Chunk | Stall | Cut"
"""One step of an answer; after the last step the answer is complete."""


def _json_answer(status: int, payload: object, extra: Sequence[tuple[str, str]] = ()) -> list[Step]:
    body = dumps(payload)
    headers = (
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        *extra,
    )
    return [Head(status, headers), Chunk(body)]


def _max_tokens(body: Any) -> int:
    """The answer's token limit the request asks for (any API's field), else 0."""
    if not isinstance(body, dict):
        return 0
    for field in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        limit = body.get(field)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return limit
    return 0


def _error_payload(status: int, message: str) -> dict[str, Any]:
    return openai_error(status, message)


def _seconds_header(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def _prompt_tokens(body: Any) -> int:
    """A rough prompt size (words in the messages), for the usage object."""
    if not isinstance(body, dict):
        return 0
    words = 0
    for message in body.get("messages") or ():
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            words += len(message["content"].split())
    return words


def render_response(
    record: RequestRecord,
    behaviour: BehaviourSource,
    *,
    model: str = "fake-model",
    created: int = 0,
) -> list[Step]:
    """The steps that answer ``record`` (routing included), pure but for calling
    ``behaviour`` when it is a function.

    Routes: ``POST /v1/chat/completions``, ``/v1/messages``, ``/v1/responses`` (per the
    behaviour, in each API's events: ``send_done=False`` drops ``[DONE]``, ``message_stop``
    or ``response.completed``; ``finish_reason="length"`` ends a Responses stream with
    ``response.incomplete``; it is stored in
    ``record.behaviour``), ``DELETE /v1/responses/{id}`` (200), ``GET /health``,
    ``GET /v1/models``; others get 404/405.
    """
    path = record.path.split("?", 1)[0]
    routes = {
        "/v1/chat/completions": "POST",
        "/v1/messages": "POST",
        "/v1/responses": "POST",
        "/health": "GET",
        "/v1/models": "GET",
    }
    if record.method == "DELETE" and path.startswith("/v1/responses/"):
        # Deleting a stored response (what hedging does with a loser's): recorded, 200.
        ident = path.rsplit("/", 1)[1]
        return _json_answer(200, {"id": ident, "object": "response.deleted", "deleted": True})
    if path not in routes:
        return _json_answer(404, _error_payload(404, f"no route {path}"))
    if record.method != routes[path]:
        return _json_answer(405, _error_payload(405, f"{record.method} not allowed on {path}"))
    if path == "/health":
        return _json_answer(200, {"status": "ok"})
    if path == "/v1/models":
        return _json_answer(
            200,
            {
                "object": "list",
                "data": [{"id": model, "object": "model", "created": created, "owned_by": "fake"}],
            },
        )
    if not isinstance(record.json, dict):
        return _json_answer(400, _error_payload(400, "the body must be a JSON object"))
    chosen = behaviour if isinstance(behaviour, Behaviour) else behaviour(record)
    record.behaviour = chosen
    requested_model = record.json.get("model")
    ident = f"chatcmpl-{record.replica or 'fake'}-{record.index}"
    wire = _WIRES[path](
        ident, requested_model if isinstance(requested_model, str) else model, created
    )
    return _render(chosen, record, wire)


#: What a hosted API that refuses assistant prefill answers (Anthropic's wording).
PREFILL_REJECTED = (
    "This model does not support assistant message prefill. "
    "The conversation must end with a user message."
)


def _prefill(body: dict[str, Any]) -> str | None:
    """The text of the request's last message when it is the assistant's, else ``None``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    if last.get("role") != "assistant":
        return None
    content = last.get("content")
    return content if isinstance(content, str) else ""


def _anchor_request(body: dict[str, Any]) -> tuple[str, str] | None:
    """``(the assistant turn's text, the quoted anchor)`` of an anchor continuation: a
    conversation (``messages``, or a Responses ``input`` list) ending with an assistant turn
    and a user turn that quotes ``<<<anchor>>>``; else ``None``."""
    turns = body.get("messages")
    if not isinstance(turns, list):
        turns = body.get("input")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    said, asked = turns[-2], turns[-1]
    if not (isinstance(said, dict) and isinstance(asked, dict)):
        return None
    text, instruction = said.get("content"), asked.get("content")
    if said.get("role") != "assistant" or asked.get("role") != "user":
        return None
    if not isinstance(text, str) or not isinstance(instruction, str):
        return None
    start, end = instruction.rfind("<<<"), instruction.rfind(">>>")
    if start < 0 or end < start:
        return None
    return text, instruction[start + 3 : end]


_CURLY = str.maketrans({'"': "\u201c", "'": "\u2019"})


def _echo(anchor: str, style: str) -> tuple[str, ...]:
    """The tokens an ``"anchor"`` replica repeats ``anchor`` with (`Behaviour.anchor_echo`)."""
    if style == "none":
        return ()
    if style == "trim":
        anchor = anchor.strip()
    elif style == "space":
        anchor = "  " + anchor.replace(" ", "   \n ")
    elif style == "curly":
        anchor = anchor.translate(_CURLY)
    elif style == "preamble":
        anchor = "Continuing from there: " + anchor
    elif style == "lose":
        core = anchor.rstrip()
        anchor = core[:-1] + anchor[len(core) :]
    elif style == "twice":
        anchor = anchor + " " + anchor
    return tuple(re.findall(r"\s*\S+\s*", anchor)) or (anchor,)


def _after(texts: tuple[str, ...], chars: int) -> tuple[str, ...]:
    """The tokens that follow the first ``chars`` characters of their text."""
    out: list[str] = []
    at = 0
    for text in texts:
        if at + len(text) <= chars:
            at += len(text)
            continue
        out.append(text[max(chars - at, 0) :])
        at += len(text)
    return tuple(out)


_WIRES: dict[str, type[Wire]] = {
    "/v1/chat/completions": ChatWire,
    "/v1/messages": MessagesWire,
    "/v1/responses": ResponsesWire,
}


def _render(b: Behaviour, record: RequestRecord, wire: Wire) -> list[Step]:
    prefill = _prefill(record.json)
    size = _prompt_tokens(record.json) + _max_tokens(record.json)
    if b.context_window is not None and size > b.context_window:
        return _json_answer(400, wire.context_error(b.context_window, size))
    if prefill is not None and b.rejects_prefill:
        b = attrs.evolve(b, status=400, error_message=PREFILL_REJECTED)
    elif (
        prefill is not None
        and b.continuation == "vllm"
        and record.json.get("continue_final_message")
    ):
        b = attrs.evolve(b, tokens=_after(b.token_texts, len(prefill)))
    elif b.continuation == "anchor" and (asked := _anchor_request(record.json)) is not None:
        said, anchor = asked
        echo = _echo(anchor, b.anchor_echo)
        b = attrs.evolve(b, tokens=echo + _after(b.token_texts, len(said)))
    if b.is_error:
        extra = () if b.retry_after is None else (("retry-after", _seconds_header(b.retry_after)),)
        steps: list[Step] = [Wait(b.error_delay)] if b.error_delay else []
        body = wire.error_body(b.status, b.error_message)
        error = body.get("error")
        if isinstance(error, dict) and "code" in error:  # the OpenAI shapes
            if b.error_code is not None:
                error["code"] = b.error_code
            if b.error_param is not None:
                error["param"] = b.error_param
        return steps + _json_answer(b.status, body, extra)

    texts = b.token_texts
    prompt = _prompt_tokens(record.json)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": len(texts),
        "total_tokens": prompt + len(texts),
    }
    if not record.stream:
        return _render_whole(b, texts, wire, usage)

    head = Head(b.status, (("content-type", "text/event-stream"), ("cache-control", "no-cache")))
    # Headers and what precedes the first token go out at once: a queued request has them.
    steps = [head, *(Chunk(data) for data in wire.start())]
    thinking = b.reasoning_texts
    for i, text in enumerate(thinking):
        gap = b.ttft if i == 0 else b.token_delay
        if gap:
            steps.append(Wait(gap))
        steps.append(Chunk(wire.reasoning(text)))
    for i, text in enumerate(texts):
        gap = b.ttft if i == 0 and not thinking else b.token_delay
        if i and b.slow_after is not None and i >= b.slow_after:
            gap = b.slow_token_delay
        if b.stall_after == i:
            return [*steps, Stall(b.keepalive_interval)]
        if gap:
            steps.append(Wait(gap))
        if b.cut_after == i:
            return [*steps, Cut()]
        if b.inband_error_after == i:
            return [*steps, Chunk(wire.inband_error(b.inband_error_status, b.error_message))]
        if b.malformed_after == i:
            return [*steps, Chunk(wire.malformed()), Stall(None)]
        steps.append(Chunk(wire.content(text), tokens=1))
    if b.stall_after is not None:  # stall_after >= number of tokens: stall before finishing
        return [*steps, Stall(b.keepalive_interval)]
    for i, fragment in enumerate(wire.tool_fragments(b.tool_calls)):
        gap = b.ttft if i == 0 and not texts and not thinking else b.token_delay
        if gap:
            steps.append(Wait(gap))
        if b.cut_after_fragments == i:
            return [*steps, Cut()]
        steps.append(Chunk(fragment))
    if not texts and not thinking and not b.tool_calls and b.ttft:
        steps.append(Wait(b.ttft))
    if b.cut_after is not None:
        return [*steps, Cut()]
    ending = wire.finish(b.finish_reason, usage if b.usage else None, end=b.send_done)
    steps += [Chunk(data) for data in ending]
    return steps


def _render_whole(
    b: Behaviour, texts: tuple[str, ...], wire: Wire, usage: dict[str, int]
) -> list[Step]:
    """A non-stream answer: nothing until the last token is due, then the whole JSON."""

    def due(n: int) -> float:  # when token n (0-based) is due
        return b.ttft + n * b.token_delay

    if b.stall_after is not None:
        return [Stall(None)]  # no answer ever comes, so when the stall starts is moot
    if b.cut_after is not None:
        return [Wait(due(min(b.cut_after, len(texts)))), Cut()]
    wait = due(max(len(texts) - 1, 0))
    body = wire.whole(
        "".join(texts),
        "".join(b.reasoning_texts),
        b.tool_calls,
        b.finish_reason,
        usage if b.usage else None,
    )
    head, whole = _json_answer(b.status, body)
    assert isinstance(whole, Chunk)
    return [*([Wait(wait)] if wait else []), head, Chunk(whole.data, tokens=len(texts))]
