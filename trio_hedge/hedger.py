"""`Hedger`: the long-lived, shared hedging policy for production.

An application creates one :class:`Hedger` and opens every request through it. Unlike
:func:`~trio_hedge.hedged_stream` (one request, a fixed plan), the Hedger keeps state across
requests and consults it at each decision of the race (through the
:class:`~trio_hedge.policy.Planner` protocol; the race and stream code are the same):

* **when to hedge** — a delay learned per group and prompt-size class from observed TTFTs,
  censoring-aware (:class:`~trio_hedge.LearnedDelay`), or a fixed number;
* **whether a hedge may be sent** — a ratio budget (:class:`~trio_hedge.policy.HedgeBudget`) and a
  failure throttle (:class:`~trio_hedge.policy.RetryThrottle`), checked at the moment; the budget is
  spent when the backup really starts;
* **whether a failover may be sent** — the same throttle (gRFC A6: no retries and no hedges
  at or below half the tokens), a replica that is not ejected, and for a replica this
  request already tried, a back-off (:class:`~trio_hedge.policy.Backoff`);
* **where an attempt goes** — a replica this request has not tried yet before one it has,
  not one cooling after server pushback (``Retry-After``), not one ejected by outlier
  detection (:class:`~trio_hedge.policy.OutlierDetection`, which never ejects the whole fleet);
  of the rest, the one with the lowest peak-EWMA cost (Finagle's and Linkerd's balancers):
  its recent TTFT, where a lost race counts as "at least this slow" and an attempt still
  waiting there as "at least this slow now", times one plus its attempts waiting for a first
  token, counting cancelled attempts its server may still be prefilling. If every usable
  replica is cooling, the attempt waits for the earliest, at most ``max_pushback_wait``
  seconds (beyond that the primary raises :class:`~trio_hedge.ReplicasCooling`, a later
  attempt is not sent);
* **whom to blame** — an error that is the replica's own fault (401/403, quota, unknown
  model) ejects that replica at once and the request does not try it again; errors that are
  the request's fault never count; an attempt counts as slow only when a later attempt of
  the same request wins.

Trio is single-threaded, so the shared state needs no locks; every structure is bounded
(sliding windows with a sample cap, a capped number of groups), so thousands of concurrent
streams over a long run do not grow it.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx
import trio

from ._hooks import emit
from ._oneshot import check_replicas
from ._source import Source
from ._stream import HedgedStream
from ._validate import check_header_value, check_headers, check_json_body, check_request_id
from .errors import AttemptError, ReplicasCooling, StreamInterrupted
from .events import EventHook, EventKind, HedgeEvent
from .policy._budget import (
    BudgetState,
    ThrottleState,
    backoff_delay,
    jitter_draw,
)
from .policy._config import HedgerConfig
from .policy._delay import DelayModel, LearnedDelay, empirical_quantile
from .policy._health import ReplicaState, counts_against_replica
from .policy._sizing import estimate_prompt_tokens
from .policy._stats import DelayStatistics, HedgerStatistics, ReplicaStatistics
from .report import AttemptOutcome, AttemptRecord, Report
from .sources.openai._http import HeaderNames, Replica
from .transport import make_client

__all__ = ["Hedger", "HedgerConfig"]

#: Commits kept for the caller-visible TTFT percentiles in ``statistics()``.
_TTFT_SAMPLES = 4096
#: Cancelled attempts a replica may count as still being prefilled (a memory bound).
_MAX_LINGERING = 1024


def _check_request_hedge_after(value: object) -> float | None:
    """A per-request hedge delay: ``None`` or finite seconds >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"hedge_after must be seconds (a number) or None, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"hedge_after must be finite seconds >= 0, not {value!r}")
    return float(value)


def _request_headers(headers: object) -> dict[str, str] | None:
    """Per-request extra headers, checked like every header the library sends (values never
    quoted), with lower-case names as the source's own headers: one key per name."""
    if headers is None:
        return None
    check_headers(headers, "headers")
    assert isinstance(headers, Mapping)
    return {name.lower(): value for name, value in headers.items()}


class Hedger:
    """One long-lived hedging policy shared by every request of an application.

    Create it once (``async with Hedger(replicas) as hedger:``, or call :meth:`aclose`
    yourself) and open each request with :meth:`stream`.

    Args:
        replicas: where attempts go: :class:`~trio_hedge.Replica` endpoints and/or any
            :class:`~trio_hedge.sources.Source`; names must be unique. Their order is the tie-break
            (and the preference with ``pick="in_order"``).
        config: a :class:`HedgerConfig`; default ``HedgerConfig()``.
        client: an ``httpx.AsyncClient`` for the HTTP replicas, used as given and never
            closed by the Hedger. Without one, the Hedger creates one on first use (one
            pool and SSL context for all requests) and closes it in :meth:`aclose`.
        headers: which headers carry the request id and attempt number
            (:class:`~trio_hedge.sources.HeaderNames`).
        on_event: callbacks receiving a :class:`~trio_hedge.events.HedgeEvent` for every attempt
            started, committed, failed or cancelled, every hedge or failover refused, replica
            cooled or ejected, and request finished. Also the mutable list :attr:`on_event`.

    Raises:
        TypeError, ValueError: bad replicas (empty, wrong type, duplicate names) or config.
    """

    def __init__(
        self,
        replicas: Sequence[Replica | Source],
        config: HedgerConfig | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        headers: HeaderNames | None = None,
        on_event: Iterable[EventHook] = (),
    ) -> None:
        config = HedgerConfig() if config is None else config
        if not isinstance(config, HedgerConfig):
            raise TypeError(f"config must be a HedgerConfig, not {type(config).__name__}")
        check_replicas(replicas)  # also refuses duplicate names
        states = [ReplicaState(index=i, name=r.name, source=r) for i, r in enumerate(replicas)]
        if client is not None and not isinstance(client, httpx.AsyncClient):
            raise TypeError(f"client must be an httpx.AsyncClient, not {type(client).__name__}")
        if headers is not None and not isinstance(headers, HeaderNames):
            raise TypeError(f"headers must be HeaderNames or None, not {type(headers).__name__}")
        self.on_event: list[EventHook] = list(on_event)
        self._config = config
        self._policy = config.stream_policy()
        self._replicas = states
        self._needs_http = any(isinstance(r, Replica) for r in replicas)
        self._client = client
        self._owned_client: httpx.AsyncClient | None = None
        self._headers = headers
        self._closed = False
        delay = config.hedge_after
        self._model = DelayModel(delay) if isinstance(delay, LearnedDelay) else None
        self._budget = BudgetState(config.budget) if config.budget is not None else None
        self._throttle = ThrottleState(config.throttle) if config.throttle is not None else None
        outlier = config.outlier_detection
        self._ejection_limit = 0 if outlier is None else outlier.ejection_limit(len(states))
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=_TTFT_SAMPLES)
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "requests", "finished", "failed", "attempts", "hedges_sent", "failovers",
                "backup_wins", "budget", "throttle", "no_replica", "failover_throttle",
                "failover_no_replica", "refused_requests", "ejections_capped", "prompt_sent",
                "prompt_resent", "wasted",
            ),
            0,
        )  # fmt: skip

    @property
    def config(self) -> HedgerConfig:
        """The :class:`HedgerConfig`."""
        return self._config

    @property
    def replica_names(self) -> tuple[str, ...]:
        """The replicas' names, in the given order."""
        return tuple(r.name for r in self._replicas)

    # -- lifetime ----------------------------------------------------------------------------

    async def __aenter__(self) -> Hedger:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client the Hedger created (not one you passed). Streams opened later
        raise ``RuntimeError``. Idempotent."""
        self._closed = True
        client, self._owned_client = self._owned_client, None
        if client is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(self._config.close_timeout):
                await client.aclose()

    def _http_client(self) -> httpx.AsyncClient:
        if self._client is not None:
            return self._client
        if self._owned_client is None:
            # Sharded pools: one httpx pool slows superlinearly with many streams (_client.py).
            self._owned_client = make_client()
        return self._owned_client

    # -- requests ----------------------------------------------------------------------------

    def stream(
        self,
        request: Mapping[str, Any] | None,
        *,
        hedge: bool = True,
        side_effects: bool = False,
        idempotency_key: str | None = None,
        prompt_tokens: int | None = None,
        group: str | None = None,
        request_id: str | None = None,
        hedge_after: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> HedgedStream:
        """Open one hedged request: ``async with hedger.stream(body) as s: async for t in s``.

        Args:
            request: the chat-completions JSON body (``model``, ``messages``, …); may be
                ``None`` when every replica is a generic :class:`~trio_hedge.sources.Source`.
            hedge: ``False`` never sends a backup on time for this request (a failed attempt
                still fails over). Default ``True``.
            side_effects: the request does something besides generating text (a tool that
                acts, a billed action). Such a request is never hedged on time unless it has an
                ``idempotency_key``. Default ``False``.
            idempotency_key: sent unchanged on every attempt (HTTP header ``Idempotency-Key``;
                ``AttemptInfo.idempotency_key`` for other sources) so the server can run the
                request once; makes a ``side_effects`` request hedgeable.
            prompt_tokens: the prompt's size in tokens, if known; default estimated from the
                messages at ``chars_per_token`` characters per token.
            group: what the delay is learned per (a model or replica group); default the
                request's ``"model"``, else ``"default"``.
            request_id: the id every attempt carries; default a fresh UUID4.
            hedge_after: this request's hedge delay in seconds (finite, >= 0), instead of the
                learned or configured one; it hedges even when the config's ``hedge_after``
                is ``None``, and ``hedge``/``side_effects`` still rule. The budget and
                throttle still apply. Default ``None`` (the Hedger's delay). A gateway
                bounds what its clients may ask for (``X-Hedge-After``).
            headers: extra HTTP headers sent on every attempt of this request to
                :class:`~trio_hedge.Replica` endpoints, over the replica's own ``headers``
                (a replica's ``api_key`` still wins over an ``Authorization`` given here).
                Values are never shown in reprs or reports. Default none.

        Returns:
            a :class:`~trio_hedge.HedgedStream` (see there for what it raises). Entering it
            also raises :class:`~trio_hedge.ReplicasCooling` when every replica is cooling
            for longer than ``max_pushback_wait`` (nothing is sent).

        Raises:
            RuntimeError: the Hedger was closed.
            TypeError, ValueError: bad arguments (raised here, before any I/O).
        """
        if self._closed:
            raise RuntimeError("this Hedger was closed")
        if request is not None and not isinstance(request, Mapping):
            raise TypeError("request must be the chat-completions JSON body (a mapping) or None")
        if request is None and self._needs_http:
            raise TypeError("request must be the chat-completions JSON body for HTTP replicas")
        if request is not None and self._needs_http:
            check_json_body(request, "request")  # replicas bind lazily: check the body now
        for name, flag in (("hedge", hedge), ("side_effects", side_effects)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, not {flag!r}")
        if idempotency_key is not None:  # sent as a header on every attempt
            check_header_value(idempotency_key, "idempotency_key", allow_empty=False)
        request_delay = _check_request_hedge_after(hedge_after)
        extra_headers = _request_headers(headers)
        if prompt_tokens is not None:
            if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int):
                raise TypeError(f"prompt_tokens must be an int or None, not {prompt_tokens!r}")
            if prompt_tokens < 0:
                raise ValueError(f"prompt_tokens must be >= 0, not {prompt_tokens!r}")
        if group is None:
            model = request.get("model") if request is not None else None
            group = model if isinstance(model, str) and model else "default"
        elif not isinstance(group, str) or not group:
            raise TypeError(f"group must be a non-empty str or None, not {group!r}")
        check_request_id(request_id)
        tokens = prompt_tokens
        if tokens is None and request is not None:
            tokens = estimate_prompt_tokens(request, chars_per_token=self._config.chars_per_token)
        size_class = 0
        if self._model is not None and tokens is not None:
            size_class = self._model.config.classes.of(tokens)
        hedgeable = (
            hedge
            and (not side_effects or idempotency_key is not None)
            and (self._config.hedge_after is not None or request_delay is not None)
        )
        request_id = request_id or str(uuid.uuid4())
        planner = _RequestPlanner(
            self,
            request,
            request_id=request_id,
            group=group,
            size_class=size_class,
            tokens=tokens,
            hedgeable=hedgeable,
            hedge_after=request_delay,
            extra_headers=extra_headers,
        )
        return HedgedStream(
            planner,
            self._policy,
            request_id=request_id,
            prompt_tokens=tokens,
            idempotency_key=idempotency_key,
        )

    def hedge_delay(self, *, prompt_tokens: int = 0, group: str = "default") -> float | None:
        """The hedge delay, in seconds, a request of this size and group would get now
        (``None``: never hedged on time)."""
        delay = self._config.hedge_after
        if delay is None:
            return None
        if self._model is None:
            assert isinstance(delay, (int, float))
            return float(delay)
        size_class = self._model.config.classes.of(prompt_tokens)
        return self._model.delay(group, size_class, trio.current_time(), prompt_tokens)

    # -- statistics --------------------------------------------------------------------------

    def statistics(self) -> HedgerStatistics:
        """A frozen :class:`~trio_hedge.policy.HedgerStatistics` snapshot (call inside Trio)."""
        now = trio.current_time()
        c = self._counts
        horizon = now - self._config.stats_window
        ttfts = [v for t, v in self._ttfts if t >= horizon]
        delays: list[DelayStatistics] = []
        if self._model is not None:
            classes = self._model.config.classes
            for group, index, observations, censored, delay, learned in self._model.describe(now):
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
        decay = self._config.latency_decay
        peak_ewma = self._config.pick == "peak_ewma"
        replicas = tuple(
            ReplicaStatistics(
                name=r.name,
                state="ejected" if r.ejected(now) else "cooling" if r.cooling(now) else "healthy",
                in_flight=r.in_flight,
                attempts=r.attempts,
                wins=r.wins,
                failures=r.failures,
                cooling_for=max(0.0, r.cooling_until - now),
                ejected_for=max(0.0, r.ejected_until - now),
                times_ejected=r.times_ejected,
                consecutive_failures=r.consecutive,
                latency=r.load(now, decay)[0] if peak_ewma else 0.0,
                lingering=len(r.lingering),
            )
            for r in self._replicas
        )
        return HedgerStatistics(
            time=now,
            requests=c["requests"],
            finished=c["finished"],
            failed=c["failed"],
            attempts=c["attempts"],
            hedges_sent=c["hedges_sent"],
            failovers=c["failovers"],
            backup_wins=c["backup_wins"],
            hedges_refused=c["budget"] + c["throttle"] + c["no_replica"],
            budget_refusals=c["budget"],
            throttle_refusals=c["throttle"],
            no_replica_refusals=c["no_replica"],
            failovers_refused=c["failover_throttle"] + c["failover_no_replica"],
            failover_throttle_refusals=c["failover_throttle"],
            failover_no_replica_refusals=c["failover_no_replica"],
            requests_refused=c["refused_requests"],
            ejections_capped=c["ejections_capped"],
            throttle_tokens=None if self._throttle is None else self._throttle.tokens,
            budget_window=None if self._budget is None else self._budget.counts(now),
            prompt_tokens_sent=c["prompt_sent"],
            prompt_tokens_resent=c["prompt_resent"],
            wasted_tokens=c["wasted"],
            ttft_p50=empirical_quantile(ttfts, 0.5),
            ttft_p90=empirical_quantile(ttfts, 0.9),
            ttft_p99=empirical_quantile(ttfts, 0.99),
            delays=tuple(delays),
            replicas=replicas,
            prefill=() if self._model is None else tuple(self._model.fits(now)),
        )

    def samples(self) -> list[dict[str, Any]]:
        """The TTFT observations the delay learner holds now (the last ``window`` seconds,
        at most ``max_samples`` per group and size class), oldest first, as the records
        ``trio-hedge tune`` reads (write one JSON object per line): ``ts`` (Unix time of
        the observation, seconds), ``group``, ``prompt_tokens``, ``replica``, ``attempt``
        (1 for the primary) and either ``ttft`` (seconds from the attempt's start to its
        first token) or ``cancelled_at`` (seconds it ran before it was cancelled without
        one). Empty unless ``hedge_after`` is a :class:`~trio_hedge.LearnedDelay`. Call
        inside Trio.

        Example::

            with open("ttft.jsonl", "w") as f:
                for record in hedger.samples():
                    f.write(json.dumps(record) + "\n")
        """
        if self._model is None:
            return []
        now = trio.current_time()
        offset = time.time() - now  # Trio time to Unix time
        out: list[dict[str, Any]] = []
        for group, (at, seconds, observed, tokens, replica, attempt) in self._model.samples(now):
            record: dict[str, Any] = {
                "ts": round(at + offset, 6),
                "group": group,
                "prompt_tokens": tokens,
                "replica": replica,
                "attempt": attempt,
            }
            record["ttft" if observed else "cancelled_at"] = round(seconds, 6)
            out.append(record)
        return out

    # -- shared decisions (used by the per-request planners) ---------------------------------

    def _pick(self, eligible: list[ReplicaState], now: float) -> ReplicaState:
        pick = self._config.pick
        if pick == "in_order" or len(eligible) == 1:
            return eligible[0]
        if pick == "least_loaded":
            return min(eligible, key=lambda r: (r.in_flight, r.index))
        decay = self._config.latency_decay
        best = eligible[0]
        best_key = (math.inf, 0)
        for r in eligible:
            latency, n = r.load(now, decay)
            key = (latency * (n + 1), n)  # ties: fewer attempts, then the given order
            if key < best_key:
                best, best_key = r, key
        return best

    def _prefill(self, group: str, tokens: int | None, now: float) -> float:
        """The seconds of a TTFT that the group's prefill model puts down to the prompt's
        size: its median for ``tokens`` minus its intercept (0 without a model or a size).
        Beyond the sizes it was fitted on the model grows in proportion to tokens, so a long
        prompt's prefill is predicted even when only short ones were seen."""
        if self._model is None or not tokens:
            return 0.0
        fit = self._model.fit(group, now)
        return 0.0 if fit is None else fit.median(tokens) - fit.intercept

    def _emit(self, event: HedgeEvent) -> None:
        if self.on_event:
            emit(self.on_event, event)

    def _health_failure(
        self,
        replica: ReplicaState,
        now: float,
        reason: str,
        request_id: str,
        group: str,
        *,
        at_once: bool = False,
    ) -> None:
        """Count one failure against ``replica``; eject it if it is due and the fleet-wide
        cap (``max_ejection_percent``, never the last replica) has room."""
        config = self._config.outlier_detection
        if not replica.failure(now, config, at_once=at_once):
            return
        assert config is not None
        ejected = 0
        for r in self._replicas:
            ejected += r.ejected_until > now
        if ejected >= self._ejection_limit:
            self._counts["ejections_capped"] += 1
            return
        replica.eject(now, config)
        self._emit(
            HedgeEvent(
                EventKind.REPLICA_EJECTED,
                now,
                request_id,
                group,
                replica.name,
                reason=reason,
                until=replica.ejected_until,
            )
        )


class _RequestPlanner:
    """The :class:`~trio_hedge.policy.Planner` of one request, backed by its Hedger's shared
    state."""

    def __init__(
        self,
        hedger: Hedger,
        request: Mapping[str, Any] | None,
        *,
        request_id: str,
        group: str,
        size_class: int,
        tokens: int | None,
        hedgeable: bool,
        hedge_after: float | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> None:
        self._h = hedger
        self._request = request
        self._request_id = request_id
        self._group = group
        self._class = size_class
        self._tokens = tokens
        self._hedgeable = hedgeable
        self._hedge_after = hedge_after  # this request's own delay, if it has one
        self._extra_headers = extra_headers
        config = hedger._config
        self._per_replica = config.attempts_per_replica
        self._max_attempts = config.max_attempts
        self._used = [0] * len(hedger._replicas)
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
        return [r for r in self._h._replicas if used[r.index] < limit]

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
        return self._h._pick(ready, now), now, now

    def _bind(self, replica: ReplicaState) -> Source:
        source = self._bound.get(replica.index)
        if source is None:
            target = replica.source
            if isinstance(target, Replica):
                assert self._request is not None
                source = target.bind(
                    self._request,
                    self._h._http_client(),
                    headers=self._h._headers,
                    extra_headers=self._extra_headers,
                )
            else:
                source = target
            self._bound[replica.index] = source
            self._by_source[id(source)] = replica
        return source

    async def next_source(self, number: int, trigger: str) -> Source | None:
        h = self._h
        primary = number == 1
        throttle = h._throttle
        if trigger == "failover" and throttle is not None and not throttle.allows:
            # gRFC A6: at or below half the tokens, no retries either (a primary always goes).
            if self._candidates():
                self._refuse("throttle", trio.current_time(), failover=True)
            return None
        wait = h._config.max_pushback_wait
        deadline = math.inf if wait is None else trio.current_time() + wait
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
                    assert wait is not None  # without a bound, every replica is in reach
                    raise ReplicasCooling(until=beyond, retry_in=beyond - now, max_wait=wait)
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
        model = self._h._model
        if model is None:
            fixed = self._h._config.hedge_after
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
        if replica is not None and self._h._config.pick == "peak_ewma":
            for key, started in replica.waiting.items():
                if key != (self, number) and now - started >= 2.0 * delay:
                    return 0.0
                break  # the first is the oldest
        return delay

    def may_hedge(self) -> bool:
        """Whether a backup may go now. Only checks: the budget is spent when it starts."""
        h = self._h
        candidates = self._candidates()
        if not candidates:
            return True  # nothing left to send: next_source ends the plan; not a refusal
        now = trio.current_time()
        if self._choose(candidates, now, now, primary=False)[0] is None:
            return self._refuse("no_replica", now)  # ejected, cooling or backing off
        if h._throttle is not None and not h._throttle.allows:
            return self._refuse("throttle", now)
        if h._budget is not None and not h._budget.allows(now):
            return self._refuse("budget", now)
        return True

    def _refuse(self, reason: str, now: float, *, failover: bool = False) -> bool:
        """Count and announce a hedge (or failover) not sent, for ``reason``: ``budget``,
        ``throttle`` or ``no_replica``."""
        h = self._h
        h._counts["failover_" + reason if failover else reason] += 1
        kind = EventKind.FAILOVER_REFUSED if failover else EventKind.HEDGE_REFUSED
        h._emit(HedgeEvent(kind, now, self._request_id, self._group, reason=reason))
        return False

    # -- what happened -----------------------------------------------------------------------

    def attempt_changed(self, source: Source, record: AttemptRecord) -> None:
        h = self._h
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
        h._emit(HedgeEvent(kind, now, self._request_id, self._group, replica.name, record=record))

    def _censored(
        self, replica: ReplicaState, record: AttemptRecord, ran: float, now: float
    ) -> None:
        """An attempt cancelled after ``ran`` seconds without a first token: its TTFT is at
        least that (right-censored) for the delay learner and for its replica's latency; and
        its server may still be prefilling it (llama.cpp notices a disconnect only when the
        prefill ends): it counts as in flight there until the prefill model's median for its
        size has passed since it started."""
        h = self._h
        tokens = self._tokens
        model = h._model
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
        if h._config.pick == "peak_ewma":
            excess = ran - h._prefill(self._group, tokens, now)
            replica.observe_latency(now, max(excess, 0.0), h._config.latency_decay)

    def _start(self, replica: ReplicaState, record: AttemptRecord, now: float) -> None:
        h = self._h
        counts = h._counts
        self._started += 1
        self._used[replica.index] += 1
        self._running[record.number] = replica
        replica.waiting[(self, record.number)] = now
        replica.in_flight += 1
        replica.attempts += 1
        counts["attempts"] += 1
        counts["prompt_sent"] += self._tokens or 0
        if record.number == 1:
            counts["requests"] += 1
            if h._budget is not None:
                h._budget.request(now)
        if record.trigger == "hedge":
            counts["hedges_sent"] += 1
            if h._budget is not None:
                h._budget.spend(now)  # spent now it really started, not when checked
            # The attempt before had no first token within the hedge delay. Whether that
            # makes it slow is known only at the end: only if another attempt wins.
            if record.number - 1 in self._running:
                if self._hedged_over is None:
                    self._hedged_over = []
                self._hedged_over.append(record.number - 1)
        elif record.trigger == "failover":
            counts["failovers"] += 1

    def _won(self, replica: ReplicaState, record: AttemptRecord, now: float) -> None:
        h = self._h
        self._winner = replica
        replica.success()
        if h._throttle is not None:
            h._throttle.success()
        replica.waiting.pop((self, record.number), None)
        if record.ttft is not None:  # None: an empty answer won, with no token to time
            model = h._model
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
            if h._config.pick == "peak_ewma":
                excess = record.ttft - h._prefill(self._group, self._tokens, now)
                replica.observe_latency(now, max(excess, 0.0), h._config.latency_decay)
            if record.started_at is not None:
                h._ttfts.append((now, record.started_at + record.ttft))
        if record.trigger == "hedge":
            h._counts["backup_wins"] += 1
        hedged_over, self._hedged_over = self._hedged_over, None
        outlier = h._config.outlier_detection
        if hedged_over is not None and outlier is not None and outlier.count_slow:
            for number in hedged_over:
                slow = self._running.get(number)  # still running: it loses now
                if number != record.number and slow is not None:
                    h._health_failure(slow, now, "slow", self._request_id, self._group)

    def _end(self, number: int) -> None:
        replica = self._running.pop(number, None)
        if replica is not None:
            replica.in_flight -= 1
            replica.waiting.pop((self, number), None)

    def _failed(self, replica: ReplicaState, error: AttemptError, now: float) -> None:
        h = self._h
        if error.retry_after is not None and error.retry_after > 0:
            replica.push_back(now, error.retry_after)
            h._emit(
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
            h._health_failure(
                replica, now, error.kind.value, self._request_id, self._group, at_once=fault
            )
        index = replica.index
        if fault:
            self._used[index] = self._per_replica  # misconfigured: not again in this request
        elif self._used[index] < self._per_replica and h._config.backoff is not None:
            # It may be tried again by this request: not before its back-off has passed.
            backoff = h._config.backoff
            repeat = self._used[index]
            draw = jitter_draw(self._request_id, replica.name, repeat) if backoff.jitter else 1.0
            if self._retry_at is None:
                self._retry_at = {}
            self._retry_at[index] = now + backoff_delay(repeat, backoff, draw)
        if error.retryable and h._throttle is not None:
            h._throttle.failure()

    def request_finished(self, report: Report) -> None:
        if self._finished:
            return
        self._finished = True
        h = self._h
        counts = h._counts
        for number, replica in self._running.items():
            replica.in_flight -= 1
            replica.waiting.pop((self, number), None)
        self._running.clear()
        now = trio.current_time()
        if not report.attempts:
            if isinstance(report.error, ReplicasCooling):
                counts["refused_requests"] += 1
                h._emit(
                    HedgeEvent(
                        EventKind.REQUEST_FINISHED,
                        now,
                        self._request_id,
                        self._group,
                        report=report,
                    )
                )
            return  # else cancelled before anything was sent (e.g. while every replica cooled)
        counts["finished"] += 1
        if report.error is not None:
            counts["failed"] += 1
        error = report.error
        if (
            isinstance(error, StreamInterrupted)
            and self._winner is not None
            and counts_against_replica(error.error)
        ):
            # The winner failed after commit (a stall, a cut): its replica's health suffers.
            h._health_failure(
                self._winner, now, error.error.kind.value, self._request_id, self._group
            )
        counts["wasted"] += report.wasted_tokens
        counts["prompt_resent"] += report.prompt_tokens_resent or 0
        h._emit(
            HedgeEvent(
                EventKind.REQUEST_FINISHED, now, self._request_id, self._group, report=report
            )
        )
