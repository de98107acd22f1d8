"""One request's decisions for a [`Hedger`][trio_hedge.Hedger]: the
[`Planner`][trio_hedge.policy.Planner] the race consults, over the
``FleetState`` every request shares.

* **where an attempt goes** -- a replica this request has not tried yet before one it has,
  none cooling, ejected or in this request's back-off (waiting, within
  ``max_pushback_wait``, when every replica is), then the fleet's pick;
* **when to hedge** -- this request's own delay, else the learned (or fixed) one for its
  group and size class; at once when another attempt on the same replica has waited twice
  that;
* **whether a hedge or failover may go** -- the budget and the throttle, checked at the
  moment;
* **what happened** -- each attempt's start, commit, failure or cancellation updates the
  delay learner, the replica's health and load, the budget, the throttle and the counters.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from .._source import Source
from ..errors import AttemptError, ReplicasCooling, StreamInterrupted
from ..events import EventKind, HedgeEvent
from ..report import AttemptOutcome, AttemptRecord, Report
from ..sources._bindable import BindableReplica
from ._backoff import backoff_delay, jitter_draw
from ._fleet import FleetState
from ._health import ReplicaState, counts_against_replica

__all__ = ["RequestPlanner"]

#: Cancelled attempts a replica may count as still being prefilled (a memory bound).
_MAX_LINGERING = 1024


class RequestPlanner:
    """The [`Planner`][trio_hedge.policy.Planner] of one request of a Hedger, over the fleet
    state every request shares. ``bind`` makes this request's source for a replica (the
    Hedger binds an HTTP replica to the request and its client); the planner decides where
    and when, never how."""

    def __init__(
        self,
        fleet: FleetState,
        bind: Callable[[BindableReplica | Source], Source],
        *,
        request_id: str,
        group: str,
        size_class: int,
        tokens: int | None,
        hedgeable: bool,
        hedge_after: float | None = None,
    ) -> None:
        self._fleet = fleet
        self._make_source = bind
        self._request_id = request_id
        self._group = group
        self._class = size_class
        self._tokens = tokens
        self._hedgeable = hedgeable
        self._hedge_after = hedge_after  # this request's own delay, if it has one
        self._began: float | None = None  # when the primary was asked for
        config = fleet.config
        self._per_replica = config.attempts_per_replica
        self._max_attempts = config.max_attempts
        self._used = [0] * len(fleet.replicas)
        self._bound: dict[int, Source] = {}  # replica index -> this request's source
        self._by_source: dict[int, ReplicaState] = {}  # id(source) -> replica
        self._running: dict[int, ReplicaState] = {}  # attempt number -> replica
        # Replica index -> when this request may try it again (back-off); made on first use.
        self._retry_at: dict[int, float] | None = None
        # Attempts a hedge was sent for: counted slow if another attempt wins.
        self._hedged_over: list[int] | None = None
        self._winner: ReplicaState | None = None
        self._started = 0
        self._finished = False

    # -- where -------------------------------------------------------------------------------

    def _candidates(self) -> list[ReplicaState]:
        if self._max_attempts is not None and self._started >= self._max_attempts:
            return []
        used, limit = self._used, self._per_replica
        return [r for r in self._fleet.replicas if used[r.index] < limit]

    def _choose(
        self, candidates: list[ReplicaState], now: float, deadline: float, *, primary: bool
    ) -> tuple[ReplicaState | None, float, float]:
        """``(replica, wait_until, beyond)``: the replica for an attempt now, else ``None``,
        the earliest time one may take it within the wait bound (``deadline``), and the
        earliest time one may take it at all (``inf``: none will).

        A replica may take an attempt once its cooldown (server pushback), its ejection and
        this request's back-off for it are over. The wait bound applies to cooldowns and
        ejections, not to the back-off (bounded by ``Backoff.maximum``). A later attempt
        never waits for an ejected replica; the primary may (the cap leaves a replica in, so
        that only matters when every replica left in is cooling)."""
        ready: list[ReplicaState] = []
        wait_until = beyond = math.inf
        retry_at = self._retry_at
        for r in candidates:
            at = r.ejected_until
            if at > now and not primary:
                continue
            if r.cooling_until > at:
                at = r.cooling_until
            if at > deadline:
                beyond = min(beyond, at)
                continue
            if retry_at is not None:
                at = max(at, retry_at.get(r.index, at))
            if at <= now:
                ready.append(r)
            elif at < wait_until:
                wait_until = at
        if not ready:
            return None, wait_until, min(wait_until, beyond)
        if not primary and len(ready) > 1:
            # A replica this request has not tried yet before one it has.
            used = self._used
            fewest = min(used[r.index] for r in ready)
            ready = [r for r in ready if used[r.index] == fewest]
        return self._fleet.pick(ready, now), now, now

    def _bind(self, replica: ReplicaState) -> Source:
        source = self._bound.get(replica.index)
        if source is None:
            source = self._make_source(replica.source)
            self._bound[replica.index] = source
            self._by_source[id(source)] = replica
        return source

    async def next_source(self, number: int, trigger: str) -> Source | None:
        fleet = self._fleet
        primary = number == 1
        throttle = fleet.throttle
        if trigger == "failover" and throttle is not None and not throttle.allows:
            # gRFC A6: at or below half the tokens, no retries either (a primary always goes).
            if self._candidates():
                self._refuse("throttle", trio.current_time(), failover=True)
            return None
        config = fleet.config
        wait = config.max_pushback_wait
        start = trio.current_time()
        deadline = math.inf if wait is None else start + wait
        if self._began is None:
            self._began = start  # the race begins with its primary
        timeout = config.first_token_timeout
        if timeout is not None:
            # Nor past the race's first_token_timeout: a replica cooling beyond it could not
            # give a first token in time, so it is not waited for (the caller's own scope
            # just cancels the wait).
            deadline = max(start, min(deadline, self._began + timeout))
        while True:
            candidates = self._candidates()
            if not candidates:
                return None  # the plan is used up: not a refusal
            now = trio.current_time()
            chosen, wait_until, beyond = self._choose(candidates, now, deadline, primary=primary)
            if chosen is not None:
                return self._bind(chosen)
            if wait_until == math.inf:
                if primary:
                    # Without a bound, every replica is in reach.
                    assert deadline != math.inf
                    bound = deadline - start
                    raise ReplicasCooling(until=beyond, retry_in=beyond - now, max_wait=bound)
                # Every replica left is ejected, or cools for longer than the bound: not sent.
                self._refuse("no_replica", now, failover=trigger != "hedge")
                return None
            # Every usable replica asked us to back off (or is in this request's back-off):
            # wait for the first to be free (bounded above, and by the caller's cancel scope).
            await trio.sleep_until(wait_until)

    # -- when --------------------------------------------------------------------------------

    def hedge_delay(self, number: int) -> float | None:
        if not self._hedgeable:
            return None
        if self._hedge_after is not None:
            return self._hedge_after  # the caller's own delay for this request, as given
        now = trio.current_time()
        model = self._fleet.model
        if model is None:
            fixed = self._fleet.config.hedge_after
            assert isinstance(fixed, (int, float))
            delay = float(fixed)
        else:
            delay = model.delay(self._group, self._class, now, self._tokens)
        # The evidence the delay waits for may be in already: another attempt on this
        # attempt's replica has waited twice the delay for its first token (at the delay it
        # was hedged itself, and for another delay nothing answered): the replica is stuck
        # now, and the pick chose it anyway, so every replica it could choose looked as bad.
        # Then the backup goes at once, joining the other queue as early as a double send
        # would (budget and throttle still apply). At once the delay itself (a 1x
        # threshold) also fired on ordinary queueing: benchmarks/tail.py, 10.04% extra
        # against 9.72%, for the same P99.
        replica = self._running.get(number)
        if replica is not None and self._fleet.config.pick == "peak_ewma":
            for key, started in replica.waiting.items():
                if key != (self, number) and now - started >= 2.0 * delay:
                    return 0.0
                break  # the first is the oldest
        return delay

    def may_hedge(self) -> bool:
        """Whether a backup may go now. Only checks: the budget is spent when it starts."""
        fleet = self._fleet
        candidates = self._candidates()
        if not candidates:
            return True  # nothing left to send: next_source ends the plan; not a refusal
        now = trio.current_time()
        if self._choose(candidates, now, now, primary=False)[0] is None:
            return self._refuse("no_replica", now)  # ejected, cooling or backing off
        if fleet.throttle is not None and not fleet.throttle.allows:
            return self._refuse("throttle", now)
        if fleet.budget is not None and not fleet.budget.allows(now):
            return self._refuse("budget", now)
        return True

    def _refuse(self, reason: str, now: float, *, failover: bool = False) -> bool:
        """Count and announce a hedge (or failover) not sent, for ``reason``: ``budget``,
        ``throttle`` or ``no_replica``."""
        fleet = self._fleet
        fleet.counts.refused(reason, failover=failover)
        kind = EventKind.FAILOVER_REFUSED if failover else EventKind.HEDGE_REFUSED
        fleet.emit(HedgeEvent(kind, now, self._request_id, self._group, reason=reason))
        return False

    # -- what happened -----------------------------------------------------------------------

    def attempt_changed(self, source: Source, record: AttemptRecord) -> None:
        fleet = self._fleet
        replica = self._by_source[id(source)]
        now = trio.current_time()
        outcome = record.outcome
        kind: EventKind
        if outcome is AttemptOutcome.RUNNING:
            kind = EventKind.ATTEMPT_STARTED
            self._start(replica, record, now)
        elif outcome is AttemptOutcome.WON:
            kind = EventKind.COMMITTED
            self._won(replica, record, now)
        elif outcome is AttemptOutcome.FAILED:
            kind = EventKind.ATTEMPT_FAILED
            self._end(record.number)
            if record.error is not None:
                self._failed(replica, record.error, now)
        elif outcome is AttemptOutcome.CANCELLED or outcome is AttemptOutcome.TIMEOUT:
            # Lost, cancelled by the caller, or stopped by first_token_timeout: no blame here
            # (a hedged attempt that lost was blamed at the commit), a censored sample.
            kind = EventKind.ATTEMPT_CANCELLED
            self._end(record.number)
            if (
                record.ttft is None
                and record.started_at is not None
                and record.ended_at is not None
            ):
                self._censored(replica, record, record.ended_at - record.started_at, now)
        else:  # pragma: no cover - the race reports no other outcome
            return
        fleet.emit(
            HedgeEvent(kind, now, self._request_id, self._group, replica.name, record=record)
        )

    def _censored(
        self, replica: ReplicaState, record: AttemptRecord, ran: float, now: float
    ) -> None:
        """An attempt cancelled after ``ran`` seconds without a first token: its TTFT is at
        least that (right-censored) for the delay learner and for its replica's latency; and
        its server may still be prefilling it (llama.cpp notices a disconnect only when the
        prefill ends): it counts as in flight there until the prefill model's median for its
        size has passed since it started."""
        fleet = self._fleet
        tokens = self._tokens
        model = fleet.model
        if model is not None:
            model.observe(
                self._group, self._class, now, ran, False, tokens, replica.name, record.number
            )
            fit = model.fit(self._group, now)
            if fit is not None:
                x = model.tokens_of(self._class) if tokens is None else tokens
                expected = fit.median(x)
                if expected > ran:
                    lingering = replica.lingering
                    if len(lingering) < _MAX_LINGERING:
                        lingering.append((now - ran + expected, now - ran))
        if fleet.config.pick == "peak_ewma":
            excess = ran - fleet.prefill(self._group, tokens, now)
            replica.observe_latency(now, max(excess, 0.0), fleet.config.latency_decay)

    def _start(self, replica: ReplicaState, record: AttemptRecord, now: float) -> None:
        fleet = self._fleet
        counts = fleet.counts
        self._started += 1
        self._used[replica.index] += 1
        self._running[record.number] = replica
        replica.waiting[(self, record.number)] = now
        replica.in_flight += 1
        replica.attempts += 1
        counts.attempts += 1
        counts.prompt_sent += self._tokens or 0
        if record.number == 1:
            counts.requests += 1
            if fleet.budget is not None:
                fleet.budget.request(now)
        if record.trigger == "hedge":
            counts.hedges_sent += 1
            if fleet.budget is not None:
                fleet.budget.spend(now)  # spent now it really started, not when checked
            # The attempt before had no first token within the hedge delay. Whether that
            # makes it slow is known only at the end: only if another attempt wins.
            if record.number - 1 in self._running:
                if self._hedged_over is None:
                    self._hedged_over = []
                self._hedged_over.append(record.number - 1)
        elif record.trigger == "failover":
            counts.failovers += 1

    def _won(self, replica: ReplicaState, record: AttemptRecord, now: float) -> None:
        fleet = self._fleet
        self._winner = replica
        replica.success()
        if fleet.throttle is not None:
            fleet.throttle.success()
        replica.waiting.pop((self, record.number), None)
        if record.ttft is not None:  # None: an empty answer won, with no token to time
            model = fleet.model
            if model is not None:
                model.observe(
                    self._group,
                    self._class,
                    now,
                    record.ttft,
                    True,
                    self._tokens,
                    replica.name,
                    record.number,
                )
            if fleet.config.pick == "peak_ewma":
                excess = record.ttft - fleet.prefill(self._group, self._tokens, now)
                replica.observe_latency(now, max(excess, 0.0), fleet.config.latency_decay)
            if record.started_at is not None:
                fleet.ttfts.append((now, record.started_at + record.ttft))
        if record.trigger == "hedge":
            fleet.counts.backup_wins += 1
        hedged_over, self._hedged_over = self._hedged_over, None
        outlier = fleet.config.outlier_detection
        if hedged_over is not None and outlier is not None and outlier.count_slow:
            for number in hedged_over:
                slow = self._running.get(number)  # still running: it loses now
                if number != record.number and slow is not None:
                    fleet.health_failure(slow, now, "slow", self._request_id, self._group)

    def _end(self, number: int) -> None:
        replica = self._running.pop(number, None)
        if replica is not None:
            replica.in_flight -= 1
            replica.waiting.pop((self, number), None)

    def _failed(self, replica: ReplicaState, error: AttemptError, now: float) -> None:
        fleet = self._fleet
        if error.retry_after is not None and error.retry_after > 0:
            replica.push_back(now, error.retry_after)
            fleet.emit(
                HedgeEvent(
                    EventKind.REPLICA_COOLING,
                    now,
                    self._request_id,
                    self._group,
                    replica.name,
                    reason=error.kind.value,
                    until=replica.cooling_until,
                )
            )
        fault = error.replica_fault
        if counts_against_replica(error):
            fleet.health_failure(
                replica, now, error.kind.value, self._request_id, self._group, at_once=fault
            )
        index = replica.index
        if fault:
            self._used[index] = self._per_replica  # misconfigured: not again in this request
        elif self._used[index] < self._per_replica and fleet.config.backoff is not None:
            # It may be tried again by this request: not before its back-off has passed.
            backoff = fleet.config.backoff
            repeat = self._used[index]
            draw = jitter_draw(self._request_id, replica.name, repeat) if backoff.jitter else 1.0
            if self._retry_at is None:
                self._retry_at = {}
            self._retry_at[index] = now + backoff_delay(repeat, backoff, draw)
        if error.retryable and fleet.throttle is not None:
            fleet.throttle.failure()

    def request_finished(self, report: Report) -> None:
        if self._finished:
            return
        self._finished = True
        fleet = self._fleet
        counts = fleet.counts
        for number, replica in self._running.items():
            replica.in_flight -= 1
            replica.waiting.pop((self, number), None)
        self._running.clear()
        now = trio.current_time()
        if not report.attempts:
            if isinstance(report.error, ReplicasCooling):
                counts.refused_requests += 1
                fleet.emit(
                    HedgeEvent(
                        EventKind.REQUEST_FINISHED,
                        now,
                        self._request_id,
                        self._group,
                        report=report,
                    )
                )
            return  # else cancelled before anything was sent (e.g. while every replica cooled)
        counts.finished += 1
        if report.error is not None:
            counts.failed += 1
        error = report.error
        if (
            isinstance(error, StreamInterrupted)
            and self._winner is not None
            and counts_against_replica(error.error)
        ):
            # The winner failed after commit (a stall, a cut): its replica's health suffers.
            fleet.health_failure(
                self._winner, now, error.error.kind.value, self._request_id, self._group
            )
        counts.wasted += report.wasted_tokens
        counts.prompt_resent += report.prompt_tokens_resent or 0
        fleet.emit(
            HedgeEvent(
                EventKind.REQUEST_FINISHED, now, self._request_id, self._group, report=report
            )
        )
