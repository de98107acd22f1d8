"""Shared helpers for the benchmarks: an out-of-process SSE server, statistics, tables.

The server (``python benchmarks/_common.py serve``) is deliberately minimal and cheap: plain
blocking sockets, one thread per connection, HTTP/1.1 keep-alive with chunked transfer
encoding, and **one SSE event per HTTP chunk, each written with its own ``sendall``** (as LLM
servers flush one event per token). Its events are rendered once per token count, so its own
CPU cost per token is a few microseconds, and it runs in another process, so none of it is
counted in the client's ``time.process_time()``.

Requests choose their answer by path: ``POST /d{ms}/n{tokens}/v1/chat/completions`` sends the
headers and a role-only chunk at once, waits ``ms`` milliseconds, then sends ``tokens``
content chunks, a finish chunk and ``data: [DONE]``; ``/v1/messages`` and ``/v1/responses``
send the same tokens as Anthropic Messages and OpenAI Responses events (their real shapes
and sizes). Without ``/n{tokens}`` the body's
``max_tokens`` says how many (default 16) and its ``x_pace_ms`` how many milliseconds apart
(default 0), so one base URL (a gateway's replica) serves every size. A client that goes away
is noticed at the next write (the thread ends).
"""

from __future__ import annotations

import functools
import json
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

_PATH = re.compile(rb"^/d(\d+)(?:/n(\d+))?/v1/(chat/completions|messages|responses)$")
_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
_WORDS = ("The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".")


def _event(delta: dict[str, str], finish: str | None = None) -> bytes:
    # The shape (and ~230 bytes) of an OpenAI chat-completion chunk.
    payload = {
        "id": "chatcmpl-9zQ3bWc7m1kTz0aYfX2rL8pNvE4sHdJq",
        "object": "chat.completion.chunk",
        "created": 1718000000,
        "model": "gpt-4o-mini-2024-07-18",
        "system_fingerprint": "fp_0123456789",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def token_text(i: int) -> str:
    """The text of content token ``i`` the server sends."""
    return _WORDS[i % len(_WORDS)]


def _typed(payload: dict[str, object]) -> bytes:
    """One HTTP chunk holding one typed SSE event (``event:`` + ``data:``, as both agent APIs
    send them)."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    event = b"event: %s\ndata: %s\n\n" % (str(payload["type"]).encode(), data)
    return b"%x\r\n%s\r\n" % (len(event), event)


_MESSAGE = {
    "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5-20250929",
    "content": [],
    "stop_reason": None,
    "stop_sequence": None,
    "usage": {"input_tokens": 25, "output_tokens": 1},
}
_RESPONSE = {"id": "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b", "object": "response"}
_ITEM = "msg_67ccd2bf17f0819081ff3bb2cf6508e60bb6a6b452d3795b"


def _agent_events(api: bytes, tokens: int) -> tuple[bytes, list[bytes], bytes]:
    if api == b"messages":
        block = {"type": "text", "text": ""}
        first = _typed({"type": "message_start", "message": _MESSAGE}) + _typed(
            {"type": "content_block_start", "index": 0, "content_block": block}
        )
        body = [
            _typed(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": token_text(i)},
                }
            )
            for i in range(tokens)
        ]
        stop = {"stop_reason": "end_turn", "stop_sequence": None}
        tail = (
            _typed({"type": "content_block_stop", "index": 0})
            + _typed({"type": "message_delta", "delta": stop, "usage": {"output_tokens": tokens}})
            + _typed({"type": "message_stop"})
        )
        return first, body, tail + b"0\r\n\r\n"
    item = {"id": _ITEM, "type": "message", "status": "in_progress", "role": "assistant"}
    first = _typed({"type": "response.created", "sequence_number": 0, "response": _RESPONSE})
    first += _typed({"type": "response.output_item.added", "output_index": 0, "item": item})
    body = [
        _typed(
            {
                "type": "response.output_text.delta",
                "sequence_number": i + 2,
                "item_id": _ITEM,
                "output_index": 0,
                "content_index": 0,
                "delta": token_text(i),
                "logprobs": [],
                "obfuscation": "k8f2Qp",
            }
        )
        for i in range(tokens)
    ]
    done = {**_RESPONSE, "status": "completed", "usage": {"output_tokens": tokens}}
    tail = _typed({"type": "response.completed", "response": done}) + b"0\r\n\r\n"
    return first, body, tail


@functools.cache
def _events(tokens: int, api: bytes = b"chat/completions") -> tuple[bytes, list[bytes], bytes]:
    if api != b"chat/completions":
        return _agent_events(api, tokens)
    first = _event({"role": "assistant", "content": ""})
    body = [_event({"content": token_text(i)}) for i in range(tokens)]
    done = b"data: [DONE]\n\n"
    tail = _event({}, "stop") + b"%x\r\n%s\r\n" % (len(done), done) + b"0\r\n\r\n"
    return first, body, tail


def _read_request(sock: socket.socket, buf: bytearray) -> tuple[bytes, bytes] | None:
    """Read one request; return its path and body (``None`` at EOF). Leaves extra bytes in
    ``buf``."""
    while b"\r\n\r\n" not in buf:
        more = sock.recv(65536)
        if not more:
            return None
        buf += more
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    del buf[:end]
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(buf) < length:
        more = sock.recv(65536)
        if not more:
            return None
        buf += more
    body = bytes(buf[:length])
    del buf[:length]
    return head.split(b" ", 2)[1], body


def _serve_connection(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray()
    try:
        with sock:
            while (request := _read_request(sock, buf)) is not None:
                path, request_body = request
                match = _PATH.match(path)
                if match is None:
                    sock.sendall(_NOT_FOUND)
                    continue
                delay_ms, pace = int(match[1]), 0.0
                if match[2] is not None:
                    tokens = int(match[2])
                else:
                    asked = json.loads(request_body or b"{}")
                    tokens = int(asked.get("max_tokens", 16))
                    pace = float(asked.get("x_pace_ms", 0)) / 1000
                first, body, tail = _events(tokens, match[3])
                sock.sendall(_HEAD + first)
                if delay_ms:
                    time.sleep(delay_ms / 1000)
                send = sock.sendall
                for chunk in body:
                    if pace:
                        time.sleep(pace)
                    send(chunk)
                send(tail)
    except OSError:
        pass  # the client went away


def serve(port: int = 0) -> None:
    """Run the server forever; print the port on stdout."""
    listener = socket.create_server(("127.0.0.1", port), backlog=4096)
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_connection, args=(conn,), daemon=True).start()


@contextmanager
def server_process() -> Iterator[int]:
    """Start the SSE server in another process; yield its port; stop it on exit."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "serve"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def url(port: int, *, delay_ms: int = 0, tokens: int) -> str:
    """The OpenAI base URL for an answer of ``tokens`` tokens after ``delay_ms``."""
    return f"http://127.0.0.1:{port}/d{delay_ms}/n{tokens}/v1"


# -- statistics --------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), nearest-rank on sorted values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def rss_bytes() -> int:
    """This process's resident set size (Linux ``/proc``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    """File descriptors open in this process (Linux ``/proc``)."""
    import os

    return len(os.listdir("/proc/self/fd"))


def verdict(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'FAIL'}: {text}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve()
    else:
        raise SystemExit("usage: python benchmarks/_common.py serve")
