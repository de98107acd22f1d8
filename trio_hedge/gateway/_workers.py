"""``trio-hedge serve --workers N``: N gateway processes on one port.

A supervisor process opens the listening sockets and hands them down (gunicorn's and
uvicorn's model, rather than ``SO_REUSEPORT``: a connection the kernel queued for a worker that
dies is not lost, since every worker accepts from the one queue), then starts N workers, each
a whole gateway (``serve`` with the sockets it was given) in a session of its own, so a
terminal's Ctrl-C reaches the supervisor once, not every worker twice. It

* restarts a worker that dies (logged with its exit status; a worker that dies within
  ``QUICK_EXIT`` seconds of its start is restarted after a back-off that doubles up to
  ``MAX_BACKOFF`` seconds, so a crash loop does not spin);
* on SIGTERM or SIGINT closes its own copy of the sockets and sends SIGTERM to every worker:
  each drains as one gateway does (``_serve.py``); a second signal is passed on too (each
  worker then cancels its requests at once). It exits when every worker has, with 0 if every
  worker did;
* makes the directory the workers' metrics are aggregated through
  (``PROMETHEUS_MULTIPROC_DIR``, ``_metrics.py``), tells prometheus-client when a worker
  died (its live gauges leave the sums) and removes the directory at the end.

A worker whose supervisor dies drains and exits (it looks every second).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence

import trio

from ._config import GatewayConfig
from ._server import open_listeners

__all__ = ["parse_worker", "supervise", "watch_supervisor", "worker_listeners"]

logger = logging.getLogger("trio_hedge.gateway")

#: Connections waiting to be accepted (as ``_serve.BACKLOG``).
BACKLOG = 4096
#: A worker that exits within this many seconds of its start is restarted after a back-off.
QUICK_EXIT = 5.0
#: The longest back-off before a quickly dying worker is started again (seconds).
MAX_BACKOFF = 10.0


def _exit_text(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


class _Supervisor:
    def __init__(self, config: GatewayConfig, argv: Sequence[str], fds: list[int]) -> None:
        self.config = config
        self.argv = list(argv)
        self.fds = fds
        self.folder = tempfile.mkdtemp(prefix="trio-hedge-metrics-")
        self.env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.folder}
        self.processes: dict[int, trio.Process] = {}
        self.stop = trio.Event()
        self.signals = 0
        self.statuses: dict[int, int | None] = {}
        self.listeners: list[trio.SocketListener] = []

    def command(self, index: int) -> list[str]:
        spec = f"{index}:{os.getpid()}:{','.join(map(str, self.fds))}"
        return [sys.executable, "-m", "trio_hedge", *self.argv, "--worker", spec]

    async def keep(self, index: int) -> None:
        """Run worker ``index`` until the supervisor stops, restarting it when it dies."""
        quick = 0
        while not self.stop.is_set():
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                run = functools.partial(
                    trio.run_process,
                    self.command(index),
                    check=False,
                    pass_fds=self.fds,
                    env=self.env,
                    start_new_session=True,
                )
                process: trio.Process = await nursery.start(run)
                self.processes[index] = process
                if self.stop.is_set():  # a signal came while it started
                    process.send_signal(signal.SIGTERM)
            del self.processes[index]
            self._dead(process.pid)
            self.statuses[index] = process.returncode
            if self.stop.is_set():
                return
            quick = quick + 1 if trio.current_time() - started < QUICK_EXIT else 0
            backoff = 0.0 if not quick else min(MAX_BACKOFF, 0.5 * 2 ** (quick - 1))
            logger.warning(
                "worker %d (pid %d) exited with %s: restarting it%s",
                index,
                process.pid,
                _exit_text(process.returncode),
                f" in {backoff:g} s" if backoff else "",
            )
            with trio.move_on_after(backoff):
                await self.stop.wait()

    def _dead(self, pid: int) -> None:
        with contextlib.suppress(Exception):  # bookkeeping only: never fatal
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self.folder)  # type: ignore[no-untyped-call]

    async def watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                self.signals += 1
                if self.signals == 1:
                    logger.info(
                        "%s: draining %d workers", signal.Signals(signum).name, len(self.processes)
                    )
                    self.stop.set()
                    for listener in self.listeners:  # the workers' copies close as they drain
                        await listener.aclose()
                else:
                    logger.info("second signal: the workers cancel their requests now")
                for process in list(self.processes.values()):
                    with contextlib.suppress(OSError):
                        process.send_signal(signal.SIGTERM)


async def supervise(config: GatewayConfig, argv: Sequence[str]) -> int:
    """Open the listening sockets, run ``config.workers`` workers (each ``python -m
    trio_hedge`` with ``argv`` and the hidden ``--worker`` flag) until SIGTERM or SIGINT,
    and return the exit status: 0 if every worker ended with 0.

    Raises:
        ListenError: it cannot listen on ``config.host:config.port``.
    """
    listeners = await open_listeners(config.host, config.port, BACKLOG)
    fds = [listener.socket.fileno() for listener in listeners]
    for fd in fds:
        os.set_inheritable(fd, True)
    supervisor = _Supervisor(config, argv, fds)
    supervisor.listeners = listeners
    try:
        async with trio.open_nursery() as outer:
            outer.start_soon(supervisor.watch_signals)
            async with trio.open_nursery() as workers:
                for index in range(config.workers):
                    workers.start_soon(supervisor.keep, index)
                binds = []
                for listener in listeners:
                    host, port = listener.socket.getsockname()[:2]
                    binds.append(
                        f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
                    )
                logger.info(
                    "trio-hedge gateway listening on %s (%s); %d workers",
                    " ".join(binds),
                    "HTTP/1.1, h2c" if config.http2 else "HTTP/1.1 only",
                    config.workers,
                )
            outer.cancel_scope.cancel()
    finally:
        for listener in listeners:
            with trio.CancelScope(shield=True):
                await listener.aclose()
        shutil.rmtree(supervisor.folder, ignore_errors=True)
    failed = [i for i, code in supervisor.statuses.items() if code != 0]
    for index in failed:
        logger.warning("worker %d ended with %s", index, _exit_text(supervisor.statuses[index]))
    return 1 if failed else 0


def parse_worker(spec: str) -> tuple[int, int, list[int]]:
    """``INDEX:SUPERVISOR_PID:FD[,FD…]`` (the hidden ``--worker`` flag).

    Raises:
        ValueError: not in that form.
    """
    index, supervisor, fds = spec.split(":")
    return int(index), int(supervisor), [int(fd) for fd in fds.split(",") if fd]


async def watch_supervisor(supervisor: int, every: float = 1.0) -> None:
    """Drain (send this process SIGTERM, which ``serve`` handles) when the supervisor
    ``supervisor`` is gone: this process's parent is then another. Polled every ``every``
    seconds (Linux's ``PR_SET_PDEATHSIG`` follows the thread that started the process, and
    Trio starts processes from a thread that may end)."""
    while os.getppid() == supervisor:  # noqa: ASYNC110 - another process: polled
        await trio.sleep(every)
    logger.warning("the supervisor (pid %d) is gone: draining", supervisor)
    os.kill(os.getpid(), signal.SIGTERM)


def worker_listeners(fds: Sequence[int]) -> list[trio.SocketListener]:
    """The supervisor's listening sockets, inherited as ``fds``."""
    out = []
    for fd in fds:
        sock = socket.socket(fileno=fd)
        out.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
    return out
