"""A Hedger (and hedged_stream) racing users' own AsyncOpenAI clients: SDKReplica, bound to
each request's create() keyword arguments as a Replica is bound to its JSON body.

Exact timing runs in virtual time: the SDK's httpx2 client is given a transport that hands
each request to the in-process ``MockReplicas`` (``_Bridge``); what needs real sockets (the
SDK's own transport, its retries, a disconnect seen by a server) runs over loopback against
``FakeReplica`` s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")

import trio_hedge as th  # noqa: E402
from trio_hedge.errors import ErrorKind  # noqa: E402
from trio_hedge.policy import estimate_prompt_tokens  # noqa: E402
from trio_hedge.sources.openai_sdk import SDKReplica, sdk_replicas  # noqa: E402
from trio_hedge.testing import Behaviour, MockReplicas, fake_replicas  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]
REQUEST = {"model": "m", "messages": MESSAGES}
KEY = "sk-test-secret-0123456789"
CHAT = "/v1/chat/completions"


class _Body(httpx2.AsyncByteStream):  # type: ignore[misc]
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __aiter__(self) -> Any:
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        await self._stream.aclose()  # the mock records the disconnect


class _Bridge(httpx2.AsyncBaseTransport):  # type: ignore[misc]
    """An httpx2 transport (the SDK's client) over ``MockReplicas``' httpx transport."""

    def __init__(self, mock: MockReplicas) -> None:
        self._transport = mock.transport

    async def handle_async_request(self, request: Any) -> Any:
        content = await request.aread()
        response = await self._transport.handle_async_request(
            httpx.Request(
                request.method, str(request.url), headers=request.headers.raw, content=content
            )
        )
        return httpx2.Response(
            response.status_code, headers=response.headers.raw, stream=_Body(response.stream)
        )


async def _clients(mock: MockReplicas, *names: str) -> dict[str, Any]:
    """One AsyncOpenAI client per mock replica. Each is warmed by one call: the SDK's first
    call on a client asks for the platform in a worker thread, and a thread's real time
    would let the autojump clock run on."""
    http = httpx2.AsyncClient(transport=_Bridge(mock))
    clients = {}
    for name in names:
        client = openai.AsyncOpenAI(
            base_url=mock.url(name), api_key=KEY, http_client=http, max_retries=0
        )
        await client.models.list()
        clients[name] = client
    return clients


def _chats(mock: MockReplicas, name: str) -> list[Any]:
    return [r for r in mock.requests[name] if r.path == CHAT]


@pytest.fixture
def no_http_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The front doors must not make an httpx client for SDK replicas."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an httpx client was made for SDK replicas")

    monkeypatch.setattr("trio_hedge.hedger.make_client", refuse)
    monkeypatch.setattr("trio_hedge._oneshot.make_client", refuse)
    yield


# -- the Hedger over SDK clients, in virtual time ------------------------------------------------


async def test_slow_primary_the_backup_wins_after_the_hedge_delay(
    autojump_clock: trio.testing.MockClock, no_http_client: None
) -> None:
    mock = MockReplicas({"p": Behaviour(ttft=5.0), "b": Behaviour(ttft=0.5, tokens=3)})
    clients = await _clients(mock, "p", "b")
    replicas = sdk_replicas(clients, overrides={"b": {"model": "small"}})
    config = th.HedgerConfig(hedge_after=1.0, pick="in_order")
    async with th.Hedger(replicas, config) as hedger:
        t0 = trio.current_time()
        async with hedger.stream(REQUEST) as stream:
            text = "".join([t async for t in stream])
        stats = hedger.statistics()
    report = stream.report
    assert text == "tok0 tok1 tok2 "
    assert [a.started_at for a in report.attempts] == [0.0, 1.0]
    assert [a.trigger for a in report.attempts] == ["primary", "hedge"]
    assert report.ttft == 1.5 and report.winner_replica == "b" and report.hedged
    (loser,) = _chats(mock, "p")
    assert loser.disconnected_at == t0 + 1.5  # closed at the commit, to the tick
    assert loser.json["model"] == "m" and _chats(mock, "b")[0].json["model"] == "small"
    assert (stats.requests, stats.finished, stats.attempts) == (1, 1, 2)
    assert (stats.hedges_sent, stats.backup_wins, stats.failed) == (1, 1, 0)
    by_name = {r.name: r for r in stats.replicas}
    assert (by_name["p"].attempts, by_name["p"].wins) == (1, 0)
    assert (by_name["b"].attempts, by_name["b"].wins) == (1, 1)


FAILOVERS = [
    (Behaviour(status=503, retry_after=3), ErrorKind.OVERLOADED, 3.0),
    (Behaviour(status=429, retry_after=2), ErrorKind.RATE_LIMIT, 2.0),
]


@pytest.mark.parametrize(
    ("primary", "kind", "cooling"), FAILOVERS, ids=[k.value for _, k, _ in FAILOVERS]
)
async def test_pushback_fails_over_at_once_and_cools_the_replica(
    primary: Behaviour,
    kind: ErrorKind,
    cooling: float,
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"p": primary, "b": Behaviour(ttft=0.25, tokens=2)})
    clients = await _clients(mock, "p", "b")
    config = th.HedgerConfig(hedge_after=1.0, pick="in_order")
    async with th.Hedger(sdk_replicas(clients), config) as hedger:
        async with hedger.stream(REQUEST) as first:
            assert "".join([t async for t in first]) == "tok0 tok1 "
        cooling_for = {r.name: r.cooling_for for r in hedger.statistics().replicas}
        # While "p" cools, the next request goes straight to "b".
        async with hedger.stream(REQUEST) as second:
            assert "".join([t async for t in second]) == "tok0 tok1 "
        stats = hedger.statistics()
    attempts = first.report.attempts
    assert [(a.replica, a.trigger, a.started_at) for a in attempts] == [
        ("p", "primary", 0.0),
        ("b", "failover", 0.0),  # at once, not after the hedge delay
    ]
    assert attempts[0].error is not None and attempts[0].error.kind is kind
    assert attempts[0].error.retry_after == cooling
    assert cooling_for["p"] == pytest.approx(cooling - 0.25)  # read at the end of request 1
    assert [a.replica for a in second.report.attempts] == ["b"]
    assert len(_chats(mock, "p")) == 1 and len(_chats(mock, "b")) == 2
    assert (stats.failovers, stats.hedges_sent, stats.failed) == (1, 0, 0)


async def test_a_request_the_server_refuses_is_not_sent_to_the_backup(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"p": Behaviour(status=400), "b": Behaviour()})
    clients = await _clients(mock, "p", "b")
    async with th.Hedger(sdk_replicas(clients), th.HedgerConfig(pick="in_order")) as hedger:
        with pytest.raises(th.FatalAttemptError) as info:
            async with hedger.stream(REQUEST):
                pass
    assert info.value.error.kind is ErrorKind.INVALID_REQUEST
    assert len(_chats(mock, "b")) == 0


async def test_prompt_size_is_estimated_from_the_kwargs_as_from_a_body(
    autojump_clock: trio.testing.MockClock, no_http_client: None
) -> None:
    long = "word " * 400
    part = {"type": "text", "text": long}
    body = {"model": "m", "messages": [{"role": "user", "content": [part]}]}
    # The SDK takes any sequence; a tuple of messages (and of content parts) counts the same.
    kwargs = {
        "model": "m",
        "messages": ({"role": "user", "content": (part,)},),
    }
    expected = estimate_prompt_tokens(body)
    assert expected == 504
    mock = MockReplicas({"p": Behaviour(tokens=1)})
    clients = await _clients(mock, "p")
    async with th.Hedger(sdk_replicas(clients)) as hedger:
        async with hedger.stream(kwargs) as stream:
            [t async for t in stream]
    assert stream.report.prompt_tokens == expected
    assert _chats(mock, "p")[0].json["messages"][0]["content"][0]["text"] == long


async def test_per_request_headers_reach_the_sdk_replica_but_not_over_its_key(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"p": Behaviour(tokens=1)})
    clients = await _clients(mock, "p")
    async with th.Hedger(sdk_replicas(clients)) as hedger:
        request = {**REQUEST, "extra_headers": {"X-Own": "1"}}
        headers = {"X-Tenant": "t1", "Authorization": "Bearer sk-other-0123456789"}
        async with hedger.stream(request, headers=headers) as stream:
            [t async for t in stream]
    sent = _chats(mock, "p")[0].headers
    assert sent["x-own"] == "1" and sent["x-tenant"] == "t1"
    assert sent["x-request-id"] == stream.request_id and sent["x-hedge-attempt"] == "1"
    assert sent["authorization"] == f"Bearer {KEY}"


async def test_hedged_stream_takes_sdk_replicas_too(
    autojump_clock: trio.testing.MockClock, no_http_client: None
) -> None:
    mock = MockReplicas({"p": Behaviour(ttft=5.0), "b": Behaviour(ttft=0.5, tokens=2)})
    clients = await _clients(mock, "p", "b")
    policy = th.HedgePolicy(hedge_after=1.0)
    async with th.hedged_stream(REQUEST, sdk_replicas(clients), policy) as stream:
        assert "".join([t async for t in stream]) == "tok0 tok1 "
    assert [a.started_at for a in stream.report.attempts] == [0.0, 1.0]
    assert stream.report.winner_replica == "b"


async def test_one_hedger_mixes_http_and_sdk_replicas(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"p": Behaviour(ttft=5.0), "b": Behaviour(ttft=0.5, tokens=2)})
    (sdk,) = sdk_replicas(await _clients(mock, "p"))
    http = th.Replica(mock.url("b"), name="b")
    async with httpx.AsyncClient(transport=mock.transport) as client:
        config = th.HedgerConfig(hedge_after=1.0, pick="in_order")
        async with th.Hedger([sdk, http], config, client=client) as hedger:
            async with hedger.stream(REQUEST) as stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 "
            # A request must suit both kinds: strict JSON for the HTTP replica ...
            with pytest.raises(ValueError, match="request"):
                hedger.stream({**REQUEST, "temperature": float("nan")})
            # ... and create() arguments for the SDK one.
            with pytest.raises(TypeError, match="top_k"):
                hedger.stream({**REQUEST, "top_k": 5})
    assert [a.replica for a in stream.report.attempts] == ["p", "b"]
    assert _chats(mock, "b")[0].json == {**REQUEST, "stream": True}


# -- bad requests fail fast, before any I/O -------------------------------------------------------

BAD_REQUESTS = [
    (None, TypeError, "not None"),
    ([("model", "m")], TypeError, "keyword arguments"),
    ({"messages": MESSAGES}, ValueError, "'model'"),
    ({"model": "m"}, ValueError, "'messages'"),
    ({**REQUEST, "stream": False}, ValueError, "stream=False"),
    ({**REQUEST, "top_k": 5}, TypeError, r"does not take: \['top_k'\]"),
    ({"model": "m", "messages": iter(MESSAGES)}, TypeError, "list or tuple"),
]


@pytest.mark.parametrize(("request_", "error", "match"), BAD_REQUESTS)
async def test_a_bad_request_fails_fast(
    request_: Any, error: type[Exception], match: str, autojump_clock: trio.testing.MockClock
) -> None:
    mock = MockReplicas({"p": Behaviour()})
    clients = await _clients(mock, "p")
    async with th.Hedger(sdk_replicas(clients)) as hedger:
        with pytest.raises(error, match=match):
            hedger.stream(request_)
        with pytest.raises(error, match=match):
            th.hedged_stream(request_, sdk_replicas(clients))
        assert hedger.statistics().requests == 0
    assert _chats(mock, "p") == []


def test_bad_replicas_are_refused_at_construction() -> None:
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key=KEY)
    with pytest.raises(TypeError, match="sync client"):
        SDKReplica(openai.OpenAI(api_key=KEY))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stream=False"):
        SDKReplica(client, overrides={"stream": False})
    with pytest.raises(TypeError, match="top_k"):
        SDKReplica(client, overrides={"top_k": 5})
    with pytest.raises(ValueError, match="unknown replicas"):
        sdk_replicas({"a": client}, overrides={"b": {}})
    with pytest.raises(ValueError, match="unique"):
        th.Hedger(sdk_replicas([client, client]))
    (replica,) = sdk_replicas([client])
    assert replica.name == "127.0.0.1:9" and KEY not in repr(replica)
    assert repr(replica) == "SDKReplica(name='127.0.0.1:9')"


# -- over real sockets: the SDK's own transport, retries and disconnects -----------------------


async def test_over_loopback_the_loser_is_closed_and_the_sdk_does_not_retry() -> None:
    async with fake_replicas(
        Behaviour(ttft=5.0), Behaviour(status=503), Behaviour(ttft=0.05, tokens=2), names="psb"
    ) as (p, s, b):
        # The users' clients retry by default (max_retries=2): the attempts must not.
        async with (
            openai.AsyncOpenAI(base_url=p.url, api_key=KEY) as cp,
            openai.AsyncOpenAI(base_url=s.url, api_key=KEY) as cs,
            openai.AsyncOpenAI(base_url=b.url, api_key=KEY) as cb,
        ):
            replicas = sdk_replicas({"p": cp, "s": cs, "b": cb})
            config = th.HedgerConfig(hedge_after=0.1, pick="in_order")
            async with th.Hedger(replicas, config) as hedger:
                async with hedger.stream(REQUEST) as stream:
                    assert "".join([t async for t in stream]) == "tok0 tok1 "
                with trio.fail_after(1):
                    record = await p.wait_disconnected(0)  # the loser's response was closed
                stats = hedger.statistics()
    assert record.disconnected_at is not None
    assert [(a.replica, a.trigger) for a in stream.report.attempts] == [
        ("p", "primary"),
        ("s", "hedge"),
        ("b", "failover"),
    ]
    assert [len(r.requests) for r in (p, s, b)] == [1, 1, 1]
    assert (stats.hedges_sent, stats.failovers, stats.backup_wins) == (1, 1, 0)
    assert stream.report.winner_replica == "b"
