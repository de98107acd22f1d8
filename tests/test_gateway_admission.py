"""Many tenants, one fleet (issue 30), over real loopback sockets with the official openai SDK
as the client, its default retries on: a burst past ``max_concurrent`` waits in the queue
instead of a 503, or is refused with the queue's own Retry-After; an exhausted request reaches
the fleet once; a high-priority class keeps its hedge rescues while a low-priority flood
spends the budget; a client's priority is clamped to its key's range."""

from __future__ import annotations

import functools
import json
import logging
import statistics
from typing import Any

import attrs
import httpx
import pytest
import trio

import trio_hedge as th
from trio_hedge.gateway import GatewayKey, Limits
from trio_hedge.policy import HedgeBudget
from trio_hedge.testing import Behaviour, FakeReplica, RequestRecord, fake_replicas

from .gateway_support import CHAT, HEDGER, Gateway, config_for

openai = pytest.importorskip("openai")


def _client(gw: Gateway, key: str = "sk-test") -> Any:
    """The SDK as an application uses it: default retries (2) and timeouts."""
    return openai.AsyncOpenAI(base_url=gw.url, api_key=key)


def _most_at_once(records: list[RequestRecord]) -> int:
    """The most requests a replica was working on at the same time."""
    edges = sorted(
        [(r.received_at, 1) for r in records]
        + [(r.finished_at if r.finished_at is not None else float("inf"), -1) for r in records],
        key=lambda e: (e[0], e[1]),
    )
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


# -- a burst: queued, or refused with the queue's Retry-After ------------------------------


async def test_a_burst_of_three_times_max_concurrent_is_served_by_the_queue() -> None:
    """12 requests at once on 4 slots, queue_wait covering the drain (3 rounds of ~0.15 s):
    every one served, none refused, none retried by the SDK; the upstream never had more
    than 4 at once; the 8 that waited say so (header, metric)."""
    service = Behaviour(ttft=0.05, token_delay=0.02, tokens=5)
    limits = Limits(max_concurrent=4, queue_wait=5.0, drain_timeout=1.0)
    async with FakeReplica(service, name="a") as a:
        async with Gateway(config_for([a], limits=limits)) as gw:
            client = _client(gw)
            waits: list[float] = []

            async def one() -> None:
                raw = await client.chat.completions.with_raw_response.create(**CHAT)
                assert raw.parse().choices[0].message.content == "tok0 tok1 tok2 tok3 tok4 "
                waits.append(float(raw.headers["x-hedge-queue-wait"]))

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    for _ in range(12):
                        nursery.start_soon(one)
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"{gw.base_url}/metrics")).text
            await client.close()
    assert len(waits) == 12
    assert len(a.requests) == 12  # no refusal, so no retry
    assert _most_at_once(a.requests) == 4
    waits.sort()
    assert waits[:4] == [0.0] * 4 and all(w > 0.1 for w in waits[4:])
    assert 'trio_hedge_gateway_queue_wait_seconds_count{priority="0"} 12.0' in metrics
    assert 'reason="queue_timeout"' not in metrics and 'reason="queue_full"' not in metrics


async def test_a_burst_the_queue_cannot_hold_is_refused_with_its_drain_time() -> None:
    """The same burst with queue_wait 0.2 s and ~0.45 s per request: 4 served, 8 refused
    with 503 queue_timeout, ``x-should-retry: false`` (so the SDK does not send them again)
    and a Retry-After from the drain rate that says when each would have had a slot: the
    refused cohort is told a spread, on average the wait they had left, each within half a
    request's time of its own."""
    service = Behaviour(ttft=0.1, token_delay=0.05, tokens=8)
    limits = Limits(max_concurrent=4, queue_wait=0.2, drain_timeout=1.0)
    async with FakeReplica(service, name="a") as a:
        async with Gateway(config_for([a], limits=limits)) as gw:
            client = _client(gw)
            # One round first: the gateway learns how long a request takes.
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(lambda: client.chat.completions.create(**CHAT))
            served: list[float] = []
            refused: list[tuple[float, Any]] = []
            start = trio.current_time()

            async def one() -> None:
                try:
                    await client.chat.completions.create(**CHAT)
                    served.append(trio.current_time())
                except openai.InternalServerError as error:
                    refused.append((trio.current_time(), error.response))

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    for _ in range(12):
                        nursery.start_soon(one)
            await client.close()
    assert (len(served), len(refused)) == (4, 8)
    assert len(a.requests) == 8  # 4 + 4: not one refused request reached the replica
    took = statistics.mean(r.finished_at - r.received_at for r in a.requests[:4])  # type: ignore[operator]
    for _, response in refused:
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "queue_timeout"
        assert response.headers["x-should-retry"] == "false"
        exact = int(response.headers["retry-after-ms"]) / 1000
        assert int(response.headers["retry-after"]) == max(1, -int(-exact // 1))  # rounded up
    # When each would have had a slot: the first 4 when the running ones end, the next 4
    # one request's time later.
    ends = sorted(r.finished_at for r in a.requests[4:])  # type: ignore[type-var]
    told = sorted(
        at + int(response.headers["retry-after-ms"]) / 1000 - start for at, response in refused
    )
    slots = [ends[0] - start] * 4 + [ends[0] - start + took] * 4
    assert statistics.mean(told) == pytest.approx(statistics.mean(slots), abs=0.15)
    for estimate, slot in zip(told, slots, strict=True):
        assert abs(estimate - slot) <= took / 2 + 0.1


async def test_a_full_queue_with_a_short_retry_after_says_retry() -> None:
    """No queue at all (max_queue 0): past max_concurrent, 503 queue_full at once, and the
    SDK retries it (x-should-retry: true, Retry-After 1 s): the retry is served."""
    held = Behaviour(ttft=0.0, token_delay=0.02, tokens=20)  # ~0.4 s
    limits = Limits(max_concurrent=1, max_queue=0, drain_timeout=1.0)
    async with FakeReplica(held, name="a") as a:
        async with Gateway(config_for([a], limits=limits)) as gw:
            client = _client(gw)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: client.chat.completions.create(**CHAT))
                await trio.sleep(0.1)
                async with httpx.AsyncClient() as http:
                    busy = await http.post(f"{gw.url}/chat/completions", json=CHAT)
                second = await client.chat.completions.create(**CHAT)  # refused, then retried
            await client.close()
    assert busy.status_code == 503 and busy.json()["error"]["code"] == "queue_full"
    assert busy.headers["x-should-retry"] == "true" and busy.headers["retry-after"] == "1"
    assert second.choices[0].message.content
    assert len(a.requests) == 2


async def test_a_client_that_leaves_while_queued_gives_its_place_back_at_once() -> None:
    """One slot, held ~1.5 s, and one place in the queue; a second request waits there and
    its client leaves: the place is free at once (a third request takes it, where a 503
    queue_full would say the gone client still held it until its turn), and the second
    never reaches the replica."""
    held = Behaviour(ttft=0.0, token_delay=0.02, tokens=75)
    limits = Limits(max_concurrent=1, max_queue=1, queue_wait=30.0, drain_timeout=1.0)
    async with FakeReplica(held, name="a") as a:
        async with Gateway(config_for([a], limits=limits)) as gw, httpx.AsyncClient() as http:
            url = f"{gw.url}/chat/completions"
            metrics_url = f"{gw.base_url}/metrics"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(http.post, url, json=CHAT))
                await a.wait_request(0)
                with trio.move_on_after(0.2):  # the second client gives up while it waits
                    await http.post(url, json=CHAT)
                left = trio.current_time()
                with trio.fail_after(0.5):  # the gateway's own state, read as an operator would
                    while "trio_hedge_gateway_queued 0.0" not in (await http.get(metrics_url)).text:  # noqa: ASYNC110
                        await trio.sleep(0.01)
                freed = trio.current_time() - left
                third = await http.post(url, json=CHAT)  # waits in the place the second left
            metrics = (await http.get(metrics_url)).text
    assert freed < 0.5 and third.status_code == 200
    assert len(a.requests) == 2  # the first and the third: the second never went upstream
    assert 'trio_hedge_gateway_requests_total{path="/v1/chat/completions",status="499"} 1.0' in (
        metrics
    )


async def test_the_messages_route_shares_the_queue_and_answers_in_its_shape() -> None:
    """A chat request holds the only slot: a Messages request is refused as Anthropic
    clients expect a full server (529 overloaded, their error shape), and says a retry can
    help."""
    held = Behaviour(ttft=0.0, token_delay=0.02, tokens=20)
    limits = Limits(max_concurrent=1, max_queue=0, drain_timeout=1.0)
    async with FakeReplica(held, name="a") as a:
        async with Gateway(config_for([a], limits=limits)) as gw, httpx.AsyncClient() as http:
            chat = {**CHAT, "stream": True}
            async with http.stream("POST", f"{gw.url}/chat/completions", json=chat):
                body = {"model": "m", "max_tokens": 8, "messages": CHAT["messages"]}
                busy = await http.post(f"{gw.url}/messages", json=body)
    assert busy.status_code == 529
    assert busy.json()["type"] == "error" and busy.json()["error"]["type"] == "overloaded_error"
    assert busy.headers["x-should-retry"] == "true"


# -- the retry contract ----------------------------------------------------------------------


async def test_an_exhausted_request_reaches_the_fleet_once() -> None:
    """Both replicas answer 503: the gateway tried every replica it may and says
    ``x-should-retry: false``; the SDK's default retries then send nothing more (each
    replica got one request). The control: the SDK alone against the same replica sends it
    three times."""
    down = Behaviour(status=503)
    async with fake_replicas(down, down, names=["a", "b"]) as (a, b):
        async with Gateway(config_for([a, b])) as gw:
            client = _client(gw)
            with pytest.raises(openai.InternalServerError) as info:
                await client.chat.completions.create(**CHAT)
            await client.close()
        assert info.value.response.headers["x-should-retry"] == "false"
        assert (len(a.requests), len(b.requests)) == (1, 1)
        direct = openai.AsyncOpenAI(base_url=a.url, api_key="sk-test")
        with pytest.raises(openai.InternalServerError):
            await direct.chat.completions.create(**CHAT)
        await direct.close()
        assert len(a.requests) == 1 + 3


async def test_the_library_tries_a_gateway_that_said_do_not_retry_once() -> None:
    """A Hedger in front of a gateway (two attempts per replica allowed): the gateway's
    exhausted 503 with ``x-should-retry: false`` is not sent to it again; another replica
    is tried and answers."""
    down = Behaviour(status=503)
    up = Behaviour(ttft=0.0, tokens=2)
    async with fake_replicas(down, down, up, names=["a", "b", "other"]) as (a, b, other):
        async with Gateway(config_for([a, b])) as gw:
            config = th.HedgerConfig(
                hedge_after=None,
                attempts_per_replica=2,
                budget=None,
                throttle=None,
                outlier_detection=None,
                pick="in_order",
            )
            replicas = [th.Replica(gw.url, name="gateway"), th.Replica(other.url, name="other")]
            async with th.Hedger(replicas, config) as hedger:
                async with hedger.stream(CHAT) as stream:
                    text = "".join([t async for t in stream])
    assert text == "tok0 tok1 "
    assert [x.replica for x in stream.report.attempts] == ["gateway", "other"]
    assert stream.report.attempts[0].error is not None
    assert stream.report.attempts[0].error.should_retry is False
    assert (len(a.requests), len(b.requests)) == (1, 1)


# -- hedging by priority ---------------------------------------------------------------------

LOW = GatewayKey("sk-low-0123456789", "low", priority=0)
HIGH = GatewayKey("sk-high-0123456789", "high", priority=5)


def _primary(record: RequestRecord) -> Behaviour:
    """Stuck behind someone's long prefill when the prompt says so."""
    if "stuck" in json.dumps(record.json):
        return Behaviour(ttft=2.0, tokens=2)
    return Behaviour(ttft=0.0, tokens=2)


async def _flood_then_rescue(priority_reserve: float) -> tuple[int, int, str]:
    """One high-priority request (class 5 in the budget's window), 40 stuck low-priority
    ones at once, then 20 stuck high-priority ones: ``(high rescued, low rescued,
    /metrics)``."""
    budget = HedgeBudget(
        ratio=0.5, min_per_second=0.1, window=60.0, priority_reserve=priority_reserve
    )
    hedger = attrs.evolve(HEDGER, budget=budget)
    async with fake_replicas(_primary, Behaviour(ttft=0.01, tokens=2), names=["a", "b"]) as (
        a,
        b,
    ):
        config = config_for([a, b], hedger=hedger, keys=(LOW, HIGH))
        async with Gateway(config) as gw:
            low, high = _client(gw, LOW.key), _client(gw, HIGH.key)
            rescued = {"low": 0, "high": 0}
            stuck = {**CHAT, "messages": [{"role": "user", "content": "stuck"}]}

            async def one(client: Any, name: str) -> None:
                raw = await client.chat.completions.with_raw_response.create(**stuck)
                if (
                    raw.headers["x-hedge-hedged"] == "true"
                    and raw.headers["x-hedge-replica"] == "b"
                ):
                    rescued[name] += 1

            await high.chat.completions.create(**CHAT)
            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for _ in range(40):
                        nursery.start_soon(one, low, "low")
                    await trio.sleep(0.5)  # their hedges decided
                    for _ in range(20):
                        nursery.start_soon(one, high, "high")
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"{gw.base_url}/metrics")).text
            await low.close()
            await high.close()
    return rescued["high"], rescued["low"], metrics


async def test_a_high_class_keeps_its_rescues_while_a_low_flood_spends_the_budget() -> None:
    high, low, metrics = await _flood_then_rescue(priority_reserve=0.5)
    # Capacity when the flood hedges: 0.5 x 41 requests + 6 = 26.5; the low class may take
    # it down to half: ~13 rescues (a hedge due before every primary of the flood started
    # sees a little less, after a little more: real time); the 20 high ones find
    # 0.5 x 61 + 6 - 13 = 23.5 left.
    assert high >= 19
    assert 11 <= low <= 15
    assert f'trio_hedge_hedges_refused_total{{reason="priority"}} {40 - low}.0' in metrics
    # The control: classes sharing the budget alike, the flood spends what the high class
    # needed.
    high, low, _ = await _flood_then_rescue(priority_reserve=0.0)
    assert high < 19 and low > 13


# -- a client's priority ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "status", "priority"),
    [
        (None, 200, 1),  # the key's default
        ("2", 200, 2),
        ("-5", 200, 1),  # never below the key's default
        ("99", 200, 4),  # never above the key's highest
        ("99999999999999999999999999", 200, 4),
        ("-99999999999999999999999999", 200, 1),
        ("+3", 200, 3),
        ("abc", 400, None),
        ("1.5", 400, None),
    ],
)
async def test_a_clients_priority_is_clamped_to_its_keys_range(
    caplog: pytest.LogCaptureFixture, header: str | None, status: int, priority: int | None
) -> None:
    """Another key's request, sent alongside, keeps its own class whatever this one asks."""
    caplog.set_level(logging.INFO, logger="trio_hedge.gateway.access")
    keys = (
        GatewayKey("sk-team-a-0123456789", "team-a", priority=1, max_priority=4),
        GatewayKey("sk-team-b-0123456789", "team-b"),
    )
    limits = Limits(priority_header=True, drain_timeout=1.0)
    async with FakeReplica(Behaviour(ttft=0.0, tokens=2), name="r") as r:
        async with Gateway(config_for([r], keys=keys, limits=limits)) as gw:
            async with httpx.AsyncClient() as http:
                headers = {"authorization": f"Bearer {keys[0].key}"}
                if header is not None:
                    headers["x-priority"] = header
                answer = await http.post(f"{gw.url}/chat/completions", json=CHAT, headers=headers)
                other = await http.post(
                    f"{gw.url}/chat/completions",
                    json=CHAT,
                    headers={"authorization": f"Bearer {keys[1].key}", "x-priority": "9"},
                )
    assert answer.status_code == status and other.status_code == 200
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name.endswith("access")]
    by_key = {line["key"]: line for line in lines}
    assert by_key["team-a"].get("priority") == priority
    assert by_key["team-b"]["priority"] == 0  # limits' range: 0 to 0
    if status == 400:
        assert answer.json()["error"]["param"] == "X-Priority"
        assert answer.headers["x-should-retry"] == "false"


async def test_the_priority_header_is_ignored_unless_allowed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trio_hedge.gateway.access")
    keys = (GatewayKey("sk-team-a-0123456789", "team-a", priority=1, max_priority=4),)
    async with FakeReplica(Behaviour(ttft=0.0, tokens=2), name="r") as r:
        async with Gateway(config_for([r], keys=keys)) as gw:
            async with httpx.AsyncClient() as http:
                headers = {"authorization": f"Bearer {keys[0].key}", "x-priority": "junk"}
                answer = await http.post(f"{gw.url}/chat/completions", json=CHAT, headers=headers)
    assert answer.status_code == 200
    (line,) = [json.loads(x.getMessage()) for x in caplog.records if x.name.endswith("access")]
    assert line["priority"] == 1
