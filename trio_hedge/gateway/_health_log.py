"""The gateway's health log: each change of a replica's state (cooling, ejected, back in
service), of a load probe's (failing, stale, answering again) and of the shared store's
(degraded, ok again), logged once per change, never per request, on the
``trio_hedge.gateway.health`` logger, with the names the metrics use (``api``, ``group``,
``replica``, ``state``, ``status``, ``model``).

Decide, then act: `HealthView` is a snapshot of that state (read from every Hedger's
``statistics()``, and from the shared store's ``status``); `diff` is a plain function of two
snapshots returning the lines to log, and `announce` one of a snapshot and a
``replica_cooling`` / ``replica_ejected`` event returning its line at once. `HealthLog` holds
the snapshot of what the log has said so far and does the I/O: a background task compares it
with the fleet every second (which is also how an ejection's end is seen: it expires, no
event says so), and each Hedger's event hook announces a cooldown or an ejection as it
happens; a verdict announced is not logged again by the next comparison.

A verdict is a cooldown or an ejection of one replica, in one Hedger (an ``api`` and a
``group``), for one model or (an ejection after failures in a row) for every model. It is
new when the snapshot before did not hold it, or held one that had ended by the time of the
snapshot after (a cooldown pushed further by another 429 is the same verdict: not logged).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

import attrs
import trio

from .. import Hedger
from ..events import EventHook, EventKind, HedgeEvent
from ..policy import HedgerStatistics
from ..state import StoreStatus

__all__ = [
    "HEALTH_EVERY",
    "HEALTH_LOGGER",
    "HealthLine",
    "HealthLog",
    "HealthView",
    "Verdict",
    "announce",
    "diff",
]

#: The logger of the health log.
HEALTH_LOGGER = logging.getLogger("trio_hedge.gateway.health")

#: Seconds between two comparisons of the fleet with what the log has said.
HEALTH_EVERY = 1.0

#: (api, group, replica, model or ``None`` for every model, state).
VerdictKey = tuple[str, str, str, "str | None", str]


@attrs.frozen
class Verdict:
    """A cooldown or an ejection in force: why, and until when (Trio time, seconds)."""

    reason: str | None
    until: float


@attrs.frozen
class ProbeView:
    """A probed replica's load probe: ``status`` (``fresh``, ``stale``, ``failing``,
    ``waiting``), why its last poll failed, its failed polls so far, and the age of its
    reading (seconds; ``None`` before the first)."""

    status: str
    error: str | None = None
    failures: int = 0
    age: float | None = None


@attrs.frozen
class HealthView:
    """What the health log is about, at one moment.

    Attributes:
        time: Trio's clock at the snapshot (seconds).
        wall: Unix time at the snapshot (seconds), to say when a verdict ends.
        verdicts: every cooldown and ejection in force, by (api, group, replica, model,
            state).
        probes: each probed replica's load probe, by replica name.
        store: the shared store's status (``"local"``, ``"ok"``, ``"degraded"``), or
            ``None`` without one.
    """

    time: float
    wall: float
    verdicts: Mapping[VerdictKey, Verdict] = attrs.field(factory=dict)
    probes: Mapping[str, ProbeView] = attrs.field(factory=dict)
    store: StoreStatus | None = None

    @classmethod
    def of(
        cls,
        statistics: Mapping[str, Mapping[str, HedgerStatistics]],
        *,
        store: StoreStatus | None = None,
        wall: float | None = None,
    ) -> HealthView:
        """The view of every Hedger's snapshot (API -> group -> statistics), and the store's
        status. Its time is the latest snapshot's; ``wall`` defaults to ``time.time()``."""
        verdicts: dict[VerdictKey, Verdict] = {}
        probes: dict[str, ProbeView] = {}
        now = -math.inf
        for api, groups in statistics.items():
            for group, stats in groups.items():
                now = max(now, stats.time)
                for r in stats.replicas:
                    for v in r.verdicts:
                        until = stats.time + v.seconds
                        verdicts[(api, group, r.name, v.model, v.state)] = Verdict(v.reason, until)
                    if r.probe != "off" and r.name not in probes:  # one poller per replica
                        probes[r.name] = ProbeView(
                            r.probe, r.probe_error, r.probe_failures, r.probe_age
                        )
        return cls(
            0.0 if now == -math.inf else now,
            time.time() if wall is None else wall,
            verdicts,
            probes,
            store,
        )

    def wall_at(self, trio_time: float) -> float:
        """The Unix time of a Trio time, by this snapshot's clocks."""
        return self.wall + (trio_time - self.time)


@attrs.frozen
class HealthLine:
    """One line of the health log: its level, what it says in a few words (``summary``), and
    its fields, named as the metrics' labels (``event`` is the metric it follows:
    ``replica_state``, ``probe_status`` or ``store_status``)."""

    level: int
    summary: str
    fields: Mapping[str, object]

    def text(self) -> str:
        """``summary: key=value …`` (a value with a space is quoted)."""
        parts = []
        for key, value in self.fields.items():
            if key == "event" or value is None:
                continue
            shown = str(value)
            if not shown or any(c.isspace() or c in '"=' for c in shown):
                shown = '"' + shown.replace("\\", "\\\\").replace('"', '\\"') + '"'
            parts.append(f"{key}={shown}")
        return f"{self.summary}: {' '.join(parts)}"


def _utc(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat(timespec="milliseconds")[:-6] + "Z"


def _worst(verdicts: Mapping[VerdictKey, Verdict], key: VerdictKey) -> str:
    """The state of ``key``'s replica for ``key``'s model in ``verdicts``: ejected (for the
    model or for every model), cooling, or healthy."""
    api, group, replica, model, _ = key
    states = {
        k[4] for k in verdicts if k[:3] == (api, group, replica) and (k[3] == model or k[3] is None)
    }
    return "ejected" if "ejected" in states else "cooling" if "cooling" in states else "healthy"


def _start(key: VerdictKey, verdict: Verdict, view: HealthView, at: float) -> HealthLine:
    """The line of a verdict that begins (seen at Trio time ``at``)."""
    api, group, replica, model, state = key
    seconds = max(0.0, verdict.until - at)
    fields: dict[str, object] = {
        "event": "replica_state",
        "replica": replica,
        "state": state,
        "model": model,
        "reason": verdict.reason,
    }
    if state == "cooling":
        fields["retry_after"] = round(seconds, 3)  # what the replica asked for
    else:
        fields["seconds"] = round(seconds, 3)
    fields["until"] = _utc(view.wall_at(verdict.until))
    fields.update(api=api, group=group)
    scope = "" if model is not None or state == "cooling" else " (every model)"
    level = logging.WARNING if state == "ejected" else logging.INFO
    return HealthLine(level, f"replica {state}{scope}", fields)


def _end(key: VerdictKey, now_state: str) -> HealthLine:
    api, group, replica, model, state = key
    fields: dict[str, object] = {
        "event": "replica_state",
        "replica": replica,
        "state": now_state,
        "was": state,
        "model": model,
        "api": api,
        "group": group,
    }
    what = "cooldown" if state == "cooling" else "ejection"
    summary = (
        "replica back in service"
        if now_state == "healthy"
        else f"replica {what} over, still {now_state}"
    )
    return HealthLine(logging.INFO, summary, fields)


def _probe_line(replica: str, before: ProbeView | None, after: ProbeView) -> HealthLine | None:
    was = "waiting" if before is None else before.status
    status = after.status
    if status == was or status == "waiting":
        return None
    fields: dict[str, object] = {
        "event": "probe_status",
        "replica": replica,
        "status": status,
        "was": was,
    }
    if status == "failing":
        fields.update(error=after.error, failures=after.failures)
        return HealthLine(logging.WARNING, "probe failing", fields)
    if status == "stale":
        fields["age"] = None if after.age is None else round(after.age, 3)
        return HealthLine(logging.WARNING, "probe stale", fields)
    # fresh
    summary = "probe answering" if was == "waiting" else "probe answering again"
    return HealthLine(logging.INFO, summary, fields)


def diff(before: HealthView, after: HealthView) -> list[HealthLine]:
    """The lines that say how ``after`` differs from ``before`` (``before``: what the log
    has said so far): verdicts that began (or began again after the one ``before`` knew had
    ended), verdicts that ended (for each, the replica's state now for that model: healthy
    is "back in service"), probe and store status changes. A pure function."""
    lines: list[HealthLine] = []
    old, new = before.verdicts, after.verdicts
    for key, verdict in new.items():
        known = old.get(key)
        if known is None or known.until <= after.time:
            lines.append(_start(key, verdict, after, after.time))
    for key in old:
        if key not in new:
            lines.append(_end(key, _worst(new, key)))
    for replica, probe in after.probes.items():
        line = _probe_line(replica, before.probes.get(replica), probe)
        if line is not None:
            lines.append(line)
    if after.store != before.store and after.store in ("ok", "degraded"):
        was = before.store
        fields = {"event": "store_status", "status": after.store, "was": was}
        if after.store == "degraded":
            lines.append(HealthLine(logging.WARNING, "shared store degraded", fields))
        elif was == "degraded":
            lines.append(HealthLine(logging.INFO, "shared store ok again", fields))
    return lines


def announce(
    view: HealthView, api: str, group: str, event: HedgeEvent, wall: float
) -> tuple[HealthLine | None, HealthView]:
    """A ``replica_cooling`` or ``replica_ejected`` event of the Hedger of ``api`` and
    ``group``, at Unix time ``wall``: its line (``None`` when ``view`` holds the verdict
    already: another request's evidence for the same cooldown), and the view with it."""
    state = "cooling" if event.kind is EventKind.REPLICA_COOLING else "ejected"
    model = event.model
    if model is None and state == "cooling":
        model = event.group  # a cooldown is per model (the request's group by default)
    if event.replica is None or event.until is None:
        return None, view
    key: VerdictKey = (api, group, event.replica, model, state)
    known = view.verdicts.get(key)
    verdict = Verdict(event.reason, event.until)
    if known is not None and known.until > event.time:  # the same verdict, maybe longer
        verdict = Verdict(known.reason, max(known.until, event.until))
        return None, attrs.evolve(view, verdicts={**view.verdicts, key: verdict})
    at = HealthView(event.time, wall)
    line = _start(key, verdict, at, event.time)
    return line, attrs.evolve(view, verdicts={**view.verdicts, key: verdict})


def log_line(line: HealthLine, logger: logging.Logger = HEALTH_LOGGER) -> None:
    """Write ``line`` (its fields also as the record's ``trio_hedge`` attribute, and its
    summary as ``trio_hedge_summary``, for JSON lines)."""
    if logger.isEnabledFor(line.level):
        extra = {"trio_hedge": dict(line.fields), "trio_hedge_summary": line.summary}
        logger.log(line.level, "%s", line.text(), extra=extra)


class HealthLog:
    """The gateway's health log (see the module docstring): `hook` for each Hedger's
    ``on_event``, `run` as a background task once the Hedgers exist.

    Args:
        store: the shared store's status, read at each comparison (``None``: no store;
            a later shared back end passes its ``status``).
        every: seconds between two comparisons (default `HEALTH_EVERY`).
    """

    def __init__(
        self,
        store: Callable[[], StoreStatus] | None = None,
        *,
        every: float | None = None,
        logger: logging.Logger = HEALTH_LOGGER,
    ) -> None:
        self._store = store
        self._every = HEALTH_EVERY if every is None else every
        self._logger = logger
        self.view: HealthView | None = None  # what the log has said; None before `run`

    def hook(self, api: str, group: str) -> EventHook:
        """The ``on_event`` hook of the Hedger of ``api`` and ``group``: announces each
        cooldown and ejection as it happens (before `run` starts: left to its first
        comparison)."""
        kinds = (EventKind.REPLICA_COOLING, EventKind.REPLICA_EJECTED)

        def on_event(event: HedgeEvent) -> None:
            if event.kind not in kinds or self.view is None:
                return
            wall = time.time() + (event.time - trio.current_time())
            line, self.view = announce(self.view, api, group, event, wall)
            if line is not None:
                log_line(line, self._logger)

        return on_event

    def sample(self, hedgers: Mapping[str, Mapping[str, Hedger]]) -> HealthView:
        """A snapshot of ``hedgers`` (API -> group -> Hedger) and of the store now."""
        stats = {api: {g: h.statistics() for g, h in by.items()} for api, by in hedgers.items()}
        return HealthView.of(stats, store=None if self._store is None else self._store())

    def check(self, hedgers: Mapping[str, Mapping[str, Hedger]]) -> None:
        """Compare the fleet with what the log has said; log what changed."""
        now = self.sample(hedgers)
        before = self.view if self.view is not None else HealthView(now.time, now.wall)
        for line in diff(before, now):
            log_line(line, self._logger)
        self.view = now

    async def run(self, hedgers: Mapping[str, Mapping[str, Hedger]]) -> None:
        """Compare every `every` seconds, until cancelled."""
        self.check(hedgers)
        while True:
            await trio.sleep(self._every)
            self.check(hedgers)
