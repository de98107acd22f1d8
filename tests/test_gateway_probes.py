"""The gateway's load probes and per-replica options (issues 21 and 17): the TOML fields, one
poller per replica for every Hedger of the gateway (each group's, on every route), the probe
state and every route's replicas on ``/metrics`` and ``/readyz``.

In-process over real loopback sockets (FakeReplica upstreams and engine pages); every wait is
on an event under a ``trio.fail_after`` bound. Probes poll with a long ``interval`` so that
the count of polls is exact: each poller reads its engine once, when the gateway starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

import trio_hedge as th
from trio_hedge.gateway import ConfigError, Group, parse_config
from trio_hedge.gateway._agent import as_api
from trio_hedge.sources.probes import LoadProbe
from trio_hedge.testing import Behaviour, EnginePage, FakeReplica, llama_slots_page

from .gateway_support import CHAT, HEDGER, Gateway, config_for

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MESSAGES: dict[str, Any] = {"model": "m", "max_tokens": 16, "messages": CHAT["messages"]}
RESPONSES: dict[str, Any] = {"model": "m", "input": "hello there"}
#: Each poller reads its engine once (when the gateway starts) and trusts it all the test.
ONCE = LoadProbe("llama.cpp", interval=1000.0, max_age=1000.0)


# -- the TOML fields -------------------------------------------------------------------------


def _replica(**fields: Any) -> th.Replica:
    document = {"replicas": [{"base_url": "http://a:8000/v1", **fields}]}
    return parse_config(document, environ={}).replicas[0]


def test_per_replica_options_are_read() -> None:
    assert _replica(probe="vllm").probe == LoadProbe("vllm")
    assert _replica(probe=False).probe is None and _replica().probe is None
    table = {
        "engine": "llama.cpp",
        "path": "/metrics",
        "interval": 0.5,
        "max_age": 2,
        "timeout": 0.25,
        "max_body": 65536,
        "cancel_quiet": 1.5,
        "prefill_rate": 650,
        "queued_request_seconds": 0.5,
        "kv_limit": 0.9,
    }
    assert _replica(probe=table).probe == LoadProbe(
        "llama.cpp",
        path="/metrics",
        interval=0.5,
        max_age=2,
        timeout=0.25,
        max_body=65536,
        cancel_quiet=1.5,
        prefill_rate=650,
        queued_request_seconds=0.5,
        kv_limit=0.9,
    )
    # false for "none" where the field is not a boolean: the engine's defaults.
    assert _replica(probe={"engine": "llama.cpp", "cancel_quiet": False}).probe.quiet == 1.2  # type: ignore[union-attr]
    r = _replica(continuation="vllm", context_window=8192, fallback=True, backup_priority=1)
    assert (r.continuation, r.context_window, r.fallback, r.backup_priority) == (
        "vllm",
        8192,
        True,
        1,
    )
    r = _replica(continuation=False, context_window=False, backup_priority=False)
    assert (r.continuation, r.context_window, r.backup_priority) == (None, None, None)
    # Every route's replica has them, but continuation (the chat endpoints' contract).
    for api in ("anthropic", "responses"):
        other = as_api(
            attrs.evolve(r, continuation="vllm", context_window=4096, fallback=True, probe=ONCE),
            api,
        )
        assert (other.continuation, other.context_window, other.fallback) == (None, 4096, True)
        assert other.probe == ONCE


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"probe": "ollama"}, "replicas[0].probe must be one of"),
        ({"probe": 3}, "replicas[0].probe must be a table"),
        ({"probe": {"interval": 1}}, "replicas[0].probe.engine is required"),
        ({"probe": {"engine": "ollama"}}, "replicas[0].probe: engine must be one of"),
        ({"probe": {"engine": "vllm", "interval": 0}}, "replicas[0].probe: interval must be > 0"),
        ({"probe": {"engine": "vllm", "intervl": 1}}, "replicas[0].probe: unknown field 'intervl'"),
        ({"probe": {"engine": "vllm", "reader": "x"}}, "replicas[0].probe: unknown field"),
        ({"probe": {"engine": "vllm", "path": "metrics"}}, "replicas[0].probe: path must be"),
        ({"probe": {"engine": "vllm", "max_body": 0}}, "replicas[0].probe: max_body must be"),
        ({"continuation": "sglang"}, 'replicas[0].continuation must be "vllm", "llama.cpp"'),
        ({"context_window": 0}, "replicas[0]: context_window must be >= 1"),
        ({"context_window": "big"}, "replicas[0]: context_window must be an int"),
        ({"fallback": "yes"}, "replicas[0].fallback must be true or false"),
        ({"backup_priority": "low"}, "replicas[0]: backup_priority must be an int"),
        ({"priority": 1}, "replicas[0]: unknown field 'priority'"),
    ],
)
def test_per_replica_mistakes_are_named(fields: dict[str, Any], message: str) -> None:
    document = {
        "replicas": [{"base_url": "http://a:8000/v1", "api_key_env": "KEY", **fields}],
    }
    with pytest.raises(ConfigError) as info:
        parse_config(document, environ={"KEY": "sk-secret-replica-key"})
    assert message in str(info.value)
    assert "sk-secret" not in str(info.value)


# -- one poller per replica for the whole gateway ----------------------------------------------


def _fleet_config(a: FakeReplica, b: FakeReplica, probe: LoadProbe = ONCE) -> Any:
    """Two groups over the same two probed replicas: 2 groups x 3 routes = 6 Hedgers, with
    the latency-aware pick (a fresh reading's predicted wait decides)."""
    hedger = attrs.evolve(HEDGER, pick="peak_ewma", hedge_after=None)
    config = config_for([a, b], hedger=hedger)
    replicas = [attrs.evolve(r, probe=probe) for r in config.replicas]
    groups = [
        Group("first", ["a", "b"], models=["m"], hedger=hedger),
        Group("second", ["a", "b"], models=["*"], hedger=hedger),
    ]
    return attrs.evolve(config, replicas=replicas, groups=groups)


async def _fresh(http: httpx.AsyncClient, gw: Gateway, *names: str) -> str:
    """The gateway's /metrics once every named replica's probe has its reading."""
    with trio.fail_after(10):
        while True:
            text = (await http.get(f"{gw.base_url}/metrics")).text
            if all(
                f'trio_hedge_gateway_probe_status{{replica="{n}",status="fresh"}} 1.0' in text
                for n in names
            ):
                return text
            await trio.sleep(0.01)


def _pages(fake: FakeReplica) -> list[str]:
    return [r.path for r in fake.requests if r.method == "GET"]


async def test_every_hedger_of_the_gateway_reads_one_poller_per_replica() -> None:
    """a's llama-server is prefilling another tenant's 7,800-token prompt, b is idle: every
    route of both groups sends its primary to b (each of the six Hedgers reads the engines),
    and each engine was polled once -- by one poller, not one per Hedger. A first caller's
    bad requests on every route change neither the polls nor a second caller's routes."""
    async with FakeReplica(name="a") as a, FakeReplica(name="b") as b:
        a.pages["/slots"] = llama_slots_page([(7800, 0), None, None, None])
        b.pages["/slots"] = llama_slots_page([None, None, None, None])
        async with Gateway(_fleet_config(a, b)) as gw, httpx.AsyncClient() as http:
            await _fresh(http, gw, "a", "b")
            winners = []
            for path, body in (
                ("/chat/completions", CHAT),
                ("/messages", MESSAGES),
                ("/responses", RESPONSES),
            ):
                for model in ("m", "other"):  # the two groups
                    bad = await http.post(f"{gw.url}{path}", content=b'{"model": ')
                    assert bad.status_code == 400
                    response = await http.post(f"{gw.url}{path}", json={**body, "model": model})
                    assert response.status_code == 200, response.text
                    winners.append(
                        (response.headers["x-hedge-replica"], response.headers["x-hedge-attempts"])
                    )
    assert winners == [("b", "1")] * 6
    assert _pages(a) == _pages(b) == ["/slots"]
    assert [r.path for r in a.requests] == ["/slots"]  # no attempt ever went to a


async def test_metrics_show_every_route_and_each_probe_once() -> None:
    async with FakeReplica(name="a") as a, FakeReplica(name="b") as b:
        a.pages["/slots"] = llama_slots_page([(7800, 800), (100, 100), None, None])
        b.pages["/slots"] = EnginePage("oops", status=500)
        async with Gateway(_fleet_config(a, b)) as gw, httpx.AsyncClient() as http:
            await _fresh(http, gw, "a")
            with trio.fail_after(10):
                await b.wait_request(0)
            text = (await http.get(f"{gw.base_url}/metrics")).text
            while 'trio_hedge_gateway_probe_status{replica="b",status="failing"} 1.0' not in text:
                await trio.sleep(0.01)
                text = (await http.get(f"{gw.base_url}/metrics")).text
    lines = text.splitlines()
    for line in (
        'trio_hedge_gateway_probe_status{replica="a",status="fresh"} 1.0',
        'trio_hedge_gateway_probe_status{replica="a",status="failing"} 0.0',
        'trio_hedge_gateway_probe_running{replica="a"} 2.0',
        'trio_hedge_gateway_probe_waiting{replica="a"} 0.0',
        'trio_hedge_gateway_probe_queued_tokens{replica="a"} 7000.0',
        'trio_hedge_gateway_probe_polls_total{replica="a"} 1.0',
        'trio_hedge_gateway_probe_failures_total{replica="a"} 0.0',
        'trio_hedge_gateway_probe_status{replica="b",status="failing"} 1.0',
        'trio_hedge_gateway_probe_polls_total{replica="b"} 1.0',
        'trio_hedge_gateway_probe_failures_total{replica="b"} 1.0',
    ):
        assert line in lines
    # One series per replica, not one per Hedger; no reading of b (its poll failed).
    assert sum(line.startswith("trio_hedge_gateway_probe_polls_total{") for line in lines) == 2
    assert not any(
        line.startswith('trio_hedge_gateway_probe_running{replica="b"') for line in lines
    )
    assert any(
        line.startswith('trio_hedge_gateway_probe_age_seconds{replica="a"}') for line in lines
    )
    # Every route's Hedgers, both groups.
    for api in ("chat", "anthropic", "responses"):
        for group in ("first", "second"):
            labels = f'api="{api}",group="{group}",replica="a"'
            assert f'trio_hedge_gateway_replica_state{{{labels},state="healthy"}} 1.0' in lines
            assert f"trio_hedge_gateway_replica_in_flight{{{labels}}} 0.0" in lines


async def test_metrics_without_probes_have_no_probe_series() -> None:
    async with FakeReplica(name="a") as a:
        async with Gateway(config_for([a])) as gw, httpx.AsyncClient() as http:
            text = (await http.get(f"{gw.base_url}/metrics")).text
    assert not [line for line in text.splitlines() if line.startswith("trio_hedge_gateway_probe_")]
    assert not a.requests  # nothing polled


async def test_readiness_follows_every_route() -> None:
    """Both replicas push back on the Messages route: /readyz says so (the model out on
    every replica; still 200: the gateway serves others), though the chat route never sent
    them anything, and lists each route's states: one fleet view per group, whatever the
    route (issue 29: a server the Messages route found cooling is cooling for the other
    routes too)."""
    pushback = Behaviour(status=503, retry_after=5)
    hedger = attrs.evolve(HEDGER, max_pushback_wait=0.1)
    async with FakeReplica(pushback, name="a") as a, FakeReplica(pushback, name="b") as b:
        async with Gateway(config_for([a, b], hedger=hedger)) as gw, httpx.AsyncClient() as http:
            ready = await http.get(f"{gw.base_url}/readyz")
            failed = await http.post(f"{gw.url}/messages", json=MESSAGES)
            after = await http.get(f"{gw.base_url}/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert failed.status_code == 529  # overloaded, as Anthropic answers it
    assert after.status_code == 200, after.text
    body = json.loads(after.text)
    assert body["models_out"] == {"default": ["m"]}
    assert body["groups"] == {"default": {"a": "degraded", "b": "degraded"}}
    assert body["apis"] == {
        api: {"default": {"a": "degraded", "b": "degraded"}}
        for api in ("chat", "anthropic", "responses")
    }


def test_the_documented_fleets_are_valid() -> None:
    """Every TOML example of docs/gateway.md parses (the vLLM and llama-server fleets too)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "gateway.md").read_text()
    blocks = [part.split("```", 1)[0] for part in doc.split("```toml\n")[1:]]
    names = ("GATEWAY_KEY", "TEAM_A_KEY", "PRIMARY_KEY", "PROVIDER_KEY", "SECRET_ENV")
    env = {name: f"k{i}" for i, name in enumerate(names)}
    configs = [parse_config(tomllib.loads(block), environ=env) for block in blocks]
    assert len(configs) == 3
    primary = configs[0].replica("primary")
    assert (primary.probe, primary.continuation, primary.backup_priority) == (
        LoadProbe("vllm"),
        "vllm",
        1,
    )
    vllm, llama = configs[1], configs[2]
    assert vllm.replica("vllm-b").probe == LoadProbe("vllm", interval=0.1, max_age=0.5)
    assert llama.replica("llama-a").probe == LoadProbe("llama.cpp", prefill_rate=650)
    assert llama.replica("llama-b").probe.probe_path == "/metrics"  # type: ignore[union-attr]
    assert [r.fallback for r in llama.replicas] == [False, False, True]
