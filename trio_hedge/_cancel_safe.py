"""httpcore's HTTP/2 connections, made safe to cancel:
[`cancel_safe_transport`][trio_hedge.transport.cancel_safe_transport].

A hedging library cancels attempts all the time, and httpcore 1.0.9 (httpcore2 2.16 too)
mishandles a cancel at three points of an HTTP/2 connection's life. Each fault below breaks
"every loser's server sees it stop" or cuts other streams; each has its failing case in
``tests/test_http2.py``.

1. **A write cut in half.** ``AsyncHTTP2Connection._write_outgoing_data`` takes every frame
   queued in its h2 state (``data_to_send()``, under its write lock), then awaits the socket
   write. A task cancelled at that await -- Trio's ``send_all`` checks for cancellation
   before it sends a byte -- drops those bytes, and they are not only its own: any task may
   have queued frames there (another request's HEADERS, the RST_STREAM trio_hedge queued for
   a loser, a WINDOW_UPDATE). The connection goes on with a hole in its byte stream: the
   server's HPACK decoder loses step (a GOAWAY that cuts every stream on the connection,
   winners included), sees RST_STREAM for a stream it never opened (PROTOCOL_ERROR, RFC 9113
   §6.4), or never hears of a loser's reset and keeps generating; over TLS, a cancelled
   ``send_all`` breaks the ``SSLStream``. Fix: `CancelSafeBackend`, behind httpcore's
   public network-backend interface, runs every write in a shielded cancel scope, so bytes
   taken from the h2 state always reach the socket; the cancel is delivered at the task's
   next checkpoint. The write stays bounded by the client's write timeout (``make_client``:
   30 s; httpx's default: 5 s; `WRITE_TIMEOUT_CAP` without one). Reads need nothing: a
   Trio receive returns data or is cancelled before it takes any. Failing cases:
   ``test_a_cancelled_write_still_reaches_the_server``,
   ``test_a_losers_reset_is_not_lost_with_another_tasks_cancelled_write``.
2. **A setup cut short** (`setup_cut_short`): a cancel inside the loop that sets a new
   connection up leaves its stream semaphore over-full; the next request raises
   ``ValueError("semaphore released too many times")`` and its stream is never reset. Fix:
   the connection is closed as the cancelled request leaves it. Failing case:
   ``test_a_cancel_during_connection_setup_leaves_no_stream_running``.
3. **A connection dropped while it connects.** Requests queue on an HTTP/2 connection that is
   still connecting (``AsyncHTTPConnection``, waiting for its request lock). One cancelled
   there marks the connection failed (``_connect_failed``) although another request is
   connecting it, so the pool drops it as closed: the connection then carries that request
   outside the pool, where nothing ever closes it (a file descriptor and a server connection
   held until garbage collection) and where trio_hedge's reset of a loser cancelled before
   its headers cannot find it. Fix: the mark is taken back while another request still holds
   the lock. Failing case:
   ``test_a_request_cancelled_while_another_connects_leaves_the_connection_pooled``.

httpx's ``AsyncHTTPTransport`` takes no network backend and no connection hook, so
`harden` sets them on the pool it built: its ``_network_backend`` (which httpcore's
pools hand to every connection they create) and its ``create_connection`` (the method
httpcore's proxy pools override). The alternatives copy httpx: a subclass that builds the
pool itself repeats httpx's constructor (TLS, proxies, limits), and a transport of our own
repeats its request and error mapping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import httpcore
import httpx
import trio

__all__ = [
    "WRITE_TIMEOUT_CAP",
    "CancelSafeBackend",
    "CancelSafeStream",
    "WrappingBackend",
    "cancel_safe_transport",
    "harden",
    "setup_cut_short",
]

#: How long (seconds) a write may take when the client sets no write timeout: a shielded
#: write must not wait for a socket forever.
WRITE_TIMEOUT_CAP = 30.0


class CancelSafeStream(httpcore.AsyncNetworkStream):
    """A network stream whose writes finish even when the task is cancelled.

    (The ``timeout`` arguments are httpcore's interface, hence the ``noqa: ASYNC109``.)
    """

    __slots__ = ("_stream",)

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return  # httpcore writes b"" after most reads (nothing queued): no scope needed
        with trio.CancelScope(shield=True):
            await self._stream.write(buffer, WRITE_TIMEOUT_CAP if timeout is None else timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        tls = await self._stream.start_tls(ssl_context, server_hostname, timeout)
        return CancelSafeStream(tls)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class WrappingBackend(httpcore.AsyncNetworkBackend):
    """``inner`` (default httpcore's Trio backend), every stream it connects wrapped by
    ``wrap`` (`CancelSafeBackend`; ``make_client``'s lean reads)."""

    def __init__(
        self,
        inner: httpcore.AsyncNetworkBackend | None = None,
        *,
        wrap: Callable[[httpcore.AsyncNetworkStream], httpcore.AsyncNetworkStream],
    ) -> None:
        self.inner = inner if inner is not None else httpcore.TrioBackend()
        self._wrap = wrap

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self.inner.connect_tcp(
            host, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )
        return self._wrap(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self.inner.connect_unix_socket(
            path, timeout=timeout, socket_options=socket_options
        )
        return self._wrap(stream)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class CancelSafeBackend(WrappingBackend):
    """``inner`` (default httpcore's Trio backend), with `CancelSafeStream` streams."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        super().__init__(inner, wrap=CancelSafeStream)


def setup_cut_short(connection: Any) -> bool:
    """Whether a cancel cut this ``AsyncHTTP2Connection``'s setup short (fault 2).

    httpcore sets a connection up inside its first request: it sends the preface, marks the
    connection initialised, makes a stream semaphore of 100 permits and then takes 99 of them
    back, one ``acquire()`` -- one checkpoint -- at a time, so that one stream runs until the
    server's SETTINGS arrive. A cancel landing in that loop (a window ~100 scheduler ticks
    wide, which a hedge's cancel hits often) leaves permits over. When the SETTINGS arrive,
    httpcore releases a permit per stream the server allows and raises
    ``ValueError("semaphore released too many times")`` into whichever request reads them;
    that request's cleanup (``_response_closed``) raises the same error before it forgets
    the stream, so the stream stays tracked, is never reset, and its server keeps working
    (the fuzz's "never saw the disconnect" on h2c).

    Once set up (its setup lock free), a sound connection never has more free permits than
    its stream limit minus its open streams: every permit httpcore releases is taken back or
    counted in the same step. ``False`` for anything else (not set up yet, not run by Trio).
    """
    permits = getattr(getattr(connection, "_max_streams_semaphore", None), "_trio_semaphore", None)
    setup = getattr(getattr(connection, "_init_lock", None), "_trio_lock", None)
    if not isinstance(permits, trio.Semaphore) or not isinstance(setup, trio.Lock):
        return False
    if setup.locked():
        return False  # being set up right now: the loop is still taking its permits back
    limit = getattr(connection, "_max_streams", None)
    return isinstance(limit, int) and permits.value + len(connection._events) > limit


def _guard(connection: Any) -> Any:
    """Wrap a pool connection's ``handle_async_request`` against faults 2 and 3."""
    handle: Callable[[httpcore.Request], Awaitable[httpcore.Response]]
    handle = connection.handle_async_request

    async def handle_async_request(request: httpcore.Request) -> httpcore.Response:
        try:
            return await handle(request)
        except BaseException:
            inner = getattr(connection, "_connection", None)
            if inner is None:
                # Fault 3: cancelled waiting for the request lock while another request
                # connects. Runs before the pool looks at the connection again.
                lock = getattr(getattr(connection, "_request_lock", None), "_trio_lock", None)
                if isinstance(lock, trio.Lock) and lock.locked():
                    connection._connect_failed = False
            elif setup_cut_short(inner):
                # Fault 2: closed before the pool hands it out again (requests queued on it
                # find it closed and are sent on another connection).
                with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await connection.aclose()
            raise

    connection.handle_async_request = handle_async_request
    return connection


def harden(
    transport: httpx.AsyncHTTPTransport,
    backend: httpcore.AsyncNetworkBackend | None = None,
    *,
    http2: bool,
) -> None:
    """Make ``transport``'s pool connect through ``backend`` (default: the pool's own) and,
    if ``http2``, make its connections safe to cancel (see the module docstring). Call it
    before the transport's first request.

    Raises:
        TypeError: ``transport`` has no httpcore pool (another transport, or an
            httpx/httpcore whose internals changed shape).
    """
    pool = getattr(transport, "_pool", None)
    current = getattr(pool, "_network_backend", None)
    create = getattr(pool, "create_connection", None)
    if not isinstance(current, httpcore.AsyncNetworkBackend) or create is None:
        raise TypeError(
            f"cannot reach the connection pool of {type(transport).__name__} "
            f"(httpx {httpx.__version__}, httpcore {httpcore.__version__})"
        )
    inner = current if backend is None else backend
    if not http2:
        pool._network_backend = inner  # type: ignore[union-attr]
        return
    pool._network_backend = CancelSafeBackend(inner)  # type: ignore[union-attr]
    pool.create_connection = lambda origin: _guard(create(origin))  # type: ignore[union-attr]


def cancel_safe_transport(
    *, network_backend: httpcore.AsyncNetworkBackend | None = None, **kwargs: Any
) -> httpx.AsyncHTTPTransport:
    """An ``httpx.AsyncHTTPTransport(**kwargs)`` whose HTTP/2 connections survive cancelled
    requests (see the module docstring for why).

    Use it for your own ``httpx.AsyncClient`` with HTTP/2:

    ```python
    client = httpx.AsyncClient(transport=trio_hedge.transport.cancel_safe_transport(http2=True))
    ```

    ([`make_client`][trio_hedge.transport.make_client] and
    [`ShardedTransport`][trio_hedge.transport.ShardedTransport] do this themselves when
    ``http2=True``.) Without it, with httpcore 1.0.9, a cancelled request can
    cut a write in half (corrupting the connection for its other streams, or losing a
    loser's RST_STREAM), or leave a connection open outside its pool. A cancelled task waits
    for a write in progress, at most the client's write timeout (`WRITE_TIMEOUT_CAP`
    without one); a write only waits when the server stops reading its socket.

    Args:
        network_backend: the httpcore network backend to connect through (default httpcore's
            own); its writes are the ones made cancel-safe.
        **kwargs: passed to ``httpx.AsyncHTTPTransport`` (``http2``, ``verify``, ``limits``…).

    Raises:
        TypeError: a keyword ``httpx.AsyncHTTPTransport`` does not take.
    """
    transport = httpx.AsyncHTTPTransport(**kwargs)
    harden(transport, network_backend, http2=True)
    return transport
