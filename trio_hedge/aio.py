"""asyncio code through trio-asyncio: ``async with aio_hedged_stream(...) as stream``.

trio-asyncio runs each ``__anext__`` of an adapted Trio iterator in a *new* Trio task, so a
hedged stream (whose race holds a nursery) cannot be iterated across tasks. Here one Trio task
owns the whole :class:`~trio_hedge.HedgedStream` from race to close and hands tokens to
asyncio through a memory channel; leaving the ``async with`` (``break``, an exception, or an
asyncio cancellation) cancels that task and waits until it has closed every response.

Needs the ``asyncio`` extra (``pip install trio-hedge[asyncio]``) and a running trio-asyncio
loop (``async with trio_asyncio.open_loop():`` in Trio, or ``trio_asyncio.run``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import trio

from ._errors import HedgeError
from ._policy import HedgePolicy
from ._report import Report
from ._stream import HedgedStream, hedged_stream
from .sources._base import Source
from .sources.openai_http import Replica

__all__ = ["AioHedgedStream", "aio_hedged_stream"]

_COMMITTED = object()


class AioHedgedStream:
    """The asyncio-flavoured face of one :class:`~trio_hedge.HedgedStream`: ``async with``
    waits for the commit (raising the same errors), ``async for`` yields ``str`` tokens."""

    def __init__(self, stream: HedgedStream, *, buffer: int = 256) -> None:
        self._stream = stream
        self._buffer = buffer
        self._receive: trio.MemoryReceiveChannel[object] | None = None
        self._task: asyncio.Future[None] | None = None

    @property
    def report(self) -> Report:
        """The underlying stream's report (see :class:`~trio_hedge.Report`)."""
        return self._stream.report

    async def _pump(self, send: trio.MemorySendChannel[object]) -> None:
        async with send:
            try:
                async with self._stream:
                    await send.send(_COMMITTED)
                    async for token in self._stream:
                        await send.send(token)
            except HedgeError as exc:
                await send.send(exc)

    async def _next(self) -> object:
        assert self._receive is not None
        receive = self._receive.receive
        loop: Any = asyncio.get_running_loop()
        try:
            return await loop.trio_as_future(receive)
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> AioHedgedStream:
        loop: Any = asyncio.get_running_loop()
        if not hasattr(loop, "trio_as_future"):
            raise RuntimeError("aio_hedged_stream needs a running trio-asyncio event loop")
        send, self._receive = trio.open_memory_channel[object](self._buffer)
        self._task = loop.trio_as_future(self._pump, send)
        try:
            first = await self._next()
        except BaseException:
            await self._stop()
            raise
        if isinstance(first, HedgeError):
            await self._stop()
            raise first
        return self

    def __aiter__(self) -> AioHedgedStream:
        return self

    async def __anext__(self) -> str:
        item = await self._next()
        if isinstance(item, HedgeError):
            raise item
        assert isinstance(item, str)
        return item

    async def _stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():
            task.cancel()
        # Wait until the Trio task has closed every response: no task outlives the block.
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()


def aio_hedged_stream(
    request: Mapping[str, Any] | None,
    replicas: Sequence[Replica | Source],
    policy: HedgePolicy | None = None,
    **kwargs: Any,
) -> AioHedgedStream:
    """:func:`~trio_hedge.hedged_stream` for asyncio code running on trio-asyncio; takes the
    same arguments. Note: pass no ``httpx.AsyncClient`` created by asyncio code: the HTTP work
    runs in Trio."""
    return AioHedgedStream(hedged_stream(request, replicas, policy, **kwargs))
