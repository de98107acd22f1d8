"""``trio-hedge serve --workers N`` with real processes: N workers on one port under a
supervisor; a worker killed mid-stream costs its own clients a clean end (the connection
closes: no hang) and nobody else anything, and is restarted (logged); one SIGTERM drains
every worker; ``/metrics`` sums the workers' counters; the default (1) starts no supervisor.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio

from trio_hedge.testing import Behaviour, FakeReplica

from .gateway_processes import Process, Stream, owner, start, stream

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals, /proc"),
]

#: Seconds a whole scenario may take (processes start in ~1 s each); a bound, never a wait.
DEADLINE = 60
#: 40 tokens 50 ms apart: a stream lasts 2 s, long enough to act in the middle of it.
PACED = Behaviour(ttft=0.0, token_delay=0.05, tokens=40)


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


async def _on_every_worker(
    clients: trio.Nursery, port: int, pids: list[int], *, batch: int = 8, batches: int = 20
) -> tuple[list[Stream], dict[int, int | None]]:
    """Open streams in batches until every worker holds one (the kernel hands a connection
    to whichever worker accepts first: one batch may all go to one); each stream's owner."""
    streams: list[Stream] = []
    owners: dict[int, int | None] = {}
    for _ in range(batches):
        fresh = [Stream() for _ in range(batch)]
        for s in fresh:
            clients.start_soon(stream, port, s)
        for s in fresh:
            await s.started.wait()
            owners[id(s)] = owner(port, s.client_port, pids)
        streams += fresh
        if set(owners.values()) >= set(pids):
            break
    return streams, owners


async def _workers(gw: Process, count: int) -> list[int]:
    """The supervisor's workers, once ``count`` of them listen."""
    for i in range(count):
        await gw.line_with(f"worker {i}: trio-hedge gateway listening on")
    pids = gw.children()
    assert len(pids) == count
    return pids


async def test_workers_share_one_port_and_metrics_sum_them(tmp_path: Path) -> None:
    async with FakeReplica(Behaviour(tokens=3), name="a") as a, trio.open_nursery() as nursery:
        config = tmp_path / "gw.toml"
        config.write_text(f'[server]\nworkers = 2\n[[replicas]]\nbase_url = "{a.url}"\n')
        gw = await start(nursery, "serve", "--config", str(config), "--port", "0")
        with trio.fail_after(DEADLINE):
            port = await gw.port()
            pids = await _workers(gw, 2)
            streams = [Stream() for _ in range(40)]
            async with trio.open_nursery() as clients:
                for s in streams:
                    clients.start_soon(stream, port, s)
            assert all(s.whole and s.tokens == 3 for s in streams)
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            # Whichever worker answered, the counters are the gateway's: both workers'.
            total = re.search(
                r'^trio_hedge_gateway_requests_total\{path="/v1/chat/completions",status="200"\} '
                r"(\S+)$",
                metrics,
                re.M,
            )
            assert total is not None and float(total[1]) == 40
            assert re.search(r'trio_hedge_gateway_trio_tasks\{worker="[01]"\}', metrics)
            gw.process.send_signal(signal.SIGTERM)
            assert await gw.process.wait() == 0
        assert not any(_alive(pid) for pid in pids)


async def test_a_worker_killed_mid_stream_costs_only_its_own_clients() -> None:
    async with FakeReplica(PACED, name="a") as a, trio.open_nursery() as nursery:
        gw = await start(nursery, "serve", "--replica", a.url, "--port", "0", "--workers", "2")
        with trio.fail_after(DEADLINE):
            port = await gw.port()
            pids = await _workers(gw, 2)
            async with trio.open_nursery() as clients:
                streams, owners = await _on_every_worker(clients, port, pids)
                victim = pids[0]
                killed_at = trio.current_time()
                os.kill(victim, signal.SIGKILL)
                line_at = len(gw.lines)
                restarted = await gw.line_with("exited with signal SIGKILL: restarting", after=0)
            ended_after = trio.current_time() - killed_at
            mine = [s for s in streams if owners[id(s)] == victim]
            others = [s for s in streams if owners[id(s)] != victim]
            assert mine and others, owners
            # The killed worker's clients: the connection ends (closed or reset), never a
            # hang, and no whole answer is claimed; the others get every token.
            assert all(not s.whole and s.ended in ("eof", "reset") for s in mine)
            assert all(s.whole and s.tokens == 40 for s in others)
            assert ended_after < 10  # the others took 2 s; nobody waited on a dead worker
            assert f"(pid {victim})" in restarted
            await gw.line_with("trio-hedge gateway listening on", after=line_at)  # the new one
            new_pids = gw.children()
            assert len(new_pids) == 2 and victim not in new_pids
            after = [Stream() for _ in range(8)]
            async with trio.open_nursery() as clients:
                for s in after:
                    clients.start_soon(stream, port, s)
            assert all(s.whole for s in after)
            gw.process.send_signal(signal.SIGTERM)
            assert await gw.process.wait() == 0


async def test_one_sigterm_drains_every_worker() -> None:
    async with FakeReplica(PACED, name="a") as a, trio.open_nursery() as nursery:
        gw = await start(nursery, "serve", "--replica", a.url, "--port", "0", "--workers", "2")
        with trio.fail_after(DEADLINE):
            port = await gw.port()
            pids = await _workers(gw, 2)
            async with trio.open_nursery() as clients:
                streams, owners = await _on_every_worker(clients, port, pids)
                assert set(owners.values()) == set(pids)  # both workers had streams in flight
                gw.process.send_signal(signal.SIGTERM)
                await gw.line_with("SIGTERM: draining 2 workers")
                for _ in pids:
                    await gw.line_with("listener closed: waiting up to drain_timeout")
            assert all(s.whole and s.tokens == 40 for s in streams)  # every stream ended whole
            assert await gw.process.wait() == 0
            with pytest.raises(OSError):  # nobody listens any more
                await trio.open_tcp_stream("127.0.0.1", port)
        assert not any(_alive(pid) for pid in pids)


async def test_one_worker_by_default_starts_no_supervisor() -> None:
    async with FakeReplica(Behaviour(tokens=3), name="a") as a, trio.open_nursery() as nursery:
        gw = await start(nursery, "serve", "--replica", a.url, "--port", "0")
        with trio.fail_after(DEADLINE):
            port = await gw.port()
            s = Stream()
            await stream(port, s)
            assert s.whole
            assert gw.children() == []  # the gateway is this one process, as before
            assert not any("worker" in line for line in gw.lines)
            gw.process.send_signal(signal.SIGTERM)
            assert await gw.process.wait() == 0
