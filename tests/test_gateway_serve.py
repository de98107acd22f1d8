"""`trio-hedge serve` and `trio-hedge fake` as processes: SIGTERM drains, the fake answers."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trio_hedge.testing import Behaviour, FakeReplica

from .gateway_support import CHAT

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


class Process:
    """A ``python -m trio_hedge`` child whose output lines are read as they come."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""
        self.lines: list[str] = []

    async def line_with(self, text: str) -> str:
        """Wait for an output line containing ``text`` (bound it with fail_after)."""
        assert self.process.stdout is not None
        while True:
            for line in self.lines:
                if text in line:
                    return line
            chunk = await self.process.stdout.receive_some()
            if not chunk:
                raise AssertionError(f"exited without {text!r}: {self.lines}")
            self._buffer += chunk
            *done, self._buffer = self._buffer.split(b"\n")
            self.lines += [d.decode() for d in done]

    async def rest(self) -> list[str]:
        assert self.process.stdout is not None
        while chunk := await self.process.stdout.receive_some():
            self._buffer += chunk
        self.lines += [d.decode() for d in self._buffer.split(b"\n") if d]
        return self.lines


async def _start(nursery: trio.Nursery, *args: str, **options: Any) -> Process:
    """``python -m trio_hedge *args`` (``options`` for ``trio.run_process``)."""
    command = [sys.executable, "-m", "trio_hedge", *args]
    run = functools.partial(
        trio.run_process,
        command,
        stdout=-1,
        stderr=-2,  # STDOUT: one stream, in order
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        **options,
    )
    process = await nursery.start(run)
    return Process(process)


async def _stream(url: str, out: list[bytes], started: trio.Event) -> None:
    async with httpx.AsyncClient() as http:
        body: dict[str, Any] = {**CHAT, "stream": True}
        async with http.stream("POST", f"{url}/chat/completions", json=body) as response:
            async for piece in response.aiter_raw():
                out.append(piece)
                if b"tok0" in piece:
                    started.set()


@pytest.mark.parametrize("drain", ["in time", "timeout"])
async def test_sigterm_drains_then_cancels(drain: str) -> None:
    paced = Behaviour(ttft=0.0, token_delay=0.05, tokens=12 if drain == "in time" else 10_000)
    timeout = "30" if drain == "in time" else "0.3"
    async with FakeReplica(paced, name="a") as a, trio.open_nursery() as nursery:
        gw = await _start(
            nursery, "serve", "--replica", a.url, "--port", "0", "--drain-timeout", timeout
        )
        with trio.fail_after(20):
            line = await gw.line_with("listening on ")
            url = line.split("listening on ")[1].split()[0] + "/v1"
            out: list[bytes] = []
            started = trio.Event()
            async with trio.open_nursery() as clients:
                clients.start_soon(_stream, url, out, started)
                await started.wait()
                gw.process.send_signal(signal.SIGTERM)
                await gw.line_with("shutting down gracefully (1 request in flight)")
                with pytest.raises(httpx.ConnectError):  # no longer accepting
                    async with httpx.AsyncClient() as http:
                        await http.get(url.removesuffix("/v1") + "/healthz")
            assert await gw.process.wait() == 0
            lines = await gw.rest()
    text = b"".join(out).decode()
    access = [json.loads(x) for x in lines if x.startswith("{")]
    if drain == "in time":
        assert text.endswith("data: [DONE]\n\n") and "tok11" in text
        assert a.requests[0].completed
        assert access[-1]["status"] == 200 and access[-1]["tokens"] == 12
    else:
        last = json.loads(text.strip().split("\n\n")[-1].removeprefix("data: "))
        assert last["error"]["code"] == "shutdown"
        assert "[DONE]" not in text
        assert a.requests[0].disconnected_at is not None  # the upstream was closed
        assert access[-1]["error"] == "shutdown"


async def test_fake_command_serves_until_sigterm() -> None:
    async with trio.open_nursery() as nursery:
        fake = await _start(
            nursery, "fake", "--port", "0", "--ttft", "0", "--tokens", "3", "--name", "f1"
        )
        with trio.fail_after(20):
            line = await fake.line_with("listening on ")
            url = line.split("listening on ")[1].strip()
            async with httpx.AsyncClient() as http:
                answer = await http.post(f"{url}/chat/completions", json=CHAT)
                failing = await http.get(url.removesuffix("/v1") + "/health")
            await fake.line_with("request 1: status 200, 3 tokens sent, completed")
            fake.process.send_signal(signal.SIGTERM)
            assert await fake.process.wait() == 0
    assert answer.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    assert failing.status_code == 200


async def test_serve_without_replicas_is_a_usage_error() -> None:
    done = await trio.run_process(
        [sys.executable, "-m", "trio_hedge", "serve"], capture_stdout=True, capture_stderr=True,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert b"give --replica URL" in done.stderr


@pytest.mark.parametrize("pick", [None, "in_order"])
async def test_the_readme_gateway_hedges_every_request_with_pick_in_order(
    pick: str | None,
) -> None:
    """The README's gateway block: a slow replica given first, a fast one second. With
    ``--pick in_order`` the slow one stays the primary and every request is hedged; the
    default pick (peak EWMA) learns from the first lost race to ask the fast one first."""
    slow = Behaviour(ttft=2.0, tokens=2)
    fast = Behaviour(ttft=0.0, tokens=2)
    async with (
        FakeReplica(slow, name="slow") as a,
        FakeReplica(fast, name="fast") as b,
        trio.open_nursery() as nursery,
    ):
        args = ["serve", "--replica", a.url, "--replica", b.url, "--hedge-after", "0.05"]
        gw = await _start(nursery, *args, "--port", "0", *(["--pick", pick] if pick else []))
        with trio.fail_after(30):
            line = await gw.line_with("listening on ")
            url = line.split("listening on ")[1].split()[0] + "/v1"
            hedged = []
            async with httpx.AsyncClient() as http:
                for _ in range(3):
                    response = await http.post(f"{url}/chat/completions", json=CHAT)
                    assert response.status_code == 200
                    hedged.append(response.headers["x-hedge-hedged"])
            gw.process.send_signal(signal.SIGTERM)
            assert await gw.process.wait() == 0
    assert hedged == (["true"] * 3 if pick == "in_order" else ["true", "false", "false"])


async def test_http1_only_flag() -> None:
    """``--http1-only``: the gateway says so, and a prior-knowledge HTTP/2 client gets 505."""
    async with FakeReplica(Behaviour(tokens=2), name="a") as a, trio.open_nursery() as nursery:
        gw = await _start(nursery, "serve", "--replica", a.url, "--port", "0", "--http1-only")
        with trio.fail_after(20):
            line = await gw.line_with("listening on ")
            port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                answer = await stream.receive_some()
            gw.process.send_signal(signal.SIGTERM)
            assert await gw.process.wait() == 0
    assert "(HTTP/1.1 only)" in line
    assert answer.startswith(b"HTTP/1.1 505")


# -- starting it wrong (issue 20, item 11) ----------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "fake"])
async def test_a_taken_port_is_one_line_and_exit_2(command: str) -> None:
    """On bcbad18: a 56-line (serve) or 23-line (fake) traceback and exit 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--replica", "http://127.0.0.1:9/v1"] if command == "serve" else []
        with trio.fail_after(20):
            done = await trio.run_process(
                [sys.executable, "-m", "trio_hedge", command, *args, "--port", str(port)],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert done.returncode == 2
    assert done.stderr.decode() == (
        f"trio-hedge: cannot listen on 127.0.0.1:{port}: address already in use "
        "(choose another port with --port)\n"
    )
    assert done.stdout == b""


async def test_the_readme_readiness_loop_gives_up() -> None:
    """The README's wait for ``/readyz``, run against a port nothing listens on (a gateway
    that could not start): it ends. On bcbad18 it was ``until curl …``: it waited forever."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("trio-hedge serve --replica", 1)[1]
    lines = block.split("\n")[2:]  # after the serve command's two lines
    loop = "\n".join(lines[: next(i for i, x in enumerate(lines) if x.startswith("curl -N"))])
    assert "readyz" in loop
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again: nothing listens there
    script = re.sub(r"sleep [0-9.]+", "sleep 0", loop.replace("8080", str(port)))
    with trio.fail_after(30):  # 50 refused connections take well under a second
        await trio.run_process(["bash", "-c", script], check=False)
