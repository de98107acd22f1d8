"""OpenAI-shaped errors: what a client sees when a request fails, with its true status.

Before the commit nothing has been sent, so an error answers with the status the upstream
replicas gave (400, 401, 404, 429 with ``Retry-After``, 503…) and an OpenAI error body, which
the official SDKs turn into their own typed exceptions (``BadRequestError``,
``AuthenticationError``, ``RateLimitError``, ``InternalServerError``…). After the commit the
status line is gone: the stream ends with the same body as an in-band ``data:`` event, and no
``[DONE]``.

Every error answer says whether a retry can help (``x-should-retry``, read by the official
openai and anthropic SDKs before their own status rules): ``false`` on errors the gateway
produced after trying every replica it may, and on the request's own faults, so a client's
default retries do not send an exhausted request to the fleet again; ``true`` only where a
retry can help (draining, a full queue or a key's rate with a short ``Retry-After``: at most
`SHORT_RETRY_AFTER`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence

import attrs

from .. import AttemptError, HedgeError, ReplicasCooling, RequestFailed, StreamInterrupted
from ..errors import ErrorKind

__all__ = ["SHORT_RETRY_AFTER", "ErrorAnswer", "answer_for", "mask", "name_replicas", "short"]

#: The longest ``Retry-After`` (seconds) after which the gateway says a retry can help: the
#: openai SDK waits up to 120 s and refuses longer; older ones (and other clients) 60 s, and
#: the anthropic SDK waits however long it is told.
SHORT_RETRY_AFTER = 60.0


def short(retry_after: float | None) -> bool:
    """Whether a client waiting ``retry_after`` seconds, then retrying, is worth telling to."""
    return retry_after is not None and retry_after <= SHORT_RETRY_AFTER


#: The status an upstream error without one stands for.
_KIND_STATUS = {
    ErrorKind.RATE_LIMIT: 429,
    ErrorKind.QUOTA_EXCEEDED: 429,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.SERVER_ERROR: 502,
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorKind.AUTH: 401,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.STREAM_TRUNCATED: 502,
    ErrorKind.EMPTY_STREAM: 502,
    ErrorKind.CONNECTION: 502,
    ErrorKind.TIMEOUT: 504,
    ErrorKind.STALL: 504,
    ErrorKind.SLOW_STREAM: 504,
    ErrorKind.PROTOCOL: 502,
    ErrorKind.UNKNOWN: 502,
}
#: Statuses that say "no capacity now, come back": answered as one 503 when mixed.
_CAPACITY = frozenset({429, 503, 529})


def _type_for(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status == 504:
        return "timeout"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def mask(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every secret in it replaced by ``***``."""
    for secret in secrets:
        if secret and secret in text:
            text = text.replace(secret, "***")
    return text


#: A URL an upstream error's message may name (the request line ``POST http://…`` that a
#: 404's context adds, a TLS failure's): clients get the replica's configured name instead.
_URL = re.compile(r"(?:(?:GET|POST|PUT|PATCH|DELETE|HEAD) )?https?://[^\s)\]'\",;]+")


def name_replicas(text: str, urls: Mapping[str, str]) -> str:
    """``text`` with every URL in it replaced by the name of the replica it belongs to
    (``urls``: base URL -> configured name; the longest that starts it), or ``an upstream``:
    a client of the gateway learns which replica answered, never where it lives."""

    def named(found: re.Match[str]) -> str:
        url = found.group(0).split(" ", 1)[-1]
        best = max((base for base in urls if url.startswith(base)), key=len, default=None)
        return f"replica {urls[best]!r}" if best is not None else "an upstream"

    return _URL.sub(named, text) if "://" in text else text


@attrs.frozen
class ErrorAnswer:
    """One error answer: status, OpenAI error fields, ``Retry-After`` (seconds), and whether
    a retry can help (``x-should-retry``; default ``False``)."""

    status: int
    message: str
    type: str | None = None
    code: str | None = None
    param: str | None = None
    retry_after: float | None = None
    should_retry: bool = False
    # The upstream API's own error type, for a route whose shape has its own types
    # (Anthropic's: the SDK raises by it).
    upstream_type: str | None = None

    def body(self) -> bytes:
        """``{"error": {"message", "type", "param", "code"}}`` as JSON bytes."""
        error = {
            "message": self.message,
            "type": self.type or _type_for(self.status),
            "param": self.param,
            "code": self.code,
        }
        return json.dumps({"error": error}, ensure_ascii=False).encode()

    def event(self) -> bytes:
        """The body as one in-band SSE ``data:`` event (after the commit)."""
        return b"data: " + self.body() + b"\n\n"

    def headers(self) -> list[tuple[bytes, bytes]]:
        """``content-type``, ``x-should-retry``, and ``retry-after`` in whole seconds (RFC
        9110) with ``retry-after-ms`` (milliseconds, which the openai SDK reads first) when
        set."""
        out = [
            (b"content-type", b"application/json"),
            (b"x-should-retry", b"true" if self.should_retry else b"false"),
        ]
        if self.retry_after is not None:
            seconds = max(0.0, self.retry_after)
            out.append((b"retry-after", str(math.ceil(seconds)).encode()))
            out.append((b"retry-after-ms", str(math.ceil(seconds * 1000)).encode()))
        return out


def _status_of(error: AttemptError) -> int:
    status = error.status_code
    if status is not None and 400 <= status <= 599:
        return status
    return _KIND_STATUS.get(error.kind, 502)


def _min_retry_after(errors: Sequence[AttemptError]) -> float | None:
    found = [e.retry_after for e in errors if e.retry_after is not None]
    return min(found) if found else None


def _answer(error: AttemptError, message: str, **fields: object) -> ErrorAnswer:
    """The answer for ``error``: its status, the upstream API's own ``code``, ``param`` and
    ``type`` when it named them (agent clients branch on them: ``previous_response_not_found``
    before they resend the history), else the kind."""
    return ErrorAnswer(
        _status_of(error),
        message,
        code=error.code or error.kind.value,
        param=error.param,
        upstream_type=error.api_type,
        **fields,  # type: ignore[arg-type]
    )


def _from_errors(
    summary: str, errors: Sequence[AttemptError], default_retry_after: float
) -> ErrorAnswer:
    """One answer for the attempts' errors: their status when they agree (with their
    upstream code and param when they agree too); 503 when all said "no capacity" in
    different ways; else 502 (the replicas failed in different ways)."""
    if not errors:
        return ErrorAnswer(503, summary, code="no_attempt", retry_after=default_retry_after)
    statuses = {_status_of(e) for e in errors}
    last = errors[-1]
    retry_after = _min_retry_after(errors)
    if len(statuses) == 1:
        (status,) = statuses
    elif statuses <= _CAPACITY:
        status = 503
    else:
        return ErrorAnswer(502, summary, code="upstream_errors")
    if status in _CAPACITY and retry_after is None:
        retry_after = default_retry_after
    message = last.message if len(errors) == 1 else f"{last.message} ({summary})"
    same = len({(e.code, e.param, e.api_type) for e in errors}) == 1 and len(statuses) == 1
    if same:
        return _answer(last, message, retry_after=retry_after)
    return ErrorAnswer(status, message, code=last.kind.value, retry_after=retry_after)


def answer_for(
    exc: HedgeError,
    *,
    secrets: Sequence[str] = (),
    default_retry_after: float = 1.0,
    replicas: Mapping[str, str] | None = None,
) -> ErrorAnswer:
    """The answer for a failed request.

    * [`FatalAttemptError`][trio_hedge.FatalAttemptError] (the request's fault): the fatal error's
      status and message.
    * [`AllAttemptsFailed`][trio_hedge.AllAttemptsFailed] and other
      [`RequestFailed`][trio_hedge.RequestFailed]: the attempts' common status (401, 404, 429,
      503…), 503 for mixed capacity errors, 502 for errors that disagree, 504 for the first-token
      timeout; ``Retry-After`` is the earliest any replica gave.
    * [`ReplicasCooling`][trio_hedge.ReplicasCooling] (every replica asked to be left alone for
      longer than the Hedger waits; nothing was sent): 503 with ``Retry-After`` until the first
      of them may take a request again.
    * [`StreamInterrupted`][trio_hedge.StreamInterrupted] (after the commit): the winner's error.
    * any other [`HedgeError`][trio_hedge.HedgeError]: 503 with its ``retry_after`` when it
      carries one.

    An upstream API's own error ``code``, ``param`` and ``type``
    ([`AttemptError.code`][trio_hedge.AttemptError]) are kept when every attempt gave the
    same. ``secrets`` (a client's forwarded key, the gateway's keys) are masked in the
    message, and every URL in it is replaced by its replica's configured name (``replicas``:
    base URL -> name). Every answer but ``ReplicasCooling``'s (``x-should-retry: true`` when
    its ``Retry-After`` is short) says ``x-should-retry: false``: the Hedger tried every
    replica it may.
    """
    answer: ErrorAnswer
    if isinstance(exc, ReplicasCooling):
        # Nothing was sent: once the first replica takes requests again, a retry can help.
        answer = ErrorAnswer(
            503,
            str(exc),
            code="replicas_cooling",
            retry_after=exc.retry_in,
            should_retry=short(exc.retry_in),
        )
    elif isinstance(exc, StreamInterrupted):
        error = exc.error
        answer = _answer(error, error.message, retry_after=error.retry_after)
    elif isinstance(exc, RequestFailed):
        fatal = getattr(exc, "error", None)
        if isinstance(fatal, AttemptError):
            answer = _answer(fatal, fatal.message)
        else:
            summary = str(exc)
            answer = _from_errors(summary, exc.errors, default_retry_after)
    else:
        retry_after = getattr(exc, "retry_after", None)
        if isinstance(retry_after, bool) or not isinstance(retry_after, (int, float)):
            retry_after = default_retry_after
        answer = ErrorAnswer(503, str(exc), code="unavailable", retry_after=float(retry_after))
    message = mask(answer.message, secrets)
    return attrs.evolve(answer, message=name_replicas(message, replicas or {}))
