"""What an OpenAI-compatible server's error means for the race: HTTP status, in-band error
objects and ``Retry-After``, classified as an [`AttemptError`][trio_hedge.AttemptError] of
some [`ErrorKind`][trio_hedge.errors.ErrorKind] (retryable or not, the replica's fault or the
request's); and transport errors (httpx, httpcore, h2) classified the same way, so the race
engine never sees an HTTP library's exception.

Server messages are masked (`trio_hedge._redact.Redactor`) before they are cut to
`MAX_MESSAGE_CHARS`, so no part of a key they echo survives.
"""

from __future__ import annotations

import datetime
import email.utils
import http
import json
import math
import re
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from ...errors import AttemptError, ErrorKind
from ._json import _loads

__all__ = [
    "MAX_MESSAGE_CHARS",
    "classify_http_error",
    "parse_retry_after",
    "request_line",
    "send_error",
    "transport_error",
    "with_context",
]

#: Longest error message kept from a server (characters).
MAX_MESSAGE_CHARS = 300


# -- errors ----------------------------------------------------------------------------------

# The server dialects behind these rules, with the bodies they send, are the table in
# tests/test_dialects.py (vLLM, SGLang, TGI, llama.cpp, llama-cpp-python, Ollama, LiteLLM,
# OpenRouter, Azure OpenAI).
_CONTEXT = re.compile(
    r"context.?length|context.?window|context.?size|context.?limit|maximum context|"
    r"prompt is too long|"
    r"input is too long|too long for (the|this) model|reduce the length|"
    r"maximum (input|prompt|model) length|exceeds? the (available|maximum) context|"
    r"too many (input )?tokens in (the )?prompt|"
    # TGI's validation.rs: "`inputs` tokens + `max_new_tokens` must be <= 4096. Given: …"
    r"inputs`? tokens \+ `?max_new_tokens`? must be|`?inputs`? must have less than \d+ tokens",
    re.IGNORECASE,
)
_QUOTA = re.compile(
    r"quota|billing|insufficient.?(credit|balance|funds)|credit balance|out of credits|"
    r"more credits|payment.?required|check your plan",
    re.IGNORECASE,
)
# A 429 that says "quota" but is a per-minute limit (Gemini, Vertex) is a rate limit.
_QUOTA_IS_RATE = re.compile(
    r"per.?minute|per.?second|resource.?(has been )?exhausted|try again (in|later)|retry in",
    re.IGNORECASE,
)
_OVERLOADED = re.compile(
    r"overload|at capacity|capacity exceeded|temporarily unavailable|queue is full|"
    r"server busy|no healthy deployments|no deployments available",
    re.IGNORECASE,
)
# A gateway with no upstream left for this model (LiteLLM: "There are no healthy deployments
# for this model", 400; "No deployments available for selected model", 429): this replica
# cannot serve anyone right now, whatever its status says.
_NO_CAPACITY = re.compile(r"no healthy deployments|no deployments available", re.IGNORECASE)
# Messages that blame the request whatever the status: TGI's in-band errors all carry
# "http_status_code": 422 (even "Model is overloaded"), so its message prefixes decide;
# content flagged by moderation (OpenRouter's 403) or a content filter is the prompt's fault.
_REQUEST_FAULT = re.compile(
    r"^(input validation error|template error|missing template va\w*|tool error):|"
    r"requires moderation|input was flagged|content.?(management )?polic|content.?filter",
    re.IGNORECASE,
)
_AUTH = re.compile(
    r"api.?key|unauthori[sz]ed|authenticat|permission.?denied|forbidden|access denied", re.I
)
_RATE = re.compile(r"rate.?limit|too many requests", re.IGNORECASE)

# Error `type`/`code` strings, normalised to lower-case alphanumerics, checked in order.
_TYPE_RULES: tuple[tuple[tuple[str, ...], ErrorKind], ...] = (
    (("contextlength", "contextwindow"), ErrorKind.CONTEXT_LENGTH_EXCEEDED),
    (
        (
            "quota",
            "billing",
            "insufficientbalance",
            "insufficientcredit",
            "creditbalance",
            "payment",
        ),
        ErrorKind.QUOTA_EXCEEDED,
    ),
    (("ratelimit", "toomanyrequests", "resourceexhausted"), ErrorKind.RATE_LIMIT),
    (("overload", "unavailable", "capacity"), ErrorKind.OVERLOADED),
    (("contentfilter", "contentpolicy", "moderation"), ErrorKind.INVALID_REQUEST),
    (("auth", "permission", "apikey", "forbidden"), ErrorKind.AUTH),
    (("timeout", "deadline"), ErrorKind.TIMEOUT),
    (("server", "internal", "apierror", "unknown"), ErrorKind.SERVER_ERROR),
    (("notfound",), ErrorKind.NOT_FOUND),
    (
        ("invalid", "badrequest", "validation", "unprocessable", "unsupported", "toolarge"),
        ErrorKind.INVALID_REQUEST,
    ),
)
_NON_ALNUM = re.compile(r"[^a-z0-9]+")
# Codes of a 4xx that mean "not on this replica" (normalised like the labels).
_NOT_HERE = ("modelnotfound", "deploymentnotfound", "previousresponsenotfound")


_JSON_MESSAGE = re.compile(r'"(?:message|detail)"\s*:\s*"((?:[^"\\]|\\.)*)')
_JSON_LABEL = re.compile(r'"(?:type|code|status|error_type)"\s*:\s*"([A-Za-z_]+)"')


#: Masks secrets in server text (see `trio_hedge._redact.Redactor`); applied to a
#: whole message *before* it is cut to `MAX_MESSAGE_CHARS`, so no prefix of a secret
#: that straddles the cut survives.
Redact = Callable[[str], str]


def _no_redact(text: str) -> str:
    return text


def _truncate(message: str) -> str:
    message = " ".join(message.split())
    if len(message) > MAX_MESSAGE_CHARS:
        return message[: MAX_MESSAGE_CHARS - 1] + "…"
    return message


def _error_fields(obj: Any) -> tuple[str, list[str], int | None]:
    """(message, type/code strings, numeric status) from an error payload of any known shape.

    Shapes: ``{"error": {"message", "type", "code", "status"}}`` (OpenAI, Azure, OpenRouter,
    Anthropic inside ``{"type": "error"}``), ``{"error": "text", "error_type": ...}`` (TGI),
    ``{"object": "error", "message", "type", "code"}`` (vLLM, SGLang), ``{"detail": ...}``
    (FastAPI), ``{"message": ...}``, and a list holding one of these (Gemini). TGI's in-band
    ``"http_status_code"`` is not read: it is 422 for every error, overload included.
    """
    if type(obj) is list and obj:
        obj = obj[0]
    if type(obj) is not dict:
        return (obj if type(obj) is str else ""), [], None
    inner = obj.get("error")
    sources: list[dict[str, Any]] = []
    message = ""
    if type(inner) is dict:
        sources.append(inner)
    elif type(inner) is str:
        message = inner
    sources.append(obj)
    labels: list[str] = []
    status: int | None = None
    for source in sources:
        if not message:
            for key in ("message", "detail", "msg", "error_message", "title"):
                value = source.get(key)
                if type(value) is str and value:
                    message = value
                    break
                if type(value) is list and value and type(value[0]) is dict:
                    msg = value[0].get("msg") or value[0].get("message")  # FastAPI 422
                    if type(msg) is str:
                        message = msg
                        break
        for key in ("type", "code", "status", "error_type"):
            value = source.get(key)
            if type(value) is bool:
                continue
            if type(value) is int:
                if status is None and 100 <= value <= 599:
                    status = value
            elif type(value) is str and value and value != "error":
                if status is None and value.isdigit() and 100 <= int(value) <= 599:
                    status = int(value)  # Azure sends "code": "429"
                else:
                    labels.append(value)
    return message, labels, status


class _Sent:
    """The text a request sent (its JSON's keys and strings, lower-cased, decoded lazily: only
    an error whose message matched a rule below asks), to tell a server's own words from
    the caller's quoted back. A server that echoes the input in a 400 (pydantic's
    ``Input tag '…' found``, ``input_value='…'``; an unknown model's name) would otherwise let
    a caller's text ("no healthy deployments", "forbidden", "api key") turn its own bad
    request into evidence against the replica, for every caller (``docs/guarantees.md``)."""

    __slots__ = ("_text", "body")

    def __init__(self, body: bytes) -> None:
        self.body = body
        self._text: str | None = None

    def said(self, phrase: str) -> bool:
        """Whether ``phrase`` (a rule's match in an error message) is in what was sent."""
        if not self.body:
            return False
        if self._text is None:
            try:
                parts: list[str] = []
                _strings(_loads(self.body), parts)
                self._text = "\n".join(parts).lower()
            except (ValueError, RecursionError):  # not JSON (or nested past the parser)
                self._text = self.body.decode("utf-8", "replace").lower()
        return phrase.lower() in self._text


def _strings(obj: Any, out: list[str]) -> None:
    """Every key and string of a JSON value, into ``out``."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            out.extend(k for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


_NOTHING_SENT = _Sent(b"")


def _server_says(pattern: re.Pattern[str], text: str, sent: _Sent) -> bool:
    """Whether ``text`` matches ``pattern`` in words the request did not send itself."""
    found = pattern.search(text)
    return found is not None and not sent.said(found.group(0))


def _kind_for(
    status: int | None,
    message: str,
    labels: list[str],
    *,
    in_band: bool,
    sent: _Sent = _NOTHING_SENT,
) -> tuple[ErrorKind, bool | None]:
    """(kind, retryable override) for an error with this status, message and labels; a rule
    that would make a client error (4xx) the replica's by its message alone reads only words
    the request did not send (``sent``)."""
    text = " ".join([message, *labels])
    norm = _NON_ALNUM.sub("", " ".join(labels).lower())
    if status != 429 and (_CONTEXT.search(text) or "contextlength" in norm):
        return ErrorKind.CONTEXT_LENGTH_EXCEEDED, None
    if status is not None:
        if 400 <= status < 500 and status != 408 and _server_says(_NO_CAPACITY, text, sent):
            return ErrorKind.OVERLOADED, None
        if status == 403 and _REQUEST_FAULT.search(text):
            return ErrorKind.INVALID_REQUEST, None  # flagged content: any replica refuses it
        if status in (429, 403, 402):
            quota = "quota" in norm or "billing" in norm or bool(_QUOTA.search(text))
            if status == 402 or (quota and not _QUOTA_IS_RATE.search(text)):
                return ErrorKind.QUOTA_EXCEEDED, None
            if status == 429:
                if "overload" in norm or _OVERLOADED.search(text):
                    # The server's own capacity (TGI's max_concurrent_requests), not the
                    # caller's rate: it says something about the replica.
                    return ErrorKind.OVERLOADED, None
                return ErrorKind.RATE_LIMIT, None
            return ErrorKind.AUTH, None
        if status == 401:
            return ErrorKind.AUTH, None
        if status == 408:
            return ErrorKind.TIMEOUT, True
        if status in (503, 529) or (status >= 500 and _OVERLOADED.search(text)):
            return ErrorKind.OVERLOADED, None
        if status >= 500:
            return ErrorKind.SERVER_ERROR, None
        if status in (409, 425):
            # Conflict / Too Early: transient (the OpenAI SDK retries 409 too).
            return ErrorKind.INVALID_REQUEST, True
        if status == 424:
            # Failed Dependency: TGI's "Request failed during generation" (a shard failed).
            return ErrorKind.SERVER_ERROR, None
        if status >= 400:
            if _server_says(_AUTH, text, sent) or any(
                k in norm for k in ("auth", "apikey", "permission")
            ):
                return ErrorKind.AUTH, None  # e.g. Gemini's 400 "API key not valid"
            if status == 404 or any(code in norm for code in _NOT_HERE):
                # An unknown model or a wrong path: this replica's fault. An explicit
                # model_not_found code counts on a 400 too (llama-cpp-python sends it so), as
                # does previous_response_not_found (a Responses replica without the stored
                # conversation another replica holds).
                return ErrorKind.NOT_FOUND, None
            if _QUOTA.search(text) and not _QUOTA_IS_RATE.search(text):
                # Anthropic's 400 invalid_request_error "Your credit balance is too low":
                # the account's, not the request's.
                return ErrorKind.QUOTA_EXCEEDED, None
            return ErrorKind.INVALID_REQUEST, None
        return ErrorKind.PROTOCOL, None  # 1xx/2xx/3xx where an answer was expected
    # No status: classify by the type/code labels, then by the message.
    for needles, kind in _TYPE_RULES:
        if any(needle in norm for needle in needles):
            if kind is ErrorKind.QUOTA_EXCEEDED and _QUOTA_IS_RATE.search(text):
                return ErrorKind.RATE_LIMIT, None
            if kind is ErrorKind.SERVER_ERROR and _OVERLOADED.search(message):
                return ErrorKind.OVERLOADED, None  # Azure: type server_error, "overloaded"
            if kind is ErrorKind.INVALID_REQUEST and _QUOTA.search(message):
                return ErrorKind.QUOTA_EXCEEDED, None  # Anthropic: "credit balance is too low"
            return kind, None
    if _REQUEST_FAULT.search(message):
        return ErrorKind.INVALID_REQUEST, None
    if _QUOTA.search(text) and not _QUOTA_IS_RATE.search(text):
        return ErrorKind.QUOTA_EXCEEDED, None
    if _RATE.search(text):
        return ErrorKind.RATE_LIMIT, None
    if _OVERLOADED.search(text):
        return ErrorKind.OVERLOADED, None
    # An unexplained error inside a 200 stream is the server's failure.
    return (ErrorKind.SERVER_ERROR if in_band else ErrorKind.PROTOCOL), None


#: The window a context-length error states: vLLM's and OpenAI's "maximum context length is
#: 4096 tokens", Anthropic's "210000 tokens > 200000 maximum", TGI's "must be <= 4096",
#: SGLang's "the model's context length (4096 tokens)", llama-server's ``"n_ctx": 4096``.
_STATED_WINDOW = (
    re.compile(r"maximum context length is (\d[\d,]*)", re.IGNORECASE),
    re.compile(r"> ?(\d[\d,]*) maximum", re.IGNORECASE),
    re.compile(r"must be <= ?(\d[\d,]*)", re.IGNORECASE),
    re.compile(
        r"context (?:length|window|size) (?:is |of )?\(?(\d[\d,]*)(?: tokens)?\)?", re.IGNORECASE
    ),
    re.compile(r'"n_ctx"\s*:\s*(\d+)'),
)


def stated_window(text: str) -> int | None:
    """The context window (tokens) a context-length error's text states, or ``None``."""
    for pattern in _STATED_WINDOW:
        found = pattern.search(text)
        if found is not None:
            try:
                value = int(found.group(1).replace(",", ""))
            except ValueError:  # pragma: no cover - the pattern matched digits
                continue
            if 0 < value < 10**9:
                return value
    return None


def _in_band_error(
    payload: Any,
    headers: Mapping[str, str] | None = None,
    *,
    status: int | None = None,
    redact: Redact = _no_redact,
    sent: _Sent = _NOTHING_SENT,
) -> AttemptError:
    message, labels, code = _error_fields(payload)
    kind, retryable = _kind_for(code, message, labels, in_band=True, sent=sent)
    retry_after = parse_retry_after(headers) if headers else None
    window = None
    if kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED:
        window = stated_window(message) or stated_window(_json_text(payload))
    return AttemptError(
        kind,
        _truncate(redact(message)) or "error event in the stream",
        retryable=retryable,
        retry_after=retry_after,
        status_code=status,
        context_window=window,
    )


def _json_text(payload: Any) -> str:
    try:
        return json.dumps(payload)[:4096]
    except (TypeError, ValueError):
        return ""


def _is_error(obj: Any) -> bool:
    """Whether a parsed JSON payload is an error envelope rather than a chunk."""
    if type(obj) is dict:
        error = obj.get("error")
        if error:  # some servers put "error": null on ordinary chunks
            return True
        return obj.get("object") == "error" or obj.get("type") == "error"
    if type(obj) is list:
        return bool(obj) and _is_error(obj[0])
    return False


def classify_http_error(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    now: float | None = None,
    redact: Redact = _no_redact,
    sent: bytes = b"",
) -> AttemptError:
    """Turn a non-2xx HTTP answer into an [`AttemptError`][trio_hedge.AttemptError].

    Args:
        status: the HTTP status code.
        headers: the *response* headers (case-insensitive mapping such as ``httpx.Headers``,
            or a dict with lower-case names). Request headers are never looked at, so no
            credential reaches the message.
        body: the start of the response body (the caller bounds it to a few KiB).
        now: POSIX time for an HTTP-date ``Retry-After`` (default: see
            [`parse_retry_after`][trio_hedge.sources.openai.parse_retry_after]).
        redact: masks secrets the server quoted back; applied to the whole message before
            it is cut to 300 characters.
        sent: the request's body (JSON), if known. A client error (4xx) is made the
            replica's by its message alone ("no healthy deployments": ``OVERLOADED``; "API
            key not valid" on a 400: ``AUTH``) only when those words are not the request's
            own, quoted back (a server echoing a caller's bad value would let any caller
            blame a replica for everyone). Default empty: every message is the server's.

    Kinds: 429 -> ``RATE_LIMIT`` (or ``QUOTA_EXCEEDED`` when the message is about
    quota/billing/credit), 402 and 403 with such a message -> ``QUOTA_EXCEEDED``,
    401/403 -> ``AUTH``, 404 -> ``NOT_FOUND`` (the last three are the replica's fault:
    retryable on another replica), 408 -> ``TIMEOUT`` (retryable), 503/529 or an
    "overloaded" message on a 5xx -> ``OVERLOADED``, other 5xx -> ``SERVER_ERROR``, a
    context-length message on any status but 429 -> ``CONTEXT_LENGTH_EXCEEDED``, other 4xx
    -> ``INVALID_REQUEST``. The message is the server's own (at most 300 characters), else
    the reason phrase.
    """
    text = body.decode("utf-8", "replace").strip().lstrip("\ufeff")
    payload: Any = None
    if text[:1] in ("{", "["):
        try:
            payload = _loads(text)
        except ValueError:
            payload = None  # truncated by the caller's bound, or not JSON: use the text
    if payload is not None:
        message, labels, _ = _error_fields(payload)
    elif text[:1] in ("{", "["):
        # JSON cut by the caller's bound: pick the fields out of the text.
        found = _JSON_MESSAGE.search(text)
        message = found.group(1).replace('\\"', '"') if found else text
        labels = [m.group(1) for m in _JSON_LABEL.finditer(text)]
    else:
        message, labels = ("" if text.startswith("<") else text), []  # skip HTML pages
    kind, retryable = _kind_for(status, message, labels, in_band=False, sent=_Sent(sent))
    if not message:
        try:
            message = f"HTTP {status} {http.HTTPStatus(status).phrase}"
        except ValueError:
            message = f"HTTP {status}"
    return AttemptError(
        kind,
        _truncate(redact(message)),
        retryable=retryable,
        retry_after=parse_retry_after(headers, now=now),
        status_code=status,
        context_window=(stated_window(text) if kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED else None),
    )


def sent_body(message: httpx.Response | httpx.Request | None) -> bytes:
    """The body of a request (or of the one a response answers; ``b""`` if unknown or
    streamed): what the error rules read as the caller's own words."""
    try:
        request = message.request if isinstance(message, httpx.Response) else message
        return b"" if request is None else request.content
    except (RuntimeError, httpx.RequestNotRead):
        return b""


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None and isinstance(headers, dict):
        for key, item in headers.items():  # a hand-made dict with mixed-case names
            if key.lower() == name:
                return str(item)
    return value


def _seconds(value: str | None, scale: float) -> float | None:
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(number) or number < 0:
        return None
    return number / scale


def parse_retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """How long the server asked to wait, in seconds, or ``None``.

    Precedence: ``retry-after-ms`` (milliseconds; OpenAI, Azure) > ``x-ms-retry-after-ms``
    (Azure) > ``Retry-After`` (RFC 9110 §10.2.3: ``delay-seconds`` or an ``HTTP-date``).
    An HTTP-date is taken relative to ``now`` (POSIX seconds) when given; otherwise relative
    to the response's own ``Date`` header when present (immune to clock skew between client
    and server), else to ``time.time()``. A date in the past gives ``0.0``. Invalid, negative
    or non-finite values are ignored. No cap is applied here: the retry policy caps it.
    """
    for name, scale in (("retry-after-ms", 1000.0), ("x-ms-retry-after-ms", 1000.0)):
        seconds = _seconds(_header(headers, name), scale)
        if seconds is not None:
            return seconds
    value = _header(headers, "retry-after")
    if value is None:
        return None
    seconds = _seconds(value, 1.0)
    if seconds is not None:
        return seconds
    when = _http_date(value)
    if when is None:
        return None
    if now is None:
        now = _http_date(_header(headers, "date") or "")
        if now is None:
            now = time.time()
    return max(0.0, when - now)


def _http_date(value: str) -> float | None:
    try:
        parsed = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if parsed.tzinfo is None:  # RFC 9110 dates are GMT
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    try:
        return parsed.timestamp()
    except (OverflowError, ValueError, OSError):
        return None


# -- transport errors (httpx, httpcore, TLS) ------------------------------------------------


def send_error(exc: Exception, request: httpx.Request, redact: Redact) -> AttemptError:
    """The [`AttemptError`][trio_hedge.AttemptError] for an exception out of ``client.send``."""
    if isinstance(exc, httpx.TimeoutException):
        return transport_error(ErrorKind.TIMEOUT, exc, redact)
    if isinstance(exc, httpx.ConnectError):
        tls = tls_failure(exc, request)
        if tls is not None:
            return AttemptError(ErrorKind.PROTOCOL, redact(tls))
    # Any other transport error, and errors the HTTP stack should never raise: httpcore 1.0.9
    # raises ValueError("semaphore released too many times") on an HTTP/2 connection a cancel
    # corrupted (trio_hedge._cancel_safe.setup_cut_short; tests/test_faults.py). The
    # connection is broken, not the request: another attempt may succeed.
    return transport_error(ErrorKind.CONNECTION, exc, redact)


def without_frames(exc: BaseException) -> BaseException:
    """``exc`` and the exceptions chained to it, without their tracebacks: the HTTP stack's
    frames (httpx, httpcore, Trio's sockets: ~30 lines per attempt) say nothing the type and
    message do not, and made a failed request's traceback 100-200 lines long. The chain stays
    (``AttemptError.__cause__`` is still the httpx exception)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        todo += [current.__cause__, current.__context__]
    return exc


def transport_error(kind: ErrorKind, exc: Exception, redact: Redact) -> AttemptError:
    # httpx messages name the host, not the headers (validated at construction, so h11 never
    # quotes an illegal one); masked all the same.
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return AttemptError(kind, redact(text))


def request_line(request: httpx.Request) -> str:
    """``POST scheme://host:port/path``: the URL called, without its query."""
    url = request.url
    return f"{request.method} {url.scheme}://{url.netloc.decode('ascii')}{url.path}"


# What OpenSSL says when the bytes that came back were not TLS at all (a plain-HTTP server
# answering a ClientHello with "HTTP/1.1 400 …").
_NOT_TLS = ("WRONG_VERSION_NUMBER", "wrong version number", "record layer failure", "HTTP_REQUEST")


def tls_failure(exc: BaseException, request: httpx.Request) -> str | None:
    """A message for a failed TLS handshake (``exc`` is a ``ConnectError``), or ``None``.

    httpx reports it as a ``ConnectError`` with an empty message; the ``ssl.SSLError`` is down
    its cause chain (httpcore's ``ConnectError``, Trio's ``BrokenResourceError``), and its
    text ("[SSL: WRONG_VERSION_NUMBER] wrong version number", or "EOF occurred in violation
    of protocol" from a server that hung up on the ClientHello) does not say the usual cause:
    an ``https://`` URL on a plain-HTTP port.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, ssl.SSLError):
            reason = str(err)
            if isinstance(err, ssl.SSLCertVerificationError):
                return f"TLS certificate rejected calling {request_line(request)}: {reason}"
            if isinstance(err, ssl.SSLEOFError) or any(m in reason for m in _NOT_TLS):
                return (
                    f"TLS handshake failed calling {request_line(request)}: the server did not "
                    f"answer in TLS ({reason}). Is it a plain-HTTP port? Try http://"
                )
            return f"TLS handshake failed calling {request_line(request)}: {reason}"
        todo += [err.__cause__, err.__context__]
    return None


def with_context(error: AttemptError, context: str) -> AttemptError:
    """``error`` with ``context`` appended to its message (same kind and fields)."""
    return AttemptError(
        error.kind,
        f"{error.message} ({context})",
        retryable=error.retryable,
        retry_after=error.retry_after,
        status_code=error.status_code,
        replica=error.replica,
        hint=error.hint,
        context_window=error.context_window,
    )
