"""make_client / ShardedTransport, and keep-alive after a stream read to [DONE]."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.errors import ErrorKind
from trio_hedge.testing import Behaviour, FakeReplica, fake_replicas
from trio_hedge.transport import ShardedTransport, make_client

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def _read(client: httpx.AsyncClient, replica: FakeReplica) -> str:
    async with th.hedged_stream(REQUEST, [th.Replica(replica.url)], client=client) as stream:
        return "".join([t async for t in stream])


async def test_connection_is_reused_after_done() -> None:
    """Closing at [DONE] reads the body's last chunk, so HTTP/1.1 keep-alive works."""
    async with FakeReplica(Behaviour(tokens=3)) as replica, httpx.AsyncClient() as client:
        for _ in range(3):
            assert await _read(client, replica) == "tok0 tok1 tok2 "
        assert replica.open_connections == 1
        assert len(replica.requests) == 3


async def test_make_client_adds_pools_and_counts_down() -> None:
    async with FakeReplica(Behaviour(tokens=2, token_delay=0.01)) as replica:
        async with make_client(per_shard=2) as client:
            transport = client._transport
            assert isinstance(transport, ShardedTransport)
            gate = trio.Event()
            opened = 0

            async def one() -> None:
                nonlocal opened
                pair = [th.Replica(replica.url)]
                async with th.hedged_stream(REQUEST, pair, client=client) as stream:
                    opened += 1
                    if opened == 7:
                        gate.set()
                    await gate.wait()
                    assert "".join([t async for t in stream]) == "tok0 tok1 "

            async with trio.open_nursery() as nursery:
                for _ in range(7):
                    nursery.start_soon(one)
            assert transport.shards == 4  # 7 open responses, at most 2 per pool
            assert transport.in_flight == 0
        with trio.fail_after(2):
            await replica.wait_connections(0)


async def test_make_client_http2_loser_is_reset() -> None:
    pytest.importorskip("h2")
    async with fake_replicas(Behaviour(ttft=30.0), Behaviour(tokens=3), http2=True) as (slow, fast):
        replicas = [th.Replica(slow.url, name="slow"), th.Replica(fast.url, name="fast")]
        async with make_client(http1=False, http2=True) as client:
            policy = th.HedgePolicy(hedge_after=0.01)
            async with th.hedged_stream(REQUEST, replicas, policy, client=client) as stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 tok2 "
            with trio.fail_after(2):
                record = await slow.wait_disconnected(0)
            assert record.http_version == "2"
            assert slow.open_connections == 1  # RST_STREAM, not a closed connection


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="per_shard"):
        ShardedTransport(0)
    with pytest.raises(TypeError, match="transport"):
        make_client(transport=httpx.AsyncHTTPTransport())


async def _burst(client: httpx.AsyncClient, replica: FakeReplica, n: int, *, read: bool) -> None:
    """``n`` streams open at once; each reads its answer to the end, or leaves after its
    first token (HTTP/1.1 then closes the connection)."""
    gate = trio.Event()
    opened = 0

    async def one() -> None:
        nonlocal opened
        async with th.hedged_stream(REQUEST, [th.Replica(replica.url)], client=client) as stream:
            opened += 1
            if opened == n:
                gate.set()
            await gate.wait()
            if read:
                assert "".join([t async for t in stream]) == "tok0 tok1 "
            else:
                await stream.__anext__()

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)


async def test_after_a_burst_low_load_reuses_one_connection_and_idle_pools_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Issue 16: pools were used in strict rotation and never removed, so after a burst each
    # request at low load went to another pool, whose connections were gone: 15 sequential
    # requests opened 15 connections. The oldest pool with room takes each request.
    async with FakeReplica(Behaviour(ttft=0.01, tokens=2, token_delay=0.01)) as replica:
        async with make_client() as client:
            transport = client._transport
            assert isinstance(transport, ShardedTransport)
            await _burst(client, replica, 80, read=False)  # high load: spread over pools
            assert transport.shards == 20  # 4 open responses per pool
            with trio.fail_after(2):
                await replica.wait_connections(0)  # every burst connection was closed
            for _ in range(15):
                assert await _read(client, replica) == "tok0 tok1 "
            assert replica.open_connections == 1  # one connection, reused 15 times
            assert len(replica.requests) == 80 + 15
            # A second burst read to its end leaves 4 idle connections in each of 20 pools.
            await _burst(client, replica, 80, read=True)
            assert (transport.shards, replica.open_connections) == (20, 80)
            # Idle for longer than keepalive_expiry (5 s): the next request removes every
            # pool but the first, closing their expired connections.
            await trio.sleep(5.0)
            assert await _read(client, replica) == "tok0 tok1 "
            assert transport.shards == 1
            with trio.fail_after(2):
                await replica.wait_connections(4)
            # High load spreads again, over new pools.
            await _burst(client, replica, 12, read=True)
            assert transport.shards == 3
        with trio.fail_after(2):
            await replica.wait_connections(0)


async def test_make_client_writes_a_request_head_and_body_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """httpcore 1.0.9 writes an HTTP/1.1 request's head and body in two writes (two
    segments, two wake-ups of the server before it can answer: TTFT, issue 20);
    make_client's HTTP/1.1 connections write them at once, a GET's head too, and every
    request is answered as before on the kept-alive connection. HTTP/2 writes are
    httpcore's own."""
    from httpcore._backends.trio import TrioStream

    writes: list[bytes] = []
    original = TrioStream.write

    async def recorded(self: TrioStream, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if buffer:
            writes.append(bytes(buffer))
        await original(self, buffer, timeout)

    monkeypatch.setattr(TrioStream, "write", recorded)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with FakeReplica(Behaviour(tokens=3)) as replica, make_client() as client:
        for _ in range(2):
            async with client.stream("POST", f"{replica.url}/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert b"tok2" in b"".join([chunk async for chunk in r.aiter_raw()])
        models = await client.get(f"{replica.url}/models")
        assert replica.open_connections == 1  # kept alive
    assert models.status_code == 200
    assert len(writes) == 3  # two POSTs and a GET, each in one write
    assert all(w.startswith((b"POST ", b"GET ")) for w in writes)
    head, _, sent = writes[0].partition(b"\r\n\r\n")
    assert json.loads(sent) == body and b"content-length: %d" % len(sent) in head.lower()


async def test_make_client_reads_tokens_without_httpcores_timeout_scope(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The token path: with no read timeout, make_client's reads skip httpcore 1.0.9's
    ``TrioStream.read`` (a ``fail_after(inf)`` and an exception-mapping context manager per
    read: ~10% of the gateway's CPU per relayed token, issue 20), and a cut mid-stream is
    still a truncated stream (httpcore's ``ReadError``, as before)."""
    from httpcore._backends.trio import TrioStream

    slow_reads = 0
    original = TrioStream.read

    async def counted(self: TrioStream, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        nonlocal slow_reads
        slow_reads += 1
        return await original(self, max_bytes, timeout)

    monkeypatch.setattr(TrioStream, "read", counted)
    behaviours = (Behaviour(tokens=50, token_delay=0.001), Behaviour(tokens=50, cut_after=5))
    async with fake_replicas(*behaviours) as (whole, cut), make_client() as client:
        assert await _read(client, whole) == "".join(f"tok{i} " for i in range(50))
        assert slow_reads == 0
        with pytest.raises(th.StreamInterrupted) as caught:
            await _read(client, cut)
        assert caught.value.error.kind is ErrorKind.STREAM_TRUNCATED
        assert caught.value.text == "tok0 tok1 tok2 tok3 tok4 "
        assert slow_reads == 0
    # With a read timeout, reads are httpcore's own (its ReadTimeout included).
    async with FakeReplica(Behaviour(tokens=3)) as replica, make_client(timeout=30.0) as client:
        assert await _read(client, replica) == "tok0 tok1 tok2 "
        assert slow_reads > 0
