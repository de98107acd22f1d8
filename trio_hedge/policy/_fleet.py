"""The state every request of one [`Hedger`][trio_hedge.Hedger] shares: the fleet.

One `FleetState` per Hedger holds what the per-request planners
(``policy/_planner.py``) read and update at each decision: the delay learner, the hedge
budget and the retry throttle, each replica's health and load, and the counters behind
[`statistics`][trio_hedge.Hedger.statistics]. It also makes the decisions that need the whole fleet:
where an attempt goes among eligible replicas (`FleetState.pick`), how much of a TTFT a
prompt's size explains (`FleetState.prefill`), and whether a failing replica is ejected
under the cap (`FleetState.health_failure`, `FleetState.eject_for_model`; whether
it failed by its own fault, ``_blame.py`` decides).

Trio is single-threaded, so the shared state needs no locks; every structure is bounded
(sliding windows with a sample cap, a capped number of groups), so thousands of concurrent
streams over a long run do not grow it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import attrs
import trio

from .._hooks import Scopes, emit
from .._source import Source
from ..events import EventHook, HedgeEvent
from ..sources._bindable import BindableReplica
from ..sources.probes import LoadProbe
from ._blame import Attribution
from ._budget import BudgetState
from ._config import HedgerConfig
from ._delay import DelayModel, LearnedDelay
from ._health import ModelState, ModelStates, ReplicaState
from ._load import ProbeState
from ._quantiles import empirical_quantile
from ._stats import DelayStatistics, HedgerStatistics, ReplicaStatistics
from ._throttle import ThrottleState

__all__ = ["FleetCounts", "FleetState"]

#: Commits kept for the caller-visible TTFT percentiles in ``statistics()``.
_TTFT_SAMPLES = 4096
#: (replica, model) records kept (cooldowns and ejections for one model): a bound on state a
#: client-chosen model name can reach.
MODEL_STATES = 1024


@attrs.define(slots=True)
class FleetCounts:
    """The Hedger's counters since it was made (what
    [`HedgerStatistics`][trio_hedge.policy.HedgerStatistics] reports)."""

    requests: int = 0
    finished: int = 0
    failed: int = 0
    attempts: int = 0
    hedges_sent: int = 0
    failovers: int = 0
    recoveries: int = 0
    backup_wins: int = 0
    #: Hedges not sent, by reason.
    budget: int = 0
    throttle: int = 0
    no_replica: int = 0
    #: Failovers not sent, by reason.
    failover_throttle: int = 0
    failover_no_replica: int = 0
    refused_requests: int = 0
    ejections_capped: int = 0
    prompt_sent: int = 0
    prompt_resent: int = 0
    wasted: int = 0
    #: Load probes: hedges refused on the engines' evidence, backups sent at once on it.
    saturated: int = 0
    at_once: int = 0

    def refused(self, reason: str, *, failover: bool) -> None:
        """Count a hedge (or failover) not sent, for ``reason``: ``"budget"``, ``"throttle"``
        or ``"no_replica"``."""
        if failover:
            if reason == "throttle":
                self.failover_throttle += 1
            else:
                self.failover_no_replica += 1
        elif reason == "budget":
            self.budget += 1
        elif reason == "throttle":
            self.throttle += 1
        else:
            self.no_replica += 1


def _no_model(_tokens: int) -> None:
    return None


def _probe_state(probe: LoadProbe | ProbeState) -> ProbeState:
    return probe if isinstance(probe, ProbeState) else ProbeState(probe)


class FleetState:
    """What every request of one Hedger shares (see the module docs).

    Args:
        config: the Hedger's [`HedgerConfig`][trio_hedge.HedgerConfig].
        replicas: where attempts go (replicas bound to each request --
            [`Replica`][trio_hedge.sources.Replica],
            [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica] -- or any
            [`Source`][trio_hedge.sources.Source]), names unique (checked by the caller).
        on_event: the hooks events go to; the list is shared, not copied.
        probes: the [`LoadProbe`][trio_hedge.sources.probes.LoadProbe] of each probed
            replica, by its index in ``replicas``, or the `ProbeState` it shares with other
            Hedgers (a ``LoadMonitor``'s: one poller per replica for all of them).
    """

    def __init__(
        self,
        config: HedgerConfig,
        replicas: Sequence[BindableReplica | Source],
        on_event: list[EventHook],
        probes: Mapping[int, LoadProbe | ProbeState] | None = None,
        *,
        name: str = "default",
    ) -> None:
        #: The fleet's name in a shared store (a gateway group's).
        self.name = name
        self.config = config
        self.on_event = on_event
        self.replicas = [
            ReplicaState(
                index=i,
                name=r.name,
                source=r,
                context_window=getattr(r, "context_window", None),
                fallback=getattr(r, "fallback", False) is True,
            )
            for i, r in enumerate(replicas)
        ]
        self.has_fallback = any(r.fallback for r in self.replicas)
        delay = config.hedge_after
        self.model = DelayModel(delay) if isinstance(delay, LearnedDelay) else None
        self.budget = BudgetState(config.budget) if config.budget is not None else None
        self.throttle = ThrottleState(config.throttle) if config.throttle is not None else None
        outlier = config.outlier_detection
        self.ejection_limit = 0 if outlier is None else outlier.ejection_limit(len(self.replicas))
        #: (time of commit, time of first token) of recent winners, for the percentiles.
        self.ttfts: deque[tuple[float, float]] = deque(maxlen=_TTFT_SAMPLES)
        self.counts = FleetCounts()
        self.attribution: Attribution = config.attribution
        self.models = ModelStates(MODEL_STATES)
        probes = probes or {}
        #: Each replica's engine evidence (``None``: not probed); ``probed``: any is.
        self.probes: list[ProbeState | None] = [
            _probe_state(probes[i]) if i in probes else None for i in range(len(self.replicas))
        ]
        self.probed = bool(probes)
        #: How often a request waiting for its hedge delay looks at the readings again.
        self.probe_interval = min(
            (p.probe.interval for p in self.probes if p is not None), default=math.inf
        )
        self._serial = 0
        #: Requests whose first failure is on the throttle's credit now (``_writer.py``).
        self.credits = 0

    def next_serial(self) -> int:
        """A number for a new request, distinct from every other request of this Hedger (its
        request id may not be: a client chooses it)."""
        self._serial += 1
        return self._serial

    def model_state(self, replica: ReplicaState, model: str) -> ModelState | None:
        return self.models.get(replica.index, model)

    def pick(
        self,
        eligible: list[ReplicaState],
        now: float,
        prefill: Callable[[int], float | None] | None = None,
    ) -> ReplicaState:
        """Where an attempt goes among ``eligible``: the lowest peak-EWMA cost -- its recent
        TTFT times one plus its attempts waiting for a first token -- and for a replica whose
        engine reading is fresh, its recent TTFT *plus* the queue wait the reading predicts
        (`predicted`): the engine's evidence adds to what the Hedger saw of the replica,
        never replaces it (a replica known to take 2 s, idle on its engine's page, is no
        faster than one known to take 0.1 s); ``prefill`` is the request's prefill model
        (seconds for a number of tokens)."""
        pick = self.config.pick
        if pick == "in_order" or len(eligible) == 1:
            return eligible[0]
        if pick == "least_loaded":
            return min(eligible, key=lambda r: (r.in_flight, r.index))
        decay = self.config.latency_decay
        best = eligible[0]
        best_key = (math.inf, 0)
        for r in eligible:
            latency, n = r.load(now, decay)
            cost = latency * (n + 1)
            if self.probed:
                predicted = self.predicted(r, now, prefill, count=True)
                if predicted is not None:
                    cost = r.latency_now(now, decay) + predicted
            key = (cost, n)  # ties: fewer attempts, then the given order
            if key < best_key:
                best, best_key = r, key
        return best

    def predicted(
        self,
        replica: ReplicaState,
        now: float,
        prefill: Callable[[int], float | None] | None,
        *,
        count: bool = False,
        request: int | None = None,
        before: float | None = None,
        own: int | None = None,
    ) -> float | None:
        """The seconds a new request would wait on ``replica`` before its prefill starts,
        from its engine's fresh reading (``inf``: saturated), raised to the age of this
        Hedger's oldest attempt waiting there for a first token (it says the replica is at
        least that slow now, whatever the engine reports); ``None`` without a fresh reading
        (the caller then uses its own view). ``count``: count the decision in statistics;
        ``request``: the asking request (its own attempts there are not ahead of it);
        ``before``: count only this Hedger's attempts started there before then (those ahead
        of an attempt started then), and once a reading taken after then shows the
        attempt's own ``own`` prompt tokens, they are not ahead of it either."""
        state = self.probes[replica.index]
        if state is None:
            return None
        reading = state.fresh(now)
        if reading is None:
            if count:
                replica.own_view_decisions += 1
            return None
        if count:
            replica.probe_decisions += 1
        wait = state.predicted_wait(reading, prefill or _no_model, request, before, own)
        wait = max(wait, state.stalled_for(reading, now, before, own))
        if replica.waiting:
            oldest = next(iter(replica.waiting.values()))
            wait = max(wait, now - oldest)
        return wait

    def prefill(self, group: str, tokens: int | None, now: float) -> float:
        """The seconds of a TTFT that the group's prefill model puts down to the prompt's
        size: its median for ``tokens`` minus its intercept (0 without a model or a size).
        Beyond the sizes it was fitted on the model grows in proportion to tokens, so a long
        prompt's prefill is predicted even when only short ones were seen."""
        if self.model is None or not tokens:
            return 0.0
        fit = self.model.fit(group, now)
        return 0.0 if fit is None else fit.median(tokens) - fit.intercept

    def emit(self, event: HedgeEvent, scopes: Scopes | None = None) -> None:
        """Hand ``event`` to the hooks; ``scopes``: the request's open hook contexts."""
        if self.on_event:
            emit(self.on_event, event, scopes)

    def _probe_statistics(self, r: ReplicaState, now: float) -> dict[str, object]:
        state = self.probes[r.index]
        if state is None:
            return {}
        fresh = state.fresh(now)
        return {
            "probe": state.status(now),
            "probe_age": None if state.reading is None else now - state.read_at,
            "probe_reading": state.reading,
            "probe_polls": state.polls,
            "probe_failures": state.failures,
            "predicted_wait": None if fresh is None else self.predicted(r, now, None),
            "probe_decisions": r.probe_decisions,
            "own_view_decisions": r.own_view_decisions,
        }

    def _replica_statistics(self, r: ReplicaState, now: float) -> ReplicaStatistics:
        cooling_until = ejected_until = -math.inf
        cooling_models: list[str] = []
        ejected_models: list[str] = []
        for model, entry in self.models.of(r.index):
            if entry.cooling_until > now:
                cooling_models.append(model)
                cooling_until = max(cooling_until, entry.cooling_until)
            if entry.ejected_until > now:
                ejected_models.append(model)
                ejected_until = max(ejected_until, entry.ejected_until)
        # The replica's own state is its whole-replica scope: an ejection or cooldown for a
        # model is that model's (``ejected_models``, ``cooling_models``), and a replica
        # serving other models is not out (readiness reads the scopes).
        state = (
            "ejected"
            if r.ejected_until > now
            else "degraded"
            if cooling_models or ejected_models
            else "healthy"
        )
        ejected_until = max(ejected_until, r.ejected_until)
        return ReplicaStatistics(
            name=r.name,
            state=state,
            in_flight=r.in_flight,
            attempts=r.attempts,
            wins=r.wins,
            failures=r.failures,
            cooling_for=max(0.0, cooling_until - now),
            ejected_for=max(0.0, ejected_until - now),
            times_ejected=r.times_ejected,
            consecutive_failures=r.consecutive,
            latency=r.load(now, self.config.latency_decay)[0]
            if self.config.pick == "peak_ewma"
            else 0.0,
            lingering=len(r.lingering),
            lost_races=r.lost_races,
            judged_attempts=0 if r.outcomes is None else r.outcomes.counts(now)[0],
            slow_attempts=0 if r.outcomes is None else r.outcomes.counts(now)[1],
            cooling_models=tuple(sorted(cooling_models)),
            ejected_models=tuple(sorted(ejected_models)),
            **self._probe_statistics(r, now),  # type: ignore[arg-type]
        )

    def statistics(self) -> HedgerStatistics:
        """A frozen [`HedgerStatistics`][trio_hedge.policy.HedgerStatistics] snapshot (call inside
        Trio)."""
        now = trio.current_time()
        c = self.counts
        horizon = now - self.config.stats_window
        ttfts = [v for t, v in self.ttfts if t >= horizon]
        delays: list[DelayStatistics] = []
        if self.model is not None:
            classes = self.model.config.classes
            for group, index, observations, censored, delay, learned in self.model.describe(now):
                low, high = classes.bounds(index)
                delays.append(
                    DelayStatistics(
                        group=group,
                        size_class=index,
                        min_tokens=low,
                        max_tokens=high,
                        observations=observations,
                        censored=censored,
                        delay=delay,
                        learned=learned,
                    )
                )
        replicas = tuple(self._replica_statistics(r, now) for r in self.replicas)
        return HedgerStatistics(
            time=now,
            requests=c.requests,
            finished=c.finished,
            failed=c.failed,
            attempts=c.attempts,
            hedges_sent=c.hedges_sent,
            failovers=c.failovers,
            recoveries=c.recoveries,
            backup_wins=c.backup_wins,
            hedges_refused=c.budget + c.throttle + c.no_replica,
            budget_refusals=c.budget,
            throttle_refusals=c.throttle,
            no_replica_refusals=c.no_replica,
            failovers_refused=c.failover_throttle + c.failover_no_replica,
            failover_throttle_refusals=c.failover_throttle,
            failover_no_replica_refusals=c.failover_no_replica,
            requests_refused=c.refused_requests,
            ejections_capped=c.ejections_capped,
            throttle_tokens=None if self.throttle is None else self.throttle.tokens,
            budget_window=None if self.budget is None else self.budget.counts(now),
            prompt_tokens_sent=c.prompt_sent,
            prompt_tokens_resent=c.prompt_resent,
            wasted_tokens=c.wasted,
            ttft_p50=empirical_quantile(ttfts, 0.5),
            ttft_p90=empirical_quantile(ttfts, 0.9),
            ttft_p99=empirical_quantile(ttfts, 0.99),
            delays=tuple(delays),
            replicas=replicas,
            prefill=() if self.model is None else tuple(self.model.fits(now)),
            saturated_refusals=c.saturated,
            hedges_at_once=c.at_once,
        )
