"""Where one request's attempt goes: plain synchronous functions of the fleet
(``_fleet.py``) and of what the request has done so far (its use of each replica, its
back-off, its running attempts, the window it needs), returning the replica, or when one
may take the attempt. They decide and change nothing; the planner (``_planner.py``) holds
the request's state and records what they say (httpcore's connection pool: decide on
state, act after).

* a replica this request has not used ``attempts_per_replica`` times, whose window (declared
  or learned for the model) takes the request (`candidates`, `fits`);
* none ejected, cooling or in this request's back-off; a later attempt on a replica this
  request has not tried yet before one it has; a fallback (``Replica.fallback``) only when
  no peer can take the attempt within ``fallback_wait`` (`choose`);
* with load probes, a backup only to a replica predicted sooner than the attempts it backs
  up (`_faster`, `predicted_wait`); then the fleet's pick (`FleetState.pick`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ._fleet import FleetState
from ._health import ReplicaState

__all__ = [
    "Choice",
    "PrefillModel",
    "candidates",
    "choose",
    "fits",
    "predicted_wait",
    "prefill_model",
]

#: Seconds of prefill for a number of prompt tokens (``None``: unknown).
PrefillModel = Callable[[int], float | None]

#: ``(replica, wait_until, beyond, saturated)``: the replica for an attempt now, else
#: ``None``; the earliest time one may take it within the wait bound; the earliest time one
#: may take it at all (``inf``: none will); and whether the load probes predicted no replica
#: sooner than the attempts a backup would back up (the planner counts it when it refuses).
Choice = tuple[ReplicaState | None, float, float, bool]


def candidates(
    fleet: FleetState,
    model: str,
    used: list[int],
    per_replica: int,
    need: int | None,
    outgrown: bool,
) -> list[ReplicaState]:
    """The replicas, in the fleet's order, a request may still try: those it used fewer than
    ``per_replica`` times (``used``: its attempts on each, by index), and of them those whose
    window takes the ``need`` tokens it needs (``outgrown``: a replica answered it a
    context-length error)."""
    out = [r for r in fleet.replicas if used[r.index] < per_replica]
    if (need is None and not outgrown) or not out:
        return out
    fitting = [r for r in out if fits(fleet, model, r, need or 0, outgrown)]
    # Before any context-length error, an estimate never empties the plan (the servers
    # decide); after one, only a replica that says it has room is tried (_blame.outgrew).
    return fitting if fitting or outgrown else out


def fits(fleet: FleetState, model: str, replica: ReplicaState, need: int, outgrown: bool) -> bool:
    """Whether ``replica``'s window, declared or learned for ``model``, takes ``need`` tokens
    (after a context-length error in this request, ``outgrown``: only a declared one)."""
    window = replica.context_window
    if window is None and outgrown:
        return False
    if window is not None and need > window:
        return False
    models = fleet.models
    state = models.get(replica.index, model) if len(models) else None
    return state is None or state.window is None or need <= state.window


def choose(
    fleet: FleetState,
    candidates: list[ReplicaState],
    now: float,
    deadline: float,
    *,
    primary: bool,
    hedge: bool,
    model: str,
    group: str,
    used: list[int],
    retry_at: dict[int, float] | None,
    running: dict[int, ReplicaState],
    owner: object,
    probe_key: int,
    tokens: int | None,
) -> Choice:
    """As `_choose_among`, peers first: a replica marked as a fallback
    (``Replica.fallback``) only when no peer can take the attempt within
    ``fallback_wait`` seconds (a peer that will, after a short cooldown, is waited for).
    The peers' saturation is not reported when a fallback takes the attempt: it refused
    nothing.

    The request's state, as the planner holds it: ``model`` and ``group`` (what per-model
    state and the prefill model are kept by); ``used``: its attempts on each replica, by
    index; ``retry_at``: its back-off, replica index -> when it may try that one again;
    ``running``: its attempts out, number -> replica; ``owner``: the request, whose attempts
    ``ReplicaState.waiting`` keys as ``(owner, number)``; ``probe_key``: its key among the
    load probes' requests; ``tokens``: its prompt's size (``None``: unknown)."""
    fallbacks = [r for r in candidates if r.fallback]
    if not fallbacks or len(fallbacks) == len(candidates):
        return _choose_among(
            fleet, candidates, now, deadline, primary, hedge,
            model, group, used, retry_at, running, owner, probe_key, tokens,
        )  # fmt: skip
    peers = [r for r in candidates if not r.fallback]
    chosen, wait_until, beyond, saturated = _choose_among(
        fleet, peers, now, deadline, primary, hedge,
        model, group, used, retry_at, running, owner, probe_key, tokens,
    )  # fmt: skip
    if chosen is not None or wait_until <= now + fleet.config.fallback_wait:
        return chosen, wait_until, beyond, saturated
    other, other_wait, other_beyond, other_saturated = _choose_among(
        fleet, fallbacks, now, deadline, primary, hedge,
        model, group, used, retry_at, running, owner, probe_key, tokens,
    )  # fmt: skip
    if other is not None:
        return other, now, now, False
    return (
        None,
        min(wait_until, other_wait),
        min(beyond, other_beyond),
        (saturated or other_saturated),
    )


def _choose_among(
    fleet: FleetState,
    candidates: list[ReplicaState],
    now: float,
    deadline: float,
    primary: bool,
    hedge: bool,
    model: str,
    group: str,
    used: list[int],
    retry_at: dict[int, float] | None,
    running: dict[int, ReplicaState],
    owner: object,
    probe_key: int,
    tokens: int | None,
) -> Choice:
    """The `Choice` for an attempt among ``candidates``, waiting until ``deadline`` at most.

    A replica may take an attempt once its cooldown (server pushback), its ejection and
    this request's back-off for it (``retry_at``) are over. The wait bound applies to
    cooldowns and ejections, not to the back-off (bounded by ``Backoff.maximum``). A later
    attempt never waits for an ejected replica; the primary may (the cap leaves a replica
    in, so that only matters when every replica left in is cooling)."""
    ready: list[ReplicaState] = []
    wait_until = beyond = math.inf
    models = fleet.models
    for r in candidates:
        at = r.ejected_until
        cooling = -math.inf
        state = models.get(r.index, model) if len(models) else None
        if state is not None:
            cooling = state.cooling_until
            if state.ejected_until > at:
                at = state.ejected_until
        if at > now and not primary:
            continue
        if cooling > at:
            at = cooling
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
        return None, wait_until, min(wait_until, beyond), False
    if not primary and len(ready) > 1:
        # A replica this request has not tried yet before one it has.
        fewest = min(used[r.index] for r in ready)
        ready = [r for r in ready if used[r.index] == fewest]
    if hedge and fleet.probed:
        ready = _faster(fleet, ready, now, group, running, owner, probe_key, tokens)
        if not ready:
            return None, math.inf, math.inf, True
    return fleet.pick(ready, now, prefill_model(fleet, group, now)), now, now, False


def prefill_model(fleet: FleetState, group: str, now: float) -> PrefillModel | None:
    """A request of ``group``'s prefill model for the load probes' predictions (``None``: the
    Hedger has none; each probe's ``prefill_rate`` then)."""
    if fleet.model is None:
        return None
    return lambda tokens: fleet.prefill(group, tokens, now)


def _faster(
    fleet: FleetState,
    ready: list[ReplicaState],
    now: float,
    group: str,
    running: dict[int, ReplicaState],
    owner: object,
    probe_key: int,
    tokens: int | None,
) -> list[ReplicaState]:
    """Of ``ready``, the replicas a backup may go to on the engines' evidence: when every
    attempt ``running`` has a fresh prediction, only those predicted sooner than the best of
    them (none when all are saturated). A replica without a fresh reading stays in, and
    nothing is filtered when a running attempt's replica has none: no evidence is never a
    reason not to hedge (fail open)."""
    prefill = prefill_model(fleet, group, now)
    target = math.inf
    for number, replica in running.items():
        predicted = predicted_wait(fleet, owner, number, replica, now, prefill, probe_key, tokens)
        if predicted is None:
            return ready
        target = min(target, predicted)
    kept = []
    for r in ready:
        predicted = fleet.predicted(r, now, prefill, request=probe_key)
        if predicted is None or predicted < target:
            kept.append(r)
    return kept


def predicted_wait(
    fleet: FleetState,
    owner: object,
    number: int,
    replica: ReplicaState,
    now: float,
    prefill: PrefillModel | None,
    probe_key: int,
    tokens: int | None,
) -> float | None:
    """The predicted wait of the running attempt ``number`` of a request (``owner``, whose
    attempts ``replica.waiting`` keys as ``(owner, number)``; ``probe_key``: its key in the
    load probes; ``tokens``: its prompt) on ``replica``: only the prompts sent there before
    it are ahead of it (not its own, nor a later request's: a long prompt hedged onto the
    replica after it is behind it)."""
    started = replica.waiting.get((owner, number))
    return fleet.predicted(replica, now, prefill, request=probe_key, before=started, own=tokens)
