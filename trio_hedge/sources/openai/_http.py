"""OpenAI-compatible chat completions over httpx: one implementation of
[`Source`][trio_hedge.sources.Source].

An attempt is ``POST {base_url}/chat/completions`` with ``"stream": true``; it is *open* when
a 2xx arrives with its headers, which is not a first token (servers answer 200 while the
request is still queued). Bytes go through [`ChunkDecoder`][trio_hedge.sources.openai.ChunkDecoder].
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal, Protocol
from urllib.parse import urlsplit

import attrs
import httpx
import trio

from ..._cancel_safe import setup_cut_short
from ..._redact import Redactor, protect_in_logs
from ..._source import AttemptInfo
from ..._validate import (
    check_api_key,
    check_header_name,
    check_headers,
    check_json_body,
    positive_int_or_none,
)
from ...errors import AttemptError, ErrorKind
from ...events import Delta
from ...transport import http2_connections
from .._aclose import aclose_nested
from ..probes import LoadProbe, as_probe
from ._codec import ChunkDecoder, decode_json_body
from ._errors import (
    classify_http_error,
    request_line,
    send_error,
    sent_body,
    transport_error,
    with_context,
    without_frames,
)

__all__ = [
    "HTTPAttempt",
    "HTTPSource",
    "HeaderNames",
    "OpenAIChatSource",
    "Replica",
    "StreamDecoder",
    "TransportErrors",
    "attempt_for",
    "is_guided",
]

#: How much of an error body is read to classify it (bytes).
ERROR_BODY_LIMIT = 4096
#: The largest non-streamed JSON answer accepted (bytes).
JSON_BODY_LIMIT = 8 * 1024 * 1024
#: After ``[DONE]``, how long (seconds) and how many bytes closing an attempt may read to reach
#: the end of the HTTP body, so an HTTP/1.1 connection goes back to the pool (see
#: ``HTTPAttempt.aclose``).
DRAIN_TIMEOUT = 0.05
DRAIN_LIMIT = 65536


def _check_header_name(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        check_header_name(value, attribute.name)


@attrs.frozen
class HeaderNames:
    """Which headers carry the request id and the attempt number (``None`` switches one off).

    The request id is a UUID4 shared by every attempt of one request, so server logs can join
    them; it is a bare UUID because some servers (llama.cpp's) answer 400 to an
    ``X-Request-ID`` that is not one. The attempt number (1 = primary) goes in its own header,
    like gRPC's ``grpc-previous-rpc-attempts`` (gRFC A6).

    Attributes:
        request_id: the request id's header. Default ``"X-Request-ID"``.
        attempt: the attempt number's header. Default ``"X-Hedge-Attempt"``.

    Raises:
        TypeError: a name that is not a ``str`` (or ``None``).
        ValueError: a name that is not an HTTP header name (an RFC 9110 token).
    """

    request_id: str | None = attrs.field(default="X-Request-ID", validator=_check_header_name)
    attempt: str | None = attrs.field(default="X-Hedge-Attempt", validator=_check_header_name)


def attempt_headers(
    base: Mapping[str, str], names: HeaderNames, info: AttemptInfo
) -> dict[str, str]:
    """``base`` plus what says which request and attempt this is: the request id and attempt
    number under ``names``, and the request's ``Idempotency-Key`` when it has one (the HTTP
    source's headers and the openai-SDK source's ``extra_headers``)."""
    headers = dict(base)
    if names.request_id is not None:
        headers[names.request_id] = info.request_id
    if names.attempt is not None:
        headers[names.attempt] = str(info.number)
    if info.idempotency_key is not None:
        headers["Idempotency-Key"] = info.idempotency_key
    return headers


@functools.lru_cache(maxsize=1024)
def parsed_url(url: str) -> httpx.URL:
    """``url`` parsed once: httpx parses a ``str`` URL on every request (about 30 µs of
    ``build_request``'s 75 here, per attempt); an ``httpx.URL`` is immutable, so one per
    replica and path serves every request. (Replica URLs come from configuration: the cache
    is bounded all the same.)"""
    return httpx.URL(url)


def _strip_slash(url: object) -> str:
    if not isinstance(url, str):
        raise TypeError(f"base_url must be a str, not {type(url).__name__}")
    return url.rstrip("/")


def _check_url(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    assert isinstance(value, str)  # _strip_slash checked it
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"base_url must be an http(s) URL, not {value!r}")
    if parts.username or parts.password:
        raise ValueError("base_url must not carry credentials; use api_key")


def _default_name(replica: Replica) -> str:
    return urlsplit(replica.base_url).netloc


def _as_dict(mapping: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(mapping, Mapping):
        raise TypeError(f"expected a mapping, not {type(mapping).__name__}")
    return dict(mapping)


def _check_api_key(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_api_key(value, attribute.name)


def _check_headers(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_headers(value, attribute.name)


def _check_overrides(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_json_body(value, attribute.name)


def _check_path(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a str, not {type(value).__name__}")
    if not value.startswith("/") or any(not "!" <= c <= "~" for c in value):
        raise ValueError(f"{attribute.name} must be a URL path starting with '/', not {value!r}")


#: What each declared engine does with an assistant-last request (``Source.continues``) and
#: the fields that ask for it: vLLM continues the final message when told to (and answers only
#: what follows); llama.cpp's server continues an assistant-last message by itself, and its
#: answer repeats the prefix.
_CONTINUATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "vllm": ("appends", {"continue_final_message": True, "add_generation_prompt": False}),
    "llama.cpp": ("repeats", {}),
    "anchor": ("anchor", {}),
}
#: The declarations another API's replica may make (the engines' own contracts are their
#: chat endpoints'; the anchor method is an instruction, any API can take it).
_ANY_API_CONTINUATIONS = ("anchor",)

#: Body fields that constrain decoding (vLLM's ``guided_*`` and ``structured_outputs``,
#: llama.cpp's ``grammar`` and ``json_schema``, SGLang's ``regex`` and ``ebnf``, Anthropic's
#: ``output_format``): a continuation would restart the constraint at its root.
_GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "grammar",
    "json_schema",
    "regex",
    "ebnf",
    "output_format",
)


def is_guided(body: Mapping[str, Any]) -> bool:
    """Whether a request body asks for guided decoding: a ``response_format`` (chat) or
    ``text.format`` (Responses) other than plain text, or a field of `_GUIDED_FIELDS`. Such
    a request is never continued, only replayed and verified: the constraint would start
    again at its root inside the answer (duplicated or nested JSON; NVIDIA Dynamo never
    migrates such requests)."""
    if any(body.get(name) not in (None, False) for name in _GUIDED_FIELDS):
        return True
    fmt = body.get("response_format")
    text = body.get("text")
    if isinstance(text, Mapping) and fmt is None:
        fmt = text.get("format")
    if fmt is None:
        return False
    kind = fmt.get("type") if isinstance(fmt, Mapping) else fmt
    return kind != "text"


#: The chat-completions fields that cap an answer's tokens (``max_tokens`` is the older
#: name; both are honoured by vLLM and llama.cpp's server).
_TOKEN_LIMITS = ("max_completion_tokens", "max_tokens")
#: Tokens an anchor continuation's limit gets back for the repeat of the anchor (its ~40
#: characters at 2 characters a token and more: generous, so the answer never stops
#: earlier than it would have; at worst it runs this many tokens past the caller's limit).
ANCHOR_REPEAT_TOKENS = 24


def _token_limit(body: Mapping[str, Any], fields: Sequence[str]) -> int | None:
    """The first of ``fields`` the body sets to a positive int, or ``None``."""
    for name in fields:
        limit = body.get(name)
        if type(limit) is int and limit > 0:
            return limit
    return None


def _as_probe(value: object) -> LoadProbe | None:
    return as_probe(value, "probe")


def _check_priority(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{attribute.name} must be an int or None")


def _redacted_headers(headers: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{k!r}: '***'" for k in headers) + "}"


@attrs.frozen
class Replica:
    """An OpenAI-compatible endpoint (a replica, instance, zone or provider).

    Attributes:
        base_url: e.g. ``"https://api.example.com/v1"``; the attempt posts to
            ``{base_url}/chat/completions``.
        api_key: sent as ``Authorization: Bearer …``; never shown in reprs, reports, logs or
            errors. Default ``None`` (no header).
        name: a short name for reports; default the URL's ``host:port``.
        overrides: JSON fields merged over the request body for this replica (e.g. a smaller
            ``model`` for the backup). Default none.
        headers: extra request headers (values hidden in reprs, as they may be secrets).
        path: the path under ``base_url``. Default ``"/chat/completions"``.
        context_window: the model's context window in tokens (prompt and answer), or
            ``None`` (default: unknown). A [`Hedger`][trio_hedge.Hedger] skips a replica whose
            window is smaller than a request (its estimated prompt tokens plus
            ``max_tokens``) when another replica can take it, and after a context-length
            error fails over to a replica that declares a larger window (a larger model as
            backup) instead of failing the request; an undeclared window is learned from the
            context-length errors it answers (``docs/recovery.md``).
        fallback: ``True`` for a lesser replica (another, smaller or costlier model) that a
            [`Hedger`][trio_hedge.Hedger] sends an attempt to only when no peer (a replica
            not marked) can take it within ``HedgerConfig.fallback_wait``; a peer's single
            500 or short ``Retry-After`` is retried once before falling back. Default
            ``False`` (a peer: raced as usual).
        continuation: how this replica's engine continues an answer begun elsewhere, for a
            recovery after the commit (``docs/recovery.md``): ``"vllm"`` (the text so far
            as a final assistant message with ``continue_final_message: true,
            add_generation_prompt: false``; it answers only what follows), ``"llama.cpp"``
            (the same message, which its server continues by default; its answer repeats the
            prefix, which is verified and stripped), ``"anchor"`` (for targets without
            assistant prefill, any API: the text so far as an assistant turn, then a user
            turn asking the model to go on, repeating the text's last ~40 characters first;
            the repeat is found, verified and trimmed, and a missing or doubled one fails the
            recovery: ``docs/recovery.md``), or ``None`` (default: never asked to; hosted
            APIs that reject assistant prefill, such as newer Claude models, answer 400).
            Without one, a recovery on this replica replays the request and verifies it.
            Declare it; it is never guessed. ``"vllm"`` and ``"llama.cpp"`` are for chat
            completions (the engines' contracts are their chat endpoints'): another API's
            replica raises ``ValueError``. A request under guided decoding (a
            ``response_format`` JSON schema, a grammar, vLLM's ``guided_*``) is never
            continued, only replayed. A backup's ``backup_priority`` goes in a
            continuation's body too, and its token limit (``max_tokens`` /
            ``max_completion_tokens``; Messages ``max_tokens``, Responses
            ``max_output_tokens``) is lowered by the tokens the caller already has (never
            below 1; an anchor continuation's gets the anchor's repeat back). The engine
            re-tokenizes the text it is given, so its answer is a continuation of that text,
            not always the very tokens the first replica would have generated
            (docs/recovery.md, "On real engines").
        probe: read the engine's own load
            ([`LoadProbe`][trio_hedge.sources.probes.LoadProbe], or an engine name:
            ``"vllm"``, ``"llama.cpp"``, ``"sglang"``, ``"tgi"``) so a
            [`Hedger`][trio_hedge.Hedger] sees the queue other tenants put on it. Default
            ``None`` (the Hedger's own view only).
        backup_priority: sent as the body's ``"priority"`` on every attempt after the
            primary (a hedge or failover), so an engine with priority scheduling serves the
            tenants' requests first (vLLM with ``--scheduling-policy priority``: lower values
            first, default 0, so give e.g. 1; SGLang with priority scheduling: check which
            way its ``--schedule-low-priority-values-first`` orders). On vLLM it orders only
            *waiting* requests: nothing preempts a running prefill. Default ``None``.

    Raises:
        TypeError, ValueError: a bad URL, name or path, a URL with embedded credentials, an
            ``api_key`` that is not a non-empty ``str`` an HTTP header can carry (a CR, LF or
            NUL -- a key read from a file ends in a newline --, another control character,
            a non-ASCII character, leading or trailing whitespace), a bad header name or
            value, or ``overrides`` that do not encode to strict JSON (``NaN``,
            ``Infinity``, ``bytes``…). Messages name the field, never the value.
    """

    base_url: str = attrs.field(validator=_check_url, converter=_strip_slash)
    api_key: str | None = attrs.field(
        default=None, validator=_check_api_key, repr=False, kw_only=True
    )
    name: str = attrs.field(
        default=attrs.Factory(_default_name, takes_self=True),
        validator=attrs.validators.instance_of(str),
        kw_only=True,
    )
    overrides: Mapping[str, Any] = attrs.field(
        factory=dict, converter=_as_dict, validator=_check_overrides, kw_only=True
    )
    headers: Mapping[str, str] = attrs.field(
        factory=dict,
        converter=_as_dict,
        validator=_check_headers,
        repr=_redacted_headers,
        kw_only=True,
    )
    path: str = attrs.field(default="/chat/completions", validator=_check_path, kw_only=True)
    context_window: int | None = attrs.field(
        default=None, validator=positive_int_or_none, kw_only=True
    )
    fallback: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool), kw_only=True
    )
    continuation: Literal["vllm", "llama.cpp", "anchor"] | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.in_(tuple(_CONTINUATIONS))),
        kw_only=True,
    )
    probe: LoadProbe | None = attrs.field(
        default=None,
        converter=_as_probe,
        kw_only=True,
    )
    backup_priority: int | None = attrs.field(default=None, validator=_check_priority, kw_only=True)
    # Masks the key and header values wherever a server might quote them back.
    _redact: Redactor = attrs.field(
        init=False,
        repr=False,
        eq=False,
        default=attrs.Factory(
            lambda self: Redactor((self.api_key, *self.headers.values())), takes_self=True
        ),
    )

    def __attrs_post_init__(self) -> None:
        key_header = self._key_header
        if self.api_key is not None and any(n.lower() == key_header for n in self.headers):
            raise ValueError(
                f"give the key as api_key or as an {key_header} header, not both "
                "(both would be sent)"
            )
        if (
            self.continuation is not None
            and self.api != "chat"
            and self.continuation not in _ANY_API_CONTINUATIONS
        ):
            # The engines' continuation contracts are their chat-completions endpoints'; a
            # recovery on another API's replica replays and verifies, or goes by anchor.
            raise ValueError(
                f"continuation={self.continuation!r} is for chat-completions replicas, not "
                f"{self.api!r} (which take 'anchor', or none: replay and verify)"
            )
        protect_in_logs(self._redact)

    #: The API this kind of replica speaks (one request body fits one API, so the front doors
    #: refuse a list of replicas that mix them).
    api: ClassVar[str] = "chat"
    #: What ``bind`` makes (set below for chat completions; each API's replica its own).
    _source_class: ClassVar[type[HTTPSource]]
    #: The (lower-case) header ``api_key`` goes in.
    _key_header: ClassVar[str] = "authorization"

    def _key_headers(self) -> dict[str, str]:
        """The headers that carry ``api_key`` (sent over the replica's own headers)."""
        return {} if self.api_key is None else {"authorization": f"Bearer {self.api_key}"}

    def _default_headers(self) -> dict[str, str]:
        """The headers every attempt sends unless the replica's or the request's replace
        them (lower-case names)."""
        return {"accept": "text/event-stream", "content-type": "application/json"}

    #: ``bind`` sends through the front door's ``httpx.AsyncClient``.
    needs_http_client: ClassVar[bool] = True

    def check_request(self, request: object) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``request`` is a chat-completions JSON
        body (a mapping that encodes to strict JSON); the message names the field, never the
        value. The front doors call it before any I/O."""
        if not isinstance(request, Mapping):
            raise TypeError("request must be the chat-completions JSON body (a mapping)")
        check_json_body(request, "request")

    def bind(
        self,
        request: Mapping[str, Any],
        client: httpx.AsyncClient | None,
        *,
        headers: HeaderNames | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> HTTPSource:
        """This replica as a [`Source`][trio_hedge.sources.Source] for one request;
        ``extra_headers`` are added to every attempt of this request (over the replica's own
        ``headers``).

        Raises:
            TypeError: ``client`` is ``None`` (an HTTP replica needs one).
        """
        if client is None:
            raise TypeError(f"a {type(self).__name__} needs an httpx.AsyncClient to bind to")
        return self._source_class(
            self, request, client, headers or HeaderNames(), extra_headers=extra_headers
        )


class StreamDecoder(Protocol):
    """What an HTTP attempt reads its body through: one per response (the chat codec's
    [`ChunkDecoder`][trio_hedge.sources.openai.ChunkDecoder], or another API's)."""

    done: bool
    error: AttemptError | None
    data_events: int

    def feed(self, data: bytes) -> list[Delta]: ...

    def end(self) -> list[Delta]: ...


class HTTPSource:
    """One request bound to one replica over one ``httpx.AsyncClient``: builds the request,
    sends it, classifies an error answer and reads the body through the API's decoder. The
    API's source says which decoder (`_decoder`) and how a whole JSON answer reads
    (`_decode_whole`)."""

    def __init__(
        self,
        replica: Replica,
        request: Mapping[str, Any],
        client: httpx.AsyncClient,
        header_names: HeaderNames,
        *,
        extra_headers: Mapping[str, str] | None = None,
    ) -> None:
        if extra_headers is not None:
            check_headers(extra_headers, "extra_headers")
        self._replica = replica
        self._client = client
        self._header_names = header_names
        body = self._body = {**request, **replica.overrides, "stream": True}
        try:
            # Strict JSON: json.dumps would write NaN/Infinity, which servers refuse or misread.
            self._content = json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
        except (TypeError, ValueError):
            check_json_body(body, "request")  # raises, naming the path
            raise
        #: The most tokens an answer to this request may have (`Source.token_limit`).
        self.token_limit = _token_limit(body, self._limit_fields)
        declared = _CONTINUATIONS.get(replica.continuation or "")
        #: How this source continues an answer (`Source.continues`), as its replica declares;
        #: never under guided decoding (`is_guided`: replay and verify only).
        self.continues = None if declared is None or is_guided(body) else declared[0]
        model = body.get("model")
        #: The model this request asks the replica for (`Source.model`), or ``None``.
        self.model: str | None = model if isinstance(model, str) and model else None
        # A backup's body: the engine may serve it after the tenants' requests (made on the
        # first backup: most requests have none).
        self._priority = replica.backup_priority
        self._backup_content: bytes | None = None
        self._url = replica.base_url + replica.path
        # Names lower-cased: HTTP names are case-insensitive, and httpx would send "Accept"
        # and "accept" (or two authorizations) as two headers.
        headers = replica._default_headers()
        headers.update((name.lower(), value) for name, value in replica.headers.items())
        if extra_headers:
            headers.update((name.lower(), value) for name, value in extra_headers.items())
        headers.update(replica._key_headers())
        self._headers = headers
        # What a server might quote back in an error message ("Incorrect API key provided:
        # sk-…", "Received API Key = sk-...1337"): masked in every AttemptError this source
        # raises, before the message is cut.
        self._redact = replica._redact
        if extra_headers:
            self._redact = Redactor(
                (replica.api_key, *replica.headers.values(), *extra_headers.values())
            )
            protect_in_logs(self._redact)

    @property
    def name(self) -> str:
        return self._replica.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(replica={self._replica!r})"

    #: The body's fields that cap an answer's tokens (`Source.token_limit`), the one an
    #: engine honours first, first; none for an API whose end by length is not a chat
    #: ``finish_reason`` (a recovery there replays, and the replay ends by length itself).
    _limit_fields: ClassVar[tuple[str, ...]] = ()
    #: The body's fields that cap an answer's tokens, lowered in a continuation's body.
    _continue_limits: ClassVar[tuple[str, ...]] = _TOKEN_LIMITS
    #: The decoder of one response body (``ChunkDecoder(redact=…)`` for chat completions).
    _stream_decoder: ClassVar[Callable[..., StreamDecoder]]
    #: How a whole ``application/json`` answer reads: ``(status, headers, body, *, redact)`` to
    #: its deltas, or the classified error raised.
    _whole_decoder: ClassVar[Callable[..., list[Delta]]]

    def _decoder(self, redact: Redactor) -> StreamDecoder:
        return self._stream_decoder(redact=redact)

    def _decode_whole(
        self, status: int, headers: Mapping[str, str], body: bytes, redact: Redactor
    ) -> list[Delta]:
        return self._whole_decoder(status, headers, body, redact=redact)

    def _content_for(self, info: AttemptInfo) -> bytes:
        """The body attempt ``info`` sends: the request's; after the primary with the
        replica's ``backup_priority``; for a recovery by continuation, the text so far as a
        final assistant message with the engine's fields (and the priority: both apply)."""
        priority = None if info.number == 1 else self._priority
        if info.continue_from is not None and self.continues is not None:
            return self._continuation(
                info.continue_from, info.continue_tokens, priority, info.instruction
            )
        if priority is None:
            return self._content
        if self._backup_content is None:
            body = {**self._body, "priority": priority}
            self._backup_content = json.dumps(body, ensure_ascii=False).encode()
        return self._backup_content

    def _continuation(
        self, text: str, tokens: int, priority: int | None, instruction: str | None = None
    ) -> bytes:
        """The body that asks this replica's engine to continue ``text`` (a recovery), the
        caller already having ``tokens`` of it: its token limits lowered by as many (never
        below 1), as the engine counts only what it generates after the prefill. With an
        ``instruction`` (the anchor method), the text goes as an assistant turn and the
        instruction as a user turn after it, and the limit gets back the tokens the
        anchor's repeat takes (`ANCHOR_REPEAT_TOKENS`)."""
        assert self._replica.continuation is not None  # the race asks only sources that say
        fields = _CONTINUATIONS[self._replica.continuation][1]
        turns = [{"role": "assistant", "content": text}]
        if instruction is not None:
            turns.append({"role": "user", "content": instruction})
            tokens -= ANCHOR_REPEAT_TOKENS
        body = {**self._with_turns(turns), **fields}
        for name in self._continue_limits:
            limit = body.get(name)
            if type(limit) is int:
                body[name] = max(1, limit - tokens)
        if priority is not None:
            body["priority"] = priority
        return json.dumps(body, ensure_ascii=False, allow_nan=False).encode()

    def _with_turns(self, turns: list[dict[str, Any]]) -> dict[str, Any]:
        """The request's body with ``turns`` after its conversation (chat and Messages:
        its ``messages``)."""
        return {**self._body, "messages": [*self._body.get("messages", ()), *turns]}

    async def open(self, info: AttemptInfo) -> HTTPAttempt:
        headers = attempt_headers(self._headers, self._header_names, info)
        content = self._content_for(info)
        request = self._client.build_request(
            "POST", parsed_url(self._url), content=content, headers=headers
        )
        request.stream = _Body(content)
        try:
            response = await self._client.send(request, stream=True)
        except BaseException as exc:
            # Any way out before the response headers -- a cancel (alone, or inside a group
            # from a pending connect), a transport error, a stray error from the HTTP/2
            # stack: over HTTP/2 httpcore drops the stream without telling the server (see
            # _reset_orphan_http2_streams).
            with trio.CancelScope(shield=True, deadline=trio.current_time() + 1.0):
                await _reset_orphan_http2_streams(self._client)
            if not isinstance(exc, Exception):
                raise
            raise send_error(exc, request, self._redact) from without_frames(exc)
        try:
            return await self._attempt_for(response)
        except BaseException:
            # Shielded and bounded; a failing close must not replace the error being raised.
            with (
                trio.CancelScope(shield=True, deadline=trio.current_time() + 1.0),
                contextlib.suppress(Exception),
            ):
                await _close_response(response, finished=False)
            raise

    async def _attempt_for(self, response: httpx.Response) -> HTTPAttempt:
        return await attempt_for(
            response,
            self._redact,
            kind=self._attempt_kind(),
            whole_decoder=self._whole_decoder,
            stream_decoder=self._stream_decoder,
        )

    def _attempt_kind(self) -> Callable[..., HTTPAttempt] | None:
        """What makes this source's attempts (``None``: ``HTTPAttempt``)."""
        return None


class OpenAIChatSource(HTTPSource):
    """One chat-completions request bound to one [`Replica`][trio_hedge.sources.Replica] over
    one ``httpx.AsyncClient``."""

    _stream_decoder = ChunkDecoder
    _whole_decoder = staticmethod(decode_json_body)
    _limit_fields = _TOKEN_LIMITS


Replica._source_class = OpenAIChatSource


@attrs.frozen
class TransportErrors:
    """The exception classes of the HTTP library a response comes from: httpx for the HTTP
    source, httpx2 as well for the openai SDK's client (one reader for both)."""

    timeout: tuple[type[Exception], ...]
    transport: tuple[type[Exception], ...]
    any: tuple[type[Exception], ...]


HTTPX_ERRORS = TransportErrors(
    (httpx.TimeoutException,), (httpx.TransportError,), (httpx.HTTPError,)
)


class _Body(httpx.ByteStream):
    """The request body, whose async iterator is an object, not a generator: httpx's
    ``ByteStream.__aiter__`` is one, and a send cancelled while it is being written leaves it
    for the garbage collector (httpx issue 3686; failing case: ``tests/test_cancel_fuzz.py``)."""

    def __aiter__(self) -> _Once:
        return _Once(self._stream)


class _Once:
    """Yields one ``bytes`` chunk, then stops; nothing to finalise."""

    __slots__ = ("_chunk",)

    def __init__(self, chunk: bytes) -> None:
        self._chunk: bytes | None = chunk

    def __aiter__(self) -> _Once:
        return self

    async def __anext__(self) -> bytes:
        chunk, self._chunk = self._chunk, None
        if chunk is None:
            raise StopAsyncIteration
        return chunk


async def _read_bounded(response: httpx.Response, limit: int) -> bytes:
    body = bytearray()
    chunks = response.aiter_bytes()
    try:
        async for chunk in chunks:
            body += chunk
            if len(body) >= limit:
                break
    finally:
        await aclose_nested(chunks)  # left early: httpx's generators, closed here
    return bytes(body[:limit])


async def attempt_for(
    response: httpx.Response,
    redact: Redactor,
    errors: TransportErrors = HTTPX_ERRORS,
    kind: Callable[..., HTTPAttempt] | None = None,
    *,
    whole_decoder: Callable[..., list[Delta]] = decode_json_body,
    stream_decoder: Callable[..., StreamDecoder] = ChunkDecoder,
) -> HTTPAttempt:
    """The attempt a response opens, by its status and content type: an error status raises
    its classified error, a web page ``PROTOCOL``, a JSON answer is read whole and decoded
    (``whole_decoder``: [`decode_json_body`][trio_hedge.sources.openai.decode_json_body] for
    chat completions), anything else is read as an event stream (``stream_decoder``:
    [`ChunkDecoder`][trio_hedge.sources.openai.ChunkDecoder]). Every source opens its attempts
    here (one set of rules); ``errors`` are the classes of the library ``response`` comes
    from, ``kind`` what makes the attempt (default ``HTTPAttempt``)."""
    status = response.status_code
    sent = sent_body(response)  # the caller's words, which an error may quote back
    if not 200 <= status < 300:
        try:
            body = await _read_bounded(response, ERROR_BODY_LIMIT)
        except errors.any:
            body = b""
        error = classify_http_error(status, response.headers, body, redact=redact, sent=sent)
        if status == 400 and b"plain HTTP request was sent to HTTPS port" in body:
            # nginx's 400 page for http:// on a TLS port: the replica's URL is wrong, not
            # the request (it would be fatal as a plain 400).
            raise AttemptError(
                ErrorKind.PROTOCOL,
                redact(
                    f"HTTP 400 from {request_line(response.request)}: the server speaks TLS on "
                    "this port (a plain HTTP request was sent to an HTTPS port); use https://"
                ),
                status_code=status,
                hint="the port speaks TLS: use https://",
            )
        if status in (404, 405):
            # A wrong path or base_url (the server's own message rarely names it).
            where = request_line(response.request)
            missing_v1 = "/v1/" not in where
            hint = "; OpenAI-compatible servers usually serve /v1/…" if missing_v1 else ""
            error = with_context(error, redact(f"{where}{hint}"))
            if missing_v1:
                error.hint = "base_url usually ends in /v1"
        raise error
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("text/html"):
        # A web page (a proxy's login or landing page, an admin UI): never an event stream.
        raise AttemptError(
            ErrorKind.PROTOCOL,
            redact(
                f"HTTP {status} with Content-Type {content_type} from "
                f"{request_line(response.request)}: a web page, not an event stream; is "
                "base_url the API's (often ending in /v1)?"
            ),
            status_code=status,
            hint="a web page, not the API: is base_url the API's (often ending in /v1)?",
        )
    if content_type.startswith("application/json"):
        body = await _read_bounded(response, JSON_BODY_LIMIT + 1)
        if len(body) > JSON_BODY_LIMIT:
            raise AttemptError(
                ErrorKind.PROTOCOL, f"JSON answer larger than {JSON_BODY_LIMIT} bytes"
            )
        whole = whole_decoder(status, response.headers, body, redact=redact, sent=sent)
        decoder = stream_decoder(redact=redact, sent=sent)
        return (kind or HTTPAttempt)(response, whole, redact, errors, decoder)
    return (kind or HTTPAttempt)(
        response, None, redact, errors, stream_decoder(redact=redact, sent=sent)
    )


class HTTPAttempt:
    """One open HTTP attempt: reads SSE bytes, yields batches of
    [`Delta`][trio_hedge.events.Delta]."""

    __slots__ = (
        "_chunks",
        "_decoder",
        "_errors",
        "_exhausted",
        "_finished",
        "_ready",
        "_redact",
        "_response",
    )

    def __init__(
        self,
        response: httpx.Response,
        whole: Sequence[Delta] | None,
        redact: Redactor | None = None,
        errors: TransportErrors = HTTPX_ERRORS,
        decoder: StreamDecoder | None = None,
    ) -> None:
        self._response = response
        self._errors = errors
        self._redact = redact if redact is not None else Redactor()
        self._decoder = decoder if decoder is not None else ChunkDecoder(redact=self._redact)
        # Undecoded bytes skip httpx's content-decoder and re-chunking layers (hot path). A
        # compressed body, or one already read (an event hook called .read()), goes through
        # aiter_bytes(), which handles both.
        raw = (
            not response.is_stream_consumed
            and response.headers.get("content-encoding", "identity") == "identity"
        )
        self._chunks: AsyncIterator[bytes] = response.aiter_raw() if raw else response.aiter_bytes()
        # A non-streamed JSON answer arrives whole: one batch, then the end.
        self._ready: Sequence[Delta] | None = whole
        self._finished = whole is not None
        self._exhausted = whole is not None  # the body was read to its end

    async def receive(self) -> Sequence[Delta] | None:
        ready = self._ready
        if ready is not None:
            self._ready = None
            return ready or None
        if self._finished:
            return None
        decoder = self._decoder
        chunks = self._chunks
        while True:
            if decoder.error is not None:
                # An in-band error that arrived behind tokens in the last read: raise it now
                # rather than wait for a read that may never come. (The decoder masked any
                # secret the server quoted back.)
                raise decoder.error
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                self._finished = self._exhausted = True
                return decoder.end() or None
            except self._errors.timeout as exc:
                raise transport_error(ErrorKind.TIMEOUT, exc, self._redact) from without_frames(exc)
            except self._errors.transport as exc:
                # A cut after data is a truncated stream; before any data, a connection error.
                kind = ErrorKind.STREAM_TRUNCATED if decoder.data_events else ErrorKind.CONNECTION
                raise transport_error(kind, exc, self._redact) from without_frames(exc)
            deltas = decoder.feed(chunk)
            if decoder.done:
                self._finished = True
                return deltas or None
            if deltas:
                return deltas

    async def aclose(self) -> None:
        finished = self._finished
        try:
            if finished and not self._exhausted:
                # After [DONE]: if the body does not end in time, the HTTP/2 stream is reset.
                finished = await self._drain()
            await _close_response(self._response, finished=finished)
        finally:
            # Left before the body's end (a break, a cancel, a lost race): the response is
            # closed, and so are httpx's generators under the body, here rather than by the
            # garbage collector (nothing to do when the body was read to its end).
            await aclose_nested(self._chunks)

    async def _drain(self) -> bool:
        """Read what follows ``[DONE]`` (normally just the body's last chunk, often already
        received) to the end of the body, within ``DRAIN_TIMEOUT`` / ``DRAIN_LIMIT``.

        Why: closing a response before its end makes httpcore close the connection (no
        keep-alive: a new TCP and TLS handshake for the next request) and leaves httpx's
        nested async generators unfinished, for Trio's finaliser to close one task each.
        Measured (sequential 5-token streams, server in another process): 1,284 µs of client
        CPU per stream without this, ~720 µs with it, 474 µs for plain httpx reading to the
        end (``docs/benchmarks.md``).

        Returns whether the body's end was reached. Runs once (a later close skips it).
        """
        self._exhausted = True
        read = 0
        with trio.move_on_after(DRAIN_TIMEOUT):
            try:
                async for chunk in self._chunks:
                    read += len(chunk)
                    if read > DRAIN_LIMIT:
                        return False
            except self._errors.any:
                return False
            return True
        return False


async def _close_response(response: httpx.Response, *, finished: bool) -> None:
    if not finished and response.http_version == "HTTP/2":
        await _reset_http2_stream(response)
    await response.aclose()


async def _reset_http2_stream(response: httpx.Response) -> None:
    """Send RST_STREAM(CANCEL) for an unfinished HTTP/2 response (RFC 9113 §6.4).

    Why: httpcore 1.0.9 closes a cancelled HTTP/2 stream locally without telling the server,
    so a loser's server keeps generating until the whole connection closes (failing case:
    ``tests/test_http2.py::test_httpcore_alone_does_not_reset``). We reach through httpx's and
    httpcore's stream wrappers to the connection's h2 state; if that shape is not there (a
    different transport or version), we close the connection instead, which also stops the
    server at the cost of the connection's other streams.
    """
    stream: object = response.stream
    for attr in ("_stream", "_httpcore_stream", "_stream"):
        stream = getattr(stream, attr, None)
    connection = getattr(stream, "_connection", None)
    stream_id = getattr(stream, "_stream_id", None)
    h2_state = getattr(connection, "_h2_state", None)
    write = getattr(connection, "_write_outgoing_data", None)
    request = getattr(stream, "_request", None)
    if h2_state is not None and write is not None and isinstance(stream_id, int):
        import h2.errors  # only with HTTP/2, which needs h2 anyway
        import h2.exceptions

        try:
            h2_state.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.CANCEL)
        except h2.exceptions.StreamClosedError:
            # Already closed: the server reset it (or ended it) first, so it has stopped,
            # which is all a reset is for. Closing the connection instead would cut every
            # other request on it (failing case: tests/test_http2.py::
            # test_a_stream_the_server_resets_leaves_the_others_on_its_connection_alone).
            return
        except Exception:
            pass  # an h2 state we do not understand: fall through to closing the connection
        else:
            try:
                await write(request)
                return
            except Exception:  # the connection broke: closing it below is all that is left
                pass
    network_stream = response.extensions.get("network_stream")
    if network_stream is not None:
        await network_stream.aclose()


class _NoTimeouts:
    """Stands in for the httpcore request whose write timeouts ``_write_outgoing_data`` reads."""

    def __init__(self) -> None:
        self.extensions: dict[str, Any] = {}


async def _reset_orphan_http2_streams(client: httpx.AsyncClient) -> None:
    """Send RST_STREAM(CANCEL) for every HTTP/2 stream httpcore has abandoned, and close every
    HTTP/2 connection whose setup a cancel cut short.

    Why: when a request is cancelled before its response headers arrive, httpcore 1.0.9 forgets
    the stream (``_response_closed`` drops its event queue) but never resets it, so the server
    keeps working for nobody (failing case:
    ``tests/test_http2.py::test_httpcore_alone_does_not_reset_before_headers``). We hold no
    response to reset, so we look for orphans: streams still open in a connection's h2 state
    that httpcore no longer tracks. httpcore registers a stream in ``_events`` before its
    HEADERS create it in the h2 state, with no checkpoint between, so an orphan is never a
    stream some other request is still using; resetting it only stops work nobody will read.

    A connection whose setup a cancel cut short (``trio_hedge._cancel_safe.setup_cut_short``:
    its stream semaphore is over-full, so the next request fails and its stream is never
    reset; failing case: ``tests/test_http2.py::
    test_a_cancel_during_connection_setup_leaves_no_stream_running``) cannot be mended from
    outside: it is closed, which ends every stream on it for its server (requests running
    there fail as connection errors, which fail over), and the pool opens a sound one for the
    next request. Transports from
    [`cancel_safe_transport`][trio_hedge.transport.cancel_safe_transport] (``make_client`` with
    HTTP/2) close it earlier, as the cancelled request leaves it.
    """
    connections = http2_connections(client)
    if not connections:
        return
    import h2.errors  # HTTP/2 is in use, so h2 is installed

    for outer, connection in connections:
        if setup_cut_short(connection):
            with contextlib.suppress(Exception):
                await outer.aclose()
            continue
        h2_state, tracked = connection._h2_state, connection._events
        orphans = [
            stream_id
            for stream_id, stream in list(h2_state.streams.items())
            if stream_id not in tracked and not stream.closed
        ]
        if not orphans:
            continue
        try:
            for stream_id in orphans:
                h2_state.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.CANCEL)
            await connection._write_outgoing_data(_NoTimeouts())
        except Exception:
            # No reset can be sent: the connection is dead to h2 (h2 raised a protocol error
            # reading what the server sent and queued its GOAWAY, which httpcore never
            # writes; the failing case was a server that lost a HEADERS frame), or its socket
            # broke. httpcore would keep the socket open until the connection expires, and
            # the server would go on working: closing it is the reset that is left.
            with contextlib.suppress(Exception):
                await outer.aclose()
