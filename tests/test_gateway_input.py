"""What a client sends cannot hurt the gateway or another client (issue 20, items 3-7, 9, 10):
bounded strings, unambiguous framing and callers, one JSON dialect on every install, an
at-once answer when every replica cools beyond the request's deadline, per-key limits.

Over real loopback sockets (raw bytes where the point is the wire); the gateway as a process
where the point is the install (orjson blocked on import).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.gateway import GatewayKey, Limits
from trio_hedge.gateway import _metrics as gateway_metrics
from trio_hedge.gateway._forward import ChatForwarder
from trio_hedge.gateway._input import MAX_MODEL_CHARS
from trio_hedge.testing import Behaviour, FakeReplica, fake_replicas

from .gateway_support import CHAT, HEDGER, Gateway, config_for

FAST = Behaviour(ttft=0.0, token_delay=0.001, tokens=2)
HELD = Behaviour(ttft=0.0, token_delay=0.02, tokens=10_000)  # streams until cancelled


def port_of(gw: Gateway) -> int:
    return int(gw.base_url.rsplit(":", 1)[1])


async def exchange_raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything the gateway sent until it closed."""
    got = b""
    with trio.fail_after(10):
        async with await trio.open_tcp_stream("127.0.0.1", port) as sock:
            await sock.send_all(data)
            while chunk := await sock.receive_some():
                got += chunk
    return got


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name.endswith("access")]


# -- 3. client-chosen strings are bounded -----------------------------------------------------


async def test_a_long_model_is_refused_and_nothing_it_names_is_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trio_hedge.gateway.access")
    huge = "m" * (1 << 20)
    async with FakeReplica(FAST, name="a") as a:
        async with Gateway(config_for([a])) as gw, httpx.AsyncClient() as http:
            url = f"{gw.url}/chat/completions"
            at_limit = await http.post(url, json={**CHAT, "model": "x" * MAX_MODEL_CHARS})
            refused = [await http.post(url, json={**CHAT, "model": huge}) for _ in range(8)]
            other = await http.post(url, json=CHAT)  # another client, served as before
            long_path = await http.get(f"{gw.base_url}/{'p' * 10_000}")
            metrics = await http.get(f"{gw.base_url}/metrics")
    assert at_limit.status_code == 200 and other.status_code == 200
    for response in refused:
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "model"
        assert len(response.content) < 500
    assert long_path.status_code == 404 and len(long_path.content) < 500
    assert len(metrics.content) < 20_000
    assert "mmmm" not in metrics.text
    lines = access_lines(caplog)
    assert [line["status"] for line in lines[1:9]] == [400] * 8
    assert max(len(json.dumps(line)) for line in lines) < 1000
    assert len(a.requests) == 2  # the refused ones went nowhere


async def test_model_labels_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The learned-delay metric labels a model a replica answered, up to a bound; every
    other model is folded into one label."""
    monkeypatch.setattr(gateway_metrics, "MAX_MODEL_LABELS", 2, raising=False)
    async with FakeReplica(FAST, name="a") as a:
        config = config_for([a], hedger=attrs.evolve(HEDGER, hedge_after=th.LearnedDelay()))
        async with Gateway(config) as gw, httpx.AsyncClient() as http:
            url = f"{gw.url}/chat/completions"
            for i in range(6):
                response = await http.post(url, json={**CHAT, "model": f"model-{i}"})
                assert response.status_code == 200
            text = (await http.get(f"{gw.base_url}/metrics")).text
    labels = {
        line.split('model="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("trio_hedge_gateway_hedge_delay_seconds{")
    }
    assert labels == {"model-0", "model-1", "(other)"}


# -- 4. Content-Length and Transfer-Encoding together ------------------------------------------


async def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed() -> None:
    body = json.dumps(CHAT).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    smuggled = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n" % len(chunked)
    )
    async with FakeReplica(FAST, name="a") as a:
        async with Gateway(config_for([a])) as gw:
            got = await exchange_raw(port_of(gw), request + chunked + smuggled)
            # A well-framed request on its own connection is still served.
            plain = await exchange_raw(
                port_of(gw),
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body),
            )
    assert got.startswith(b"HTTP/1.1 400 ")
    assert got.count(b"HTTP/1.1 ") == 1  # the smuggled request was not answered
    assert b'"code":"ambiguous_framing"' in got.replace(b" ", b"")
    assert plain.startswith(b"HTTP/1.1 200 ")
    assert len(a.requests) == 1  # only the well-framed request went upstream


# -- 5. one Authorization ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        [("authorization", "Bearer wrong"), ("authorization", "Bearer sk-right")],
        [("authorization", "Bearer sk-right"), ("authorization", "Bearer wrong")],
        [("authorization", "Bearer sk-right"), ("authorization", "Bearer sk-right")],
        [("authorization", "Bearer sk-right"), ("x-request-id", "a"), ("x-request-id", "b")],
        [("authorization", "Bearer sk-right"), ("x-hedge", "on"), ("x-hedge", "off")],
    ],
    ids=["wrong-right", "right-wrong", "right-right", "request-id", "x-hedge"],
)
async def test_a_header_the_gateway_reads_twice_is_refused(headers: list[tuple[str, str]]) -> None:
    async with FakeReplica(FAST, name="a") as a:
        async with Gateway(config_for([a], keys=("sk-right",))) as gw:
            async with httpx.AsyncClient() as http:
                url = f"{gw.url}/chat/completions"
                twice = await http.post(url, json=CHAT, headers=headers)
                once = await http.post(url, json=CHAT, headers={"authorization": "Bearer sk-right"})
    assert twice.status_code == 400
    error = twice.json()["error"]
    assert error["code"] == "duplicate_header" and error["param"] == headers[-1][0]
    assert once.status_code == 200
    assert len(a.requests) == 1


# -- 6, 9. every bad body a 400, on every install; numbers kept exact -------------------------

NESTED = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": '
BAD_BODIES = {
    "lone surrogate": b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
    "lone low surrogate": b'{"model": "m", "messages": [{"role": "user", "content": "a\\udc00"}]}',
    "nested 5000 deep": NESTED + b"[" * 5000 + b"]" * 5000 + b"}",
    "nested 65 deep": NESTED + b"[" * 64 + b"]" * 64 + b"}",
    "NaN": b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    "1e400": b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 1e400}',
    "Infinity in a long number body": (
        b'{"model": "m", "seed": 12345678901234567890, "messages": [{"role": "user", '
        b'"content": "x"}], "top_p": -Infinity}'
    ),
    "UTF-16": json.dumps(CHAT).encode("utf-16"),
    "not UTF-8": b'{"model": "m\xff", "messages": [{"role": "user", "content": "x"}]}',
    "a 1 MiB model": json.dumps({**CHAT, "model": "m" * (1 << 20)}).encode(),
    "n true": json.dumps({**CHAT, "n": True}).encode(),
    "n 1.0": json.dumps({**CHAT, "n": 1.0}).encode(),
    "n string": json.dumps({**CHAT, "n": "1"}).encode(),
}
GOOD_BODIES = {
    "a surrogate pair": (
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    ),
    "nested 64 deep": NESTED + b"[" * 63 + b"]" * 63 + b"}",
    "big integers": (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 1, '
        b'"max_tokens": 1000000000000000000000000000000, "seed": -9223372036854775809}'
    ),
}
EXACT = {"max_tokens": 10**30, "seed": -(2**63) - 1}


class Serve:
    """``python -m trio_hedge serve`` as a process, optionally with orjson blocked: the
    documented ``.[gateway]`` install has no orjson. Its output is read as it comes (a
    full pipe would stop it)."""

    def __init__(self, nursery: trio.Nursery, replica: str, *, orjson: bool) -> None:
        self.nursery, self.replica, self.orjson = nursery, replica, orjson
        self.output = b""
        self._listening = trio.Event()
        self._done = trio.Event()

    async def start(self) -> str:
        block = "" if self.orjson else "sys.modules['orjson'] = None; "
        code = f"import sys; {block}from trio_hedge.cli import main; sys.exit(main())"
        command = [sys.executable, "-c", code, "serve", "--replica", self.replica, "--port", "0"]
        run = functools.partial(
            trio.run_process,
            command,
            stdout=-1,
            stderr=-2,
            check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.process = await self.nursery.start(run)
        self.nursery.start_soon(self._read)
        await self._listening.wait()
        assert b"listening on " in self.output, self.output
        return self.output.split(b"listening on ")[1].split()[0].decode()

    async def _read(self) -> None:
        while chunk := await self.process.stdout.receive_some():
            self.output += chunk
            if b"listening on " in self.output:
                self._listening.set()
        self._listening.set()
        self._done.set()

    async def stop(self) -> str:
        self.process.terminate()
        await self._done.wait()
        await self.process.wait()
        return self.output.decode()


@pytest.mark.parametrize("orjson", [True, False], ids=["orjson", "json"])
async def test_every_bad_body_gets_a_400_on_every_install(orjson: bool) -> None:
    async with FakeReplica(FAST, name="a") as a, trio.open_nursery() as nursery:
        serve = Serve(nursery, a.url, orjson=orjson)
        with trio.fail_after(30):
            base = await serve.start()
            async with httpx.AsyncClient() as http:
                url = f"{base}/v1/chat/completions"
                headers = {"content-type": "application/json"}
                post = functools.partial(http.post, url, headers=headers)
                bad = {name: await post(content=body) for name, body in BAD_BODIES.items()}
                good = {name: await post(content=body) for name, body in GOOD_BODIES.items()}
            output = await serve.stop()
    for name, response in bad.items():
        assert response.status_code == 400, name
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], name
    assert {n: r.status_code for n, r in good.items()} == dict.fromkeys(GOOD_BODIES, 200)
    assert "Traceback" not in output
    access = [json.loads(x) for x in output.splitlines() if x.startswith("{")]
    assert [x["status"] for x in access] == [400] * len(BAD_BODIES) + [200] * len(GOOD_BODIES)
    # Only the good bodies went upstream, and their numbers as the client wrote them.
    assert len(a.requests) == len(GOOD_BODIES)
    assert a.requests[0].json["messages"][0]["content"] == "\U0001f600"
    sent = a.requests[2].json
    assert {k: sent[k] for k in EXACT} == EXACT
    assert all(type(sent[k]) is int for k in EXACT)


# -- 7. every replica cooling beyond the request's deadline -----------------------------------


async def test_a_cooldown_beyond_the_first_token_timeout_is_answered_at_once() -> None:
    pushback = Behaviour(status=503, retry_after=5)
    hedger = attrs.evolve(HEDGER, first_token_timeout=1.0, max_pushback_wait=10.0)
    async with fake_replicas(pushback, pushback, names=["a", "b"]) as replicas:
        async with Gateway(config_for(replicas, hedger=hedger)) as gw, httpx.AsyncClient() as http:
            url = f"{gw.url}/chat/completions"
            failed = await http.post(url, json=CHAT)  # both push back: cooling for 5 s
            cooling = await http.post(url, json=CHAT)
    assert failed.status_code == 503 and failed.headers["retry-after"] == "5"
    # Waiting 5 s for a replica cannot give a first token within 1 s: 503 at once, not 504.
    assert cooling.status_code == 503
    assert cooling.json()["error"]["code"] == "replicas_cooling"
    assert 4 <= int(cooling.headers["retry-after"]) <= 5
    assert [len(r.requests) for r in replicas] == [1, 1]  # nothing more was sent


# -- 10. per-key limits --------------------------------------------------------------------------

KEYS = (
    GatewayKey("sk-team-a-0123456789", "team-a", max_concurrent=1, rate=0.01, burst=3),
    GatewayKey("sk-team-b-0123456789", "team-b"),
)


async def first_token(response: httpx.Response) -> Any:
    """Read ``response`` up to its first token; the iterator, to close when done (dropped,
    it would be closed whenever it is garbage-collected)."""
    pieces = response.aiter_raw()
    with trio.fail_after(10):
        while b"tok0" not in await pieces.__anext__():
            pass
    return pieces


def bearer(key: GatewayKey) -> dict[str, str]:
    return {"authorization": f"Bearer {key.key}"}


async def test_one_key_cannot_take_every_slot_or_every_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trio_hedge.gateway.access")
    team_a, team_b = KEYS
    limits = Limits(max_concurrent=3, queue_wait=0.2, drain_timeout=1.0)
    async with fake_replicas(HELD, FAST, names=["held", "fast"]) as (held, fast):
        config = config_for([held], keys=KEYS, limits=limits)
        async with Gateway(config) as gw, httpx.AsyncClient() as http:
            url = f"{gw.url}/chat/completions"
            body = {**CHAT, "stream": True}
            async with http.stream("POST", url, json=body, headers=bearer(team_a)) as first:
                first_pieces = await first_token(first)
                # team-a has its one stream: its next waits for its own slot, queue_wait,
                # then 503; team-b is served meanwhile.
                with trio.fail_after(10):  # without the limit: a second endless stream
                    second = await http.post(url, json=body, headers=bearer(team_a))
                async with http.stream("POST", url, json=body, headers=bearer(team_b)) as other:
                    other_pieces = await first_token(other)
                    metrics_during = (await http.get(f"{gw.base_url}/metrics")).text
                    await other_pieces.aclose()
                await first_pieces.aclose()
            with trio.fail_after(5):
                await held.wait_disconnected(0)
                await held.wait_disconnected(1)
            # team-a's rate: a burst of 3 (the stream admitted, these two), then 429; the
            # request that timed out in the queue was never admitted, so never counted.
            third = await http.get(f"{gw.url}/models", headers=bearer(team_a))
            fourth = await http.get(f"{gw.url}/models", headers=bearer(team_a))
            fifth = await http.get(f"{gw.url}/models", headers=bearer(team_a))
            b_after = [
                (await http.get(f"{gw.url}/models", headers=bearer(team_b))).status_code
                for _ in range(5)
            ]
            metrics = (await http.get(f"{gw.base_url}/metrics")).text
    assert first.status_code == 200 and other.status_code == 200
    assert second.status_code == 503
    assert second.json()["error"]["code"] == "queue_timeout"
    assert second.headers["x-should-retry"] == "false"  # it waited as long as allowed
    assert second.headers["retry-after"] == "1"  # nothing finished yet: limits.retry_after
    assert third.status_code == fourth.status_code == 200
    assert fifth.status_code == 429 and fifth.json()["error"]["code"] == "rate_limit_exceeded"
    assert 99 <= int(fifth.headers["retry-after"]) <= 100  # one request per 100 s
    assert fifth.headers["x-should-retry"] == "false"  # too long to be worth waiting for
    assert b_after == [200] * 5
    assert 'trio_hedge_gateway_key_in_flight{key="team-a"} 1.0' in metrics_during
    assert 'trio_hedge_gateway_key_in_flight{key="team-b"} 1.0' in metrics_during
    for line in (
        'trio_hedge_gateway_key_requests_total{key="team-a",status="429"} 1.0',
        'trio_hedge_gateway_key_requests_total{key="team-a",status="503"} 1.0',
        'trio_hedge_gateway_key_requests_total{key="team-b",status="200"} 5.0',
        'trio_hedge_gateway_key_in_flight{key="team-a"} 0.0',
        'trio_hedge_gateway_refused_total{reason="queue_timeout"} 1.0',
        'trio_hedge_gateway_refused_total{reason="key_rate"} 1.0',
        "trio_hedge_gateway_queued 0.0",
    ):
        assert line in metrics
    for key in KEYS:
        assert key.key not in metrics and key.key not in caplog.text
    assert {line.get("key") for line in access_lines(caplog)} == {"team-a", "team-b", None}
    assert fast.requests == []


async def test_a_defect_is_answered_500_and_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_hedge.gateway")

    def broken(*_args: Any) -> Any:
        raise RuntimeError("a defect with the secret sk-not-shown in its message")

    monkeypatch.setattr(ChatForwarder, "prepare", broken)
    async with FakeReplica(FAST, name="a") as a:
        async with Gateway(config_for([a])) as gw, httpx.AsyncClient() as http:
            response = await http.post(f"{gw.url}/chat/completions", json=CHAT)
            health = await http.get(f"{gw.base_url}/healthz")
            metrics = (await http.get(f"{gw.base_url}/metrics")).text
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert health.status_code == 200
    assert 'trio_hedge_gateway_requests_total{path="/v1/chat/completions",status="500"}' in metrics
    assert access_lines(caplog)[0]["status"] == 500
    assert "RuntimeError" in caplog.text and "sk-not-shown" not in caplog.text
