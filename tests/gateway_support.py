"""Running the gateway in-process for tests: real loopback sockets, the test's own Trio run."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import attrs
import trio

import trio_hedge as th
from trio_hedge.gateway import GatewayConfig, Group, Limits, serve
from trio_hedge.testing import FakeReplica

#: No learning, budget, throttle, ejection or recovery: a fixed, short hedge delay, the
#: replicas in the order given (the default latency-aware pick would learn to avoid a slow
#: primary). No recovery (the gateway's default makes 2): these tests are about how a stream
#: the winner breaks ends, and which attempts went upstream.
HEDGER = th.HedgerConfig(
    hedge_after=0.05,
    first_token=th.events.FirstToken.ANY_OUTPUT,
    budget=None,
    throttle=None,
    outlier_detection=None,
    pick="in_order",
    max_recoveries=0,
)
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def config_for(
    replicas: Sequence[FakeReplica], *, hedger: th.HedgerConfig = HEDGER, **changes: Any
) -> GatewayConfig:
    """A gateway config (port 0) racing ``replicas`` in order, one group."""
    limits = changes.pop("limits", Limits(drain_timeout=1.0))
    made = [th.Replica(r.url, name=r.name) for r in replicas]
    group = Group("default", [r.name for r in made], hedger=hedger)
    return attrs.evolve(GatewayConfig(made, [group], port=0, limits=limits), **changes)


def count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return walk(root)


class Gateway:
    """``async with Gateway(config) as gw:`` serves it on a free port; ``gw.url`` is the
    OpenAI base URL (``…/v1``)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.stop = trio.Event()
        self.base_url = ""
        self._manager: Any = None
        self._nursery: trio.Nursery | None = None

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1"

    async def __aenter__(self) -> Gateway:
        self._manager = trio.open_nursery()
        self._nursery = await self._manager.__aenter__()
        try:
            (self.base_url,) = await self._nursery.start(
                lambda task_status: serve(self.config, stop=self.stop, task_status=task_status)
            )
        except BaseException:
            self._nursery.cancel_scope.cancel()
            await self._manager.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> bool:
        self.stop.set()
        return bool(await self._manager.__aexit__(exc_type, exc, tb))
