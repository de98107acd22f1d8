"""HTTP/2 losers must stop for real.

httpcore 1.0.9 drops a cancelled HTTP/2 stream without RST_STREAM, so the server keeps
generating. The proofs below need no waiting: an HTTP/2 server handles a connection's frames
in order, so once a later request on the same connection has been answered, a RST_STREAM sent
before it has been seen — or was never sent."""

from __future__ import annotations

import functools

import httpx
import pytest
import trio

import trio_hedge as th
from trio_hedge.testing import Behaviour, FakeReplica, RequestRecord, fake_replicas

pytest.importorskip("h2")

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _h2_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(http1=False, http2=True)  # h2c with prior knowledge


async def _barrier(client: httpx.AsyncClient, replica: FakeReplica) -> None:
    response = await client.get(replica.base_url + "/health")
    assert response.http_version == "HTTP/2"


async def test_httpcore_alone_does_not_reset() -> None:
    """The failing case that motivates ``_reset_http2_stream``."""
    async with FakeReplica(Behaviour(ttft=30.0), name="slow", http2=True) as replica:
        async with _h2_client() as client:
            body = {**REQUEST, "stream": True}
            request = client.build_request("POST", replica.url + "/chat/completions", json=body)
            response = await client.send(request, stream=True)
            assert response.http_version == "HTTP/2"
            await response.aclose()  # what a cancelled loser does with plain httpx
            await _barrier(client, replica)
            record = replica.requests[0]
            assert record.disconnected_at is None  # the server never heard: it keeps going
            assert record.finished_at is None
        # Only closing the whole connection stops it.
        with trio.fail_after(2):
            await replica.wait_disconnected(0)


# Headers held back for 30 s: the primary is still "queued" when the backup commits.
HEADERS_LATE = Behaviour(status=503, error_delay=30.0)


async def test_httpcore_alone_does_not_reset_before_headers() -> None:
    """The failing case behind ``_reset_orphan_http2_streams``: a request cancelled while it
    waits for its response headers is forgotten by httpcore, not reset."""
    async with FakeReplica(HEADERS_LATE, name="queued", http2=True) as replica:
        async with _h2_client() as client:
            body = {**REQUEST, "stream": True}
            async with trio.open_nursery() as nursery:
                url = replica.url + "/chat/completions"
                nursery.start_soon(functools.partial(client.post, url, json=body))
                await replica.wait_request(0)  # the server has it and is "queueing" it
                nursery.cancel_scope.cancel()
            await _barrier(client, replica)
            assert replica.requests[0].disconnected_at is None  # still working for nobody
            assert replica.open_connections == 1


@pytest.mark.parametrize("make", [_h2_client, lambda: th.make_client(http1=False, http2=True)])
async def test_loser_cancelled_before_its_headers_is_reset(make: object) -> None:
    async with fake_replicas(HEADERS_LATE, Behaviour(ttft=0.05, tokens=3), http2=True) as (
        primary,
        backup,
    ):
        replicas = [th.Replica(primary.url, name="primary"), th.Replica(backup.url, name="b")]
        async with make() as client:  # type: ignore[operator]
            stream = th.hedged_stream(
                REQUEST, replicas, th.HedgePolicy(hedge_after=0.02), client=client
            )
            async with stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 tok2 "
            assert stream.report.winner == 2
            assert stream.report.attempts[0].outcome is th.AttemptOutcome.CANCELLED
            await _barrier(client, primary)
            record = primary.requests[0]
            assert record.status is None  # it never answered: cancelled before the headers
            assert record.disconnected_at is not None  # RST_STREAM reached the server
            assert primary.open_connections == 1  # and the connection lives on


async def test_hedged_loser_is_reset_and_the_connection_survives() -> None:
    async with fake_replicas(Behaviour(ttft=30.0), Behaviour(ttft=0.05, tokens=3), http2=True) as (
        primary,
        backup,
    ):
        replicas = [th.Replica(primary.url, name="primary"), th.Replica(backup.url, name="b")]
        async with _h2_client() as client:
            stream = th.hedged_stream(
                REQUEST, replicas, th.HedgePolicy(hedge_after=0.02), client=client
            )
            async with stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 tok2 "
            assert stream.report.winner == 2
            await _barrier(client, primary)
            record = primary.requests[0]
            assert record.http_version == "2"
            assert record.disconnected_at is not None  # RST_STREAM reached the server
            assert record.tokens_sent == 0
            # The connection itself was not torn down: other streams on it live on.
            assert primary.open_connections == 1


@pytest.mark.parametrize("make", [_h2_client, lambda: th.make_client(http1=False, http2=True)])
async def test_a_stream_the_server_resets_leaves_the_others_on_its_connection_alone(
    make: object,
) -> None:
    """The failing case: when the server reset one stream (RST_STREAM, here after its first
    token), our own reset of that stream raised h2's ``StreamClosedError`` and the fallback
    closed the whole connection, cutting every other request on it."""

    def behaviour(record: RequestRecord) -> Behaviour:
        if record.index == 1:  # the first chat request (0 is the barrier's /health)
            return Behaviour(ttft=0.05, tokens=8, cut_after=1)
        return Behaviour(token_delay=0.05, tokens=8)

    async with FakeReplica(behaviour, name="shared", http2=True) as server, make() as client:  # type: ignore[operator]
        await _barrier(client, server)
        replica = th.Replica(server.url)
        texts: list[str] = []
        interrupted: list[th.StreamInterrupted] = []

        async def one() -> None:
            stream = th.hedged_stream(
                REQUEST, [replica], th.HedgePolicy(hedge_after=None), client=client
            )
            try:
                async with stream:
                    texts.append("".join([t async for t in stream]))
            except th.StreamInterrupted as exc:
                interrupted.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
        assert [e.error.kind for e in interrupted] == [th.ErrorKind.STREAM_TRUNCATED]
        assert interrupted[0].text == "tok0 "
        assert texts == ["".join(f"tok{i} " for i in range(8))] * 3
        assert {r.http_version for r in server.requests} == {"2"}
        assert server.open_connections == 1  # one connection carried them all, and lives on
        await _barrier(client, server)
        assert server.open_connections == 1
