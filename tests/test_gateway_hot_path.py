"""The gateway's token path (issue 20): what one read of the winner brought goes out in one
write, byte for byte, over real loopback sockets."""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable

import pytest
import trio
from hypercorn.protocol.http_stream import HTTPStream

import trio_hedge as th
from trio_hedge.gateway import GatewayConfig, Group, _server

from .gateway_support import CHAT, HEDGER, Gateway

#: The server's own compact JSON (key order, spacing), as a model server writes it.
EVENTS = [
    '{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    '"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
    *(
        f'{{"id":"c1","object":"chat.completion.chunk","choices":[{{"index":0,'
        f'"delta":{{"content":"tok{i} "}},"finish_reason":null}}]}}'
        for i in range(6)
    ),
    '{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},'
    '"finish_reason":"stop"}]}',
]
BODY = "".join(f"data: {e}\n\n" for e in EVENTS).encode() + b"data: [DONE]\n\n"


async def _burst_server(listener: trio.SocketListener, answer: bytes = BODY) -> None:
    """Answers each request with the whole event stream in one write (a burst: what a
    model server sends when tokens come faster than it flushes, or what a reader that fell
    behind finds waiting)."""
    async with listener:
        while True:
            stream = await listener.accept()
            async with stream:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await stream.receive_some()
                head, _, request = data.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(request) < length:
                    request += await stream.receive_some()
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(answer), answer)
                )


def _chunks(raw: bytes) -> tuple[bytes, list[bytes]]:
    """The head and the HTTP/1.1 chunks (the gateway's writes) of a chunked response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    chunks = []
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        chunks.append(rest[:n])
        rest = rest[n + 2 :]
    return head, chunks


async def _relay(
    body: bytes = BODY,
    before_reading: Callable[[], Awaitable[None]] | None = None,
    rcvbuf: int | None = None,
) -> bytes:
    """The gateway's raw answer to one streamed request, the upstream sending ``body`` in
    one write; the client waits for ``before_reading()`` before it reads."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_burst_server, listener, body)
        replica = th.Replica(f"http://127.0.0.1:{port}/v1", name="burst")
        config = GatewayConfig([replica], [Group("default", ["burst"], hedger=HEDGER)], port=0)
        async with Gateway(config) as gw:
            host, gw_port = gw.base_url.split("//")[1].split(":")
            payload = json.dumps({**CHAT, "stream": True}).encode()
            with trio.fail_after(10):
                sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                if rcvbuf is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
                await sock.connect((host, int(gw_port)))
                stream = trio.SocketStream(sock)
                async with stream:
                    await stream.send_all(
                        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                        b"content-type: application/json\r\nconnection: close\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
                    )
                    if before_reading is not None:
                        await before_reading()
                    raw = b""
                    while chunk := await stream.receive_some():
                        raw += chunk
        nursery.cancel_scope.cancel()
    return raw


async def test_a_reads_events_go_out_in_one_write_byte_for_byte() -> None:
    """The upstream sends all its events in one write: the gateway relays them in one
    ``send`` (one HTTP chunk), then ``[DONE]``; the bytes are the server's own, in order."""
    head, chunks = _chunks(await _relay())
    assert head.startswith(b"HTTP/1.1 200")
    assert b"".join(chunks) == BODY  # byte for byte, [DONE] the gateway's own
    assert chunks == [BODY.removesuffix(b"data: [DONE]\n\n"), b"data: [DONE]\n\n"]


class _Writes(list[tuple[bytes, int]]):
    """Every write to a client socket, as (bytes asked, bytes written at once), whichever
    path it takes (the one that waits reports all of its bytes); ``full`` is set at the
    first that did not go at once."""

    def __init__(self) -> None:
        super().__init__()
        self.full = trio.Event()


def _record_writes(monkeypatch: pytest.MonkeyPatch) -> _Writes:
    writes = _Writes()
    write_now = getattr(_server._Socket, "write_now", None)
    send_all = _server._Socket.send_all

    def recording_write_now(self: _server._Socket, data: bytes) -> int:
        assert write_now is not None
        sent: int = write_now(self, data)
        writes.append((bytes(data), sent))
        if sent < len(data):
            writes.full.set()
        return sent

    async def recording_send_all(self: _server._Socket, data: bytes) -> None:
        writes.append((bytes(data), len(data)))
        await send_all(self, data)

    if write_now is not None:
        monkeypatch.setattr(_server._Socket, "write_now", recording_write_now)
    monkeypatch.setattr(_server._Socket, "send_all", recording_send_all)
    return writes


async def test_the_head_goes_out_with_the_first_events_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The status line and headers are written together with the events read up to the
    commit: one segment, one wake-up of the client before its first token (TTFT); the
    body's chunks skip hypercorn's and h11's send path, byte for byte. On bcbad18 the head
    was a write of its own, and every chunk went through hypercorn."""
    writes = _record_writes(monkeypatch)
    through_hypercorn: list[dict[str, object]] = []
    app_send = HTTPStream.app_send

    async def counted(self: HTTPStream, message: dict[str, object] | None) -> None:
        if message is not None:
            through_hypercorn.append(message)
        await app_send(self, message)  # type: ignore[arg-type]

    monkeypatch.setattr(HTTPStream, "app_send", counted)
    _, chunks = _chunks(await _relay())
    assert b"".join(chunks) == BODY
    # The body's chunks went straight to the connection; the start and the end through
    # hypercorn (its state: the response ends, the connection is kept or closed).
    assert [m["type"] for m in through_hypercorn] == ["http.response.start", "http.response.body"]
    assert through_hypercorn[1]["more_body"] is False
    first = writes[0][0]
    assert first.startswith(b"HTTP/1.1 200")
    assert first.partition(b"\r\n\r\n")[2] == b"%x\r\n%s\r\n" % (len(chunks[0]), chunks[0])


async def test_a_client_that_reads_late_gets_every_byte_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client with a small receive buffer that reads only once the gateway's writes have
    found the socket full: the write that does not go at once finishes on the waiting path
    (the connection's lock, shielded), and the answer is the server's bytes, in order."""
    writes = _record_writes(monkeypatch)
    events = [e.replace("tok", f"r{i}-tok") for i in range(2000) for e in EVENTS]
    body = "".join(f"data: {e}\n\n" for e in events).encode()  # ~300 KB in one write
    answer = await _relay(body + b"data: [DONE]\n\n", writes.full.wait, rcvbuf=4096)
    head, chunks = _chunks(answer)
    assert head.startswith(b"HTTP/1.1 200")
    assert b"".join(chunks) == body + b"data: [DONE]\n\n"
