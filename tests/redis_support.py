"""A real ``redis-server`` per test, on a free loopback port, nothing written to disk (never
a mock: ../shared/README.md). Tests that need it skip, saying why, where it is missing;
``.ci/run`` installs Debian's package."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

REDIS_SERVER = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
)
try:
    import coredis  # noqa: F401

    HAVE_COREDIS = True
except ImportError:  # pragma: no cover - the dev extra installs it
    HAVE_COREDIS = False

needs_redis = [
    pytest.mark.skipif(
        REDIS_SERVER is None,
        reason="redis-server is not installed (apt-get install redis-server; .ci/run does)",
    ),
    pytest.mark.skipif(not HAVE_COREDIS, reason="coredis is not installed (the redis extra)"),
]

#: Seconds a redis-server may take to start answering (a bound, never a wait).
START_BOUND = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1:port``: `stop` (SIGKILL: as a crash) and `start`
    again on the same port, empty (no persistence), as a restarted Redis is."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        assert REDIS_SERVER is not None
        self.port = port or free_port()
        self.password = password
        self._dir = tempfile.mkdtemp(prefix="redis-test-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.process is None
        command = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", self._dir]
        if self.password:
            command += ["--requirepass", self.password]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + START_BOUND
        while True:  # another process: polled until it answers, bounded
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                if reply.startswith((b"+PONG", b"-NOAUTH")):
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.01)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: Redis accepts nothing and answers nothing (a slow, stuck Redis)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()
