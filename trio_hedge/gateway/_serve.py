"""Run the gateway on hypercorn's Trio worker: HTTP/1.1 and h2c (HTTP/2 without TLS) on one
port, one long-lived [`Hedger`][trio_hedge.Hedger] per group over one shared connection pool.

Shutdown (SIGTERM or SIGINT, or ``stop.set()``): stop accepting, answer new requests on open
connections with 503, let in-flight requests go on for ``drain_timeout`` seconds, then cancel
them (each ends with an in-band error event, its upstream attempts closed), then close the
pool. A second signal cancels at once.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import hypercorn.config
import hypercorn.trio
import trio

from .. import Hedger
from ..transport import make_client
from ._agent import agent_hedgers
from ._app import GatewayApp
from ._config import GatewayConfig
from ._limits import Limiter
from ._metrics import GatewayMetrics

__all__ = ["serve"]

logger = logging.getLogger("trio_hedge.gateway")

#: Seconds hypercorn waits beyond ``drain_timeout`` for cancelled requests to write their
#: last event and close their upstreams, before it cuts the connections.
CLOSE_GRACE = 5.0


def _hypercorn_config(config: GatewayConfig) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.graceful_timeout = config.limits.drain_timeout + CLOSE_GRACE
    hc.accesslog = None  # the gateway writes its own, one JSON line per request
    hc.errorlog = logging.getLogger("trio_hedge.gateway.server")
    hc.backlog = 4096  # bursts of thousands of new connections
    return hc


async def _cancel_after(limiter: Limiter, seconds: float) -> None:
    await trio.sleep(seconds)
    if limiter.in_flight:
        logger.info("drain timeout: cancelling %d requests in flight", limiter.in_flight)
    limiter.cancel_all()


async def _signals(stop: trio.Event, limiter: Limiter) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if not stop.is_set():
                logger.info(
                    "%s: draining (%d in flight)", signal.Signals(signum).name, limiter.in_flight
                )
                stop.set()
            else:
                logger.info("second signal: cancelling %d requests now", limiter.in_flight)
                limiter.cancel_all()


async def serve(
    config: GatewayConfig,
    *,
    stop: trio.Event | None = None,
    handle_signals: bool = False,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``config`` until ``stop`` is set (or, with ``handle_signals``, SIGTERM/SIGINT),
    then drain (see the module docstring).

    ``await nursery.start(serve, config, stop=stop)`` returns the URLs it listens on
    (``["http://127.0.0.1:PORT"]``; port 0 picks a free one).
    """
    stop = trio.Event() if stop is None else stop
    metrics = GatewayMetrics()
    hedgers: dict[str, Hedger] = {}
    by_api: dict[str, dict[str, Hedger]] = {}
    async with make_client() as client:
        try:
            for group in config.groups:
                replicas = [config.replica(name) for name in group.replicas]
                hedgers[group.name] = Hedger(
                    replicas, group.hedger, client=client, on_event=[metrics.hook]
                )
            # The same groups speaking Anthropic Messages and OpenAI Responses (_agent.py).
            by_api = agent_hedgers(config, client, [metrics.hook])
            app = GatewayApp(config, hedgers, client, metrics, by_api)
            limiter = app.limiter
            async with trio.open_nursery() as nursery:
                if handle_signals:
                    nursery.start_soon(_signals, stop, limiter)

                async def shutdown_trigger() -> None:
                    await stop.wait()
                    limiter.start_draining()
                    nursery.start_soon(_cancel_after, limiter, config.limits.drain_timeout)

                async def run(task_status: trio.TaskStatus[list[str]]) -> None:
                    framework: Any = app
                    await hypercorn.trio.serve(
                        framework,
                        _hypercorn_config(config),
                        shutdown_trigger=shutdown_trigger,
                        task_status=task_status,
                    )
                    nursery.cancel_scope.cancel()  # served and drained: stop the helpers

                binds: list[str] = await nursery.start(run)
                groups = ", ".join(f"{g.name}: {'/'.join(g.replicas)}" for g in config.groups)
                logger.info(
                    "trio-hedge gateway listening on %s (HTTP/1.1, h2c); groups %s",
                    " ".join(binds),
                    groups,
                )
                task_status.started(binds)
        finally:
            with trio.CancelScope(shield=True):
                for hedger in [
                    *hedgers.values(),
                    *(h for g in by_api.values() for h in g.values()),
                ]:
                    await hedger.aclose()
