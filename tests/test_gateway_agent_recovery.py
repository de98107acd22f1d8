"""The gateway's agent routes around recoveries and errors (issue 28), over real loopback
sockets with FakeReplica upstreams:

* every event written on ``/v1/responses`` and ``/v1/messages`` across a recovery validates
  as one the API could have sent (the SDKs' own types, required fields included), and
  Responses ``sequence_number``s strictly increase;
* the ids the client keeps name the answer it got, or the stream ends with the API's typed
  error; stored responses the client does not hold are deleted;
* usage counts what the client got, and what each model generated is in the access log and
  a per-model metric;
* errors keep the upstream API's own ``code`` and ``param`` and name replicas by their
  configured names, never URLs; each route answers in its own error shape, auth included.
"""

from __future__ import annotations

import json
import logging
import typing
from typing import Any

import attrs
import httpx
import pydantic
import pytest
import trio
from openai.types.responses import ResponseStreamEvent

import trio_hedge as th
from trio_hedge.gateway import GatewayConfig, Group, Limits
from trio_hedge.gateway._config import DEFAULT_HEDGER
from trio_hedge.testing import Behaviour, FakeReplica

from .gateway_support import CHAT, Gateway

anthropic = pytest.importorskip("anthropic")

HEDGER = attrs.evolve(DEFAULT_HEDGER, hedge_after=30.0, pick="in_order", budget=None)
FULL = "tok0 tok1 tok2 tok3 tok4 tok5 "
CUT = Behaviour(tokens=6, token_delay=0.001, cut_after=3)
GOOD = Behaviour(tokens=6, token_delay=0.001)
SPLIT = Behaviour(tokens=["tok0 tok", "1 tok2 tok3 ", "tok4 ", "tok5 "], token_delay=0.001)
OTHER = Behaviour(tokens=["tok0 ", "tok1 ", "TOKX ", "tok3 "], token_delay=0.001)
RESPONSES: dict[str, Any] = {"model": "m", "input": "hello there", "stream": True}
MESSAGES: dict[str, Any] = {**CHAT, "max_tokens": 50, "stream": True}
#: The openai SDK's model of each Responses event, by its type: validating an event against
#: its own class names the field that is missing (the union's error lists 59 classes).
RESPONSES_TYPES: dict[str, Any] = {
    typing.get_args(c.model_fields["type"].annotation)[0]: c
    for c in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
MESSAGE_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(
    anthropic.types.RawMessageStreamEvent
)


def check_responses_event(data: dict[str, Any]) -> None:
    """``data`` validates as the Responses event its type names (every required field)."""
    RESPONSES_TYPES[data["type"]].model_validate(data)


def config(
    *fakes: FakeReplica,
    hedger: th.HedgerConfig = HEDGER,
    models: tuple[str | None, ...] = (),
    **changes: Any,
) -> GatewayConfig:
    made = [
        th.Replica(
            f.url,
            name=f.name,
            overrides={"model": m} if (m := (models[i] if i < len(models) else None)) else {},
        )
        for i, f in enumerate(fakes)
    ]
    group = Group("default", [r.name for r in made], hedger=hedger)
    limits = changes.pop("limits", Limits(drain_timeout=1.0))
    return attrs.evolve(GatewayConfig(made, [group], port=0, limits=limits), **changes)


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of each event of a typed-event stream."""
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        name, data = block.split("\ndata: ", 1)
        out.append((name.removeprefix("event: "), json.loads(data)))
    return out


async def post(gw: Any, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        with trio.fail_after(20):
            return await http.post(f"{gw.url}{path}", json=body, **kw)


# -- Responses: events, ids, stored responses ---------------------------------------------------


@pytest.mark.parametrize("backup", [GOOD, SPLIT], ids=["whole events", "split inside"])
async def test_every_responses_event_across_a_recovery_is_the_apis(backup: Behaviour) -> None:
    async with (
        FakeReplica(CUT, name="a") as a,
        FakeReplica(backup, name="b") as b,
        Gateway(config(a, b)) as gw,
    ):
        answer = await post(gw, "/responses", RESPONSES)
    events = sse(answer.text)
    for name, data in events:
        assert name == data["type"]
        check_responses_event(data)  # every required field (logprobs, numbers…)
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == list(range(len(events)))  # before: … 4, 5, None, 5, 6 …
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == FULL
    final = events[-1][1]["response"]
    assert final["id"] == "resp-b-0" and final["output"][0]["content"][0]["text"] == FULL


async def test_a_responses_recovery_that_diverges_ends_typed_and_keeps_the_clients_id() -> None:
    # The replay differs: the client keeps the cut response's id and text, and the stream
    # ends with the API's own error event; the replay's stored response, which the client
    # never saw, is deleted; the cut one (the answer the client got) is kept.
    async with (
        FakeReplica(CUT, name="a") as a,
        FakeReplica(OTHER, name="b") as b,
        Gateway(config(a, b)) as gw,
    ):
        answer = await post(gw, "/responses", RESPONSES)
    events = sse(answer.text)
    assert events[-1][0] == "error" and "response.completed" not in [n for n, _ in events]
    ids = {d["response"]["id"] for _, d in events if "response" in d}
    assert ids == {"resp-a-0"}
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == "tok0 tok1 tok2 "
    assert [r.path for r in a.requests if r.method == "DELETE"] == []
    assert [r.path for r in b.requests if r.method == "DELETE"] == ["/v1/responses/resp-b-0"]


async def test_with_store_off_nothing_is_deleted() -> None:
    async with (
        FakeReplica(CUT, name="a") as a,
        FakeReplica(GOOD, name="b") as b,
        Gateway(config(a, b)) as gw,
    ):
        answer = await post(gw, "/responses", {**RESPONSES, "store": False})
    assert sse(answer.text)[-1][1]["response"]["output"][0]["content"][0]["text"] == FULL
    assert all(r.method == "POST" for r in (*a.requests, *b.requests))


async def test_an_anchor_continuation_through_the_responses_route() -> None:
    # store: false (a stored request replays only): the anchor's instruction goes as a user
    # turn, the repeat is trimmed, and the terminal response's text is the whole answer,
    # not the part the recovery generated.
    anchor = Behaviour(tokens=6, token_delay=0.001, continuation="anchor", anchor_echo="space")
    async with FakeReplica(CUT, name="a") as a, FakeReplica(anchor, name="b") as b:
        made = [th.Replica(a.url, name="a"), th.Replica(b.url, name="b", continuation="anchor")]
        group = Group("default", ["a", "b"], hedger=HEDGER)
        cfg = GatewayConfig(made, [group], port=0, limits=Limits(drain_timeout=1.0))
        async with Gateway(cfg) as gw:
            answer = await post(gw, "/responses", {**RESPONSES, "store": False})
    events = sse(answer.text)
    for _, data in events:
        check_responses_event(data)
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == FULL
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == FULL
    sent = b.requests[0].json
    assert [t["role"] for t in sent["input"]] == ["user", "assistant", "user"]


# -- Messages -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backup", [GOOD, SPLIT], ids=["whole events", "split inside"])
async def test_every_messages_event_across_a_recovery_is_the_apis(backup: Behaviour) -> None:
    async with (
        FakeReplica(CUT, name="a") as a,
        FakeReplica(backup, name="b") as b,
        Gateway(config(a, b)) as gw,
    ):
        answer = await post(gw, "/messages", MESSAGES)
    events = sse(answer.text)
    for name, data in events:
        assert name == data["type"]
        MESSAGE_EVENT.validate_python(data)
    names = [n for n, _ in events]
    assert names.count("message_start") == 1 and names[-1] == "message_stop"
    assert events[0][1]["message"]["id"] == "msg-a-0"  # the Messages API names it once
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert text == FULL
    assert {d["index"] for n, d in events if n.startswith("content_block")} == {0}
    assert events[-2][1]["usage"]["output_tokens"] == 6  # what the client got


# -- usage by model --------------------------------------------------------------------------------


async def test_what_each_model_generated_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The case at small scale: model-a generated 40 tokens and broke; model-b
    # replayed the answer: 60 tokens generated (40 of them the reproduced prefix). The
    # client is charged what it got (60, one usage); the access log and the per-model metric
    # say what each model generated (model-a 40, model-b 60), to bill or budget by model.
    caplog.set_level(logging.INFO)
    primary = Behaviour(tokens=60, token_delay=0.0005, cut_after=40, usage=True)
    backup = Behaviour(tokens=60, token_delay=0.0005, usage=True)
    async with FakeReplica(primary, name="a") as a, FakeReplica(backup, name="b") as b:
        async with Gateway(config(a, b, models=("model-a", "model-b"))) as gw:
            body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            answer = await post(gw, "/chat/completions", body)
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"{gw.base_url}/metrics")).text
    chunks = [json.loads(e[6:]) for e in answer.text.split("\n\n") if e and e != "data: [DONE]"]
    assert chunks[-1]["usage"]["completion_tokens"] == 60
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name.endswith("access")]
    (line,) = [entry for entry in access if entry["path"] == "/v1/chat/completions"]
    assert line["generated"] == {"model-a": 40, "model-b": 60}
    assert (line["tokens"], line["wasted_tokens"], line["recoveries"]) == (60, 40, 1)
    for sample in (
        'trio_hedge_gateway_generated_tokens_total{model="model-a",replica="a"} 40.0',
        'trio_hedge_gateway_generated_tokens_total{model="model-b",replica="b"} 60.0',
    ):
        assert sample in metrics


# -- errors ----------------------------------------------------------------------------------


NOT_FOUND = Behaviour(
    status=404,
    error_message="Previous response with id 'resp_x' not found.",
    error_code="previous_response_not_found",
    error_param="previous_response_id",
)


async def test_previous_response_not_found_keeps_the_apis_code_and_param() -> None:
    # Every replica answers previous_response_not_found: agent clients branch on that code
    # (then resend the history), so it reaches them as the API sent it, with the param; the
    # message names the replicas by their configured names, never by URL.
    async with FakeReplica(NOT_FOUND, name="a") as a, FakeReplica(NOT_FOUND, name="b") as b:
        urls = (a.url, b.url)
        async with Gateway(config(a, b)) as gw:
            body = {**RESPONSES, "previous_response_id": "resp_x"}
            answer = await post(gw, "/responses", body)
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id"
    for url in (*urls, "127.0.0.1", "http://"):
        assert url not in error["message"]
    assert "replica 'b'" in error["message"] and "at a;" in error["message"]


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/messages", {"x-api-key": "wrong"}),
        ("/messages", {}),
        ("/responses", {"authorization": "Bearer wrong"}),
        ("/chat/completions", {"authorization": "Bearer wrong"}),
    ],
)
async def test_each_route_refuses_a_wrong_key_in_its_own_error_shape(
    path: str, headers: dict[str, str]
) -> None:
    async with FakeReplica(GOOD, name="a") as a:
        async with Gateway(attrs.evolve(config(a), keys=("gw-key-1",))) as gw:
            answer = await post(gw, path, {**MESSAGES, "input": "hi"}, headers=headers)
    assert answer.status_code == 401
    body = answer.json()
    if path == "/messages":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert set(body["error"]) == {"type", "message"}
    else:
        assert body["error"]["code"] == "invalid_api_key"
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert a.requests == []


async def test_the_anthropic_sdk_raises_its_own_error_for_a_refused_key() -> None:
    async with FakeReplica(GOOD, name="a") as a:
        async with Gateway(attrs.evolve(config(a), keys=("gw-key-1",))) as gw:
            client = anthropic.Anthropic(base_url=gw.base_url, api_key="wrong", max_retries=0)

            def call() -> Any:
                with client:
                    return client.messages.create(**{**MESSAGES, "stream": False})

            with pytest.raises(anthropic.AuthenticationError) as info, trio.fail_after(20):
                await trio.to_thread.run_sync(call)
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
