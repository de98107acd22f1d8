"""A fake OpenAI-compatible replica: a real HTTP server on a loopback port.

HTTP/1.1 is served with h11; with ``http2=True`` a connection that starts with the HTTP/2
preface is served with h2 (prior knowledge, "h2c"), so tests can see whether a client resets a
cancelled stream (RST_STREAM) or leaves the server generating.
"""

from __future__ import annotations

import contextlib
import sys
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

import attrs
import h11
import trio

from ._behaviour import (
    KEEPALIVE,
    Behaviour,
    BehaviourSource,
    Chunk,
    Cut,
    Head,
    RequestLog,
    RequestRecord,
    Stall,
    Step,
    Wait,
    render_response,
)
from ._engine import EnginePage

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

if TYPE_CHECKING:
    import h2.connection

__all__ = ["FakeReplica", "fake_replicas"]

_RECEIVE_SIZE = 65536
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SERVER_HEADER = ("server", "trio-hedge-fake")
_Outcome = Literal["completed", "cut", "gone"]
_DEFAULT_BEHAVIOUR = Behaviour()  # frozen, so one shared default is safe


class _ClientGone(Exception):
    """The client went away while we were writing to it."""


class _Responder(Protocol):
    """Carries steps to one protocol; methods raise `_ClientGone`."""

    async def head(self, status: int, headers: Sequence[tuple[str, str]]) -> None: ...
    async def chunk(self, data: bytes) -> None: ...
    async def end(self) -> None: ...
    async def cut(self) -> None: ...


async def _execute(steps: Sequence[Step], record: RequestRecord, out: _Responder) -> _Outcome:
    """Carry out ``steps``, keeping ``record`` up to date. Cancellation (a disconnect seen by
    a watcher, or the server shutting down) ends it with ``record`` finished, not complete."""
    head_sent = False
    try:
        for step in steps:
            if isinstance(step, Wait):
                await trio.sleep(step.seconds)
            elif isinstance(step, Head):
                await out.head(step.status, (*step.headers, _SERVER_HEADER))
                record.status = step.status
                head_sent = True
            elif isinstance(step, Chunk):
                await out.chunk(step.data)
                record.note_sent(step.tokens)
            elif isinstance(step, Stall):
                interval = step.keepalive_interval
                if interval is None or not head_sent:
                    await trio.sleep_forever()
                while True:
                    await trio.sleep(interval)
                    await out.chunk(KEEPALIVE)
            elif isinstance(step, Cut):
                # Finish first: closing the socket wakes the watcher, which must not take our
                # own close for a client disconnect.
                record.note_finished()
                await out.cut()
                return "cut"
        await out.end()
        record.note_finished(completed=True)
        return "completed"
    except _ClientGone:
        record.note_finished(disconnected=True)
        return "gone"
    finally:
        record.note_finished()  # no-op unless cancelled


# --------------------------------------------------------------------------------------------
# HTTP/1.1


class _H11Responder:
    def __init__(self, conn: h11.Connection, stream: trio.SocketStream) -> None:
        self._conn = conn
        self._stream = stream

    async def _send(self, event: h11.Event) -> None:
        data = self._conn.send(event)
        if data:
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise _ClientGone from exc

    async def head(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        await self._send(h11.Response(status_code=status, headers=list(headers)))

    async def chunk(self, data: bytes) -> None:
        await self._send(h11.Data(data=data))  # one HTTP chunk per event, like LLM servers

    async def end(self) -> None:
        await self._send(h11.EndOfMessage())

    async def cut(self) -> None:
        await self._stream.aclose()  # FIN mid-body: the client sees a truncated chunked body


async def _h11_next_event(conn: h11.Connection, stream: trio.SocketStream) -> object:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await stream.receive_some(_RECEIVE_SIZE))


def _header_dict(pairs: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for raw_name, raw_value in pairs:
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


# --------------------------------------------------------------------------------------------
# HTTP/2 (imported lazily: h2 is an optional dependency)


#: How long (seconds) a send of bytes h2 has already encoded may wait for a client that does not
#: read: after that the connection is closed.
_SEND_LIMIT = 5.0


async def _send_whole(stream: trio.SocketStream, data: bytes) -> None:
    """Send ``data`` whole, even if the task is cancelled meanwhile (an answer whose stream
    the client reset). h2 has encoded it already: a HEADERS frame dropped here leaves the
    client's HPACK table out of step, and the client fails the whole connection at the next
    response's headers (failing case: ``tests/test_http2.py::
    test_the_fake_server_sends_a_reset_streams_headers_whole``). So it is shielded, and
    bounded: a send still waiting after `_SEND_LIMIT` closes the connection."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + _SEND_LIMIT) as scope:
        await stream.send_all(data)
    if scope.cancelled_caught:
        await stream.aclose()
        raise trio.ClosedResourceError("the client did not read for too long")


@attrs.define(eq=False)
class _H2Stream:
    stream_id: int
    headers: dict[str, str]
    body: bytearray = attrs.field(factory=bytearray)
    record: RequestRecord | None = None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    window_open: trio.Event = attrs.field(factory=trio.Event)


class _H2Responder:
    def __init__(
        self,
        conn: h2.connection.H2Connection,
        stream: _H2Stream,
        flush: Callable[[], Awaitable[None]],
    ) -> None:
        self._conn = conn
        self._stream = stream
        self._flush = flush

    async def _run(self, action: Callable[..., object], *args: object) -> None:
        """Queue frames with ``action(*args)`` and send them; a closed stream or socket means
        the client is gone."""
        import h2.exceptions

        try:
            action(*args)
            await self._flush()
        except (
            h2.exceptions.ProtocolError,  # includes StreamClosedError (the client reset it)
            trio.BrokenResourceError,
            trio.ClosedResourceError,
        ) as exc:
            raise _ClientGone from exc

    async def head(self, status: int, headers: Sequence[tuple[str, str]]) -> None:
        pairs = [(":status", str(status)), *headers]
        await self._run(self._conn.send_headers, self._stream.stream_id, pairs)

    async def chunk(self, data: bytes) -> None:
        import h2.exceptions

        sid = self._stream.stream_id
        while data:
            try:
                window = self._conn.local_flow_control_window(sid)
            except h2.exceptions.ProtocolError as exc:  # the stream is gone
                raise _ClientGone from exc
            size = min(window, self._conn.max_outbound_frame_size, len(data))
            if size <= 0:
                # The client does not read (e.g. httpcore dropped the stream without a
                # reset): block as a real server would, until a WINDOW_UPDATE.
                self._stream.window_open = trio.Event()
                await self._stream.window_open.wait()
                continue
            await self._run(self._conn.send_data, sid, data[:size])
            data = data[size:]

    async def end(self) -> None:
        await self._run(self._conn.end_stream, self._stream.stream_id)

    async def cut(self) -> None:
        import h2.errors

        code = h2.errors.ErrorCodes.INTERNAL_ERROR
        await self._run(self._conn.reset_stream, self._stream.stream_id, code)


# --------------------------------------------------------------------------------------------
# The replica


class FakeReplica:
    """A fake OpenAI-compatible replica on ``127.0.0.1`` (a free port), as an async context
    manager:

    ```python
    async with FakeReplica(Behaviour(ttft=0.1), name="primary") as replica:
        client.stream("POST", f"{replica.url}/chat/completions", json=...)
    ```

    It serves ``POST /v1/chat/completions``, ``POST /v1/messages`` (Anthropic) and
    ``POST /v1/responses`` (OpenAI Responses), each as its API streams (or one JSON answer
    when the body has ``"stream": false``), ``DELETE /v1/responses/{id}``, ``GET /health``,
    ``GET /v1/models``, and the engine pages in its ``pages`` dict (a load probe's
    ``/metrics``, ``/slots``: an [`EnginePage`][trio_hedge.testing.EnginePage] per path,
    settable at any time). While it waits (``ttft``, between tokens, stalled) it also watches
    the socket, so a client disconnect is recorded in ``RequestRecord.disconnected_at`` within
    milliseconds and the answer stops.

    An exception raised in the ``async with`` body comes out as itself, not wrapped in an
    ``ExceptionGroup``; the server's own crashes come out as an ``ExceptionGroup``.

    Args:
        behaviour: a [`Behaviour`][trio_hedge.testing.Behaviour], or a function
            ``(RequestRecord) -> Behaviour`` called for each chat request. Can be changed later via
            `behaviour`.
        name: the replica's name (in records and completion ids).
        http2: also accept HTTP/2 with prior knowledge (h2c); needs the ``h2`` package.
        model: the model name listed by ``/v1/models`` (chat answers echo the request's).
        host: the address to listen on. Default ``"127.0.0.1"``.
        port: the TCP port; default 0 (any free port: read
            [`port`][trio_hedge.testing.FakeReplica.port]).
    """

    def __init__(
        self,
        behaviour: BehaviourSource = _DEFAULT_BEHAVIOUR,
        *,
        name: str = "replica",
        http2: bool = False,
        model: str = "fake-model",
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if http2:
            import h2  # noqa: F401 (fail early and clearly when the extra is missing)
        self.behaviour: BehaviourSource = behaviour
        self.name = name
        self.http2 = http2
        self.model = model
        self.host = host
        self._listen_port = port
        self._open_connections = 0
        self._connections_changed = trio.Event()
        self._log = RequestLog(name)
        self._port: int | None = None
        self._nursery_manager: contextlib.AbstractAsyncContextManager[trio.Nursery] | None = None
        self._nursery: trio.Nursery | None = None
        #: Extra ``GET`` pages by path (an engine's ``/metrics`` or ``/slots``): set or change
        #: them at any time.
        self.pages: dict[str, EnginePage] = {}

    def __repr__(self) -> str:
        where = f"port={self._port}" if self._port is not None else "not started"
        return f"<FakeReplica {self.name!r} {where} requests={len(self.requests)}>"

    # -- addresses and records ---------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port (only inside ``async with``)."""
        if self._port is None:
            raise RuntimeError("the FakeReplica is not running (use `async with`)")
        return self._port

    @property
    def base_url(self) -> str:
        """``"http://HOST:PORT"`` (``127.0.0.1`` by default)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL, ``"http://127.0.0.1:PORT/v1"``."""
        return f"{self.base_url}/v1"

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request received (all paths), in arrival order."""
        return self._log.records

    @property
    def open_connections(self) -> int:
        """Connections currently open (accepted and not yet closed by us), for leak tests."""
        return self._open_connections

    def _count_connection(self, delta: int) -> None:
        self._open_connections += delta
        self._connections_changed.set()
        self._connections_changed = trio.Event()

    async def wait_connections(self, count: int = 0) -> None:
        """Wait until exactly ``count`` connections are open (default: all closed, i.e. the
        server has seen every client close). Bound it with ``trio.fail_after``."""
        while self._open_connections != count:
            await self._connections_changed.wait()

    async def wait_request(self, index: int) -> RequestRecord:
        """Wait until request ``index`` (0-based) has arrived."""
        return await self._log.wait_request(index)

    async def wait_finished(self, index: int) -> RequestRecord:
        """Wait until the replica is done with request ``index`` (for any reason)."""
        return await self._log.wait_finished(index)

    async def wait_disconnected(self, index: int) -> RequestRecord:
        """Wait until request ``index`` ends by a client disconnect; ``AssertionError`` if it
        ends otherwise. Bound it with ``trio.fail_after``."""
        return await self._log.wait_disconnected(index)

    # -- lifetime ----------------------------------------------------------------------------

    async def __aenter__(self) -> FakeReplica:
        if self._nursery_manager is not None:
            raise RuntimeError("a FakeReplica can be entered only once")
        listeners = await trio.open_tcp_listeners(self._listen_port, host=self.host)
        manager = trio.open_nursery()
        self._nursery_manager = manager
        self._nursery = await manager.__aenter__()
        try:
            await self._nursery.start(trio.serve_listeners, self._handle_connection, listeners)
        except BaseException:
            self._nursery.cancel_scope.cancel()
            await manager.__aexit__(*sys.exc_info())
            raise
        self._port = listeners[0].socket.getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> bool:
        assert self._nursery is not None and self._nursery_manager is not None
        self._nursery.cancel_scope.cancel()
        self._port = None  # the server is gone: its URL must not be used any more
        try:
            return bool(await self._nursery_manager.__aexit__(exc_type, exc, tb))
        except BaseExceptionGroup as group:
            # Trio wraps the body's exception into a group; give the body's own back so a
            # failing assert reads as an AssertionError. Server errors keep the group.
            if exc is not None and len(group.exceptions) == 1 and group.exceptions[0] is exc:
                return False  # re-raises exc as it was
            raise

    # -- connections -------------------------------------------------------------------------

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        self._count_connection(+1)
        try:
            async with stream:
                initial = b""
                if self.http2:
                    initial = await self._read_preface(stream)
                    if initial.startswith(_H2_PREFACE):
                        await self._serve_h2(stream, initial)
                        return
                await self._serve_h11(stream, initial)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away between requests
        finally:
            self._count_connection(-1)

    @staticmethod
    async def _read_preface(stream: trio.SocketStream) -> bytes:
        """Read until we know whether the client speaks HTTP/2 (prior knowledge)."""
        data = b""
        while len(data) < len(_H2_PREFACE) and _H2_PREFACE.startswith(data):
            more = await stream.receive_some(_RECEIVE_SIZE)
            if not more:
                break
            data += more
        return data

    def _render(self, record: RequestRecord) -> list[Step]:
        page = self.pages.get(record.path.split("?", 1)[0])
        if page is not None and record.method == "GET":
            return page.steps()
        return render_response(record, self.behaviour, model=self.model, created=int(time.time()))

    async def _serve_h11(self, stream: trio.SocketStream, initial: bytes) -> None:
        conn = h11.Connection(h11.SERVER)
        if initial:
            conn.receive_data(initial)
        while True:
            try:
                event = await _h11_next_event(conn, stream)
                if not isinstance(event, h11.Request):
                    return  # ConnectionClosed (or junk): nothing to answer
                body = bytearray()
                while not isinstance(part := await _h11_next_event(conn, stream), h11.EndOfMessage):
                    if isinstance(part, h11.Data):
                        body += part.data
                    elif isinstance(part, h11.ConnectionClosed):
                        return
            except h11.RemoteProtocolError:
                return
            record = self._log.new(
                method=event.method.decode("ascii"),
                path=event.target.decode("latin-1"),
                headers=_header_dict(list(event.headers)),
                body=bytes(body),
                http_version=event.http_version.decode("ascii"),
            )
            outcome = await self._h11_respond(conn, stream, record)
            if outcome != "completed" or conn.our_state is not h11.DONE:
                return  # cut, gone, or `Connection: close`
            if conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _h11_respond(
        self, conn: h11.Connection, stream: trio.SocketStream, record: RequestRecord
    ) -> _Outcome:
        outcome: _Outcome = "gone"
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                # Race every wait against a receive: EOF or a reset means the client left.
                try:
                    while data := await stream.receive_some(_RECEIVE_SIZE):
                        conn.receive_data(data)  # a pipelined request: keep it for later
                except trio.ClosedResourceError:
                    return  # we closed it ourselves (cut)
                except trio.BrokenResourceError:
                    pass
                record.note_finished(disconnected=True)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            outcome = await _execute(self._render(record), record, _H11Responder(conn, stream))
            nursery.cancel_scope.cancel()
        return outcome

    async def _serve_h2(self, stream: trio.SocketStream, initial: bytes) -> None:
        import h2.config
        import h2.connection
        import h2.events
        import h2.exceptions

        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        conn.initiate_connection()
        send_lock = trio.Lock()  # one send_all at a time on the socket
        streams: dict[int, _H2Stream] = {}

        async def flush() -> None:
            async with send_lock:
                data = conn.data_to_send()
                if data:
                    await _send_whole(stream, data)

        async def answer(st: _H2Stream, record: RequestRecord) -> None:
            with st.scope:
                await _execute(self._render(record), record, _H2Responder(conn, st, flush))
            streams.pop(st.stream_id, None)

        client_gone = False
        async with trio.open_nursery() as nursery:
            try:
                await flush()
                data = initial
                while data:
                    try:
                        events = conn.receive_data(data)
                    except h2.exceptions.ProtocolError:
                        await flush()  # the GOAWAY h2 queued
                        client_gone = True
                        break
                    for ev in events:
                        if isinstance(ev, h2.events.RequestReceived):
                            raw = [(bytes(k), bytes(v)) for k, v in ev.headers or ()]
                            streams[ev.stream_id or 0] = _H2Stream(
                                ev.stream_id or 0, _header_dict(raw)
                            )
                        elif isinstance(ev, h2.events.DataReceived):
                            sid = ev.stream_id or 0
                            if sid in streams and ev.data:
                                streams[sid].body += ev.data
                            conn.acknowledge_received_data(ev.flow_controlled_length or 0, sid)
                        elif isinstance(ev, h2.events.StreamEnded):
                            st = streams.get(ev.stream_id or 0)
                            if st is not None and st.record is None:
                                # Record now, not in the task, so a reset that comes before
                                # the task runs still finds a record to mark.
                                st.record = self._new_h2_record(st)
                                nursery.start_soon(answer, st, st.record)
                        elif isinstance(ev, h2.events.StreamReset):
                            st = streams.pop(ev.stream_id or 0, None)
                            if st is not None:
                                if st.record is not None:
                                    st.record.note_finished(disconnected=True)
                                st.scope.cancel()
                        elif isinstance(
                            ev, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged
                        ):
                            sid = getattr(ev, "stream_id", 0) or 0
                            for st in [streams[sid]] if sid in streams else streams.values():
                                st.window_open.set()
                        elif isinstance(ev, h2.events.ConnectionTerminated):
                            data = b""
                    await flush()
                    if data:
                        data = await stream.receive_some(_RECEIVE_SIZE)
                client_gone = True  # EOF, or GOAWAY
            except trio.BrokenResourceError:
                client_gone = True
            finally:
                if client_gone:
                    for st in streams.values():
                        if st.record is not None:
                            st.record.note_finished(disconnected=True)
                nursery.cancel_scope.cancel()

    def _new_h2_record(self, st: _H2Stream) -> RequestRecord:
        headers = dict(st.headers)
        method = headers.pop(":method", "GET")
        path = headers.pop(":path", "/")
        authority = headers.pop(":authority", None)
        for pseudo in [k for k in headers if k.startswith(":")]:
            del headers[pseudo]
        if authority is not None:
            headers.setdefault("host", authority)
        return self._log.new(
            method=method, path=path, headers=headers, body=bytes(st.body), http_version="2"
        )


@contextlib.asynccontextmanager
async def fake_replicas(
    *behaviours: BehaviourSource,
    names: Sequence[str] | None = None,
    http2: bool = False,
    model: str = "fake-model",
) -> AsyncIterator[list[FakeReplica]]:
    """Several [`FakeReplica`][trio_hedge.testing.FakeReplica] at once:

    ```python
    async with fake_replicas(Behaviour(ttft=5), Behaviour()) as [primary, backup]:
        ...
    ```

    Names default to ``"replica0"``, ``"replica1"``, … The body's exception comes out
    unwrapped, as with one replica.
    """
    if names is None:
        names = [f"replica{i}" for i in range(len(behaviours))]
    if len(names) != len(behaviours):
        raise ValueError("give one name per behaviour")
    async with contextlib.AsyncExitStack() as stack:
        replicas = [
            await stack.enter_async_context(FakeReplica(b, name=n, http2=http2, model=model))
            for b, n in zip(behaviours, names, strict=True)
        ]
        yield replicas
