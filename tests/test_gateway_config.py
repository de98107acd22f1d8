"""The gateway's TOML configuration and flags: every field read, every mistake named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import trio_hedge as th
from trio_hedge.gateway import (
    ConfigError,
    GatewayConfig,
    GatewayKey,
    Limits,
    load_config,
    parse_config,
)
from trio_hedge.gateway._config import DEFAULT_HEDGER, with_flags
from trio_hedge.gateway._errors import answer_for

FULL = """
[server]
host = "0.0.0.0"
port = 9000
log_format = "json"

[auth]
keys_env = ["GW_KEY"]

[limits]
max_concurrent = 50
max_body_bytes = 65536
request_timeout = 120
drain_timeout = 10
retry_after = 2
hedge_after_min = 0.05
hedge_after_max = 3
drain_delay = 5

[hedger]
hedge_after = { percentile = 0.95, fallback = 0.5, classes = { first = 128 } }
max_attempts = 3
first_token = "content"
first_token_timeout = 20
stall_timeout = 30
budget = { ratio = 0.05 }
throttle = false
outlier_detection = { consecutive_failures = 3, count_slow = false }
pick = "in_order"

[[replicas]]
name = "primary"
base_url = "http://10.0.0.1:8000/v1"
api_key_env = "PRIMARY_KEY"

[[replicas]]
name = "backup"
base_url = "https://backup.example/v1"
overrides = { model = "small" }
headers = { "X-Org" = "acme" }
headers_env = { "X-Secret" = "BACKUP_SECRET" }

[[groups]]
name = "chat"
models = ["llama-*", "gpt-4o"]
replicas = ["primary", "backup"]
hedger = { hedge_after = 0.25, budget = false }

[[groups]]
name = "agents"
models = ["*"]
replicas = ["backup"]
side_effects = true
"""
ENV = {"GW_KEY": "sk-gw-secret", "PRIMARY_KEY": "sk-primary", "BACKUP_SECRET": "s3cret"}


def test_every_section_is_read(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(FULL)
    config = load_config(path, environ=ENV)
    assert (config.host, config.port) == ("0.0.0.0", 9000)
    assert [(k.name, k.key) for k in config.keys] == [("GW_KEY", "sk-gw-secret")]
    assert config.limits == Limits(50, 65536, 120.0, 10.0, 2.0, 0.05, 3.0, drain_delay=5.0)
    assert config.log_format == "json"
    primary, backup = config.replicas
    assert (primary.name, primary.api_key) == ("primary", "sk-primary")
    assert backup.overrides == {"model": "small"}
    assert backup.headers == {"X-Org": "acme", "X-Secret": "s3cret"}
    chat, agents = config.groups
    base = chat.hedger
    assert base.hedge_after == 0.25 and base.budget is None  # the group's own table
    assert base.max_attempts == 3 and base.first_token is th.events.FirstToken.CONTENT
    assert (base.first_token_timeout, base.stall_timeout, base.pick) == (20.0, 30.0, "in_order")
    assert base.throttle is None
    assert base.outlier_detection == th.policy.OutlierDetection(
        consecutive_failures=3, count_slow=False
    )
    learned = agents.hedger.hedge_after
    assert isinstance(learned, th.LearnedDelay)
    assert (learned.percentile, learned.fallback, learned.classes.first) == (0.95, 0.5, 128)
    assert agents.hedger.budget == th.policy.HedgeBudget(ratio=0.05)
    assert agents.side_effects and not chat.side_effects
    # Routing: the first group whose pattern matches; "*" takes the rest.
    assert config.group_for("llama-3-70b") is chat and config.group_for("gpt-4o") is chat
    assert config.group_for("claude") is agents and config.group_for(None) is agents
    # No secret in the repr.
    shown = repr(config)
    for secret in ENV.values():
        assert secret not in shown


def test_defaults_one_group_and_the_gateway_first_token_rule() -> None:
    config = parse_config({"replicas": [{"base_url": "http://127.0.0.1:1/v1"}]}, environ={})
    (group,) = config.groups
    assert group.name == "default" and group.replicas == ("127.0.0.1:1",)
    assert group.hedger == DEFAULT_HEDGER
    assert group.hedger.first_token is th.events.FirstToken.ANY_OUTPUT
    assert isinstance(group.hedger.hedge_after, th.LearnedDelay)
    # Recovery after the commit as the library's Hedger (2): the gateway keeps one
    # completion across a recovery (tests/test_gateway_recovery.py).
    assert group.hedger.max_recoveries == th.HedgerConfig().max_recoveries == 2
    assert (config.host, config.port, config.keys, config.forward_client_key) == (
        "127.0.0.1",
        8080,
        (),
        False,
    )


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({}, "replicas: at least one"),
        ({"replicas": [{"name": "a"}]}, "replicas[0].base_url is required"),
        ({"replicas": [{"base_url": "ftp://x"}]}, "replicas[0]: base_url must be an http(s) URL"),
        ({"replicas": [{"base_url": "http://a/v1", "colour": 1}]}, "replicas[0]: unknown field"),
        ({"replicas": [{"base_url": "http://a/v1", "api_key_env": "NOPE"}]}, "NOPE is not set"),
        ({"hedger": {"hedge_after": "soon"}}, "hedger.hedge_after must be seconds"),
        ({"hedger": {"budget": {"ratio": 2}}}, "hedger.budget: ratio must be <= 1"),
        ({"hedger": {"budget": 3}}, "hedger.budget must be a table, true or false"),
        ({"hedger": {"max_attempts": 0}}, "hedger: max_attempts must be >= 1"),
        ({"hedger": {"hedgeafter": 1}}, "hedger: unknown field 'hedgeafter'"),
        ({"limits": {"max_concurrent": -1}}, "limits: max_concurrent must be >= 1"),
        ({"limits": {"hedge_after_min": 2, "hedge_after_max": 1}}, "limits: hedge_after_min"),
        ({"groups": [{"replicas": ["ghost"]}]}, "unknown replica 'ghost'"),
        ({"auth": {"keys_env": "GW_KEY"}}, "auth.keys_env must be a list"),
        ({"auth": {"keys_env": ["GW_KEY"], "forward_client_key": True}}, "forward_client_key"),
        ({"servr": {}}, "config: unknown field 'servr'"),
        ({"auth": {"keys": [{"name": "a"}]}}, "auth.keys[0].key_env is required"),
        ({"auth": {"keys": [{"key_env": "NOPE"}]}}, "auth.keys[0].key_env: environment"),
        ({"auth": {"keys": [{"key_env": "GW_KEY", "rate": 0}]}}, "auth.keys[0]: rate must be"),
        ({"auth": {"keys": [{"key_env": "GW_KEY", "burst": 0}]}}, "auth.keys[0]: burst must be"),
        ({"auth": {"keys": [{"key_env": "GW_KEY", "rat": 1}]}}, "unknown field 'rat'"),
        ({"auth": {"keys": {"key_env": "GW_KEY"}}}, "auth.keys must be [[auth.keys]] tables"),
        (
            {"auth": {"keys_env": ["GW_KEY"], "keys": [{"key_env": "GW_KEY", "name": "b"}]}},
            "two gateway keys are the same key",
        ),
        (
            {"auth": {"keys_env": ["GW_KEY"], "keys": [{"key_env": "GW_KEY2"}], "x": 1}},
            "auth: unknown field 'x'",
        ),
        ({"auth": {"keys": [{"key_env": "GW_KEY"}] * 2}}, "key names must be unique"),
        ({"limits": {"key_rate": 1.0}}, "per-key limits (limits.key_*) need gateway keys"),
        ({"limits": {"key_max_concurrent": 0}}, "limits: key_max_concurrent must be >= 1"),
        ({"limits": {"key_rate": "fast"}}, "limits: key_rate must be requests per second"),
        ({"limits": {"key_tokens_per_minute": 5}}, "per-key limits (limits.key_*) need gateway"),
        ({"limits": {"max_queue": -1}}, "limits: max_queue must be >= 0"),
        ({"limits": {"queue_wait": -1}}, "limits: queue_wait must be finite seconds >= 0"),
        ({"limits": {"priority": 10}}, "limits: priority must be from 0 to 9"),
        ({"limits": {"priority": -1}}, "limits: priority must be from 0 to 9"),
        ({"limits": {"priority": 3, "max_priority": 2}}, "max_priority (2) must be >= priority"),
        ({"limits": {"completion_weight": 0}}, "completion_weight must be in (0, 100]"),
        ({"limits": {"completion_weight": 101}}, "completion_weight must be in (0, 100]"),
        ({"limits": {"completion_reserve": 0}}, "completion_reserve must be >= 1"),
        ({"limits": {"fairness_horizon": 0}}, "fairness_horizon must be > 0 seconds"),
        ({"limits": {"priority_header": "yes"}}, "priority_header"),
        ({"groups": [{"max_concurrent": 0}]}, "groups[0]: max_concurrent must be >= 1"),
        (
            {"auth": {"keys": [{"key_env": "GW_KEY", "priority": 4, "max_priority": 2}]}},
            "gateway key 'GW_KEY': max_priority (2) must be >= its priority (4)",
        ),
        (
            {"auth": {"keys": [{"key_env": "GW_KEY", "tokens_per_minute": 0}]}},
            "auth.keys[0]: tokens_per_minute must be >= 1",
        ),
    ],
)
def test_mistakes_are_named(document: dict[str, Any], message: str) -> None:
    if document:  # the empty document is about the missing replicas
        document.setdefault("replicas", [{"base_url": "http://a/v1"}])
    with pytest.raises(ConfigError) as info:
        parse_config(document, environ={"GW_KEY": "sk-gw-secret-value", "GW_KEY2": "sk-2"})
    assert message in str(info.value)
    assert "sk-gw-secret-value" not in str(info.value)


def test_named_keys_and_their_limits() -> None:
    document = {
        "replicas": [{"base_url": "http://a/v1"}],
        "auth": {
            "keys_env": ["GW_KEY"],
            "keys": [
                {"name": "team-a", "key_env": "A_KEY", "max_concurrent": 2, "rate": 0.5},
                {"key_env": "B_KEY", "burst": 4},
            ],
        },
        "limits": {"key_max_concurrent": 10, "key_rate": 5.0},
    }
    environ = {"GW_KEY": "sk-gw", "A_KEY": "sk-a-secret", "B_KEY": "sk-b-secret"}
    config = parse_config(document, environ=environ)
    assert config.keys == (
        GatewayKey("sk-gw", "GW_KEY"),
        GatewayKey("sk-a-secret", "team-a", max_concurrent=2, rate=0.5),
        GatewayKey("sk-b-secret", "B_KEY", burst=4),
    )
    assert (config.limits.key_max_concurrent, config.limits.key_rate) == (10, 5.0)
    assert "sk-a-secret" not in repr(config) and "sk-a-secret" not in repr(config.keys[1])
    # Plain strings are keys named by position.
    plain = GatewayConfig(config.replicas, keys=["sk-1", "sk-2"])
    assert [k.name for k in plain.keys] == ["key0", "key1"]


def test_the_operator_turns_recovery_off() -> None:
    document = {"replicas": [{"base_url": "http://a/v1"}], "hedger": {"max_recoveries": 0}}
    assert parse_config(document, environ={}).groups[0].hedger.max_recoveries == 0


def test_false_stands_for_none() -> None:
    document = {
        "replicas": [{"base_url": "http://a/v1"}],
        "limits": {"request_timeout": False, "fairness_horizon": False, "max_priority": False},
        "hedger": {"max_attempts": False, "first_token_timeout": False, "budget": False},
    }
    config = parse_config(document, environ={})
    assert config.limits.request_timeout is None
    assert config.limits.fairness_horizon is None and config.limits.max_priority is None
    hedger = config.groups[0].hedger
    assert (hedger.max_attempts, hedger.first_token_timeout, hedger.budget) == (None, None, None)
    learned = (
        parse_config(
            {
                "replicas": [{"base_url": "http://a/v1"}],
                "hedger": {"hedge_after": {"censoring": False}},
            },
            environ={},
        )
        .groups[0]
        .hedger.hedge_after
    )
    assert isinstance(learned, th.LearnedDelay) and learned.censoring is False  # a bool stays


def test_not_toml(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[server\nport = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(FULL)
    config = with_flags(
        load_config(path, environ=ENV),
        port=0,
        hedger={"hedge_after": "off", "stall_timeout": 5.0},
        limits={"max_concurrent": 7},
    )
    assert config.port == 0 and config.limits.max_concurrent == 7
    assert [g.hedger.hedge_after for g in config.groups] == [None, None]
    assert [g.hedger.stall_timeout for g in config.groups] == [5.0, 5.0]
    replaced = with_flags(
        load_config(path, environ=ENV),
        replicas=["http://127.0.0.1:1/v1", "http://127.0.0.1:1/v1"],
        api_key="sk-flag",
    )
    assert [r.name for r in replaced.replicas] == ["r0", "r1"]
    assert [g.name for g in replaced.groups] == ["default"]
    assert replaced.replicas[0].api_key == "sk-flag"
    with pytest.raises(ConfigError, match="give --replica"):
        with_flags(None)


def test_error_answers_keep_the_true_status() -> None:
    e = th.AttemptError
    k = th.errors.ErrorKind

    def all_failed(*errors: th.AttemptError) -> th.AllAttemptsFailed:
        return th.AllAttemptsFailed("all failed", errors)

    cases = [
        (all_failed(e(k.AUTH, "bad key", status_code=401)), 401, None),
        (
            all_failed(
                e(k.RATE_LIMIT, "slow down", status_code=429, retry_after=4.2),
                e(k.RATE_LIMIT, "slow down", status_code=429, retry_after=2.5),
            ),
            429,
            "3",
        ),
        (
            all_failed(
                e(k.RATE_LIMIT, "slow down", status_code=429),
                e(k.OVERLOADED, "busy", status_code=503),
            ),
            503,
            "1",
        ),
        (all_failed(e(k.AUTH, "x", status_code=401), e(k.CONNECTION, "refused")), 502, None),
        (all_failed(e(k.TIMEOUT, "no first token within first_token_timeout")), 504, None),
        (all_failed(), 503, "1"),
        (th.ReplicasCooling(until=12.0, retry_in=2.2, max_wait=1.0), 503, "3"),
        (th.HedgeError("something else"), 503, "1"),
    ]
    for exc, status, retry_after in cases:
        answer = answer_for(exc)
        assert answer.status == status, exc
        assert dict(answer.headers()).get(b"retry-after") == (
            None if retry_after is None else retry_after.encode()
        )


def test_the_documented_example_is_valid(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "gateway.md").read_text()
    path = tmp_path / "example.toml"
    path.write_text(doc.split("```toml\n", 1)[1].split("```", 1)[0])
    env = {
        "GATEWAY_KEY": "k",
        "TEAM_A_KEY": "a",
        "PRIMARY_KEY": "p",
        "PROVIDER_KEY": "q",
        "SECRET_ENV": "s",
    }
    config = load_config(path, environ=env)
    assert [(k.name, k.max_concurrent, k.rate, k.burst) for k in config.keys] == [
        ("GATEWAY_KEY", None, None, None),
        ("team-a", 20, 5.0, 10),
    ]
    team_a = config.keys[1]
    assert (team_a.tokens_per_minute, team_a.priority, team_a.max_priority) == (200000, 2, 5)
    assert config.priorities(team_a) == (2, 5) and config.priorities(config.keys[0]) == (0, 0)
    limits = config.limits
    assert (limits.max_queue, limits.queue_wait, limits.fairness_horizon) == (256, 10, 2.0)
    assert (limits.priority_header, limits.max_priority, limits.key_tokens_per_minute) == (
        False,
        None,
        None,
    )
    (group,) = config.groups
    assert group.max_concurrent == 200
    assert group.hedger.budget is not None and group.hedger.budget.priority_reserve == 0.5
    assert group.hedger.max_pushback_wait == 10 and group.hedger.hedge_after == 0.5
    assert [r.name for r in config.replicas] == ["primary", "backup"]


def test_deltas_without_a_wire_form_are_encoded_as_chunks() -> None:
    import json

    from trio_hedge.gateway._forward import ChunkEncoder, Completion

    encoder = ChunkEncoder("rid", "m")
    call = th.events.ToolCallDelta(0, "call_1", "f", '{"a"')
    deltas = [
        th.events.Delta(role="assistant"),
        th.events.Delta("Hi", reasoning="hmm"),
        th.events.Delta(tool_calls=(call,)),
        th.events.Delta(
            tool_calls=(th.events.ToolCallDelta(0, None, None, ": 1}"),), finish_reason="stop"
        ),
        th.events.Delta(usage={"completion_tokens": 2}),
    ]
    events = [encoder.encode(d) for d in deltas]
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    chunks = [json.loads(e[6:]) for e in events]
    assert {c["id"] for c in chunks} == {"chatcmpl-rid"} and chunks[0]["model"] == "m"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hi", "reasoning_content": "hmm"}
    assert chunks[2]["choices"][0]["delta"]["tool_calls"] == [
        {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": "f", "arguments": '{"a"'},
        }
    ]
    assert chunks[3]["choices"][0]["finish_reason"] == "stop"
    assert chunks[4]["choices"] == [] and chunks[4]["usage"] == {"completion_tokens": 2}
    # A multi-line raw event keeps SSE framing: one data field per line.
    assert encoder.encode(th.events.Delta("x", raw='{"a":\n1}')) == b'data: {"a":\ndata: 1}\n\n'
    whole = Completion()
    for d in deltas:
        whole.add(d)
    body = json.loads(whole.body("rid", "m"))
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("Hi", "hmm")
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert body["object"] == "chat.completion" and body["usage"] == {"completion_tokens": 2}
