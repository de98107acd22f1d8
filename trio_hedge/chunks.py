"""OpenAI-compatible chat-completion streams: bytes in, :class:`~trio_hedge.Delta` s out.

What "OpenAI-compatible" means in practice (each rule stands for a kind of real-world server
quirk; see ``/work/shared/sse-cases`` for reproductions):

* SSE framing is :mod:`trio_hedge.sse` (CR/LF/CRLF, comments, ``data:`` without a space,
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
* Tool calls stay fragments (:class:`ToolCallDelta`); :func:`merge_tool_calls` assembles them.
* Usage is taken wherever the server puts it: top level (also on a finish chunk or a
  ``choices: []`` chunk), inside the choice, or Groq's ``x_groq.usage``.
* In-band errors -- ``{"error": {...}}``, ``{"error": "text"}``, ``{"object": "error", ...}``
  (vLLM), ``{"type": "error", ...}`` (Anthropic), a list holding one of those (Gemini), or an
  ``event: error`` frame -- raise an :class:`AttemptError` classified like an HTTP error.

JSON is parsed with orjson when importable, else :mod:`json`; orjson failures fall back to
:mod:`json`, so both give the same results (the one value-level difference, integers beyond
64 bits, cannot change a Delta: see :func:`_index`).
"""

from __future__ import annotations

import datetime
import email.utils
import http
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._errors import AttemptError, ErrorKind
from ._events import Delta, ToolCallDelta
from .sse import DEFAULT_MAX_EVENT_SIZE, RawEvent, SSEDecoder

__all__ = [
    "ChunkDecoder",
    "classify_http_error",
    "decode_json_body",
    "merge_tool_calls",
    "parse_retry_after",
]

try:  # orjson is about twice as fast; the hot path parses one JSON object per token.
    import orjson

    _orjson_loads: Any = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _orjson_loads = None

#: Longest error message kept from a server (characters).
MAX_MESSAGE_CHARS = 300

_json_loads = json.loads


def _loads(text: str | bytes) -> Any:
    """Parse JSON; raise ``ValueError`` when it is not JSON."""
    if _orjson_loads is not None:
        try:
            return _orjson_loads(text)
        except ValueError:
            pass  # stdlib json accepts a little more (NaN, 1e400): keep results identical
    return _json_loads(text)


def _index(value: object, default: int) -> int:
    """A list index from JSON. Integers beyond 2**31 (which orjson turns into floats and json
    keeps exact) and non-integers fall back to the position, so both parsers agree."""
    if type(value) is int and 0 <= value < 2**31:
        return value
    return default


def _inexact(value: object) -> bool:
    """Whether orjson may have parsed ``value`` differently from json: integers beyond 64
    bits become floats in orjson. Checked only on usage objects (once per stream)."""
    if _orjson_loads is None:
        return False
    if type(value) is float:
        return abs(value) >= 2.0**63
    if type(value) is dict:
        return any(_inexact(item) for item in value.values())
    if type(value) is list:
        return any(_inexact(item) for item in value)
    return False


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


# -- errors ----------------------------------------------------------------------------------

# The server dialects behind these rules, with the bodies they send, are the table in
# tests/test_dialects.py (vLLM, SGLang, TGI, llama.cpp, llama-cpp-python, Ollama, LiteLLM,
# OpenRouter, Azure OpenAI).
_CONTEXT = re.compile(
    r"context.?length|context.?window|context.?size|maximum context|prompt is too long|"
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
        ("quota", "billing", "insufficientbalance", "insufficientcredit", "payment"),
        ErrorKind.QUOTA_EXCEEDED,
    ),
    (("ratelimit", "toomanyrequests"), ErrorKind.RATE_LIMIT),
    (("overload", "unavailable", "capacity"), ErrorKind.OVERLOADED),
    (("contentfilter", "contentpolicy", "moderation"), ErrorKind.INVALID_REQUEST),
    (("auth", "permission", "apikey", "forbidden"), ErrorKind.AUTH),
    (("timeout", "deadline"), ErrorKind.TIMEOUT),
    (("server", "internal", "apierror", "unknown"), ErrorKind.SERVER_ERROR),
    (("notfound",), ErrorKind.NOT_FOUND),
    (
        ("invalid", "badrequest", "validation", "unprocessable", "unsupported"),
        ErrorKind.INVALID_REQUEST,
    ),
)
_NON_ALNUM = re.compile(r"[^a-z0-9]+")


_JSON_MESSAGE = re.compile(r'"(?:message|detail)"\s*:\s*"((?:[^"\\]|\\.)*)')
_JSON_LABEL = re.compile(r'"(?:type|code|status|error_type)"\s*:\s*"([A-Za-z_]+)"')


#: Masks secrets in server text (see :class:`trio_hedge._redact.Redactor`); applied to a
#: whole message *before* it is cut to :data:`MAX_MESSAGE_CHARS`, so no prefix of a secret
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


def _kind_for(
    status: int | None, message: str, labels: list[str], *, in_band: bool
) -> tuple[ErrorKind, bool | None]:
    """(kind, retryable override) for an error with this status, message and labels."""
    text = " ".join([message, *labels])
    norm = _NON_ALNUM.sub("", " ".join(labels).lower())
    if status != 429 and (_CONTEXT.search(text) or "contextlength" in norm):
        return ErrorKind.CONTEXT_LENGTH_EXCEEDED, None
    if status is not None:
        if 400 <= status < 500 and status != 408 and _NO_CAPACITY.search(text):
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
            if _AUTH.search(text) or any(k in norm for k in ("auth", "apikey", "permission")):
                return ErrorKind.AUTH, None  # e.g. Gemini's 400 "API key not valid"
            if status == 404 or "modelnotfound" in norm or "deploymentnotfound" in norm:
                # An unknown model or a wrong path: this replica's fault. An explicit
                # model_not_found code counts on a 400 too (llama-cpp-python sends it so).
                return ErrorKind.NOT_FOUND, None
            return ErrorKind.INVALID_REQUEST, None
        return ErrorKind.PROTOCOL, None  # 1xx/2xx/3xx where an answer was expected
    # No status: classify by the type/code labels, then by the message.
    for needles, kind in _TYPE_RULES:
        if any(needle in norm for needle in needles):
            if kind is ErrorKind.QUOTA_EXCEEDED and _QUOTA_IS_RATE.search(text):
                return ErrorKind.RATE_LIMIT, None
            if kind is ErrorKind.SERVER_ERROR and _OVERLOADED.search(message):
                return ErrorKind.OVERLOADED, None  # Azure: type server_error, "overloaded"
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


def _in_band_error(
    payload: Any,
    headers: Mapping[str, str] | None = None,
    *,
    status: int | None = None,
    redact: Redact = _no_redact,
) -> AttemptError:
    message, labels, code = _error_fields(payload)
    kind, retryable = _kind_for(code, message, labels, in_band=True)
    retry_after = parse_retry_after(headers) if headers else None
    return AttemptError(
        kind,
        _truncate(redact(message)) or "error event in the stream",
        retryable=retryable,
        retry_after=retry_after,
        status_code=status,
    )


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
) -> AttemptError:
    """Turn a non-2xx HTTP answer into an :class:`AttemptError`.

    Args:
        status: the HTTP status code.
        headers: the *response* headers (case-insensitive mapping such as ``httpx.Headers``,
            or a dict with lower-case names). Request headers are never looked at, so no
            credential reaches the message.
        body: the start of the response body (the caller bounds it to a few KiB).
        now: POSIX time for an HTTP-date ``Retry-After`` (default: see
            :func:`parse_retry_after`).
        redact: masks secrets the server quoted back; applied to the whole message before
            it is cut to 300 characters.

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
    kind, retryable = _kind_for(status, message, labels, in_band=False)
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
    )


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


# -- non-SSE answers ----------------------------------------------------------------------

_BOM = b"\xef\xbb\xbf"
_SSE_START = (b"data:", b"data\n", b"data\r", b":", b"event:", b"id:", b"retry:")


def decode_json_body(
    status: int, headers: Mapping[str, str], body: bytes, *, redact: Redact = _no_redact
) -> list[Delta]:
    """Decode a whole ``application/json`` answer to a streaming request.

    An error object raises its classified :class:`AttemptError`; a ``chat.completion``
    (the server ignored ``stream: true``) becomes one Delta with its content, reasoning,
    tool calls, finish reason and usage. Tolerated: a body that is really an event stream
    (decoded as one), and ``data: [DONE]`` appended after the JSON.

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
            raise classify_http_error(status, headers, body, redact=redact)
        raise _in_band_error(obj, headers, status=status, redact=redact)
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


class ChunkDecoder:
    """Per-response decoder of an OpenAI-compatible chat-completion event stream.

    Args:
        max_event_size: bound on one SSE event (see :class:`trio_hedge.sse.SSEDecoder`).
        redact: masks secrets the server quoted back in an error event (default: none).

    Attributes:
        done: ``[DONE]`` was seen; later bytes are ignored.
        data_events: data events seen so far: events whose data is non-empty after stripping
            (``[DONE]`` and error events count; comments, ``id:``/``retry:``-only blocks and
            empty ``data:`` keep-alives do not). A body that is one JSON document counts 1.
        error: the :class:`AttemptError` this decoder raised or will raise next, or ``None``.
        finish_reason: the last non-empty finish reason seen, or ``None``.
        usage: the last usage object seen, or ``None``.

    A body that starts with ``{`` or ``[`` is not an event stream (a JSON answer under an
    event-stream content type): it is buffered and decoded by :func:`decode_json_body` at
    :meth:`end`.
    """

    __slots__ = (
        "_json",
        "_mode",
        "_redact",
        "_sse",
        "data_events",
        "done",
        "error",
        "finish_reason",
        "usage",
    )

    def __init__(
        self, max_event_size: int = DEFAULT_MAX_EVENT_SIZE, *, redact: Redact = _no_redact
    ) -> None:
        self._sse = SSEDecoder(max_event_size)
        self._redact = redact
        self._mode = 0  # 0: undecided (only whitespace so far), 1: SSE, 2: whole JSON body
        self._json = bytearray()
        self.done = False
        self.error: AttemptError | None = None
        self.data_events = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def feed(self, data: bytes) -> list[Delta]:
        """Decode the next bytes of the body; return the Deltas of the events they complete.

        When an error event follows Deltas in the same read, those Deltas are returned and
        the error is raised by the next :meth:`feed` or :meth:`end` (it is also in
        :attr:`error` at once): the text before an in-band error is never lost.

        Raises:
            AttemptError: an in-band error event (classified), or ``PROTOCOL`` (bad SSE, an
                event that is not JSON, an event over ``max_event_size``).
        """
        if self.error is not None:
            raise self.error
        if self.done:
            return []
        if self._mode != 1:
            data = self._sniff(data)
            if not data:
                return []
        out: list[Delta] = []
        try:
            for event in self._sse.feed_raw(data):
                delta = self._event(event, final=False)
                if delta is not None:
                    out.append(delta)
                if self.done:
                    break
            else:
                if self._sse.pending_error is not None:
                    raise self._sse.pending_error
        except AttemptError as exc:
            self.error = exc
            if not out:
                raise
        return out

    def feed_indexed(self, data: bytes) -> list[tuple[int, Delta]]:
        """Like :meth:`feed`, pairing each Delta with the 0-based index of its data event."""
        # A twin of feed() on purpose: feed() is the per-token hot path and must not build
        # index pairs for the tests and tools that want them.
        if self.error is not None:
            raise self.error
        if self.done:
            return []
        if self._mode != 1:
            data = self._sniff(data)
            if not data:
                return []
        out: list[tuple[int, Delta]] = []
        try:
            for event in self._sse.feed_raw(data):
                delta = self._event(event, final=False)
                if delta is not None:
                    out.append((self.data_events - 1, delta))
                if self.done:
                    break
            else:
                if self._sse.pending_error is not None:
                    raise self._sse.pending_error
        except AttemptError as exc:
            self.error = exc
            if not out:
                raise
        return out

    def end(self) -> list[Delta]:
        """The body ended: return the last Deltas, or raise if the stream is incomplete.

        Raises:
            AttemptError: ``STREAM_TRUNCATED`` (data came, but neither ``[DONE]`` nor a
                finish reason), ``EMPTY_STREAM`` (no data event), or an error from the last
                event.
        """
        return [delta for _, delta in self.end_indexed()]

    def end_indexed(self) -> list[tuple[int, Delta]]:
        """Like :meth:`end`, pairing each Delta with the index of its data event."""
        if self.error is not None:
            raise self.error
        try:
            return self._end()
        except AttemptError as exc:
            self.error = exc
            raise

    def _end(self) -> list[tuple[int, Delta]]:
        if self.done:
            return []
        if self._mode == 2:
            return self._end_json()
        out: list[tuple[int, Delta]] = []
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
                out.append((self.data_events - 1, delta))
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

    def _sniff(self, data: bytes) -> bytes:
        """Until the first significant byte: decide between SSE and a whole JSON body."""
        buf = self._json
        buf += data
        if len(buf) > self._sse.max_event_size:
            raise AttemptError(ErrorKind.PROTOCOL, "answer larger than max_event_size")
        if self._mode == 2:
            return b""
        raw = bytes(buf)
        if len(raw) < 3 and _BOM.startswith(raw):
            return b""  # maybe the start of a BOM
        head = raw[3:] if raw.startswith(_BOM) else raw
        head = head.lstrip(b" \t\r\n")
        if not head:
            return b""  # only blank lines so far: no meaning in either format
        if head[0] in b"{[":
            self._mode = 2
            self._json = bytearray(head)
            return b""
        self._mode = 1
        buf.clear()
        return raw

    def _end_json(self) -> list[tuple[int, Delta]]:
        self.data_events = 1
        deltas = decode_json_body(200, {}, bytes(self._json), redact=self._redact)
        self.done = True
        for delta in deltas:
            if delta.finish_reason is not None:
                self.finish_reason = delta.finish_reason
            if delta.usage is not None:
                self.usage = delta.usage
        return [(0, delta) for delta in deltas]

    def _event(self, event: RawEvent, *, final: bool) -> Delta | None:
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
                raise _in_band_error(text, redact=self._redact) from None
            if text[0] == ":":
                return None  # an SSE comment a proxy re-wrapped as data
            raise AttemptError(
                ErrorKind.PROTOCOL,
                f"event data is not JSON: {_truncate(self._redact(text))[:80]!r}",
            ) from None
        self.data_events += 1
        if type(obj) is not dict:
            if kind == "error" or _is_error(obj):
                raise _in_band_error(obj, redact=self._redact)
            return None
        if kind == "error" or obj.get("error") or obj.get("object") == "error":
            raise _in_band_error(obj, redact=self._redact)
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
            raise _in_band_error(obj, redact=self._redact)
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
