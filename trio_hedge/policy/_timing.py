"""When one request's backup goes, and whether a hedge or failover may go at the moment:
plain synchronous functions of the fleet (``_fleet.py``) and of what the request has done so
far (its group, size class and prompt, its running attempts, the fleet's delay for each),
returning the delay, or what would refuse. They decide and change nothing; the planner
(``_planner.py``) holds the request's state, records what they return and announces what it
refuses (httpcore's connection pool: decide on state, act after).

* `fleet_delay` -- the delay the fleet would hedge an attempt at: learned for the request's
  group and size class (no shorter than its own prompt's prefill while the class is not
  learned, `own_prefill`), or the fixed one; at once when another attempt on the same
  replica has waited twice that;
* `predicted_past` -- whether the engine's fresh reading (load probes) predicts an attempt
  waits longer than its delay: then its backup may go at once; `recheck_after`: when the
  race looks again (a new reading, or a cold learner's new samples);
* `wait_deadline` -- until when an attempt may wait for a replica that is cooling or backing
  off;
* `refusal` -- what would refuse a backup now: the throttle, the budget (a caller's `early`
  hedge draws on only part of it), or the share kept for higher priority classes;
  `retry_allowed` -- the throttle's word on a failover (or recovery); `backoff_until` --
  when a request may try a replica that failed it again.
"""

from __future__ import annotations

import math

from ._backoff import Backoff, backoff_delay, jitter_draw
from ._config import HedgerConfig
from ._fleet import FleetState
from ._health import ReplicaState
from ._routing import predicted_wait, prefill_model

__all__ = [
    "COLD_RECHECK",
    "backoff_until",
    "early",
    "fleet_delay",
    "own_prefill",
    "predicted_past",
    "recheck_after",
    "refusal",
    "retry_allowed",
    "wait_deadline",
]

#: Seconds between two looks at a cold learner's delay for an attempt that waits on it.
COLD_RECHECK = 0.05


def fleet_delay(
    fleet: FleetState,
    group: str,
    size_class: int,
    tokens: int | None,
    replica: ReplicaState | None,
    owner: object,
    number: int,
    now: float,
) -> tuple[float | None, bool]:
    """``(delay, cold)``: the delay the fleet would hedge attempt ``number`` of a request
    (``owner``, whose attempts ``replica.waiting`` keys as ``(owner, number)``) at, running
    on ``replica`` (``None``: not running), whatever delay the caller chose for the request
    (learned for ``group``, ``size_class`` and ``tokens``, or fixed; ``None``: never on
    time); and whether the learner gave it cold (`LearnedDelay`'s cold rule: the planner
    looks at it again as the fleet's first samples arrive)."""
    model = fleet.model
    cold = False
    if model is None:
        fixed = fleet.config.hedge_after
        assert fixed is None or isinstance(fixed, (int, float))
        if fixed is None:
            return None, False
        delay = float(fixed)
    else:
        delay, cold = model.estimate(group, size_class, now, tokens)
        delay = max(delay, own_prefill(fleet, group, size_class, tokens, replica, now))
    # The evidence the delay waits for may be in already: another attempt on this
    # attempt's replica has waited twice the delay for its first token (at the delay it
    # was hedged itself, and for another delay nothing answered): the replica is stuck
    # now, and the pick chose it anyway, so every replica it could choose looked as bad.
    # Then the backup goes at once, joining the other queue as early as a double send
    # would (budget and throttle still apply). At once the delay itself (a 1x
    # threshold) also fired on ordinary queueing: benchmarks/tail.py, 10.04% extra
    # against 9.72%, for the same P99.
    if replica is not None and fleet.config.pick == "peak_ewma":
        for key, started in replica.waiting.items():
            if key != (owner, number) and now - started >= 2.0 * delay:
                return 0.0, cold
            break  # the first is the oldest
    return delay, cold


def own_prefill(
    fleet: FleetState,
    group: str,
    size_class: int,
    tokens: int | None,
    replica: ReplicaState | None,
    now: float,
) -> float:
    """While the delay of ``size_class`` is not learned from its own data, the seconds a
    prompt of ``tokens`` takes to prefill at its probed ``replica``'s ``prefill_rate`` (0:
    not probed, no prompt size, not running, or the class learned, whose delay then accounts
    for it). A cold Hedger's fallback delay (1 s) hedged a 4,000-token prompt on
    llama-server, whose prefill takes ~3 s: the backup doubled the prefill on a replica
    another tenant was using (``benchmarks/real_engine.py --scenario evidence``). The
    prefill model is no guide here: fitted on short prompts only, it extrapolates their
    noise."""
    model = fleet.model
    if not fleet.probed or not tokens or replica is None or model is None:
        return 0.0
    state = fleet.probes[replica.index]
    if state is None or model.raw(group, size_class, now) is not None:
        return 0.0
    return tokens / state.probe.prefill_rate


def predicted_past(
    fleet: FleetState,
    owner: object,
    number: int,
    replica: ReplicaState,
    delay: float,
    now: float,
    group: str,
    probe_key: int,
    tokens: int | None,
) -> bool:
    """Whether the engine's fresh reading predicts the running attempt ``number`` (of
    ``owner``, on ``replica``; ``probe_key`` and ``tokens`` as for `predicted_wait`) waits
    longer than ``delay`` for its prefill: then its backup may go at once, instead of
    waiting for a timer the engine has answered (when a replica it may go to is predicted
    sooner and nothing refuses it: the planner asks). What the fleet would have waited
    stays what blames a loser (`_blame.is_slow`): a replica busy for other tenants is not
    slow for losing a race it was never given time for."""
    prefill = prefill_model(fleet, group, now)
    predicted = predicted_wait(fleet, owner, number, replica, now, prefill, probe_key, tokens)
    return predicted is not None and predicted > delay


def recheck_after(fleet: FleetState, cold: bool) -> float | None:
    """Seconds until the race asks again whether a backup may go before its delay: the
    probes' shortest interval (a new reading may have come), at most `COLD_RECHECK` while a
    ``cold`` learner's delay is looked at again; ``None``: never (neither). A prompt that
    arrived at the engine just after the primary was sent is seen at the next poll, not at
    the timer: on llama-server, a short request behind another tenant's 4,000-token prefill
    waits for all of it (``../shared/engine2/README.md``)."""
    if not fleet.probed:
        return COLD_RECHECK if cold else None
    return min(fleet.probe_interval, COLD_RECHECK) if cold else fleet.probe_interval


def wait_deadline(config: HedgerConfig, start: float, began: float, recovery: bool) -> float:
    """Until when an attempt asked for at ``start`` may wait for a replica that is cooling
    or backing off: ``max_pushback_wait`` (``inf``: no bound); nor past the race's
    ``first_token_timeout`` from when it ``began`` (no sooner than ``start``): a replica
    cooling beyond it could not give a first token in time, so it is not waited for (the
    caller's own scope just cancels the wait). A ``recovery``'s race, after the commit, has
    no such timeout."""
    wait = config.max_pushback_wait
    deadline = math.inf if wait is None else start + wait
    timeout = config.first_token_timeout
    if timeout is not None and not recovery:
        deadline = max(start, min(deadline, began + timeout))
    return deadline


def retry_allowed(fleet: FleetState) -> bool:
    """The throttle's word, now, on a failover (or recovery): gRFC A6, at or below half
    its tokens no retries (a primary always goes)."""
    throttle = fleet.throttle
    return throttle is None or throttle.allows


def backoff_until(
    backoff: Backoff, request_id: str, replica: str, repeat: int, serial: int, now: float
) -> float:
    """When a request (``request_id``, its ``serial`` in the fleet) may try ``replica`` again
    after its ``repeat``-th attempt there failed at ``now``: ``backoff``'s delay, jittered by
    a draw of the request, the replica and the repeat (the same for the same request:
    `jitter_draw`)."""
    draw = jitter_draw(request_id, replica, repeat, serial) if backoff.jitter else 1.0
    return now + backoff_delay(repeat, backoff, draw)


def refusal(
    fleet: FleetState,
    now: float,
    priority: int,
    hedge_after: float | None,
    fleet_delays: dict[int, float | None] | None,
    running: dict[int, ReplicaState],
    owner: object,
) -> str | None:
    """What would refuse a backup now, ``"throttle"``, ``"budget"`` or ``"priority"`` (the
    budget's share kept for classes above ``priority``), or ``None`` (a check: nothing is
    counted or spent). The other inputs are for `early`."""
    if fleet.throttle is not None and not fleet.throttle.allows:
        return "throttle"
    budget = fleet.budget
    if budget is not None:
        hedged_early = early(now, hedge_after, fleet_delays, running, owner)
        if not budget.allows(now, early=hedged_early):
            return "budget"
        # The part of the budget kept for the higher classes in the window.
        if not budget.allows(now, early=hedged_early, priority=priority):
            return "priority"
    return None


def early(
    now: float,
    hedge_after: float | None,
    fleet_delays: dict[int, float | None] | None,
    running: dict[int, ReplicaState],
    owner: object,
) -> bool:
    """Whether a hedge now would go before the fleet's own delay for the attempt it backs up
    (the last in ``fleet_delays``, attempt number -> the fleet's delay for it; ``running``:
    number -> replica, whose ``waiting`` keys it as ``(owner, number)``): the caller's own
    shorter ``hedge_after`` chose it (it then draws on only part of the shared budget,
    `BudgetState.allows`)."""
    if hedge_after is None or not fleet_delays:
        return False
    number = max(fleet_delays)
    delay = fleet_delays[number]
    if delay is None:
        return True  # the fleet never hedges on time: only the caller asked for it
    replica = running.get(number)
    started = None if replica is None else replica.waiting.get((owner, number))
    return started is not None and now - started < delay
