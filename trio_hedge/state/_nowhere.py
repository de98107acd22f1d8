"""`LocalFleetStore`: the fleet store of a process that shares its fleet view with nobody.

What one process learns stays in it (today's behaviour, and the default): ``publish`` drops
the change, ``run`` hands nothing to apply. The writer talks to it exactly as to a shared
store, so a gateway without ``[state] redis_url`` runs the same code path.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ._contracts import StateChange, StoreStatus

__all__ = ["LocalFleetStore"]


class LocalFleetStore:
    """A [`FleetStore`][trio_hedge.state.FleetStore] that shares nothing: ``status`` is
    ``"local"``, `publish` is a no-op and `run` returns at once (nothing comes from
    anywhere)."""

    __slots__ = ()

    @property
    def status(self) -> StoreStatus:
        """Always ``"local"``."""
        return "local"

    def publish(self, change: StateChange) -> None:
        """Nothing to send it to: dropped."""

    async def run(
        self,
        apply: Callable[[StateChange], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Nothing to fetch: says it started and returns."""
        task_status.started()

    def __repr__(self) -> str:
        return "LocalFleetStore()"
