"""The gateway's connections (``trio_hedge/gateway/_server.py``): no single connection, of any
protocol, takes the process down or holds a slot past its deadlines, over real sockets.

The h2 requests here are raw frames (the ``h2`` package, client side, with its checks off) so
that a test can send what no well-behaved client would.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import random
import socket
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import httpx
import pytest
import trio

import trio_hedge as th
from trio_hedge.gateway import GatewayConfig, Group, Limits, serve
from trio_hedge.testing import Behaviour, FakeReplica

from .gateway_support import CHAT, HEDGER, Gateway, config_for

#: A stream that lasts ~0.4 s: the second client, in flight while another one misbehaves.
PACED = Behaviour(ttft=0.0, token_delay=0.02, tokens=20)
#: 32 MB as fast as the gateway takes it: fills a client's socket buffers at once.
BIG = Behaviour(ttft=0.0, token_delay=0.0, tokens=("x" * 8000 + " ",) * 4000)

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _port(gw: Gateway) -> int:
    return int(gw.base_url.rsplit(":", 1)[1])


class H2:
    """A raw h2c client (prior knowledge) over one loopback connection."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            validate_inbound_headers=False,
        )
        self.connection = h2.connection.H2Connection(config)
        self.events: list[h2.events.Event] = []

    @classmethod
    @asynccontextmanager
    async def open(cls, port: int) -> AsyncIterator[H2]:
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            client = cls(stream)
            client.connection.initiate_connection()
            await client.flush()
            yield client

    async def flush(self) -> None:
        data = self.connection.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def request(self, headers: list[tuple[bytes, bytes]], *, end: bool = True) -> int:
        stream_id: int = self.connection.get_next_available_stream_id()
        self.connection.send_headers(stream_id, headers, end_stream=end)
        await self.flush()
        return stream_id

    async def until(self, done: Callable[[], bool]) -> None:
        """Read until ``done()`` (bound it with ``fail_after``)."""
        while not done():
            data = await self.stream.receive_some()
            if not data:
                raise EOFError("the gateway closed the connection")
            self.events += self.connection.receive_data(data)
            await self.flush()

    def ended(self, stream_id: int) -> Callable[[], bool]:
        def done() -> bool:
            return any(
                isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset))
                and e.stream_id == stream_id
                for e in self.events
            )

        return done

    def of(self, stream_id: int, kind: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind) and e.stream_id == stream_id]

    def status(self, stream_id: int) -> int | None:
        for event in self.of(stream_id, h2.events.ResponseReceived):
            return int(dict(event.headers)[b":status"])
        return None


def _headers(
    path: bytes = b"/healthz", method: bytes = b"GET", *extra: tuple[bytes, bytes]
) -> list[tuple[bytes, bytes]]:
    return [(b":method", method), (b":path", path), (b":scheme", b"http"), (b":authority", b"x"),
            *extra]  # fmt: skip


async def _second_client(gw: Gateway, task_status: trio.TaskStatus[list[bytes]]) -> None:
    """A second client's stream: ``await nursery.start(_second_client, gw)`` returns once it
    is in flight, with the list its pieces go into (whole when the task ends)."""
    out: list[bytes] = []
    async with httpx.AsyncClient() as http:
        body = {**CHAT, "stream": True}
        async with http.stream("POST", f"{gw.url}/chat/completions", json=body) as response:
            async for piece in response.aiter_raw():
                if not out:
                    task_status.started(out)
                out.append(piece)


def _served_whole(out: Sequence[bytes]) -> bool:
    text = b"".join(out)
    return b"tok19" in text and text.endswith(b"data: [DONE]\n\n")


async def _healthy(gw: Gateway) -> int:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{gw.base_url}/healthz")).status_code


async def _logged(caplog: pytest.LogCaptureFixture, logger: str) -> None:
    """Wait for a line on ``logger`` (the access log's comes after the slot is released).
    No event says so: poll, bounded by the caller's ``fail_after``."""
    while not any(r.name == logger for r in caplog.records):  # noqa: ASYNC110
        await trio.sleep(0.01)


def _contained(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The connections that failed in hypercorn and were contained (an unknown defect)."""
    return [r.getMessage() for r in caplog.records if "failed (" in r.getMessage()]


# -- item 1: one request must not take the process down -----------------------------------------

#: Each raised in hypercorn 0.18.0 and ended ``serve`` (checked on bcbad18): what it sends,
#: and the RST_STREAM error code it gets now.
H2_CRASHERS = {
    "a non-ASCII :path": (_headers(b"/v1/\xff"), h2.errors.ErrorCodes.PROTOCOL_ERROR),
    "a non-ASCII :method": (_headers(b"/healthz", b"G\xc9T"), h2.errors.ErrorCodes.PROTOCOL_ERROR),
    "a plain CONNECT (no :path)": (
        [(b":method", b"CONNECT"), (b":authority", b"x:443")],
        h2.errors.ErrorCodes.PROTOCOL_ERROR,
    ),
}


@pytest.mark.parametrize("case", list(H2_CRASHERS))
async def test_a_request_hypercorn_cannot_decode_is_reset_alone(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    headers, code = H2_CRASHERS[case]
    async with FakeReplica(PACED, name="a") as a, Gateway(config_for([a])) as gw:
        async with trio.open_nursery() as clients, H2.open(_port(gw)) as client:
            with trio.fail_after(10):
                second = await clients.start(_second_client, gw)
                bad = await client.request(headers)
                await client.until(client.ended(bad))
                good = await client.request(_headers())  # the same connection goes on
                await client.until(client.ended(good))
        assert await _healthy(gw) == 200
    (reset,) = client.of(bad, h2.events.StreamReset)
    assert reset.error_code == code and client.status(bad) is None
    assert client.status(good) == 200
    assert _served_whole(second)
    assert not _contained(caplog)


async def test_data_after_a_complete_response_ends_that_stream_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 404 (or 405, 413) answered before the body; the body then arrives: hypercorn 0.18.0
    raised ``KeyError`` and ended ``serve``. Now the client is asked to stop (RST_STREAM
    NO_ERROR, RFC 9113 §8.1) after its whole answer."""
    async with FakeReplica(PACED, name="a") as a, Gateway(config_for([a])) as gw:
        async with trio.open_nursery() as clients, H2.open(_port(gw)) as client:
            with trio.fail_after(10):
                second = await clients.start(_second_client, gw)
                early = await client.request(_headers(b"/nowhere", b"POST"), end=False)
                await client.until(client.ended(early))
                client.connection.send_data(early, b"x" * 100)
                await client.flush()
                await client.until(lambda: bool(client.of(early, h2.events.StreamReset)))
                good = await client.request(_headers())
                await client.until(client.ended(good))
        assert await _healthy(gw) == 200
    assert client.status(early) == 404
    (reset,) = client.of(early, h2.events.StreamReset)
    assert reset.error_code == h2.errors.ErrorCodes.NO_ERROR
    assert client.status(good) == 200
    assert _served_whole(second)
    assert not _contained(caplog)


#: HTTP/1.1 inputs, each on its own connection: what the gateway answers (the status line's
#: start), or ``b""`` for a closed connection.
H1_CASES = {
    # hypercorn 0.18.0 sent its 101 and then raised binascii.Error: serve ended.
    "h2c Upgrade, HTTP2-Settings not base64": (
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nconnection: Upgrade, "
        b"HTTP2-Settings\r\nhttp2-settings: !!!notbase64\r\n\r\n",
        b"HTTP/1.1 200",
    ),
    "h2c Upgrade, HTTP2-Settings badly padded": (
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQ\r\n\r\n",
        b"HTTP/1.1 200",
    ),
    "h2c Upgrade, HTTP2-Settings with ENABLE_PUSH = 5": (
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\nhttp2-settings: AAIAAAAF\r\n\r\n",
        b"HTTP/1.1 200",
    ),
    "a non-ASCII target": (b"GET /\xff HTTP/1.1\r\nhost: x\r\n\r\n", b"HTTP/1.1 400"),
    "a non-ASCII method": (b"G\xffT / HTTP/1.1\r\nhost: x\r\n\r\n", b"HTTP/1.1 400"),
    "a non-ASCII header name": (b"GET / HTTP/1.1\r\nhost: x\r\nx\xff: 1\r\n\r\n", b"HTTP/1.1 400"),
    "a non-ASCII header value": (
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: \xff\xfe\r\n\r\n",
        b"HTTP/1.1 200",
    ),
    "a NUL in the target": (b"GET /\x00 HTTP/1.1\r\nhost: x\r\n\r\n", b"HTTP/1.1 400"),
    "a bad version": (b"GET / HTTP/1.\xff\r\nhost: x\r\n\r\n", b"HTTP/1.1 400"),
    "a bad chunk": (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
        b"\r\nzz\r\n",
        b"HTTP/1.1 400",
    ),
    "a header over 16 KiB": (
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nx: " + b"a" * 100_000 + b"\r\n\r\n",
        b"HTTP/1.1 431",
    ),
    "a websocket upgrade": (
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n",
        b"HTTP/1.1 403",  # refused (was hypercorn's 500 for an app that says nothing)
    ),
    "CONNECT": (b"CONNECT x:443 HTTP/1.1\r\nhost: x\r\n\r\n", b"HTTP/1.1 404"),
    "OPTIONS *": (b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n", b"HTTP/1.1 404"),
}


async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection and read what comes back until the gateway closes
    the connection or the first answer is whole (bound it with ``fail_after``)."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(data)
        got = b""
        while True:
            try:
                more = await stream.receive_some()
            except trio.BrokenResourceError:
                return got
            if not more:
                return got
            got += more
            head, sep, body = got.partition(b"\r\n\r\n")
            if sep and (b"content-length: " + str(len(body)).encode()) in head:
                return got


@pytest.mark.parametrize("case", list(H1_CASES))
async def test_http1_inputs_are_answered_and_hurt_no_one(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    data, answer = H1_CASES[case]
    async with FakeReplica(PACED, name="a") as a, Gateway(config_for([a])) as gw:
        async with trio.open_nursery() as clients:
            with trio.fail_after(10):
                second = await clients.start(_second_client, gw)
                got = await _exchange(_port(gw), data)
        assert await _healthy(gw) == 200
    assert got.startswith(answer)
    assert _served_whole(second)
    assert not _contained(caplog)


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    head = struct.pack(">I", len(payload))[1:] + bytes([kind, flags])
    return head + struct.pack(">I", stream_id) + payload


@pytest.mark.parametrize("seed", range(4))
async def test_random_h2_frames_hurt_no_one(seed: int, caplog: pytest.LogCaptureFixture) -> None:
    """Seeded fuzz: 25 connections each sending the preface, SETTINGS and 6 random frames
    (any type, flags, a small stream id, up to 40 random bytes, or a valid request's HEADERS
    with bytes flipped). No connection may raise in hypercorn (each would end it: a defect
    to handle by name above), the second client's stream goes on, the process serves."""
    rng = random.Random(seed)
    valid = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding=None))
    valid.initiate_connection()
    valid.send_headers(1, _headers(b"/v1/chat/completions", b"POST"), end_stream=False)
    headers_block = valid.data_to_send()[-40:]

    def junk() -> bytes:
        if rng.random() < 0.3:
            flipped = bytearray(headers_block)
            for _ in range(3):
                flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            return _frame(1, rng.choice([4, 5]), 1, bytes(flipped[9:]))
        payload = rng.randbytes(rng.randrange(41))
        return _frame(rng.randrange(12), rng.randrange(256), rng.randrange(6), payload)

    async with FakeReplica(PACED, name="a") as a, Gateway(config_for([a])) as gw:
        async with trio.open_nursery() as clients:
            with trio.fail_after(10):
                second = await clients.start(_second_client, gw)
            for _ in range(25):
                frames = b"".join(junk() for _ in range(6))
                with trio.fail_after(10):
                    async with await trio.open_tcp_stream("127.0.0.1", _port(gw)) as stream:
                        await stream.send_all(H2_PREFACE + _frame(4, 0, 0, b"") + frames)
        assert await _healthy(gw) == 200
    assert _served_whole(second)
    assert not _contained(caplog)


async def test_http1_only(caplog: pytest.LogCaptureFixture) -> None:
    """``http2 = false``: the HTTP/2 preface gets 505, an ``Upgrade: h2c`` is answered over
    HTTP/1.1, and none of the h2 inputs reaches hypercorn's HTTP/2 code."""
    async with FakeReplica(PACED, name="a") as a:
        async with Gateway(config_for([a], http2=False)) as gw:
            port = _port(gw)
            with trio.fail_after(10):
                preface = await _exchange(port, H2_PREFACE + _frame(4, 0, 0, b""))
                upgrade = await _exchange(
                    port,
                    b"GET /healthz HTTP/1.1\r\nhost: x\r\nupgrade: h2c\r\n"
                    b"connection: Upgrade, HTTP2-Settings\r\nhttp2-settings: AAMAAABk\r\n\r\n",
                )
            async with httpx.AsyncClient(http1=False, http2=True) as http:
                with pytest.raises(httpx.RemoteProtocolError):
                    await http.get(f"{gw.base_url}/healthz")
    assert preface.startswith(b"HTTP/1.1 505")
    assert upgrade.startswith(b"HTTP/1.1 200") and b"upgrade" not in upgrade.lower()
    assert not _contained(caplog)


# -- item 2: a client that stops reading --------------------------------------------------------


class BigAndSmall:
    """A gateway whose model ``big`` goes to a `BIG` replica and every other to a small fast
    one: ``async with BigAndSmall(limits) as (big, gw)``."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> tuple[FakeReplica, Gateway]:
        stack = self._stack
        big = await stack.enter_async_context(FakeReplica(BIG, name="big"))
        small = await stack.enter_async_context(FakeReplica(Behaviour(tokens=2), name="small"))
        replicas = [th.Replica(big.url, name="big"), th.Replica(small.url, name="small")]
        groups = [
            Group("big", ["big"], models=["big"], hedger=HEDGER),
            Group("small", ["small"], hedger=HEDGER),
        ]
        config = GatewayConfig(replicas, groups, port=0, limits=self._limits)
        gw = await stack.enter_async_context(Gateway(config))
        return big, gw

    async def __aexit__(self, *exc: object) -> bool | None:
        return await self._stack.__aexit__(*exc)  # type: ignore[arg-type]


async def _stalled_client(port: int, body: dict[str, Any]) -> trio.SocketStream:
    """A client that sends a request and never reads: a small receive buffer, so the
    gateway's writes stop making progress at once."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    data = json.dumps(body).encode()
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(data)).encode() + b"\r\n\r\n" + data
    )
    return stream


@pytest.mark.parametrize("deadline", ["write_timeout", "request_timeout"])
async def test_a_client_that_stops_reading_loses_its_request_and_slot(
    deadline: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One slot (``max_concurrent = 1``), taken by a client that stops reading: the write
    that makes no progress for ``write_timeout`` (or the request's ``request_timeout``)
    ends its request, the upstream is closed and the next client gets the slot. On bcbad18
    the request stayed in flight as long as the socket was open (the second case hangs)."""
    caplog.set_level(logging.INFO)
    if deadline == "write_timeout":
        limits = Limits(max_concurrent=1, write_timeout=0.3, request_timeout=None)
    else:
        limits = Limits(max_concurrent=1, request_timeout=1.0)  # write_timeout: 30 s
    async with BigAndSmall(limits) as (big, gw):
        stalled = await _stalled_client(_port(gw), {**CHAT, "model": "big", "stream": True})
        async with stalled:
            with trio.fail_after(10):
                await big.wait_disconnected(0)
                await _logged(caplog, "trio_hedge.gateway.access")  # its slot is free
                async with httpx.AsyncClient() as http:
                    after = await http.post(f"{gw.url}/chat/completions", json=CHAT)
    assert after.status_code == 200  # the slot was freed
    # The upstream was not read into the gateway's memory: it stopped with the client.
    assert big.requests[0].tokens_sent < 4000
    reason = "no progress for 0.3 s" if deadline == "write_timeout" else "request_timeout"
    assert any(reason in r.getMessage() for r in caplog.records)


async def test_an_h2_stream_whose_window_stays_shut_loses_its_request_and_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same over HTTP/2 by a client that keeps reading the connection but opens no
    stream window (``SETTINGS_INITIAL_WINDOW_SIZE = 0``): no socket write stalls, the
    stream's send waits for its window; after ``write_timeout`` the request is cancelled."""
    caplog.set_level(logging.INFO)
    limits = Limits(max_concurrent=1, write_timeout=0.3, request_timeout=None)
    async with BigAndSmall(limits) as (big, gw), H2.open(_port(gw)) as client:
        client.connection.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        body = json.dumps({**CHAT, "model": "big", "stream": True}).encode()
        shut = await client.request(_headers(b"/v1/chat/completions", b"POST"), end=False)
        client.connection.send_data(shut, body, end_stream=True)
        await client.flush()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.until, lambda: False)  # reads, never a window
                await big.wait_disconnected(0)
                await _logged(caplog, "trio_hedge.gateway.access")  # its slot is free
                async with httpx.AsyncClient() as http:
                    after = await http.post(f"{gw.url}/chat/completions", json=CHAT)
                nursery.cancel_scope.cancel()
    assert after.status_code == 200  # the slot was freed
    assert any("window stayed shut for 0.3 s" in r.getMessage() for r in caplog.records)


async def test_the_drain_ends_whatever_a_stalled_client_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stop (SIGTERM) with a client that stopped reading and no write or request deadline
    that would end it first: ``serve`` returns after ``drain_timeout`` plus the grace, its
    upstream closed. On bcbad18 it never returned (hypercorn's shielded write)."""
    monkeypatch.setattr("trio_hedge.gateway._server.CLOSE_GRACE", 0.2)
    limits = Limits(drain_timeout=0.2, request_timeout=None, write_timeout=None)
    async with FakeReplica(BIG, name="big") as big:
        gw = Gateway(config_for([big], limits=limits))
        with trio.fail_after(10):
            async with gw:
                stalled = await _stalled_client(_port(gw), {**CHAT, "stream": True})
                await big.wait_request(0)
            # serve() returned: drained, connections closed, pool closed
            await big.wait_disconnected(0)
        await stalled.aclose()


async def test_serve_cancelled_from_outside_returns_whatever_a_stalled_client_does() -> None:
    """Cancelled (not stopped), with a client stuck in a write and no deadline that would
    end it: ``serve`` closes every connection and returns (without that, hypercorn's
    shielded write held it forever)."""
    limits = Limits(request_timeout=None, write_timeout=None)
    async with FakeReplica(BIG, name="big") as big:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                start = functools.partial(serve, config_for([big], limits=limits))
                (url,) = await nursery.start(start)
                port = int(url.rsplit(":", 1)[1])
                stalled = await _stalled_client(port, {**CHAT, "stream": True})
                record = await big.wait_request(0)
                sent, quiet = -1, 0
                while quiet < 10:  # the upstream stopped: every buffer on the way is full
                    quiet = quiet + 1 if record.tokens_sent == sent else 0
                    sent = record.tokens_sent
                    await trio.sleep(0.02)
                nursery.cancel_scope.cancel()
            await big.wait_disconnected(0)
        await stalled.aclose()


# -- item 8: SIGTERM and idle keep-alive connections ------------------------------------------


async def _ask(stream: trio.SocketStream, request: bytes) -> bytes:
    """One HTTP/1.1 exchange on a kept-alive connection: the whole answer (Content-Length)."""
    await stream.send_all(request)
    got = b""
    while True:
        head, sep, body = got.partition(b"\r\n\r\n")
        if sep:
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(body) >= length:
                return got
        more = await stream.receive_some()
        if not more:
            raise EOFError(f"closed after {got!r}")
        got += more


READYZ = b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n"


async def test_a_request_on_an_idle_keep_alive_connection_during_the_drain_gets_503() -> None:
    """SIGTERM with a stream in flight: idle keep-alive connections stay open while it
    drains; a request sent on one is answered 503 ``shutdown`` with ``Connection: close``
    (then the connection closes), ``/readyz`` says ``draining`` on another, and the stream
    in flight finishes. On bcbad18 they were closed at once (a request met a closed
    connection)."""
    chat = json.dumps(CHAT).encode()
    post = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(chat)).encode() + b"\r\n\r\n" + chat
    )
    async with FakeReplica(PACED, name="a") as a:
        gw = Gateway(config_for([a], limits=Limits(drain_timeout=10)))
        async with gw:
            port = _port(gw)
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            probe = await trio.open_tcp_stream("127.0.0.1", port)
            async with idle, probe, H2.open(port) as h2c:
                with trio.fail_after(10):
                    assert (await _ask(idle, READYZ)).startswith(b"HTTP/1.1 200")
                    assert (await _ask(probe, READYZ)).startswith(b"HTTP/1.1 200")
                    async with trio.open_nursery() as clients:
                        second = await clients.start(_second_client, gw)
                        gw.stop.set()
                        ready = b""
                        while not ready.startswith(b"HTTP/1.1 503"):
                            ready = await _ask(probe, READYZ)  # the probe stays open too
                        answer = await _ask(idle, post)
                        assert await idle.receive_some() == b""  # then it closes
                        on_h2 = await h2c.request(
                            _headers(b"/v1/chat/completions", b"POST"), end=False
                        )
                        h2c.connection.send_data(on_h2, chat, end_stream=True)
                        await h2c.flush()
                        await h2c.until(h2c.ended(on_h2))
    assert json.loads(ready.partition(b"\r\n\r\n")[2])["status"] == "draining"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "shutdown"
    assert h2c.status(on_h2) == 503  # no Connection header in HTTP/2 (RFC 9113 §8.2.2)
    assert _served_whole(second)


# -- the settings ----------------------------------------------------------------------------------


def test_config_and_flags_carry_the_connection_settings() -> None:
    from trio_hedge.gateway import parse_config
    from trio_hedge.gateway._config import with_flags

    document = {
        "server": {"http2": False},
        "limits": {"write_timeout": 5},
        "replicas": [{"base_url": "http://127.0.0.1:9/v1"}],
    }
    config = parse_config(document)
    assert config.http2 is False and config.limits.write_timeout == 5
    assert GatewayConfig(config.replicas).http2 is True
    assert Limits().write_timeout == 30.0
    assert with_flags(None, replicas=["http://127.0.0.1:9/v1"], http2=False).http2 is False
    with pytest.raises(ValueError, match="write_timeout"):
        Limits(write_timeout=0)


@pytest.mark.parametrize(
    ("what", "request_head", "status"),
    [
        ("no route", b"POST /nope HTTP/1.1\r\nhost: x\r\n", b"404"),
        ("a refused key", b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n", b"401"),
    ],
)
async def test_an_answer_before_the_body_is_read_says_the_connection_closes(
    what: str, request_head: bytes, status: bytes
) -> None:
    """An answer sent before the request's body was read (a 404, a 401: nothing reads it)
    is followed by hypercorn closing the connection when the body has not come by the end
    of the answer: the answer says so (``Connection: close``), so no client sends its next
    request on it and loses it (on bcbad18 it did not: test_gateway_keys lost a request that
    way now and then). A request without a body keeps its connection."""
    async with FakeReplica(PACED, name="a") as a:
        async with Gateway(config_for([a], keys=("sk-gateway-key-0123456789",))) as gw:
            with trio.fail_after(10):
                early = await _exchange(_port(gw), request_head + b"content-length: 2\r\n\r\n")
                async with await trio.open_tcp_stream("127.0.0.1", _port(gw)) as stream:
                    ready = [await _ask(stream, READYZ), await _ask(stream, READYZ)]
    head = early.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 " + status) and b"\r\nconnection: close" in head
    assert all(r.startswith(b"HTTP/1.1 200") and b"connection: close" not in r for r in ready)
