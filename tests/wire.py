"""An HTTP/2 server behind an in-memory socket, for exact tests of what reaches the wire.

:class:`Wire` is an httpcore network backend (``httpcore.AsyncNetworkBackend``, the public
extension point) whose every connection is one in-memory socket to an h2 server. It records
what the server got (streams opened and reset, the headers it decoded, any protocol error
that ended the connection, whether the client closed the connection) and can hold the
client's writes back, as a full socket buffer does, or its connects, as a slow network does,
so a test can cancel a task exactly while its bytes are in flight or its connection is being
made.

The socket keeps Trio's own contract for ``SocketStream``: a write checks for cancellation
before it sends a byte, then either parks (socket full: a cancel while parked sends nothing)
or sends everything; a read either returns data or is cancelled before taking any.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import httpcore
import trio

__all__ = ["Wire", "WireServer"]

SSE_HEADERS = [(":status", "200"), ("content-type", "text/event-stream")]


@attrs.define(eq=False)
class WireServer:
    """One connection's server side: an h2 server answering every request's headers at once
    (or never, if the wire says so)."""

    wire: Wire
    h2: h2.connection.H2Connection = attrs.field(
        factory=lambda: h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
    )
    opened: list[int] = attrs.Factory(list)  # stream ids whose HEADERS arrived
    reset: list[int] = attrs.Factory(list)  # stream ids the client reset
    headers: dict[int, dict[str, str]] = attrs.Factory(dict)  # what the server decoded
    error: Exception | None = None  # the protocol error that ended the connection
    closed: bool = False
    to_client: bytearray = attrs.Factory(bytearray)
    readers: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)

    def __attrs_post_init__(self) -> None:
        self.h2.initiate_connection()
        self._flush()

    def receive(self, data: bytes) -> None:
        if self.error is not None:
            return  # the connection is over for the server: it reads no more
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:  # HPACK errors included
            self.error = exc
            self.closed = True  # after the GOAWAY h2 queued, as servers do
            self._flush()
            return
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                sid = event.stream_id or 0
                self.opened.append(sid)
                self.headers[sid] = {str(k): str(v) for k, v in event.headers or ()}
                if self.wire.answer:
                    self.h2.send_headers(sid, SSE_HEADERS)
            elif isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(
                    event.flow_controlled_length or 0, event.stream_id or 0
                )
            elif isinstance(event, h2.events.StreamReset):
                self.reset.append(event.stream_id or 0)
        self._flush()

    def send_raw(self, data: bytes) -> None:
        """Send ``data`` to the client as it is (frames h2 would never write)."""
        self.to_client += data
        self.readers.unpark_all()

    def send_data(self, stream_id: int, data: bytes) -> None:
        """Send ``data`` on ``stream_id`` to the client."""
        self.h2.send_data(stream_id, data)
        self._flush()

    def _flush(self) -> None:
        self.to_client += self.h2.data_to_send()
        self.readers.unpark_all()


class WireStream(httpcore.AsyncNetworkStream):
    def __init__(self, server: WireServer) -> None:
        self.server = server

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        await trio.lowlevel.checkpoint_if_cancelled()
        server = self.server
        while not server.to_client and not server.closed:
            await server.readers.park()  # cancellable: nothing taken
        data = bytes(server.to_client[:max_bytes])
        del server.to_client[:max_bytes]
        await trio.lowlevel.cancel_shielded_checkpoint()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return
        await trio.lowlevel.checkpoint_if_cancelled()  # as Trio's send_all: nothing sent yet
        wire = self.server.wire
        while wire.allowance == 0:
            wire.parked += 1
            try:
                await wire.writers.park()  # the socket is full; a cancel here sends nothing
            finally:
                wire.parked -= 1
        if wire.allowance is not None:
            wire.allowance -= 1
        wire.sent += len(buffer)
        self.server.receive(bytes(buffer))
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def aclose(self) -> None:
        self.server.closed = True
        self.server.readers.unpark_all()
        await trio.lowlevel.checkpoint()

    def get_extra_info(self, info: str) -> Any:
        return None


@attrs.define(eq=False)
class Wire(httpcore.AsyncNetworkBackend):
    """The network backend: each ``connect_tcp`` opens a new :class:`WireServer`."""

    servers: list[WireServer] = attrs.Factory(list)
    #: How many more writes may go through before the socket is full again (None: no limit).
    allowance: int | None = None
    #: Whether servers answer a request's headers (else they hold them back).
    answer: bool = True
    connects: trio.Event | None = None  # while set and not fired, connects wait for it
    parked: int = 0  # writes waiting for room
    sent: int = 0  # bytes that reached a server
    writers: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)

    def hold(self) -> None:
        """Fill the socket: every write from now on waits."""
        self.allowance = 0

    def release(self, writes: int | None = None) -> None:
        """Let ``writes`` more writes through (all of them if None)."""
        self.allowance = writes
        self.writers.unpark_all()

    def hold_connects(self) -> None:
        """Make connects wait until :meth:`release_connects`."""
        self.connects = trio.Event()

    def release_connects(self) -> None:
        assert self.connects is not None
        self.connects.set()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        if self.connects is not None:
            await self.connects.wait()
        await trio.lowlevel.checkpoint()
        server = WireServer(self)
        self.servers.append(server)
        return WireStream(server)

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)
