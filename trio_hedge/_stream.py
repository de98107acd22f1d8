"""`HedgedStream`: the async context manager and its token iterator.

Entering races the attempts until one commits (the race's nursery lives and dies inside
``__aenter__``); iterating then reads the winner's stream in the caller's own task, so after
commit a token pays no task switch and no channel hop. Leaving, by any path, closes the winner.
When the winner breaks after the commit, ``_recovery.py`` may go on with the answer on another
replica (``max_recoveries``); the stream then reads the new winner as directly.
"""

from __future__ import annotations

import sys
import uuid
from collections import deque
from collections.abc import Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, NoReturn, Protocol

import sniffio
import trio

from ._attempt_error import classify_exception, leaves
from ._plan import Planner
from ._race import Committed, close_quietly, race
from ._recovery import recover
from ._source import AttemptStream
from .errors import AttemptError, ErrorKind, HedgeError, StreamInterrupted
from .events import Delta, FirstToken
from .report import Report, _Recorder

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["AsyncCloseable", "BatchIterator", "EventIterator", "HedgedStream", "StreamSettings"]


class StreamSettings(Protocol):
    """What a [`HedgedStream`][trio_hedge.HedgedStream] reads of its policy (a
    [`HedgePolicy`][trio_hedge.HedgePolicy] has these; the engine depends on the fields, not on the
    policy package). Seconds."""

    @property
    def first_token(self) -> FirstToken: ...
    @property
    def first_token_timeout(self) -> float | None: ...
    @property
    def stall_timeout(self) -> float | None: ...
    @property
    def close_timeout(self) -> float: ...
    @property
    def max_recoveries(self) -> int: ...


class AsyncCloseable(Protocol):
    """A resource the stream made and closes on exit (the HTTP client of a one-off request)."""

    async def aclose(self) -> None: ...


class HedgedStream:
    """One hedged request: ``async with`` races to the first token, ``async for`` yields
    ``str`` tokens from the winner, [`events`][trio_hedge.HedgedStream.events] yields richer
    [`Delta`][trio_hedge.events.Delta] events, and [`report`][trio_hedge.HedgedStream.report] says
    what happened. Use each stream once.

    The ``async with`` owns a nursery for the racing attempts: it returns at the commit, the
    losers close their own streams concurrently (each within ``close_timeout``), and the block
    does not exit before every attempt's stream is closed.

    Raises:
        FatalAttemptError: from ``async with``: an error that is the request's fault (400,
            413, 422, context length…): no backup would do better.
        AllAttemptsFailed: from ``async with``: every allowed attempt failed, or
            ``first_token_timeout`` passed.
        StreamInterrupted: while iterating: the winner failed after its first token;
            ``.text`` keeps the partial answer.
    """

    def __init__(
        self,
        planner: Planner,
        policy: StreamSettings,
        *,
        request_id: str | None = None,
        owned_client: AsyncCloseable | None = None,
        prompt_tokens: int | None = None,
        idempotency_key: str | None = None,
    ) -> None:
        self._planner = planner
        self._policy = policy
        self._owned_client = owned_client
        self._recorder = _Recorder(
            request_id=request_id or str(uuid.uuid4()),
            prompt_tokens=prompt_tokens,
            idempotency_key=idempotency_key,
        )
        self._planner_told = False
        self._nursery_manager: AbstractAsyncContextManager[trio.Nursery] | None = None
        self._nursery: trio.Nursery | None = None
        self._winner: AttemptStream | None = None
        self._winner_number = 0
        # The winner's deltas not yet handed to the caller: ``async for`` takes the content
        # ones, ``events()`` takes them all, from the same queue (so mixing them never repeats).
        self._pending: deque[Delta] = deque()
        self._ended = False
        self._entered = False
        # The winner, when __anext__ may read it directly (no stall timeout to enforce).
        self._direct: AttemptStream | None = None
        # The stall clock: seconds spent waiting on the winner since its last output. It runs
        # only inside receive(): time the caller spends between reads is not the upstream's.
        self._silent_for = 0.0
        # Recoveries after the commit this request may still make, and the deltas with
        # reasoning or tool calls the caller was given (what a replay must reproduce besides
        # the text; kept only when a recovery may need them).
        self._recoveries_left = policy.max_recoveries
        self._others: list[Delta] | None = [] if self._recoveries_left else None
        self._recovered = 0
        self._token_limit: int | None = None  # the winner's (``Source.token_limit``)

    @property
    def request_id(self) -> str:
        """The id every attempt of this request carries."""
        return self._recorder.request_id

    @property
    def started_at(self) -> float:
        """The Trio clock time (seconds) the request started; report times are offsets
        from it."""
        return self._recorder.origin

    @property
    def report(self) -> Report:
        """A frozen snapshot of what happened so far (see [`Report`][trio_hedge.Report])."""
        return self._recorder.snapshot()

    @property
    def recovered(self) -> int:
        """How many recoveries took over the answer after the commit so far (0 when none
        did): a relay may read it per batch to know the deltas now come from another replica
        (the gateway then rewrites them as one completion). It counts, too, an answer the
        stream ended itself with ``finish_reason="length"`` because the winner broke once
        the caller had every token the request allows (``docs/recovery.md``)."""
        return self._recovered

    @property
    def text(self) -> str:
        """The text relayed to the caller so far."""
        return "".join(self._recorder.chunks)

    # -- entering: the race ----------------------------------------------------------------

    async def __aenter__(self) -> HedgedStream:
        require_trio("hedged_stream() and Hedger.stream()")
        if self._entered:
            raise RuntimeError("a HedgedStream can be entered only once")
        self._entered = True
        rec = self._recorder
        rec.origin = trio.current_time()
        policy = self._policy
        manager = self._nursery_manager = trio.open_nursery()
        nursery = self._nursery = await manager.__aenter__()
        try:
            committed = await race(
                self._planner,
                rec,
                nursery,
                first_token=policy.first_token,
                close_timeout=policy.close_timeout,
                first_token_timeout=policy.first_token_timeout,
            )
        except BaseException as exc:
            nursery.cancel_scope.cancel()
            try:
                await self._leave()  # every attempt closed and recorded before the error goes
            finally:
                rec.ended_at = trio.current_time()
                if isinstance(exc, HedgeError):
                    rec.error = exc
                    exc.report = rec.snapshot()
                self._tell_planner()
            raise
        self._install(committed)
        return self

    # -- leaving: close the winner, wait for the losers --------------------------------------

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        rec = self._recorder
        if rec.ended_at is None:
            rec.ended_at = trio.current_time()
        winner, self._winner = self._winner, None
        self._direct = None
        if exc is not None and not isinstance(exc, HedgeError) and rec.error is None:
            rec.error = exc
        if winner is not None:
            state = rec.attempt(self._winner_number)
            state.ended_at = rec.ended_at
            await close_quietly(winner, self._policy.close_timeout)
        try:
            await self._leave()
        finally:
            self._tell_planner()

    async def _leave(self) -> None:
        """Wait for every attempt task (losers closing their streams), then close the client
        the stream made. The caller's own exception is not passed to the nursery, so it comes
        out as itself, never wrapped in a group; what the tasks raise (a KeyboardInterrupt in
        a source) comes out as itself when it is alone."""
        manager, self._nursery_manager = self._nursery_manager, None
        try:
            if manager is not None:
                try:
                    await manager.__aexit__(None, None, None)
                except BaseExceptionGroup as group:
                    lone = _sole_error(group)
                    if lone is group:
                        raise
                    raise lone from lone.__cause__
        finally:
            await self._close_client()

    def _tell_planner(self) -> None:
        if not self._planner_told:
            self._planner_told = True
            self._planner.request_finished(self._recorder.snapshot())

    async def _close_client(self) -> None:
        client, self._owned_client = self._owned_client, None
        if client is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(self._policy.close_timeout):
                await client.aclose()

    # -- iterating: the hot path -------------------------------------------------------------

    def _take(self, batch: Sequence[Delta], now: float, *, count_for_attempt: bool = True) -> None:
        """Account one batch of the winner's deltas (text, token times, counts)."""
        rec = self._recorder
        chunks = rec.chunks
        others = self._others
        count = 0
        for delta in batch:
            content = delta.content
            if content:
                chunks.append(content)
                count += 1
            if others is not None and (delta.reasoning or delta.tool_calls):
                others.append(delta)
        if count:
            last = rec.last_token_time
            if last is None:
                rec.first_token_time = now
            else:
                gap = now - last
                if rec.max_gap is None or gap > rec.max_gap:
                    rec.max_gap = gap
            rec.last_token_time = now
            rec.token_count += count
            if count_for_attempt:
                rec.attempt(self._winner_number).tokens_received += count

    async def _receive(self) -> Sequence[Delta] | None:
        """The winner's next batch, under the stall timeout; errors become typed.

        The stall timeout bounds the upstream's silence, not the caller's pauses (Envoy's
        ``per_try_idle_timeout`` is upstream idleness): the clock runs only while this task
        waits in the winner's ``receive()``, adds up over calls, and is reset by any output
        (``Delta.has_output``: content, reasoning, tool-call fragments, whatever the
        first-token rule). Keep-alives, role-only deltas and usage do not reset it (the
        caller loops back here). A batch already buffered when the caller comes back costs
        no silence; an upstream silent while the caller was away is charged only from when
        the caller waits again (silent and back-pressured look alike without a read)."""
        winner = self._winner
        if winner is None:
            raise RuntimeError("iterate a HedgedStream inside its 'async with' block")
        stall = self._policy.stall_timeout
        try:
            if stall is None:
                return await winner.receive()
            began = trio.current_time()
            with trio.move_on_at(began + stall - self._silent_for):
                batch = await winner.receive()
                if batch is not None and any(d.has_output for d in batch):
                    self._silent_for = 0.0
                else:
                    self._silent_for += trio.current_time() - began
                return batch
            raise AttemptError(
                ErrorKind.STALL, f"no output from the winner in stall_timeout={stall} s of waiting"
            )
        except Exception as exc:
            return await self._broken(classify_exception(exc))

    async def _broken(self, error: AttemptError) -> Sequence[Delta]:
        """The winner failed after the commit: go on with the answer on another replica (its
        first deltas are then pending: returns an empty batch), or raise
        `StreamInterrupted` for ``error``, the original failure, whatever the recoveries met.
        The planner hears of the break at once (``winner_broke``: the break is judged where it
        happens, and it says whether a recovery may go at all: not for the request's own
        fault, which would fail the same way anywhere)."""
        rec = self._recorder
        broken = self._winner_number
        state = rec.attempt(broken)
        if error.replica is None:
            error.replica = state.replica
        told = getattr(self._planner, "winner_broke", None)
        recoverable = told(error) if told is not None else error.retryable
        if not recoverable or not self._recoveries_left or self._nursery is None:
            self._fail(error)
        state.error = error
        state.ended_at = trio.current_time()
        winner, self._winner, self._direct = self._winner, None, None
        policy = self._policy
        if winner is not None:  # its server must see it stop before another one starts
            await close_quietly(winner, policy.close_timeout)
        limit = self._token_limit
        if limit is not None and rec.token_count >= limit:
            # The caller has every token its request allows (the break came before the
            # finish): nothing to recover. The answer ends as the engine would have ended it.
            self._ended = True
            self._recovered += 1  # the last delta is the stream's own, not the winner's
            return (Delta(finish_reason="length"),)
        before = len(rec.attempts)
        committed = await recover(
            self._planner,
            rec,
            self._nursery,
            replaces=broken,
            others=self._others or (),
            limit=self._recoveries_left,
            first_token=policy.first_token,
            close_timeout=policy.close_timeout,
            stall_timeout=policy.stall_timeout,
        )
        self._recoveries_left -= len(rec.attempts) - before
        if committed is None:
            self._fail(error)
        self._recovered += 1
        self._install(committed)
        return ()

    def _install(self, committed: Committed) -> None:
        """Read ``committed`` from now on (the race's winner, or a recovery's); its stall
        clock starts at zero."""
        self._winner = committed.stream
        if self._policy.stall_timeout is None:
            self._direct = committed.stream
        self._winner_number = committed.number
        self._token_limit = committed.token_limit
        self._ended = committed.ended
        self._silent_for = 0.0
        self._pending.extend(committed.pending)
        # The race already counted these in the winner's tokens_received.
        self._take(committed.pending, trio.current_time(), count_for_attempt=False)

    def _fail(self, error: AttemptError) -> NoReturn:
        rec = self._recorder
        state = rec.attempt(self._winner_number)
        if error.replica is None:
            error.replica = state.replica
        state.error = error
        rec.ended_at = trio.current_time()
        if state.ended_at is None:  # (a winner that broke before a failed recovery: then)
            state.ended_at = rec.ended_at
        interrupted = StreamInterrupted(error, self.text)
        rec.error = interrupted
        self._ended = True
        interrupted.report = rec.snapshot()
        raise interrupted

    def __aiter__(self) -> HedgedStream:
        return self

    async def __anext__(self) -> str:
        pending = self._pending
        while True:
            while pending:
                content = pending.popleft().content
                if content:
                    return content
            if self._ended:
                self._finish()
                raise StopAsyncIteration
            direct = self._direct
            if direct is not None:
                # Hot path (no stall timeout): the winner itself, one coroutine per batch.
                try:
                    batch = await direct.receive()
                except Exception as exc:
                    batch = await self._broken(classify_exception(exc))
            else:
                batch = await self._receive()
            if batch is None:
                self._ended = True
            else:
                self._take(batch, trio.current_time())
                pending.extend(batch)

    def events(self) -> EventIterator:
        """An async iterator of the winner's [`Delta`][trio_hedge.events.Delta] events (content,
        reasoning, tool-call fragments, usage, finish reason), from where the stream is: the
        events read before the commit first, unless ``async for`` already took them. It holds
        nothing between items, so leaving it early is safe, and ``async for`` may go on after
        it (and the other way round) without repeating or losing content."""
        return EventIterator(self)

    def batches(self) -> BatchIterator:
        """Like [`events`][trio_hedge.HedgedStream.events], but each step yields every event
        already received: the ones read before the commit first, then what each read of the
        winner gave (never an empty list). For a relay that writes once per read rather than
        once per event (the gateway: one ``send`` where a read brought several events). It
        reads the same queue as ``events()`` and ``async for``, so mixing them never repeats
        or loses an event."""
        return BatchIterator(self)

    async def _next_event(self) -> Delta:
        pending = self._pending
        if not pending:
            batch = await self._next_batch()
            if batch is None:
                raise StopAsyncIteration
            pending.extend(batch)
        return pending.popleft()

    async def _next_batch(self) -> Sequence[Delta] | None:
        """Everything the winner has ready, at least one delta, or ``None`` at the end (the
        asyncio bridge's pump and ``batches()`` read this way: one await per batch, however
        many deltas it carries)."""
        pending = self._pending
        while True:
            # (After a recovery took over, its first deltas, already taken, are pending.)
            if pending:
                taken = list(pending)
                pending.clear()
                return taken
            if self._ended:
                break
            batch = await self._receive()
            if batch is None:
                self._ended = True
            elif batch:
                self._take(batch, trio.current_time())
                return batch
        self._finish()
        return None

    def _finish(self) -> None:
        """The winner's stream ended normally."""
        rec = self._recorder
        rec.completed = rec.error is None
        if rec.ended_at is None:
            rec.ended_at = trio.current_time()
            if self._winner_number:
                rec.attempt(self._winner_number).ended_at = rec.ended_at


def require_trio(what: str) -> None:
    """Raise ``RuntimeError`` with the way out when the caller is not Trio code: asyncio users
    calling the Trio API is the common mistake, and Trio's own error ("must be called from
    async context") names neither the cause nor ``trio_hedge.aio``."""
    try:
        library: str | None = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = None
    if library != "trio":
        raise RuntimeError(
            f"{what} run in Trio, and this is {library or 'not async'} code. From asyncio, use "
            "trio_hedge.aio (aio_hedged_stream, AioHedger) and start the program with "
            "trio_asyncio.run(trio_asyncio.aio_as_trio(main)) instead of asyncio.run(main()): "
            "see docs/asyncio.md"
        )


class _NextEvent(Protocol):
    def _next_event(self) -> Coroutine[Any, Any, Delta]: ...


class EventIterator:
    """What ``events()`` returns (here and in [`trio_hedge.aio`][trio_hedge.aio]): each step awaits
    the stream's next [`Delta`][trio_hedge.events.Delta]. A class, not an async generator, so
    leaving the loop early leaves nothing to finalise."""

    __slots__ = ("_stream",)

    def __init__(self, stream: _NextEvent) -> None:
        self._stream = stream

    def __aiter__(self) -> EventIterator:
        return self

    def __anext__(self) -> Coroutine[Any, Any, Delta]:
        return self._stream._next_event()


class BatchIterator:
    """What ``batches()`` returns: each step awaits the stream's next non-empty list of
    [`Delta`][trio_hedge.events.Delta] events. A class, not an async generator (see
    `EventIterator`)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: HedgedStream) -> None:
        self._stream = stream

    def __aiter__(self) -> BatchIterator:
        return self

    async def __anext__(self) -> Sequence[Delta]:
        batch = await self._stream._next_batch()
        if batch is None:
            raise StopAsyncIteration
        return batch


def _sole_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """Attempts turn every ``Exception`` into data, so what escapes the race's nursery is a
    ``KeyboardInterrupt``, a bug, or cancellation. A lone non-``Cancelled`` error comes out
    as itself (as ``open_tcp_stream`` raises a plain ``OSError``), not wrapped in a group the
    caller never asked for; groups of ``Cancelled`` are left to Trio."""
    _, rest = group.split(trio.Cancelled)
    if rest is not None and len(found := leaves(rest)) == 1:
        return found[0]
    return group
