"""The fleet's one writer: every change to what a Hedger's requests share goes through here.

The judge (``_judge.py``) turns a request's evidence into verdicts; `FleetWriter.apply` is
the only code that applies them to the fleet state (``_fleet.py``): health and ejection,
cooldowns, the retry throttle, the pick's latency estimates, the delay learner, the learned
context windows. The in-flight bookkeeping (attempts waiting for a first token, lingering
prefills, the hedge budget's deposits and spends, the counters behind ``statistics()``)
goes through its other methods. And what other processes of the fleet decided (a shared
``FleetStore``, ``trio_hedge.state``) arrives through `FleetWriter.apply_remote`, and what
this one decides leaves through the store's ``publish``: one writer, two back ends.

Its decisions are plain synchronous functions of the state and the verdict, returning what
happened (`Applied`: ejections and cooldowns for the planner to announce, the throttle
credit granted or not); nothing here awaits (httpcore's connection pool: decide on state,
act after).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..report import AttemptOutcome, Report
from ..state import Cooldown, DelaySample, Ejection, FleetStore, StateChange
from ._fleet import FleetState
from ._health import OutcomeWindow, ReplicaState
from ._judge import Effect, Verdict

__all__ = ["Applied", "FleetWriter", "Request"]

#: Cancelled attempts a replica may count as still being prefilled (a memory bound).
_MAX_LINGERING = 1024


def _nothing(*_: object) -> None:
    """A verdict that found nobody at fault: recorded, nothing to apply."""


def _erred(v: Verdict, replica: ReplicaState | None, now: float, req: Request) -> None:
    assert replica is not None
    replica.last_server_error = now


class Applied:
    """What applying a request's verdicts did (internal): announcements for the planner.
    (A plain slotted class: one is made for every event of every request.)"""

    __slots__ = ("cooled", "credit", "ejected", "taken")

    def __init__(self) -> None:
        #: (replica, until, reason, model or None for the whole replica)
        self.ejected: list[tuple[ReplicaState, float, str, str | None]] = []
        #: (replica, until, reason, model)
        self.cooled: list[tuple[ReplicaState, float, str, str]] = []
        #: A CREDIT verdict: whether the throttle granted it (None: none asked).
        self.credit: bool | None = None
        #: Throttle thousandths taken at once (DEBIT verdicts, a CREDIT refused).
        self.taken = 0


class Request(NamedTuple):
    """What the writer needs of the request whose verdicts it applies (made once per
    request): its model, learning group, size class and prompt tokens."""

    model: str
    group: str
    size_class: int
    tokens: int | None


_Handler = Callable[[Verdict, ReplicaState | None, float, Request], None]


class FleetWriter:
    """The only writer of a `FleetState` (see the module docs)."""

    def __init__(self, fleet: FleetState, store: FleetStore | None = None) -> None:
        self.fleet = fleet
        self.store = store
        self._by_name = {r.name: r for r in fleet.replicas}
        self._out: Applied | None = None
        handlers: dict[Effect, _Handler] = {
            Effect.NOTHING: _nothing,
            Effect.FAILURE: self._on_failure,
            Effect.SUCCESS: self._on_success,
            Effect.EJECT: self._on_eject,
            Effect.OUTAGE: self._on_eject,
            Effect.COOL: self._on_cool,
            Effect.SLOW: self._on_speed,
            Effect.LATENCY: self._on_latency,
            Effect.LATENCY_FLOOR: self._on_latency,
            Effect.SAMPLE: self._on_sample,
            Effect.WINDOW: self._on_window,
            Effect.CREDIT: self._credit,
            Effect.DEBIT: self._debit,
            Effect.CREDIT_RELEASED: self._credit_closed,
            Effect.CREDIT_DEBITED: self._credit_closed,
            Effect.REFUND: self._refund,
            Effect.THROTTLE_SUCCESS: self._succeeded,
            Effect.ERRED: _erred,
        }
        # Keyed by the member's name: an Enum's own __hash__ is Python code, on every
        # verdict of every request.
        self._handlers = {effect._name_: handler for effect, handler in handlers.items()}

    # -- verdicts ----------------------------------------------------------------------------

    def apply(
        self,
        verdicts: Sequence[Verdict],
        now: float,
        request: Request,
    ) -> Applied | None:
        """Apply one event's verdicts for ``request``. Returns what the planner must know
        of what happened (ejections and cooldowns to announce, the throttle's credit), or
        ``None``: nothing (most events, on every request's path)."""
        self._out = None
        replicas, handlers = self.fleet.replicas, self._handlers
        for v in verdicts:
            index = v.replica
            handlers[v.effect._name_](v, None if index is None else replicas[index], now, request)
        out, self._out = self._out, None
        return out

    def _record(self) -> Applied:
        """This event's `Applied`, made when something is to be told."""
        out = self._out
        if out is None:
            out = self._out = Applied()
        return out

    def _on_failure(
        self, v: Verdict, replica: ReplicaState | None, now: float, req: Request
    ) -> None:
        assert replica is not None
        replica.failures += 1
        until = self._failure(replica, req.model, now)
        if until is not None:
            self._ejected(replica, None, until, v.reason, now)

    def _on_success(
        self, v: Verdict, replica: ReplicaState | None, now: float, req: Request
    ) -> None:
        assert replica is not None
        replica.success()
        if v.model is not None:
            self.fleet.models.succeeded(replica.index, v.model)

    def _on_eject(self, v: Verdict, replica: ReplicaState | None, now: float, req: Request) -> None:
        assert replica is not None and v.model is not None
        outage = v.effect is _EFFECT_OUTAGE
        if not outage:
            replica.failures += 1
        until = self._eject_for_model(replica, v.model, now, v.seconds if outage else None)
        if until is not None:
            self._ejected(replica, v.model, until, v.reason, now)
        elif outage:
            # Held in by the cap (or no outlier detection): it still asked not to be sent
            # anything for that long.
            self._cool(replica, v.model, v.seconds, v.reason, now)

    def _on_cool(self, v: Verdict, replica: ReplicaState | None, now: float, req: Request) -> None:
        assert replica is not None and v.model is not None
        self._cool(replica, v.model, v.seconds, v.reason, now)

    def _on_speed(self, v: Verdict, replica: ReplicaState | None, now: float, req: Request) -> None:
        assert replica is not None
        until = self._speed(replica, v.effect is _EFFECT_SLOW, req.model, now)
        if until is not None:
            self._ejected(replica, None, until, "slow", now)

    def _on_latency(
        self, v: Verdict, replica: ReplicaState | None, now: float, req: Request
    ) -> None:
        assert replica is not None
        answered = v.effect is _EFFECT_LATENCY
        if answered:  # answered first: an attempt judged not slow
            window = replica.outcomes
            if window is not None:
                window.record(now, False, False)
            elif self.fleet.config.outlier_detection is not None:
                self._speed(replica, False, req.model, now)
        config = self.fleet.config
        if config.pick != "peak_ewma":
            return
        seconds = v.seconds
        if v.excess:
            seconds = max(seconds - self.fleet.prefill(req.group, req.tokens, now), 0.0)
        if answered:
            replica.observe_latency(now, seconds, config.latency_decay)
        else:
            replica.observe_lower_bound(now, seconds, config.latency_decay)

    def _on_window(
        self, v: Verdict, replica: ReplicaState | None, now: float, req: Request
    ) -> None:
        assert replica is not None and v.model is not None
        state = self.fleet.models.make(replica.index, v.model)
        state.window = v.tokens if state.window is None else min(state.window, v.tokens)

    def _cool(
        self,
        replica: ReplicaState,
        model: str,
        seconds: float,
        reason: str,
        now: float,
    ) -> None:
        fleet = self.fleet
        state = fleet.models.make(replica.index, model)
        state.push_back(now, seconds)
        state.cooling_reason = reason
        self._record().cooled.append((replica, state.cooling_until, reason, model))
        if self.store is not None:
            self.store.publish(Cooldown(fleet.name, replica.name, model, seconds, reason))

    # The throttle: each effect its own handler (the success is on every request's path).

    def _credit(self, v: Verdict, replica: ReplicaState | None, now: float, req: Request) -> None:
        fleet = self.fleet
        throttle = fleet.throttle
        if throttle is None:
            self._record().credit = False
        elif fleet.credits < self.credit_cap(now):
            fleet.credits += 1
            self._record().credit = True
        else:  # the credit is used up: the failure takes its token at once
            out = self._record()
            out.credit = False
            out.taken += throttle.failure()

    def _debit(self, v: Verdict, replica: ReplicaState | None, now: float, req: Request) -> None:
        throttle = self.fleet.throttle
        if throttle is not None:
            self._record().taken += throttle.failure()

    def _credit_closed(
        self, v: Verdict, replica: ReplicaState | None, now: float, req: Request
    ) -> None:
        fleet = self.fleet
        if fleet.throttle is not None:
            fleet.credits = max(0, fleet.credits - 1)
            if v.effect is _EFFECT_CREDIT_DEBITED:
                fleet.throttle.failure()

    def _refund(self, v: Verdict, replica: ReplicaState | None, now: float, req: Request) -> None:
        throttle = self.fleet.throttle
        if throttle is not None:
            throttle.refund(v.tokens)

    def _succeeded(
        self, v: Verdict, replica: ReplicaState | None, now: float, req: Request
    ) -> None:
        throttle = self.fleet.throttle
        if throttle is not None:
            throttle.success()

    def credit_cap(self, now: float) -> int:
        """How many requests' first failures may be on credit at once: what the hedge budget
        would still allow now (its floor included: a quiet fleet's burst fits), else half
        the throttle's tokens. A fleet that fails whole makes at most that many extra
        attempts beyond what the throttle allows (docs/guarantees.md, the storm bound)."""
        fleet = self.fleet
        if fleet.budget is not None:
            return max(1, math.floor(fleet.budget.allowance(now)))
        assert fleet.config.throttle is not None
        return max(1, math.floor(fleet.config.throttle.max_tokens / 2))

    def _on_sample(
        self, v: Verdict, replica: ReplicaState | None, now: float, req: Request
    ) -> None:
        fleet = self.fleet
        model = fleet.model
        if model is None:
            return
        name = None if replica is None else replica.name
        at = now if v.at is None else min(v.at, now)
        group, size_class, tokens = req.group, req.size_class, req.tokens
        model.observe(group, size_class, at, v.seconds, v.observed, tokens, name, v.attempt)
        if self.store is not None and name is not None:
            self.store.publish(
                DelaySample(
                    fleet.name, group, size_class, v.seconds, v.observed, tokens, name, now - at
                )
            )

    def _ejected(
        self, replica: ReplicaState, model: str | None, until: float, reason: str, now: float
    ) -> None:
        """An ejection just made (whole, or for ``model``): its reason kept, announced to
        the request's planner, published to the other processes."""
        if model is None:
            replica.ejected_reason = reason
        else:
            self.fleet.models.make(replica.index, model).ejected_reason = reason
        self._record().ejected.append((replica, until, reason, model))
        if self.store is not None:
            self.store.publish(Ejection(self.fleet.name, replica.name, model, until - now, reason))

    # -- ejection: decisions on the state ---------------------------------------------------

    def _outcomes(self, replica: ReplicaState) -> OutcomeWindow | None:
        config = self.fleet.config.outlier_detection
        if config is None:
            return None
        if replica.outcomes is None:
            replica.outcomes = OutcomeWindow(config.slow_window)
        return replica.outcomes

    def _failure(self, replica: ReplicaState, model: str, now: float) -> float | None:
        """One failure in ``replica``'s run, seen by a request for ``model``: ejected whole if
        the run is due, the replica fails more than the others (`_worse`) and the cap
        (``max_ejection_percent``, never the last replica) has room among the replicas out
        for ``model`` (ejected whole or for it). Returns when the ejection ends, or
        ``None``."""
        fleet = self.fleet
        config = fleet.config.outlier_detection
        window = self._outcomes(replica)
        if window is not None:
            window.record(now, False, True)
        if not replica.failure(now, config):
            return None
        assert config is not None
        if not self._worse(replica, model, now, failed=True):
            return None  # the fleet fails alike: ejecting it would only take capacity away
        if self._out_for(model, now) >= fleet.ejection_limit:
            fleet.counts.ejections_capped += 1
            return None
        replica.eject(now, config)
        return replica.ejected_until

    def _in_for(self, model: str, now: float, besides: ReplicaState) -> list[ReplicaState]:
        """The replicas other than ``besides`` in service for ``model`` now."""
        models = self.fleet.models
        out = []
        for r in self.fleet.replicas:
            if r is besides or r.ejected(now):
                continue
            state = models.get(r.index, model)
            if state is not None and state.ejected_until > now:
                continue
            out.append(r)
        return out

    def _worse(
        self, replica: ReplicaState, model: str, now: float, *, failed: bool, volume: int = 1
    ) -> bool:
        """Whether ``replica``'s share of failed (or slow) attempts over the window is
        ``slow_margin`` above the best share of another replica in service for ``model``
        with at least ``volume`` judged attempts (Envoy's success-rate detection compares
        hosts, not a run of one). With no other replica to compare with, a run of failures
        alone decides (the cap still holds); slowness never does."""
        config = self.fleet.config.outlier_detection
        assert config is not None and replica.outcomes is not None
        judged, slow, failures = replica.outcomes.counts(now)
        share = (failures if failed else slow) / max(judged, 1)
        best = None
        pending = False
        for r in self._in_for(model, now, replica):
            n = 0
            if r.outcomes is not None:
                n, s, f = r.outcomes.counts(now)
                if n >= volume:
                    other = (f if failed else s) / n
                    best = other if best is None else min(best, other)
            if n < volume and r.waiting:
                pending = True  # its attempts are out: their outcome will tell
        if best is None:
            # Nothing to compare with: a run of failures decides alone, unless another
            # replica's attempts are still out (a burst failing everywhere at one instant:
            # whichever replica's failures are counted first must not be the one ejected).
            return failed and not pending
        return share - best >= config.slow_margin - 1e-9

    def _out_for(self, model: str, now: float) -> int:
        """How many replicas are out for ``model`` now (ejected whole or for it)."""
        out = 0
        models = self.fleet.models
        for r in self.fleet.replicas:
            state = models.get(r.index, model)
            out += r.ejected_until > now or (state is not None and state.ejected_until > now)
        return out

    def _eject_for_model(
        self, replica: ReplicaState, model: str, now: float, seconds: float | None
    ) -> float | None:
        """Eject ``replica`` for ``model`` at once, for ``seconds`` (an outage) or the
        growing ejection time, under the same cap. Returns when it ends, or ``None`` (out
        already, no outlier detection, or the cap)."""
        fleet = self.fleet
        config = fleet.config.outlier_detection
        if config is None:
            return None
        current = fleet.models.get(replica.index, model)
        if replica.ejected(now) or (current is not None and current.ejected_until > now):
            return None
        if self._out_for(model, now) >= fleet.ejection_limit:
            fleet.counts.ejections_capped += 1
            return None
        state = fleet.models.make(replica.index, model)
        state.ejections += 1
        replica.times_ejected += 1
        length = config.ejection_time(state.ejections) if seconds is None else seconds
        state.ejected_until = now + length
        return state.ejected_until

    def _speed(self, replica: ReplicaState, slow: bool, model: str, now: float) -> float | None:
        """Record one attempt judged for speed; eject ``replica`` if it is slow *relative to
        the others* (`OutlierDetection.count_slow`), never when fewer than two replicas would
        be left in for ``model`` (a request needs one to hedge to). Returns when the ejection
        ends, or ``None``."""
        fleet = self.fleet
        config = fleet.config.outlier_detection
        if config is None:
            return None
        window = replica.outcomes
        if window is None:
            window = replica.outcomes = OutcomeWindow(config.slow_window)
        window.record(now, slow, False)
        if not slow or not config.count_slow or replica.ejected(now):
            return None
        if window.counts(now)[0] < config.slow_min_volume:
            return None
        if len(self._in_for(model, now, replica)) < 2:
            return None  # a request needs a replica to hedge to: never the last two
        if not self._worse(replica, model, now, failed=False, volume=config.slow_min_volume):
            return None
        if self._out_for(model, now) >= fleet.ejection_limit:
            fleet.counts.ejections_capped += 1
            return None
        replica.eject(now, config)
        return replica.ejected_until

    # -- what other processes decided ------------------------------------------------------

    def apply_remote(self, change: StateChange, now: float) -> None:
        """Apply a change another process of the fleet published (through the shared store):
        an ejection or a cooldown for (replica, model) for its remaining seconds, or a delay
        sample at its age. This process's own rules still hold: an ejection is not applied
        without outlier detection, nor past the cap (``max_ejection_percent``: never the last
        replica, counted as a local ejection is), nor shortened; a replica or a size class
        this Hedger does not have, or a sample older than the learner's window, is ignored
        (nothing a peer sends makes state here grow, nor raises)."""
        fleet = self.fleet
        if isinstance(change, DelaySample):
            model = fleet.model
            if model is None or not 0 <= change.size_class < model.config.classes.count:
                return
            if change.age >= model.config.window:
                return
            model.observe(
                change.group,
                change.size_class,
                now - change.age,
                change.seconds,
                change.observed,
                change.tokens,
                change.replica,
            )
            return
        replica = self._by_name.get(change.replica)
        if replica is None:
            return
        until = now + change.seconds
        if isinstance(change, Cooldown):
            state = fleet.models.make(replica.index, change.model)
            state.push_back(now, change.seconds)
            state.cooling_reason = change.reason
            return
        if fleet.config.outlier_detection is None:
            return
        if change.model is None:
            if until <= replica.ejected_until:
                return
            whole = sum(1 for r in fleet.replicas if r.ejected(now))
            if not replica.ejected(now) and whole >= fleet.ejection_limit:
                fleet.counts.ejections_capped += 1
                return
            replica.ejected_until = until
            replica.ejected_reason = change.reason
            return
        current = fleet.models.get(replica.index, change.model)
        if current is not None and until <= current.ejected_until:
            return
        out = replica.ejected(now) or (current is not None and current.ejected_until > now)
        if not out and self._out_for(change.model, now) >= fleet.ejection_limit:
            fleet.counts.ejections_capped += 1
            return
        state = fleet.models.make(replica.index, change.model)
        state.ejected_until = until
        state.ejected_reason = change.reason

    # -- bookkeeping: in flight, the budget, counters ---------------------------------------

    def started(
        self,
        replica: ReplicaState,
        key: object,
        number: int,
        trigger: str,
        now: float,
        *,
        tokens: int | None,
        probe_key: int,
        at_once: bool,
        priority: int = 0,
        recovery_hedge: bool = False,
    ) -> None:
        """An attempt started on ``replica`` (``key``: the request and attempt, waiting for a
        first token there); a primary deposits in the hedge budget for its class
        ``priority``; ``recovery_hedge``: a recovery sent as a hedge inside the recovery
        phase (it spends the hedge budget as a hedge does)."""
        fleet = self.fleet
        counts = fleet.counts
        replica.waiting[key] = now
        probe = fleet.probes[replica.index] if fleet.probed else None
        if probe is not None:
            probe.started(now, tokens or 0, probe_key)
        replica.in_flight += 1
        replica.attempts += 1
        counts.attempts += 1
        counts.prompt_sent += tokens or 0
        if number == 1:
            counts.requests += 1
            if fleet.budget is not None:
                fleet.budget.request(now, priority)
        if trigger == "hedge":
            counts.hedges_sent += 1
            if at_once:
                counts.at_once += 1
            if fleet.budget is not None:
                fleet.budget.spend(now)  # spent now it really started, not when checked
        elif trigger == "failover":
            counts.failovers += 1
        elif trigger == "recovery":
            counts.recoveries += 1
            if recovery_hedge:
                counts.recovery_hedges += 1
                if fleet.budget is not None:
                    fleet.budget.spend(now)  # a hedge inside the recovery: the same budget

    def ended(self, replica: ReplicaState, key: object) -> None:
        """An attempt on ``replica`` ended (failed, cancelled, or its request finished)."""
        replica.waiting.pop(key, None)
        replica.in_flight -= 1

    def committed(
        self,
        replica: ReplicaState,
        key: object,
        now: float,
        *,
        hedge: bool,
        first_token: float | None,
    ) -> None:
        """An attempt on ``replica`` got its first token and won (no longer waiting for one
        there); ``first_token``: when the caller saw it (the statistics' percentiles), or
        ``None`` (a recovery's, or an empty answer)."""
        replica.waiting.pop(key, None)
        replica.wins += 1
        replica.last_commit = now
        if hedge:
            self.fleet.counts.backup_wins += 1
        if first_token is not None:
            self.fleet.ttfts.append((now, first_token))

    def cancelled(
        self, replica: ReplicaState, now: float, *, lost: bool, ran: float, expected: float | None
    ) -> None:
        """An attempt cancelled without a first token: its server may still prefill it (a
        lingering load, llama.cpp notices a disconnect only when a prefill ends) until the
        prefill model's median ``expected`` for its size has passed since it started."""
        fleet = self.fleet
        if lost:
            replica.lost_races += 1
        probe = fleet.probes[replica.index] if fleet.probed else None
        if probe is not None:
            probe.cancelled(now)  # its prefill may run: no poll may keep it alive
        if expected is not None and expected > ran:
            lingering = replica.lingering
            if len(lingering) < _MAX_LINGERING:
                lingering.append((now - ran + expected, now - ran))

    def refused(self, reason: str, *, failover: bool, saturated: bool) -> None:
        counts = self.fleet.counts
        counts.refused(reason, failover=failover)
        if saturated:
            counts.saturated += 1

    def streamed(self, report: Report, model: str) -> None:
        """What a finished request's streams say (the throughput floor's evidence): winners
        the floor took the answer from are counted, and each winner's streaming rate after
        its commit is learned for its (replica, ``model``) when it ended unbroken with at
        least ``min_tokens`` tokens (a stream the floor cut, or one that broke, teaches
        nothing about its replica's rate)."""
        fleet = self.fleet
        fleet.counts.slow_streams += report.slow_streams
        floor = fleet.config.recovery.throughput_floor
        if floor is None:
            return
        by_name = {r.name: r for r in fleet.replicas}
        for a in report.attempts:
            if a.stream_rate is None or a.outcome is not AttemptOutcome.WON or a.error:
                continue
            replica = by_name.get(a.replica)
            if replica is not None and a.tokens_received >= floor.min_tokens:
                fleet.rates.observe(replica.index, model, a.stream_rate)

    def finished(self, report: Report, *, refused_request: bool) -> bool:
        """Count a request that ended; returns whether it counts as finished (it sent
        something, or was refused for cooling replicas)."""
        counts = self.fleet.counts
        if not report.attempts:
            if refused_request:
                counts.refused_requests += 1
            return False
        counts.finished += 1
        if report.error is not None:
            counts.failed += 1
        counts.wasted += report.wasted_tokens
        counts.prompt_resent += report.prompt_tokens_resent or 0
        return True


# Enum members read on every request's path, as module constants: loading one is about
# ten times faster than the class attribute (EnumType resolves it on each access).
_EFFECT_CREDIT_DEBITED = Effect.CREDIT_DEBITED
_EFFECT_LATENCY = Effect.LATENCY
_EFFECT_OUTAGE = Effect.OUTAGE
_EFFECT_SLOW = Effect.SLOW
