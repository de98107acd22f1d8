"""Servers for code that runs its own ``trio.run`` (the CLI's ``main``): a server thread.

``serve_in_thread`` runs :func:`trio_hedge.testing.fake_replicas` or :func:`raw_server` in a
thread with its own Trio loop and hands back what the caller needs to reach them; leaving the
``with`` stops the loop and joins the thread.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import trio

__all__ = ["raw_server", "serve_in_thread"]


@contextlib.contextmanager
def serve_in_thread(
    make: Callable[[], contextlib.AbstractAsyncContextManager[Any]],
) -> Iterator[Any]:
    """Enter ``make()`` inside a Trio loop in another thread; yield what it yields."""
    handoff: queue.Queue[tuple[Any, trio.CancelScope, trio.lowlevel.TrioToken] | BaseException]
    handoff = queue.Queue()

    async def serve() -> None:
        with trio.CancelScope() as scope:
            try:
                async with make() as value:
                    handoff.put((value, scope, trio.lowlevel.current_trio_token()))
                    await trio.sleep_forever()
            except BaseException as exc:
                handoff.put(exc)
                raise

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    got = handoff.get(timeout=10)
    if isinstance(got, BaseException):
        raise got
    value, scope, token = got
    try:
        yield value
    finally:
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        thread.join(10)


@contextlib.asynccontextmanager
async def raw_server(
    status: int, headers: list[tuple[str, str]], body: bytes, *, at_once: bool = False
) -> AsyncIterator[str]:
    """A one-answer HTTP/1.1 server on loopback: every request gets ``status``, ``headers``
    (``content-length`` added) and ``body``, then the connection closes; with ``at_once``, it
    answers as soon as any bytes arrive (as plain-HTTP servers answer a TLS ClientHello).
    Yields the base URL (``http://127.0.0.1:PORT/v1``)."""
    reason = b"OK" if status < 400 else b"Error"
    head = [f"HTTP/1.1 {status} ".encode() + reason]
    head += [f"{k}: {v}".encode() for k, v in [*headers, ("content-length", str(len(body)))]]
    answer = b"\r\n".join(head) + b"\r\nconnection: close\r\n\r\n" + body

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            received = b""
            with trio.move_on_after(5):
                while b"\r\n\r\n" not in received:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    received += chunk
                    if at_once:
                        break
                with contextlib.suppress(trio.BrokenResourceError):
                    await stream.send_all(answer)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}/v1"
        nursery.cancel_scope.cancel()
