"""asyncio code through trio-asyncio: hedged streams and a shared
[`AioHedger`][trio_hedge.aio.AioHedger].

Start from a plain asyncio program by running it with ``trio_asyncio.run`` instead of
``asyncio.run``:

```python
import trio_asyncio
from trio_hedge.aio import aio_hedged_stream

async def main():  # an ordinary asyncio coroutine
    async with aio_hedged_stream(request, replicas) as stream:
        async for token in stream:
            print(token, end="")

trio_asyncio.run(trio_asyncio.aio_as_trio(main))
```

How the bridge works. trio-asyncio runs each ``__anext__`` of an adapted Trio iterator in a
*new* Trio task, and a hedged stream (whose race holds a nursery) cannot be iterated across
tasks; a Trio task per token also costs ~100 µs. So one Trio task (the *pump*) owns the whole
[`HedgedStream`][trio_hedge.HedgedStream], from the race to the close, and appends each batch
of the winner's deltas to a buffer that asyncio reads directly: the asyncio side waits only
when the buffer is empty, and then takes everything that arrived meanwhile. A real server sends
one token every 10-50 ms, so there every token is a hand-over of its own; the pump then resumes
the waiting consumer at once, in its own task, instead of queueing the wake-up on the loop (see
``_Handover``): a hand-over costs about what the Trio path's own wake-up does, never a task or
a loop round per token. The pump stops reading ahead when ``buffer`` deltas wait unread.

Leaving the ``async with`` by any path (the end, ``break``, an exception, ``task.cancel()``,
``asyncio.timeout``) cancels the pump and waits until it has closed every upstream response
(each close is bounded by the policy's ``close_timeout``): no Trio task outlives the block.

Needs the ``asyncio`` extra (``pip install "trio-hedge[asyncio]"``, or from a clone
``pip install -e ".[asyncio]"``) and a running trio-asyncio loop (``trio_asyncio.run(...)``, or
``async with trio_asyncio.open_loop():`` inside Trio).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx
import sniffio
import trio

from ._oneshot import hedged_stream
from ._source import Source
from ._stream import EventIterator, HedgedStream
from .errors import HedgeError
from .events import Delta, EventHook
from .hedger import Hedger
from .policy._config import HedgePolicy, HedgerConfig
from .policy._stats import HedgerStatistics
from .report import Report
from .sources._bindable import BindableReplica
from .sources.openai._http import HeaderNames, Replica

__all__ = ["AioHedgedStream", "AioHedger", "aio_hedged_stream"]

_sniffio = sniffio.thread_local

#: Deltas the pump may read ahead of the asyncio consumer (back-pressure beyond that).
DEFAULT_BUFFER = 256


def _trio_asyncio_loop() -> Any:
    if sniffio.current_async_library() == "trio":
        # Trio code (trio.run, a Trio task under trio-asyncio): there is no asyncio task to
        # hand the stream to, and trio-asyncio's own error says only "no running event loop".
        raise RuntimeError(
            "trio_hedge.aio is the asyncio API, called here from Trio code: use "
            "trio_hedge.hedged_stream(...) (or trio_hedge.Hedger and hedger.stream(...)) "
            "directly, with the same arguments"
        )
    loop: Any = asyncio.get_running_loop()
    if not hasattr(loop, "trio_as_future"):
        raise RuntimeError(
            "trio_hedge.aio needs a trio-asyncio event loop: run your program with "
            "trio_asyncio.run(trio_asyncio.aio_as_trio(main)) instead of asyncio.run(main())"
        )
    return loop


class _Handover:
    """What the asyncio consumer awaits while the buffer is empty: a future-like object (the
    protocol ``asyncio.Task`` accepts from any awaitable with ``_asyncio_future_blocking``),
    resolved by the pump.

    Why not an ``asyncio.Future``: setting a future's result queues the consumer's wake-up on
    the trio-asyncio loop, whose Trio task then runs it: a scheduler round and ~80 Python calls
    per hand-over. With tokens paced like a real server's every token is a hand-over of its
    own, and after each idle wake-up that cost +38 µs per token (``benchmarks/overhead.py``).
    So ``resolve(now=True)`` runs the consumer's wake-up at once, in the pump's task. That is
    safe because the pump runs only while the loop's task waits between two callbacks: no
    asyncio code is running, and the consumer's step runs as it would from the loop (in its
    own context, with ``sniffio`` saying "asyncio"). A cancel (the task's ``cancel()``,
    ``asyncio.timeout``) wakes the consumer through the loop, as a future does.
    """

    __slots__ = ("_asyncio_future_blocking", "_callback", "_cancelled", "_done", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._asyncio_future_blocking = False
        self._done = False
        self._cancelled: tuple[str, ...] | None = None  # the cancel message, once cancelled
        self._callback: tuple[Callable[[Any], object], contextvars.Context] | None = None

    def resolve(self, *, now: bool) -> None:
        """Wake the consumer: ``now`` runs its step in the caller's task (which must be a Trio
        task of the loop's thread, between checkpoints), else through the loop. No-op once
        done."""
        if self._done:
            return
        self._done = True
        callback, self._callback = self._callback, None
        if callback is None:
            return
        function, context = callback
        if not now:
            self._loop.call_soon(function, self, context=context)
            return
        previous, _sniffio.name = _sniffio.name, "asyncio"
        try:
            context.run(function, self)
        finally:
            _sniffio.name = previous

    # -- the future protocol, as asyncio.Task uses it ----------------------------------------

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled is not None

    def result(self) -> None:
        if self._cancelled is not None:
            raise asyncio.CancelledError(*self._cancelled)
        if not self._done:
            raise asyncio.InvalidStateError("the hand-over is not done")

    def exception(self) -> BaseException | None:
        self.result()
        return None

    def add_done_callback(
        self, function: Callable[[Any], object], *, context: contextvars.Context | None = None
    ) -> None:
        if context is None:
            context = contextvars.copy_context()
        if self._done:
            self._loop.call_soon(function, self, context=context)
        elif self._callback is not None:
            raise RuntimeError("a hand-over has one waiter")
        else:
            self._callback = (function, context)

    def remove_done_callback(self, function: Callable[[Any], object]) -> int:
        if self._callback is not None and self._callback[0] == function:
            self._callback = None
            return 1
        return 0

    def cancel(self, msg: object = None) -> bool:
        if self._done:
            return False
        self._done = True
        self._cancelled = () if msg is None else (str(msg),)
        callback, self._callback = self._callback, None
        if callback is not None:
            self._loop.call_soon(callback[0], self, context=callback[1])
        return True

    def __await__(self) -> Generator[_Handover, None, None]:
        if not self._done:
            self._asyncio_future_blocking = True
            yield self
        self.result()

    __iter__ = __await__


class AioHedgedStream:
    """The asyncio face of one [`HedgedStream`][trio_hedge.HedgedStream].

    ``async with`` waits for the commit (raising what the Trio stream raises:
    [`FatalAttemptError`][trio_hedge.FatalAttemptError],
    [`AllAttemptsFailed`][trio_hedge.AllAttemptsFailed]); ``async for`` yields ``str`` tokens;
    [`events`][trio_hedge.aio.AioHedgedStream.events] yields [`Delta`][trio_hedge.events.Delta]
    events (both read one queue, as on the Trio stream);
    [`report`][trio_hedge.aio.AioHedgedStream.report] says what happened. While iterating,
    [`StreamInterrupted`][trio_hedge.StreamInterrupted] comes after the tokens that arrived before
    the failure. Use each stream once, from one asyncio task.

    Args:
        stream: the Trio stream to run (not yet entered).
        buffer: the pump stops reading once this many deltas wait unread (one batch of the
            winner may go past it). Default 256.

    Raises:
        RuntimeError: entered from Trio code (use the Trio API there), outside a
            trio-asyncio loop, or twice.
    """

    def __init__(self, stream: HedgedStream, *, buffer: int = DEFAULT_BUFFER) -> None:
        if not isinstance(stream, HedgedStream):
            raise TypeError(f"stream must be a HedgedStream, not {type(stream).__name__}")
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"buffer must be an int >= 1, not {buffer!r}")
        self._stream = stream
        self._limit = buffer
        # Shared between the pump (a Trio task) and the asyncio consumer. Both run in one
        # thread (trio-asyncio), so plain objects need no locks.
        self._ready: deque[Delta] = deque()
        self._done = False  # the pump will add nothing more
        self._error: BaseException | None = None  # raised once the buffer is drained
        self._committed = False
        self._waiter: _Handover | None = None  # the consumer, waiting for the pump
        self._space: trio.Event | None = None  # the pump, waiting for the consumer
        self._task: asyncio.Future[None] | None = None
        self._loop: Any = None  # the trio-asyncio loop, from __aenter__
        self._entered = False

    @property
    def report(self) -> Report:
        """The underlying stream's report (see [`Report`][trio_hedge.Report])."""
        return self._stream.report

    @property
    def request_id(self) -> str:
        """The id every attempt of this request carries."""
        return self._stream.request_id

    @property
    def text(self) -> str:
        """The text handed to the pump so far (the consumer may not have read all of it)."""
        return self._stream.text

    # -- the pump (Trio) -----------------------------------------------------------------------

    def _wake(self, *, now: bool = False) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.resolve(now=now)

    async def _pump(self) -> None:
        ready = self._ready
        limit = self._limit
        try:
            async with self._stream as stream:
                self._committed = True
                self._wake()
                next_batch = stream._next_batch
                # One await per batch of the winner, one wake-up per hand-over.
                while (batch := await next_batch()) is not None:
                    drained = not ready  # else the consumer has yet to take the last one
                    ready.extend(batch)
                    if drained:
                        self._wake(now=True)  # the hot path: see _Handover
                    if len(ready) >= limit:
                        self._space = space = trio.Event()
                        await space.wait()
        except HedgeError as exc:
            self._error = exc
        finally:
            self._done = True
            self._wake()

    # -- the consumer (asyncio) ----------------------------------------------------------------

    async def __aenter__(self) -> AioHedgedStream:
        if self._entered:
            raise RuntimeError("an AioHedgedStream can be entered only once")
        loop = self._loop = _trio_asyncio_loop()
        self._entered = True
        self._task = loop.trio_as_future(self._pump)
        try:
            while not (self._committed or self._done):
                waiter = self._waiter = _Handover(loop)
                await waiter
        except BaseException:
            await self._stop()
            raise
        if not self._committed:
            await self._stop()  # raises what the pump raised (a bug, KeyboardInterrupt)
            error, self._error = self._error, None
            assert error is not None
            raise error
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _stop(self) -> None:
        """Cancel the pump and wait until it has closed every response, even if this task is
        cancelled again meanwhile (the wait is bounded by the close timeout)."""
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():
            task.cancel()
        cancelled: BaseException | None = None
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError as exc:
                cancelled = exc
        if not task.cancelled() and (error := task.exception()) is not None:
            raise error
        if cancelled is not None:
            raise cancelled

    def _release(self) -> None:
        """Let the pump read ahead again once half the buffer is free."""
        space = self._space
        if space is not None and len(self._ready) <= self._limit // 2:
            self._space = None
            space.set()

    def _ended(self) -> None:
        """The buffer is empty: raise the pump's error, or end the iteration when it is done;
        return to wait for more."""
        error = self._error
        if error is not None:
            self._error = None
            raise error
        if self._done:
            raise StopAsyncIteration

    def __aiter__(self) -> AioHedgedStream:
        return self

    # The two readers are the hot path of a paced stream (one hand-over per token): the
    # buffer is read inline and the wait is one future, awaited here, not in a helper.

    def _check_open(self) -> None:
        if self._task is None:
            raise RuntimeError("iterate an AioHedgedStream inside its 'async with' block")

    async def __anext__(self) -> str:
        self._check_open()
        ready = self._ready
        while True:
            while ready:
                content = ready.popleft().content
                if self._space is not None:
                    self._release()
                if content:
                    return content
            self._ended()
            waiter = self._waiter = _Handover(self._loop)
            await waiter

    async def _next_event(self) -> Delta:
        self._check_open()
        ready = self._ready
        while not ready:
            self._ended()
            waiter = self._waiter = _Handover(self._loop)
            await waiter
        delta = ready.popleft()
        if self._space is not None:
            self._release()
        return delta

    def events(self) -> EventIterator:
        """An async iterator of the winner's [`Delta`][trio_hedge.events.Delta] events (content,
        reasoning, tool-call fragments, usage, finish reason), as
        [`trio_hedge.HedgedStream.events`][trio_hedge.HedgedStream.events]: it shares one queue with
        ``async for``."""
        return EventIterator(self)


def aio_hedged_stream(
    request: Mapping[str, Any] | None,
    replicas: Sequence[Replica | BindableReplica | Source],
    policy: HedgePolicy | None = None,
    *,
    buffer: int = DEFAULT_BUFFER,
    **kwargs: Any,
) -> AioHedgedStream:
    """[`hedged_stream`][trio_hedge.hedged_stream] for asyncio code on trio-asyncio; takes the same
    arguments (validated here, before any I/O), plus ``buffer`` (see
    [`AioHedgedStream`][trio_hedge.aio.AioHedgedStream]). A ``client=`` must be an
    ``httpx.AsyncClient`` that only the library uses: its connections live in Trio."""
    return AioHedgedStream(hedged_stream(request, replicas, policy, **kwargs), buffer=buffer)


class AioHedger:
    """A [`Hedger`][trio_hedge.Hedger] for asyncio code: one long-lived object shared by every
    asyncio task of an application (learned hedge delay, budget, replica health):

    ```python
    async with AioHedger(replicas) as hedger:      # in asyncio code on trio-asyncio
        async with hedger.stream(request) as stream:
            async for token in stream: ...
    ```

    Takes the [`Hedger`][trio_hedge.Hedger]'s arguments. All its work runs in Trio (one pump
    task per open stream), in the loop's thread, so the shared state needs no locks.

    Raises:
        TypeError, ValueError: as [`Hedger`][trio_hedge.Hedger] (bad replicas or config).
    """

    def __init__(
        self,
        replicas: Sequence[Replica | BindableReplica | Source],
        config: HedgerConfig | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        headers: HeaderNames | None = None,
        on_event: Iterable[EventHook] = (),
        buffer: int = DEFAULT_BUFFER,
    ) -> None:
        self._hedger = Hedger(replicas, config, client=client, headers=headers, on_event=on_event)
        if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
            raise ValueError(f"buffer must be an int >= 1, not {buffer!r}")
        self._buffer = buffer

    @property
    def hedger(self) -> Hedger:
        """The Trio [`Hedger`][trio_hedge.Hedger] doing the work (for Trio code in the same
        program: both faces share one state)."""
        return self._hedger

    @property
    def on_event(self) -> list[EventHook]:
        """The mutable list of event hooks (see [`Hedger`][trio_hedge.Hedger])."""
        return self._hedger.on_event

    @property
    def config(self) -> HedgerConfig:
        """The [`HedgerConfig`][trio_hedge.HedgerConfig]."""
        return self._hedger.config

    def stream(self, request: Mapping[str, Any] | None, **kwargs: Any) -> AioHedgedStream:
        """Open one hedged request; takes [`trio_hedge.Hedger.stream`][trio_hedge.Hedger.stream]'s
        arguments (``hedge``, ``side_effects``, ``idempotency_key``, ``prompt_tokens``, ``group``,
        ``request_id``), validated here, before any I/O.

        Raises:
            RuntimeError: the hedger was closed.
            TypeError, ValueError: bad arguments.
        """
        return AioHedgedStream(self._hedger.stream(request, **kwargs), buffer=self._buffer)

    def statistics(self) -> HedgerStatistics:
        """A [`HedgerStatistics`][trio_hedge.policy.HedgerStatistics] snapshot."""
        return self._hedger.statistics()

    def hedge_delay(self, *, prompt_tokens: int = 0, group: str = "default") -> float | None:
        """The hedge delay (seconds) a request of this size and group would get now."""
        return self._hedger.hedge_delay(prompt_tokens=prompt_tokens, group=group)

    async def aclose(self) -> None:
        """Close the client the hedger created (see
        [`trio_hedge.Hedger.aclose`][trio_hedge.Hedger.aclose])."""
        await _trio_asyncio_loop().trio_as_future(self._hedger.aclose)

    async def __aenter__(self) -> AioHedger:
        _trio_asyncio_loop()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
