"""What the examples promise beyond their smoke runs (CI smoke-runs each with --smoke): the SSE
endpoint relays tokens as they arrive, and a browser that goes away closes every upstream."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import trio

pytest.importorskip("hypercorn")

import trio_hedge as th
from trio_hedge.testing import Behaviour, fake_replicas

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def _serve(app: object, nursery: trio.Nursery) -> tuple[str, trio.Event]:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    shutdown = trio.Event()

    async def run(task_status: trio.TaskStatus[list[str]]) -> None:
        await serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)  # type: ignore[arg-type]

    binds = await nursery.start(run)
    return binds[0], shutdown


async def test_sse_endpoint_relays_tokens_and_a_gone_browser_closes_every_upstream() -> None:
    sse = _load("sse_server")
    slow = Behaviour(ttft=30.0)
    streaming = Behaviour(ttft=0.0, token_delay=0.05, tokens=200)
    async with fake_replicas(slow, streaming, names=["p", "b"]) as (p, b), trio.open_nursery() as n:
        replicas = [th.Replica(r.url, name=r.name) for r in (p, b)]
        async with th.Hedger(replicas, th.HedgerConfig(hedge_after=0.05)) as hedger:
            url, shutdown = await _serve(sse.App(hedger, "m"), n)
            async with httpx.AsyncClient(timeout=5) as client:
                tokens = []
                async with client.stream("GET", url + "/chat", params={"q": "hi"}) as response:
                    assert response.headers["content-type"] == "text/event-stream"
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            tokens.append(json.loads(line[6:])["token"])
                            if len(tokens) == 3:
                                break  # the browser goes away mid-answer
                left_at = trio.current_time()
            assert tokens == ["tok0 ", "tok1 ", "tok2 "]
            with trio.fail_after(2):
                primary = await p.wait_finished(0)
                backup = await b.wait_disconnected(0)
            assert primary.disconnected_at is not None  # the loser, at the commit
            assert backup.disconnected_at is not None
            assert backup.disconnected_at - left_at < 0.1
            assert backup.tokens_sent < 200
            shutdown.set()


def test_the_chat_example_shows_the_hedge_its_docstring_promises() -> None:
    """The primary is slow on the second request: the backup the hedge sent answers it (with
    the default pick, peak EWMA, the Hedger learned to avoid the primary: no hedge shown)."""
    pytest.importorskip("rich")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "chat.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = " ".join(done.stdout.split())  # rich wraps lines
    assert "winner primary (attempt 1) · not hedged" in out
    # The backup went once the 0.3 s hedge delay had passed: the figure is wall-clock time, a
    # hundredth or two later on a loaded machine (it read 0.31 s under CI load).
    hedged = re.search(r"winner backup \(attempt 2\) · hedged after (\d+\.\d\d) s", out)
    assert hedged is not None, out
    assert float(hedged.group(1)) >= 0.30


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_chat_ends_on_ctrl_c_without_a_traceback() -> None:
    # A chat UI is where users copy Ctrl-C handling from: it used to end in a 20-line
    # KeyboardInterrupt traceback inside an exception group.
    import signal

    pytest.importorskip("rich")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent), *sys.path])}
    chat = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "chat.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert chat.stdout is not None
    seen = ""
    while "you>" not in seen:  # waiting for the user's line
        char = chat.stdout.read(1)
        assert char, "the chat ended before asking"
        seen += char
    chat.send_signal(signal.SIGINT)
    _, err = chat.communicate(timeout=30)
    assert chat.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip() == "interrupted"
