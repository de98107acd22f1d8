"""Scale-out shown with a real load balancer (issue 20, item 12): two `trio-hedge serve`
processes behind HAProxy (the system's package, started here on loopback; the tests skip
without it), health-checked on ``/readyz``, as docs/gateway.md's scale-out section configures
it. The fleet's extra requests stay within each instance's hedge budget, a client leaving is
seen by the upstream through the balancer, a SIGTERM'd instance drains its streams while
the other takes the new ones, out of the balancer's rotation before its streams end, and a
rolling restart of both (issue 31) loses no request and no stream, even through a balancer
that does not retry."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from trio_hedge.testing import Behaviour, FakeReplica, RequestRecord, fake_replicas

HAPROXY = shutil.which("haproxy") or (
    "/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None
)
pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and processes"),
    pytest.mark.skipif(
        HAPROXY is None, reason="HAProxy is not installed (apt-get install haproxy; .ci/run does)"
    ),
]

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
#: Seconds a whole scenario may take (processes start in ~1 s each); a bound, never a wait.
DEADLINE = 60

# The HAProxy configuration docs/gateway.md shows (scale-out), with the test's ports. Health
# checks on /readyz every 100 ms, out of rotation at the first failure (an instance that is
# draining answers 503, or no longer accepts); a request the gateway refused before sending
# anything upstream (503, or a refused connection) is retried on the other instance.
HAPROXY_CONFIG = """\
global
    maxconn 4096
    stats socket {stats} mode 600 level admin

defaults
    mode http
    timeout connect 2s
    timeout client 10m
    timeout server 10m
    timeout http-keep-alive 10s
    retries 2
    option redispatch 1
    retry-on conn-failure empty-response 503

frontend llm
    bind 127.0.0.1:{port}
    default_backend gateways

backend gateways
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
    default-server check inter 100ms fall 1 rise 1
    http-response set-header x-served-by %s
{servers}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@attrs.define
class Instance:
    """One ``python -m trio_hedge serve`` child."""

    name: str
    process: trio.Process
    log: Path
    port: int = 0

    async def wait_listening(self) -> None:
        while not (port := _listening_port(self.log)):
            if self.process.returncode is not None:
                raise AssertionError(f"{self.name} exited: {self.log.read_text()}")
            await trio.sleep(0.02)
        self.port = port


def _listening_port(log: Path) -> int:
    text = log.read_text() if log.exists() else ""
    marker = "listening on http://127.0.0.1:"
    if marker not in text:
        return 0
    return int(text.split(marker, 1)[1].split()[0])


def _gateway_toml(replicas: Sequence[FakeReplica], hedger: str, limits: str = "") -> str:
    lines = ["[hedger]", hedger, 'pick = "in_order"', "", "[limits]", "drain_timeout = 20"]
    lines += [limits, ""]
    for r in replicas:
        lines += ["[[replicas]]", f'name = "{r.name}"', f'base_url = "{r.url}"', ""]
    return "\n".join(lines)


@attrs.define
class Fleet:
    url: str  # the balancer's OpenAI base URL
    instances: list[Instance]
    stats: Path
    #: Start a gateway named ``name`` on ``port`` (a restart: the old one's port).
    start: Callable[[str, int], Awaitable[Instance]]

    def instance(self, name: str) -> Instance:
        return next(i for i in self.instances if i.name == name)

    async def server_states(self) -> dict[str, str]:
        """HAProxy's view of each gateway: ``UP`` or ``DOWN`` (its stats socket)."""
        sock = trio.socket.socket(socket.AF_UNIX)
        with sock:
            await sock.connect(str(self.stats))
            await sock.send(b"show stat\n")
            data = b""
            while chunk := await sock.recv(65536):
                data += chunk
        states = {}
        for line in data.decode().splitlines():
            fields = line.split(",")
            if len(fields) > 17 and fields[0] == "gateways" and fields[1].startswith("gw"):
                states[fields[1]] = fields[17].split()[0]
        return states

    async def wait_states(self, wanted: dict[str, str]) -> None:
        while await self.server_states() != wanted:  # noqa: ASYNC110 - another process: polled
            await trio.sleep(0.02)


#: HAProxy without retries: a request it sent to an instance that refuses the connection or
#: answers 503 reaches the client as an error (as through a balancer that cannot retry a
#: POST safely, or a Kubernetes Service).
NO_RETRIES = ("retries 2", "option redispatch 1", "retry-on conn-failure empty-response 503")


@asynccontextmanager
async def fleet(
    tmp_path: Path,
    replicas: Sequence[FakeReplica],
    *,
    hedger: str,
    size: int = 2,
    limits: str = "",
    retries: bool = True,
) -> AsyncIterator[Fleet]:
    """``size`` gateways over ``replicas`` behind HAProxy; every child stopped on exit."""
    assert HAPROXY is not None
    config = tmp_path / "gateway.toml"
    config.write_text(_gateway_toml(replicas, hedger, limits))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    async with trio.open_nursery() as nursery:
        children: list[trio.Process] = []
        logs: list[Any] = []

        async def start(command: list[str], log: Path) -> trio.Process:
            out = log.open("wb")
            logs.append(out)
            run = functools.partial(
                trio.run_process, command, stdout=out, stderr=out, check=False, env=env
            )
            process: trio.Process = await nursery.start(run)
            children.append(process)
            return process

        async def launch(name: str, port: int = 0) -> Instance:
            log = tmp_path / f"{name}.{len(logs)}.log"
            command = [sys.executable, "-m", "trio_hedge", "serve"]
            command += ["--config", str(config), "--port", str(port)]
            return Instance(name, await start(command, log), log)

        async def gateway(name: str, port: int = 0) -> Instance:
            instance = await launch(name, port)
            await instance.wait_listening()
            return instance

        try:
            instances = [await launch(f"gw{n}") for n in range(1, size + 1)]
            for instance in instances:  # started together, then each waited for
                await instance.wait_listening()
            port, stats = _free_port(), tmp_path / "haproxy.sock"
            servers = "\n".join(f"    server {i.name} 127.0.0.1:{i.port}" for i in instances)
            cfg = tmp_path / "haproxy.cfg"
            text = HAPROXY_CONFIG.format(port=port, stats=stats, servers=servers)
            if not retries:
                for line in NO_RETRIES:
                    text = text.replace(f"    {line}\n", "")
                text = text.replace("defaults\n", "defaults\n    retries 0\n")
            cfg.write_text(text)
            await start([HAPROXY, "-db", "-f", str(cfg)], tmp_path / "haproxy.log")
            while not stats.exists():  # noqa: ASYNC110 - another process: polled
                await trio.sleep(0.02)
            out = Fleet(f"http://127.0.0.1:{port}/v1", instances, stats, gateway)
            await out.wait_states({i.name: "UP" for i in instances})
            yield out
        finally:
            for process in children:
                if process.returncode is None:
                    process.terminate()
            with trio.move_on_after(10):
                for process in children:
                    await process.wait()
            nursery.cancel_scope.cancel()
            for out in logs:
                out.close()


async def test_the_fleets_extra_requests_stay_within_each_instances_budget(
    tmp_path: Path,
) -> None:
    """Every request wants a backup (a slow primary), each instance's budget allows backups
    for a quarter of its own requests (no floor): through the balancer the fleet's extra
    requests stay within a quarter too, each instance held to its own share. Without the
    budget every request is hedged (ratio 1)."""
    requests = 40
    async with fake_replicas(
        Behaviour(ttft=0.5, tokens=2), Behaviour(tokens=2), names=["slow", "fast"]
    ) as (slow, fast):
        hedger = "hedge_after = 0.02\nbudget = { ratio = 0.25, min_per_second = 0, window = 60 }"
        with trio.fail_after(DEADLINE):
            async with fleet(tmp_path, [slow, fast], hedger=hedger) as f:
                served: dict[str, list[bool]] = {"gw1": [], "gw2": []}

                async def one(client: httpx.AsyncClient) -> None:
                    body = {**CHAT, "stream": False}
                    response = await client.post(f"{f.url}/chat/completions", json=body)
                    assert response.status_code == 200, response.text
                    hedged = response.headers["x-hedge-hedged"] == "true"
                    served[response.headers["x-served-by"]].append(hedged)

                async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as n:
                    for _ in range(requests):
                        n.start_soon(one, client)
    backups = {name: sum(hedged) for name, hedged in served.items()}
    assert sum(len(s) for s in served.values()) == requests
    for name, hedged in served.items():
        assert hedged, f"{name} served no request: the balancer did not spread them"
        assert backups[name] <= 0.25 * len(hedged), (name, backups[name], len(hedged))
    assert 0 < sum(backups.values()) <= 0.25 * requests
    # What the replicas saw: every request's primary at the slow one, the backups at the fast.
    chats = [r for r in fast.requests if r.path.startswith("/v1/chat")]
    assert len(chats) == sum(backups.values())
    assert len([r for r in slow.requests if r.path.startswith("/v1/chat")]) == requests


async def _open_stream(url: str) -> tuple[trio.SocketStream, bytes]:
    """A streaming request on a raw socket; returns it and the bytes up to the first token."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = json.dumps({**CHAT, "stream": True}).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    data = b""
    while b"tok0" not in data:
        chunk = await stream.receive_some()
        assert chunk, data
        data += chunk
    return stream, data


async def test_a_client_leaving_reaches_the_upstream_through_the_balancer(
    tmp_path: Path,
) -> None:
    """The client closes its connection to HAProxy mid-stream: HAProxy closes its connection
    to the gateway, and the gateway cancels the upstream attempt (the replica sees the
    disconnect, long before its 100 tokens would have ended)."""
    async with FakeReplica(Behaviour(tokens=100, token_delay=0.1), name="r") as replica:
        with trio.fail_after(DEADLINE):
            async with fleet(tmp_path, [replica], hedger='hedge_after = "off"') as f:
                stream, _ = await _open_stream(f.url)
                await stream.aclose()
                with trio.fail_after(5):
                    record = await replica.wait_disconnected(0)
                assert record.tokens_sent < 100


async def test_a_sigtermed_instance_drains_while_the_other_takes_new_requests(
    tmp_path: Path,
) -> None:
    """One stream on each instance; SIGTERM one: HAProxy takes it out of rotation (its
    readiness fails) while its stream still runs; every new request goes to the other and
    succeeds; the stream on the stopped instance ends whole (``[DONE]``) and the process
    exits 0."""
    async with FakeReplica(Behaviour(tokens=30, token_delay=0.05), name="r") as replica:
        with trio.fail_after(DEADLINE):
            async with fleet(tmp_path, [replica], hedger='hedge_after = "off"') as f:
                streams = [await _open_stream(f.url) for _ in range(2)]
                by_instance = {}
                for stream, head in streams:
                    served = head.split(b"x-served-by: ")[1].split(b"\r\n")[0].decode()
                    by_instance[served] = (stream, head)
                assert set(by_instance) == {"gw1", "gw2"}
                stopped = f.instance("gw1")
                stopped.process.send_signal(signal.SIGTERM)
                await f.wait_states({"gw1": "DOWN", "gw2": "UP"})
                assert stopped.process.returncode is None  # still draining its stream
                assert len(replica.requests) == 2
                async with httpx.AsyncClient(timeout=30) as client:
                    for _ in range(4):
                        body = {**CHAT, "stream": False}
                        response = await client.post(f"{f.url}/chat/completions", json=body)
                        assert response.status_code == 200, response.text
                        assert response.headers["x-served-by"] == "gw2"
                for stream, head in by_instance.values():
                    data = head
                    while chunk := await stream.receive_some():
                        data += chunk
                        if data.endswith(b"0\r\n\r\n"):
                            break
                    assert b"data: [DONE]" in data
                    assert data.count(b'"content":"tok') == 30
                    await stream.aclose()
                assert await stopped.process.wait() == 0


# -- a rolling restart (issue 31, item 3) -----------------------------------------------------

#: Each stream: 40 tokens 50 ms apart (2 s); one starts every 0.2 s (20 over 4 s).
STREAM_TOKENS, STREAMS, EVERY = 40, 20, 0.2


async def _whole_stream(url: str) -> tuple[str, bytes]:
    """One streaming request through the balancer, read to its end: who served it, and the
    body."""
    stream, data = await _open_stream(url)
    async with stream:
        while not data.endswith(b"0\r\n\r\n"):
            chunk = await stream.receive_some()
            if not chunk:
                break
            data += chunk
    served = data.split(b"x-served-by: ")[1].split(b"\r\n")[0].decode()
    return served, data


async def _restart(f: Fleet, name: str) -> None:
    """SIGTERM gateway ``name``, start its successor on its port once its listener closes,
    and wait until HAProxy has the new one in rotation."""
    old = f.instance(name)
    old.process.send_signal(signal.SIGTERM)
    while "listener closed" not in old.log.read_text():  # noqa: ASYNC110 - another process
        await trio.sleep(0.02)
    new = await f.start(name, old.port)
    f.instances[f.instances.index(old)] = new
    await f.wait_states({i.name: "UP" for i in f.instances})
    assert await old.process.wait() == 0  # its streams drained whole, then it exited


async def test_a_rolling_restart_loses_no_request_and_no_stream(tmp_path: Path) -> None:
    """Two gateways behind HAProxy, with no retries at the balancer (a request it sends to
    an instance that refuses it reaches the client as an error), ``drain_delay = 1``: 20
    streams start through the pair, one every 0.2 s, and short requests go one after
    another meanwhile; gw1 is SIGTERM'd and restarted on its port, then gw2. Every stream
    ends whole (40 tokens, ``[DONE]``), every request gets 200, and both old processes exit
    0. With ``drain_delay = 0`` (c6222d8's behaviour: the listener closed at once) requests
    sent in the ~100 ms before the balancer's next health check are refused."""
    short = {"model": "m", "messages": [{"role": "user", "content": "short"}]}

    def paced(record: RequestRecord) -> Behaviour:  # short requests answer at once
        if record.json and record.json.get("messages") == short["messages"]:
            return Behaviour(tokens=2)
        return Behaviour(tokens=STREAM_TOKENS, token_delay=0.05)

    async with FakeReplica(paced, name="r") as replica:
        with trio.fail_after(DEADLINE):
            async with fleet(
                tmp_path,
                [replica],
                hedger='hedge_after = "off"',
                limits="drain_delay = 1",
                retries=False,
            ) as f:
                streams: list[tuple[str, bytes]] = []
                statuses: list[int] = []
                done = trio.Event()

                async def requests() -> None:
                    async with httpx.AsyncClient(timeout=30) as client:
                        while not done.is_set():
                            response = await client.post(f"{f.url}/chat/completions", json=short)
                            statuses.append(response.status_code)

                async def stream() -> None:
                    streams.append(await _whole_stream(f.url))

                async with trio.open_nursery() as load:
                    load.start_soon(requests)
                    async with trio.open_nursery() as all_streams:
                        for n in range(STREAMS):
                            all_streams.start_soon(stream)
                            await trio.sleep(EVERY)
                            if n == 3:
                                load.start_soon(_restart, f, "gw1")
                        while len(streams) < STREAMS // 2:  # noqa: ASYNC110 - polled
                            await trio.sleep(0.05)
                        await _restart(f, "gw2")
                    done.set()
    assert len(streams) == STREAMS
    for served, data in streams:
        assert b"data: [DONE]" in data, (served, data[-300:])
        assert data.count(b'"content":"tok') == STREAM_TOKENS
    assert {served for served, _ in streams} == {"gw1", "gw2"}
    assert len(statuses) > 100 and set(statuses) == {200}, Counter(statuses)
