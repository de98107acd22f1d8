"""`trio-hedge serve` in-process, over real loopback sockets: the official openai SDK (sync and
asyncio) and httpx as clients, FakeReplica upstreams with a slow primary.

Real time, small delays; nothing sleeps to "wait enough": every wait is on an event (a
replica's record, a response byte) under a ``trio.fail_after`` bound.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import shutil
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio

from trio_hedge.gateway import GatewayKey, Limits
from trio_hedge.gateway._config import DEFAULT_HEDGER
from trio_hedge.testing import Behaviour, FakeReplica, fake_replicas

from .gateway_support import CHAT, HEDGER, Gateway, config_for, count_tasks

SLOW = Behaviour(ttft=30.0, tokens=4)  # never reaches its first token: cancelled
FAST = Behaviour(ttft=0.0, token_delay=0.001, tokens=4)
TEXT = "tok0 tok1 tok2 tok3 "


def sync_client(gw: Gateway, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url, api_key="sk-test", max_retries=0, **kw)


async def in_thread(fn: Any) -> Any:
    return await trio.to_thread.run_sync(fn)


async def in_asyncio(coro_fn: Any) -> Any:
    """Run ``coro_fn()`` in asyncio, in a thread: as an asyncio application would."""
    return await trio.to_thread.run_sync(lambda: asyncio.run(coro_fn()))


# -- the official SDK ------------------------------------------------------------------------


async def test_openai_sync_stream_and_whole_answer_come_from_the_backup() -> None:
    async with fake_replicas(SLOW, FAST, names=["slow", "fast"]) as (slow, fast):
        async with Gateway(config_for([slow, fast])) as gw:

            def use_sdk() -> tuple[list[Any], Any, Any]:
                client = sync_client(gw)
                stream = client.chat.completions.create(
                    **CHAT, stream=True, stream_options={"include_usage": True}
                )
                chunks = list(stream)
                raw = client.chat.completions.with_raw_response.create(**CHAT)
                return chunks, raw.headers, raw.parse()

            with trio.fail_after(10):
                chunks, headers, whole = await in_thread(use_sdk)
                await slow.wait_disconnected(0)
                await slow.wait_disconnected(1)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert whole.choices[0].message.content == TEXT
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.completion_tokens == 4
    assert headers["x-hedge-replica"] == "fast"
    assert headers["x-hedge-attempts"] == "2" and headers["x-hedge-hedged"] == "true"
    assert 0.05 <= float(headers["x-hedge-ttft"]) < 5
    assert [r.disconnected_at is not None for r in slow.requests] == [True, True]


async def test_async_openai_tool_calls_reasoning_and_usage() -> None:
    agent = Behaviour(
        ttft=0.0,
        reasoning=2,
        tokens=0,
        tool_calls=[("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')],
        finish_reason="tool_calls",
    )
    async with fake_replicas(SLOW, agent, names=["slow", "agent"]) as (slow, good):
        async with Gateway(config_for([slow, good])) as gw:

            async def use_sdk() -> tuple[list[Any], Any]:
                client = openai.AsyncOpenAI(base_url=gw.url, api_key="sk-test", max_retries=0)
                async with client:
                    stream = await client.chat.completions.create(
                        **CHAT, stream=True, stream_options={"include_usage": True}
                    )
                    chunks = [c async for c in stream]
                    whole = await client.chat.completions.create(**CHAT)
                return chunks, whole

            with trio.fail_after(10):
                chunks, whole = await in_asyncio(use_sdk)
    calls: dict[int, dict[str, str]] = {}
    reasoning = ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += (call.function and call.function.name) or ""
            entry["arguments"] += (call.function and call.function.arguments) or ""
    assert reasoning == "think0 think1 "
    assert calls == {
        0: {"id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        1: {"id": "call_1", "name": "get_time", "arguments": '{"tz": "CET"}'},
    }
    assert chunks[-1].usage is not None
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("call_0", "get_weather", '{"city": "Paris"}'),
        ("call_1", "get_time", '{"tz": "CET"}'),
    ]
    assert message.content is None
    assert whole.usage is not None and whole.usage.prompt_tokens == 2


@pytest.mark.parametrize(
    ("primary", "backup", "sdk_error", "status", "retry_after"),
    [
        (Behaviour(status=401), Behaviour(status=401), openai.AuthenticationError, 401, None),
        (Behaviour(status=400), FAST, openai.BadRequestError, 400, None),
        (Behaviour(status=404), Behaviour(status=404), openai.NotFoundError, 404, None),
        (
            # Short pushback: the second request waits for the earliest cooldown (0.2 s).
            Behaviour(status=429, retry_after=0.4),
            Behaviour(status=429, retry_after=0.2),
            openai.RateLimitError,
            429,
            "1",  # whole seconds, rounded up
        ),
        (Behaviour(status=503), Behaviour(status=503), openai.InternalServerError, 503, "1"),
    ],
    ids=["401", "400", "404", "429", "all-503"],
)
async def test_upstream_errors_reach_the_sdk_typed(
    primary: Behaviour, backup: Behaviour, sdk_error: type, status: int, retry_after: str | None
) -> None:
    async with fake_replicas(primary, backup, names=["a", "b"]) as replicas:
        async with Gateway(config_for(replicas)) as gw:
            client = sync_client(gw)
            for stream in (True, False):
                with trio.fail_after(10), pytest.raises(sdk_error) as info:
                    await in_thread(
                        lambda s=stream: client.chat.completions.create(**CHAT, stream=s)
                    )
                error = info.value
                assert isinstance(error, openai.APIStatusError)
                assert error.status_code == status
                assert error.response.headers.get("retry-after") == retry_after
                assert error.response.headers["x-request-id"]
                body = error.body
                assert isinstance(body, dict) and body["message"] and body["type"]
    # A fatal 400 is not retried on the backup.
    if status == 400:
        assert len(replicas[1].requests) == 0


async def test_an_upstream_failure_after_commit_ends_the_stream_in_band() -> None:
    broken = Behaviour(tokens=5, token_delay=0.001, inband_error_after=2, error_message="boom")
    async with FakeReplica(broken, name="a") as a:
        async with Gateway(config_for([a])) as gw:
            client = sync_client(gw)

            def read() -> tuple[str, BaseException | None]:
                text = ""
                try:
                    for chunk in client.chat.completions.create(**CHAT, stream=True):
                        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
                except openai.APIError as exc:
                    return text, exc
                return text, None

            with trio.fail_after(10):
                text, error = await in_thread(read)
                async with httpx.AsyncClient() as http:
                    raw = await http.post(
                        f"{gw.url}/chat/completions", json={**CHAT, "stream": True}
                    )
    assert text == "tok0 tok1 "
    assert isinstance(error, openai.APIError) and "boom" in str(error)
    events = [e for e in raw.text.split("\n\n") if e]
    assert raw.status_code == 200
    assert json.loads(events[-1].removeprefix("data: "))["error"]["message"] == "boom"
    assert "[DONE]" not in raw.text


async def test_the_gateway_recovers_after_commit_by_default() -> None:
    # The winner is cut after two tokens; the backup replays the answer, reproduces them and
    # goes on: the client gets the backup's whole text as one completion, and [DONE]
    # (tests/test_gateway_recovery.py: the ids, usage and a divergence).
    cut = Behaviour(tokens=5, token_delay=0.001, cut_after=2)
    hedger = attrs.evolve(DEFAULT_HEDGER, hedge_after=30.0, pick="in_order", budget=None)
    async with fake_replicas(cut, FAST, names=["cut", "backup"]) as (a, b):
        async with Gateway(config_for([a, b], hedger=hedger)) as gw, httpx.AsyncClient() as http:
            with trio.fail_after(10):
                raw = await http.post(f"{gw.url}/chat/completions", json={**CHAT, "stream": True})
    events = [e.removeprefix("data: ") for e in raw.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in chunks if e.get("choices")
    )
    assert text == TEXT
    assert {e["id"] for e in chunks} == {"chatcmpl-cut-0"}
    assert len(b.requests) == 1  # the recovery


# -- the wire ----------------------------------------------------------------------------------


def _normalised(text: str) -> list[str]:
    """The data lines, with the per-request id and creation time blanked."""
    lines = [e for e in text.split("\n\n") if e]
    return [re.sub(r'"(id|created)":("[^"]*"|\d+)', r'"\1":_', line) for line in lines]


async def test_the_winners_events_are_relayed_byte_for_byte() -> None:
    async with FakeReplica(FAST, name="a") as a:
        async with Gateway(config_for([a])) as gw, httpx.AsyncClient() as http:
            body = {**CHAT, "stream": True}
            direct = await http.post(f"{a.url}/chat/completions", json=body)
            relayed = await http.post(f"{gw.url}/chat/completions", json=body)
    assert relayed.headers["content-type"].startswith("text/event-stream")
    # The server's compact JSON, key order and all: no re-encoding on the way.
    assert _normalised(relayed.text) == _normalised(direct.text)
    assert relayed.text.endswith("data: [DONE]\n\n")


async def test_curl_sees_tokens_as_they_are_produced() -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    paced = Behaviour(ttft=0.0, token_delay=0.3, tokens=4)
    async with FakeReplica(paced, name="a") as a:
        async with Gateway(config_for([a])) as gw:
            command = [
                curl, "-sN", f"{gw.url}/chat/completions", "-H", "content-type: application/json",
                "-d", json.dumps({**CHAT, "stream": True}),
            ]  # fmt: skip
            async with trio.open_nursery() as nursery:
                run = functools.partial(trio.run_process, command, stdout=-1, check=False)
                process = await nursery.start(run)
                seen = b""
                with trio.fail_after(10):
                    while b"tok0" not in seen:
                        seen += await process.stdout.receive_some()
                # The first token reached curl while the replica was still producing.
                assert a.requests[0].tokens_sent < 4
                with trio.fail_after(10):
                    while chunk := await process.stdout.receive_some():
                        seen += chunk
    assert seen.endswith(b"data: [DONE]\n\n") and b"tok3" in seen


async def test_h2c_clients_are_served() -> None:
    async with fake_replicas(SLOW, FAST, names=["slow", "fast"]) as replicas:
        async with Gateway(config_for(replicas)) as gw:
            async with httpx.AsyncClient(http1=False, http2=True) as http:
                async with http.stream(
                    "POST", f"{gw.url}/chat/completions", json={**CHAT, "stream": True}
                ) as response:
                    text = await response.aread()
    assert response.http_version == "HTTP/2"
    assert response.headers["x-hedge-replica"] == "fast"
    assert b"tok3" in text and text.endswith(b"data: [DONE]\n\n")


# -- the client leaving ------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before the first token", "mid-stream"])
async def test_client_disconnect_closes_every_upstream_attempt(when: str) -> None:
    if when == "before the first token":
        behaviours = (SLOW, SLOW)  # hedged at 0.05 s: two attempts running, no token
    else:
        streaming = Behaviour(ttft=0.0, token_delay=0.05, tokens=1000)
        behaviours = (SLOW, streaming)
    async with fake_replicas(*behaviours, names=["a", "b"]) as (a, b):
        async with Gateway(config_for([a, b])) as gw:
            baseline = count_tasks()
            streaming_started = trio.Event()

            async def request(http: httpx.AsyncClient) -> None:
                url = f"{gw.url}/chat/completions"
                async with http.stream("POST", url, json={**CHAT, "stream": True}) as response:
                    async for piece in response.aiter_raw():
                        if b"tok2" in piece:
                            streaming_started.set()

            async with httpx.AsyncClient() as http, trio.open_nursery() as nursery:
                nursery.start_soon(request, http)
                with trio.fail_after(10):
                    await a.wait_request(0)
                    await b.wait_request(0)  # both attempts are running
                    if when == "mid-stream":
                        await streaming_started.wait()
                closed_at = trio.current_time()
                nursery.cancel_scope.cancel()  # the client goes away: its socket closes
            with trio.fail_after(5):
                ra = await a.wait_disconnected(0)
                rb = await b.wait_disconnected(0)
                await a.wait_connections(0)
                await b.wait_connections(0)
                # No event says "the handler and its watcher are gone": poll, bounded.
                while count_tasks() > baseline:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            assert gw.config.limits.max_concurrent == 1000
    for record in (ra, rb):
        assert record.disconnected_at is not None
        assert record.disconnected_at - closed_at < 0.05
    assert not rb.completed


# -- headers -------------------------------------------------------------------------------


async def test_idempotency_keys_are_namespaced_per_gateway_key() -> None:
    # Two tenants of the gateway choose the same Idempotency-Key: forwarded as it came (on
    # c6222d8), the upstream, which sees one client (the gateway), would run one request and
    # replay its answer to the other tenant. Each key's name prefixes it.
    keys = [GatewayKey("sk-team-one-secret", "one"), GatewayKey("sk-team-two-secret", "two")]
    async with fake_replicas(FAST, names=["a"]) as (a,):
        config = config_for([a], keys=keys)
        async with Gateway(config) as gw, httpx.AsyncClient() as http:
            for secret in ("sk-team-one-secret", "sk-team-two-secret"):
                response = await http.post(
                    f"{gw.url}/chat/completions",
                    json=CHAT,
                    headers={"authorization": f"Bearer {secret}", "idempotency-key": "k-1"},
                )
                assert response.status_code == 200
    sent = [r.headers["idempotency-key"] for r in a.requests]
    assert sent == ["one:k-1", "two:k-1"]


async def test_request_headers_steer_the_race() -> None:
    limits = Limits(hedge_after_max=0.3, drain_timeout=1.0)
    slowish = Behaviour(ttft=0.6, tokens=2)
    async with fake_replicas(slowish, FAST, names=["a", "b"]) as (a, b):
        async with Gateway(config_for([a, b], limits=limits)) as gw, httpx.AsyncClient() as http:
            url = f"{gw.url}/chat/completions"
            rid = "0B9F0C36-4F57-4D0E-9C85-3C2B7B6F0A11"
            with trio.fail_after(10):
                off = await http.post(
                    url, json=CHAT, headers={"x-hedge": "off", "x-request-id": rid}
                )
                late = await http.post(url, json=CHAT, headers={"x-hedge-after": "99"})
                keyed = await http.post(
                    url, json=CHAT, headers={"idempotency-key": "k-1", "x-request-id": "not-a-uuid"}
                )
    # X-Hedge: off: the primary alone, after its 0.6 s; the UUID kept (canonical form).
    assert off.headers["x-hedge-replica"] == "a" and off.headers["x-hedge-attempts"] == "1"
    assert off.headers["x-request-id"] == rid.lower() == a.requests[0].headers["x-request-id"]
    # X-Hedge-After: 99 is clamped to hedge_after_max = 0.3: the backup starts then, and wins.
    assert late.headers["x-hedge-replica"] == "b"
    started = b.requests[0].received_at - a.requests[1].received_at
    assert 0.25 <= started < 0.55  # received_at is after the transit; the hedge fired at 0.3
    # Idempotency-Key goes to every attempt; a request id that is not a UUID is replaced.
    assert a.requests[2].headers["idempotency-key"] == b.requests[1].headers["idempotency-key"]
    assert a.requests[2].headers["idempotency-key"] == "k-1"
    new_id = keyed.headers["x-request-id"]
    assert new_id != "not-a-uuid" and a.requests[2].headers["x-request-id"] == new_id


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        (b"{not json", {}, None),
        (b"[1, 2]", {}, None),
        (json.dumps({"model": "m"}).encode(), {}, "messages"),
        (json.dumps({"model": "m", "messages": []}).encode(), {}, "messages"),
        (json.dumps({**CHAT, "stream": "yes"}).encode(), {}, "stream"),
        (json.dumps({**CHAT, "n": 2}).encode(), {}, "n"),
        (json.dumps(CHAT).encode(), {"x-hedge": "maybe"}, "X-Hedge"),
        (json.dumps(CHAT).encode(), {"x-hedge-after": "-1"}, "X-Hedge-After"),
        (json.dumps(CHAT).encode(), {"x-hedge-after": "nan"}, "X-Hedge-After"),
    ],
)
async def test_bad_requests_get_400_and_nothing_goes_upstream(
    body: bytes, headers: dict[str, str], param: str | None
) -> None:
    async with FakeReplica(FAST, name="a") as a:
        async with Gateway(config_for([a])) as gw, httpx.AsyncClient() as http:
            response = await http.post(f"{gw.url}/chat/completions", content=body, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert a.requests == []


async def test_routes_methods_and_models() -> None:
    async with fake_replicas(FAST, FAST, names=["a", "b"]) as (a, b):
        b.model = "other-model"
        config = config_for([a, b])
        groups = (
            attrs.evolve(config.groups[0], name="small", replicas=("b",), models=("small-*",)),
            attrs.evolve(config.groups[0], name="big", replicas=("a",), models=("big",)),
        )
        config = attrs.evolve(config, groups=groups)
        async with Gateway(config) as gw, httpx.AsyncClient() as http:
            url = f"{gw.url}/chat/completions"
            small = await http.post(url, json={**CHAT, "model": "small-1"})
            big = await http.post(url, json={**CHAT, "model": "big"})
            unknown = await http.post(url, json={**CHAT, "model": "nope"})
            models = await http.get(f"{gw.url}/models")
            wrong_method = await http.get(url)
            no_route = await http.get(f"{gw.base_url}/v2/whatever")
    assert small.headers["x-hedge-replica"] == "b" and big.headers["x-hedge-replica"] == "a"
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    # What the replicas list but no group of theirs takes (fake-model, other-model) would be
    # refused: not listed (issue 31); the group's literal name is.
    assert [m["id"] for m in models.json()["data"]] == ["big"]
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert no_route.status_code == 404


# -- limits ---------------------------------------------------------------------------------


async def test_body_size_and_concurrency_limits() -> None:
    limits = Limits(max_body_bytes=2000, max_concurrent=1, max_queue=0, drain_timeout=1.0)
    held = Behaviour(ttft=0.0, token_delay=0.02, tokens=1000)
    async with FakeReplica(held, name="a") as a:
        async with Gateway(config_for([a], limits=limits)) as gw, httpx.AsyncClient() as http:
            url = f"{gw.url}/chat/completions"
            big = {**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]}
            too_big = await http.post(url, json=big)

            async def chunked() -> Any:
                yield json.dumps(big).encode()  # no Content-Length: counted while read

            too_big_chunked = await http.post(url, content=chunked())
            async with http.stream("POST", url, json={**CHAT, "stream": True}) as first:
                async for piece in first.aiter_raw():
                    if b"tok0" in piece:
                        break
                busy = await http.post(url, json=CHAT)
            with trio.fail_after(5):
                await a.wait_disconnected(0)
    assert too_big.status_code == 413 and too_big_chunked.status_code == 413
    assert too_big.json()["error"]["code"] == "request_too_large"
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["type"] == "server_error"
    assert busy.json()["error"]["code"] == "queue_full"  # max_queue=0: no queue at all
    assert busy.headers["x-should-retry"] == "true"  # a short Retry-After: a retry can help
    assert len(a.requests) == 1  # nothing refused went upstream


async def test_the_request_deadline() -> None:
    limits = Limits(request_timeout=0.3, drain_timeout=1.0)
    paced = Behaviour(ttft=0.0, token_delay=0.1, tokens=100)
    async with fake_replicas(SLOW, paced, names=["slow", "paced"]) as (slow, paced_replica):
        config = config_for([slow], limits=limits)
        async with Gateway(config) as gw, httpx.AsyncClient() as http:
            before = await http.post(f"{gw.url}/chat/completions", json=CHAT)
        config = config_for([paced_replica], limits=limits)
        async with Gateway(config) as gw, httpx.AsyncClient() as http:
            after = await http.post(f"{gw.url}/chat/completions", json={**CHAT, "stream": True})
            with trio.fail_after(5):
                await paced_replica.wait_disconnected(0)
            # A body that never completes holds a slot only until the deadline.
            port = int(gw.base_url.rsplit(":", 1)[1])
            with trio.fail_after(5):
                sock = await trio.open_tcp_stream("127.0.0.1", port)
                async with sock:
                    await sock.send_all(
                        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                        b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{"
                    )
                    trickled = b""
                    while b"\r\n\r\n" not in trickled:
                        trickled += await sock.receive_some()
    assert before.status_code == 504 and before.json()["error"]["code"] == "request_timeout"
    assert trickled.startswith(b"HTTP/1.1 408")
    assert after.status_code == 200
    last = [e for e in after.text.split("\n\n") if e][-1]
    assert json.loads(last.removeprefix("data: "))["error"]["code"] == "request_timeout"
    assert "[DONE]" not in after.text


# -- authentication, secrets --------------------------------------------------------------------


async def test_gateway_keys(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    key = "sk-gateway-key-0123456789"
    async with FakeReplica(FAST, name="a") as a:
        config = config_for([a], keys=("sk-other-key", key))
        async with Gateway(config) as gw, httpx.AsyncClient() as http:
            url = f"{gw.url}/chat/completions"
            none = await http.post(url, json=CHAT)
            wrong = await http.post(url, json=CHAT, headers={"authorization": f"Bearer {key}x"})
            right = await http.post(url, json=CHAT, headers={"authorization": f"Bearer {key}"})
            models = await http.get(f"{gw.url}/models")
            health = await http.get(f"{gw.base_url}/healthz")
    assert none.status_code == wrong.status_code == models.status_code == 401
    assert none.json()["error"]["code"] == "invalid_api_key"
    assert none.headers["www-authenticate"] == "Bearer"
    assert right.status_code == 200 and health.status_code == 200
    assert "authorization" not in a.requests[0].headers  # the gateway's key stays here
    assert len(a.requests) == 1
    assert key not in caplog.text and key[3:15] not in caplog.text
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name.endswith("access")]
    assert [line["status"] for line in access] == [401, 401, 200, 401, 200]


async def test_a_forwarded_client_key_is_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    client_key = "sk-client-own-key-abcdef"
    echo = Behaviour(status=401, error_message=f"Incorrect API key provided: {client_key}.")
    async with fake_replicas(echo, echo, names=["a", "b"]) as (a, b):
        config = config_for([a, b], forward_client_key=True)
        async with Gateway(config) as gw, httpx.AsyncClient() as http:
            response = await http.post(
                f"{gw.url}/chat/completions",
                json=CHAT,
                headers={"authorization": f"Bearer {client_key}"},
            )
    assert a.requests[0].headers["authorization"] == f"Bearer {client_key}"
    assert response.status_code == 401
    assert client_key not in response.text and "***" in response.json()["error"]["message"]
    assert client_key not in caplog.text and "sk-client-own" not in caplog.text


# -- operations ------------------------------------------------------------------------------


async def test_health_readiness_metrics_and_pushback() -> None:
    # Both replicas push back for 5 s; the Hedger waits at most 0.1 s for a cooling replica.
    pushback = Behaviour(status=503, retry_after=5)
    hedger = attrs.evolve(HEDGER, max_pushback_wait=0.1)
    async with fake_replicas(pushback, pushback, names=["a", "b"]) as replicas:
        async with Gateway(config_for(replicas, hedger=hedger)) as gw, httpx.AsyncClient() as http:
            ready = await http.get(f"{gw.base_url}/readyz")
            failed = await http.post(f"{gw.url}/chat/completions", json=CHAT)
            cooling = await http.post(f"{gw.url}/chat/completions", json=CHAT)
            still_ready = await http.get(f"{gw.base_url}/readyz")
            health = await http.get(f"{gw.base_url}/healthz")
            metrics = (await http.get(f"{gw.base_url}/metrics")).text
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert failed.status_code == 503 and failed.headers["retry-after"] == "5"
    # Every replica cooling longer than the Hedger waits: refused at once, nothing sent.
    assert cooling.status_code == 503 and cooling.json()["error"]["code"] == "replicas_cooling"
    assert 4 <= int(cooling.headers["retry-after"]) <= 5
    assert [len(r.requests) for r in replicas] == [1, 1]
    # The model is out on every replica, the gateway is not: every instance sees the same
    # upstream (a load balancer can route around none of them); the body says which model.
    assert still_ready.status_code == 200, still_ready.text
    assert still_ready.json()["groups"] == {"default": {"a": "degraded", "b": "degraded"}}
    assert still_ready.json()["models_out"] == {"default": ["m"]}
    assert health.status_code == 200
    for line in (
        'trio_hedge_gateway_requests_total{path="/v1/chat/completions",status="503"} 2.0',
        'trio_hedge_gateway_requests_total{path="/readyz",status="200"} 2.0',
        'trio_hedge_attempts_total{outcome="failed",replica="a",trigger="primary"} 1.0',
        'trio_hedge_gateway_replica_state{api="chat",group="default",replica="b",'
        'state="degraded"} 1.0',
        "trio_hedge_gateway_in_flight 0.0",
    ):
        assert line in metrics


def _replica(name: str, state: str = "healthy", **models: tuple[str, ...]) -> Any:
    from trio_hedge.policy import ReplicaStatistics

    fields = dict.fromkeys(
        ("in_flight", "attempts", "wins", "failures", "times_ejected", "consecutive_failures"), 0
    )
    return ReplicaStatistics(
        name=name,
        state=state,
        cooling_for=0.0,
        ejected_for=0.0,
        latency=0.0,
        cooling_models=models.get("cooling", ()),
        ejected_models=models.get("ejected", ()),
        **fields,
    )


READINESS = [
    # (name, the chat route's replicas, status, models out on every replica)
    ("every replica healthy", [_replica("a"), _replica("b")], "ready", {}),
    # Issue 27: a serves model x, b serves y; one failing request per model ejected each for
    # the model it does not serve. On c6222d8 each counted as ejected whole: 503.
    (
        "each replica out for the model it does not serve",
        [_replica("a", "degraded", ejected=("y",)), _replica("b", "degraded", ejected=("x",))],
        "ready",
        {},
    ),
    # A model out on every replica (a per-model rate limit): its requests get their own
    # answer; the gateway stays in its load balancer for the others (every instance sees
    # the same upstream: taking them out refused every model's requests).
    (
        "every replica cooling for the one model",
        [_replica("a", "degraded", cooling=("m",)), _replica("b", "degraded", cooling=("m",))],
        "ready",
        {"default": ["m"]},
    ),
    (
        "one ejected whole, the other out for the model",
        [_replica("a", "ejected"), _replica("b", "degraded", ejected=("m",))],
        "ready",
        {"default": ["m"]},
    ),
    (
        "every replica ejected whole",
        [_replica("a", "ejected"), _replica("b", "ejected")],
        "no eligible replica",
        {},
    ),
]


@pytest.mark.parametrize(
    ("name", "replicas", "status", "models_out"), READINESS, ids=[r[0] for r in READINESS]
)
def test_readiness_reads_scopes(
    name: str, replicas: list[Any], status: str, models_out: dict[str, list[str]]
) -> None:
    from trio_hedge.gateway._app import readiness

    got, body = readiness({"chat": {"default": replicas}}, draining=False)
    assert got == status and body["status"] == status
    assert body["models_out"] == models_out
    assert readiness({"chat": {"default": replicas}}, draining=True)[0] == "draining"
