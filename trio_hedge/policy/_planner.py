"""One request's decisions for a [`Hedger`][trio_hedge.Hedger]: the
[`Planner`][trio_hedge.policy.Planner] the race consults, over the
``FleetState`` every request shares.

* **where an attempt goes** -- asked of ``_routing.py`` (a replica this request has not
  tried yet before one it has, none cooling, ejected or in this request's back-off, then the
  fleet's pick) with this request's state; the planner waits, within the bound
  ``_timing.py`` gives (``max_pushback_wait``, ``first_token_timeout``), when every replica
  is cooling or backing off, and binds the replica chosen;
* **when to hedge** -- this request's own delay, else the fleet's, asked of ``_timing.py``
  (learned or fixed for its group and size class; at once when another attempt on the same
  replica has waited twice that, or on the load probes' evidence); the planner records the
  fleet's delay for each attempt and which a cold learner gave;
* **whether a hedge or failover may go** -- the budget and the throttle, checked at the
  moment (``_timing.py``); the planner counts and announces a refusal;
* **what happened** -- each attempt's start, first token, failure, cancellation or break
  after the commit, and the request's end, goes into the request's evidence
  (``_evidence.py``); the judge (``_judge.py``) turns it into verdicts, and the fleet's one
  writer (``_writer.py``) applies them. This module keeps no rule about blame: it records,
  asks and announces.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import trio

from .._hooks import Scopes
from .._source import Source
from ..errors import AttemptError, ReplicasCooling
from ..events import EventKind, HedgeEvent
from ..report import AttemptOutcome, AttemptRecord, Report
from ..sources._bindable import BindableReplica
from . import _recovery_limits, _routing, _timing
from ._blame import outgrew
from ._evidence import AttemptEvidence, Evidence, Outcome, Phase
from ._fleet import FleetState
from ._health import ReplicaState
from ._judge import (
    QUERY_OF_DEATH_WINDOW,
    Effect,
    Event,
    Rules,
    Verdict,
    judge,
    recoverable,
    stated_window,
    transient,
)
from ._judge import EventKind as Happened
from ._writer import Applied, FleetWriter, Request

__all__ = ["RequestPlanner"]

#: Keys of requests unique across Hedgers: the attempts a shared load probe counts.
_PROBE_KEYS = itertools.count(1)


class RequestPlanner:
    """The [`Planner`][trio_hedge.policy.Planner] of one request of a Hedger, over the fleet
    state every request shares. ``bind`` makes this request's source for a replica (the
    Hedger binds an HTTP replica to the request and its client); the planner decides where
    and when, never how."""

    __slots__ = (
        "_at_once",
        "_began",
        "_bound",
        "_by_source",
        "_class",
        "_cold",
        "_evidence",
        "_finished",
        "_fleet",
        "_fleet_delays",
        "_group",
        "_hedge_after",
        "_hedgeable",
        "_key",
        "_make_source",
        "_max_attempts",
        "_model",
        "_need",
        "_outgrown",
        "_per_replica",
        "_priority",
        "_probe_key",
        "_replicas",
        "_request",
        "_request_id",
        "_retried",
        "_retries",
        "_retry_at",
        "_rules",
        "_running",
        "_saturated",
        "_scopes",
        "_serial",
        "_started",
        "_tokens",
        "_used",
        "_writer",
    )

    def __init__(
        self,
        fleet: FleetState,
        bind: Callable[[BindableReplica | Source], Source],
        *,
        writer: FleetWriter | None = None,
        rules: Rules | None = None,
        replicas: Sequence[BindableReplica | Source] | None = None,
        affinities: tuple[str, ...] = (),
        tokens_exact: bool = False,
        request_id: str,
        group: str,
        size_class: int,
        tokens: int | None,
        hedgeable: bool,
        hedge_after: float | None = None,
        model: str | None = None,
        context_tokens: int | None = None,
        priority: int = 0,
    ) -> None:
        self._fleet = fleet
        self._priority = priority  # its class for the hedge budget (_budget: priority_reserve)
        self._writer = FleetWriter(fleet) if writer is None else writer
        self._rules = rules_of(fleet) if rules is None else rules
        self._make_source = bind
        # What each of the fleet's replicas is for this request's Hedger (another API's
        # replica of the same server, when Hedgers share a fleet).
        self._replicas = [r.source for r in fleet.replicas] if replicas is None else list(replicas)
        self._request_id = request_id
        self._serial = fleet.next_serial()  # this request, whatever its id
        # This request among every Hedger's sharing a load probe (a LoadMonitor).
        self._probe_key = next(_PROBE_KEYS)
        self._group = group
        self._model = group if model is None else model  # what per-model state is kept by
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
        self._fleet_delays: dict[int, float | None] | None = None  # attempt -> fleet's delay
        self._scopes: Scopes = {}  # the hooks' context managers open for this request's attempts
        self._key = object()  # HedgeEvent.request_key: this request, whatever its id
        self._started = 0
        # What this request saw (the judge reads it), and the failovers (or recoveries) the
        # throttle allowed at the failure (or break) that caused each, oldest first.
        self._evidence = Evidence(
            model=self._model,
            group=group,
            size_class=size_class,
            tokens=tokens,
            tokens_exact=tokens_exact,
            need=context_tokens,
            affinities=affinities,
        )
        self._retries: deque[bool] | None = None
        # What the writer needs of this request.
        self._request = Request(self._model, group, size_class, tokens)
        self._finished = False
        # The context window the request needs (estimated prompt plus max_tokens), and whether
        # a replica answered it a context-length error (then only a declared larger window).
        self._need = context_tokens
        self._outgrown = False
        self._retried: set[int] | None = None  # peers given one more try before a fallback
        # Load probes: a refusal on the engines' evidence; attempts hedged at once on it.
        self._saturated = False
        self._at_once: set[int] | None = None
        # Attempts whose delay a cold learner gave (looked at again as samples arrive).
        self._cold: set[int] | None = None

    # -- where -------------------------------------------------------------------------------

    def _candidates(self) -> list[ReplicaState]:
        if self._max_attempts is not None and self._started >= self._max_attempts:
            return []
        return _routing.candidates(
            self._fleet, self._model, self._used, self._per_replica, self._need, self._outgrown
        )

    def fails_over(self, error: AttemptError) -> bool:
        """Whether a request-fault ``error`` may still fail over: a context-length error,
        while a replica that declares a larger window is left (the race asks)."""
        return outgrew(error) and bool(self._candidates())

    def _choose(
        self,
        candidates: list[ReplicaState],
        now: float,
        deadline: float,
        *,
        primary: bool,
        hedge: bool = False,
    ) -> tuple[ReplicaState | None, float, float]:
        """``(replica, wait_until, beyond)`` for this request's next attempt (`_routing.choose`);
        the load probes' saturation it reports is counted when the refusal is (`_refuse`)."""
        chosen, wait_until, beyond, saturated = _routing.choose(
            self._fleet, candidates, now, deadline, primary=primary, hedge=hedge,
            model=self._model, group=self._group, used=self._used, retry_at=self._retry_at,
            running=self._running, owner=self, probe_key=self._probe_key, tokens=self._tokens,
        )  # fmt: skip
        if saturated:
            self._saturated = True
        return chosen, wait_until, beyond

    def _bind(self, replica: ReplicaState) -> Source:
        source = self._bound.get(replica.index)
        if source is None:
            source = self._make_source(self._replicas[replica.index])
            self._bound[replica.index] = source
            self._by_source[id(source)] = replica
        return source

    async def next_source(self, number: int, trigger: str) -> Source | None:
        fleet = self._fleet
        primary = number == 1
        # A recovery after the commit goes as a failover does (throttle, ejection, the plan).
        # The throttle decided at the failure (or break) that causes it (gRFC A6's check, at
        # the failure: a scheduler batch later, other requests' failures had emptied it).
        retry = trigger == "failover" or trigger == "recovery"
        if retry:
            retries = self._retries
            allowed = retries.popleft() if retries else _timing.retry_allowed(fleet)
            if not allowed:
                # gRFC A6: at or below half the tokens, no retries either (a primary always
                # goes).
                if self._candidates():
                    self._refuse("throttle", trio.current_time(), failover=True)
                return None
        start = trio.current_time()
        if self._began is None:
            self._began = start  # the race begins with its primary
            self._evidence.began = start
        deadline = _timing.wait_deadline(fleet.config, start, self._began, trigger == "recovery")
        while True:
            candidates = self._candidates()
            if not candidates:
                return None  # the plan is used up: not a refusal
            now = trio.current_time()
            chosen, wait_until, beyond = self._choose(
                candidates, now, deadline, primary=primary, hedge=trigger == "hedge"
            )
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

    # -- when, and whether a backup may go: asked of _timing.py --------------------------------

    def hedge_delay(self, number: int) -> float | None:
        if not self._hedgeable:
            return None
        delay, cold = self._fleet_delay(number, trio.current_time())
        # What the fleet would have waited: an attempt hedged sooner (the caller's own
        # shorter delay) is not slow for losing (_blame.is_slow).
        self._record_fleet_delay(number, delay)
        if self._hedge_after is None and cold and delay:
            if self._cold is None:
                self._cold = set()
            self._cold.add(number)  # looked at again as the fleet's first samples arrive
        if self._hedge_after is not None:
            delay = self._hedge_after  # the caller's own delay for this request, as given
        assert delay is not None  # hedgeable without a delay of its own
        if delay > 0 and self._fleet.probed and self._slow_on_evidence(number, delay):
            self._mark_at_once(number)
            return 0.0
        return delay

    def hedge_on_evidence(self, number: int) -> float | None:
        """Asked by the race while it waits out attempt ``number``'s hedge delay: ``0.0``, the
        backup goes now (`_slow_on_evidence`, or a cold learner's delay has passed since);
        otherwise the seconds until it asks again, or ``None``: `_timing.recheck_after`."""
        fleet = self._fleet
        cold = self._cold is not None and number in self._cold
        if not (fleet.probed or cold) or not self._hedgeable:
            return None
        delay = (self._fleet_delays or {}).get(number)
        if self._hedge_after is not None:
            delay = self._hedge_after
        if delay is None or delay <= 0:
            return None
        if cold and self._cold_delay_passed(number):
            return 0.0
        if fleet.probed and self._slow_on_evidence(number, delay):
            self._mark_at_once(number)
            return 0.0
        return _timing.recheck_after(fleet, self._cold is not None and number in self._cold)

    def _fleet_delay(self, number: int, now: float) -> tuple[float | None, bool]:
        """``(delay, cold)`` of attempt ``number`` (`_timing.fleet_delay`)."""
        return _timing.fleet_delay(
            self._fleet, self._group, self._class, self._tokens, self._running.get(number),
            self, number, now,
        )  # fmt: skip

    def _record_fleet_delay(self, number: int, delay: float | None) -> None:
        if self._fleet_delays is None:
            self._fleet_delays = {}
        self._fleet_delays[number] = delay
        attempt = self._evidence.attempts.get(number)
        if attempt is not None:
            attempt.fleet_delay = delay

    def _cold_delay_passed(self, number: int) -> bool:
        """Whether attempt ``number``, hedged at a cold learner's delay, has waited the delay
        the learner gives now, with the samples that arrived since (`LearnedDelay`'s cold
        rule): then its backup goes now, and that delay is the fleet's for it (what blames a
        loser). Once the learner is no longer cold for it, it is not looked at again."""
        replica = self._running.get(number)
        started = None if replica is None else replica.waiting.get((self, number))
        assert self._cold is not None
        if started is None:
            self._cold.discard(number)
            return False
        now = trio.current_time()
        fresh, cold = self._fleet_delay(number, now)
        if not cold:
            self._cold.discard(number)
        if fresh is None or now - started < fresh:
            return False
        self._record_fleet_delay(number, fresh)
        self._cold.discard(number)
        return True

    def _mark_at_once(self, number: int) -> None:
        """Attempt ``number``'s backup goes before its delay, on the engine's evidence."""
        if self._at_once is None:
            self._at_once = set()
        self._at_once.add(number)

    def _slow_on_evidence(self, number: int, delay: float) -> bool:
        """Whether attempt ``number``'s backup goes at once, before ``delay``: its replica's
        engine is predicted to keep it longer (`_timing.predicted_past`), a replica a backup
        may go to is predicted sooner, and nothing would refuse the backup now."""
        replica = self._running.get(number)
        now = trio.current_time()
        if replica is None or not _timing.predicted_past(
            self._fleet, self, number, replica, delay, now, self._group, self._probe_key,
            self._tokens,
        ):  # fmt: skip
            return False
        candidates = self._candidates()
        if not candidates:
            return False
        saturated = self._saturated
        chosen = self._choose(candidates, now, now, primary=False, hedge=True)[0]
        self._saturated = saturated  # a check, not a refusal
        # A backup the budget or throttle would refuse now is left to the timer (asked
        # again there): refused early, it would have cost the request the hedge the timer
        # may still be allowed to send.
        return chosen is not None and self._refusal(now) is None

    def _refusal(self, now: float) -> str | None:
        return _timing.refusal(
            self._fleet, now, self._priority, self._hedge_after, self._fleet_delays,
            self._running, self,
        )  # fmt: skip

    def may_hedge(self) -> bool:
        """Whether a backup may go now. Only checks: the budget is spent when it starts."""
        candidates = self._candidates()
        if not candidates:
            return True  # nothing left to send: next_source ends the plan; not a refusal
        now = trio.current_time()
        if self._choose(candidates, now, now, primary=False, hedge=True)[0] is None:
            # Ejected, cooling or backing off; or (load probes) none predicted sooner.
            return self._refuse("no_replica", now)
        refusal = self._refusal(now)
        return True if refusal is None else self._refuse(refusal, now)

    def _refuse(self, reason: str, now: float, *, failover: bool = False) -> bool:
        """Count and announce a hedge (or failover) not sent, for ``reason``: ``budget``,
        ``priority``, ``throttle`` or ``no_replica``. A refused hedge is evidence too: the
        attempt it would have backed up had nowhere to hedge (``_judge``: "unhedgeable")."""
        saturated, self._saturated = self._saturated, False
        self._writer.refused(reason, failover=failover, saturated=saturated)
        if not failover:
            for number in self._running:
                attempt = self._evidence.attempts[number]
                if attempt.phase is _PHASE_RACE and attempt.refused is None:
                    attempt.refused = reason
        kind = EventKind.FAILOVER_REFUSED if failover else EventKind.HEDGE_REFUSED
        self._emit(kind, now, reason=reason)
        return False

    def _emit(self, kind: EventKind, now: float, replica: str | None = None, **fields: Any) -> None:
        fleet = self._fleet
        if fleet.on_event or self._scopes:  # (contexts still open are exited at their end)
            event = HedgeEvent(
                kind,
                now,
                self._request_id,
                self._group,
                replica,
                request_key=self._key,
                **fields,
            )
            fleet.emit(event, self._scopes)

    # -- the recovery phase (after the commit): its limits, asked of _recovery_limits.py -----

    def recovery_deadline(self, source: Source, added_tokens: int) -> float:
        """Seconds a recovery attempt on ``source`` may take to its first output before it is
        abandoned (``RecoveryPolicy.deadline`` of the TTFT the fleet expects of that replica
        for this model and the recovery's prompt: this request's plus ``added_tokens``)."""
        tokens = _recovery_limits.recovery_tokens(self._tokens, added_tokens)
        return _recovery_limits.deadline(
            self._fleet, self._by_source[id(source)], self._group, self._class, tokens,
            trio.current_time(),
        )  # fmt: skip

    def recovery_hedge_delay(self, source: Source, added_tokens: int) -> float | None:
        """Seconds after a recovery attempt on ``source`` starts before a second recovery may
        go as a hedge: this request's own ``hedge_after``, else the fleet's delay for the
        recovery's prompt size; ``None`` when this request may not be hedged or
        ``RecoveryPolicy.hedge`` is off (``may_hedge`` is asked then, as for any hedge)."""
        if not self._hedgeable or not self._fleet.config.recovery.hedge:
            return None
        if self._hedge_after is not None:
            return self._hedge_after
        tokens = _recovery_limits.recovery_tokens(self._tokens, added_tokens)
        return _recovery_limits.size_delay(
            self._fleet, self._group, self._class, tokens, trio.current_time()
        )

    def throughput_floor(self, source: Source) -> tuple[float, int | None] | None:
        """``(window, tokens)`` for a winner on ``source`` (``RecoveryPolicy.throughput_floor``
        against the rate its replica learned for this model; ``tokens`` ``None`` while too
        little is learned: the stream is timed, to learn, and not judged: no evidence is
        never a reason to cut a stream), or ``None``: no floor, no timing."""
        replica = self._by_source.get(id(source))
        return _recovery_limits.throughput_floor(self._fleet, replica, self._model)

    # -- what happened -----------------------------------------------------------------------

    def attempt_changed(self, source: Source, record: AttemptRecord) -> None:
        replica = self._by_source[id(source)]
        now = trio.current_time()
        outcome = record.outcome
        number = record.number
        kind: EventKind
        if record.recovery is not None:
            # The recovery's own evidence (its deadline, first output, whether hedged).
            attempt = self._evidence.attempts.get(number)
            if attempt is not None:
                attempt.recovery = record.recovery
        if outcome is _ATTEMPTOUTCOME_RUNNING:
            kind = EventKind.ATTEMPT_STARTED
            self._start(replica, record, now)
        elif outcome is _ATTEMPTOUTCOME_WON:
            kind = EventKind.COMMITTED
            self._won(replica, record, now)
        elif outcome is _ATTEMPTOUTCOME_FAILED:
            kind = EventKind.ATTEMPT_FAILED
            attempt = self._ended(number, now)
            if record.error is not None:
                self._failed(replica, attempt, record.error, now)
        elif outcome is _ATTEMPTOUTCOME_CANCELLED or outcome is _ATTEMPTOUTCOME_TIMEOUT:
            kind = EventKind.ATTEMPT_CANCELLED
            attempt = self._ended(number, now)
            self._cancelled(replica, attempt, outcome, now)
        else:  # pragma: no cover - the race reports no other outcome
            return
        self._emit(kind, now, replica.name, record=record)

    def _verdicts(self, event: Event, now: float) -> None:
        """Judge ``event`` on this request's evidence, have the writer apply the verdicts,
        announce what changed, and note what the request's evidence must remember."""
        verdicts = judge(self._rules, self._evidence, event)
        applied = self._writer.apply(verdicts, now, self._request)
        if applied is None:
            return
        for verdict in verdicts:
            if verdict.effect._name_ in _REMEMBERED:
                self._remember(verdict, applied)
        for replica, until, reason, model in applied.ejected:
            self._emit(
                EventKind.REPLICA_EJECTED, now, replica.name, reason=reason, until=until,
                model=model,
            )  # fmt: skip
        for replica, until, reason, model in applied.cooled:
            self._emit(
                EventKind.REPLICA_COOLING, now, replica.name, reason=reason, until=until,
                model=model,
            )  # fmt: skip

    def _remember(self, verdict: Verdict, applied: Applied) -> None:
        evidence = self._evidence
        effect = verdict.effect
        if effect is _EFFECT_CREDIT:
            evidence.asked_credit = True
            evidence.credit = applied.credit is True
        elif effect is _EFFECT_DEBIT and not evidence.asked_credit:  # pragma: no cover
            evidence.asked_credit = True
        elif effect is _EFFECT_CREDIT_RELEASED or effect is _EFFECT_CREDIT_DEBITED:
            evidence.credit = False
        elif effect is _EFFECT_REFUND:
            evidence.taken = 0
        if effect is _EFFECT_CREDIT or effect is _EFFECT_DEBIT:
            evidence.taken += applied.taken
            applied.taken = 0  # (counted once, whichever verdict took it)

    def _start(self, replica: ReplicaState, record: AttemptRecord, now: float) -> None:
        number = record.number
        self._started += 1
        self._used[replica.index] += 1
        self._running[number] = replica
        recovery = record.trigger == "recovery"
        evidence = self._evidence
        evidence.attempts[number] = AttemptEvidence(
            number=number,
            replica=replica.index,
            name=replica.name,
            trigger=record.trigger,
            started=now,
            phase=_PHASE_RECOVERY if recovery else _PHASE_RACE,
            recovery=record.recovery,
        )
        at_once = self._at_once is not None and number - 1 in self._at_once
        if record.trigger == "hedge":
            # The attempt before had no first token by now: a backup was sent for it.
            before = evidence.attempts.get(number - 1)
            if before is not None and before.outcome is _OUTCOME_RUNNING:
                before.hedged_after = now - before.started
        self._writer.started(
            replica,
            (self, number),
            number,
            record.trigger,
            now,
            tokens=self._tokens,
            probe_key=self._probe_key,
            at_once=record.trigger == "hedge" and at_once,
            priority=self._priority,
            recovery_hedge=record.recovery is not None and record.recovery.hedged,
        )

    def _ended(self, number: int, now: float) -> AttemptEvidence:
        replica = self._running.pop(number, None)
        if replica is not None:
            self._writer.ended(replica, (self, number))
        attempt = self._evidence.attempts[number]
        attempt.ended = now
        return attempt

    def _won(self, replica: ReplicaState, record: AttemptRecord, now: float) -> None:
        evidence = self._evidence
        number = record.number
        attempt = evidence.attempts[number]
        attempt.outcome = _OUTCOME_WON
        attempt.ttft = ttft = record.ttft
        evidence.winner = number
        started = record.started_at
        seen = (
            None
            if ttft is None or started is None or record.trigger == "recovery"
            else started + ttft
        )
        self._writer.committed(
            replica, (self, number), now, hedge=record.trigger == "hedge", first_token=seen
        )
        self._verdicts(Event(_HAPPENED_COMMITTED, number), now)

    def _failed(
        self, replica: ReplicaState, attempt: AttemptEvidence, error: AttemptError, now: float
    ) -> None:
        attempt.outcome = _OUTCOME_FAILED
        attempt.error = error
        self._evidence.failures += 1
        if outgrew(error):
            self._outgrew(replica, error)
        self._verdicts(Event(_HAPPENED_FAILED, attempt.number), now)
        # The failover this failure causes is decided now, at the failure.
        self._decide_retry(clear=False)
        index = replica.index
        fleet = self._fleet
        if not error.repeatable:
            # It would answer the same, or said x-should-retry: false: not again.
            self._used[index] = self._per_replica
        elif self._used[index] < self._per_replica and fleet.config.backoff is not None:
            # It may be tried again by this request: not before its back-off has passed.
            if self._retry_at is None:
                self._retry_at = {}
            self._retry_at[index] = _timing.backoff_until(
                fleet.config.backoff, self._request_id, replica.name, self._used[index],
                self._serial, now,
            )  # fmt: skip
        if transient(self._rules, error):
            self._retry_before_falling_back(replica, error)

    def _retry_before_falling_back(self, replica: ReplicaState, error: AttemptError) -> None:
        """A peer that answered a single 500, or pushback of at most ``fallback_wait``
        seconds, is tried once more (after its ``Retry-After``) before a fallback, when only
        fallbacks are left: LiteLLM's users expect the preferred model to be retried first.
        The report says which happened: the next attempt's replica."""
        if replica.fallback or not self._fleet.has_fallback:
            return
        index, used, limit = replica.index, self._used, self._per_replica
        if used[index] < limit or (self._retried is not None and index in self._retried):
            return
        wait = self._fleet.config.fallback_wait
        short = error.retry_after is not None and 0 < error.retry_after <= wait
        if not (error.status_code == 500 or short):
            return
        if any(not r.fallback and used[r.index] < limit for r in self._fleet.replicas):
            return  # another peer goes first
        if self._retried is None:
            self._retried = set()
        self._retried.add(index)
        used[index] -= 1

    def _outgrew(self, replica: ReplicaState, error: AttemptError) -> None:
        """``replica`` answered that the request does not fit its window: from now on this
        request needs more than that window (the one the error states, else its declared
        one): only a replica that says it has room is tried. (The fleet learns the window
        from a stated size only: the judge's "context" rule.)"""
        self._outgrown = True
        window = stated_window(error) or replica.context_window or 0
        self._need = max(self._need or 0, window + 1)

    def _cancelled(
        self,
        replica: ReplicaState,
        attempt: AttemptEvidence,
        outcome: AttemptOutcome,
        now: float,
    ) -> None:
        """Lost, cancelled by the caller, or stopped by first_token_timeout."""
        recovery = attempt.phase is _PHASE_RECOVERY
        lost = self._evidence.winner is not None and not recovery
        if outcome is _ATTEMPTOUTCOME_TIMEOUT:
            attempt.outcome = _OUTCOME_TIMEOUT
        else:
            attempt.outcome = _OUTCOME_LOST if lost else _OUTCOME_CANCELLED
        expected = None
        ran = now - attempt.started
        fleet = self._fleet
        if attempt.ttft is None and not recovery:
            if attempt.fleet_delay is None:
                # Never asked (a request that may not hedge): what the fleet would have
                # waited, for whether a caller's cancel is a sample.
                attempt.fleet_delay = self._fleet_delay(attempt.number, now)[0]
            model = fleet.model
            fit = None if model is None else model.fit(self._group, now)
            if fit is not None:
                assert model is not None
                x = model.tokens_of(self._class) if self._tokens is None else self._tokens
                expected = fit.median(x)
        if attempt.ttft is None:
            self._writer.cancelled(replica, now, lost=lost, ran=ran, expected=expected)
        self._verdicts(Event(_HAPPENED_CANCELLED, attempt.number), now)

    def winner_broke(self, error: AttemptError) -> bool:
        """The winner failed after the commit (a cut, a stall, a malformed event, an in-band
        error): judged now, at the break (one failure for its replica, its throttle token),
        and the recovery's throttle decided now too. Returns whether a recovery may be tried
        at all: not when the error is the request's own fault, which would fail the same way
        anywhere (``_judge``: "after-commit-request")."""
        evidence = self._evidence
        number = evidence.winner
        now = trio.current_time()
        if number is None:  # pragma: no cover - the stream breaks only after a commit
            return False
        attempt = evidence.attempts[number]
        attempt.outcome = _OUTCOME_BROKE
        attempt.error = error
        attempt.ended = now
        evidence.breaks += 1
        self._verdicts(Event(_HAPPENED_BROKE, number), now)
        self._decide_retry(clear=True)
        return recoverable(self._rules, error)

    def _read_on(self, report: Report) -> None:
        """A winner the throughput floor found slow that no recovery took over was read on to
        its end: it served the request after all (its evidence says so, for "served"). Its
        record says so: a winner that broke keeps its error there, a slow one read on not."""
        number = self._evidence.winner
        if number is None:
            return
        attempt = self._evidence.attempts[number]
        if attempt.outcome is not _OUTCOME_BROKE:
            return
        for record in report.attempts:
            if record.number == number:
                if record.outcome is _ATTEMPTOUTCOME_WON and record.error is None:
                    attempt.outcome = _OUTCOME_WON
                    attempt.error = None
                return

    def _decide_retry(self, *, clear: bool) -> None:
        """The throttle's word, now, on the failover (or recovery) a failure (or break)
        causes; ``next_source`` takes it when that attempt is asked for."""
        if self._retries is None:
            self._retries = deque()
        elif clear:
            self._retries.clear()
        self._retries.append(_timing.retry_allowed(self._fleet))

    def request_finished(self, report: Report) -> None:
        if self._finished:
            return
        self._finished = True
        writer = self._writer
        for number, replica in self._running.items():
            writer.ended(replica, (self, number))
        self._running.clear()
        now = trio.current_time()
        refused = isinstance(report.error, ReplicasCooling)
        if not writer.finished(report, refused_request=refused):
            if refused:
                self._emit(EventKind.REQUEST_FINISHED, now, report=report)
            return  # else cancelled before anything was sent (e.g. while every replica cooled)
        self._read_on(report)
        self._evidence.completed = report.completed
        # The replicas that served another request lately, and no 500 since: a request every
        # replica answered 500 while the fleet served others is a query of death (the
        # judge's rule); a fleet that began to fail whole served others only before.
        served: frozenset[int] = frozenset()
        evidence = self._evidence
        if not evidence.answered:
            since = now - QUERY_OF_DEATH_WINDOW
            # Its own first tokens are no evidence of others served (a query of death may
            # crash the decode, after the commit).
            own = {a.replica for a in evidence.attempts.values() if a.ttft is not None}
            served = frozenset(
                r.index
                for r in self._fleet.replicas
                if r.last_commit >= since
                and r.last_commit > r.last_server_error
                and r.index not in own
            )
        self._verdicts(Event(_HAPPENED_FINISHED, served_since=served), now)
        writer.streamed(report, self._model)
        self._emit(EventKind.REQUEST_FINISHED, now, report=report)


#: The verdicts whose outcome the request's evidence keeps (the throttle's credit and tokens).
_REMEMBERED = frozenset(
    e._name_
    for e in (
        Effect.CREDIT,
        Effect.DEBIT,
        Effect.CREDIT_RELEASED,
        Effect.CREDIT_DEBITED,
        Effect.REFUND,
    )
)


def rules_of(fleet: FleetState) -> Rules:
    """The judge's rules from a Hedger's configuration."""
    config = fleet.config
    outlier = config.outlier_detection
    return Rules(
        attribution=config.attribution,
        count_slow=outlier is not None and outlier.count_slow,
        max_pushback_wait=config.max_pushback_wait,
        rate_limit_cooldown=config.rate_limit_cooldown,
        max_ejection=300.0 if outlier is None else outlier.max_ejection,
    )


# Enum members read on every request's path, as module constants: loading one is about
# ten times faster than the class attribute (EnumType resolves it on each access).
_ATTEMPTOUTCOME_CANCELLED = AttemptOutcome.CANCELLED
_ATTEMPTOUTCOME_FAILED = AttemptOutcome.FAILED
_ATTEMPTOUTCOME_RUNNING = AttemptOutcome.RUNNING
_ATTEMPTOUTCOME_TIMEOUT = AttemptOutcome.TIMEOUT
_ATTEMPTOUTCOME_WON = AttemptOutcome.WON
_EFFECT_CREDIT = Effect.CREDIT
_EFFECT_CREDIT_DEBITED = Effect.CREDIT_DEBITED
_EFFECT_CREDIT_RELEASED = Effect.CREDIT_RELEASED
_EFFECT_DEBIT = Effect.DEBIT
_EFFECT_REFUND = Effect.REFUND
_HAPPENED_BROKE = Happened.BROKE
_HAPPENED_CANCELLED = Happened.CANCELLED
_HAPPENED_COMMITTED = Happened.COMMITTED
_HAPPENED_FAILED = Happened.FAILED
_HAPPENED_FINISHED = Happened.FINISHED
_OUTCOME_BROKE = Outcome.BROKE
_OUTCOME_CANCELLED = Outcome.CANCELLED
_OUTCOME_FAILED = Outcome.FAILED
_OUTCOME_LOST = Outcome.LOST
_OUTCOME_RUNNING = Outcome.RUNNING
_OUTCOME_TIMEOUT = Outcome.TIMEOUT
_OUTCOME_WON = Outcome.WON
_PHASE_RACE = Phase.RACE
_PHASE_RECOVERY = Phase.RECOVERY
