"""Misbehaving servers on loopback, and the leak checks the fault and fuzz suites share.

:class:`RawServer` speaks HTTP/1.1 by hand on raw Trio sockets, so a script can do what no
well-behaved server library lets it: reset the connection at any byte, send garbage, invalid
UTF-8 or one event of a megabyte, drip a response one byte at a time, or never answer. It
records every connection (accepted, the request read, who closed it and when), so a test can
prove that the *server* saw each connection closed, not only that the client forgot it. With
``tls=True`` it speaks TLS (a self-signed certificate for 127.0.0.1 in ``tests/data``).

:func:`refused_port` is a port where nothing listens; :class:`Blackhole` is a listening socket
that never accepts, with its backlog full, so a client's TCP connect stays pending (Linux drops
SYNs to a full accept queue; the client retries after 1 s, 3 s, ...).

The leak checks: :func:`open_responses` counts responses an httpx client has not closed (the
connection pool's in-flight requests), :class:`Baseline` compares this process's file
descriptors and Trio tasks before and after, :class:`GeneratorLeaks` records every async
generator the garbage collector had to finalise (Trio's ``ResourceWarning``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import ssl
import struct
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
import trio.testing

__all__ = [
    "TLS_PEM",
    "Baseline",
    "Blackhole",
    "Conn",
    "GeneratorLeaks",
    "RawServer",
    "ServerConn",
    "chunk",
    "close_cleanly",
    "open_responses",
    "refused_port",
    "sse",
    "token_event",
]

TLS_PEM = Path(__file__).parent / "data" / "loopback-tls.pem"

# -- bytes on the wire ------------------------------------------------------------------------

#: Status line and headers of a chunked event stream (the body follows as chunks).
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"content-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n"
    b"connection: close\r\n"
    b"\r\n"
)
END_OF_BODY = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk carrying ``data``."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse(payload: str | bytes) -> bytes:
    """One SSE data event."""
    raw = payload.encode() if isinstance(payload, str) else payload
    return b"data: " + raw + b"\n\n"


def _choice(delta: str, finish: str | None = None) -> str:
    reason = "null" if finish is None else f'"{finish}"'
    return (
        '{"id":"raw","object":"chat.completion.chunk","choices":'
        f'[{{"index":0,"delta":{delta},"finish_reason":{reason}}}]}}'
    )


ROLE_EVENT = sse(_choice('{"role":"assistant"}'))
FINISH_EVENT = sse(_choice("{}", "stop"))
DONE_EVENT = sse("[DONE]")


def token_event(text: str) -> bytes:
    """An SSE event carrying one content token (``text`` must need no JSON escaping)."""
    return sse(_choice('{"content":"%s"}' % text))  # noqa: UP031 - braces are JSON's


def healthy_body(tokens: Sequence[str]) -> list[bytes]:
    """The SSE events of a complete answer: role, tokens, finish reason, ``[DONE]``."""
    return [ROLE_EVENT, *(token_event(t) for t in tokens), FINISH_EVENT, DONE_EVENT]


# -- the server -------------------------------------------------------------------------------


class _ClientGone(Exception):
    """The client closed or reset the connection while the script was writing."""


@attrs.define(eq=False)
class Conn:
    """What a :class:`RawServer` saw on one connection. Times are ``trio.current_time()``."""

    number: int
    accepted_at: float
    request: bytes = attrs.field(default=b"", repr=False)  # head and body, once read whole
    request_at: float | None = None
    #: when the server saw the client close or reset the connection (EOF, ECONNRESET, a
    #: failed write, a failed TLS handshake), or ``None``.
    client_closed_at: float | None = None
    #: when the server's own socket for it was closed (by the script or after the client left).
    closed_at: float | None = None
    closed_by: str | None = None  # "client" or "server"
    tls_error: str | None = None
    _closed: trio.Event = attrs.field(factory=trio.Event, repr=False)

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    async def wait_closed(self) -> None:
        await self._closed.wait()


Script = Callable[["ServerConn"], Awaitable[None]]


class ServerConn:
    """What a script acts on: one accepted connection whose request has been read.

    Every wait of the script is raced against the client: when the client goes away the
    script is cancelled and the connection is recorded as closed by the client.
    """

    def __init__(self, stream: trio.abc.Stream, record: Conn, sock: trio.socket.SocketType) -> None:
        self._stream = stream
        self._sock = sock
        self.record = record
        self.closed_by_script = False

    async def send(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _ClientGone from exc

    async def send_chunks(self, events: Sequence[bytes]) -> None:
        for event in events:
            await self.send(chunk(event))

    async def drip(self, data: bytes) -> None:
        """Send ``data`` one byte per write, each read by the client before the next is sent
        (on loopback a write is readable at once: once every task is blocked again, the
        client has taken the byte and waits for more)."""
        for i in range(len(data)):
            await self.send(data[i : i + 1])
            await trio.testing.wait_all_tasks_blocked()

    async def close(self) -> None:
        """Close with a FIN (the script ends the connection)."""
        self.closed_by_script = True
        await self._stream.aclose()

    async def reset(self) -> None:
        """Close with a TCP RST (``SO_LINGER`` 0): the client reads ECONNRESET."""
        self.closed_by_script = True
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await self._stream.aclose()

    async def hold(self) -> None:
        """Send nothing more, and keep the connection open until the client leaves."""
        await trio.sleep_forever()


class RawServer:
    """An HTTP/1.1 server on ``127.0.0.1`` whose every answer is a script (an async function
    of a :class:`ServerConn`), as an async context manager. After the script returns, the
    server closes the connection (every scripted answer says ``connection: close``).

    Args:
        script: what to do with each request once it has been read.
        tls: speak TLS (``https://``) with the test certificate.
        name: for messages.
    """

    def __init__(self, script: Script, *, tls: bool = False, name: str = "raw") -> None:
        self.script = script
        self.name = name
        self.tls = tls
        self.connections: list[Conn] = []
        self._changed = trio.Event()
        self._port: int | None = None
        self._cancel: trio.CancelScope | None = None
        self._nursery_cm: Any = None
        self._ssl: ssl.SSLContext | None = None
        if tls:
            self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._ssl.load_cert_chain(TLS_PEM)

    def __repr__(self) -> str:
        return f"<RawServer {self.name!r} port={self._port} connections={len(self.connections)}>"

    @property
    def port(self) -> int:
        assert self._port is not None, "the server is not running"
        return self._port

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.port}/v1"

    @property
    def open_connections(self) -> int:
        return sum(1 for c in self.connections if not c.closed)

    def _note(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_connections(self, count: int = 0) -> None:
        """Wait until exactly ``count`` connections are open. Bound it with ``fail_after``."""
        while self.open_connections != count:
            await self._changed.wait()

    async def wait_requests(self, count: int) -> None:
        """Wait until ``count`` requests have been read whole."""
        while sum(1 for c in self.connections if c.request_at is not None) < count:
            await self._changed.wait()

    async def __aenter__(self) -> RawServer:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        self._cancel = nursery.cancel_scope
        self._port = listeners[0].socket.getsockname()[1]
        await nursery.start(trio.serve_listeners, self._handle, listeners)
        return self

    async def __aexit__(self, *exc_info: object) -> bool:
        assert self._cancel is not None
        self._cancel.cancel()
        return bool(await self._nursery_cm.__aexit__(*exc_info))

    async def _handle(self, tcp: trio.SocketStream) -> None:
        record = Conn(number=len(self.connections), accepted_at=trio.current_time())
        self.connections.append(record)
        self._note()
        sock = tcp.socket
        stream: trio.abc.Stream = tcp
        conn: ServerConn | None = None
        try:
            if self._ssl is not None:
                stream = trio.SSLStream(tcp, self._ssl, server_side=True)
                try:
                    await stream.do_handshake()
                except trio.BrokenResourceError as exc:
                    record.tls_error = str(exc.__cause__ or exc)
                    record.client_closed_at = trio.current_time()
                    return
            request = await _read_request(stream)
            if request is None:  # the client left before its request was whole
                record.client_closed_at = trio.current_time()
                return
            record.request, record.request_at = request, trio.current_time()
            self._note()
            conn = ServerConn(stream, record, sock)
            await self._run_script(conn, stream)
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
            record.closed_at = trio.current_time()
            if record.closed_by is None:
                script_closed = conn is not None and conn.closed_by_script
                gone = record.client_closed_at is not None and not script_closed
                record.closed_by = "client" if gone else "server"
            record._closed.set()
            self._note()

    async def _run_script(self, conn: ServerConn, stream: trio.abc.Stream) -> None:
        record = conn.record
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                # Anything the client sends now is ignored; EOF or a reset means it left.
                try:
                    while await stream.receive_some(65536):
                        pass
                except trio.ClosedResourceError:
                    return  # the script closed it
                except trio.BrokenResourceError:
                    pass
                if not conn.closed_by_script:
                    record.client_closed_at = trio.current_time()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            try:
                await self.script(conn)
            except _ClientGone:
                if record.client_closed_at is None:
                    record.client_closed_at = trio.current_time()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the script closed or reset the connection itself
            nursery.cancel_scope.cancel()


async def _read_request(stream: trio.abc.Stream) -> bytes | None:
    """Read one request's head and its ``content-length`` body; ``None`` on EOF first."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            more = await stream.receive_some(65536)
            if not more:
                return None
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            more = await stream.receive_some(65536)
            if not more:
                return None
            body += more
    except trio.BrokenResourceError:
        return None
    return head + b"\r\n\r\n" + body


# -- sockets that do not serve ----------------------------------------------------------------


def refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed: a connect is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class Blackhole:
    """A listening socket that never accepts, its backlog filled, so connects hang (SYN
    dropped) until the client gives up or is cancelled. Synchronous context manager."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._fillers: list[socket.socket] = []

    def __enter__(self) -> Blackhole:
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        # Linux queues backlog + 1 connections; fill the queue so later SYNs are dropped.
        for _ in range(2):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(self._listener.getsockname())
            self._fillers.append(filler)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for s in self._fillers:
            s.close()
        self._listener.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}/v1"


# -- leak checks ------------------------------------------------------------------------------


def _pools(client: httpx.AsyncClient) -> list[Any]:
    transport = client._transport
    shards = getattr(transport, "_shards", None)
    transports = [s.transport for s in shards] if shards is not None else [transport]
    return [t._pool for t in transports]


def open_responses(client: httpx.AsyncClient) -> int:
    """Responses sent through ``client`` and not closed yet (httpcore keeps each request in
    its pool's list until the response is closed)."""
    return sum(len(pool._requests) for pool in _pools(client))


def _fds() -> dict[int, str]:
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd is closed by now
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return fds


def _tasks(task: trio.lowlevel.Task) -> list[str]:
    out = []
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            out.append(child.name)
            out.extend(_tasks(child))
    return out


@attrs.frozen
class Baseline:
    """This process's open file descriptors and the Trio tasks under the root task."""

    fds: dict[int, str]
    tasks: tuple[str, ...]

    @classmethod
    def take(cls) -> Baseline:
        return cls(_fds(), tuple(sorted(_tasks(trio.lowlevel.current_root_task()))))

    async def changes(self) -> list[str]:
        """What was left behind since :meth:`take`: file descriptors and Trio tasks."""
        gc.collect()  # async generators in reference cycles get finalised (a system task)
        await trio.testing.wait_all_tasks_blocked()
        now = Baseline.take()
        found = []
        leaked_fds = {fd: target for fd, target in now.fds.items() if fd not in self.fds}
        if leaked_fds:
            found.append(f"file descriptors left open: {leaked_fds}")
        if len(now.tasks) != len(self.tasks):
            extra = sorted(set(now.tasks) - set(self.tasks)) or list(now.tasks)
            found.append(f"Trio tasks left running: {extra}")
        return found

    async def assert_unchanged(self, what: str = "") -> None:
        """Assert that no fd and no task was left behind since :meth:`take`."""
        found = await self.changes()
        assert not found, f"{what}: {'; '.join(found)}"


@asynccontextmanager
async def close_cleanly(client: httpx.AsyncClient) -> AsyncIterator[httpx.AsyncClient]:
    """``async with client`` that closes it even when the body is cancelled."""
    try:
        yield client
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()


@attrs.define
class GeneratorLeaks:
    """Every async generator left unfinished for the garbage collector to finalise, with the
    races running when it was found (Trio's ``ResourceWarning``: "Async generator ... was
    garbage collected before it had been exhausted").

    The warning is raised in the collector's context, where ``filterwarnings = error`` can
    only print it ("Exception ignored in ..."), so a test cannot fail on it by raising:
    :meth:`recording` records it (and any other warning, which a test should fail on too),
    and :meth:`settle` collects reference cycles so none escapes the count."""

    running: set[str] = attrs.Factory(set)  # labels of what runs now (races)
    found: list[tuple[str, tuple[str, ...]]] = attrs.Factory(list)  # (message, running)
    other: list[str] = attrs.Factory(list)  # any other warning

    @contextmanager
    def recording(self) -> Iterator[GeneratorLeaks]:
        def show(message: Warning | str, category: type[Warning], *_args: object) -> None:
            text = str(message)
            if category is ResourceWarning and "was garbage collected" in text:
                self.found.append((text.split("'")[1], tuple(sorted(self.running))))
            else:
                self.other.append(f"{category.__name__}: {text}"[:300])

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            yield self

    async def settle(self) -> None:
        """Finalise what only the cycle collector frees (inside the Trio run, so its hooks
        see it) and let Trio's finaliser tasks run."""
        gc.collect()
        await trio.testing.wait_all_tasks_blocked()

    def problems(self) -> list[str]:
        """One line per generator kind, with the races it was found under."""
        by_name: dict[str, list[str]] = {}
        for name, running in self.found:
            by_name.setdefault(name, []).extend(running)
        lines = [
            f"{sum(1 for n, _ in self.found if n == name)} async generator(s) {name!r} left for "
            f"the garbage collector (races running: {', '.join(sorted(set(races))[:5]) or '-'})"
            for name, races in by_name.items()
        ]
        return lines + [f"a warning: {w}" for w in self.other]
