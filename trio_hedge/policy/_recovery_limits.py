"""The recovery phase's limits, from what the fleet (``_fleet.py``) expects of a replica:
plain synchronous functions of the fleet and one request's group, size class and prompt
size, asked by the planner (``_planner.py``) for the race's recovery (``_recovery.py``).

* `deadline` -- the seconds a recovery attempt may take to its first output: the
  ``RecoveryPolicy``'s deadline of the TTFT the fleet expects of its replica (`expected_ttft`);
* `size_delay` -- the fleet's hedge delay for the recovery's prompt, after which a second
  recovery may go as a hedge;
* `throughput_floor` -- the tokens a winner must stream in a window against the rate its
  replica learned for the model.

They read and change nothing else: the planner holds the request's state and asks.
"""

from __future__ import annotations

from ._fleet import FleetState
from ._health import ReplicaState

__all__ = ["deadline", "expected_ttft", "recovery_tokens", "size_delay", "throughput_floor"]


def recovery_tokens(tokens: int | None, added: int) -> int | None:
    """The prompt tokens of a recovery: the request's ``tokens`` plus the ``added`` the
    recovery sends (``None``: neither is known)."""
    if tokens is None and not added:
        return None
    return (tokens or 0) + added


def deadline(
    fleet: FleetState,
    replica: ReplicaState,
    group: str,
    size_class: int,
    tokens: int | None,
    now: float,
) -> float:
    """Seconds a recovery attempt on ``replica`` may take to its first output before it is
    abandoned: ``RecoveryPolicy.deadline`` of the TTFT the fleet expects of that replica
    for a prompt of ``tokens`` (`expected_ttft`)."""
    expected = expected_ttft(fleet, replica, group, size_class, tokens, now)
    return fleet.config.recovery.deadline(expected)


def size_delay(
    fleet: FleetState, group: str, size_class: int, tokens: int | None, now: float
) -> float | None:
    """The fleet's hedge delay for a prompt of ``tokens`` of ``group`` (learned for the
    prompt's size class, ``size_class`` when its size is unknown, or the fixed one;
    ``None``: never on time)."""
    model = fleet.model
    if model is None:
        fixed = fleet.config.hedge_after
        assert fixed is None or isinstance(fixed, (int, float))
        return None if fixed is None else float(fixed)
    size_class = size_class if tokens is None else model.config.classes.of(tokens)
    return model.delay(group, size_class, now, tokens)


def expected_ttft(
    fleet: FleetState,
    replica: ReplicaState,
    group: str,
    size_class: int,
    tokens: int | None,
    now: float,
) -> float | None:
    """The TTFT the fleet expects of ``replica`` for a prompt of ``tokens``: the larger of
    the group's delay for that size and the replica's peak-EWMA latency over the prompt's
    predicted prefill (``None``: nothing known)."""
    expected = size_delay(fleet, group, size_class, tokens, now)
    if fleet.config.pick == "peak_ewma":
        latency = replica.latency_now(now, fleet.config.latency_decay)
        if latency > 0:
            own = latency + fleet.prefill(group, tokens, now)
            expected = own if expected is None else max(expected, own)
    return expected


def throughput_floor(
    fleet: FleetState, replica: ReplicaState | None, model: str
) -> tuple[float, int | None] | None:
    """``(window, tokens)`` for a winner on ``replica`` streaming ``model``
    (``RecoveryPolicy.throughput_floor`` against the rate the replica learned for the model;
    ``tokens`` ``None`` while too little is learned, or for a source of no replica: the
    stream is timed, to learn, and not judged: no evidence is never a reason to cut a
    stream), or ``None``: no floor, no timing."""
    floor = fleet.config.recovery.throughput_floor
    if floor is None:
        return None
    if replica is None:
        return floor.window, None
    rate = fleet.rates.rate(replica.index, model, floor.min_samples)
    return floor.window, None if rate is None else floor.tokens_needed(rate)
