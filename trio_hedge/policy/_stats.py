"""Frozen snapshots of a [`Hedger`][trio_hedge.Hedger]'s shared state (``hedger.statistics()``).

Counter names follow Finagle's ``BackupRequestFilter`` (``backups_sent``, ``backups_won``,
``budget_exhausted``) where there is one.
"""

from __future__ import annotations

import attrs

from ..sources.probes import LoadReading
from ._prefill import PrefillFit

__all__ = ["DelayStatistics", "HedgerStatistics", "ReplicaStatistics"]


@attrs.frozen
class DelayStatistics:
    """The hedge delay of one (group, prompt-size class) that has observations.

    Attributes:
        group: the group (model / replica group).
        size_class: the class index (see [`SizeClasses`][trio_hedge.policy.SizeClasses]).
        min_tokens: the class's smallest prompt size, in tokens.
        max_tokens: the class's prompt-token bound, exclusive (``None`` for the open last
            class).
        observations: TTFT observations in the window (exact and censored).
        censored: of those, attempts cancelled before their first token.
        delay: the delay, in seconds, a request of this class gets now.
        learned: whether ``delay`` comes from the class's own data (else the fallback, or a
            smaller class's delay).
    """

    group: str
    size_class: int
    min_tokens: int
    max_tokens: int | None
    observations: int
    censored: int
    delay: float
    learned: bool


_PROBE_FIELDS = frozenset(
    (
        "probe",
        "probe_age",
        "probe_reading",
        "probe_polls",
        "probe_failures",
        "predicted_wait",
        "probe_decisions",
        "own_view_decisions",
    )
)


@attrs.frozen(repr=False)
class ReplicaStatistics:
    """One replica's health.

    Attributes:
        name: the replica's name.
        state: its own scope: ``"ejected"`` (for every model: its run of failures, or
            slow beside the others), ``"degraded"`` (cooling or ejected for some models
            only: ``cooling_models``, ``ejected_models``; it serves the others) or
            ``"healthy"``.
        in_flight: attempts running on it now (a committed winner counts until its stream
            ends).
        attempts: attempts started on it since the Hedger was created.
        wins: requests it won since the Hedger was created.
        failures: attempts on it that failed by its own fault (as ``docs/guarantees.md``,
            "Who is blamed for what", decides: not the request's errors), and its winners
            that failed after the commit, since the Hedger was created. Lost races are not
            failures (``lost_races``).
        cooling_for: seconds left of its longest cooldown after server pushback (0 when
            none).
        ejected_for: seconds left of its longest ejection by outlier detection (0 when none).
        times_ejected: ejections since the Hedger was created (for every model or one).
        consecutive_failures: failures in a row now (slow lost races included: the run
            that ejects it).
        latency: what the ``peak_ewma`` pick sees now, in seconds: the peak-EWMA TTFT
            estimate (excess over predicted prefill), raised to the age of the oldest
            attempt waiting there for its first token (0 with other picks).
        lingering: cancelled attempts the server may still be prefilling (counted as in
            flight by the ``peak_ewma`` pick).
        lost_races: its attempts cancelled because another attempt of the same request won,
            since the Hedger was created.
        judged_attempts: its attempts judged for speed in the last ``slow_window`` seconds
            (``OutlierDetection``): those that got a first token, and those that lost a race
            after waiting the fleet's own delay.
        slow_attempts: of those, the ones that lost after the fleet's delay: slow. A
            replica is ejected for slowness only relative to the others (``count_slow``).
        cooling_models: the models it is cooling for now (pushback is kept per model).
        ejected_models: the models it is ejected for now (an error that was its own fault
            for that model), not counting an ejection for every model (``state``).
        probe: its [`LoadProbe`][trio_hedge.sources.probes.LoadProbe]'s state: ``"off"`` (no
            probe, or the Hedger not entered with ``async with``), ``"waiting"`` (no poll
            answered yet), ``"fresh"`` (its reading is evidence now), ``"stale"`` (older than
            ``max_age``: the own view is used) or ``"failing"`` (its last poll failed: the
            own view is used).
        probe_age: seconds since its last reading (``None``: none yet).
        probe_reading: its last [`LoadReading`][trio_hedge.sources.probes.LoadReading]
            (what the engine said: waiting and running requests, queued tokens, KV usage),
            fresh or stale; ``None`` before the first reading and after a failed poll.
        probe_polls: polls made since the Hedger was entered.
        probe_failures: of those, polls that gave no reading.
        predicted_wait: with a fresh reading, the seconds the engine's queue makes a new
            short request wait before its prefill starts (``inf``: KV cache saturated);
            ``None`` otherwise.
        probe_decisions: picks and hedge decisions it took part in with its engine's
            reading.
        own_view_decisions: the same, of a Hedger with probes, made from the Hedger's own
            view (no fresh reading).
    """

    name: str
    state: str
    in_flight: int
    attempts: int
    wins: int
    failures: int
    cooling_for: float
    ejected_for: float
    times_ejected: int
    consecutive_failures: int
    latency: float = 0.0
    lingering: int = 0
    lost_races: int = 0
    judged_attempts: int = 0
    slow_attempts: int = 0
    cooling_models: tuple[str, ...] = ()
    ejected_models: tuple[str, ...] = ()
    probe: str = "off"
    probe_age: float | None = None
    probe_reading: LoadReading | None = None
    probe_polls: int = 0
    probe_failures: int = 0
    predicted_wait: float | None = None
    probe_decisions: int = 0
    own_view_decisions: int = 0

    def __repr__(self) -> str:
        # The probe's fields only for a probed replica: a line per replica stays readable.
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in attrs.fields(type(self))
            if self.probe != "off" or f.name not in _PROBE_FIELDS
        ]
        return f"{type(self).__name__}({', '.join(shown)})"


@attrs.frozen
class HedgerStatistics:
    """A snapshot of a [`Hedger`][trio_hedge.Hedger]. Counts are totals since it was created.

    Attributes:
        time: Trio's clock at the snapshot (seconds).
        requests: requests whose primary attempt started.
        finished: requests that ended (stream closed, failed or cancelled).
        failed: requests that ended with an error.
        attempts: attempts started (primaries and backups).
        hedges_sent: backups sent because the hedge delay passed (Finagle ``backups_sent``).
        failovers: attempts started because an earlier attempt failed.
        recoveries: attempts started after a commit because the winner broke
            (``trigger="recovery"``).
        backup_wins: requests won by a hedge (Finagle ``backups_won``).
        hedges_refused: hedges not sent, for any reason (sum of the three below).
        budget_refusals: refused by the [`HedgeBudget`][trio_hedge.policy.HedgeBudget]
            (Finagle ``budget_exhausted``).
        throttle_refusals: refused by the [`RetryThrottle`][trio_hedge.policy.RetryThrottle].
        no_replica_refusals: refused because no replica the request may still use could take
            it at once (every one ejected, cooling after pushback, or in its back-off), or,
            with load probes, because every one is predicted no faster than the attempts
            running or is saturated (``saturated_refusals`` counts those).
        failovers_refused: failovers not sent after a failed attempt although the request's
            plan (``max_attempts``, ``attempts_per_replica``) allowed one (sum of the two
            below); the request then goes on with the attempts still running, or fails.
        failover_throttle_refusals: refused by the
            [`RetryThrottle`][trio_hedge.policy.RetryThrottle] (gRFC A6: no retries at or below half
            the tokens).
        failover_no_replica_refusals: refused because every replica the request may still
            use is ejected, or cooling (or in its back-off) longer than
            ``max_pushback_wait``.
        saturated_refusals: of ``no_replica_refusals``, hedges not sent because the
            engines' readings predicted no replica faster than the attempt running, or
            every replica saturated (load probes only).
        hedges_at_once: backups sent at once (no hedge delay) because the engine's reading
            predicted the attempt running would take longer than the delay, and another
            replica sooner (load probes only).
        requests_refused: requests that sent nothing and raised
            [`ReplicasCooling`][trio_hedge.ReplicasCooling] (counted neither in ``requests`` nor in
            ``finished``).
        ejections_capped: times a replica was due for ejection but stayed in because
            ``max_ejection_percent`` of the replicas (or all but one) were already out.
        throttle_tokens: the throttle's token count now (``None`` without a throttle).
        budget_window: ``(requests, backups)`` counted in the budget's window now.
        prompt_tokens_sent: prompt tokens sent, over all attempts (estimated).
        prompt_tokens_resent: of those, sent again by backups.
        wasted_tokens: content tokens received by losing attempts.
        ttft_p50: the caller-visible median TTFT (seconds) over the statistics window, or
            ``None`` before the first commit.
        ttft_p90: the caller-visible P90 TTFT (seconds), likewise.
        ttft_p99: the caller-visible P99 TTFT (seconds), likewise.
        delays: the current hedge delay of every (group, size class) with data.
        replicas: every replica's health, in the order given to the Hedger.
        prefill: each group's prefill model ([`PrefillFit`][trio_hedge.policy.PrefillFit]: TTFT
            against prompt tokens), for groups with enough data (learned delays only).
    """

    time: float
    requests: int
    finished: int
    failed: int
    attempts: int
    hedges_sent: int
    failovers: int
    recoveries: int
    backup_wins: int
    hedges_refused: int
    budget_refusals: int
    throttle_refusals: int
    no_replica_refusals: int
    failovers_refused: int
    failover_throttle_refusals: int
    failover_no_replica_refusals: int
    requests_refused: int
    ejections_capped: int
    throttle_tokens: float | None
    budget_window: tuple[int, int] | None
    prompt_tokens_sent: int
    prompt_tokens_resent: int
    wasted_tokens: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    delays: tuple[DelayStatistics, ...]
    replicas: tuple[ReplicaStatistics, ...]
    prefill: tuple[PrefillFit, ...] = ()
    saturated_refusals: int = 0
    hedges_at_once: int = 0

    @property
    def ejected(self) -> tuple[str, ...]:
        """Names of the replicas ejected now, whole or for some model."""
        return tuple(r.name for r in self.replicas if r.state == "ejected" or r.ejected_models)

    @property
    def cooling(self) -> tuple[str, ...]:
        """Names of the replicas cooling now (server pushback, for some model)."""
        return tuple(r.name for r in self.replicas if r.cooling_models)

    def __str__(self) -> str:
        """One field per line, and one per replica, delay or prefill fit, for
        ``print(hedger.statistics())``; ``repr`` stays one line."""
        lines = [f"{type(self).__name__}("]
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if isinstance(value, tuple) and value and attrs.has(type(value[0])):
                lines.append(f"    {field.name}=(")
                lines.extend(f"        {item!r}," for item in value)
                lines.append("    ),")
            else:
                lines.append(f"    {field.name}={value!r},")
        return "\n".join([*lines, ")"])

    def delay(self, group: str, size_class: int) -> float | None:
        """The current delay of one (group, class), or ``None`` if it has no data."""
        for d in self.delays:
            if d.group == group and d.size_class == size_class:
                return d.delay
        return None
