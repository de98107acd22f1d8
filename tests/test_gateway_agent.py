"""`trio-hedge serve`'s ``/v1/messages`` and ``/v1/responses`` in-process, over real loopback
sockets: the official ``anthropic`` and ``openai`` SDKs as clients, FakeReplica upstreams (the
same group serving all three APIs) with a slow primary.

Real time, small delays; every wait is on an event under a ``trio.fail_after`` bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio

from trio_hedge.testing import Behaviour, FakeReplica, fake_replicas

from .gateway_support import Gateway, config_for

anthropic = pytest.importorskip("anthropic")

SLOW = Behaviour(ttft=30.0, tokens=4)  # never reaches its first token: cancelled
FAST = Behaviour(ttft=0.0, token_delay=0.001, tokens=4)
TEXT = "tok0 tok1 tok2 tok3 "
MESSAGES: dict[str, Any] = {
    "model": "m",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "hello there"}],
}
RESPONSES: dict[str, Any] = {"model": "m", "input": "hello there"}


def claude(gw: Gateway, **kw: Any) -> Any:
    return anthropic.Anthropic(base_url=gw.base_url, api_key="sk-test", max_retries=0, **kw)


def oai(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url, api_key="sk-test", max_retries=0)


async def in_thread(fn: Any) -> Any:
    return await trio.to_thread.run_sync(fn)


# -- Anthropic Messages -----------------------------------------------------------------------


async def test_anthropic_sdk_stream_and_whole_message_come_from_the_backup() -> None:
    async with fake_replicas(SLOW, FAST, names=["slow", "fast"]) as (slow, fast):
        async with Gateway(config_for([slow, fast])) as gw:

            def use_sdk() -> tuple[list[str], Any, Any, Any]:
                with claude(gw) as client:
                    with client.messages.stream(**MESSAGES) as stream:
                        texts = list(stream.text_stream)
                        final = stream.get_final_message()
                    raw = client.messages.with_raw_response.create(**MESSAGES)
                    return texts, final, raw.headers, raw.parse()

            with trio.fail_after(10):
                texts, final, headers, whole = await in_thread(use_sdk)
                await slow.wait_disconnected(0)
                await slow.wait_disconnected(1)
    assert "".join(texts) == TEXT
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 4
    assert [b.text for b in final.content] == [TEXT]
    assert whole.content[0].text == TEXT and whole.stop_reason == "end_turn"
    assert whole.usage.output_tokens == 4
    assert headers["x-hedge-replica"] == "fast" and headers["x-hedge-hedged"] == "true"
    # Upstream: the Messages API, with the client's anthropic-version (the SDK's own).
    sent = fast.requests[0]
    assert sent.path == "/v1/messages" and sent.json["stream"] is True
    with anthropic.Anthropic(api_key="k") as sdk:
        assert sent.headers["anthropic-version"] == sdk.default_headers["anthropic-version"]


async def test_async_anthropic_sdk_tool_use_thinking_and_usage() -> None:
    behaviour = Behaviour(
        tokens="Let me look.",
        reasoning=["hm ", "ok"],
        tool_calls=[("get_weather", '{"city": "Paris"}')],
        finish_reason="tool_calls",
    )
    async with fake_replicas(SLOW, behaviour, names=["slow", "fast"]) as (slow, fast):
        async with Gateway(config_for([slow, fast])) as gw:

            async def use_sdk() -> Any:
                async with anthropic.AsyncAnthropic(
                    base_url=gw.base_url, api_key="sk-test", max_retries=0
                ) as client:
                    async with client.messages.stream(**MESSAGES) as stream:
                        return await stream.get_final_message()

            with trio.fail_after(10):
                final = await in_thread(lambda: asyncio.run(use_sdk()))
    kinds = [b.type for b in final.content]
    assert kinds == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "hm ok"
    assert final.content[1].text == "Let me look."
    assert (final.content[2].name, final.content[2].input) == ("get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use"


@pytest.mark.parametrize(
    ("primary", "backup", "sdk_error", "status"),
    [
        (Behaviour(status=401), Behaviour(status=401), "AuthenticationError", 401),
        (Behaviour(status=400), FAST, "BadRequestError", 400),
        (
            Behaviour(status=429, retry_after=2),
            Behaviour(status=429, retry_after=2),
            "RateLimitError",
            429,
        ),
        (Behaviour(status=529), Behaviour(status=529), "OverloadedError", 529),
        (Behaviour(status=503), Behaviour(status=503), "OverloadedError", 529),
    ],
    ids=["401", "400", "429", "529", "503-as-529"],
)
async def test_upstream_errors_reach_the_anthropic_sdk_typed(
    primary: Behaviour, backup: Behaviour, sdk_error: str, status: int
) -> None:
    async with fake_replicas(primary, backup, names=["a", "b"]) as replicas:
        async with Gateway(config_for(replicas)) as gw:
            with claude(gw) as client:
                for stream in (True, False):

                    def call(s: bool = stream) -> Any:
                        if s:
                            with client.messages.stream(**MESSAGES) as events:
                                return list(events)
                        return client.messages.create(**MESSAGES)

                    with trio.fail_after(10), pytest.raises(getattr(anthropic, sdk_error)) as info:
                        await in_thread(call)
                    assert info.value.status_code == status
                    body = info.value.body
                    assert (
                        body["type"] == "error"
                        and body["error"]["type"]
                        and body["error"]["message"]
                    )
    if status == 400:  # the request's fault: never sent to the backup
        assert len(replicas[1].requests) == 0


async def test_an_upstream_failure_after_commit_ends_the_anthropic_stream_in_band() -> None:
    broken = Behaviour(tokens=5, token_delay=0.001, inband_error_after=2, inband_error_status=529)
    async with FakeReplica(broken, name="a") as a:
        async with Gateway(config_for([a])) as gw:
            got: list[str] = []

            def use_sdk() -> None:
                with claude(gw) as client, client.messages.stream(**MESSAGES) as stream:
                    got.extend(stream.text_stream)

            with trio.fail_after(10), pytest.raises(anthropic.APIStatusError) as info:
                await in_thread(use_sdk)
    assert "".join(got) == "tok0 tok1 "
    assert info.value.body["error"]["type"] == "overloaded_error"


async def test_the_winners_events_are_relayed_with_their_names() -> None:
    async with FakeReplica(FAST, name="a") as a:
        async with Gateway(config_for([a])) as gw:
            async with httpx.AsyncClient() as client:
                with trio.fail_after(10):
                    response = await client.post(
                        f"{gw.url}/messages", json={**MESSAGES, "stream": True}
                    )
    lines = response.text.split("\n")
    events = [line[7:] for line in lines if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "data: [DONE]" not in response.text
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == events  # each event's name is its data's type


async def test_anthropic_clients_authenticate_with_x_api_key() -> None:
    async with FakeReplica(FAST, name="a") as a:
        async with Gateway(attrs.evolve(config_for([a]), keys=("gw-key-1",))) as gw:
            ok = anthropic.Anthropic(base_url=gw.base_url, api_key="gw-key-1", max_retries=0)
            with trio.fail_after(10), ok, claude(gw) as bad:
                message = await in_thread(lambda: ok.messages.create(**MESSAGES))
                assert message.content[0].text == TEXT
                with pytest.raises(anthropic.AuthenticationError):
                    await in_thread(lambda: bad.messages.create(**MESSAGES))
    assert "gw-key-1" not in json.dumps(a.requests[0].headers)  # the gateway key stays here


# -- OpenAI Responses ------------------------------------------------------------------------


async def test_openai_responses_stream_helper_and_whole_response_come_from_the_backup() -> None:
    async with fake_replicas(SLOW, FAST, names=["slow", "fast"]) as (slow, fast):
        async with Gateway(config_for([slow, fast])) as gw:

            def use_sdk() -> tuple[list[Any], Any, Any]:
                with oai(gw) as client:
                    events = list(client.responses.create(**RESPONSES, stream=True))
                    with client.responses.stream(**RESPONSES) as stream:
                        final = stream.get_final_response()
                    whole = client.responses.create(**RESPONSES)
                    return events, final, whole

            with trio.fail_after(10):
                events, final, whole = await in_thread(use_sdk)
                await slow.wait_finished(5)
    # The loser of each request was cancelled, and its stored response deleted.
    posts = [r for r in slow.requests if r.method == "POST"]
    assert [r.disconnected_at is not None for r in posts] == [True, True, True]
    deleted = [r.path for r in slow.requests if r.method == "DELETE"]
    assert deleted == [f"/v1/responses/resp-slow-{r.index}" for r in posts]
    assert [r.method for r in fast.requests] == ["POST"] * 3  # the winners' are kept
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == TEXT
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert final.output_text == TEXT and final.usage is not None
    assert whole.output_text == TEXT and whole.status == "completed"
    assert fast.requests[0].path == "/v1/responses"


async def test_openai_responses_tool_calls() -> None:
    behaviour = Behaviour(tokens=0, tool_calls=[("get_weather", '{"city": "Paris"}')])
    async with FakeReplica(behaviour, name="a") as a:
        async with Gateway(config_for([a])) as gw:
            with trio.fail_after(10), oai(gw) as client:
                events = await in_thread(
                    lambda: list(client.responses.create(**RESPONSES, stream=True))
                )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (added,) = [e for e in events if e.type == "response.output_item.added"]
    assert (added.item.type, added.item.name, args) == (
        "function_call",
        "get_weather",
        '{"city": "Paris"}',
    )


@pytest.mark.parametrize(
    ("primary", "backup", "sdk_error", "status"),
    [
        (Behaviour(status=401), Behaviour(status=401), openai.AuthenticationError, 401),
        (Behaviour(status=429, retry_after=1), Behaviour(status=429), openai.RateLimitError, 429),
        (Behaviour(status=503), Behaviour(status=503), openai.InternalServerError, 503),
    ],
    ids=["401", "429", "503"],
)
async def test_upstream_errors_reach_the_openai_sdk_typed(
    primary: Behaviour, backup: Behaviour, sdk_error: type, status: int
) -> None:
    async with fake_replicas(primary, backup, names=["a", "b"]) as replicas:
        async with Gateway(config_for(replicas)) as gw:
            with oai(gw) as client:
                for stream in (True, False):
                    with trio.fail_after(10), pytest.raises(sdk_error) as info:
                        await in_thread(
                            lambda s=stream: (
                                list(client.responses.create(**RESPONSES, stream=True))
                                if s
                                else client.responses.create(**RESPONSES)
                            )
                        )
                    assert info.value.status_code == status


async def test_a_stateful_responses_request_is_refused_and_nothing_goes_upstream() -> None:
    async with FakeReplica(FAST, name="a") as a:
        async with Gateway(config_for([a])) as gw:
            client = oai(gw)
            with trio.fail_after(10), client, pytest.raises(openai.BadRequestError) as info:
                await in_thread(
                    lambda: client.responses.create(**RESPONSES, background=True, stream=True)
                )
            assert "background" in str(info.value)
            with trio.fail_after(10), oai(gw) as again:  # the next caller: served as usual
                whole = await in_thread(lambda: again.responses.create(**RESPONSES))
    assert whole.output_text == TEXT
    assert len(a.requests) == 1


async def test_an_upstream_failure_after_commit_ends_the_responses_stream_in_band() -> None:
    broken = Behaviour(tokens=5, token_delay=0.001, inband_error_after=2, inband_error_status=500)
    async with FakeReplica(broken, name="a") as a:
        async with Gateway(config_for([a])) as gw:
            got: list[str] = []

            def use_sdk() -> None:
                with oai(gw) as client:
                    for event in client.responses.create(**RESPONSES, stream=True):
                        if event.type == "response.output_text.delta":
                            got.append(event.delta)

            with trio.fail_after(10), pytest.raises(openai.APIError) as info:
                await in_thread(use_sdk)
    assert "".join(got) == "tok0 tok1 "
    assert "server_error" in str(info.value.body)


# -- operations ------------------------------------------------------------------------------


async def test_access_log_metrics_and_a_forwarded_key_for_the_agent_routes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    client_key = "sk-ant-client-own-key-abcdef"
    echo = Behaviour(status=401, error_message=f"invalid x-api-key: {client_key}")
    async with fake_replicas(SLOW, FAST, names=["slow", "fast"]) as (slow, fast):
        async with FakeReplica(echo, name="echo") as bad:
            config = config_for([slow, fast])
            async with Gateway(config) as gw, httpx.AsyncClient() as http:
                with trio.fail_after(10):
                    ok = await http.post(f"{gw.url}/messages", json=MESSAGES)
                    also = await http.post(f"{gw.url}/responses", json=RESPONSES)
                    metrics = (await http.get(f"{gw.base_url}/metrics")).text
            keyed = attrs.evolve(config_for([bad]), forward_client_key=True)
            async with Gateway(keyed) as gw, httpx.AsyncClient() as http:
                with trio.fail_after(10):
                    refused = await http.post(
                        f"{gw.url}/messages", json=MESSAGES, headers={"x-api-key": client_key}
                    )
    assert ok.status_code == 200 and ok.json()["content"][0]["text"] == TEXT
    assert also.status_code == 200 and also.json()["status"] == "completed"
    for line in (
        'trio_hedge_gateway_requests_total{path="/v1/messages",status="200"} 1.0',
        'trio_hedge_gateway_requests_total{path="/v1/responses",status="200"} 1.0',
    ):
        assert line in metrics
    # Each route's TTFT under its own api label (as the replica-state gauges name it).
    for api in ("anthropic", "responses"):
        assert f'trio_hedge_gateway_ttft_seconds_count{{api="{api}",group="default",' in metrics
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name.endswith("access")]
    assert [(line["path"], line["status"], line["winner"]) for line in access[:2]] == [
        ("/v1/messages", 200, "fast"),
        ("/v1/responses", 200, "fast"),
    ]
    # The client's x-api-key went upstream, and is masked wherever the upstream echoed it.
    assert bad.requests[0].headers["x-api-key"] == client_key
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert client_key not in refused.text and "***" in refused.text
    assert client_key not in caplog.text


@pytest.mark.parametrize("api", ["anthropic", "responses"])
def test_an_upstream_whole_answer_is_relayed_in_the_apis_events(api: str) -> None:
    """An upstream that ignored ``stream: true`` gives deltas with no wire form: the gateway
    writes them as the API's events, which read back to the same answer."""
    from trio_hedge.events import Delta
    from trio_hedge.gateway._agent import (
        MessageCompletion,
        MessagesForwarder,
        ResponseCompletion,
        ResponsesForwarder,
    )
    from trio_hedge.sources.anthropic import MessagesDecoder
    from trio_hedge.sources.openai_responses import ResponsesDecoder

    forwarder: Any = MessagesForwarder if api == "anthropic" else ResponsesForwarder
    reason = "end_turn" if api == "anthropic" else "completed"
    delta = Delta("whole answer", finish_reason=reason, usage={"output_tokens": 2})
    data = forwarder._synthesize(None, delta, True)
    decoder = MessagesDecoder() if api == "anthropic" else ResponsesDecoder()
    deltas = decoder.feed(data)
    assert decoder.done and decoder.end() == []
    assert "".join(d.content for d in deltas) == "whole answer"
    assert [d.finish_reason for d in deltas if d.finish_reason] == [reason]
    completion = MessageCompletion() if api == "anthropic" else ResponseCompletion()
    completion.add(delta)
    body = json.loads(completion.body("r1", "m"))
    if api == "anthropic":
        assert body["content"] == [{"type": "text", "text": "whole answer"}]
        assert body["stop_reason"] == "end_turn" and body["type"] == "message"
    else:
        assert body["output"][0]["content"][0]["text"] == "whole answer"
