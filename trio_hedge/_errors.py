"""The public exception types.

Errors are data until the race ends: an attempt that fails records an :class:`AttemptError`
and wakes the race; only the race decides whether that error is fatal, a reason to start the
next attempt at once, or the last straw. What `hedged_stream` raises is always a
:class:`HedgeError` (or the caller's own cancellation), never a bare ``ExceptionGroup``.
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup

if TYPE_CHECKING:
    from ._report import Report

__all__ = [
    "AllAttemptsFailed",
    "AttemptError",
    "ErrorKind",
    "FatalAttemptError",
    "HedgeError",
    "RequestFailed",
    "StreamInterrupted",
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
    """401/403: bad or missing API key: the replica's fault (see :data:`REPLICA_KINDS`)."""
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
    """after commit, the winner produced no content for ``stall_timeout`` seconds."""
    PROTOCOL = "protocol"
    """the bytes broke the protocol (bad SSE, bad JSON, event too large, invalid UTF-8);
    retryable before the first token (another replica may be sane)."""
    UNKNOWN = "unknown"
    """the source raised something the library does not know; fatal."""


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
        kind: the :class:`ErrorKind`.
        retryable: whether another attempt (on another replica) may succeed. Defaults to
            whether ``kind`` is in :data:`RETRYABLE_KINDS`; a non-retryable error is the
            request's fault and ends the whole request (:class:`FatalAttemptError`).
        retry_after: seconds the server asked to wait before trying it again (from
            ``Retry-After`` / ``retry-after-ms``), or ``None``.
        status_code: the HTTP status, or ``None`` for transport/in-band errors.
        replica: the name of the replica the attempt went to (filled in by the race).
        message: a human-readable description; never contains credentials.
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
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retryable = kind in RETRYABLE_KINDS if retryable is None else retryable
        self.retry_after = retry_after
        self.status_code = status_code
        self.replica = replica

    @property
    def replica_fault(self) -> bool:
        """Whether the error is the replica's fault (:data:`REPLICA_KINDS`): the replica is
        misconfigured for this request, another replica may still answer."""
        return self.kind in REPLICA_KINDS

    def brief(self) -> str:
        """``"rate_limit (HTTP 429, retry after 2 s) at replica"``: the error without its
        message."""
        details = []
        if self.status_code is not None:
            details.append(f"HTTP {self.status_code}")
        if self.retry_after is not None:
            details.append(f"retry after {self.retry_after:g} s")
        text = self.kind.value + (f" ({', '.join(details)})" if details else "")
        return text + (f" at {self.replica}" if self.replica else "")

    def __str__(self) -> str:
        return f"{self.brief()}: {self.message}"

    def __repr__(self) -> str:
        return (
            f"AttemptError(kind={self.kind.value!r}, message={self.message!r}, "
            f"retryable={self.retryable!r}, retry_after={self.retry_after!r}, "
            f"status_code={self.status_code!r}, replica={self.replica!r})"
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


class HedgeError(Exception):
    """Base of every error `hedged_stream` raises. ``report`` says what happened so far."""

    report: Report | None

    def __init__(self, message: str, *, report: Report | None = None) -> None:
        super().__init__(message)
        self.report = report


class RequestFailed(HedgeError):
    """No attempt produced a first token. ``errors`` holds each failed attempt's error, in
    the order the attempts started; ``__cause__`` groups them as an ``ExceptionGroup``
    (as Trio's ``open_tcp_stream`` does for its connection attempts)."""

    def __init__(
        self, message: str, errors: tuple[AttemptError, ...], *, report: Report | None = None
    ) -> None:
        super().__init__(message, report=report)
        self.errors = errors
        if errors:
            self.__cause__ = ExceptionGroup(message, list(errors))


class AllAttemptsFailed(RequestFailed):
    """Every attempt the policy allowed failed with a retryable error."""


class FatalAttemptError(RequestFailed):
    """An attempt failed with an error that is the request's fault (400, 413, 422, context
    length…): every other attempt was cancelled at once, since a backup would fail the same
    way. ``error`` is the fatal one; ``errors`` holds every failure, in start order."""

    def __init__(
        self,
        message: str,
        errors: tuple[AttemptError, ...],
        *,
        error: AttemptError,
        report: Report | None = None,
    ) -> None:
        super().__init__(message, errors, report=report)
        self.error = error


class StreamInterrupted(HedgeError):
    """The committed winner failed after its first token (stall, cut connection, in-band
    error). Nothing is retried after commit: the text already relayed stays available as
    ``text`` (and on ``report``); ``error`` (also ``__cause__``) says why."""

    def __init__(self, error: AttemptError, text: str, *, report: Report | None = None) -> None:
        super().__init__(f"stream interrupted after commit: {error}", report=report)
        self.error = error
        self.text = text
        self.__cause__ = error


class ReplicasCooling(RequestFailed):
    """No attempt was sent: every replica the request could use asked to be left alone
    (server pushback, ``Retry-After``) for longer than the Hedger waits
    (``HedgerConfig.max_pushback_wait``). Raised at once, without waiting in vain; nothing
    was sent, so ``errors`` is empty.

    Attributes:
        until: the Trio time (``trio.current_time()``, seconds) at which the first of those
            replicas may take a request again.
        retry_in: seconds from the moment this was raised until ``until``.
        max_wait: the bound that was exceeded, in seconds.
    """

    def __init__(
        self, *, until: float, retry_in: float, max_wait: float, report: Report | None = None
    ) -> None:
        super().__init__(
            f"every replica is cooling after server pushback until Trio time {until:.3f}, "
            f"{retry_in:.3f} s from now: longer than max_pushback_wait={max_wait:g} s",
            (),
            report=report,
        )
        self.until = until
        self.retry_in = retry_in
        self.max_wait = max_wait
