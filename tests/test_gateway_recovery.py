"""The gateway keeps one completion per request across a recovery after the commit: over real
loopback sockets, the official openai SDK (and httpx for the raw bytes) as client, a winner
cut after 3 of 6 tokens and a backup that reproduces the text (docs/gateway.md, Streaming).

The replicas answer with their own ``id`` (``chatcmpl-<replica>-<n>``), ``model`` and
``created``, so a chunk relayed without rewriting would show the backup's.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio

import trio_hedge as th
from trio_hedge.gateway import GatewayConfig, Group, Limits
from trio_hedge.gateway._config import DEFAULT_HEDGER
from trio_hedge.testing import Behaviour, FakeReplica
from trio_hedge.testing._behaviour import RequestRecord, Step, render_response

from .gateway_support import CHAT, Gateway

FULL = "tok0 tok1 tok2 tok3 tok4 tok5 "
CUT = Behaviour(tokens=6, token_delay=0.001, cut_after=3, usage=True)
BACKUP = Behaviour(tokens=6, token_delay=0.001, usage=True)
#: The backup samples differently after two tokens: a replay diverges.
OTHER = Behaviour(tokens=["tok0 ", "tok1 ", "TOKX ", "tok3 "], token_delay=0.001, usage=True)
#: The gateway's default (it recovers), failover only: the cut winner's backup is the recovery.
HEDGER = attrs.evolve(DEFAULT_HEDGER, hedge_after=30.0, pick="in_order", budget=None)


class Dated(FakeReplica):
    """A fake replica whose chunks carry its own ``model`` and ``created``."""

    def __init__(self, behaviour: Behaviour, *, name: str, answers_as: str, created: int) -> None:
        super().__init__(behaviour, name=name)
        self.answers_as = answers_as
        self.created = created

    def _render(self, record: RequestRecord) -> list[Step]:
        if isinstance(record.json, dict):
            record.json = {**record.json, "model": self.answers_as}
        return render_response(record, self.behaviour, model=self.model, created=self.created)


def config(a: FakeReplica, b: FakeReplica, *, continuation: str | None = None) -> GatewayConfig:
    made = [
        th.Replica(a.url, name=a.name),
        th.Replica(b.url, name=b.name, continuation=continuation),
    ]
    group = Group("default", [r.name for r in made], hedger=HEDGER)
    return GatewayConfig(made, [group], port=0, limits=Limits(drain_timeout=1.0))


async def _sdk(gw: Gateway, *, stream: bool) -> Any:
    def call() -> Any:
        with openai.OpenAI(base_url=gw.url, api_key="sk-test", max_retries=0) as client:
            if not stream:
                return client.chat.completions.create(**CHAT)
            made = client.chat.completions.create(
                **CHAT, stream=True, stream_options={"include_usage": True}
            )
            return list(made)

    with trio.fail_after(20):
        return await trio.to_thread.run_sync(call)


async def _raw(gw: Gateway) -> str:
    async with httpx.AsyncClient() as http:
        with trio.fail_after(20):
            body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            answer = await http.post(f"{gw.url}/chat/completions", json=body)
    assert answer.status_code == 200
    return answer.text


def _replicas(backup: Behaviour) -> tuple[Dated, Dated]:
    return (
        Dated(CUT, name="cut", answers_as="model-a", created=1_000),
        Dated(backup, name="backup", answers_as="model-b", created=2_000),
    )


@pytest.mark.parametrize(
    ("continuation", "prompt_sent"),
    [
        (None, 2),  # a replay: the original request ("hello there": 2 prompt words) again
        ("vllm", 5),  # a continuation: the prompt carried the 3 delivered tokens as well
    ],
)
async def test_a_stream_recovered_is_one_completion(
    continuation: str | None, prompt_sent: int
) -> None:
    a, b = _replicas(attrs.evolve(BACKUP, continuation=continuation))
    async with a, b, Gateway(config(a, b, continuation=continuation)) as gw:
        chunks = await _sdk(gw, stream=True)
        raw = await _raw(gw)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == FULL
    # One completion: the first upstream's id, model and created on every chunk.
    assert {(c.id, c.model, c.created) for c in chunks} == {("chatcmpl-cut-0", "model-a", 1_000)}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # Usage counts what the client got: 3 tokens from the cut winner, 3 from the recovery;
    # the prompt is the original's (2 words), whatever the recovery's request carried.
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (2, 6, 8)
    # The raw stream: one role chunk (the new upstream's opening is dropped), [DONE] last.
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    roles = [p for p in parsed if p["choices"] and "role" in p["choices"][0]["delta"]]
    assert len(roles) == 1
    assert {p["id"] for p in parsed} == {"chatcmpl-cut-1"}
    assert b.requests[1].json is not None
    sent = b.requests[1].json["messages"]
    assert len(sent) == (2 if continuation else 1)  # the prefix went as an assistant message
    assert prompt_sent == sum(len(m["content"].split()) for m in sent)


@pytest.mark.parametrize("continuation", [None, "vllm"])
async def test_a_whole_answer_recovered_is_complete(continuation: str | None) -> None:
    # (A vLLM continuation's own usage says 5 prompt and 3 completion tokens.)
    a, b = _replicas(attrs.evolve(BACKUP, continuation=continuation))
    async with a, b, Gateway(config(a, b, continuation=continuation)) as gw:
        whole = await _sdk(gw, stream=False)
    assert whole.choices[0].message.content == FULL
    assert whole.choices[0].finish_reason == "stop"
    assert (whole.id, whole.model, whole.created) == ("chatcmpl-cut-0", "model-a", 1_000)
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (2, 6)
    assert whole.usage.total_tokens == 8


async def test_a_recovery_that_diverges_ends_in_band_with_the_partial_text() -> None:
    a, b = _replicas(OTHER)
    async with a, b, Gateway(config(a, b)) as gw:
        raw = await _raw(gw)

        def sdk() -> tuple[str, BaseException | None]:
            got = []
            with openai.OpenAI(base_url=gw.url, api_key="sk-test", max_retries=0) as client:
                try:
                    for chunk in client.chat.completions.create(**CHAT, stream=True):
                        got.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
                except openai.APIError as exc:
                    return "".join(got), exc
            return "".join(got), None

        with trio.fail_after(20):
            text, error = await trio.to_thread.run_sync(sdk)
    assert text == "tok0 tok1 tok2 " and isinstance(error, openai.APIError)
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert "[DONE]" not in events
    parsed = [json.loads(e) for e in events]
    assert "error" in parsed[-1]
    relayed = "".join(
        p["choices"][0]["delta"].get("content") or "" for p in parsed if p.get("choices")
    )
    assert relayed == "tok0 tok1 tok2 "
    assert {p["id"] for p in parsed[:-1]} == {"chatcmpl-cut-0"}


async def test_a_messages_stream_recovered_keeps_its_message_id() -> None:
    # The Messages API names its message once, in message_start: a replay's own opening is
    # held back with the prefix it reproduces, so the client's message stays the first one.
    # Its usage (output_tokens) is the replay's own count: the whole answer regenerated.
    a, b = _replicas(BACKUP)
    body = {**CHAT, "max_tokens": 50, "stream": True}
    async with a, b, Gateway(config(a, b)) as gw, httpx.AsyncClient() as http:
        with trio.fail_after(20):
            answer = await http.post(f"{gw.url}/messages", json=body)
    events = [e.split("\ndata: ", 1) for e in answer.text.split("\n\n") if e]
    parsed = [(name.removeprefix("event: "), json.loads(data)) for name, data in events]
    assert [n for n, _ in parsed].count("message_start") == 1
    assert parsed[0][1]["message"]["id"] == "msg-cut-0"
    text = "".join(d["delta"].get("text", "") for n, d in parsed if n == "content_block_delta")
    assert text == FULL
    assert parsed[-2][1]["usage"]["output_tokens"] == 6
    assert parsed[-1][0] == "message_stop"


@pytest.mark.parametrize("stream", [True, False])
async def test_a_messages_answer_recovered_inside_an_event_is_whole(stream: bool) -> None:
    # The replay chunks its text differently: the prefix ends inside an event, whose rest
    # the gateway has no event text for (streamed: made; whole: added to its block).
    split = Behaviour(tokens=["tok0 tok", "1 tok2 tok3 ", "tok4 ", "tok5 "], token_delay=0.001)
    a, b = _replicas(split)
    body = {**CHAT, "max_tokens": 50, "stream": stream}
    async with a, b, Gateway(config(a, b)) as gw, httpx.AsyncClient() as http:
        with trio.fail_after(20):
            answer = await http.post(f"{gw.url}/messages", json=body)
    if stream:
        events = [e.split("\ndata: ", 1) for e in answer.text.split("\n\n") if e]
        names = [n.removeprefix("event: ") for n, _ in events]
        # One block, one end: the split event's rest made no block or message of its own.
        assert names.count("content_block_start") == names.count("message_stop") == 1
        assert names[-1] == "message_stop"
        deltas = [json.loads(d) for n, d in events if n == "event: content_block_delta"]
        text = "".join(d["delta"].get("text", "") for d in deltas)
    else:
        whole = answer.json()
        assert whole["id"] == "msg-cut-0"
        text = "".join(block["text"] for block in whole["content"])
    assert text == FULL


async def test_a_chat_stream_recovered_inside_a_chunk_is_one_completion() -> None:
    # The rest of the chunk where the reproduced prefix ends has no JSON text of its own:
    # made by the gateway, with the first upstream's head like the others.
    split = Behaviour(tokens=["tok0 tok", "1 tok2 tok3 ", "tok4 ", "tok5 "], token_delay=0.001)
    a, b = _replicas(split)
    async with a, b, Gateway(config(a, b)) as gw:
        chunks = await _sdk(gw, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == FULL
    assert {(c.id, c.model, c.created) for c in chunks} == {("chatcmpl-cut-0", "model-a", 1_000)}


SPLIT = Behaviour(tokens=["tok0 tok", "1 tok2 tok3 ", "tok4 ", "tok5 "], token_delay=0.001)


@pytest.mark.parametrize("backup", [BACKUP, SPLIT], ids=["whole events", "split inside"])
async def test_a_responses_stream_recovered_names_the_answer_the_client_got(
    backup: Behaviour,
) -> None:
    # The official SDK as client: the text whole, one terminal event, the open item under the
    # client's id while it goes on; the terminal response is the one stored with the whole
    # answer (the replay's), the id the client's next turn continues from. The cut response
    # (3 words, stored under the id response.created gave) is deleted upstream: no one
    # continues from it. Before, the replay's events carried the cut response's id, and the
    # full answer was stored under an id the client never saw, which nothing deleted.
    a, b = _replicas(backup)
    async with a, b, Gateway(config(a, b)) as gw:

        def call() -> tuple[list[Any], Any]:
            with openai.OpenAI(base_url=gw.url, api_key="sk-test", max_retries=0) as client:
                made = client.responses.create(model="m", input="hello there", stream=True)
                events = list(made)
                whole = client.responses.create(model="m", input="hello there")
            return events, whole

        with trio.fail_after(20):
            events, whole = await trio.to_thread.run_sync(call)
    kinds = [e.type for e in events]
    assert kinds.count("response.completed") == 1 and kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == FULL
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {"item_resp-cut-0_0"}
    assert [e.response.id for e in events if hasattr(e, "response")] == [
        "resp-cut-0",
        "resp-cut-0",
        "resp-backup-0",
    ]
    final = events[-1].response
    assert final.output_text == FULL and final.output[0].id == "item_resp-backup-0_0"
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))  # every event numbered, strictly increasing
    assert whole.id == "resp-backup-1" and whole.output_text == FULL
    deleted = [r.path for r in a.requests if r.method == "DELETE"]
    # (The fake names a response by its request's index, the DELETE counted.)
    assert deleted == ["/v1/responses/resp-cut-0", "/v1/responses/resp-cut-2"]
    assert [r.method for r in b.requests] == ["POST", "POST"]  # the answers stay stored


@pytest.mark.parametrize("stream", [True, False])
async def test_a_cut_after_the_last_allowed_token_ends_the_completion_by_length(
    stream: bool,
) -> None:
    # The winner sent all max_tokens tokens and was cut before its finish chunk: nothing is
    # recovered (the backup gets no request), and the client's completion ends by length
    # under the winner's id, model and created, with [DONE]. Before, a replay ran the
    # whole request again (and a continuation would have added max_tokens tokens more).
    cut = Behaviour(tokens=6, token_delay=0.001, cut_after=6)
    a = Dated(cut, name="cut", answers_as="model-a", created=1_000)
    b = Dated(BACKUP, name="backup", answers_as="model-b", created=2_000)
    request = {**CHAT, "max_tokens": 6}

    def call(gw: Gateway) -> Any:
        with openai.OpenAI(base_url=gw.url, api_key="sk-test", max_retries=0) as client:
            if not stream:
                return client.chat.completions.create(**request)
            return list(client.chat.completions.create(**request, stream=True))

    async with a, b, Gateway(config(a, b)) as gw:
        with trio.fail_after(20):
            answer = await trio.to_thread.run_sync(call, gw)
    assert b.requests == []
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        assert text == FULL
        assert {(c.id, c.model, c.created) for c in answer} == {
            ("chatcmpl-cut-0", "model-a", 1_000)
        }
        assert [c.choices[0].finish_reason for c in answer if c.choices][-1] == "length"
    else:
        assert answer.choices[0].message.content == FULL
        assert answer.choices[0].finish_reason == "length"
        assert (answer.id, answer.model) == ("chatcmpl-cut-0", "model-a")
