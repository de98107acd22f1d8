"""One attempt's failure, as data: [`ErrorKind`][trio_hedge.errors.ErrorKind] (why) and
[`AttemptError`][trio_hedge.AttemptError] (what the race records and decides on);
`classify_exception` turns whatever a source raised into one. Public from `trio_hedge.errors`; kept
apart from the request-level exceptions there because the [`Report`][trio_hedge.Report] records
attempt errors while those exceptions carry a report: each module imports only downward.
"""

from __future__ import annotations

import enum
import sys

import trio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "REPLICA_KINDS",
    "RETRYABLE_KINDS",
    "TRANSIENT_KINDS",
    "AttemptError",
    "ErrorKind",
    "classify_exception",
    "leaves",
]


class ErrorKind(str, enum.Enum):
    """Why one attempt failed. The value is the stable, lower-case name used in reports/JSON."""

    RATE_LIMIT = "rate_limit"
    """429 without a quota message; retryable, usually with a ``Retry-After``."""
    QUOTA_EXCEEDED = "quota_exceeded"
    """429/402/403 saying the account's quota or credit is used up: the replica's fault."""
    OVERLOADED = "overloaded"
    """503, 529, or an in-band "overloaded" event; retryable."""
    SERVER_ERROR = "server_error"
    """other 5xx, or an in-band server error; retryable."""
    INVALID_REQUEST = "invalid_request"
    """400, 405, 413, 422 and other client errors: the request's fault; fatal (a backup would
    fail the same way)."""
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    """the prompt does not fit the model's context window: the request's fault; fatal."""
    AUTH = "auth"
    """401/403: bad or missing API key: the replica's fault (see `REPLICA_KINDS`)."""
    NOT_FOUND = "not_found"
    """404: the replica does not serve this model or path: the replica's fault."""
    STREAM_TRUNCATED = "stream_truncated"
    """the connection ended after data without ``[DONE]`` or a finish reason; retryable."""
    EMPTY_STREAM = "empty_stream"
    """the response ended without a single data event; retryable."""
    CONNECTION = "connection"
    """could not connect, or the connection broke; retryable."""
    TIMEOUT = "timeout"
    """an HTTP timeout (connect/read/write/pool) or a 408; retryable."""
    STALL = "stall"
    """after commit, the caller waited ``stall_timeout`` seconds on the winner with no
    output arriving (content, reasoning or tool-call fragments)."""
    PROTOCOL = "protocol"
    """the bytes broke the protocol (bad SSE, bad JSON, event too large, invalid UTF-8);
    retryable before the first token (another replica may be sane)."""
    UNKNOWN = "unknown"
    """the source raised something the library does not know; fatal."""
    DIVERGED = "diverged"
    """a recovery after the commit did not reproduce the output the caller already has (a
    replay that sampled differently, a continuation that did not repeat its prefix as its
    engine promised): not retried, the answer ends as it was; nobody's fault."""


#: Kinds that are the replica's fault, not the request's: that replica will fail every request
#: until someone fixes it (a wrong key, an exhausted quota, an unknown model or a wrong path),
#: but another replica may answer. Such an attempt fails alone (the other attempts go on, and
#: the next one starts at once) and its replica is blamed strongly.
REPLICA_KINDS = frozenset({ErrorKind.AUTH, ErrorKind.QUOTA_EXCEEDED, ErrorKind.NOT_FOUND})

#: Transient kinds: another attempt may fix them, unless the error itself says otherwise.
TRANSIENT_KINDS = frozenset(
    {
        ErrorKind.RATE_LIMIT,
        ErrorKind.OVERLOADED,
        ErrorKind.SERVER_ERROR,
        ErrorKind.STREAM_TRUNCATED,
        ErrorKind.EMPTY_STREAM,
        ErrorKind.CONNECTION,
        ErrorKind.TIMEOUT,
        ErrorKind.STALL,
        ErrorKind.PROTOCOL,
    }
)

#: Kinds another attempt (on another replica) may fix: the rest are the request's fault.
RETRYABLE_KINDS = TRANSIENT_KINDS | REPLICA_KINDS


class AttemptError(Exception):
    """One attempt's failure, classified.

    Attributes:
        kind: the [`ErrorKind`][trio_hedge.errors.ErrorKind].
        retryable: whether another attempt (on another replica) may succeed. Defaults to
            whether ``kind`` is in `RETRYABLE_KINDS`; a non-retryable error is the
            request's fault and ends the whole request
            ([`FatalAttemptError`][trio_hedge.FatalAttemptError]).
        retry_after: seconds the server asked to wait before trying it again (from
            ``Retry-After`` / ``retry-after-ms``), or ``None``.
        status_code: the HTTP status, or ``None`` for transport/in-band errors.
        replica: the name of the replica the attempt went to (filled in by the race).
        message: a human-readable description; never contains credentials.
        hint: a short way to fix a misconfiguration (``"base_url usually ends in /v1"``),
            which the request's one-line summary carries too, or ``None``.
        context_window: for a context-length error, the window (tokens) the server stated
            (``maximum context length is 4096 tokens``, llama-server's ``n_ctx``), or
            ``None``: a window is learned only from a size the server states, never from
            the request's estimated size.
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        retryable: bool | None = None,
        retry_after: float | None = None,
        status_code: int | None = None,
        replica: str | None = None,
        hint: str | None = None,
        context_window: int | None = None,
    ) -> None:
        super().__init__(message)
        self.context_window = context_window
        self.kind = kind
        self.message = message
        self.hint = hint
        self.retryable = kind in RETRYABLE_KINDS if retryable is None else retryable
        self.retry_after = retry_after
        self.status_code = status_code
        self.replica = replica

    @property
    def replica_fault(self) -> bool:
        """Whether the error is the replica's fault (`REPLICA_KINDS`): the replica is
        misconfigured for this request, another replica may still answer."""
        return self.kind in REPLICA_KINDS

    def brief(self) -> str:
        """``"rate_limit (HTTP 429, retry after 2 s) at replica"``: the error without its
        message, and its ``hint`` if any
        (``"not_found (HTTP 404) at a: base_url usually ends in /v1"``)."""
        head = self._head()
        return f"{head}: {self.hint}" if self.hint else head

    def _head(self) -> str:
        details = []
        if self.status_code is not None:
            details.append(f"HTTP {self.status_code}")
        if self.retry_after is not None:
            details.append(f"retry after {self.retry_after:g} s")
        text = self.kind.value + (f" ({', '.join(details)})" if details else "")
        return text + (f" at {self.replica}" if self.replica else "")

    def __str__(self) -> str:
        return f"{self._head()}: {self.message}"

    def __repr__(self) -> str:
        return (
            f"AttemptError(kind={self.kind.value!r}, message={self.message!r}, "
            f"retryable={self.retryable!r}, retry_after={self.retry_after!r}, "
            f"status_code={self.status_code!r}, replica={self.replica!r}, hint={self.hint!r})"
        )

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready description (for reports and the CLI's ``--json``)."""
        return {
            "kind": self.kind.value,
            "message": self.message,
            "retryable": self.retryable,
            "retry_after": self.retry_after,
            "status_code": self.status_code,
            "replica": self.replica,
        }


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``, flattening (nested) exception groups."""
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    found: list[BaseException] = []
    for inner in exc.exceptions:
        found.extend(leaves(inner))
    return found


def _http_stack_kind(cls: type[BaseException]) -> ErrorKind | None:
    """What an exception of the HTTP stack that a source let through means: a generic
    iterator may read with httpx, and httpcore's and h2's own protocol errors are not mapped
    to httpx's on every path (an HTTP/2 stream used after a cancel). httpx's timeouts are
    timeouts, its transport errors and anything from httpcore, h2 or h11 a broken connection
    (not a bad request); ``None`` for anything else. Known by class and module name: the
    engine imports no HTTP library (the HTTP source classifies its own errors, in
    ``sources/openai/_errors.py``)."""
    top = cls.__module__.partition(".")[0]
    if top in ("httpcore", "h2", "h11"):
        return ErrorKind.CONNECTION
    if top != "httpx":
        return None
    bases = {c.__name__ for c in cls.__mro__ if c.__module__.partition(".")[0] == "httpx"}
    if "TimeoutException" in bases:
        return ErrorKind.TIMEOUT
    return ErrorKind.CONNECTION if "TransportError" in bases else None


def classify_exception(exc: BaseException) -> AttemptError:
    """Turn what a source raised into an [`AttemptError`][trio_hedge.AttemptError].

    Sources should raise ``AttemptError`` themselves; this covers generic iterators (an
    ``OSError`` is a connection error, a ``TimeoutError`` a timeout, anything else unknown and
    fatal) and exception groups from sources that use a nursery: a group's errors are
    classified one by one, and the group is as bad as its worst (the first fatal one, else the
    first one).
    """
    if isinstance(exc, BaseExceptionGroup):
        errors = [classify_exception(leaf) for leaf in leaves(exc)]
        worst = next((e for e in errors if not e.retryable), errors[0])
        if len(errors) > 1 and worst.__cause__ is not exc:
            worst.__cause__ = exc  # keep the whole group in the chain
        return worst
    if isinstance(exc, AttemptError):
        return exc
    err: AttemptError
    http_kind = _http_stack_kind(type(exc))
    if http_kind is ErrorKind.TIMEOUT or isinstance(exc, (TimeoutError, trio.TooSlowError)):
        err = AttemptError(ErrorKind.TIMEOUT, f"{type(exc).__name__}: {exc}")
    elif http_kind is not None or isinstance(exc, (OSError, trio.BrokenResourceError)):
        err = AttemptError(ErrorKind.CONNECTION, f"{type(exc).__name__}: {exc}")
    else:
        err = AttemptError(ErrorKind.UNKNOWN, f"{type(exc).__name__}: {exc}", retryable=False)
    err.__cause__ = exc
    return err
