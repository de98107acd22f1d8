"""The gateway's HTTP server: hypercorn's HTTP/1.1 and HTTP/2 protocol code on connections the
gateway owns, so that no single connection can hurt any other.

``hypercorn.trio.serve`` has these defects the gateway works around here (read and tested in
hypercorn 0.17.3 and 0.18.0, the version in constraints.txt: ``trio/run.py``,
``trio/tcp_server.py``, ``protocol/h2.py``, ``protocol/http_stream.py``; re-check the
wrappers below when upgrading it, tests/test_gateway_server.py sends each input):

1. **A connection's exception ends the process.** ``TCPServer.run`` catches only ``OSError``
   and runs in the server's nursery, so anything else raised while handling one connection's
   bytes cancels every connection and ``serve`` exits with it. Two such inputs, each one
   unauthenticated h2c request: a ``:method`` or ``:path`` that is not ASCII
   (``UnicodeDecodeError``, ``h2.py`` ``_create_stream`` and ``http_stream.py`` ``handle``),
   and DATA on a stream whose response is complete (``KeyError`` in ``h2.py``
   ``_handle_events``: a 404 or 413 answered before the body is enough); PRIORITY frames
   naming 1001 streams (``priority.TooManyStreamsError``, ``_priority_updated``: that
   connection only, its requests cut; ignored here); and three more
   found by trying malformed inputs: a ``CONNECT`` without ``:path`` (``UnboundLocalError``),
   an ``Upgrade: h2c`` whose ``HTTP2-Settings`` is not base64 or holds a bad value
   (``binascii.Error``, ``InvalidSettingsValueError``, after hypercorn's 101). Here the
   requests are refused on their stream (``RST_STREAM`` ``PROTOCOL_ERROR``: malformed, RFC
   9113 §8.1.1), the DATA ends its stream (``RST_STREAM`` ``NO_ERROR``, §8.1), the upgrade is
   ignored (answered over HTTP/1.1), and anything else a connection raises is contained:
   logged in one line, that connection closed, every other connection untouched.
2. **Writes have no deadline.** ``TCPServer.protocol_send`` writes inside a shielded cancel
   scope with no timeout, so a client that stops reading holds its request, its concurrency
   slot and its upstream connection for as long as it keeps the socket open, past every
   deadline, and shutdown waits for it. Here a write that makes no progress for
   ``write_timeout`` seconds, or goes on `ABORT_GRACE` seconds past its request's
   ``request_timeout``, closes the connection (a request still running later is
   cancelled); an HTTP/2 request whose stream's flow-control window stays shut for
   ``write_timeout`` is cancelled; and the end of the drain closes every connection left.
   Also over HTTP/2: with a window that stays shut, ``H2Protocol._send_data`` pops 0 bytes,
   which wakes the app's send (under the low-water mark), so the stream's buffer took the
   whole answer; `_H2` waits for the window instead (memory: 32 KiB a stream).
   And the connection's end leaves each stream's buffer open, so a request whose response
   was ending (waiting for its last bytes to be sent) waited on after its client had gone,
   holding its slot; `_H2` closes them.
3. **Nothing bounds the connections.** Each one holds a file descriptor until its
   ``keep_alive_timeout`` (5 s idle); at the process's ``RLIMIT_NOFILE`` the gateway cannot
   open a connection to a replica (``EMFILE``: the request answered 502 ``connection``, as
   if the replica had failed). Here connections beyond ``max_connections`` are closed as
   soon as they are accepted, leaving descriptors for the replicas.
4. **Shutdown closes idle keep-alive connections at once** (the ``terminated`` event is set
   when the shutdown trigger fires), so a request a client sent on one just then meets a
   closed connection. Here they stay open while requests are in flight (a request on one is
   answered 503, ``Connection: close``), and close when the last request in flight ends.
5. **An HTTP/2 connection that never ends a stream has no idle timeout.** The HTTP/1.1
   protocol stops the keep-alive timer on reading the preface as a request, and HTTP/2
   restarts it only when a stream ends: a client that sends the preface and then nothing
   (or PINGs, or a header block it never ends) held its connection, and with it a
   ``max_connections`` place, forever. `_Protocols` restarts the timer at the switch.

Also: an answer sent before the request's body was read (a 401, a 404) is followed by
hypercorn closing the connection when the body has not come by then, without saying so;
`_H11` adds ``Connection: close`` to it.

Two costs on the token path are taken out here too (issue 20, ``benchmarks/gateway.py``):
hypercorn's write of each chunk takes a ``trio.Lock`` and a shielded cancel scope (two passes
through Trio's scheduler), and goes through ``app_send``, ``stream_send`` and h11's ``send``
(event objects, checks, the state machine): `_Connection.protocol_send` writes at once when
the socket takes the bytes, and `_Connection._chunked` frames a streamed body's chunk itself
where h11 writes chunked. A response head waits for the first body bytes
(`_Connection.send_head`): one write before the first token, not two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import resource
import sys
import traceback
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h11
import hypercorn.config
import trio
from h11._writers import ChunkedWriter
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.events import Response
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H2CProtocolRequiredError, H2ProtocolAssumedError, H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr

from ._http import HOLD_HEAD

if sys.version_info < (3, 11):  # pragma: no cover - Python 3.10
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "ABORT_GRACE",
    "CLOSE_GRACE",
    "ListenError",
    "Server",
    "default_max_connections",
    "open_listeners",
    "raise_fd_limit",
    "requests_text",
]

logger = logging.getLogger("trio_hedge.gateway")

#: Seconds a request may go on after its ``request_timeout`` (to write its in-band error)
#: before it is cancelled and, when it is stuck writing, its connection closed.
ABORT_GRACE = 1.0

#: Seconds between two checks for stalled writes (`Server.watch`).
WATCH_EVERY = 0.25

#: Seconds the requests cancelled at the end of the drain get to write their last event and
#: close their upstreams, before their connections are closed.
CLOSE_GRACE = 5.0

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


class ListenError(OSError):
    """The gateway cannot listen on its address (the port taken, not allowed, no such host);
    ``filename`` is the address."""

    def __str__(self) -> str:
        return f"cannot listen on {self.filename}: {(self.strerror or '').lower()}"


async def open_listeners(host: str, port: int, backlog: int) -> list[trio.SocketListener]:
    """Listening sockets on ``host:port``.

    Raises:
        ListenError: naming the address and the reason.
    """
    try:
        return await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    except OSError as exc:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise ListenError(exc.errno, exc.strerror or str(exc), where) from None


def raise_fd_limit() -> None:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (a service manager's
    soft limit is often 1024: less than ``max_concurrent`` streams need)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # not allowed: keep the soft limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def default_max_connections() -> int:
    """Half the process's soft ``RLIMIT_NOFILE`` (the other half for the replicas'
    connections, the listeners and the logs)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(1, (1 << 20 if soft == resource.RLIM_INFINITY else soft) // 2)


def requests_text(n: int) -> str:
    """``"1 request"``, ``"2 requests"`` (for the log)."""
    return f"{n} request" if n == 1 else f"{n} requests"


def _where(exc: BaseException) -> str:
    """``Type at file:line`` of the innermost frame: never the message (it may quote a
    client's header)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    frames = traceback.extract_tb(exc.__traceback__)
    place = ""
    if frames:
        place = f" at {'/'.join(frames[-1].filename.split('/')[-2:])}:{frames[-1].lineno}"
    return f"{type(exc).__name__}{place}"


class _Socket(trio.abc.HalfCloseableStream):
    """A connection's socket that notes when its write in progress last made progress, and
    by when it must end (the deadline of the request whose task writes), for
    `Server.watch` to close it when it stalls. (A cancel scope per write would cost ~9 µs
    a token; this costs two stores.)"""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self.socket = stream.socket  # hypercorn reads the addresses from it
        #: Trio time by which each request task's writes end (its request's deadline).
        self.deadlines: dict[trio.lowlevel.Task, float] = {}
        #: Trio time the write in progress last made progress (``None``: no write).
        self.progress_at: float | None = None
        #: Trio time by which the write in progress must end.
        self.write_by = math.inf
        self.closed_because: str | None = None

    def close_now(self, reason: str) -> None:
        """Close the socket: a write or read waiting on it ends (``ClosedResourceError``)."""
        if self.closed_because is None:
            self.closed_because = reason
        self.socket.close()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        # trio.SocketStream.send_all's loop, noting each write's progress.
        self.write_by = self.deadlines.get(trio.lowlevel.current_task(), math.inf)
        with memoryview(data) as view:
            sent = 0
            try:
                while sent < len(view):
                    self.progress_at = trio.current_time()
                    with view[sent:] as rest:
                        sent += await self.socket.send(rest)
            except OSError as exc:
                raise trio.BrokenResourceError(self.closed_because) from exc
            finally:
                self.progress_at = None

    def write_now(self, data: bytes) -> int:
        """Write what the socket's buffer takes of ``data`` without waiting: the bytes
        written (0 when the buffer is full or on an error, which the waiting path then meets
        and reports)."""
        try:
            return os.write(self.socket.fileno(), data)
        except OSError:  # BlockingIOError, or a closed or broken socket (-1: closed)
            return 0

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._stream.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()


class _Refused(Exception):
    """The client spoke HTTP/2 to a gateway serving HTTP/1.1 only (answered 505)."""


class _H11(H11Protocol):
    """hypercorn's HTTP/1.1, with the switch to h2c (``Upgrade`` or the HTTP/2 preface) only
    when HTTP/2 is served, an ``Upgrade: h2c`` whose ``HTTP2-Settings`` hypercorn could not
    decode (``binascii.Error`` after its 101) answered over HTTP/1.1 instead, and
    ``Connection: close`` on an answer sent before the request's body was read."""

    http2 = True

    async def _check_protocol(self, event: h11.Request) -> None:
        if event.method == b"PRI" and event.target == b"*" and event.http_version == b"2.0":
            if not self.http2:
                await self._send_error_response(505)  # HTTP Version Not Supported
                raise _Refused
        elif not self.http2 or not _h2c_settings_decode(event.headers):
            return  # an `Upgrade: h2c` is ignored: answered over HTTP/1.1 (RFC 9113 §3.1)
        await super()._check_protocol(event)

    async def stream_send(self, event: StreamEvent) -> None:
        # hypercorn closes the connection after a response sent before the request's body
        # was read to its end (``_maybe_recycle``) without saying so: a client then sends its
        # next request on it before the close arrives and loses that request (a 401 or 413
        # answered before the body). Say so (RFC 9112 section 9.6).
        if (
            type(event) is Response
            and event.status_code >= 200
            and self.connection.their_state is h11.SEND_BODY
            and not any(name == b"connection" for name, _ in event.headers)
        ):
            event = dataclasses.replace(event, headers=[*event.headers, _CLOSE])
        await super().stream_send(event)


_CLOSE = (b"connection", b"close")


def _h2c_settings_decode(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether h2 takes the ``HTTP2-Settings`` header (if any) as hypercorn will give it."""
    for name, value in headers:
        if name.lower() == b"http2-settings":
            trial = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
            try:
                trial.initiate_upgrade_connection(value)
            except (ValueError, h2.exceptions.H2Error):  # binascii.Error is a ValueError
                return False
    return True


def _servable(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether hypercorn can take the request: a ``:path`` (a plain CONNECT has none), and a
    ``:method`` and ``:path`` in ASCII."""
    pseudo = {name: value for name, value in headers if name in (b":method", b":path")}
    return len(pseudo) == 2 and all(value.isascii() for value in pseudo.values())


class _H2(H2Protocol):
    """hypercorn's HTTP/2, refusing on its own stream what would raise in hypercorn, and
    holding at most its 32 KiB per stream while the client's window is shut."""

    async def _send_data(self, stream_id: int) -> None:
        # hypercorn pops 0 bytes when the window is shut, and a pop under the low-water mark
        # wakes the app's send: with a window that stays shut the app writes on and the
        # stream's buffer holds the whole answer (a zero-window reader took 32 MB of one
        # upstream answer into memory). Wait for the window instead (`_window_updated`).
        buffer = self.stream_buffers.get(stream_id)
        if buffer is not None and buffer.buffer:
            try:
                shut = self.connection.local_flow_control_window(stream_id) <= 0
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                shut = False  # hypercorn's own handling closes it
            if shut:
                self.priority.block(stream_id)
                return
        await super()._send_data(stream_id)

    async def handle(self, event: Event) -> None:
        await super().handle(event)
        if isinstance(event, Closed):
            # hypercorn's send task stops at Closed, but the streams' buffers stay open: a
            # request waiting for its last bytes to be sent (a response's end) waited until
            # write_timeout, holding its slot after its client had gone. Wake it.
            for buffer in list(self.stream_buffers.values()):
                await buffer.close()

    async def _priority_updated(self, event: h2.events.PriorityUpdated) -> None:
        # Ignored (RFC 9113 deprecates this priority scheme, section 5.3.2: a server may
        # ignore it). hypercorn puts each PRIORITY frame's stream, and the stream it depends
        # on, in its priority tree for good; at 1001 the tree raises TooManyStreamsError
        # and the connection failed: 1001 PRIORITY frames of 14 bytes ended every request
        # on it.
        return

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        for event in events:
            if isinstance(event, h2.events.RequestReceived) and not _servable(event.headers):
                self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.PROTOCOL_ERROR)
            elif isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                # Its response is complete (or it was refused): ask the client to stop.
                self.connection.acknowledge_received_data(
                    event.flow_controlled_length, event.stream_id
                )
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
            else:
                await super()._handle_events([event])
                continue
            await self._flush()


class _Protocols(ProtocolWrapper):
    """hypercorn's protocol switch (``ProtocolWrapper``), with `_H11` and `_H2`."""

    def __init__(self, *args: Any, http2: bool) -> None:
        super().__init__(*args)
        self._args = args
        self.protocol = _H11(*args)
        self.protocol.http2 = http2

    async def handle(self, event: Event) -> None:
        try:
            return await self.protocol.handle(event)
        except H2ProtocolAssumedError as error:  # the HTTP/2 preface
            self.protocol = _H2(*self._args)
            await self.protocol.initiate()
            # hypercorn's HTTP/1.1 stopped the keep-alive timer on taking the preface for a
            # request, and its HTTP/2 restarts it only when a stream ends: a connection
            # that never finishes a stream (nothing after the preface, PINGs, a header
            # block never ended) stayed open forever. No stream yet: the timer runs.
            await self.send(Updated(idle=True))
            if error.data != b"":
                return await self.protocol.handle(RawData(data=error.data))
        except H2CProtocolRequiredError as error:  # Upgrade: h2c
            self.protocol = _H2(*self._args)
            await self.protocol.initiate(error.headers, error.settings)
            if error.data != b"":
                return await self.protocol.handle(RawData(data=error.data))
        except _Refused:
            await self.send(Closed())
        return None


class _Connection(TCPServer):
    """One client connection (hypercorn's ``TCPServer``): its requests bounded in time, its
    socket's writes too, and `abort` to end it from outside."""

    def __init__(self, server: Server, stream: trio.SocketStream) -> None:
        self.socket_ = _Socket(stream)
        super().__init__(self._request, server.hypercorn, server.context, {}, self.socket_)  # type: ignore[arg-type]
        self._server = server
        self.requests: dict[trio.CancelScope, None] = {}  # in start order
        #: The h2 requests whose send waits, and since when (Trio time).
        self.sending: dict[trio.CancelScope, float] = {}
        self._hold_head = False
        self._held = b""

    async def run(self) -> None:
        # TCPServer.run without TLS, with `_Protocols` for ProtocolWrapper.
        try:
            socket = self.stream.socket
            client = parse_socket_addr(socket.family, socket.getpeername())
            server = parse_socket_addr(socket.family, socket.getsockname())
            async with TaskGroup() as task_group:
                self._task_group = task_group
                state = ConnectionState({})
                args = (self.app, self.config, self.context, task_group, state, False)
                self.protocol = _Protocols(
                    *args, client, server, self.protocol_send, http2=self._server.http2
                )
                await self.protocol.initiate()
                await self.idle_task.restart(self._task_group, self._idle_timeout)
                await self._read_data()
        except OSError:
            pass
        finally:
            await self._close()

    async def protocol_send(self, event: Event) -> None:
        """hypercorn's write, without its ``trio.Lock`` and shielded scope when the socket
        takes the bytes at once (a token's chunk almost always: two passes through Trio's
        scheduler, ~10 µs a token, saved); else, or while another task's write waits, the
        locked, shielded, watched write as before. A write no task waits on cannot be cut in
        half by a cancel, nor interleave with another's, so neither is needed for it.

        A response head sent by `send_head` waits for the next write (the first body
        bytes): one segment and one wake-up of the client for both (TTFT)."""
        if type(event) is RawData:
            data = event.data
            if self._hold_head:
                self._hold_head = False
                self._held = data
                return
            if self._held:
                data, self._held = self._held + data, b""
            lock = self.send_lock
            if lock.locked():
                await super().protocol_send(RawData(data=data))  # in turn, after that write
                return
            sent = self.socket_.write_now(data)
            if sent == len(data):
                return
            lock.acquire_nowait()  # free: nothing awaited since `locked()`
            try:
                with trio.CancelScope(shield=True):  # the rest of a chunk begun
                    await self.stream.send_all(data[sent:])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
            finally:
                lock.release()
            return
        if self._held:  # the response ends before its body (Closed): the head first
            held, self._held = self._held, b""
            await super().protocol_send(RawData(data=held))
        await super().protocol_send(event)

    async def send_head(self, send: Any, message: Any) -> None:
        """``await send(message)`` (a response start), its bytes held for the next write
        (the body bytes the caller sends at once: `protocol_send`)."""
        self._hold_head = True
        try:
            await send(message)
        finally:
            self._hold_head = False

    async def _request(
        self, scope: Any, receive: Any, send: Any, _sync: Any = None, _call_soon: Any = None
    ) -> None:
        """One request (hypercorn's app call). A write by its task ends `ABORT_GRACE` seconds
        after its ``request_timeout`` (the connection closed: the app then ends as if the
        client left); the request itself is cancelled `ABORT_GRACE` seconds later still,
        wherever it waits. Over HTTP/2 a send that waits ``write_timeout`` for the stream's
        flow-control window (a client that reads the connection but not the stream) cancels
        the request (`Server.watch`)."""
        server = self._server
        write_by = trio.current_time() + server.request_limit
        task = trio.lowlevel.current_task()
        with trio.CancelScope(deadline=write_by + ABORT_GRACE) as request:
            self.requests[request] = None
            self.socket_.deadlines[task] = write_by
            server.requests += 1
            if scope.get("http_version") == "2":
                send = self._timed(send, request)
            else:
                scope[HOLD_HEAD] = self.send_head
                send = self._chunked(send)
            try:
                await server.app(scope, receive, send)
            finally:
                del self.requests[request]
                del self.socket_.deadlines[task]
                server.requests -= 1
                if not server.requests:
                    server.changed()
        if request.cancelled_caught and trio.current_time() >= request.deadline:
            logger.warning(
                "a request from %s was still running %g s after its request_timeout: cancelled",
                scope.get("client", ("?",))[0],
                2 * ABORT_GRACE,
            )

    def _chunked(self, send: Any) -> Any:
        """``send`` (HTTP/1.1), writing a streamed response's body bytes as one HTTP/1.1
        chunk each straight to the connection, past hypercorn's ``app_send`` and
        ``stream_send`` and h11's ``send`` (~7 µs a token: their event objects, checks and
        state machine, for a state that does not change in the body), when h11 is writing
        this response chunked (``ChunkedWriter``: its bytes, ``%x CRLF data CRLF``); every
        other message, and any other state or h11 version, takes hypercorn's path."""
        protocols = self.protocol
        write = self.protocol_send

        async def chunked(message: Any) -> None:
            body = message.get("body")
            if type(body) is bytes and body and message.get("more_body"):
                h11_protocol = protocols.protocol
                stream = getattr(h11_protocol, "stream", None)
                connection = getattr(h11_protocol, "connection", None)
                if (
                    message["type"] == "http.response.body"
                    and type(stream) is HTTPStream
                    and stream.state is ASGIHTTPState.RESPONSE
                    and type(connection) is h11.Connection
                    and connection.our_state is h11.SEND_BODY
                    and type(getattr(connection, "_writer", None)) is ChunkedWriter
                ):
                    await write(RawData(data=b"%x\r\n%s\r\n" % (len(body), body)))
                    return
            await send(message)

        return chunked

    def _timed(self, send: Any, request: trio.CancelScope) -> Any:
        """``send`` noting in `sending` since when it waits (an h2 stream's window)."""
        sending = self.sending

        async def timed(message: Any) -> None:
            sending[request] = trio.current_time()
            try:
                await send(message)
            finally:
                del sending[request]

        return timed

    def abort(self, reason: str) -> None:
        """End the connection now: its requests cancelled, its socket closed."""
        for request in self.requests:
            request.cancel()
        self.socket_.close_now(reason)


class Server:
    """The gateway's connections: each one contained, its writes bounded; and the drain.

    Args:
        app: the ASGI application.
        write_timeout: seconds a write may make no progress before the connection is
            closed; ``None``: no limit.
        request_timeout: the app's own request deadline (seconds; ``None``: none): a request
            still running `ABORT_GRACE` seconds later is cancelled.
        http2: serve h2c (prior knowledge and ``Upgrade``) besides HTTP/1.1.
        max_connections: connections open at once; one more is closed as soon as it is
            accepted.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        write_timeout: float | None,
        request_timeout: float | None,
        http2: bool,
        max_connections: int,
    ) -> None:
        self.app = app
        self.max_connections = max_connections
        self._full = False  # connections are being refused (logged once per episode)
        self.write_timeout = write_timeout
        self.request_limit = math.inf if request_timeout is None else request_timeout + ABORT_GRACE
        self.http2 = http2
        self.hypercorn = hypercorn.config.Config()
        self.hypercorn.accesslog = None  # the gateway writes its own, one JSON line per request
        self.hypercorn.errorlog = logging.getLogger("trio_hedge.gateway.server")
        self.context = WorkerContext(None)
        self.connections: set[_Connection] = set()
        self.requests = 0  # in flight, every route
        self._changed = trio.Event()
        self._hurry = False

    def changed(self) -> None:
        """Wake `drain`: a request or a connection ended, or `hurry` was called."""
        self._changed.set()
        self._changed = trio.Event()

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one connection (a ``trio.serve_listeners`` handler). Whatever it raises
        ends it alone."""
        if len(self.connections) >= self.max_connections:
            if not self._full:
                self._full = True
                logger.warning(
                    "%d connections open (max_connections): closing new ones at once",
                    len(self.connections),
                )
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
            return
        self._full = False
        connection = _Connection(self, stream)
        self.connections.add(connection)
        try:
            peer = "{}:{}".format(*stream.socket.getpeername()[:2])
        except OSError:
            peer = "?"
        try:
            await connection.run()
        except Exception as exc:  # a hypercorn defect (see the module docstring)
            logger.warning(
                "connection from %s failed (%s): closed; no other connection affected",
                peer,
                _where(exc),
            )
        finally:
            self.connections.discard(connection)
            with trio.CancelScope(shield=True):
                await stream.aclose()
            self.changed()
        reason = connection.socket_.closed_because
        if reason is not None:
            level = logging.INFO if reason == "shutdown" else logging.WARNING
            logger.log(level, "closed the connection from %s: %s", peer, reason)

    async def watch(self) -> None:
        """Close each connection whose write in progress made no progress for
        ``write_timeout`` seconds or outlived its request's deadline, and cancel each h2
        request whose send waited ``write_timeout`` for its stream's window: checked every
        `WATCH_EVERY` seconds (at most a tenth of ``write_timeout``)."""
        timeout = math.inf if self.write_timeout is None else self.write_timeout
        while True:
            await trio.sleep(min(WATCH_EVERY, timeout / 10))
            now = trio.current_time()
            for connection in self.connections:
                sock = connection.socket_
                since = sock.progress_at
                if since is not None:
                    if now - since >= timeout:
                        sock.close_now(f"a write made no progress for {timeout:g} s")
                    elif now >= sock.write_by:
                        sock.close_now("a write outlived its request's request_timeout")
                for request, since in connection.sending.items():
                    if now - since >= timeout and not request.cancel_called:
                        logger.warning(
                            "cancelled an HTTP/2 request: its stream's window stayed shut for %g s",
                            timeout,
                        )
                        request.cancel()

    def hurry(self) -> None:
        """End the drain delay and the drain's wait for requests now (a second signal)."""
        self._hurry = True
        self.changed()

    @property
    def hurried(self) -> bool:
        """Whether `hurry` was called."""
        return self._hurry

    async def linger(self, seconds: float) -> None:
        """Wait ``seconds`` (the drain delay: the listener still open, requests still
        served), or until `hurry` is called."""
        with trio.move_on_after(seconds):
            while not self._hurry:
                await self._changed.wait()

    async def close_idle(self) -> None:
        """Close the idle keep-alive connections now, and each busy one once its request
        ends (hypercorn's shutdown event: new requests can only come on new connections)."""
        await self.context.terminated.set()

    async def drain(self, drain_timeout: float, cancel_all: Callable[[], None]) -> None:
        """Let the requests in flight finish for ``drain_timeout`` seconds (idle keep-alive
        connections stay open meanwhile), then ``cancel_all()`` them and give them
        `CLOSE_GRACE` seconds more; then close the idle connections, and close every connection
        left after `ABORT_GRACE` seconds."""
        with trio.move_on_after(drain_timeout):
            while self.requests and not self._hurry:
                await self._changed.wait()
        if self.requests:
            if not self._hurry:  # a second signal said so already, and cancelled them
                logger.info(
                    "drain_timeout=%g s passed: cancelling %s in flight",
                    drain_timeout,
                    requests_text(self.requests),
                )
            cancel_all()
            with trio.move_on_after(CLOSE_GRACE):
                while self.requests:
                    await self._changed.wait()
        await self.context.terminated.set()  # hypercorn closes the idle connections
        for connection in list(self.connections):
            if connection.requests:  # stuck writing to a client that does not read
                connection.abort("shutdown")
        with trio.move_on_after(ABORT_GRACE):
            while self.connections:
                await self._changed.wait()
        self.close_all()

    def close_all(self) -> None:
        """End every connection now (its requests cancelled, its socket closed)."""
        for connection in list(self.connections):
            connection.abort("shutdown")
