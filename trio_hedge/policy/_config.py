"""The configuration classes: [`HedgePolicy`][trio_hedge.HedgePolicy] (one request's fixed plan, for
[`hedged_stream`][trio_hedge.hedged_stream]) and [`HedgerConfig`][trio_hedge.HedgerConfig] (how a
[`Hedger`][trio_hedge.Hedger] hedges). Both are frozen attrs values validated at construction;
the fields they share (attempt limits, the first-token rule, the three timeouts, the back-off,
the pushback wait, the recoveries) are declared once, in `_SharedFields`, so one default and
one rule hold for both (but for ``max_recoveries``' default: a Hedger recovers, a one-off
request does not).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from .._validate import (
    integer,
    number,
    optional_instance_of,
    positive_int,
    positive_int_or_none,
    positive_seconds,
    positive_seconds_or_none,
    seconds_or_none,
)
from ..events import FirstToken
from ._backoff import Backoff
from ._blame import Attribution
from ._budget import HedgeBudget
from ._delay import LearnedDelay
from ._health import OutlierDetection
from ._throttle import RetryThrottle

__all__ = ["HedgePolicy", "HedgerConfig"]


class _SharedFields:
    """Field factories for what [`HedgePolicy`][trio_hedge.HedgePolicy] and
    [`HedgerConfig`][trio_hedge.HedgerConfig] share (each class documents them; the defaults and
    validators live here only)."""

    @staticmethod
    def max_attempts() -> Any:
        return attrs.field(default=None, validator=positive_int_or_none)

    @staticmethod
    def attempts_per_replica() -> Any:
        return attrs.field(default=1, validator=positive_int)

    @staticmethod
    def first_token() -> Any:
        return attrs.field(
            default=FirstToken.CONTENT,
            converter=FirstToken,
            validator=attrs.validators.in_(tuple(FirstToken)),
        )

    @staticmethod
    def first_token_timeout() -> Any:
        return attrs.field(default=None, validator=positive_seconds_or_none)

    @staticmethod
    def stall_timeout() -> Any:
        return attrs.field(default=None, validator=positive_seconds_or_none)

    @staticmethod
    def close_timeout() -> Any:
        return attrs.field(default=1.0, validator=positive_seconds)

    @staticmethod
    def max_recoveries(default: int) -> Any:
        return attrs.field(default=default, validator=integer(0))

    @staticmethod
    def backoff() -> Any:
        return attrs.field(factory=Backoff, validator=optional_instance_of(Backoff))

    @staticmethod
    def max_pushback_wait() -> Any:
        return attrs.field(default=10.0, validator=seconds_or_none)


_shared = _SharedFields


@attrs.frozen
class HedgePolicy:
    """How a request is hedged. All durations are in seconds.

    The race follows the Happy Eyeballs rule (RFC 8305, as in Trio's ``open_tcp_stream``):
    attempt 1 starts at once; attempt k+1 starts when ``hedge_after`` seconds pass with no
    first token from any running attempt, or at once when a running attempt fails before its
    first token. The first attempt to produce a first token commits (gRPC hedging, gRFC A6,
    commits at the first response; we commit at the first *token*), and every other attempt
    is cancelled.

    Attributes:
        hedge_after: the hedge delay: seconds without a first token before the next backup
            is sent. ``None`` never hedges on time (attempts then start only on failure, a
            plain failover). Default 1.0. Pick it near the P90–P95 of your TTFT ("The Tail at
            Scale", Dean & Barroso 2013); [`trio_hedge.Hedger`][trio_hedge.Hedger] learns it per
            request size.
        max_attempts: attempts per request, primary included; ``None`` means one per replica
            times ``attempts_per_replica``. Default ``None``.
        attempts_per_replica: how many attempts of one request may go to the same replica.
            Default 1 (a second attempt on the same replica usually lands in the same queue).
        hedge: ``False`` disables time-based hedging for this request (failover on error
            still happens). Default ``True``.
        first_token: what counts as the first token ([`FirstToken`][trio_hedge.events.FirstToken]).
            Default content.
        first_token_timeout: seconds, over all attempts, to wait for a first token before
            failing with [`AllAttemptsFailed`][trio_hedge.AllAttemptsFailed] (``kind="timeout"``);
            ``None`` waits as long as the caller's own cancel scope allows. Default ``None``.
        stall_timeout: after commit, seconds of the upstream's silence before the stream
            fails with [`StreamInterrupted`][trio_hedge.StreamInterrupted] (``kind="stall"``):
            the time the caller spends *waiting* for the winner's next batch with no output
            (content, reasoning or tool-call fragments, whatever ``first_token``) arriving.
            Time the caller spends between reads does not count; keep-alive comments,
            role-only deltas, usage and empty events do not reset it (Envoy's
            ``per_try_idle_timeout``, an upstream idle timeout). ``None`` disables it.
            Default ``None``.
        close_timeout: seconds a loser's close may take before it is abandoned (its socket is
            closed regardless). Default 1.0.
        max_recoveries: recovery attempts after the commit: when the winner breaks (a cut, a
            stall, a malformed event, an in-band error), the answer goes on on another replica
            by continuation or by replay and verify, with no gap and no repeated text
            (``docs/recovery.md``). Each is an attempt (``trigger="recovery"``) within
            ``max_attempts``. Default 0 here: a one-off request has no throttle or ejection
            to bound what recoveries re-send, so it ends with
            [`StreamInterrupted`][trio_hedge.StreamInterrupted] unless you ask
            (a [`Hedger`][trio_hedge.Hedger] recovers by default).
        backoff: a [`Backoff`][trio_hedge.policy.Backoff] for repeated attempts on one replica
            (only with ``attempts_per_replica > 1``): the ``n``-th repeat waits up to
            ``min(0.1 × 2^(n−1), 5)`` seconds after that replica's last failure (full jitter,
            drawn from the request id), as the Hedger's do (gRFC A6). ``None`` repeats at
            once. Default ``Backoff()``: bounded by default, as stamina's retries are
            (before, 1,000 attempts on two dead replicas went out in 0 s).
        max_pushback_wait: seconds a repeat on a replica that answered ``Retry-After`` (or
            ``retry-after-ms``) may wait for it to pass; a replica that asked for longer is
            not tried again by this request. ``None`` waits as long as the caller's cancel
            scope allows. Default 10, as the Hedger's.

    Raises:
        TypeError, ValueError: on a badly typed or out-of-range field.
    """

    hedge_after: float | None = attrs.field(default=1.0, validator=seconds_or_none)
    max_attempts: int | None = _shared.max_attempts()
    attempts_per_replica: int = _shared.attempts_per_replica()
    hedge: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    first_token: FirstToken = _shared.first_token()  # noqa: RUF009 (an attrs field)
    first_token_timeout: float | None = _shared.first_token_timeout()
    stall_timeout: float | None = _shared.stall_timeout()
    close_timeout: float = _shared.close_timeout()
    max_recoveries: int = _shared.max_recoveries(0)
    backoff: Backoff | None = _shared.backoff()  # noqa: RUF009 (an attrs field)
    max_pushback_wait: float | None = _shared.max_pushback_wait()


def _check_hedge_after(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None or isinstance(value, LearnedDelay):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"hedge_after must be seconds (a number), a LearnedDelay or None, not {value!r}"
        )
    seconds_or_none(_inst, attribute, value)  # the same rule as HedgePolicy.hedge_after


@attrs.frozen
class HedgerConfig:
    """How a [`Hedger`][trio_hedge.Hedger] hedges. Durations in seconds.

    Attributes:
        hedge_after: a [`LearnedDelay`][trio_hedge.LearnedDelay] (default: P95 of the last 300 s of
            TTFTs per group and prompt-size class, 1.0 s until 20 observations), a fixed
            number of seconds, or ``None`` to never hedge on time (failover only).
        max_attempts: attempts per request, primary included; ``None`` (default) allows one
            per replica times ``attempts_per_replica``. gRPC caps it at 5 (gRFC A6).
        attempts_per_replica: attempts of one request a replica may take. Default 1.
        first_token: what counts as the first token ([`FirstToken`][trio_hedge.events.FirstToken]).
        first_token_timeout: seconds over all attempts to wait for a first token, else
            [`AllAttemptsFailed`][trio_hedge.AllAttemptsFailed] (``kind="timeout"``). Default
            ``None`` (the caller's own cancel scope is the deadline).
        stall_timeout: after commit, seconds of the upstream's silence (the caller waiting
            on the winner with no output arriving; the caller's own pauses do not count, as
            in [`HedgePolicy`][trio_hedge.HedgePolicy]) before
            [`StreamInterrupted`][trio_hedge.StreamInterrupted] (``kind="stall"``); it counts
            against the replica's health. Default ``None``.
        close_timeout: seconds a loser's close may take. Default 1.0.
        max_recoveries: recovery attempts a request may make after its commit, when the
            winner breaks (a cut, a stall, a malformed event, an in-band error): the answer
            goes on on another replica, by continuation where the replica declares its
            engine's contract (``Replica.continuation``), else by replay and verify, with no
            gap and no repeated text; a recovery that fails ends the answer with the original
            failure's [`StreamInterrupted`][trio_hedge.StreamInterrupted]. Each is an attempt
            (``trigger="recovery"``) under a failover's rules: the throttle, ejection and
            ``max_attempts``. ``0`` turns recovery off. Default 2 (``docs/recovery.md``).
        budget: a [`HedgeBudget`][trio_hedge.policy.HedgeBudget] (default 10% + 0.5/s over 60 s) or
            ``None`` for no budget.
        throttle: a [`RetryThrottle`][trio_hedge.policy.RetryThrottle] (default 10 tokens, ratio
            0.1) or ``None``.
        outlier_detection: an [`OutlierDetection`][trio_hedge.policy.OutlierDetection] (default 5
            failures in a row, 10 s doubling up to 300 s, at most a third of the replicas) or
            ``None`` to never eject.
        attribution: an [`Attribution`][trio_hedge.policy.Attribution]: whose fault each kind
            of attempt error is. Default ``Attribution()``: the request's evidence decides (a
            key, quota or "not found" error is a replica's only when another replica served
            the same request); a gateway that forwards its clients' keys says
            ``Attribution(caller={"auth"})``.
        backoff: a [`Backoff`][trio_hedge.policy.Backoff] for a request's repeated attempts on one
            replica (only with ``attempts_per_replica > 1``; default 0.1 s doubling up to
            5 s, full jitter) or ``None`` to repeat at once (the throttle still applies).
        max_pushback_wait: seconds an attempt may wait for a replica to end its cooldown
            (server pushback) when every replica it could use is cooling. Beyond that the
            primary raises [`ReplicasCooling`][trio_hedge.ReplicasCooling] at once (saying until
            when) and a later attempt is not sent. ``None`` waits as long as the caller's cancel
            scope allows. Default 10: a rate-limit window usually ends within seconds, and a
            caller who waits longer should say so (a batch job: raise it). It is also the
            ceiling past which a ``Retry-After`` is an outage, not a wait: that replica is
            ejected for that model for the time it asked (at most ``max_ejection``), as an
            SDK refuses to wait past 120 s.
        rate_limit_cooldown: seconds a 429 *without* ``Retry-After`` cools its replica for
            that model (and raises its latency estimate to at least that, so the pick moves
            off it), in ``[0, 60]``. Default 1.0: a replica rate-limiting every request was
            the first attempt of 30 requests in 30 when a 429 said nothing.
        fallback_wait: seconds a peer may keep an attempt waiting before a replica marked
            as a fallback (``Replica.fallback``) takes it: a peer cooling for at most this
            long is waited for, and a peer that answered a single 500 or pushback
            (``Retry-After``) of at most this long is tried once more (after it) before the
            request falls back. Default 1.0.
        pick: where an attempt goes among the eligible replicas (ties in the given order):
            ``"peak_ewma"`` (default), the lowest ``latency × (attempts + 1)``, as Finagle's
            ``P2CPeakEwma`` and Linkerd's balancer cost a replica: ``latency`` is a peak-EWMA
            of its TTFTs (excess over the prompt's predicted prefill, so a long prompt's own
            prefill does not mark a replica slow; an attempt cancelled before its first token
            counts as "at least this slow"; the estimate decays toward zero with
            ``latency_decay``), raised to the age of the oldest attempt still waiting there
            for a first token; ``attempts`` are those waiting there for a first token plus
            cancelled ones whose prefill the server may still be running (until the prefill
            model's median for their size has passed since they started); a stream already
            answering is not counted (a batching engine prefills beside it).
            ``"least_loaded"``: the fewest
            attempts in flight (this process's only). ``"in_order"``: the first eligible
            one, for a preferred primary and fallback providers. Server pushback keeps a
            replica out of every pick until its cooldown ends, and failures count through
            outlier detection, not the latency.
        latency_decay: seconds, the time constant of the peak-EWMA latency's decay. Default
            10 (Finagle's and Linkerd's default decay time).
        chars_per_token: for estimating prompt tokens from the messages. Default 4.0.
        stats_window: seconds of commits behind the TTFT percentiles in ``statistics()``.
            Default 60.

    Raises:
        TypeError, ValueError: on a badly typed or out-of-range field.
    """

    hedge_after: float | LearnedDelay | None = attrs.field(
        factory=LearnedDelay, validator=_check_hedge_after
    )
    max_attempts: int | None = _shared.max_attempts()
    attempts_per_replica: int = _shared.attempts_per_replica()
    first_token: FirstToken = _shared.first_token()  # noqa: RUF009 (an attrs field)
    first_token_timeout: float | None = _shared.first_token_timeout()
    stall_timeout: float | None = _shared.stall_timeout()
    close_timeout: float = _shared.close_timeout()
    max_recoveries: int = _shared.max_recoveries(2)
    budget: HedgeBudget | None = attrs.field(
        factory=HedgeBudget, validator=optional_instance_of(HedgeBudget)
    )
    throttle: RetryThrottle | None = attrs.field(
        factory=RetryThrottle, validator=optional_instance_of(RetryThrottle)
    )
    outlier_detection: OutlierDetection | None = attrs.field(
        factory=OutlierDetection, validator=optional_instance_of(OutlierDetection)
    )
    attribution: Attribution = attrs.field(
        factory=Attribution, validator=attrs.validators.instance_of(Attribution)
    )
    backoff: Backoff | None = _shared.backoff()  # noqa: RUF009 (an attrs field)
    max_pushback_wait: float | None = _shared.max_pushback_wait()
    rate_limit_cooldown: float = attrs.field(default=1.0, validator=number(0.0))

    @rate_limit_cooldown.validator
    def _check_rate_limit_cooldown(self, attribute: attrs.Attribute[float], value: float) -> None:
        if value > 60:
            raise ValueError(f"rate_limit_cooldown must be <= 60 seconds, not {value!r}")

    fallback_wait: float = attrs.field(default=1.0, validator=number(0.0))
    pick: Literal["peak_ewma", "least_loaded", "in_order"] = attrs.field(
        default="peak_ewma",
        validator=attrs.validators.in_(("peak_ewma", "least_loaded", "in_order")),
    )
    latency_decay: float = attrs.field(default=10.0, validator=number(0.0, open_lo=True))
    chars_per_token: float = attrs.field(default=4.0, validator=number(0.0, open_lo=True))
    stats_window: float = attrs.field(default=60.0, validator=number(0.0, open_lo=True))

    def stream_policy(self) -> HedgePolicy:
        """The per-stream part (timeouts, first-token rule) as a
        [`HedgePolicy`][trio_hedge.HedgePolicy]."""
        return HedgePolicy(
            hedge_after=None,
            first_token=self.first_token,
            first_token_timeout=self.first_token_timeout,
            stall_timeout=self.stall_timeout,
            close_timeout=self.close_timeout,
            max_recoveries=self.max_recoveries,
        )
