"""Run the gateway: HTTP/1.1 and h2c (HTTP/2 without TLS) on one port (or HTTP/1.1 only), one
long-lived [`Hedger`][trio_hedge.Hedger] per group over one shared connection pool. The
connections themselves are ``_server.py``'s (hypercorn's protocol code, each connection
contained and its writes bounded).

With ``[state] redis_url``, the fleet's slow state (ejections, cooldowns, the learned
delay's samples) and each gateway key's leases are shared with the fleet's other processes
through Redis: one store and one ledger per process, their loops in the gateway's nursery,
every group's Hedgers (on every route) publishing to the store and taking in what the others
publish (``state/_redis.py``, ``state/_redis_ledger.py``).

Shutdown (SIGTERM or SIGINT, or ``stop.set()``): ``/readyz`` answers 503 ``draining`` while
new requests are still served for ``drain_delay`` seconds (so that load balancers take the
instance out of rotation first); then stop accepting, answer new requests on open
connections with 503, let in-flight requests go on for ``drain_timeout`` seconds, then cancel
them (each ends with an in-band error event, its upstream attempts closed), then close the
connections and the pool. A second signal stops at once: no more delay, the requests in
flight cancelled.

The health log (``_health_log.py``) runs beside the server: each Hedger announces its
cooldowns and ejections, and a task compares the fleet with what the log has said every
second.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import signal
from collections.abc import Mapping, Sequence

import trio

from .. import Hedger
from ..events import EventHook
from ..hedger import LoadMonitor
from ..policy._writer import FleetWriter
from ..state import (
    FleetStore,
    KeyLedger,
    LocalFleetStore,
    LocalKeyLedger,
    RedisFleetStore,
    RedisKeyLedger,
    StateChange,
)
from ..transport import make_client
from ._agent import agent_hedgers
from ._app import GatewayApp
from ._config import GatewayConfig, StateConfig
from ._health_log import HealthLog
from ._limits import Limiter
from ._metrics import GatewayMetrics
from ._server import Server, default_max_connections, open_listeners, requests_text

__all__ = ["serve"]

logger = logging.getLogger("trio_hedge.gateway")

#: Connections waiting to be accepted: bursts of thousands of new connections.
BACKLOG = 4096


async def _signals(stop: trio.Event, limiter: Limiter, server: Server) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not stop.is_set():
                logger.info(
                    "%s: shutting down gracefully (%s in flight); a second SIGTERM or "
                    "Ctrl-C stops at once, cancelling the requests in flight",
                    name,
                    requests_text(limiter.in_flight),
                )
                stop.set()
            else:
                logger.info(
                    "second signal (%s): stopping now, cancelling %s in flight",
                    name,
                    requests_text(limiter.in_flight),
                )
                limiter.cancel_all()
                server.hurry()


def fleet_store(state: StateConfig) -> FleetStore:
    """The fleet store ``[state]`` asks for: Redis when it names a URL, else nobody's.

    Raises:
        ImportError: a Redis URL without the ``redis`` extra (``coredis``).
    """
    if state.redis_url is None:
        return LocalFleetStore()
    if importlib.util.find_spec("coredis") is None:
        raise ImportError(
            "[state] redis_url needs the redis extra: pip install 'trio-hedge[redis]'",
            name="coredis",
        )
    return RedisFleetStore(state.redis_url, prefix=state.prefix, timeout=state.timeout)


def key_ledger(state: StateConfig) -> RedisKeyLedger | None:
    """The key ledger ``[state]`` asks for: Redis's when it names a URL (this process's own
    counts while Redis is unreachable, or refusals with ``fail_closed``), else ``None`` (the
    gateway's own `LocalKeyLedger`).

    Raises:
        ImportError: a Redis URL without the ``redis`` extra (``coredis``).
    """
    if state.redis_url is None:
        return None
    if importlib.util.find_spec("coredis") is None:
        raise ImportError(
            "[state] redis_url needs the redis extra: pip install 'trio-hedge[redis]'",
            name="coredis",
        )
    return RedisKeyLedger(
        state.redis_url,
        fallback=LocalKeyLedger(),
        fail_closed=state.fail_closed,
        prefix=state.prefix,
        timeout=state.timeout,
    )


def _share(store: FleetStore, hedgers: Mapping[str, Hedger]) -> dict[str, FleetWriter]:
    """Connect each group's one fleet (every route's Hedger shares it: ``fleet_of``) to
    ``store`` under the group's name: its writer publishes what it decides there. The
    writers by group (none when nothing is shared: the writer then does no work for it)."""
    writers: dict[str, FleetWriter] = {}
    if store.status == "local":
        return writers
    for group, hedger in hedgers.items():
        hedger._fleet.name = group
        hedger._writer.store = store
        writers[group] = hedger._writer
    return writers


async def serve(
    config: GatewayConfig,
    *,
    stop: trio.Event | None = None,
    handle_signals: bool = False,
    ledger: KeyLedger | None = None,
    listeners: Sequence[trio.SocketListener] | None = None,
    worker: int | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``config`` until ``stop`` is set (or, with ``handle_signals``, SIGTERM/SIGINT),
    then drain (see the module docstring). ``ledger``: where each gateway key's leases are
    kept ([`KeyLedger`][trio_hedge.state.KeyLedger]; default this process's own,
    [`LocalKeyLedger`][trio_hedge.state.LocalKeyLedger]), owned by the caller.

    ``await nursery.start(serve, config, stop=stop)`` returns the URLs it listens on
    (``["http://127.0.0.1:PORT"]``; port 0 picks a free one).

    ``listeners``: sockets already listening (a ``--workers`` supervisor's, handed down),
    in place of ``config.host:config.port``; closed at the end. ``worker``: this process's
    index among the workers (logs, and the ``worker`` label of ``/metrics``).

    Raises:
        OSError: it cannot listen on ``config.host:config.port`` (the port taken, …),
            before anything else is opened; its message names the address.
    """
    stop = trio.Event() if stop is None else stop
    if listeners is None:
        listeners = await open_listeners(config.host, config.port, BACKLOG)
    listeners = list(listeners)
    metrics = GatewayMetrics(worker)
    store = fleet_store(config.state)
    shared_ledger = key_ledger(config.state) if ledger is None else None
    if shared_ledger is not None:
        ledger = shared_ledger
    health = HealthLog(lambda: store.status)
    hedgers: dict[str, Hedger] = {}
    by_api: dict[str, dict[str, Hedger]] = {}
    async with make_client() as client:
        # One poller per probed replica for the whole gateway: every group's Hedgers, on
        # every route, read it (a cancel by any of them opens its quiet window).
        monitor = LoadMonitor(config.replicas, client=client)
        try:
            for group in config.groups:
                replicas = [config.replica(name) for name in group.replicas]
                hooks: list[EventHook] = [metrics.hook, health.hook("chat", group.name)]
                hedgers[group.name] = Hedger(
                    replicas, group.hedger, client=client, on_event=hooks, probes=monitor
                )
            # The same groups speaking Anthropic Messages and OpenAI Responses (_agent.py).
            by_api = agent_hedgers(config, client, [metrics.hook], hedgers)
            writers = _share(store, hedgers)

            def apply(change: StateChange) -> None:
                """Another process's change, to its group's fleet (every route's)."""
                writer = writers.get(change.fleet)
                if writer is not None:
                    writer.apply_remote(change, trio.current_time())

            app = GatewayApp(config, hedgers, client, metrics, by_api, ledger, store=store)
            if shared_ledger is not None:
                metrics.watch_state({"keys": shared_ledger})
            limiter = app.limiter
            limits = config.limits
            server = Server(
                app,
                write_timeout=limits.write_timeout,
                request_timeout=limits.request_timeout,
                http2=config.http2,
                max_connections=limits.max_connections or default_max_connections(),
            )
            async with monitor, trio.open_nursery() as nursery:
                nursery.start_soon(server.watch)
                await nursery.start(store.run, apply)  # started at once: never waits on Redis
                if shared_ledger is not None:
                    await nursery.start(shared_ledger.run)
                # One fleet view per group, whatever the route (the agent routes' Hedgers
                # share the chat Hedger's state and hooks): its changes logged once.
                nursery.start_soon(health.run, {"chat": hedgers})
                if handle_signals:
                    nursery.start_soon(_signals, stop, limiter, server)
                await _accept_then_drain(
                    config, server, limiter, listeners, stop, task_status, worker
                )
                nursery.cancel_scope.cancel()  # served and drained: stop the helpers
        finally:
            for listener in listeners:
                with trio.CancelScope(shield=True):
                    await listener.aclose()
            with trio.CancelScope(shield=True):
                for hedger in [
                    *hedgers.values(),
                    *(h for g in by_api.values() for h in g.values()),
                ]:
                    await hedger.aclose()


async def _accept_then_drain(
    config: GatewayConfig,
    server: Server,
    limiter: Limiter,
    listeners: list[trio.SocketListener],
    stop: trio.Event,
    task_status: trio.TaskStatus[list[str]],
    worker: int | None = None,
) -> None:
    """Accept connections until ``stop``, then stop accepting and drain."""
    binds = [_url(listener) for listener in listeners]
    async with trio.open_nursery() as connections:
        try:
            async with trio.open_nursery() as accepting:
                await accepting.start(
                    functools.partial(
                        trio.serve_listeners,
                        server.handle,
                        listeners,
                        handler_nursery=connections,
                    )
                )
                groups = ", ".join(f"{g.name}: {'/'.join(g.replicas)}" for g in config.groups)
                logger.info(
                    "%strio-hedge gateway listening on %s (%s); groups %s",
                    "" if worker is None else f"worker {worker}: ",
                    " ".join(binds),
                    "HTTP/1.1, h2c" if config.http2 else "HTTP/1.1 only",
                    groups,
                )
                task_status.started(binds)
                await stop.wait()
                limits = config.limits
                if limits.drain_delay > 0 and not server.hurried:
                    limiter.leave()
                    logger.info(
                        "draining: /readyz answers 503 'draining'; new requests are still "
                        "served for drain_delay=%g s, then the listener closes",
                        limits.drain_delay,
                    )
                    await server.linger(limits.drain_delay)
                    # The balancer was told for drain_delay: the idle keep-alive connections
                    # close now, with the listener. A balancer pools idle connections by
                    # address, and one to a process restarted on the same port would hand a
                    # request to this one (answered 503 while it drains): HAProxy did, in
                    # 2 of 8 rolling restarts (test_a_rolling_restart_loses_no_request...).
                    await server.close_idle()
                limiter.start_draining()
                accepting.cancel_scope.cancel()  # the listening sockets close
            if limiter.in_flight and not server.hurried:
                logger.info(
                    "listener closed: waiting up to drain_timeout=%g s for %s in flight",
                    config.limits.drain_timeout,
                    requests_text(limiter.in_flight),
                )
            else:
                logger.info("listener closed")
            await server.drain(config.limits.drain_timeout, limiter.cancel_all)
            connections.cancel_scope.cancel()
        finally:  # cancelled from outside: nothing may wait on a client
            server.close_all()


def _url(listener: trio.SocketListener) -> str:
    host, port = listener.socket.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
