"""Two ``trio-hedge serve`` processes and one real ``redis-server`` (``[state] redis_url``):
an ejection one gateway decides is honoured by the other within a second; Redis killed and
restarted under load fails no request, the degraded gauge and ``/readyz`` say so, then
recover; a gateway started while Redis is down serves, and joins when it comes. The same
pair of gateways with workers shares the same view."""

from __future__ import annotations

import json
import re
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trio_hedge.testing import Behaviour, FakeReplica

from .gateway_processes import Process, Stream, owner, start, stream
from .redis_support import RedisServer, needs_redis

pytestmark = [
    *needs_redis,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
]

#: Seconds a whole scenario may take; a bound, never a wait.
DEADLINE = 60


def _config(
    tmp_path: Path, name: str, redis: str, replicas: list[FakeReplica], extra: str = ""
) -> Path:
    # A timeout a busy machine does not reach by accident: Redis is lost here by being killed.
    lines = ["[state]", f'redis_url = "{redis}"', "timeout = 2", "", "[hedger]"]
    lines += ['pick = "in_order"', extra, ""]
    for r in replicas:
        lines += ["[[replicas]]", f'name = "{r.name}"', f'base_url = "{r.url}"', ""]
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines))
    return path


async def _gateways(
    nursery: trio.Nursery, configs: list[Path], *flags: str
) -> list[tuple[Process, int]]:
    out = []
    for config in configs:
        gw = await start(nursery, "serve", "--config", str(config), "--port", "0", *flags)
        out.append((gw, await gw.port()))
    return out


async def _ready(port: int) -> dict[str, object]:
    async with httpx.AsyncClient() as http:
        result: dict[str, object] = (await http.get(f"http://127.0.0.1:{port}/readyz")).json()
        return result


async def _ready_from(port: int, pids: list[int]) -> tuple[int | None, dict[str, Any]]:
    """``/readyz`` over a kept-alive connection, and which of ``pids`` answered it (the
    connection's owner, looked up while it is still open)."""
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    async with sock:
        await sock.send_all(b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += await sock.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.I)[1])  # type: ignore[index]
        while len(body) < length:
            body += await sock.receive_some(65536)
        who = owner(port, sock.socket.getsockname()[1], pids)
    return who, json.loads(body)


async def _state_is(port: int, state: str) -> bool:
    return (await _ready(port))["state"] == state


async def _degraded_is(port: int, value: float) -> bool:
    return await _degraded(port) == value


async def _degraded(port: int) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    match = re.search(r'^trio_hedge_gateway_state_degraded\{backend="fleet"\} (\S+)$', text, re.M)
    assert match is not None, text
    return float(match[1])


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll another process until ``check()`` (bounded by the scenario's fail_after)."""
    while not await check():  # noqa: ASYNC110 - another process: polled
        await trio.sleep(0.02)


async def _stop(gateways: list[tuple[Process, int]]) -> None:
    for gw, _ in gateways:
        gw.process.send_signal(signal.SIGTERM)
    for gw, _ in gateways:
        assert await gw.process.wait() == 0


@pytest.mark.parametrize("workers", [1, 2])
async def test_an_ejection_one_gateway_decides_is_honoured_by_the_other_within_a_second(
    tmp_path: Path, redis_server: RedisServer, workers: int
) -> None:
    # a answers 500 to everything. Five requests through gateway 1 fail over from a to b;
    # the fifth failure ejects a there. Gateway 2, which never sent a request to a, shows a
    # ejected within 1 s, and its requests go to b alone.
    failing = Behaviour(status=500)
    async with (
        FakeReplica(failing, name="a") as a,
        FakeReplica(Behaviour(tokens=3), name="b") as b,
        trio.open_nursery() as nursery,
    ):
        configs = [_config(tmp_path, f"gw{i}", redis_server.url, [a, b]) for i in (1, 2)]
        with trio.fail_after(DEADLINE):
            gateways = await _gateways(nursery, configs, "--workers", str(workers))
            (_, port1), (_, port2) = gateways
            for port in (port1, port2):
                await _until(lambda port=port: _state_is(port, "ok"))
            # Five failures in a row in one process eject a (with two workers, nine requests
            # bring one of them five).
            for _ in range(5 if workers == 1 else 9):
                s = Stream()
                await stream(port1, s)
                assert s.whole
            decided = trio.current_time()
            ejected = {"default": {"a": "ejected", "b": "healthy"}}
            gw2 = gateways[1][0]
            pids = gw2.children() or [gw2.process.pid]  # its workers, or itself
            told: set[int] = set()
            while told != set(pids):  # every process of gateway 2, whichever answers
                who, body = await _ready_from(port2, pids)
                if who is not None and body["groups"] == ejected:
                    told.add(who)
            honoured = trio.current_time() - decided
            sent_to_a = len(a.requests)
            for _ in range(4):
                s = Stream()
                await stream(port2, s)
                assert s.whole
            assert len(a.requests) == sent_to_a  # gateway 2 sent nothing to a
            await _stop(gateways)
    assert honoured < 1.0


async def test_redis_killed_and_restarted_under_load_fails_no_request(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # Two gateways serve a steady stream of requests while Redis is killed, stays down, and
    # comes back empty: every request is served whole; the degraded gauge and /readyz's
    # state go up on both, then down; each logs the loss once and the return once.
    async with FakeReplica(Behaviour(tokens=3), name="a") as a, trio.open_nursery() as nursery:
        configs = [_config(tmp_path, f"gw{i}", redis_server.url, [a]) for i in (1, 2)]
        with trio.fail_after(DEADLINE):
            gateways = await _gateways(nursery, configs)
            ports = [port for _, port in gateways]
            for port in ports:
                await _until(lambda port=port: _degraded_is(port, 0))
            results: list[Stream] = []
            stop = trio.Event()

            async def client(port: int) -> None:
                while not stop.is_set():
                    s = Stream()
                    await stream(port, s)
                    results.append(s)

            async with trio.open_nursery() as clients:
                for port in ports * 2:
                    clients.start_soon(client, port)
                await trio.sleep(0.3)
                redis_server.stop()
                for port in ports:
                    await _until(lambda port=port: _degraded_is(port, 1))
                    assert (await _ready(port))["state"] == "degraded"
                    assert (await _ready(port))["status"] == "ready"  # fail open
                during = len(results)
                await trio.sleep(0.5)
                redis_server.start()
                for port in ports:
                    await _until(lambda port=port: _degraded_is(port, 0))
                    assert (await _ready(port))["state"] == "ok"
                await trio.sleep(0.3)
                stop.set()
            # A busy machine may time a call out once more after the return (a flap: lost and
            # back again); stopped while connected, each loss has its return in the log.
            for port in ports:
                await _until(lambda port=port: _degraded_is(port, 0))
            await _stop(gateways)
            logs = [await gw.rest() for gw, _ in gateways]
    assert len(results) > during > 0
    assert [s.status for s in results if not s.whole] == []
    for lines in logs:  # one line each way per loss, not one per failing round
        lost = sum("is unreachable" in line for line in lines)
        assert lost >= 1 and sum("reachable again" in line for line in lines) == lost


async def test_a_gateway_started_while_redis_is_down_serves_and_joins_later(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    redis_server.stop()
    async with FakeReplica(Behaviour(tokens=3), name="a") as a, trio.open_nursery() as nursery:
        config = _config(tmp_path, "gw", redis_server.url, [a])
        with trio.fail_after(DEADLINE):
            gateways = await _gateways(nursery, [config])
            port = gateways[0][1]
            s = Stream()
            await stream(port, s)
            assert s.whole
            assert (await _ready(port))["state"] == "degraded"
            redis_server.start()
            await _until(lambda: _state_is(port, "ok"))
            await _stop(gateways)
