"""The official ``openai`` SDK as a [`Source`][trio_hedge.sources.Source]: race
``client.chat.completions.create(..., stream=True)`` over your own ``AsyncOpenAI`` clients.

``openai.AsyncOpenAI`` runs under Trio (it is built on httpx and anyio, both of which detect
Trio): streaming works, and cancelling a task inside its stream closes the HTTP response (the
server saw the disconnect within a millisecond over loopback, ``tests/test_openai_sdk.py``).
Leaving its stream early *without* cancelling leaves the response open until
``AsyncStream.close()``: an attempt here always closes it.

Each attempt is one ``create(**request, stream=True)`` call on the replica's client, whose
``ChatCompletionChunk``s become [`SDKChunkDelta`][trio_hedge.sources.openai_sdk.SDKChunkDelta]
events (a [`Delta`][trio_hedge.events.Delta] that keeps the ``chunk``): iterate the stream for
``str`` tokens, or [`sdk_chunks`][trio_hedge.sources.openai_sdk.sdk_chunks] for the SDK's own
chunk objects.

The response is read as the HTTP source reads its own, by the same code (its status and
content type, [`ChunkDecoder`][trio_hedge.sources.openai.ChunkDecoder],
[`decode_json_body`][trio_hedge.sources.openai.decode_json_body]): the SDK's own stream is
never iterated, so a replica's quirk (an empty keep-alive ``data:`` line, vLLM's
``{"object": "error", ...}`` event, a JSON answer from a server that ignores ``stream: true``)
is handled alike by both sources (``tests/test_source_parity.py`` serves every shared case and
fault to both). What ``create()`` raises is classified by the HTTP source's rules
([`classify_http_error`][trio_hedge.sources.openai.classify_http_error]):
``openai.APIStatusError`` by its status code, headers (``Retry-After``) and body;
``APITimeoutError`` is a timeout; ``APIConnectionError`` a connection error (a failed TLS
handshake a protocol error, as the HTTP source names it); a cut once data arrived is a
truncated stream.

Retries: the SDK retries 408/409/429/5xx and connection errors itself (``max_retries``, default
2, with backoff of 0.5–8 s) *inside* one call, which would hide a failing replica from the race
(no failover until its retries are spent) and from the Hedger's health, budget and throttle.
Attempts therefore use ``client.with_options(max_retries=0)`` (a copy sharing your client's
connection pool, made once per client): the race is the retry policy.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import httpx
import trio

from .._redact import Redactor, protect_in_logs
from .._source import AttemptInfo
from .._validate import check_headers
from ..errors import AttemptError, ErrorKind
from ..events import Delta
from .openai._errors import (
    _in_band_error,
    _Sent,
    classify_http_error,
    sent_body,
    tls_failure,
)
from .openai._http import (
    ERROR_BODY_LIMIT,
    HeaderNames,
    HTTPAttempt,
    TransportErrors,
    attempt_for,
    attempt_headers,
)
from .openai._json import _loads

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletionChunk

__all__ = [
    "OpenAISDKSource",
    "SDKChunkDelta",
    "SDKReplica",
    "openai_sdk_sources",
    "sdk_chunks",
    "sdk_replicas",
]


@attrs.frozen(slots=True)
class SDKChunkDelta(Delta):
    """A [`Delta`][trio_hedge.events.Delta] that carries the SDK's ``ChatCompletionChunk`` it was
    made from, for code that wants the SDK's own objects.

    Attributes:
        chunk: the SDK's chunk (not part of equality or the repr); the other fields are
            [`Delta`][trio_hedge.events.Delta]'s.
    """

    chunk: ChatCompletionChunk | None = attrs.field(default=None, eq=False, repr=False)


_NO_RETRIES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _without_retries(client: AsyncOpenAI) -> AsyncOpenAI:
    """``client.with_options(max_retries=0)``, made once per client (a copy costs)."""
    if client.max_retries == 0:
        return client
    copy = _NO_RETRIES.get(client)
    if copy is None:
        copy = _NO_RETRIES[client] = client.with_options(max_retries=0)
    return copy


def _transport_errors() -> TransportErrors:
    """The exception classes of httpx and of httpx2 (the openai SDK 3.x client)."""
    timeouts: list[type[Exception]] = [httpx.TimeoutException]
    transport: list[type[Exception]] = [httpx.TransportError]
    every: list[type[Exception]] = [httpx.HTTPError]
    try:
        import httpx2
    except ImportError:
        pass
    else:
        timeouts.append(httpx2.TimeoutException)
        transport.append(httpx2.TransportError)
        every.append(httpx2.HTTPError)
    return TransportErrors(tuple(timeouts), tuple(transport), tuple(every))


def _sdk_delta(delta: Delta) -> SDKChunkDelta:
    """``delta`` with the SDK's ``ChatCompletionChunk`` of its event (built as the SDK builds
    its own: ``construct``, no validation); a whole JSON answer gets the chunk it stands for."""
    from openai.types.chat import ChatCompletionChunk

    obj = _loads(delta.raw) if delta.raw is not None else None
    if type(obj) is not dict:
        obj = _chunk_object(delta)
    return SDKChunkDelta(
        delta.content,
        delta.reasoning,
        delta.tool_calls,
        delta.finish_reason,
        delta.usage,
        delta.role,
        delta.raw,
        chunk=ChatCompletionChunk.construct(**obj),
    )


def _chunk_object(delta: Delta) -> dict[str, Any]:
    """The chunk a non-streamed answer's Delta stands for (its id and model are not kept)."""
    fields: dict[str, Any] = {"role": delta.role, "content": delta.content or None}
    if delta.tool_calls:
        fields["tool_calls"] = [
            {
                "index": call.index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in delta.tool_calls
        ]
    if delta.reasoning:
        fields["reasoning_content"] = delta.reasoning
    return {
        "id": "",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "",
        "choices": [{"index": 0, "delta": fields, "finish_reason": delta.finish_reason}],
        "usage": delta.usage,
    }


class _SDKAttempt(HTTPAttempt):
    """The SDK's response read as the HTTP source reads its own (one decoder, one set of
    rules for keep-alives, in-band errors and JSON answers), each Delta with its SDK chunk."""

    __slots__ = ()

    task_bound = False  # the response holds no cancel scope between reads

    async def receive(self) -> Sequence[Delta] | None:
        deltas = await super().receive()
        if deltas is None:
            return None
        return [_sdk_delta(delta) for delta in deltas]


class _Classifier:
    """SDK exceptions -> [`AttemptError`][trio_hedge.AttemptError], by the HTTP source's rules, keys
    masked."""

    def __init__(self, redact: Redactor) -> None:
        import openai

        self._openai = openai
        self.redact = redact
        self.errors = _transport_errors()

    def classify(self, exc: BaseException) -> AttemptError:
        openai = self._openai
        error: AttemptError
        if isinstance(exc, AttemptError):
            error = exc
        elif isinstance(exc, openai.APIStatusError):
            error = classify_http_error(
                exc.status_code,
                exc.response.headers,
                _body(exc),
                redact=self.redact,
                sent=sent_body(exc.response),
            )
        elif isinstance(exc, (openai.APITimeoutError, *self.errors.timeout)):
            error = AttemptError(ErrorKind.TIMEOUT, self.redact(f"{type(exc).__name__}: {exc}"))
        elif isinstance(exc, (openai.APIConnectionError, *self.errors.transport)):
            # A failed TLS handshake is named as the HTTP source names it (PROTOCOL).
            # (httpx's ``.request`` raises when unset; its ``_request`` is None then.)
            request = exc.request if isinstance(exc, openai.APIError) else exc._request  # type: ignore[attr-defined]
            tls = None if request is None else tls_failure(exc, request)
            if tls is not None:
                error = AttemptError(ErrorKind.PROTOCOL, self.redact(tls))
            else:
                message = self.redact(f"{type(exc).__name__}: {exc}")
                error = AttemptError(ErrorKind.CONNECTION, message)
        elif isinstance(exc, openai.APIError):
            # Any other API error the SDK raises with an error object as body.
            body = exc.body if exc.body is not None else exc.message
            sent = _Sent(sent_body(exc.request))  # the words the request itself sent
            error = _in_band_error({"error": body}, redact=self.redact, sent=sent)
        else:
            message = self.redact(f"{type(exc).__name__}: {exc}")
            error = AttemptError(ErrorKind.UNKNOWN, message, retryable=False)
        return error


def _body(exc: Any) -> bytes:
    """The start of an error response's body (the SDK has read it)."""
    try:
        content = exc.response.content
    except Exception:  # not read (closed early): the SDK's parsed body is all there is
        content = None
    if isinstance(content, bytes):
        return content[:ERROR_BODY_LIMIT]
    import json

    return json.dumps({"error": exc.body}).encode()[:ERROR_BODY_LIMIT]


def _check_client(client: object) -> None:
    try:
        import openai
    except ImportError as exc:  # pragma: no cover - exercised without the package
        raise ImportError(
            'the openai SDK source needs the openai package: pip install "trio-hedge[openai]", '
            'or from a clone pip install -e ".[openai]"'
        ) from exc
    if not isinstance(client, openai.AsyncOpenAI):
        hint = " (the sync client would block Trio)" if isinstance(client, openai.OpenAI) else ""
        raise TypeError(f"client must be an openai.AsyncOpenAI, not {type(client).__name__}{hint}")


def _check_overrides(overrides: object) -> dict[str, Any]:
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a mapping, not {type(overrides).__name__}")
    if overrides.get("stream", True) is not True:
        raise ValueError("overrides ask for stream=False: hedging needs a stream")
    return dict(overrides)


def _default_name(client: AsyncOpenAI) -> str:
    url = client.base_url
    return f"{url.host}:{url.port}" if url.port else str(url.host)


_CREATE_PARAMETERS: frozenset[str] | None = None


def _create_parameters() -> frozenset[str]:
    """The keyword arguments ``chat.completions.create`` takes (empty: it takes any)."""
    global _CREATE_PARAMETERS
    if _CREATE_PARAMETERS is None:
        import inspect

        from openai.resources.chat.completions import AsyncCompletions

        parameters = inspect.signature(AsyncCompletions.create).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            _CREATE_PARAMETERS = frozenset()
        else:
            _CREATE_PARAMETERS = frozenset(p.name for p in parameters if p.name != "self")
    return _CREATE_PARAMETERS


def _check_request(request: object) -> None:
    """Raise unless ``request`` is keyword arguments ``chat.completions.create`` can stream,
    once per attempt: a mapping of its parameters with ``model`` and ``messages`` (a list or
    tuple: a one-shot iterable would be empty for the backup), not ``stream=False``.

    Raises:
        TypeError: not a mapping; a key ``create()`` does not take (named); ``messages`` not
            a list or tuple.
        ValueError: no ``model`` or ``messages``; ``stream=False``.
    """
    if not isinstance(request, Mapping):
        raise TypeError(
            "request must be the chat.completions.create() keyword arguments (a mapping), "
            f"not {type(request).__name__}"
        )
    known = _create_parameters()
    if known:
        unknown = [key for key in request if key not in known]
        if unknown:
            raise TypeError(
                f"request has arguments chat.completions.create() does not take: {unknown!r} "
                "(a server's own fields go in extra_body)"
            )
    for key in ("model", "messages"):
        if key not in request:
            raise ValueError(f"request must have {key!r}")
    messages = request["messages"]
    if not isinstance(messages, (list, tuple)):
        raise TypeError(
            "request['messages'] must be a list or tuple (each attempt sends it again), "
            f"not {type(messages).__name__}"
        )
    if request.get("stream", True) is not True:
        raise ValueError("request asks for stream=False: hedging needs a stream")


def _merge_extra_headers(
    kwargs: Mapping[str, Any], extra_headers: Mapping[str, str] | None
) -> dict[str, str]:
    """The request's own ``extra_headers``, then the front door's per-request ones."""
    merged = dict(kwargs.get("extra_headers") or {})
    if extra_headers:
        merged.update(extra_headers)
    return merged


class OpenAISDKSource:
    """One request bound to one replica's ``AsyncOpenAI`` client, as a
    [`Source`][trio_hedge.sources.Source].

    Args:
        client: an ``openai.AsyncOpenAI`` (or ``AsyncAzureOpenAI``) for this replica; its
            base URL, key, timeout and HTTP client are used as configured, except retries (see
            the module docs: attempts run with ``max_retries=0``).
        request: the keyword arguments of ``client.chat.completions.create`` (``model``,
            ``messages``, …); ``stream=True`` is set for you.
        name: a short name for reports (never a credential). Default the client's
            ``base_url`` host and port.
        overrides: arguments merged over ``request`` for this replica (e.g. a smaller
            ``model`` for the backup).
        headers: which headers carry the request id and attempt number
            ([`HeaderNames`][trio_hedge.sources.HeaderNames]), sent with ``extra_headers``.
        extra_headers: headers sent on every attempt, over the request's own
            ``extra_headers`` (values masked in errors). Default none.

    Raises:
        TypeError: ``client`` is not an ``AsyncOpenAI``; ``request`` is not a mapping, has an
            argument ``create()`` does not take, or its ``messages`` are not a list or tuple.
        ValueError: ``request`` lacks ``model`` or ``messages``, or asks for ``stream=False``.
        ImportError: the ``openai`` package is not installed.
    """

    __slots__ = ("_client", "_errors", "_extra_headers", "_header_names", "_kwargs", "_name")

    def __init__(
        self,
        client: AsyncOpenAI,
        request: Mapping[str, Any],
        *,
        name: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        headers: HeaderNames | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> None:
        _check_client(client)
        if not isinstance(request, Mapping):
            raise TypeError(f"request must be a mapping, not {type(request).__name__}")
        kwargs = {**request, **_check_overrides(overrides)}
        _check_request(kwargs)
        if name is None:
            name = _default_name(client)
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty str")
        if headers is not None and not isinstance(headers, HeaderNames):
            raise TypeError(f"headers must be HeaderNames or None, not {type(headers).__name__}")
        if extra_headers is not None:
            check_headers(extra_headers, "extra_headers")
        redact = Redactor((client.api_key, *(extra_headers or {}).values()))
        protect_in_logs(redact)
        self._setup(
            _without_retries(client), kwargs, name, headers, _Classifier(redact), extra_headers
        )

    def _setup(
        self,
        client: AsyncOpenAI,
        kwargs: dict[str, Any],
        name: str,
        headers: HeaderNames | None,
        errors: _Classifier,
        extra_headers: Mapping[str, str] | None,
    ) -> None:
        kwargs["stream"] = True
        self._client = client
        self._kwargs = kwargs
        self._name = name
        self._header_names = headers or _DEFAULT_HEADER_NAMES
        self._errors = errors
        self._extra_headers = _merge_extra_headers(kwargs, extra_headers)

    @classmethod
    def _checked(
        cls,
        client: AsyncOpenAI,
        kwargs: dict[str, Any],
        name: str,
        headers: HeaderNames | None,
        errors: _Classifier,
        extra_headers: Mapping[str, str] | None,
    ) -> OpenAISDKSource:
        """A source from arguments checked already
        ([`SDKReplica.bind`][trio_hedge.sources.openai_sdk.SDKReplica.bind])."""
        self = cls.__new__(cls)
        self._setup(client, kwargs, name, headers, errors, extra_headers)
        return self

    @property
    def name(self) -> str:
        return self._name

    @property
    def model(self) -> str | None:
        """The model this request asks for (`Source.model`)."""
        model = self._kwargs.get("model")
        return model if isinstance(model, str) and model else None

    def __repr__(self) -> str:
        return f"OpenAISDKSource(name={self._name!r})"

    async def open(self, info: AttemptInfo) -> HTTPAttempt:
        errors = self._errors
        extra = attempt_headers(self._extra_headers, self._header_names, info)
        try:
            stream = await self._client.chat.completions.create(
                **{**self._kwargs, "extra_headers": extra}
            )
        except Exception as exc:
            raise errors.classify(exc) from exc
        # The SDK's own stream is never iterated: its response is read as the HTTP source
        # reads one (a replica's quirk is handled alike by both sources).
        response = stream.response
        try:
            return await attempt_for(response, errors.redact, errors.errors, _SDKAttempt)
        except BaseException as exc:
            with (
                trio.CancelScope(shield=True, deadline=trio.current_time() + 1.0),
                contextlib.suppress(Exception),
            ):
                await response.aclose()
            if isinstance(exc, Exception):
                raise errors.classify(exc) from exc
            raise


_DEFAULT_HEADER_NAMES = HeaderNames()


class SDKReplica:
    """Your ``AsyncOpenAI`` client as a replica that a [`Hedger`][trio_hedge.Hedger] (or
    [`hedged_stream`][trio_hedge.hedged_stream]) binds to each request, as it binds a
    [`Replica`][trio_hedge.sources.Replica]: the request is ``chat.completions.create()``'s keyword
    arguments (``model``, ``messages``, …), and each attempt is one ``create(**request,
    **overrides, stream=True)`` call on this client:

    ```python
    hedger = trio_hedge.Hedger([SDKReplica(primary, name="primary"),
                                SDKReplica(backup, name="backup")])
    async with hedger.stream({"model": "gpt-4o", "messages": messages}) as stream: ...
    ```

    Args:
        client: an ``openai.AsyncOpenAI`` (or ``AsyncAzureOpenAI``); its base URL, key,
            timeout and HTTP client are used as configured, except retries: attempts run with
            ``max_retries=0`` (a copy sharing its connection pool, made once), as the race is
            the retry policy.
        name: a short name for reports, events and statistics (never a credential). Default
            the client's ``base_url`` host and port.
        overrides: ``create()`` arguments merged over every request for this replica (e.g.
            ``{"model": "gpt-4o-mini"}`` for the backup). Default none.

    Raises:
        TypeError: ``client`` is not an ``AsyncOpenAI`` (the sync client would block Trio);
            ``overrides`` is not a mapping or has an argument ``create()`` does not take.
        ValueError: an empty ``name``; ``overrides`` ask for ``stream=False``.
        ImportError: the ``openai`` package is not installed.
    """

    __slots__ = ("_api_key", "_client", "_errors", "_name", "_overrides")

    #: Attempts go through this client's own HTTP client, not the front door's.
    needs_http_client: ClassVar[bool] = False

    def __init__(
        self,
        client: AsyncOpenAI,
        *,
        name: str | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        _check_client(client)
        overrides = _check_overrides(overrides)
        known = _create_parameters()
        unknown = [key for key in overrides if known and key not in known]
        if unknown:
            raise TypeError(
                f"overrides have arguments chat.completions.create() does not take: {unknown!r}"
            )
        if name is None:
            name = _default_name(client)
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty str")
        self._client = _without_retries(client)
        self._name = name
        self._overrides = overrides
        self._api_key = client.api_key
        redact = Redactor((client.api_key,))
        protect_in_logs(redact)
        self._errors = _Classifier(redact)

    @property
    def name(self) -> str:
        """The replica's name."""
        return self._name

    @property
    def overrides(self) -> Mapping[str, Any]:
        """The arguments merged over every request for this replica (a copy)."""
        return dict(self._overrides)

    def __repr__(self) -> str:
        return f"SDKReplica(name={self._name!r})"

    def check_request(self, request: object) -> None:
        """Raise unless ``request`` is ``create()`` keyword arguments this library can race
        (called by the front doors before any I/O).

        Raises:
            TypeError: not a mapping; an argument ``create()`` does not take (named);
                ``messages`` not a list or tuple (each attempt sends them again).
            ValueError: no ``model`` or ``messages``; ``stream=False``.
        """
        _check_request(request)

    def bind(
        self,
        request: Mapping[str, Any],
        client: httpx.AsyncClient | None = None,
        *,
        headers: HeaderNames | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> OpenAISDKSource:
        """This replica as a [`Source`][trio_hedge.sources.Source] for one request (checked by
        [`check_request`][trio_hedge.sources.openai_sdk.SDKReplica.check_request]); ``client`` (an
        HTTP client for [`Replica`][trio_hedge.sources.Replica]s) is not used. ``extra_headers``
        (checked by the caller) go on every attempt, over the request's own ``extra_headers``."""
        errors = self._errors
        if extra_headers:
            # This client's key wins over a per-request Authorization, as a Replica's does.
            extra_headers = {k: v for k, v in extra_headers.items() if k.lower() != "authorization"}
        if extra_headers:
            # The request's own header values are masked too, as the HTTP source masks them.
            redact = Redactor((self._api_key, *extra_headers.values()))
            protect_in_logs(redact)
            errors = _Classifier(redact)
        kwargs = {**request, **self._overrides}
        return OpenAISDKSource._checked(
            self._client, kwargs, self._name, headers, errors, extra_headers
        )


def sdk_replicas(
    clients: Mapping[str, AsyncOpenAI] | Sequence[AsyncOpenAI],
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[SDKReplica]:
    """One [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica] per client, in order, for a
    [`Hedger`][trio_hedge.Hedger]:

    ```python
    hedger = trio_hedge.Hedger(
        sdk_replicas({"primary": primary, "backup": backup},
                     overrides={"backup": {"model": "gpt-4o-mini"}})
    )
    ```

    Args:
        clients: ``{name: AsyncOpenAI}`` in preference order, or a sequence of clients (named
            after their ``base_url``).
        overrides: per-name ``create()`` arguments merged over every request.

    Raises:
        TypeError, ValueError: as [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica], or an
            override for an unknown name.
    """
    named = _named(clients)
    overrides = _check_named_overrides(overrides, named)
    return [
        SDKReplica(client, name=name, overrides=overrides.get(name) if name is not None else None)
        for name, client in named
    ]


def _named(
    clients: Mapping[str, AsyncOpenAI] | Sequence[AsyncOpenAI],
) -> list[tuple[str | None, AsyncOpenAI]]:
    if isinstance(clients, Mapping):
        return list(clients.items())
    return [(None, c) for c in clients]


def _check_named_overrides(
    overrides: Mapping[str, Mapping[str, Any]] | None, named: list[tuple[str | None, Any]]
) -> dict[str, Mapping[str, Any]]:
    found = dict(overrides or {})
    unknown = set(found) - {n for n, _ in named}
    if unknown:
        raise ValueError(f"overrides for unknown replicas: {sorted(unknown)!r}")
    return found


def openai_sdk_sources(
    clients: Mapping[str, AsyncOpenAI] | Sequence[AsyncOpenAI],
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    headers: HeaderNames | None = None,
    **request: Any,
) -> list[OpenAISDKSource]:
    """One [`OpenAISDKSource`][trio_hedge.sources.openai_sdk.OpenAISDKSource] per client, for one
    request: your ``create`` call's keyword arguments, raced over your clients (primary first):

    ```python
    sources = openai_sdk_sources(
        {"primary": primary, "backup": backup}, model="gpt-4o-mini", messages=messages
    )
    async with trio_hedge.hedged_stream(None, sources) as stream: ...
    ```

    Args:
        clients: ``{name: AsyncOpenAI}`` in attempt order, or a sequence of clients (named
            after their ``base_url``).
        overrides: per-name arguments merged over ``request`` (e.g. ``{"backup": {"model":
            "small"}}``).
        headers: see [`OpenAISDKSource`][trio_hedge.sources.openai_sdk.OpenAISDKSource].
        **request: the ``chat.completions.create`` arguments.

    Raises:
        TypeError, ValueError: as
            [`OpenAISDKSource`][trio_hedge.sources.openai_sdk.OpenAISDKSource], or an override for
            an unknown name.
    """
    named = _named(clients)
    overrides = _check_named_overrides(overrides, named)
    return [
        OpenAISDKSource(
            client,
            request,
            name=name,
            overrides=overrides.get(name) if name is not None else None,
            headers=headers,
        )
        for name, client in named
    ]


def sdk_chunks(stream: Any) -> SDKChunks:
    """The winner's ``ChatCompletionChunk``s, from a hedged stream (Trio's
    [`HedgedStream`][trio_hedge.HedgedStream] or the asyncio one) whose replicas are
    [`OpenAISDKSource`][trio_hedge.sources.openai_sdk.OpenAISDKSource]s: ``async for chunk in
    sdk_chunks(stream)``. It reads the stream's [`events`][trio_hedge.HedgedStream.events] queue, as
    ``async for`` does, and holds nothing between items (leaving it early is safe)."""
    return SDKChunks(stream.events())


class SDKChunks:
    """The iterator [`sdk_chunks`][trio_hedge.sources.openai_sdk.sdk_chunks] returns."""

    __slots__ = ("_events",)

    def __init__(self, events: AsyncIterator[Delta]) -> None:
        self._events = events

    def __aiter__(self) -> SDKChunks:
        return self

    async def __anext__(self) -> ChatCompletionChunk:
        while True:
            chunk = getattr(await self._events.__anext__(), "chunk", None)
            if chunk is not None:
                return chunk  # type: ignore[no-any-return]
