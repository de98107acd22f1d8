"""The load pollers of a [`Hedger`][trio_hedge.Hedger]: one task per probed replica, in the
Hedger's own nursery (internal).

Each poller reads its replica's engine (``sources/probes.py``) into its ``ProbeState``
(``policy/_load.py``) at most every ``interval`` seconds, never inside the quiet window after
the Hedger cancelled an attempt there (``ProbeState.next_poll``), each poll bounded by
``timeout``. A poll that fails in any way is counted and drops the reading (fail open); it
never raises: nothing a replica's endpoint answers reaches a caller.
"""

from __future__ import annotations

import math

import trio

from .policy._load import ProbeState
from .sources.probes import LoadReading, Reader

__all__ = ["poll_load"]


async def poll_load(state: ProbeState, read: Reader) -> None:
    """Poll forever (until cancelled): ``read()`` into ``state`` on its schedule."""
    probe = state.probe
    last = -math.inf
    while True:
        now = trio.current_time()
        due = state.next_poll(last)
        if due > now:
            # Re-checked after the sleep: a cancel meanwhile may have moved the quiet window.
            await trio.sleep_until(due)
            continue
        last = now
        try:
            with trio.fail_after(probe.timeout):
                reading = await read()
        except Exception as exc:  # every failure is only "no evidence"
            state.failed(exc)
            continue
        if isinstance(reading, LoadReading):
            state.observed(reading, now, trio.current_time())
        else:  # a reader of your own that answered something else
            state.failed(TypeError("a probe reader must return a LoadReading"))
