"""Graceful rollouts (issue 31, item 3): on SIGTERM ``/readyz`` turns 503 ``draining`` while
the listener stays open for ``drain_delay`` seconds and new requests are still served; then
the listener closes and the requests in flight drain. The log says what a second signal does,
and a second signal does it: it stops at once, without claiming a drain timeout that never
passed. (Two gateways behind HAProxy through a rolling restart:
``tests/test_gateway_haproxy.py``.)"""

from __future__ import annotations

import json
import signal
import sys

import httpx
import pytest
import trio

from trio_hedge.gateway import Limits
from trio_hedge.testing import Behaviour, FakeReplica

from .gateway_support import Gateway, config_for
from .test_gateway_serve import _start, _stream

DELAY = 1.0  # seconds of drain_delay: a bound the test measures, not a wait


async def test_the_listener_stays_open_for_the_drain_delay() -> None:
    """A stream in flight, then stop: at once ``/readyz`` answers 503 ``draining``, and a
    new client on a new connection is still served (its stream whole); the listener
    closes no sooner than ``drain_delay`` after the stop; the stream begun before the stop
    ends whole. On c6222d8 the listener closed at once: the new client was refused."""
    paced = Behaviour(tokens=40, token_delay=0.05)  # 2 s: past the delay
    async with FakeReplica(paced, name="a") as a:
        limits = Limits(drain_timeout=10, drain_delay=DELAY)
        async with Gateway(config_for([a], limits=limits)) as gw:
            root = gw.base_url
            with trio.fail_after(20):
                async with trio.open_nursery() as clients:
                    first: list[bytes] = []
                    started = trio.Event()
                    clients.start_soon(_stream, gw.url, first, started)
                    await started.wait()
                    gw.stop.set()
                    stopped = trio.current_time()
                    async with httpx.AsyncClient(timeout=10) as http:
                        ready = await http.get(f"{root}/readyz")
                    late: list[bytes] = []
                    late_started = trio.Event()
                    clients.start_soon(_stream, gw.url, late, late_started)  # a new connection
                    await late_started.wait()
                    while True:
                        try:
                            async with httpx.AsyncClient() as http:
                                await http.get(f"{root}/healthz")
                        except (httpx.ConnectError, httpx.RemoteProtocolError):
                            # Refused, or accepted in the instant the listener closed and
                            # closed with it, unread (as idle): either way, closed.
                            closed = trio.current_time()
                            break
                        await trio.sleep(0.02)
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert closed - stopped >= DELAY
    for stream in (first, late):
        text = b"".join(stream)
        assert text.endswith(b"data: [DONE]\n\n") and text.count(b'"content":"tok') == 40


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
async def test_a_second_signal_stops_at_once_and_says_so() -> None:
    """SIGTERM with a stream in flight and a long drain delay: the log says the gateway is
    draining and what a second signal does; a second SIGTERM stops it at once (the stream
    ends with the in-band ``shutdown`` error, the upstream closed) and the log says so,
    with no "drain timeout" line (on c6222d8: "drain timeout: cancelling 1 requests",
    although no timeout had passed)."""
    paced = Behaviour(tokens=10_000, token_delay=0.05)
    async with FakeReplica(paced, name="a") as a, trio.open_nursery() as nursery:
        args = ["serve", "--replica", a.url, "--port", "0", "--drain-delay", "60"]
        gw = await _start(nursery, *args, "--drain-timeout", "60")
        with trio.fail_after(20):
            line = await gw.line_with("listening on ")
            url = line.split("listening on ")[1].split()[0] + "/v1"
            out: list[bytes] = []
            started = trio.Event()
            async with trio.open_nursery() as clients:
                clients.start_soon(_stream, url, out, started)
                await started.wait()
                gw.process.send_signal(signal.SIGTERM)
                first = await gw.line_with("SIGTERM: ")
                await gw.line_with("draining: /readyz answers 503")
                async with httpx.AsyncClient() as http:
                    ready = await http.get(url.removesuffix("/v1") + "/readyz")
                gw.process.send_signal(signal.SIGTERM)
                second = await gw.line_with("second signal")
            assert await gw.process.wait() == 0
            lines = await gw.rest()
    assert first == (
        "SIGTERM: shutting down gracefully (1 request in flight); a second SIGTERM or "
        "Ctrl-C stops at once, cancelling the requests in flight"
    )
    assert ready.status_code == 503
    assert second == "second signal (SIGTERM): stopping now, cancelling 1 request in flight"
    assert not [x for x in lines if "drain timeout" in x or "drain_timeout=" in x], lines
    last = json.loads(b"".join(out).decode().strip().split("\n\n")[-1].removeprefix("data: "))
    assert last["error"]["code"] == "shutdown"
    assert a.requests[0].disconnected_at is not None
