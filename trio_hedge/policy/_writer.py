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

import attrs

from ..report import Report
from ..state import Cooldown, DelaySample, Ejection, FleetStore, StateChange
from ._fleet import FleetState
from ._health import OutcomeWindow, ReplicaState
from ._judge import Effect, Verdict

__all__ = ["Applied", "FleetWriter"]

#: Cancelled attempts a replica may count as still being prefilled (a memory bound).
_MAX_LINGERING = 1024


@attrs.define
class Applied:
    """What applying a request's verdicts did (internal): announcements for the planner."""

    #: (replica, until, reason, model or None for the whole replica)
    ejected: list[tuple[ReplicaState, float, str, str | None]] = attrs.Factory(list)
    #: (replica, until, reason)
    cooled: list[tuple[ReplicaState, float, str]] = attrs.Factory(list)
    #: A CREDIT verdict: whether the throttle granted it (None: none asked).
    credit: bool | None = None
    #: Throttle thousandths taken at once (DEBIT verdicts).
    taken: int = 0
    #: Credit given back or debited.
    credit_closed: bool = False
    refunded: bool = False


class FleetWriter:
    """The only writer of a `FleetState` (see the module docs)."""

    def __init__(self, fleet: FleetState, store: FleetStore | None = None) -> None:
        self.fleet = fleet
        self.store = store
        self._by_name = {r.name: r for r in fleet.replicas}

    # -- verdicts ----------------------------------------------------------------------------

    def apply(
        self,
        verdicts: tuple[Verdict, ...],
        now: float,
        *,
        model: str,
        group: str,
        size_class: int,
        tokens: int | None,
    ) -> Applied:
        """Apply one event's verdicts, for a request for ``model`` of learning group
        ``group``, size class ``size_class`` and ``tokens`` prompt tokens."""
        out = Applied()
        fleet = self.fleet
        for v in verdicts:
            effect = v.effect
            replica = None if v.replica is None else fleet.replicas[v.replica]
            if effect is Effect.NOTHING:
                continue
            if effect is Effect.FAILURE:
                assert replica is not None
                replica.failures += 1
                until = self._failure(replica, model, now)
                if until is not None:
                    replica.reason = v.reason
                    out.ejected.append((replica, until, v.reason, None))
                    self._publish_ejection(replica, None, until - now, v.reason)
            elif effect is Effect.SUCCESS:
                assert replica is not None
                replica.success()
                if v.model is not None:
                    fleet.models.succeeded(replica.index, v.model)
            elif effect is Effect.EJECT or effect is Effect.OUTAGE:
                assert replica is not None and v.model is not None
                if effect is Effect.EJECT:
                    replica.failures += 1
                until = self._eject_for_model(
                    replica, v.model, now, None if effect is Effect.EJECT else v.seconds
                )
                if until is not None:
                    fleet.models.make(replica.index, v.model).reason = v.reason
                    out.ejected.append((replica, until, v.reason, v.model))
                    self._publish_ejection(replica, v.model, until - now, v.reason)
                elif effect is Effect.OUTAGE:
                    # Held in by the cap (or no outlier detection): it still asked not to be
                    # sent anything for that long.
                    self._cool(replica, v.model, v.seconds, v.reason, now, out)
            elif effect is Effect.COOL:
                assert replica is not None and v.model is not None
                self._cool(replica, v.model, v.seconds, v.reason, now, out)
            elif effect is Effect.SLOW or effect is Effect.PROMPT:
                assert replica is not None
                until = self._speed(replica, effect is Effect.SLOW, model, now)
                if until is not None:
                    replica.reason = "slow"
                    out.ejected.append((replica, until, "slow", None))
                    self._publish_ejection(replica, None, until - now, "slow")
            elif effect is Effect.LATENCY or effect is Effect.LATENCY_FLOOR:
                assert replica is not None
                if fleet.config.pick != "peak_ewma":
                    continue
                seconds = v.seconds
                if v.excess:
                    seconds = max(seconds - fleet.prefill(group, tokens, now), 0.0)
                if effect is Effect.LATENCY:
                    replica.observe_latency(now, seconds, fleet.config.latency_decay)
                else:
                    replica.observe_lower_bound(now, seconds, fleet.config.latency_decay)
            elif effect is Effect.SAMPLE:
                self._sample(v, now, group, size_class, tokens)
            elif effect is Effect.WINDOW:
                assert replica is not None and v.model is not None
                state = fleet.models.make(replica.index, v.model)
                state.window = v.tokens if state.window is None else min(state.window, v.tokens)
            else:
                self._throttle(v, now, out)
        return out

    def _cool(
        self,
        replica: ReplicaState,
        model: str,
        seconds: float,
        reason: str,
        now: float,
        out: Applied,
    ) -> None:
        fleet = self.fleet
        state = fleet.models.make(replica.index, model)
        state.push_back(now, seconds)
        state.reason = reason
        out.cooled.append((replica, state.cooling_until, reason))
        if self.store is not None:
            self.store.publish(Cooldown(fleet.name, replica.name, model, seconds, reason))

    def _throttle(self, v: Verdict, now: float, out: Applied) -> None:
        fleet = self.fleet
        throttle = fleet.throttle
        effect = v.effect
        if throttle is None:
            if effect is Effect.CREDIT:
                out.credit = False
            return
        if effect is Effect.CREDIT:
            if fleet.credits < self.credit_cap(now):
                fleet.credits += 1
                out.credit = True
            else:  # the credit is used up: the failure takes its token at once
                out.credit = False
                out.taken += throttle.failure()
        elif effect is Effect.DEBIT:
            out.taken += throttle.failure()
        elif effect is Effect.CREDIT_RELEASED:
            fleet.credits = max(0, fleet.credits - 1)
            out.credit_closed = True
        elif effect is Effect.CREDIT_DEBITED:
            fleet.credits = max(0, fleet.credits - 1)
            throttle.failure()
            out.credit_closed = True
        elif effect is Effect.REFUND:
            throttle.refund(v.tokens)
            out.refunded = True
        elif effect is Effect.THROTTLE_SUCCESS:
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

    def _sample(
        self, v: Verdict, now: float, group: str, size_class: int, tokens: int | None
    ) -> None:
        fleet = self.fleet
        model = fleet.model
        if model is None:
            return
        name = None if v.replica is None else fleet.replicas[v.replica].name
        at = now if v.at is None else min(v.at, now)
        model.observe(group, size_class, at, v.seconds, v.observed, tokens, name, v.attempt)
        if self.store is not None and name is not None:
            self.store.publish(
                DelaySample(
                    fleet.name, group, size_class, v.seconds, v.observed, tokens, name, now - at
                )
            )

    def _publish_ejection(
        self, replica: ReplicaState, model: str | None, seconds: float, reason: str
    ) -> None:
        if self.store is not None:
            self.store.publish(Ejection(self.fleet.name, replica.name, model, seconds, reason))

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
            window.record(now, failed=True)
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
        for r in self._in_for(model, now, replica):
            if r.outcomes is None:
                continue
            n, s, f = r.outcomes.counts(now)
            if n >= volume:
                other = (f if failed else s) / n
                best = other if best is None else min(best, other)
        if best is None:
            return failed
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
        window = self._outcomes(replica)
        if window is None or config is None:
            return None
        window.record(now, slow=slow)
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
            state.reason = change.reason
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
            replica.reason = change.reason
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
        state.reason = change.reason

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
    ) -> None:
        """An attempt started on ``replica`` (``key``: the request and attempt, waiting for a
        first token there)."""
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
                fleet.budget.request(now)
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

    def answered(self, replica: ReplicaState, key: object) -> None:
        """An attempt on ``replica`` got its first token: no longer waiting for one there."""
        replica.waiting.pop(key, None)

    def ended(self, replica: ReplicaState, key: object) -> None:
        """An attempt on ``replica`` ended (failed, cancelled, or its request finished)."""
        replica.waiting.pop(key, None)
        replica.in_flight -= 1

    def committed(self, replica: ReplicaState, now: float, *, hedge: bool) -> None:
        replica.wins += 1
        replica.last_commit = now
        if hedge:
            self.fleet.counts.backup_wins += 1

    def commit_time(self, at: float, first_token: float) -> None:
        """A caller-visible first token (for the statistics' percentiles)."""
        self.fleet.ttfts.append((at, first_token))

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
