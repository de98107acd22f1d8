"""The fake replicas of ``trio_hedge.testing``, exercised with plain httpx.

Real-socket tests use small delays and assert ordering, not wall times (a shared CI machine is
noisy); exact times are checked with ``MockReplicas`` under the autojump ``MockClock``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from trio_hedge.testing import (
    Behaviour,
    FakeReplica,
    MockReplicas,
    RequestRecord,
    fake_replicas,
    render_response,
)

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hello there"}]}


def events(raw: bytes) -> list[bytes]:
    """The SSE events in ``raw`` (data and comments), without the blank-line separators."""
    return [event for event in raw.split(b"\n\n") if event]


def data_payloads(pieces: list[bytes]) -> list[Any]:
    """The JSON (or ``"[DONE]"``) of every data event, in order; comments are skipped."""
    out: list[Any] = []
    for event in events(b"".join(pieces)):
        if event.startswith(b"data: "):
            body = event[len(b"data: ") :]
            out.append("[DONE]" if body == b"[DONE]" else json.loads(body))
    return out


def content_of(payloads: list[Any]) -> list[str]:
    return [
        p["choices"][0]["delta"]["content"]
        for p in payloads
        if isinstance(p, dict) and p["choices"] and "content" in p["choices"][0]["delta"]
    ]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5) as c:
        yield c


# --------------------------------------------------------------------------------------------
# Behaviour and RequestRecord


def test_behaviour_validation() -> None:
    for bad in (
        {"ttft": -1},
        {"token_delay": -0.1},
        {"error_delay": float("nan")},
        {"tokens": -1},
        {"status": 99},
        {"status": 600},
        {"retry_after": -1},
        {"stall_after": -1},
        {"cut_after": -2},
        {"keepalive_interval": 0},
        {"stall_after": 1, "cut_after": 1},
    ):
        with pytest.raises(ValueError):
            Behaviour(**bad)


def test_behaviour_tokens() -> None:
    assert Behaviour(tokens=3).token_texts == ("tok0 ", "tok1 ", "tok2 ")
    words = Behaviour(tokens="Hello  brave\nworld").token_texts
    assert words == ("Hello  ", "brave\n", "world")
    assert "".join(words) == "Hello  brave\nworld"
    assert Behaviour(tokens=["a", "b"]).tokens == ("a", "b")
    assert Behaviour(tokens="").token_texts == ()


def test_record_repr_redacts_credentials() -> None:
    record = RequestRecord(
        index=0,
        received_at=0.0,
        method="POST",
        path="/v1/chat/completions",
        headers={"authorization": "Bearer sk-secret", "x-api-key": "k1", "api-key": "k2"},
    )
    text = repr(record)
    assert "sk-secret" not in text and "k1" not in text and "k2" not in text
    assert text.count("<redacted>") == 3
    assert record.headers["authorization"] == "Bearer sk-secret"  # stored, only hidden


def test_render_stall_and_cut_positions() -> None:
    def steps(**knobs: Any) -> list[str]:
        record = RequestRecord(index=0, received_at=0, method="POST", path="/v1/chat/completions")
        record.json = {"stream": True}
        return [type(s).__name__ for s in render_response(record, Behaviour(**knobs))]

    # Headers and the role chunk first; the cut comes when the next token was due.
    assert steps(tokens=2, ttft=1, cut_after=1) == ["Head", "Chunk", "Wait", "Chunk", "Cut"]
    assert steps(tokens=2, ttft=1, cut_after=0) == ["Head", "Chunk", "Wait", "Cut"]
    assert steps(tokens=2, ttft=1, stall_after=0) == ["Head", "Chunk", "Stall"]


# --------------------------------------------------------------------------------------------
# FakeReplica over real loopback sockets


async def test_headers_come_before_the_first_token(client: httpx.AsyncClient) -> None:
    # The one test that waits a noticeable real time (0.2 s): headers must not wait for it.
    async with (
        FakeReplica(Behaviour(ttft=0.2, tokens=2)) as replica,
        client.stream("POST", f"{replica.url}/chat/completions", json=CHAT) as resp,
    ):
        record = replica.requests[0]
        # The headers (and the role-only chunk) are here while the first token is not.
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream"
        assert record.first_token_at is None
        pieces = [piece async for piece in resp.aiter_raw()]
    role = data_payloads(pieces[:1])[0]
    assert role["choices"][0]["delta"] == {"role": "assistant"}
    assert record.first_token_at is not None
    assert record.first_token_at - record.received_at >= 0.2
    assert record.completed and record.disconnected_at is None
    assert record.http_version == "1.1"


async def test_one_event_per_chunk_and_full_stream(client: httpx.AsyncClient) -> None:
    behaviour = Behaviour(token_delay=0.005, tokens=("Hello", " world"))
    async with (
        FakeReplica(behaviour, name="primary") as replica,
        client.stream("POST", f"{replica.url}/chat/completions", json=CHAT) as resp,
    ):
        pieces = [piece async for piece in resp.aiter_raw()]
    # One HTTP chunk per SSE event, as LLM servers flush them.
    assert all(len(events(piece)) == 1 and piece.endswith(b"\n\n") for piece in pieces)
    payloads = data_payloads(pieces)
    assert content_of(payloads) == ["Hello", " world"]
    assert payloads[-3]["choices"][0]["finish_reason"] == "stop"
    assert payloads[-2]["choices"] == []
    assert payloads[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert payloads[-1] == "[DONE]"
    assert payloads[0]["model"] == "m"
    assert payloads[0]["id"] == "chatcmpl-primary-0"
    record = replica.requests[0]
    assert record.tokens_sent == 2 and record.completed and record.json == CHAT
    assert record.token_times == sorted(record.token_times)


async def test_error_status_with_retry_after(client: httpx.AsyncClient) -> None:
    behaviour = Behaviour(status=429, retry_after=2, error_message="slow down")
    async with FakeReplica(behaviour) as replica:
        resp = await client.post(f"{replica.url}/chat/completions", json=CHAT)
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "2"
    assert resp.json()["error"]["message"] == "slow down"
    assert resp.json()["error"]["code"] == "rate_limit_exceeded"
    assert replica.requests[0].status == 429 and replica.requests[0].completed


async def test_non_stream_health_models_and_404(client: httpx.AsyncClient) -> None:
    async with FakeReplica(Behaviour(tokens="the answer")) as replica:
        whole = await client.post(f"{replica.url}/chat/completions", json={"messages": []})
        health = await client.get(f"{replica.base_url}/health")
        models = await client.get(f"{replica.url}/models")
        missing = await client.get(f"{replica.url}/nope")
        wrong = await client.get(f"{replica.url}/chat/completions")
    assert whole.headers["content-type"] == "application/json"
    answer = whole.json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == "the answer"
    assert health.json() == {"status": "ok"}
    assert models.json()["data"][0]["id"] == "fake-model"
    assert (missing.status_code, wrong.status_code) == (404, 405)
    assert [r.path for r in replica.requests][1:3] == ["/health", "/v1/models"]


async def test_cut_after_truncates_the_stream(client: httpx.AsyncClient) -> None:
    async with FakeReplica(Behaviour(tokens=5, cut_after=2)) as replica:
        pieces: list[bytes] = []
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", f"{replica.url}/chat/completions", json=CHAT) as r:
                async for piece in r.aiter_raw():
                    pieces.append(piece)
        with trio.fail_after(1):
            await replica.wait_connections(0)
    assert content_of(data_payloads(pieces)) == ["tok0 ", "tok1 "]
    record = replica.requests[0]
    assert record.tokens_sent == 2
    assert not record.completed and record.disconnected_at is None


async def test_stall_with_keepalives_then_disconnect(client: httpx.AsyncClient) -> None:
    behaviour = Behaviour(tokens=3, stall_after=1, keepalive_interval=0.01)
    async with FakeReplica(behaviour) as replica:
        pieces: list[bytes] = []
        async with client.stream("POST", f"{replica.url}/chat/completions", json=CHAT) as resp:
            async for piece in resp.aiter_raw():
                pieces.append(piece)
                if pieces.count(b": keep-alive\n\n") == 3:
                    break
        record = await replica.wait_disconnected(0)
    assert content_of(data_payloads(pieces)) == ["tok0 "]
    assert record.tokens_sent == 1 and not record.completed


@pytest.mark.parametrize("while_", ["ttft", "between_tokens"])
async def test_client_close_is_recorded_within_50ms(client: httpx.AsyncClient, while_: str) -> None:
    # The replica waits 10 s (first token or next token); the close must end it at once.
    behaviour = Behaviour(tokens=3, ttft=10) if while_ == "ttft" else Behaviour(token_delay=10)
    async with FakeReplica(behaviour) as replica:
        async with client.stream("POST", f"{replica.url}/chat/completions", json=CHAT) as resp:
            if while_ == "between_tokens":
                async for piece in resp.aiter_raw():
                    if b"tok0" in piece:
                        break
            closed_at = trio.current_time()
        with trio.fail_after(1):
            record = await replica.wait_disconnected(0)
        with trio.fail_after(1):
            await replica.wait_connections(0)
    assert record.disconnected_at is not None
    assert record.disconnected_at - closed_at < 0.05
    assert record.finished_at == record.disconnected_at and not record.completed


async def test_per_request_behaviour(client: httpx.AsyncClient) -> None:
    def choose(record: RequestRecord) -> Behaviour:
        if record.headers.get("x-scenario") == "overloaded":
            return Behaviour(status=503)
        return Behaviour(tokens=1 + record.index)

    async with FakeReplica(choose) as replica:
        first = await client.post(f"{replica.url}/chat/completions", json={"messages": []})
        second = await client.post(
            f"{replica.url}/chat/completions", json={}, headers={"x-scenario": "overloaded"}
        )
        third = await client.post(f"{replica.url}/chat/completions", json={})
    assert first.json()["choices"][0]["message"]["content"] == "tok0 "
    assert second.status_code == 503
    assert third.json()["usage"]["completion_tokens"] == 3
    assert [r.status for r in replica.requests] == [200, 503, 200]


async def test_body_exception_is_not_wrapped() -> None:
    with pytest.raises(AssertionError, match="from the body") as info:
        async with FakeReplica() as replica:
            assert replica.port > 0
            raise AssertionError("from the body")
    assert type(info.value) is AssertionError

    with pytest.raises(KeyError):
        async with fake_replicas(Behaviour(), Behaviour()):
            raise KeyError("several")


async def test_fake_replicas_and_connection_count(client: httpx.AsyncClient) -> None:
    async with fake_replicas(
        Behaviour(ttft=10), Behaviour(tokens=2), names=["primary", "backup"]
    ) as [primary, backup]:
        assert primary.url != backup.url
        assert (primary.name, backup.name) == ("primary", "backup")
        resp = await client.post(f"{backup.url}/chat/completions", json={})
        assert resp.json()["choices"][0]["message"]["content"] == "tok0 tok1 "
        assert backup.open_connections == 1  # kept alive by the pool
        await client.aclose()
        with trio.fail_after(1):
            await backup.wait_connections(0)
        assert primary.requests == []
    with pytest.raises(RuntimeError):
        _ = primary.url  # not running any more


# --------------------------------------------------------------------------------------------
# HTTP/2


@pytest.mark.parametrize("how", ["cancel", "aclose"])
async def test_http2_cancelled_stream_is_not_reset_by_httpcore(how: str) -> None:
    """The problem the library must solve: httpcore 1.0.9 drops a cancelled (or closed)
    HTTP/2 stream without RST_STREAM, so the server keeps generating until the whole
    connection closes. (Over HTTP/1.1 the same cancel closes the socket: see above.)"""
    async with FakeReplica(Behaviour(tokens=3, stall_after=1), http2=True) as replica:
        async with httpx.AsyncClient(http1=False, http2=True, timeout=5) as h2_client:
            url = f"{replica.url}/chat/completions"
            with trio.CancelScope() as scope:
                async with h2_client.stream("POST", url, json=CHAT) as resp:
                    assert resp.http_version == "HTTP/2"
                    async for piece in resp.aiter_raw():
                        if b"tok0" in piece:
                            if how == "aclose":
                                break
                            scope.cancel()  # as when a hedge loses the race
            assert scope.cancelled_caught == (how == "cancel")
            # A later request on the same connection completes: the server has read every
            # frame sent before it, so an RST_STREAM would have been seen by now.
            await h2_client.get(f"{replica.url}/models")
            assert replica.open_connections == 1
            assert replica.requests[1].http_version == "2"
            assert replica.requests[0].disconnected_at is None
            assert not replica.requests[0].finished  # still "generating"
        # Closing the client closes the connection: only now does the server see it.
        with trio.fail_after(1):
            record = await replica.wait_disconnected(0)
    assert record.tokens_sent == 1


async def test_http2_rst_stream_is_recorded() -> None:
    """A client that does reset the stream is seen at once (a raw h2 client, no httpcore)."""
    import h2.config
    import h2.connection
    import h2.errors
    import h2.events

    async with FakeReplica(Behaviour(ttft=10), http2=True) as replica:
        stream = await trio.open_tcp_stream("127.0.0.1", replica.port)
        async with stream:
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            body = json.dumps(CHAT).encode()
            conn.send_headers(
                1,
                [
                    (":method", "POST"),
                    (":path", "/v1/chat/completions"),
                    (":scheme", "http"),
                    (":authority", f"127.0.0.1:{replica.port}"),
                    ("authorization", "Bearer sk-secret"),
                ],
            )
            conn.send_data(1, body, end_stream=True)
            await stream.send_all(conn.data_to_send())
            got_headers = False
            with trio.fail_after(2):
                while not got_headers:
                    for event in conn.receive_data(await stream.receive_some()):
                        got_headers |= isinstance(event, h2.events.ResponseReceived)
                    await stream.send_all(conn.data_to_send())
            conn.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
            await stream.send_all(conn.data_to_send())
            reset_at = trio.current_time()
            with trio.fail_after(1):
                record = await replica.wait_disconnected(0)
            assert replica.open_connections == 1  # the connection itself lives on
    assert record.disconnected_at is not None and record.disconnected_at - reset_at < 0.05
    assert record.headers["authorization"] == "Bearer sk-secret"
    assert "sk-secret" not in repr(record)
    assert record.json == CHAT


async def test_http2_cut_resets_the_stream() -> None:
    async with (
        FakeReplica(Behaviour(tokens=3, cut_after=1), http2=True) as replica,
        httpx.AsyncClient(http1=False, http2=True, timeout=5) as h2_client,
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            async with h2_client.stream(
                "POST", f"{replica.url}/chat/completions", json=CHAT
            ) as resp:
                async for _ in resp.aiter_raw():
                    pass
    assert replica.requests[0].tokens_sent == 1 and not replica.requests[0].completed


# --------------------------------------------------------------------------------------------
# MockReplicas: exact virtual time


async def test_mock_exact_token_times(autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas({"primary": Behaviour(ttft=5, token_delay=0.25, tokens=3)})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        t0 = trio.current_time()
        arrivals: list[tuple[float, bytes]] = []
        async with client.stream(
            "POST", f"{mock.url('primary')}/chat/completions", json=CHAT
        ) as resp:
            headers_at = trio.current_time()
            async for piece in resp.aiter_raw():
                arrivals.append((trio.current_time(), piece))
    assert mock.url("primary") == "http://primary.test/v1"
    assert headers_at == t0
    assert all(len(events(piece)) == 1 for _, piece in arrivals)
    token_times = [at for at, piece in arrivals if b'"content"' in piece]
    assert token_times == [t0 + 5, t0 + 5.25, t0 + 5.5]
    record = mock.requests["primary"][0]
    assert record.received_at == t0
    assert record.first_token_at == t0 + 5
    assert record.token_times == [t0 + 5, t0 + 5.25, t0 + 5.5]
    assert record.completed and record.finished_at == t0 + 5.5
    assert record.disconnected_at is None


async def test_mock_disconnect_at_exact_time(autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas({"primary": Behaviour(ttft=5), "backup": Behaviour(ttft=0.5)})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        t0 = trio.current_time()
        with trio.move_on_after(2):  # the client gives up on the primary after 2 s
            async with client.stream(
                "POST", f"{mock.url('primary')}/chat/completions", json=CHAT
            ) as resp:
                async for _ in resp.aiter_raw():
                    pass
        # The backup's error answer never sends headers before the client leaves.
        mock.behaviours["backup"] = Behaviour(status=503, error_delay=4)
        with trio.move_on_after(1):
            await client.post(f"{mock.url('backup')}/chat/completions", json=CHAT)
    primary = mock.requests["primary"][0]
    assert primary.disconnected_at == t0 + 2 and primary.tokens_sent == 0
    assert not primary.completed
    backup = mock.requests["backup"][0]
    assert backup.disconnected_at == t0 + 3 and backup.status is None


async def test_mock_cut_error_and_unknown_host(autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas(
        {
            "cut": Behaviour(ttft=1, tokens=4, cut_after=2),
            "limited": Behaviour(status=429, retry_after=0.5, error_delay=0.25),
        }
    )
    async with httpx.AsyncClient(transport=mock.transport) as client:
        pieces: list[bytes] = []
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream(
                "POST", f"{mock.url('cut')}/chat/completions", json=CHAT
            ) as resp:
                async for piece in resp.aiter_raw():
                    pieces.append(piece)
        t0 = trio.current_time()
        limited = await client.post(f"{mock.url('limited')}/chat/completions", json=CHAT)
        assert trio.current_time() == t0 + 0.25
        with pytest.raises(httpx.ConnectError):
            await client.get("http://elsewhere.test/health")
    assert content_of(data_payloads(pieces)) == ["tok0 ", "tok1 "]
    cut = mock.requests["cut"][0]
    assert cut.tokens_sent == 2 and not cut.completed and cut.disconnected_at is None
    assert limited.status_code == 429 and limited.headers["retry-after"] == "0.5"


async def test_mock_stall_keepalives_and_non_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"r": Behaviour(ttft=1, token_delay=0.5, tokens=4, stall_after=0)})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        mock.behaviours["r"] = Behaviour(tokens=2, stall_after=0, keepalive_interval=15)
        t0 = trio.current_time()
        times: list[float] = []
        async with client.stream("POST", f"{mock.url('r')}/chat/completions", json=CHAT) as resp:
            async for piece in resp.aiter_raw():
                if piece == b": keep-alive\n\n":
                    times.append(trio.current_time() - t0)
                if len(times) == 2:
                    break
        assert times == [15, 30]
        await mock.wait_disconnected("r", 0)

        mock.behaviours["r"] = Behaviour(ttft=1, token_delay=0.5, tokens=4)
        t1 = trio.current_time()
        whole = await client.post(f"{mock.url('r')}/chat/completions", json={"messages": []})
        # A non-stream answer comes when the last token is due: 1 + 3 * 0.5 s.
        assert trio.current_time() == t1 + 2.5
    assert whole.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 "
    assert mock.requests["r"][1].completed


async def test_mock_reasoning_and_tool_calls(autojump_clock: trio.testing.MockClock) -> None:
    from trio_hedge.sources.openai import ChunkDecoder, decode_json_body, merge_tool_calls

    behaviour = Behaviour(
        ttft=1,
        token_delay=0.5,
        tokens=1,
        reasoning=2,
        tool_calls=[("get_weather", '{"city": "Paris"}')],
        finish_reason="tool_calls",
    )
    mock = MockReplicas({"a": behaviour})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        t0 = trio.current_time()
        times: list[float] = []
        decoder = ChunkDecoder()
        deltas = []
        url = f"{mock.url('a')}/chat/completions"
        async with client.stream("POST", url, json=CHAT) as resp:
            async for piece in resp.aiter_raw():
                batch = decoder.feed(piece)
                times += [trio.current_time() - t0 for d in batch if d.has_output]
                deltas += batch
        whole = await client.post(url, json={**CHAT, "stream": False})
    assert [d.reasoning for d in deltas if d.reasoning] == ["think0 ", "think1 "]
    assert [d.content for d in deltas if d.content] == ["tok0 "]
    # reasoning at ttft, then every output chunk token_delay apart: 2 + 1 + 3 fragments.
    assert times == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    calls = merge_tool_calls(deltas)
    assert calls == [
        {
            "id": "call_0",
            "type": "function",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        }
    ]
    assert decoder.finish_reason == "tool_calls"
    (message,) = decode_json_body(200, {}, whole.content)
    assert (message.content, message.reasoning) == ("tok0 ", "think0 think1 ")
    assert merge_tool_calls([message]) == calls


async def test_fake_replica_listens_where_asked() -> None:
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free now that the probe closes
    async with FakeReplica(port=port) as replica:
        assert replica.port == port and replica.url == f"http://127.0.0.1:{port}/v1"
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{replica.base_url}/health")).json() == {"status": "ok"}
    with pytest.raises(TypeError):
        Behaviour(tool_calls=[("only a name",)])
