"""``trio-hedge serve`` as real processes for tests: start one (its output read line by line
as it comes), stream from it over a raw loopback socket, and tell which of its worker
processes holds a client's connection (``/proc``: Linux)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import attrs
import trio

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


class Process:
    """A ``python -m trio_hedge`` child whose output is read as it comes, all the time (a
    gateway under load writes an access-log line per request: a pipe nobody reads fills up
    and the gateway blocks on its next line)."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""
        self.lines: list[str] = []
        self._ended = False
        self._changed = trio.Event()

    async def pump(self) -> None:
        """Read the output until it ends (in the nursery that runs the process)."""
        assert self.process.stdout is not None
        try:
            while chunk := await self.process.stdout.receive_some():
                self._buffer += chunk
                *done, self._buffer = self._buffer.split(b"\n")
                if done:
                    self.lines += [d.decode() for d in done]
                    self._changed.set()
                    self._changed = trio.Event()
        finally:
            if self._buffer:
                self.lines.append(self._buffer.decode())
                self._buffer = b""
            self._ended = True
            self._changed.set()

    async def line_with(self, text: str, *, after: int = 0) -> str:
        """Wait for an output line (from line ``after`` on) containing ``text`` (bound it
        with fail_after)."""
        while True:
            for line in self.lines[after:]:
                if text in line:
                    return line
            if self._ended:
                raise AssertionError(f"exited without {text!r}: {self.lines}")
            await self._changed.wait()

    async def rest(self) -> list[str]:
        """Every line, once the output has ended."""
        while not self._ended:
            await self._changed.wait()
        return self.lines

    async def port(self) -> int:
        line = await self.line_with("listening on http://127.0.0.1:")
        return int(line.split("listening on http://127.0.0.1:")[1].split()[0])

    def children(self) -> list[int]:
        """The pids of its child processes (its workers), from /proc."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.process.pid:
                    found.append(int(entry.name))
        return sorted(found)


async def _terminate_then_kill(process: trio.Process) -> None:
    """Cancelled: SIGTERM, and SIGKILL 5 s later (trio's own default warns first, which the
    test suite's ``-W error`` turns into an exception before the kill: the child lived on)."""
    with contextlib.suppress(OSError):
        process.terminate()
    with trio.move_on_after(5):
        await process.wait()
        return
    with contextlib.suppress(OSError):
        process.kill()


async def start(nursery: trio.Nursery, *args: str, **options: Any) -> Process:
    """``python -m trio_hedge *args`` in ``nursery``, stdout and stderr as one stream, read
    all the time."""
    command = [sys.executable, "-m", "trio_hedge", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **options.pop("env", {})}
    run = functools.partial(
        trio.run_process,
        command,
        stdout=-1,
        stderr=-2,
        check=False,
        env=env,
        deliver_cancel=_terminate_then_kill,
        **options,
    )
    process = Process(await nursery.start(run))
    nursery.start_soon(process.pump)
    return process


@attrs.define
class Stream:
    """One streamed chat completion over its own connection, read to its end."""

    client_port: int = 0
    status: int = 0
    body: bytes = b""
    ended: str = ""  # "done" ([DONE] and the connection's end), "eof", "reset"
    tokens: int = 0
    started: trio.Event = attrs.Factory(trio.Event)

    @property
    def whole(self) -> bool:
        return self.status == 200 and self.ended == "done"


async def stream(
    port: int, out: Stream, body: dict[str, Any] | None = None, **headers: str
) -> None:
    """POST a streamed chat completion to ``127.0.0.1:port`` and read the answer into
    ``out`` (``out.started`` is set at its first token)."""
    payload = json.dumps({**(body or CHAT), "stream": True}).encode()
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n{extra}connection: close\r\n\r\n"
    ).encode()
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    async with sock:
        out.client_port = sock.socket.getsockname()[1]
        await sock.send_all(head + payload)
        data = b""
        try:
            while chunk := await sock.receive_some(65536):
                data += chunk
                out.tokens = len(re.findall(rb'"content":"tok', data))
                if out.tokens:
                    out.started.set()
        except trio.BrokenResourceError:
            out.ended = "reset"
        else:
            out.ended = "eof"
    head_bytes, _, out.body = data.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/1\.1 (\d+)", head_bytes)
    out.status = int(match[1]) if match else 0
    if out.ended == "eof" and b"data: [DONE]" in out.body and out.body.endswith(b"0\r\n\r\n"):
        out.ended = "done"
    out.started.set()


def owner(server_port: int, client_port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` holds the server side of the connection from ``client_port`` to
    ``server_port`` (its socket's inode in /proc/net/tcp, among each process's fds)."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, remote = fields[1], fields[2]
            if (
                int(local.rsplit(":", 1)[1], 16) == server_port
                and int(remote.rsplit(":", 1)[1], 16) == client_port
            ):
                inode = fields[9]
    if inode is None:
        return None
    wanted = f"socket:[{inode}]"
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == wanted:
                    return pid
            except OSError:
                continue
    return None
