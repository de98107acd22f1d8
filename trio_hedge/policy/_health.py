"""Per-replica health: server pushback (cooldown) and outlier ejection.

Whose fault an error is (and so what reaches this state) is decided in ``_blame.py``.

* Cooldown: an attempt that fails with ``retry_after`` (a 429/503 with ``Retry-After`` or
  ``retry-after-ms``; gRPC's ``grpc-retry-pushback-ms``, gRFC A6) puts its replica in cooldown
  *for that model* for exactly that many seconds: no new attempt for the model goes there
  before it ends (a provider's rate limit is per model; `ModelStates`, bounded).
* Ejection (Envoy's outlier detection, ``consecutive_5xx`` / ``base_ejection_time`` /
  ``max_ejection_time`` / ``max_ejection_percent``): ``consecutive_failures`` failures in a
  row eject the replica for ``base_ejection × 2^(n−1)`` seconds, ``n`` counting ejections
  since its last success, capped at ``max_ejection``; an error that is the replica's own
  fault for a model (401/403, quota, unknown model, once the request's evidence shows it)
  ejects it for that model at once. A success resets both counts. Never more than
  ``max_ejection_percent`` of the replicas are out at once (at least one may be, the last
  one never is).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import attrs

from .._validate import integer, number

__all__ = ["OutlierDetection"]


def _percent(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    number(0.0)(_inst, attribute, value)
    assert isinstance(value, (int, float))
    if value > 100:
        raise ValueError(f"{attribute.name} must be <= 100, not {value!r}")


@attrs.frozen
class OutlierDetection:
    """When a replica is ejected, and for how long. Durations in seconds.

    Attributes:
        consecutive_failures: failures in a row that eject a replica. Default 5 (Envoy).
        base_ejection: the first ejection's length. Default 10.
        max_ejection: the longest ejection. Default 300 (Envoy).
        count_slow: whether slowness may eject a replica, *relative to the others*: an
            attempt that was hedged for lack of a first token and then lost to a later attempt
            of the same request after waiting the fleet's own delay (not a caller's shorter
            ``hedge_after``) counts as slow in its replica's window of ``slow_window``
            seconds; a replica whose share of slow attempts (at least ``slow_min_volume``
            judged) is ``slow_margin`` above another replica's is ejected, never when fewer
            than two replicas would be left in for the model (a request needs one to hedge
            to). A lost race is never a failure in the run: busy is not broken (two
            llama-server replicas behind another tenant's prompts: the run rule ejected a
            replica that never failed and refused a third of the hedges). Envoy's
            success-rate detection compares hosts the same way. Default ``True``.
        slow_window: seconds over which slow attempts are counted. Default 60.
        slow_min_volume: judged attempts (won, or lost after the fleet's delay) a replica
            needs in the window before its share counts, and another replica to be compared
            with. Default 10 (Envoy's ``success_rate_request_volume`` is 100, for RPCs).
        slow_margin: how far above the best other replica's share of slow attempts a
            replica's must be to eject it, in ``(0, 1]``. Default 0.5.
        max_ejection_percent: at most this percentage of the replicas is ejected at any
            moment, rounded down (Envoy's ``max_ejection_percent``: a replica is ejected
            only if ``ejected + 1 <= percent × replicas / 100``). At least one replica may
            always be ejected (Envoy's ``always_eject_one_host``; older Envoy and gRPC's
            outlier detection allowed one past the cap), and the last one that is not
            ejected never is: the fleet is never ejected whole, so a single replica is
            never ejected. Default ``100 / 3``: a third (1 of 2–5 replicas, 2 of 6–8).
            Envoy's default is 10%; a hedger has few replicas and needs one left to hedge
            to. A replica that reaches its threshold while the cap is full stays in, at
            the threshold, and goes at its next failure once there is room. The replicas
            counted are those out for the model of the request that saw the failure
            (ejected whole or for that model), not those out for another model only.

    What counts (``docs/guarantees.md``, "Who is blamed for what"; decided in one place,
    [`Attribution`][trio_hedge.policy.Attribution]): a transient error of the replica's
    making (5xx, overload, connection, timeout, truncated or broken stream: one failure; a
    plain 429 only cools it for that model), a key, quota or "not found" error while another
    replica served the same request (ejects it for that model at once), the winner stalling
    or breaking after commit (one failure), and with ``count_slow`` a hedged attempt that
    lost after waiting the fleet's own delay (one failure). Errors that are the request's
    fault (400, 413, 422, context length; a key, quota or "not found" error every replica
    tried gave) never count.

    Raises:
        TypeError, ValueError: on a bad field or ``base_ejection > max_ejection``.
    """

    consecutive_failures: int = attrs.field(default=5, validator=integer(1))
    base_ejection: float = attrs.field(default=10.0, validator=number(0.0, open_lo=True))
    max_ejection: float = attrs.field(default=300.0, validator=number(0.0, open_lo=True))
    count_slow: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    slow_window: float = attrs.field(default=60.0, validator=number(0.0, open_lo=True))
    slow_min_volume: int = attrs.field(default=10, validator=integer(1))
    slow_margin: float = attrs.field(default=0.5, validator=number(0.0, open_lo=True))
    max_ejection_percent: float = attrs.field(default=100 / 3, validator=_percent)

    def __attrs_post_init__(self) -> None:
        if self.slow_margin > 1:
            raise ValueError(f"slow_margin must be <= 1, not {self.slow_margin!r}")
        if self.base_ejection > self.max_ejection:
            raise ValueError(
                f"base_ejection ({self.base_ejection}) must be <= max_ejection "
                f"({self.max_ejection})"
            )

    def ejection_time(self, ejections: int) -> float:
        """Seconds of the ``ejections``-th ejection in a row: ``base_ejection × 2^(n−1)``, at
        most ``max_ejection``."""
        return min(self.base_ejection * 2.0 ** min(ejections - 1, 64), self.max_ejection)

    def ejection_limit(self, replicas: int) -> int:
        """How many of ``replicas`` may be ejected at once: ``max_ejection_percent`` of them
        rounded down, but at least one, and never all."""
        share = math.floor(replicas * self.max_ejection_percent / 100 + 1e-9)
        return min(replicas - 1, max(1, share))


@attrs.define(slots=True)
class ReplicaState:
    """One replica's shared state across all requests (internal)."""

    index: int
    name: str
    source: Any  # a Replica or a Source
    in_flight: int = 0
    ejected_until: float = float("-inf")
    consecutive: int = 0
    ejections: int = 0  # since the last success: drives the growing back-off
    ejected_reason: str | None = None  # why its last ejection for every model (statistics)
    times_ejected: int = 0  # ever, for statistics
    attempts: int = 0
    wins: int = 0
    failures: int = 0  # attempts that failed by its fault, winners failing after the commit
    lost_races: int = 0  # attempts cancelled because another attempt of the request won
    # The latency-aware pick (peak EWMA, Finagle/Linkerd): a recent TTFT estimate (seconds,
    # at ``latency_at``; it decays toward zero from there), the start times of attempts still
    # waiting for a first token (keyed per attempt, oldest first), and (until, started) of
    # cancelled attempts whose server may still be prefilling them.
    latency: float = 0.0
    latency_at: float = float("-inf")
    waiting: dict[object, float] = attrs.Factory(dict)
    lingering: list[tuple[float, float]] = attrs.Factory(list)
    # Its declared context window (tokens; ``Replica.context_window``), or None: unknown.
    context_window: int | None = None
    # Used only when no peer can take an attempt in time (``Replica.fallback``).
    fallback: bool = False
    # Load probes: this Hedger's picks and hedge decisions made with the replica's engine
    # reading, and without one (its own view). Per Hedger: the reading may be shared.
    probe_decisions: int = 0
    own_view_decisions: int = 0
    # When it last gave a first token (a commit, any request's): a 500 every replica gave is
    # a query of death only if they served others meanwhile.
    last_commit: float = float("-inf")
    # When it last answered a 500 (any request's): until it commits again it is not serving
    # others (a fleet failing whole is no query of death).
    last_server_error: float = float("-inf")
    # Its judged attempts (answered first, lost after the fleet's delay, failed) lately.
    outcomes: OutcomeWindow | None = None

    def latency_now(self, now: float, decay: float) -> float:
        """The peak-EWMA TTFT estimate now: the last value, decayed toward zero with time
        constant ``decay`` seconds (Finagle decays it on every read, so that a replica left
        alone is tried again)."""
        if self.latency <= 0.0:
            return 0.0
        return self.latency * math.exp((self.latency_at - now) / decay)

    def observe_lower_bound(self, now: float, seconds: float, decay: float) -> None:
        """An attempt cancelled ``seconds`` after it started, without a first token: its TTFT
        is at least that. Raises the estimate if it is higher, never lowers it (a lost race
        is no evidence that a replica is fast)."""
        if seconds > self.latency_now(now, decay):
            self.latency = seconds
            self.latency_at = now

    def observe_latency(self, now: float, seconds: float, decay: float) -> None:
        """One TTFT sample: a sample above the decayed estimate replaces it at once (the
        *peak*); a lower one pulls it down as an EWMA weighted by the time since the last
        sample (tower's ``PeakEwma``)."""
        current = self.latency_now(now, decay)
        if seconds < current:
            recency = 1.0 - math.exp((self.latency_at - now) / decay)
            seconds = current + (seconds - current) * recency
        self.latency = seconds
        self.latency_at = now

    def load(self, now: float, decay: float) -> tuple[float, int]:
        """``(latency, attempts)``: the peak-EWMA estimate, raised to the age of the oldest
        attempt still waiting here for its first token (it says the replica is at least that
        slow *now*), and the attempts ahead of a new one: those waiting for a first token
        and cancelled ones the server may still be prefilling. A stream already answering
        is not counted: an engine that batches decodes prefills a new request beside it
        (where it does delay one, as llama-cpp-python's one-request-at-a-time server does,
        the TTFT samples show it); counting streams kept traffic on a replica stuck in a
        long prefill (``benchmarks/tail.py --tenants others``: P99 TTFT 1.92 s, against
        1.67 s)."""
        latency = self.latency_now(now, decay)
        n = len(self.waiting)
        if self.waiting:
            oldest = next(iter(self.waiting.values()))
            if now - oldest > latency:
                latency = now - oldest
        if self.lingering:
            self.lingering = [entry for entry in self.lingering if entry[0] > now]
            for _, started in self.lingering:
                if now - started > latency:
                    latency = now - started
            n += len(self.lingering)
        return latency, n

    def ejected(self, now: float) -> bool:
        return self.ejected_until > now

    def success(self) -> None:
        """A request it served ended without a break: its run and ejection count reset."""
        self.consecutive = 0
        self.ejections = 0

    def failure(self, now: float, config: OutlierDetection | None) -> bool:
        """Count one failure in its run; returns whether the replica is due for ejection
        (the caller checks the cap, then calls `eject`). A replica held at the
        threshold while the cap keeps it in goes at its next failure once there is room."""
        if config is None or self.ejected(now):
            return False
        self.consecutive += 1
        return self.consecutive >= config.consecutive_failures

    def eject(self, now: float, config: OutlierDetection) -> None:
        self.consecutive = 0
        self.ejections += 1
        self.times_ejected += 1
        self.ejected_until = now + config.ejection_time(self.ejections)


@attrs.define(slots=True)
class ModelState:
    """What one replica's record holds for one model (internal): its cooldown after server
    pushback, and its ejection for an error that is its own fault for that model (a key,
    quota or "not found" error another replica served the request through)."""

    cooling_until: float = float("-inf")
    ejected_until: float = float("-inf")
    ejections: int = 0  # for this model, since its last success there
    # Its context window for this model, as a context-length error stated it (tokens), or
    # None: an estimated request size never teaches it (_judge: "context").
    window: int | None = None
    # Why its last cooldown and its last ejection for this model (the events' ``reason``).
    cooling_reason: str | None = None
    ejected_reason: str | None = None

    def push_back(self, now: float, seconds: float) -> None:
        self.cooling_until = max(self.cooling_until, now + seconds)


class OutcomeWindow:
    """A replica's judged attempts over a sliding window (internal; ``slots`` counters, like
    the hedge budget's): how many answered first, lost a race after the fleet's delay
    (slow), or failed by its own fault. What the ejection rules compare between replicas."""

    __slots__ = ("_count", "_slot_width", "_slots", "_totals")

    def __init__(self, window: float, slots: int = 10) -> None:
        self._slot_width = window / slots
        self._count = slots
        self._slots: list[list[int]] = []  # [slot index, judged, slow, failed]
        self._totals = [0, 0, 0]

    def _current(self, now: float) -> list[int]:
        index = int(now // self._slot_width)
        slots = self._slots
        if slots and slots[-1][0] == index and slots[0][0] > index - self._count:
            return slots[-1]  # the common case: nothing expired, the same slot
        oldest = index - self._count + 1
        totals = self._totals
        while slots and slots[0][0] < oldest:
            old = slots.pop(0)
            for i in range(3):
                totals[i] -= old[i + 1]
        if not slots or slots[-1][0] != index:
            slots.append([index, 0, 0, 0])
        return slots[-1]

    def record(self, now: float, slow: bool = False, failed: bool = False) -> None:
        slot = self._current(now)
        totals = self._totals
        slot[1] += 1
        totals[0] += 1
        if slow:
            slot[2] += 1
            totals[1] += 1
        if failed:
            slot[3] += 1
            totals[2] += 1

    def counts(self, now: float) -> tuple[int, int, int]:
        """``(judged, slow, failed)`` in the window."""
        self._current(now)
        judged, slow, failed = self._totals
        return judged, slow, failed


class ModelStates:
    """`ModelState` per (replica index, model), least recently written first, at most
    ``cap`` of them (internal): the model is a string a client chooses, so it must never make
    the state grow. An entry is made only by evidence (pushback, a replica's fault), never by a
    request alone; the oldest is dropped when full (it forgets a cooldown or an ejection, which
    the next error makes again)."""

    __slots__ = ("_cap", "_entries")

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._entries: OrderedDict[tuple[int, str], ModelState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, index: int, model: str) -> ModelState | None:
        return self._entries.get((index, model))

    def make(self, index: int, model: str) -> ModelState:
        key = (index, model)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = ModelState()
            if len(self._entries) > self._cap:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return entry

    def succeeded(self, index: int, model: str) -> None:
        entry = self._entries.get((index, model))
        if entry is not None:
            entry.ejections = 0

    def of(self, index: int) -> list[tuple[str, ModelState]]:
        return [(model, e) for (i, model), e in self._entries.items() if i == index]
