"""The load pollers: one task per probed replica, in the nursery of whoever owns them -- a
[`Hedger`][trio_hedge.Hedger] (its own probes) or a
[`LoadMonitor`][trio_hedge.hedger.LoadMonitor] (one poller per replica for every Hedger
given it).

Each poller reads its replica's engine (``sources/probes.py``) into its ``ProbeState``
(``policy/_load.py``) at most every ``interval`` seconds, never inside the quiet window after
a Hedger cancelled an attempt there (``ProbeState.next_poll``), each poll bounded by
``timeout``. A poll that fails in any way is counted and drops the reading (fail open); it
never raises: nothing a replica's endpoint answers reaches a caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType

import httpx
import trio

from ._source import Source
from .policy._load import ProbeState
from .sources._bindable import BindableReplica
from .sources.openai._http import Replica
from .sources.probes import LoadProbe, LoadReading, Reader, as_probe, read_load
from .transport import make_client

__all__ = ["LoadMonitor", "Pollers", "poll_load", "probes_of"]

AnyReplica = Replica | BindableReplica | Source


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


def probes_of(
    replicas: Sequence[AnyReplica], probes: Mapping[str, LoadProbe | str] | None
) -> dict[int, tuple[LoadProbe, Replica | None]]:
    """Each probed replica's probe and (for the HTTP read) its ``Replica``, by index: the
    replicas' own ``probe``, with ``probes`` (by name) over them.

    Raises:
        TypeError, ValueError: ``probes`` not a mapping, naming an unknown replica, or a
            probe without a ``reader`` for a replica that is not a ``Replica``.
    """
    found: dict[int, tuple[LoadProbe, Replica | None]] = {}
    index = {r.name: i for i, r in enumerate(replicas)}
    for i, r in enumerate(replicas):
        if isinstance(r, Replica) and r.probe is not None:
            found[i] = (r.probe, r)
    if probes is None:
        return found
    if not isinstance(probes, Mapping):
        raise TypeError("probes must be a mapping of replica names to LoadProbes")
    for name, value in probes.items():
        if name not in index:
            raise ValueError("probes names a replica the Hedger does not have")
        probe = as_probe(value, "probes")
        i = index[name]
        if probe is None:
            found.pop(i, None)
            continue
        replica = replicas[i]
        http = replica if isinstance(replica, Replica) else None
        if http is None and probe.reader is None:
            raise ValueError("probes: a replica that is not a Replica needs a LoadProbe reader")
        found[i] = (probe, http)
    return found


def _reader(
    probe: LoadProbe, replica: Replica | None, client: Callable[[], httpx.AsyncClient]
) -> Reader:
    """The probe's own reader, or the HTTP read of ``replica``'s engine over ``client()``."""
    if probe.reader is not None:
        return probe.reader
    assert replica is not None
    headers = dict(replica.headers)
    headers.update(replica._key_headers())  # the key in the header this API sends it in

    async def read() -> LoadReading:
        return await read_load(client(), probe, replica.base_url, headers)

    return read


class Pollers:
    """The pollers of some ``ProbeState``s, alive exactly as long as an ``async with``
    (internal: the Hedger's and the monitor's)."""

    def __init__(self) -> None:
        self._manager: AbstractAsyncContextManager[trio.Nursery] | None = None
        self._nursery: trio.Nursery | None = None

    async def start(
        self,
        polled: Sequence[tuple[ProbeState, LoadProbe, Replica | None]],
        client: Callable[[], httpx.AsyncClient],
        owner: str,
    ) -> None:
        if self._manager is not None:
            raise RuntimeError(f"a {owner} with load probes can be entered only once at a time")
        # The pollers' nursery lives exactly as long as the owner's ``async with``: no
        # poller outlives it. Pollers never raise (a failed poll is only "no evidence").
        manager = trio.open_nursery()
        nursery = await manager.__aenter__()
        self._manager, self._nursery = manager, nursery
        for state, probe, replica in polled:
            nursery.start_soon(poll_load, state, _reader(probe, replica, client))

    async def stop(self) -> None:
        manager, nursery = self._manager, self._nursery
        if manager is not None and nursery is not None:
            self._manager = self._nursery = None
            nursery.cancel_scope.cancel()
            # The body's own exception is not handed to the nursery (it would come out in
            # an ExceptionGroup): the pollers end at once on the cancel, and never raise.
            await manager.__aexit__(None, None, None)


class LoadMonitor:
    """One poller per probed replica, shared by every [`Hedger`][trio_hedge.Hedger] given it
    (``Hedger(..., probes=monitor)``): Hedgers over the same replicas -- one per API, per
    group, per tenant -- read one poller's reading instead of each polling the engine, and a
    cancel in any of them opens the quiet window (``LoadProbe.cancel_quiet``) for that one
    poller. Polls then cost what one Hedger's cost, and on llama-server, where any poll
    within 1 s of a cancel keeps the cancelled prefill running, no Hedger's polls defeat
    another's cancel (``docs/policy.md``, "Load probes").

    The pollers run inside ``async with LoadMonitor(...)`` only (its own nursery); the Hedgers
    need not be entered for them. A Hedger's replica is read from the monitor when the
    monitor probes a replica of the same name (and, for a
    [`Replica`][trio_hedge.sources.Replica], the same ``base_url``); its other probed
    replicas it polls itself, as without a monitor. Statistics: every Hedger's
    ``statistics()`` shows the shared reading, polls and failures; the decisions it made
    from them are its own.

    Args:
        replicas: the replicas to probe (each with its own ``probe``; the others are not
            probed unless ``probes`` names them), as for a Hedger.
        probes: [`LoadProbe`][trio_hedge.sources.probes.LoadProbe]s (or engine names) by
            replica name, over the replicas' own, as for a Hedger.
        client: the ``httpx.AsyncClient`` the polls go through, used as given and never
            closed. Without one, the monitor makes one when entered and closes it on exit.

    Raises:
        TypeError, ValueError: bad replicas (duplicate names) or probes, as for a Hedger.
    """

    def __init__(
        self,
        replicas: Sequence[AnyReplica],
        *,
        probes: Mapping[str, LoadProbe | str] | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        names = [getattr(r, "name", None) for r in replicas]
        if len(set(names)) != len(names):
            raise ValueError("replica names must be unique")
        if client is not None and not isinstance(client, httpx.AsyncClient):
            raise TypeError(f"client must be an httpx.AsyncClient, not {type(client).__name__}")
        found = probes_of(replicas, probes)
        self._polled = [(ProbeState(p), p, r) for p, r in found.values()]
        #: name -> (its shared state, the base_url it is read at, or None: a reader's).
        self._states: dict[str, tuple[ProbeState, str | None]] = {
            replicas[i].name: (state, None if r is None else r.base_url)
            for i, (state, _, r) in zip(found, self._polled, strict=True)
        }
        self._client = client
        self._owned: httpx.AsyncClient | None = None
        self._pollers = Pollers()

    @property
    def replica_names(self) -> tuple[str, ...]:
        """The names of the replicas it probes, in the given order."""
        return tuple(self._states)

    def shared(self, replica: AnyReplica) -> ProbeState | None:
        """The state a Hedger's ``replica`` reads, or ``None`` (not this monitor's)."""
        entry = self._states.get(replica.name)
        if entry is None:
            return None
        state, base_url = entry
        if isinstance(replica, Replica) and base_url is not None and replica.base_url != base_url:
            raise ValueError(
                "probes: a replica has the name of one the LoadMonitor reads at another base_url"
            )
        return state

    def _http_client(self) -> httpx.AsyncClient:
        if self._client is not None:
            return self._client
        if self._owned is None:
            self._owned = make_client()
        return self._owned

    async def __aenter__(self) -> LoadMonitor:
        await self._pollers.start(self._polled, self._http_client, "LoadMonitor")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._pollers.stop()
        client, self._owned = self._owned, None
        if client is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await client.aclose()
