"""The gateway's token path (issue 20): what one read of the winner brought goes out in one
write, byte for byte, over real loopback sockets."""

from __future__ import annotations

import json

import trio

import trio_hedge as th
from trio_hedge.gateway import GatewayConfig, Group

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


async def _burst_server(listener: trio.SocketListener) -> None:
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
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(body) < length:
                    body += await stream.receive_some()
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(BODY), BODY)
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


async def test_a_reads_events_go_out_in_one_write_byte_for_byte() -> None:
    """The upstream sends all its events in one write: the gateway relays them in one
    ``send`` (one HTTP chunk), then ``[DONE]``; the bytes are the server's own, in order."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_burst_server, listener)
        replica = th.Replica(f"http://127.0.0.1:{port}/v1", name="burst")
        config = GatewayConfig([replica], [Group("default", ["burst"], hedger=HEDGER)], port=0)
        async with Gateway(config) as gw:
            host, gw_port = gw.base_url.split("//")[1].split(":")
            payload = json.dumps({**CHAT, "stream": True}).encode()
            with trio.fail_after(10):
                stream = await trio.open_tcp_stream(host, int(gw_port))
                async with stream:
                    await stream.send_all(
                        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                        b"content-type: application/json\r\nconnection: close\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
                    )
                    raw = b""
                    while chunk := await stream.receive_some():
                        raw += chunk
        nursery.cancel_scope.cancel()
    head, chunks = _chunks(raw)
    assert head.startswith(b"HTTP/1.1 200")
    assert b"".join(chunks) == BODY  # byte for byte, [DONE] the gateway's own
    assert chunks == [BODY.removesuffix(b"data: [DONE]\n\n"), b"data: [DONE]\n\n"]
