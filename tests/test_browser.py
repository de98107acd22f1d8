"""The browser example (``examples/sse_server.py``) in a real browser (issue 31, item 4):
headless Chromium (Debian's package; ``.ci/run`` installs it) driven over its DevTools
protocol (CDP, a WebSocket: trio-websocket), the page served by the example's own ASGI app
over loopback fake replicas. The page shows the tokens as they arrive, then the report
(winner, hedged, TTFT); closing the tab closes the upstream attempts (counted on the fakes).

The screenshot in the docs (``docs/img/sse-example.png``) is this test's: run it with
``TRIO_HEDGE_SCREENSHOT=docs/img/sse-example.png`` to take it again.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import struct
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import trio_hedge as th
from trio_hedge.testing import Behaviour, FakeReplica, fake_replicas

from .test_examples import _load, _serve

trio_websocket = pytest.importorskip("trio_websocket")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (apt-get install chromium; .ci/run does)",
)

#: What headless Chromium needs here: no sandbox (root in a container), no GPU, nothing
#: fetched from the network at start (component updates, sync), a profile of its own.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--remote-debugging-port=0",
)
ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "docs" / "img" / "sse-example.png"


class DevTools:
    """A Chrome DevTools Protocol connection: commands (``send``) and events (``wait_for``),
    one page session at a time (``flatten`` sessions: one WebSocket for all)."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._answers: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self._event = trio.Event()
        self.session: str | None = None

    async def read(self) -> None:
        while True:
            try:
                text = await self._ws.get_message()
            except trio_websocket.ConnectionClosed:
                return
            message = json.loads(text)
            if "id" in message:
                channel = self._answers.pop(message["id"], None)
                if channel is not None:
                    channel.send_nowait(message)
            else:
                self.events.append(message)
                self._event.set()
                self._event = trio.Event()

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self._ids)
        out, answer = trio.open_memory_channel[dict[str, Any]](1)
        self._answers[number] = out
        message: dict[str, Any] = {"id": number, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        await self._ws.send_message(json.dumps(message))
        reply = await answer.receive()
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply["result"]
        return result

    async def wait_for(self, method: str, since: int = 0) -> dict[str, Any]:
        while True:
            for event in self.events[since:]:
                if event["method"] == method:
                    return event
            await self._event.wait()

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


@asynccontextmanager
async def chromium() -> AsyncIterator[DevTools]:
    """Headless Chromium with a fresh profile, and a DevTools connection to it; the browser
    and every process it started are ended on exit."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        command = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"]
        async with trio.open_nursery() as nursery:
            process = await trio.lowlevel.open_process(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: its children end with it
            )  # fmt: skip
            try:
                assert process.stderr is not None
                seen = b""
                while b"DevTools listening on " not in seen or not seen.endswith(b"\n"):
                    chunk = await process.stderr.receive_some()
                    assert chunk, seen.decode(errors="replace")
                    seen += chunk
                url = seen.split(b"DevTools listening on ")[1].split()[0].decode()

                async def drain_stderr() -> None:  # its warnings must not fill the pipe
                    assert process.stderr is not None
                    while await process.stderr.receive_some():
                        pass

                nursery.start_soon(drain_stderr)
                async with trio_websocket.open_websocket_url(url, message_queue_size=0) as ws:
                    tools = DevTools(ws)
                    nursery.start_soon(tools.read)
                    yield tools
                    nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    os.killpg(process.pid, signal.SIGTERM)
                    with trio.move_on_after(5) as waited:
                        await process.wait()
                    if waited.cancelled_caught:
                        os.killpg(process.pid, signal.SIGKILL)
                        await process.wait()


async def _open_tab(tools: DevTools, url: str) -> str:
    """A new tab on ``url``, loaded; its target id (the session is attached to it)."""
    target = (await tools.send("Target.createTarget", url="about:blank"))["targetId"]
    attached = await tools.send("Target.attachToTarget", targetId=target, flatten=True)
    tools.session = attached["sessionId"]
    await tools.send("Page.enable")
    await tools.send("Runtime.enable")
    await tools.send(
        "Emulation.setDeviceMetricsOverride",
        width=760,
        height=115,
        deviceScaleFactor=1,
        mobile=False,
    )
    since = len(tools.events)
    await tools.send("Page.navigate", url=url)
    await tools.wait_for("Page.loadEventFired", since)
    return str(target)


ASK = "document.querySelector('#f button').click()"
OUT = "document.getElementById('out').textContent"
REPORT = "document.getElementById('report').textContent"


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@attrs.frozen
class Example:
    """The example's page served over two fake replicas, and a browser."""

    url: str
    primary: FakeReplica
    backup: FakeReplica
    tools: DevTools


@asynccontextmanager
async def example(
    primary: Behaviour, backup: Behaviour, hedge_after: float
) -> AsyncIterator[Example]:
    """``examples/sse_server.py``'s app over a slow primary and a backup (``pick="in_order"``:
    the primary first, as a preferred one), and headless Chromium; all stopped on exit."""
    sse = _load("sse_server")
    async with (
        fake_replicas(primary, backup, names=["primary", "backup"]) as (p, b),
        trio.open_nursery() as nursery,
    ):
        replicas = [th.Replica(r.url, name=r.name) for r in (p, b)]
        config = th.HedgerConfig(hedge_after=hedge_after, pick="in_order")
        async with th.Hedger(replicas, config) as hedger:
            url, shutdown = await _serve(sse.App(hedger, "m"), nursery)
            try:
                async with chromium() as tools:
                    yield Example(url, p, b, tools)
            finally:
                shutdown.set()


async def test_the_page_shows_tokens_as_they_come_and_the_report() -> None:
    """Ask on the page: the answer grows on screen token by token (the page's text read
    while the backup streams, one word every 80 ms), then the report says the backup won,
    hedged, with its TTFT: the primary was slow (1 s) and the hedge went after 0.3 s. The
    screenshot shows it."""
    sse = _load("sse_server")
    words = sse.ANSWER.split(" ")
    primary = Behaviour(ttft=1.0, token_delay=0.02, tokens=sse.ANSWER)
    backup = Behaviour(ttft=0.05, token_delay=0.08, tokens=sse.ANSWER)
    with trio.fail_after(30):
        async with example(primary, backup, hedge_after=0.3) as page:
            tools, p = page.tools, page.primary
            await _open_tab(tools, page.url + "/")
            await tools.evaluate(ASK)
            seen: list[str] = []
            while not (report := await tools.evaluate(REPORT)):
                text = await tools.evaluate(OUT)
                if text and (not seen or text != seen[-1]):
                    seen.append(text)
                await trio.sleep(0.02)  # the page's state, read as a user sees it
            final = await tools.evaluate(OUT)
            shot = await tools.send("Page.captureScreenshot", format="png")
    assert final == sse.ANSWER
    growing = [s for s in seen if s != sse.ANSWER]
    assert len(growing) >= len(words) // 2, seen  # shown as the tokens came, not at the end
    assert all(sse.ANSWER.startswith(s) for s in seen)
    assert " ".join(report.split()).startswith("winner backup (attempt 2), hedged: true, TTFT 0.")
    ttft = float(report.split("TTFT ")[1].split()[0])
    assert 0.3 <= ttft < 1.0
    assert p.requests[0].disconnected_at is not None  # the primary, cancelled at the commit
    image = base64.b64decode(shot["data"])
    assert _png_size(image) == (760, 115)
    where = os.environ.get("TRIO_HEDGE_SCREENSHOT")
    if where:
        await trio.Path(where).write_bytes(image)
    assert _png_size(await trio.Path(SCREENSHOT).read_bytes()) == (760, 115)  # the docs' copy


async def test_closing_the_tab_closes_every_upstream_attempt() -> None:
    """A long answer streaming into the page; the tab is closed: the backup streaming it
    sees its client go within 0.5 s, long before the end (400 tokens, 20 s), and the
    primary, cancelled at the commit, is closed too: no attempt is left open upstream."""
    primary = Behaviour(ttft=5.0, tokens=400)
    backup = Behaviour(ttft=0.05, token_delay=0.05, tokens=400)
    with trio.fail_after(30):
        async with example(primary, backup, hedge_after=0.1) as page:
            tools = page.tools
            target = await _open_tab(tools, page.url + "/")
            await tools.evaluate(ASK)
            while len((await tools.evaluate(OUT) or "").split()) < 5:  # noqa: ASYNC110
                await trio.sleep(0.02)
            closed_at = trio.current_time()
            await tools.send("Target.closeTarget", targetId=target)
            with trio.fail_after(2):
                gone = await page.backup.wait_disconnected(0)
                loser = await page.primary.wait_finished(0)
    assert gone.disconnected_at is not None
    assert gone.disconnected_at - closed_at < 0.5
    assert 5 <= gone.tokens_sent < 400
    assert loser.disconnected_at is not None and loser.tokens_sent == 0
