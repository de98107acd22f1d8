"""A Trio web endpoint that relays a hedged stream to a browser as server-sent events.

A raw ASGI app served by hypercorn's Trio worker: ``GET /`` is a page that opens an
``EventSource``; ``GET /chat?q=...`` races the replicas and sends each token as an SSE
``data:`` event as soon as it arrives, then an ``event: report`` (winner, hedge, TTFT) and
``event: done``. A browser that goes away cancels the request: every upstream response is
closed, so the replicas stop generating.

Run:

    .venv/bin/python examples/sse_server.py          # fake replicas; open http://127.0.0.1:8080/
    .venv/bin/python examples/sse_server.py --smoke  # serve, fetch one answer over HTTP, exit
    .venv/bin/python examples/sse_server.py --replica http://10.0.0.1:8000/v1 \\
        --replica http://10.0.0.2:8000/v1 --model my-model

Needs the ``examples`` extra; from a clone of the repository:
``.venv/bin/pip install -c constraints.txt -e ".[examples]"`` (once released:
``pip install "trio-hedge[examples]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

import trio_hedge as th
from trio_hedge.testing import Behaviour, RequestRecord, fake_replicas

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

PAGE = b"""<!doctype html><meta charset="utf-8"><title>trio_hedge SSE</title>
<form id="f"><input id="q" size="60" value="Why hedge on the first token?"><button>Ask</button>
</form><p id="out" style="white-space:pre-wrap"></p><p id="report" style="color:#666"></p>
<script>
document.getElementById("f").onsubmit = (e) => {
  e.preventDefault();
  const out = document.getElementById("out"), rep = document.getElementById("report");
  out.textContent = ""; rep.textContent = "";
  const q = encodeURIComponent(document.getElementById("q").value);
  const es = new EventSource("/chat?q=" + q);
  es.onmessage = (m) => { out.textContent += JSON.parse(m.data).token; };
  es.addEventListener("report", (m) => {
    const r = JSON.parse(m.data);
    rep.textContent = `winner ${r.winner_replica} (attempt ${r.winner}), hedged: ${r.hedged},
      TTFT ${r.ttft.toFixed(3)} s`;
  });
  es.addEventListener("done", () => es.close());
};
</script>
"""
ANSWER = "Because the first token is what a user waits for, and a queue delays exactly it."


def _sse(data: object, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


class App:
    """The ASGI application: one Hedger shared by every request."""

    def __init__(self, hedger: th.Hedger, model: str) -> None:
        self.hedger = hedger
        self.model = model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = (await receive())["type"]  # lifespan.startup, lifespan.shutdown
                await send({"type": f"{message}.complete"})
                if message == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        if scope["path"] == "/":
            await _respond(send, 200, b"text/html; charset=utf-8", PAGE)
        elif scope["path"] == "/chat":
            query = parse_qs(scope["query_string"].decode())
            question = query.get("q", ["Hello"])[0]
            await self.chat(question, receive, send)
        else:
            await _respond(send, 404, b"text/plain", b"not found")

    async def chat(self, question: str, receive: Receive, send: Send) -> None:
        request = {"model": self.model, "messages": [{"role": "user", "content": question}]}
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async with trio.open_nursery() as nursery:
            # A browser that goes away cancels the relay, and with it every attempt.
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            stream = self.hedger.stream(request)
            try:
                async with stream:
                    async for token in stream:
                        await _body(send, _sse({"token": token}))
            except th.HedgeError as exc:
                await _body(send, _sse({"error": str(exc)}, "error"))
            report = stream.report
            summary = {
                "winner": report.winner,
                "winner_replica": report.winner_replica,
                "hedged": report.hedged,
                "ttft": report.ttft,
            }
            await _body(send, _sse(summary, "report") + _sse({}, "done"))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _body(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _respond(send: Send, status: int, content_type: bytes, body: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def _replicas(urls: list[str] | None) -> AsyncIterator[list[th.Replica]]:
    if urls:
        yield [th.Replica(url) for url in urls]
        return

    def primary(record: RequestRecord) -> Behaviour:  # slow on every other request
        return Behaviour(ttft=2.0 if record.index % 2 else 0.05, token_delay=0.02, tokens=ANSWER)

    backup = Behaviour(ttft=0.1, token_delay=0.02, tokens=ANSWER)
    async with fake_replicas(primary, backup, names=["primary", "backup"]) as fakes:
        yield [th.Replica(f.url, name=f.name) for f in fakes]


async def _smoke(url: str, *, fakes: bool) -> int:
    """Fetch two answers as a browser would; check tokens, the report and the end (and, from
    the fake replicas, that the second answer came from the backup the hedge sent)."""
    seen: list[tuple[str, bool]] = []
    async with httpx.AsyncClient(timeout=10) as client:
        page = await client.get(url + "/")
        assert page.status_code == 200 and b"EventSource" in page.content
        for _ in range(2):
            text, report = "", None
            async with client.stream("GET", url + "/chat", params={"q": "hi"}) as response:
                assert response.headers["content-type"] == "text/event-stream"
                event = None
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        if event is None:
                            text += data["token"]
                        elif event == "report":
                            report = data
                        event = None
            print(f"{text!r}\n  report: {report}")
            assert text == ANSWER and report is not None and report["ttft"] is not None
            seen.append((report["winner_replica"], report["hedged"]))
    assert not fakes or seen == [("primary", False), ("backup", True)], seen
    return 0


async def main(args: argparse.Namespace) -> int:
    config = Config()
    config.bind = [f"127.0.0.1:{0 if args.smoke else args.port}"]
    config.accesslog = None
    async with (
        _replicas(args.replica) as replicas,
        # "in_order": the first replica is the preferred primary, hedged to the backup when it
        # is slow. The default pick ("peak_ewma") would learn to go to the backup first, and
        # the fake primary's slow answers would never show a hedge.
        th.Hedger(replicas, th.HedgerConfig(hedge_after=0.3, pick="in_order")) as hedger,
        trio.open_nursery() as nursery,
    ):
        app = App(hedger, args.model)
        shutdown = trio.Event()
        binds = await nursery.start(
            lambda task_status: serve(  # type: ignore[misc]
                app, config, shutdown_trigger=shutdown.wait, task_status=task_status
            )
        )
        print(f"serving on {binds[0]}/ (Ctrl-C quits)")
        if args.smoke:
            try:
                return await _smoke(binds[0], fakes=not args.replica)
            finally:
                shutdown.set()
        await trio.sleep_forever()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="serve, fetch two answers, exit")
    parser.add_argument("--port", type=int, default=8080, help="port (default: %(default)s)")
    parser.add_argument("--replica", action="append", help="an OpenAI-compatible base URL")
    parser.add_argument("--model", default="fake-model", help="model name (default: %(default)s)")
    sys.exit(trio.run(main, parser.parse_args()))
