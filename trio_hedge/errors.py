"""The public exception types: [`HedgeError`][trio_hedge.HedgeError] and its subclasses (what a
request raises), [`AttemptError`][trio_hedge.AttemptError] and
[`ErrorKind`][trio_hedge.errors.ErrorKind] (why one attempt failed).

Errors are data until the race ends: an attempt that fails records an
[`AttemptError`][trio_hedge.AttemptError] and wakes the race; only the race decides whether that
error is fatal, a reason to start the next attempt at once, or the last straw. What `hedged_stream`
raises is always a [`HedgeError`][trio_hedge.HedgeError] (or the caller's own cancellation), never a
bare ``ExceptionGroup``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup

from ._attempt_error import AttemptError, ErrorKind

# Tracebacks name an exception by its class's module: this one is raised and caught through
# its public home, so an uncaught one reads ``trio_hedge.errors.AttemptError``, not the private
# module it is defined in.
AttemptError.__module__ = __name__

if TYPE_CHECKING:
    from .report import Report

__all__ = [
    "AllAttemptsFailed",
    "AttemptError",
    "ErrorKind",
    "FatalAttemptError",
    "HedgeError",
    "RequestFailed",
    "StreamInterrupted",
]


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
    (``HedgerConfig.max_pushback_wait``, or less when the request's deadline comes first:
    its ``first_token_timeout`` or the caller's cancel scope). Raised at once, without
    waiting in vain; nothing was sent, so ``errors`` is empty.

    Attributes:
        until: the Trio time (``trio.current_time()``, seconds) at which the first of those
            replicas may take a request again.
        retry_in: seconds from the moment this was raised until ``until``.
        max_wait: the bound that was exceeded, in seconds: ``max_pushback_wait``, or the
            time left before the request's deadline when that is shorter.
    """

    def __init__(
        self, *, until: float, retry_in: float, max_wait: float, report: Report | None = None
    ) -> None:
        super().__init__(
            f"every replica is cooling after server pushback until Trio time {until:.3f}, "
            f"{retry_in:.3f} s from now: longer than the request may wait ({max_wait:g} s)",
            (),
            report=report,
        )
        self.until = until
        self.retry_in = retry_in
        self.max_wait = max_wait
