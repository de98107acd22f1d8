"""The Anthropic Messages and OpenAI Responses sources hedged end to end: over loopback fake
replicas that speak each API (real sockets), and in virtual time (MockReplicas): the first
token, failover on errors by meaning, truncation after the commit, the stateful Responses
rules, and a second caller the first one's bad request does not touch."""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import HedgePolicy, HedgerConfig
from trio_hedge.errors import ErrorKind
from trio_hedge.events import FirstToken
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.sources import Replica
from trio_hedge.sources.anthropic import AnthropicReplica
from trio_hedge.sources.openai import merge_tool_calls
from trio_hedge.sources.openai_responses import ResponsesReplica
from trio_hedge.testing import Behaviour, MockReplicas, fake_replicas

from . import misbehaving as mb

MESSAGES = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi"}
API = {
    "anthropic": (AnthropicReplica, MESSAGES),
    "responses": (ResponsesReplica, RESPONSES),
}
#: No recovery after the commit: each case is about how one API's stream ends
#: (tests/test_recovery.py recovers them).
PLAIN = HedgerConfig(
    hedge_after=1.0,
    budget=None,
    throttle=None,
    outlier_detection=None,
    pick="in_order",
    max_recoveries=0,
)


def _replicas(kind: type[Replica], urls: dict[str, str], **fields: Any) -> list[Replica]:
    return [kind(url, name=name, **fields) for name, url in urls.items()]


# -- real sockets -------------------------------------------------------------------------------


@pytest.mark.parametrize("api", sorted(API))
async def test_a_slow_primary_is_hedged_and_the_loser_cancelled(api: str) -> None:
    kind, request = API[api]
    async with fake_replicas(
        Behaviour(ttft=3.0, tokens=3), Behaviour(ttft=0.05, token_delay=0.01, tokens=3)
    ) as (primary, backup):
        replicas = _replicas(kind, {"p": primary.url, "b": backup.url}, api_key="sk-secret-1")
        async with httpx.AsyncClient() as client:
            stream = th.hedged_stream(
                request, replicas, HedgePolicy(hedge_after=0.05), client=client
            )
            async with stream:
                deltas = [d async for d in stream.events()]
            with trio.fail_after(1):
                loser = await primary.wait_disconnected(0)
        assert "".join(d.content for d in deltas) == "tok0 tok1 tok2 "
        assert stream.report.winner == 2 and stream.report.completed
        assert loser.tokens_sent == 0
        # The start events (message_start and ping; response.created and in_progress) came
        # with the primary's headers, and were not a first token.
        assert loser.path == ("/v1/messages" if api == "anthropic" else "/v1/responses")
        finish = [d.finish_reason for d in deltas if d.finish_reason]
        assert finish == (["end_turn"] if api == "anthropic" else ["completed"])
        usage = [d.usage for d in deltas if d.usage is not None][-1]
        assert usage is not None and usage.get("output_tokens") == 3
        won = backup.requests[0]
        assert won.json == {**request, "stream": True}
        if api == "anthropic":
            assert won.headers["x-api-key"] == "sk-secret-1"
            assert won.headers["anthropic-version"] == "2023-06-01"
            assert "authorization" not in won.headers
        else:
            assert won.headers["authorization"] == "Bearer sk-secret-1"
        assert "sk-secret-1" not in repr(replicas) + repr(stream.report)


@pytest.mark.parametrize("api", sorted(API))
async def test_reasoning_and_tool_calls_come_as_deltas(api: str) -> None:
    kind, request = API[api]
    behaviour = Behaviour(
        tokens="Let me check.",
        reasoning=["think ", "hard"],
        tool_calls=[("get_weather", '{"city": "Paris"}')],
        finish_reason="tool_calls",
    )
    async with fake_replicas(behaviour) as (replica,):
        async with httpx.AsyncClient() as client:
            policy = HedgePolicy(hedge_after=1.0, first_token=FirstToken.ANY_OUTPUT)
            stream = th.hedged_stream(
                request, _replicas(kind, {"r": replica.url}), policy, client=client
            )
            async with stream:
                deltas = [d async for d in stream.events()]
    assert "".join(d.content for d in deltas) == "Let me check."
    assert [d.reasoning for d in deltas if d.reasoning] == ["think ", "hard"]
    ((call),) = merge_tool_calls(deltas)
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Paris"}')
    assert call["id"] == ("toolu_0" if api == "anthropic" else "call_0")
    finish = [d.finish_reason for d in deltas if d.finish_reason]
    assert finish == (["tool_use"] if api == "anthropic" else ["completed"])
    # Every event but keep-alives is a Delta with the server's JSON, for relaying.
    assert all(d.raw is not None for d in deltas)
    kinds = [json.loads(d.raw)["type"] for d in deltas if d.raw is not None]
    assert kinds[0] == ("message_start" if api == "anthropic" else "response.created")
    assert kinds[-1] == ("message_stop" if api == "anthropic" else "response.completed")
    assert "ping" not in kinds


# -- virtual time ---------------------------------------------------------------------------------


async def _run(
    kind: type[Replica],
    request: dict[str, Any],
    behaviours: dict[str, Behaviour],
    config: HedgerConfig = PLAIN,
) -> tuple[th.HedgedStream, str, MockReplicas]:
    mock = MockReplicas(behaviours)
    async with httpx.AsyncClient(transport=mock.transport) as client:
        replicas = [kind(mock.url(n), name=n) for n in behaviours]
        async with th.Hedger(replicas, config, client=client) as hedger:
            async with hedger.stream(request) as stream:
                text = "".join([t async for t in stream])
    return stream, text, mock


# Errors by meaning, before the first token: (behaviour of the primary, error kind, whether
# the backup was started as a failover at once).
ERRORS_BEFORE_THE_FIRST_TOKEN = [
    (Behaviour(status=529, error_delay=0.1), ErrorKind.OVERLOADED),
    (Behaviour(status=503, error_delay=0.1), ErrorKind.OVERLOADED),
    (Behaviour(status=429, error_delay=0.1, retry_after=3), ErrorKind.RATE_LIMIT),
    (Behaviour(status=500, error_delay=0.1), ErrorKind.SERVER_ERROR),
    (Behaviour(status=401, error_delay=0.1), ErrorKind.AUTH),
    (Behaviour(status=403, error_delay=0.1), ErrorKind.AUTH),
    (Behaviour(status=404, error_delay=0.1), ErrorKind.NOT_FOUND),
    (Behaviour(ttft=0.1, inband_error_after=0, inband_error_status=529), ErrorKind.OVERLOADED),
    (Behaviour(ttft=0.1, inband_error_after=0, inband_error_status=429), ErrorKind.RATE_LIMIT),
    (Behaviour(ttft=0.1, inband_error_after=0, inband_error_status=500), ErrorKind.SERVER_ERROR),
]


@pytest.mark.parametrize("api", sorted(API))
@pytest.mark.parametrize(("primary", "kind"), ERRORS_BEFORE_THE_FIRST_TOKEN)
async def test_errors_by_meaning_fail_over_before_the_first_token(
    autojump_clock: trio.testing.MockClock, api: str, primary: Behaviour, kind: ErrorKind
) -> None:
    replica, request = API[api]
    stream, text, _ = await _run(
        replica, request, {"a": primary, "b": Behaviour(ttft=0.2, tokens=2)}
    )
    assert text == "tok0 tok1 "
    a, b = stream.report.attempts
    assert (a.outcome, b.outcome, b.trigger) == (O.FAILED, O.WON, "failover")
    assert a.error is not None and a.error.kind is kind
    assert a.error.retry_after == (
        3.0 if kind is ErrorKind.RATE_LIMIT and primary.is_error else None
    )


@pytest.mark.parametrize("api", sorted(API))
@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        (400, "messages: field required", ErrorKind.INVALID_REQUEST),
        (
            400,
            "prompt is too long: 250000 tokens > 200000 maximum",
            ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        ),
        (413, "request exceeds the maximum size", ErrorKind.INVALID_REQUEST),
    ],
)
async def test_the_requests_own_fault_ends_it_and_a_second_caller_is_served(
    autojump_clock: trio.testing.MockClock, api: str, status: int, message: str, kind: ErrorKind
) -> None:
    replica, request = API[api]
    bad = {**request, "model": "bad"}

    def behaviour(record: Any) -> Behaviour:
        if record.json.get("model") == "bad":
            return Behaviour(status=status, error_message=message, error_delay=0.1)
        return Behaviour(ttft=0.2, tokens=2)

    mock = MockReplicas({"a": behaviour, "b": behaviour})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        replicas = [replica(mock.url(n), name=n) for n in ("a", "b")]
        async with th.Hedger(replicas, PLAIN, client=client) as hedger:
            with pytest.raises(th.FatalAttemptError) as info:
                async with hedger.stream(bad) as stream:
                    pass
            assert info.value.error.kind is kind
            assert len(mock.requests["b"]) == 0  # no backup: any replica would refuse it
            async with hedger.stream(request) as stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 "
            assert [a.replica for a in stream.report.attempts] == ["a"]
            assert stream.report.ttft == pytest.approx(0.2, abs=1e-9)
            ra, rb = hedger.statistics().replicas
            assert (ra.state, rb.state) == ("healthy", "healthy")


@pytest.mark.parametrize(
    ("api", "behaviour", "kind"),
    [
        # The body is cut after two tokens: no message_stop / response.completed.
        ("anthropic", Behaviour(ttft=0.1, tokens=4, cut_after=2), ErrorKind.STREAM_TRUNCATED),
        ("responses", Behaviour(ttft=0.1, tokens=4, cut_after=2), ErrorKind.STREAM_TRUNCATED),
        # The body ends cleanly without response.completed.
        ("responses", Behaviour(ttft=0.1, tokens=4, send_done=False), ErrorKind.STREAM_TRUNCATED),
        # An in-band error after tokens: overloaded_error after a 200 / response.failed.
        (
            "anthropic",
            Behaviour(ttft=0.1, tokens=4, inband_error_after=2, inband_error_status=529),
            ErrorKind.OVERLOADED,
        ),
        (
            "responses",
            Behaviour(ttft=0.1, tokens=4, inband_error_after=2, inband_error_status=500),
            ErrorKind.SERVER_ERROR,
        ),
    ],
)
async def test_an_answer_that_ends_before_its_terminal_event_is_interrupted(
    autojump_clock: trio.testing.MockClock, api: str, behaviour: Behaviour, kind: ErrorKind
) -> None:
    replica, request = API[api]
    with pytest.raises(th.StreamInterrupted) as info:
        await _run(replica, request, {"a": behaviour, "b": Behaviour(ttft=0.2)})
    assert info.value.text == ("tok0 tok1 tok2 tok3 " if not behaviour.send_done else "tok0 tok1 ")
    assert info.value.error.kind is kind


async def test_a_messages_stream_that_ends_after_its_stop_reason_is_complete(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Lenient: some proxies drop message_stop after the message_delta with stop_reason."""
    stream, text, _ = await _run(
        AnthropicReplica, MESSAGES, {"a": Behaviour(tokens=2, send_done=False)}
    )
    assert text == "tok0 tok1 " and stream.report.completed


async def test_a_responses_incomplete_end_is_complete_with_its_reason(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"a": Behaviour(tokens=2, finish_reason="length")})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        replicas = [ResponsesReplica(mock.url("a"), name="a")]
        async with th.hedged_stream(RESPONSES, replicas, client=client) as stream:
            deltas = [d async for d in stream.events()]
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["max_output_tokens"]
    assert stream.report.completed


#: vLLM 0.32's answer to a Responses request cut by max_output_tokens (trimmed to the fields
#: that matter): the terminal event is response.completed, the response's status incomplete.
VLLM_CUT = [
    {"type": "response.created", "response": {"id": "resp_v", "status": "in_progress"}},
    {"type": "response.in_progress", "response": {"id": "resp_v", "status": "in_progress"}},
    {
        "type": "response.output_item.added",
        "item": {"id": "msg_v", "content": [], "role": "assistant", "type": "message"},
    },
    {"type": "response.output_text.delta", "item_id": "msg_v", "delta": "air"},
    {"type": "response.output_text.delta", "item_id": "msg_v", "delta": "menwork"},
    {"type": "response.output_text.done", "item_id": "msg_v", "text": "airmenwork"},
    {
        "type": "response.completed",
        "response": {
            "id": "resp_v",
            "object": "response",
            "status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"},
            "usage": {"input_tokens": 15, "output_tokens": 4},
        },
    },
]


async def test_a_completed_event_of_an_incomplete_response_says_why() -> None:
    """vLLM ends a cut response with response.completed and status "incomplete": the finish
    reason is the response's own (max_output_tokens), as for response.incomplete and for the
    same answer sent whole; the response that finished is still "completed"."""
    finished = {**VLLM_CUT[-1]["response"], "status": "completed", "incomplete_details": None}
    bodies = [VLLM_CUT, [*VLLM_CUT[:-1], {"type": "response.completed", "response": finished}]]

    async def script(conn: mb.ServerConn) -> None:
        await conn.send(mb.SSE_HEAD)
        await conn.send_chunks([_typed(event) for event in bodies[len(server.connections) - 1]])
        await conn.send(mb.END_OF_BODY)

    async with mb.RawServer(script, name="vllm") as server, th.transport.make_client() as client:
        reasons = []
        for _ in bodies:
            replicas = [ResponsesReplica(server.url, name="vllm")]
            async with th.hedged_stream(RESPONSES, replicas, client=client) as stream:
                deltas = [d async for d in stream.events()]
            assert "".join(d.content for d in deltas) == "airmenwork"
            assert stream.report.completed
            reasons.append([d.finish_reason for d in deltas if d.finish_reason])
    assert reasons == [["max_output_tokens"], ["completed"]]


# -- stateful Responses requests ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("background", True), ("conversation", "conv_123"), ("conversation", {"id": "conv_1"})],
)
async def test_stateful_fields_are_refused_before_any_io_and_a_second_caller_is_served(
    autojump_clock: trio.testing.MockClock, field: str, value: Any
) -> None:
    mock = MockReplicas({"a": Behaviour(ttft=0.2, tokens=2), "b": Behaviour(ttft=0.2, tokens=2)})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        replicas = [ResponsesReplica(mock.url(n), name=n) for n in ("a", "b")]
        async with th.Hedger(replicas, PLAIN, client=client) as hedger:
            with pytest.raises(ValueError, match=f"request field '{field}' cannot be hedged"):
                hedger.stream({**RESPONSES, field: value})
            assert mock.requests == {"a": [], "b": []}
            async with hedger.stream({**RESPONSES, "background": False}) as stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 "
            assert stream.report.ttft == 0.2
            assert hedger.statistics().requests == 1
    with pytest.raises(ValueError, match="overrides field 'background'"):
        ResponsesReplica(mock.url("a"), overrides={"background": True}).bind(
            RESPONSES, httpx.AsyncClient(transport=mock.transport)
        )


def _deleted(mock: MockReplicas, name: str) -> list[str]:
    return [r.path.rsplit("/", 1)[1] for r in mock.requests[name] if r.method == "DELETE"]


@pytest.mark.parametrize("store", [None, True, False])
async def test_the_losers_stored_response_is_deleted_and_the_winners_kept(
    autojump_clock: trio.testing.MockClock, store: bool | None
) -> None:
    request = RESPONSES if store is None else {**RESPONSES, "store": store}
    stream, text, mock = await _run(
        ResponsesReplica,
        request,
        {"a": Behaviour(ttft=5.0, tokens=2), "b": Behaviour(ttft=0.5, tokens=2)},
    )
    assert text == "tok0 tok1 " and stream.report.winner == 2
    if store is False:  # nothing stored: nothing to delete
        assert _deleted(mock, "a") == []
    else:  # store on, the API's default
        assert _deleted(mock, "a") == ["resp-a-0"]
    assert _deleted(mock, "b") == []  # the winner's response is the caller's
    (delete,) = [r for r in mock.requests["a"] if r.method == "DELETE"] or [None]
    if delete is not None:
        assert delete.path == "/v1/responses/resp-a-0"


async def test_a_winner_closed_early_keeps_its_stored_response(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"a": Behaviour(ttft=0.5, token_delay=1.0, tokens=5)})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        replicas = [ResponsesReplica(mock.url("a"), name="a")]
        async with th.hedged_stream(RESPONSES, replicas, client=client) as stream:
            async for _token in stream:
                break  # the caller leaves after the first token
    assert _deleted(mock, "a") == []


async def test_a_replica_without_the_previous_response_fails_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """previous_response_id: replicas that do not share the stored conversation answer
    previous_response_not_found, the replica's fault: that attempt fails alone."""
    body = {
        "error": {
            "message": "Previous response with id 'resp_1' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "previous_response_not_found",
        }
    }
    mock = MockReplicas({"b": Behaviour(ttft=0.2, tokens=2)})

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a.test":
            await trio.sleep(0.1)
            return httpx.Response(400, json=body)
        return await mock.transport.handle_async_request(request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
        replicas = [
            ResponsesReplica("http://a.test/v1", name="a"),
            ResponsesReplica(mock.url("b"), name="b"),
        ]
        async with th.Hedger(replicas, PLAIN, client=client) as hedger:
            async with hedger.stream({**RESPONSES, "previous_response_id": "resp_1"}) as stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 "
    a, b = stream.report.attempts
    assert a.error is not None and a.error.kind is ErrorKind.NOT_FOUND
    assert (b.trigger, b.outcome) == ("failover", O.WON)
    assert mock.requests["b"][0].json["previous_response_id"] == "resp_1"


# -- construction -------------------------------------------------------------------------------


def test_replicas_of_different_apis_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas must all speak one API"):
        th.Hedger([Replica("http://a/v1", name="a"), AnthropicReplica("http://b/v1", name="b")])
    with pytest.raises(ValueError, match="one API"):
        th.hedged_stream(
            RESPONSES,
            [ResponsesReplica("http://a/v1", name="a"), AnthropicReplica("http://b/v1", name="b")],
        )


def test_anthropic_replica_fields() -> None:
    replica = AnthropicReplica("https://api.anthropic.com/v1/", api_key="sk-ant-secret")
    assert (replica.base_url, replica.path, replica.anthropic_version) == (
        "https://api.anthropic.com/v1",
        "/messages",
        "2023-06-01",
    )
    assert replica.api == "anthropic" and isinstance(replica, Replica)
    assert "sk-ant" not in repr(replica)
    with pytest.raises(ValueError, match="x-api-key"):
        AnthropicReplica("http://a/v1", api_key="k", headers={"X-Api-Key": "k2"})
    with pytest.raises(ValueError, match="anthropic_version"):
        AnthropicReplica("http://a/v1", anthropic_version="2023\n")
    with pytest.raises(TypeError, match="Messages JSON body"):
        replica.check_request(["not", "a", "mapping"])
    assert attrs.evolve(replica, anthropic_version="2024-01-01").anthropic_version == "2024-01-01"


async def test_a_requests_own_anthropic_version_replaces_the_default(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"a": Behaviour(tokens=1)})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        replicas = [AnthropicReplica(mock.url("a"), name="a", api_key="k")]
        async with th.Hedger(replicas, PLAIN, client=client) as hedger:
            async with hedger.stream(
                MESSAGES, headers={"anthropic-version": "2099-01-01", "anthropic-beta": "x"}
            ) as stream:
                assert [t async for t in stream] == ["tok0 "]
    headers = mock.requests["a"][0].headers
    assert (headers["anthropic-version"], headers["anthropic-beta"]) == ("2099-01-01", "x")


@pytest.mark.parametrize("api", sorted(API))
async def test_asyncio_callers_get_the_same_deltas(
    autojump_clock: trio.testing.MockClock, api: str
) -> None:
    trio_asyncio = pytest.importorskip("trio_asyncio")
    from trio_hedge.aio import aio_hedged_stream

    kind, request = API[api]
    mock = MockReplicas({"a": Behaviour(ttft=5.0, tokens=2), "b": Behaviour(ttft=0.5, tokens=2)})

    async def consume(client: httpx.AsyncClient) -> tuple[list[str], th.Report]:
        replicas = [kind(mock.url(n), name=n) for n in ("a", "b")]
        policy = HedgePolicy(hedge_after=1.0)
        async with aio_hedged_stream(request, replicas, policy, client=client) as stream:
            finish = [d.finish_reason async for d in stream.events() if d.finish_reason]
        return finish, stream.report

    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with trio_asyncio.open_loop():
            finish, report = await trio_asyncio.aio_as_trio(consume)(client)
    assert finish == (["end_turn"] if api == "anthropic" else ["completed"])
    assert (report.winner, report.text, report.ttft) == (2, "tok0 tok1 ", 1.5)


class _Paced(httpx.AsyncByteStream):
    """A response body: each ``(seconds, bytes)`` sent that long after the previous one."""

    def __init__(self, steps: list[tuple[float, bytes]]) -> None:
        self._steps = steps

    async def __aiter__(self) -> Any:
        for delay, data in self._steps:
            await trio.sleep(delay)
            yield data


def _typed(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


#: What each API sends that is not a token: every 0.2 s for 2 s, then one token.
NOT_TOKENS = {
    "anthropic": [
        _typed({"type": "message_start", "message": {"usage": {"input_tokens": 1}}}),
        _typed(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            }
        ),
        _typed({"type": "ping"}),
        _typed(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": ""}}
        ),
        b": keep-alive\n\n",
        b"data: \n\n",
    ],
    "responses": [
        _typed({"type": "response.created", "response": {"id": "resp_1"}}),
        _typed({"type": "response.in_progress", "response": {"id": "resp_1"}}),
        _typed({"type": "response.queued", "response": {"id": "resp_1"}}),
        _typed({"type": "keepalive"}),
        _typed({"type": "response.output_text.delta", "item_id": "m", "delta": ""}),
        b": keep-alive\n\n",
    ],
}
TOKEN = {
    "anthropic": _typed(
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "late"}}
    ),
    "responses": _typed({"type": "response.output_text.delta", "item_id": "m", "delta": "late"}),
}


@pytest.mark.parametrize("api", sorted(API))
async def test_start_events_pings_and_empty_deltas_are_not_a_first_token(
    autojump_clock: trio.testing.MockClock, api: str
) -> None:
    """The primary sends only what is not a token for 2 s: the hedge goes out at 1 s and the
    backup's first token wins; under a stall timeout, the same events are no progress."""
    kind, request = API[api]
    busy = [*[(0.2, event) for event in NOT_TOKENS[api] * 2][:10], (0.0, TOKEN[api])]
    mock = MockReplicas({"b": Behaviour(ttft=0.5, tokens=2)})

    async def handle(http: httpx.Request) -> httpx.Response:
        if http.url.host == "a.test":
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, stream=_Paced(busy)
            )
        return await mock.transport.handle_async_request(http)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
        replicas = [kind("http://a.test/v1", name="a"), kind(mock.url("b"), name="b")]
        async with th.Hedger(replicas, PLAIN, client=client) as hedger:
            async with hedger.stream(request) as stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 "
        assert (stream.report.winner, stream.report.ttft) == (2, 1.5)
        # Alone, under a stall timeout of 1 s, 2 s of such events are a stall.
        alone = [kind("http://a.test/v1", name="a")]
        busy[:0] = [(0.0, TOKEN[api])]  # one token first: the commit
        policy = HedgePolicy(hedge_after=None, stall_timeout=1.0)
        with pytest.raises(th.StreamInterrupted) as info:
            async with th.hedged_stream(request, alone, policy, client=client) as stream:
                async for _ in stream:
                    pass
        assert info.value.error.kind is ErrorKind.STALL and info.value.text == "late"
