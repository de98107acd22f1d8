"""Attacks on the gateway from outside, over real loopback sockets, that an earlier gateway
did not hold: a body trickled to hold a slot, a second gateway key in another header,
connections opened until no file descriptor is left for the replicas, h2 PRIORITY frames, a
body of a million objects, an h2 client gone while its answer ends."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys

import h2.settings
import httpx
import pytest
import trio

from trio_hedge.gateway import Limits
from trio_hedge.testing import Behaviour, FakeReplica

from .gateway_support import CHAT, Gateway, config_for
from .test_gateway_serve import Process, _start
from .test_gateway_server import H2, _frame, _headers, _logged, _port

FAST = Behaviour(ttft=0.0, token_delay=0.0, tokens=3)


async def _head(stream: trio.SocketStream) -> bytes:
    """The bytes up to the end of an HTTP/1.1 response's head."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = await stream.receive_some()
        if not piece:
            break
        data += piece
    return data


# -- a body trickled to hold a slot -------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http/1.1", "h2"])
async def test_a_body_that_does_not_arrive_loses_its_slot(
    protocol: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that sends a chat request's headers and one byte of its body held a
    concurrency slot until ``request_timeout`` (600 s by default): ``max_concurrent`` such
    sockets, 80 bytes each, locked every other client out with 503. ``body_timeout`` ends
    it: 408, the slot freed, the next client served."""
    caplog.set_level(logging.INFO)
    limits = Limits(max_concurrent=1, body_timeout=0.2, drain_timeout=0.0)
    async with FakeReplica(FAST, name="a") as a, Gateway(config_for([a], limits=limits)) as gw:
        port = _port(gw)
        with trio.fail_after(5):
            if protocol == "h2":
                async with H2.open(port) as client:
                    length = (b"content-length", b"1000")
                    sid = await client.request(
                        _headers(b"/v1/chat/completions", b"POST", length), end=False
                    )
                    client.connection.send_data(sid, b"{")
                    await client.flush()
                    await client.until(lambda: client.status(sid) is not None)
                    status = client.status(sid)
            else:
                async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                    await stream.send_all(
                        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                        b"content-length: 1000\r\n\r\n{"
                    )
                    head = await _head(stream)
                    status = int(head.split()[1])
                    assert b"connection: close" in head.lower()
            await _logged(caplog, "trio_hedge.gateway.access")  # the slot is released
            async with httpx.AsyncClient() as http:
                after = await http.post(f"{gw.url}/chat/completions", json=CHAT)
    assert status == 408
    assert after.status_code == 200
    assert len(a.requests) == 1


# -- a second gateway key in another header ------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ([("x-api-key", "wrong"), ("x-api-key", "sk-right")], "duplicate_header"),
        ([("x-api-key", "sk-right"), ("x-api-key", "wrong")], "duplicate_header"),
        ([("authorization", "Bearer sk-right"), ("x-api-key", "wrong")], "ambiguous_credentials"),
        ([("authorization", "Bearer wrong"), ("x-api-key", "sk-right")], "ambiguous_credentials"),
    ],
    ids=["x-api-key-wrong-right", "x-api-key-right-wrong", "bearer-right", "x-api-key-right"],
)
async def test_two_keys_in_one_request_are_refused(
    headers: list[tuple[str, str]], code: str
) -> None:
    """Two ``x-api-key`` headers: the last one won (wrong-then-right got 200); a bearer
    token and an ``x-api-key`` that differ: the bearer won. A proxy or replica reading the
    other one disagrees about who the caller is."""
    async with FakeReplica(FAST, name="a") as a:
        async with Gateway(config_for([a], keys=("sk-right",))) as gw:
            async with httpx.AsyncClient() as http:
                url = f"{gw.url}/chat/completions"
                twice = await http.post(url, json=CHAT, headers=headers)
                same = [("authorization", "Bearer sk-right"), ("x-api-key", "sk-right")]
                once = await http.post(url, json=CHAT, headers=same)
    assert twice.status_code == 400
    assert twice.json()["error"]["code"] == code
    assert "sk-right" not in twice.text
    assert once.status_code == 200
    assert len(a.requests) == 1


# -- connections opened until no descriptor is left for the replicas ----------------------

#: The file-descriptor limit of the gateway process in the test (soft and hard).
FD_LIMIT = 128


def _low_fd_limit() -> None:  # pragma: no cover - runs in the child
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _closed(sockets: list[socket.socket]) -> int:
    """How many of ``sockets`` the other side closed."""
    closed = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            closed += sock.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:  # reset
            closed += 1
    return closed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and RLIMIT_NOFILE")
async def test_idle_connections_leave_descriptors_for_the_replicas() -> None:
    """Idle connections up to the process's descriptor limit (each held until its 5 s
    keep-alive): the gateway could not connect to its replica (``EMFILE``) and answered a
    client's request 502 ``connection``, as if the replica had failed. With
    ``max_connections`` (half the limit by default) the ones beyond it are closed at once and
    the request is served."""
    flood = 2 * FD_LIMIT
    async with FakeReplica(FAST, name="a") as a, trio.open_nursery() as nursery:
        gateway: Process = await _start(
            nursery,
            "serve",
            "--port=0",
            f"--replica={a.url}",
            "--hedge-after=off",
            preexec_fn=_low_fd_limit,
        )
        with trio.fail_after(20):
            line = await gateway.line_with("listening on")
            port = int(re.search(r"127\.0\.0\.1:(\d+)", line).group(1))  # type: ignore[union-attr]
            fds = f"/proc/{gateway.process.pid}/fd"
            async with await trio.open_tcp_stream("127.0.0.1", port) as client:
                await client.send_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                assert b" 200 " in await _head(client)
                others = [socket.create_connection(("127.0.0.1", port)) for _ in range(flood)]
                # Until the gateway has taken what it will of them: its descriptors are
                # all used, or it closes the ones beyond max_connections.
                while len(os.listdir(fds)) < FD_LIMIT - 2 and _closed(others) < flood - FD_LIMIT:  # noqa: ASYNC110 (no event says so: poll)
                    await trio.sleep(0.01)
                body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
                await client.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                head = await _head(client)
                for other in others:
                    other.close()
            gateway.process.terminate()
            await gateway.rest()
    assert head.split()[1] == b"200", head
    assert len(a.requests) == 1
    assert any("max_connections" in line for line in gateway.lines)


# -- h2 PRIORITY frames for streams that never open ---------------------------------------


@pytest.mark.parametrize("depends", ["idle streams", "open stream"])
async def test_priority_frames_do_not_end_the_connection(
    depends: str, caplog: pytest.LogCaptureFixture
) -> None:
    """hypercorn 0.18.0 keeps every stream a PRIORITY frame names (and the one it depends
    on) in its priority tree; at 1001 the tree raised and the connection failed, cutting
    its requests (1001 frames of 14 bytes). Now PRIORITY is ignored (RFC 9113 §5.3.2) and
    the connection's next request is answered."""
    async with FakeReplica(FAST, name="a") as a, Gateway(config_for([a])) as gw:
        async with H2.open(_port(gw)) as client:
            with trio.fail_after(10):
                if depends == "idle streams":  # a PRIORITY frame per idle stream
                    for stream_id in range(1001, 3003, 2):
                        client.connection.prioritize(stream_id, depends_on=stream_id + 2)
                else:  # one open stream, made to depend on 1001 streams in turn
                    held = await client.request(
                        _headers(b"/v1/chat/completions", b"POST"), end=False
                    )
                    for parent in range(1001, 3003, 2):
                        client.connection.prioritize(held, depends_on=parent)
                await client.flush()
                good = await client.request(_headers())
                await client.until(client.ended(good))
    assert client.status(good) == 200
    assert not [r for r in caplog.records if "failed (" in r.getMessage()]


# -- a body of a million empty objects -----------------------------------------------------


@pytest.mark.parametrize("extra", [0, 1])
async def test_a_body_of_too_many_objects_is_refused(extra: int) -> None:
    """4 MiB of ``{},`` is 1.4 M objects: walking them for the depth check took 1.6 s of the
    event loop, every other stream stalled meanwhile, and the parsed request held ~50 MB.
    Past `MAX_JSON_CONTAINERS` arrays and objects the body is a 400 (the walk stops there);
    at the limit it is relayed."""
    from trio_hedge.gateway._input import MAX_JSON_CONTAINERS

    # The body, its messages list and message, the list "x", and its objects.
    objects = MAX_JSON_CONTAINERS - 4 + extra
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": ['
        + b",".join([b"{}"] * objects)
        + b"]}"
    )
    async with FakeReplica(FAST, name="a") as a, Gateway(config_for([a])) as gw:
        async with httpx.AsyncClient() as http:
            url = f"{gw.url}/chat/completions"
            answer = await http.post(
                url, content=body, headers={"content-type": "application/json"}
            )
            after = await http.post(url, json=CHAT)
    if extra:
        assert answer.status_code == 400
        assert "arrays and objects" in answer.json()["error"]["message"]
    else:
        assert answer.status_code == 200
    assert after.status_code == 200
    assert len(a.requests) == 2 - extra


# -- an h2 client gone while its answer's last bytes wait ----------------------------------


async def test_an_h2_client_gone_while_its_answer_ends_frees_its_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A window of 0 (``SETTINGS_INITIAL_WINDOW_SIZE``), a request, the answer's head read,
    the connection closed: hypercorn's send task stopped but the stream's buffer stayed
    open, so the request waited for its last bytes forever (``write_timeout`` off) holding
    its slot. Now it ends when the connection does; the next client is served."""
    caplog.set_level(logging.INFO)
    limits = Limits(max_concurrent=1, write_timeout=None, drain_timeout=0.0)
    async with FakeReplica(FAST, name="a") as a, Gateway(config_for([a], limits=limits)) as gw:
        with trio.fail_after(5):
            async with H2.open(_port(gw)) as client:
                client.connection.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
                await client.flush()
                sid = await client.request(_headers(b"/v1/chat/completions", b"POST"), end=False)
                client.connection.send_data(sid, json.dumps(CHAT).encode(), end_stream=True)
                await client.flush()
                await client.until(lambda: client.status(sid) is not None)
            await _logged(caplog, "trio_hedge.gateway.access")  # the slot is released
            async with httpx.AsyncClient() as http:
                after = await http.post(f"{gw.url}/chat/completions", json=CHAT)
    assert client.status(sid) == 200
    assert after.status_code == 200


# -- an h2 connection that never ends a stream ----------------------------------------------


@pytest.mark.parametrize("then", ["nothing", "PINGs", "a header block never ended"])
async def test_an_h2_connection_without_a_finished_stream_times_out(
    then: str, autojump_clock: trio.testing.MockClock
) -> None:
    """The HTTP/2 preface, then nothing (or a PING a second, or HEADERS without
    END_HEADERS): hypercorn stopped the keep-alive timer on the preface and restarts it only
    when a stream ends, so the connection stayed open forever (and took a
    ``max_connections`` place). Now it is closed after the keep-alive timeout (5 s, virtual
    time here)."""
    async with FakeReplica(FAST, name="a") as a, Gateway(config_for([a])) as gw:
        async with H2.open(_port(gw)) as client:
            opened = trio.current_time()
            with trio.fail_after(60):
                if then == "a header block never ended":
                    block = b"\x82\x84\x86\x41\x01x"  # GET / http, :authority x (HPACK)
                    await client.stream.send_all(_frame(1, 0, 1, block))  # no END_HEADERS
                try:
                    while await client.stream.receive_some():
                        if then == "PINGs":  # one a second, each answered
                            await trio.sleep(1)
                            client.connection.ping(b"12345678")
                            await client.flush()
                except trio.BrokenResourceError:  # reset: closed too
                    pass
            closed = trio.current_time() - opened
    assert closed == pytest.approx(5.0, abs=1.0)
