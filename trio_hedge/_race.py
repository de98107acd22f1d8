"""The race: staggered attempts in one nursery, fail fast, commit at the first token.

Modelled on Trio's Happy Eyeballs (``trio/_highlevel_open_tcp_stream.py``): the parent loop
starts an attempt, then waits ``with trio.move_on_after(delay): await attempt_failed.wait()``,
so the next attempt starts after the hedge delay *or* at once when an attempt fails; no timer
tasks. The winner cancels the nursery. Every stream an attempt opens is closed by that
attempt's own task on the way out unless it was handed out as the winner.

The nursery spans only the time to the first token: the winner's stream leaves the race
open, and the caller's task reads it directly afterwards (no task switch per token).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence

import attrs
import httpx
import trio

from ._errors import AllAttemptsFailed, AttemptError, ErrorKind, FatalAttemptError
from ._events import Delta, FirstToken, counts_as_first_token
from ._plan import Planner
from ._report import AttemptOutcome, _AttemptState, _Recorder
from .sources._base import AttemptInfo, AttemptStream, Source

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["Committed", "close_quietly", "race"]


@attrs.frozen
class Committed:
    """The race's result: the winner's open stream and what it read before handing over."""

    number: int
    stream: AttemptStream
    pending: Sequence[Delta]
    ended: bool  # the winner's stream already ended cleanly (a complete, possibly empty answer)


def classify_exception(exc: Exception) -> AttemptError:
    """Turn what a source raised into an :class:`AttemptError` (sources should raise
    ``AttemptError`` themselves; this covers generic iterators and stray transport errors)."""
    if isinstance(exc, AttemptError):
        return exc
    err: AttemptError
    if isinstance(exc, (httpx.TimeoutException, TimeoutError, trio.TooSlowError)):
        err = AttemptError(ErrorKind.TIMEOUT, f"{type(exc).__name__}: {exc}")
    elif isinstance(exc, (httpx.TransportError, OSError, trio.BrokenResourceError)):
        err = AttemptError(ErrorKind.CONNECTION, f"{type(exc).__name__}: {exc}")
    else:
        err = AttemptError(ErrorKind.UNKNOWN, f"{type(exc).__name__}: {exc}", retryable=False)
    err.__cause__ = exc
    return err


async def close_quietly(stream: AttemptStream, limit: float) -> None:
    """Close ``stream`` even inside a cancelled scope, bounded by ``limit`` seconds."""
    # One scope, shielded and bounded (it runs on every attempt's way out).
    with trio.CancelScope(shield=True, deadline=trio.current_time() + limit):
        try:  # noqa: SIM105 - suppress() would cost a context manager on every close
            await stream.aclose()
        except Exception:  # a failing close must not mask the race's outcome
            pass


def _summary(errors: Sequence[AttemptError]) -> str:
    """``"all 2 attempts failed: overloaded (HTTP 503) at a; connection at b"``."""
    n = len(errors)
    head = "the only attempt failed" if n == 1 else f"all {n} attempts failed"
    return head + ": " + "; ".join(e.brief() for e in errors)


def _sole_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """Attempts turn every ``Exception`` into data, so what escapes the race's nursery is a
    ``KeyboardInterrupt``, a bug, or cancellation. Raise a lone non-``Cancelled`` error as
    itself (as ``open_tcp_stream`` raises a plain ``OSError``), not wrapped in a group the
    caller never asked for; leave groups of ``Cancelled`` to Trio."""
    _, rest = group.split(trio.Cancelled)
    if rest is not None and len(leaves := list(_leaves(rest))) == 1:
        return leaves[0]
    return group


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


class _Race:
    def __init__(
        self,
        planner: Planner,
        recorder: _Recorder,
        *,
        first_token: FirstToken,
        close_timeout: float,
    ) -> None:
        self._planner = planner
        self._observed = getattr(planner, "observes_attempts", True)
        self._recorder = recorder
        self._first_token = first_token
        self._close_timeout = close_timeout
        self._winner: Committed | None = None
        self._fatal: AttemptError | None = None
        self._errors: list[AttemptError] = []
        self._sources: dict[int, Source] = {}
        self._attempt_failed = trio.Event()
        self._nursery: trio.Nursery | None = None

    def _changed(self, state: _AttemptState) -> None:
        if not self._observed:  # a frozen record per state change costs; skip it when unused
            return
        record = state.freeze(self._recorder.origin)
        self._planner.attempt_changed(self._sources[state.number], record)

    async def run(self) -> Committed:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self._stagger(nursery)
        except BaseExceptionGroup as group:
            raise _sole_error(group) from None
        if self._winner is not None:
            return self._winner
        errors = tuple(self._errors)
        if self._fatal is not None:
            raise FatalAttemptError(
                f"fatal error, not retried: {self._fatal}", errors, error=self._fatal
            )
        if not errors:
            raise AllAttemptsFailed("no attempt could be started", errors)
        raise AllAttemptsFailed(_summary(errors), errors)

    async def _stagger(self, nursery: trio.Nursery) -> None:
        number = 0
        trigger = "primary"
        while True:
            source = await self._planner.next_source(number + 1, trigger)
            if source is None:
                return
            number += 1
            self._attempt_failed = attempt_failed = trio.Event()
            self._start(nursery, number, source, trigger)
            delay = self._planner.hedge_delay(number)
            with trio.move_on_after(math.inf if delay is None else delay):
                await attempt_failed.wait()
            if attempt_failed.is_set():
                trigger = "failover"
                continue
            # A first token due at the very instant the delay ends wins without a hedge: let
            # the tasks woken in this tick run first (a commit cancels us right here).
            await trio.lowlevel.checkpoint()
            if self._planner.may_hedge():
                trigger = "hedge"
                self._recorder.hedged = True
                continue
            # The budget said no: the running attempts go on alone; only a failure may still
            # start another attempt.
            self._recorder.hedges_refused += 1
            await attempt_failed.wait()
            trigger = "failover"

    def _start(self, nursery: trio.Nursery, number: int, source: Source, trigger: str) -> None:
        state = _AttemptState(
            number=number, replica=source.name, trigger=trigger, started_at=trio.current_time()
        )
        self._recorder.attempts.append(state)
        self._sources[number] = source
        self._changed(state)
        info = AttemptInfo(
            request_id=self._recorder.request_id,
            number=number,
            trigger=trigger,
            idempotency_key=self._recorder.idempotency_key,
        )
        nursery.start_soon(self._attempt, state, source, info, name=f"trio_hedge attempt {number}")

    async def _attempt(self, state: _AttemptState, source: Source, info: AttemptInfo) -> None:
        stream: AttemptStream | None = None
        try:
            stream = await source.open(info)
            pending: list[Delta] = []
            while True:
                batch = await stream.receive()
                if batch is None:  # ended cleanly before any first token: an answer all the same
                    if self._commit(state, stream, pending, ended=True):
                        stream = None
                    return
                pending.extend(batch)
                state.tokens_received += sum(1 for d in batch if d.content)
                for delta in batch:
                    if counts_as_first_token(delta, self._first_token):
                        if self._commit(state, stream, pending, ended=False):
                            stream = None  # handed out: the caller now owns closing it
                        return
        except trio.Cancelled:
            state.outcome = AttemptOutcome.CANCELLED
            state.ended_at = trio.current_time()
            self._changed(state)
            raise
        except Exception as exc:
            self._failed(state, source, classify_exception(exc))
        finally:
            if stream is not None:
                await close_quietly(stream, self._close_timeout)

    def _commit(
        self, state: _AttemptState, stream: AttemptStream, pending: list[Delta], *, ended: bool
    ) -> bool:
        now = trio.current_time()
        if self._winner is not None or self._fatal is not None:
            # Another attempt committed in the same scheduling tick: this one lost.
            state.outcome = AttemptOutcome.CANCELLED
            state.ended_at = now
            self._changed(state)
            return False
        self._winner = Committed(state.number, stream, pending, ended)
        state.outcome = AttemptOutcome.WON
        state.ttft = now - state.started_at
        self._recorder.winner = state.number
        self._recorder.committed_at = now
        self._changed(state)
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel(reason=f"attempt {state.number} committed")
        return True

    def _failed(self, state: _AttemptState, source: Source, error: AttemptError) -> None:
        if error.replica is None:
            error.replica = source.name
        state.outcome = AttemptOutcome.FAILED
        state.error = error
        state.ended_at = trio.current_time()
        self._errors.append(error)
        self._changed(state)
        if not error.retryable and self._winner is None:
            self._fatal = error
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel(reason=f"attempt {state.number}: fatal {error}")
        else:
            self._attempt_failed.set()


async def race(
    planner: Planner, recorder: _Recorder, *, first_token: FirstToken, close_timeout: float
) -> Committed:
    """Race attempts until one produces a first token.

    Returns:
        the :class:`Committed` winner; its stream is open and owned by the caller.

    Raises:
        FatalAttemptError: an attempt failed with a non-retryable error.
        AllAttemptsFailed: every attempt the planner allowed failed.
    """
    return await _Race(
        planner, recorder, first_token=first_token, close_timeout=close_timeout
    ).run()
