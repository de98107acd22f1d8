"""`Hedger`: the long-lived, shared hedging policy for production.

An application creates one [`Hedger`][trio_hedge.Hedger] and opens every request through it.
Unlike [`hedged_stream`][trio_hedge.hedged_stream] (one request, a fixed plan), the Hedger keeps
state across requests and consults it at each decision of the race (through the
[`Planner`][trio_hedge.policy.Planner] protocol; the race and stream code are the same):

* **when to hedge** — a delay learned per group and prompt-size class from observed TTFTs,
  censoring-aware ([`LearnedDelay`][trio_hedge.LearnedDelay]), or a fixed number;
* **whether a hedge may be sent** — a ratio budget
  ([`HedgeBudget`][trio_hedge.policy.HedgeBudget]) and a failure throttle
  ([`RetryThrottle`][trio_hedge.policy.RetryThrottle]), checked at the moment; the budget is spent
  when the backup really starts;
* **whether a failover may be sent** — the same throttle (gRFC A6: no retries and no hedges
  at or below half the tokens), a replica that is not ejected, and for a replica this
  request already tried, a back-off ([`Backoff`][trio_hedge.policy.Backoff]);
* **where an attempt goes** — a replica this request has not tried yet before one it has,
  not one cooling after server pushback (``Retry-After``), not one ejected by outlier
  detection ([`OutlierDetection`][trio_hedge.policy.OutlierDetection], which never ejects the whole
  fleet); of the rest, the one with the lowest peak-EWMA cost (Finagle's and Linkerd's balancers):
  its recent TTFT, where a lost race counts as "at least this slow" and an attempt still
  waiting there as "at least this slow now", times one plus its attempts waiting for a first
  token, counting cancelled attempts its server may still be prefilling. If every usable
  replica is cooling, the attempt waits for the earliest, at most ``max_pushback_wait``
  seconds (beyond that the primary raises [`ReplicasCooling`][trio_hedge.ReplicasCooling], a later
  attempt is not sent);
* **what the engines say** (opt-in, ``Replica(..., probe="vllm")``): one poller per probed
  replica, inside ``async with``, reads the engine's queue; a fresh reading's predicted wait
  replaces the peak-EWMA cost, sends a backup at once when the primary's engine says it will
  be slow, and holds one back from a replica predicted no faster; a stale or failing probe
  leaves the Hedger's own view (``docs/policy.md``, "Load probes");
* **whom to blame** — the evidence of the request decides, in one place
  (``policy/_blame.py``, [`Attribution`][trio_hedge.policy.Attribution]): errors that are the
  request's fault never count; a key, quota or "not found" error (401/403, quota, unknown
  model) is its replica's only when another replica served the same request (then that
  replica is ejected for that model), and the request does not try it again either way; an
  attempt counts as slow only when a later attempt of the same request wins after it waited
  the fleet's own delay; pushback and ejections for one model are kept per (replica, model).

Where each part lives: the configuration in ``policy/_config.py``, the state every request
shares (delay learner, budget, throttle, replica health, counters) in ``policy/_fleet.py``,
one request's decisions over it in ``policy/_planner.py``; the Hedger wires them to the race
([`HedgedStream`][trio_hedge.HedgedStream]) and owns the HTTP client.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx
import trio

from ._oneshot import check_replicas, check_request
from ._probing import LoadMonitor, Pollers, probes_of
from ._source import Source
from ._stream import HedgedStream, require_trio
from ._validate import (
    check_header_value,
    check_request_headers,
    check_request_hedge_after,
    check_request_id,
)
from .events import EventHook
from .policy._config import HedgerConfig
from .policy._fleet import FleetState
from .policy._load import ProbeState
from .policy._planner import RequestPlanner, rules_of
from .policy._sizing import estimate_prompt_tokens
from .policy._stats import HedgerStatistics
from .policy._writer import FleetWriter
from .sources._bindable import BindableReplica, is_bindable
from .sources.openai._http import HeaderNames, Replica
from .sources.probes import LoadProbe
from .transport import make_client

__all__ = ["Hedger", "LoadMonitor"]

#: Commits kept for the caller-visible TTFT percentiles in ``statistics()``.
_TTFT_SAMPLES = 4096
#: Cancelled attempts a replica may count as still being prefilled (a memory bound).
_MAX_LINGERING = 1024


def new_request_id() -> str:
    """A random UUID4, as ``str(uuid.uuid4())`` makes it (the same 122 random bits from
    ``os.urandom``), in a third of its time: it is made for every request."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class Hedger:
    """One long-lived hedging policy shared by every request of an application.

    Create it once (``async with Hedger(replicas) as hedger:``, or call
    [`aclose`][trio_hedge.Hedger.aclose] yourself) and open each request with
    [`stream`][trio_hedge.Hedger.stream].

    Args:
        replicas: where attempts go: [`Replica`][trio_hedge.sources.Replica] endpoints,
            [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica]s (your ``AsyncOpenAI``
            clients), both bound to each request, and/or any request-independent
            [`Source`][trio_hedge.sources.Source]; names must be unique. Their order is the
            tie-break (and the preference with ``pick="in_order"``).
        config: a [`HedgerConfig`][trio_hedge.HedgerConfig]; default ``HedgerConfig()``.
        client: an ``httpx.AsyncClient`` for the [`Replica`][trio_hedge.sources.Replica]s, used as
            given and never closed by the Hedger. Without one, the Hedger creates one when a
            ``Replica`` is first used (never when there is none: an ``SDKReplica`` uses its
            own client), one pool and SSL context for all requests, and closes it in
            [`aclose`][trio_hedge.Hedger.aclose].
        headers: which headers carry the request id and attempt number
            ([`HeaderNames`][trio_hedge.sources.HeaderNames]).
        on_event: callbacks receiving a [`HedgeEvent`][trio_hedge.events.HedgeEvent] for every
            attempt started, committed, failed or cancelled, every hedge or failover refused,
            replica cooled or ejected, and request finished. Also the mutable list
            [`on_event`][trio_hedge.Hedger.on_event].
        probes: [`LoadProbe`][trio_hedge.sources.probes.LoadProbe]s (or engine names) by
            replica name, over each [`Replica`][trio_hedge.sources.Replica]'s own ``probe``; a
            replica that is not a ``Replica`` needs a probe with a ``reader``. The probes run
            inside ``async with Hedger(...)``, one poller per replica in the Hedger's own
            nursery (``docs/policy.md``, "Load probes"). Or a
            [`LoadMonitor`][trio_hedge.hedger.LoadMonitor] that several Hedgers share: the
            replicas it probes are read from its pollers (one per replica for all of them),
            the others' own probes polled by this Hedger. Default none: the Hedger decides
            from its own view only, exactly as without this argument.
        fleet_of: another Hedger whose fleet state this one shares: each replica's health,
            cooldowns and ejections, the learned delays, the hedge budget, the throttle and
            the load probes' readings (its pollers). For the same servers reached through
            another API (a gateway's chat, Messages and Responses routes): a replica one
            route found dead is out for the others, and they learn one delay and spend one
            budget. ``replicas`` must have the same names in the same order, ``config``
            must be the other's (default: it is), and ``probes`` must be ``None``. Its
            counters (``statistics()``) are the shared ones. Default ``None``.

    Raises:
        TypeError, ValueError: bad replicas (empty, wrong type, duplicate names), config or
            probes (an unknown replica name, a non-HTTP replica's probe without a reader),
            or a ``fleet_of`` whose replica names or config differ.
    """

    def __init__(
        self,
        replicas: Sequence[Replica | BindableReplica | Source],
        config: HedgerConfig | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        headers: HeaderNames | None = None,
        on_event: Iterable[EventHook] = (),
        probes: Mapping[str, LoadProbe | str] | LoadMonitor | None = None,
        fleet_of: Hedger | None = None,
    ) -> None:
        if fleet_of is not None:
            if not isinstance(fleet_of, Hedger):
                raise TypeError(f"fleet_of must be a Hedger, not {type(fleet_of).__name__}")
            if config is None:
                config = fleet_of.config
            elif config != fleet_of.config:
                raise ValueError("a Hedger sharing another's fleet state must share its config")
            if probes is not None:
                raise ValueError("probes come from the Hedger whose fleet state is shared")
        config = HedgerConfig() if config is None else config
        if not isinstance(config, HedgerConfig):
            raise TypeError(f"config must be a HedgerConfig, not {type(config).__name__}")
        request_checks = check_replicas(replicas)  # also refuses duplicate names
        if client is not None and not isinstance(client, httpx.AsyncClient):
            raise TypeError(f"client must be an httpx.AsyncClient, not {type(client).__name__}")
        if headers is not None and not isinstance(headers, HeaderNames):
            raise TypeError(f"headers must be HeaderNames or None, not {type(headers).__name__}")
        self._config = config
        self._policy = config.stream_policy()
        states: dict[int, LoadProbe | ProbeState] = {}
        if isinstance(probes, LoadMonitor):  # its pollers; the replicas' own probes otherwise
            monitor, own = probes, probes_of(replicas, None)
            for i, replica in enumerate(replicas):
                shared = monitor.shared(replica)
                if shared is not None:
                    states[i] = shared
                    own.pop(i, None)
        else:
            own = probes_of(replicas, probes)
        states.update((i, p) for i, (p, _) in own.items())
        self._fleet: FleetState
        self._writer: FleetWriter
        if fleet_of is not None:
            names = tuple(r.name for r in replicas)
            if names != fleet_of.replica_names:
                raise ValueError(
                    f"replica names {names} differ from the shared fleet's {fleet_of.replica_names}"
                )
            own = {}  # the other Hedger polls them
            self._fleet, self._writer = fleet_of._fleet, fleet_of._writer
            self._fleet.on_event.extend(h for h in on_event if h not in self._fleet.on_event)
        else:
            self._fleet = FleetState(config, replicas, list(on_event), states)
            # The fleet's one writer: every request's verdicts go through it.
            self._writer = FleetWriter(self._fleet)
        #: The replicas requests are bound to, by the fleet's index.
        self._replicas: tuple[Any, ...] = tuple(replicas)
        self._rules = rules_of(self._fleet)  # what the judge reads of the config
        # What of a request only some replicas can answer, by kind of replica.
        rules: set[Callable[[Mapping[str, Any]], tuple[str, ...]]] = set()
        for r in replicas:
            rule = getattr(type(r), "affinities", None)
            if callable(rule):
                rules.add(rule)
        self._affinity_rules = tuple(rules)
        self._own_probes = own
        self._pollers = Pollers()
        # The checks each request must pass (one per kind of replica bound to requests),
        # and the replicas bound to requests (by id: the planner hands the object back).
        self._request_checks = request_checks
        self._bindable = frozenset(id(r) for r in replicas if is_bindable(r))
        self._client = client
        self._owned_client: httpx.AsyncClient | None = None
        self._headers = headers
        self._closed = False

    @property
    def on_event(self) -> list[EventHook]:
        """The ``on_event`` hooks: a list you may change (or replace) at any time."""
        return self._fleet.on_event

    @on_event.setter
    def on_event(self, hooks: list[EventHook]) -> None:
        self._fleet.on_event = hooks

    @property
    def config(self) -> HedgerConfig:
        """The [`HedgerConfig`][trio_hedge.HedgerConfig]."""
        return self._config

    @property
    def replica_names(self) -> tuple[str, ...]:
        """The replicas' names, in the given order."""
        return tuple(r.name for r in self._fleet.replicas)

    # -- lifetime ----------------------------------------------------------------------------

    async def __aenter__(self) -> Hedger:
        require_trio("Hedger")
        if self._own_probes:
            polled = []
            for index, (probe, replica) in self._own_probes.items():
                state = self._fleet.probes[index]
                assert state is not None
                polled.append((state, probe, replica))
            await self._pollers.start(polled, self._http_client, "Hedger")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._pollers.stop()
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
            # Sharded pools: one httpx pool slows superlinearly with many streams (transport.py).
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
            request: the chat-completions request: the JSON body (``model``, ``messages``,
                …) for [`Replica`][trio_hedge.sources.Replica]s, ``chat.completions.create()``'s
                keyword arguments for [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica]s
                (both kinds in one Hedger: a body whose fields are also ``create()``
                arguments); may be ``None`` when every replica is a generic
                [`Source`][trio_hedge.sources.Source].
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
                [`Replica`][trio_hedge.sources.Replica] endpoints, over the replica's own
                ``headers``, and to [`SDKReplica`][trio_hedge.sources.openai_sdk.SDKReplica]s, over
                the request's own ``extra_headers`` (a replica's key still wins over an
                ``Authorization`` given here).
                Values are never shown in reprs or reports. Default none.

        Returns:
            The request's stream (see [`HedgedStream`][trio_hedge.HedgedStream] for what it
            raises). Entering it also raises [`ReplicasCooling`][trio_hedge.ReplicasCooling] when
            every replica is cooling for longer than ``max_pushback_wait`` (nothing is sent).

        Raises:
            RuntimeError: the Hedger was closed.
            TypeError, ValueError: bad arguments (raised here, before any I/O).
        """
        if self._closed:
            raise RuntimeError("this Hedger was closed")
        if self._request_checks:
            # Replicas bind lazily, inside the race: check the request for each kind now.
            request = check_request(request, self._request_checks)
        elif request is not None and not isinstance(request, Mapping):
            raise TypeError("request must be a mapping or None")
        if hedge is not True and hedge is not False:
            raise TypeError(f"hedge must be a bool, not {hedge!r}")
        if side_effects is not True and side_effects is not False:
            raise TypeError(f"side_effects must be a bool, not {side_effects!r}")
        if idempotency_key is not None:  # sent as a header on every attempt
            check_header_value(idempotency_key, "idempotency_key", allow_empty=False)
        request_delay = None if hedge_after is None else check_request_hedge_after(hedge_after)
        extra_headers = None if headers is None else check_request_headers(headers)
        if prompt_tokens is not None:
            if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int):
                raise TypeError(f"prompt_tokens must be an int or None, not {prompt_tokens!r}")
            if prompt_tokens < 0:
                raise ValueError(f"prompt_tokens must be >= 0, not {prompt_tokens!r}")
        model = request.get("model") if request is not None else None
        if not isinstance(model, str) or not model:
            model = None
        if group is None:
            group = model or "default"
        elif not isinstance(group, str) or not group:
            raise TypeError(f"group must be a non-empty str or None, not {group!r}")
        if request_id is not None:
            check_request_id(request_id)
        tokens = prompt_tokens
        if tokens is None and request is not None:
            tokens = estimate_prompt_tokens(request, chars_per_token=self._config.chars_per_token)
        size_class = 0
        if self._fleet.model is not None and tokens is not None:
            size_class = self._fleet.model.config.classes.of(tokens)
        hedgeable = (
            hedge
            and (not side_effects or idempotency_key is not None)
            and (self._config.hedge_after is not None or request_delay is not None)
        )
        request_id = request_id or new_request_id()

        def bind(target: BindableReplica | Source) -> Source:
            """This request's source for a replica: a replica bound to the request (over the
            Hedger's HTTP client, if it needs one), or the request-independent source."""
            if id(target) not in self._bindable:
                return target  # type: ignore[return-value]
            assert request is not None  # checked above
            replica: BindableReplica = target  # type: ignore[assignment]
            client = self._http_client() if replica.needs_http_client else None
            return replica.bind(request, client, headers=self._headers, extra_headers=extra_headers)

        # The context window the request needs: its prompt and the answer it allows.
        context_tokens = tokens
        allowed = None if request is None else request.get("max_completion_tokens")
        if allowed is None and request is not None:
            allowed = request.get("max_tokens")
        if context_tokens is not None and isinstance(allowed, int) and allowed > 0:
            context_tokens += allowed
        affinities: tuple[str, ...] = ()
        if request is not None and self._affinity_rules:
            for rule in self._affinity_rules:
                affinities += tuple(rule(request))
        planner = RequestPlanner(
            self._fleet,
            bind,
            writer=self._writer,
            rules=self._rules,
            replicas=self._replicas,
            affinities=affinities,
            tokens_exact=prompt_tokens is not None,
            request_id=request_id,
            group=group,
            size_class=size_class,
            tokens=tokens,
            hedgeable=hedgeable,
            hedge_after=request_delay,
            model=model,
            context_tokens=context_tokens,
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
        if self._fleet.model is None:
            assert isinstance(delay, (int, float))
            return float(delay)
        size_class = self._fleet.model.config.classes.of(prompt_tokens)
        return self._fleet.model.delay(group, size_class, trio.current_time(), prompt_tokens)

    # -- statistics --------------------------------------------------------------------------

    def statistics(self) -> HedgerStatistics:
        """A frozen [`HedgerStatistics`][trio_hedge.policy.HedgerStatistics] snapshot (call inside
        Trio)."""
        return self._fleet.statistics()

    def samples(self) -> list[dict[str, Any]]:
        """The TTFT observations the delay learner holds now (the last ``window`` seconds,
        at most ``max_samples`` per group and size class), oldest first, as the records
        ``trio-hedge tune`` reads (write one JSON object per line): ``ts`` (Unix time the
        attempt started, seconds), ``group``, ``prompt_tokens``, ``replica``, ``attempt``
        (1 for the primary) and either ``ttft`` (seconds from the attempt's start to its
        first token) or ``cancelled_at`` (seconds it ran before it was cancelled without
        one). Empty unless ``hedge_after`` is a [`LearnedDelay`][trio_hedge.LearnedDelay]. Call
        inside Trio.

        Example:
            ```python
            with open("ttft.jsonl", "w") as f:
                for record in hedger.samples():
                    f.write(json.dumps(record) + "\\n")
            ```
        """
        if self._fleet.model is None:
            return []
        now = trio.current_time()
        offset = time.time() - now  # Trio time to Unix time
        out: list[dict[str, Any]] = []
        for group, (at, seconds, observed, tokens, replica, attempt) in self._fleet.model.samples(
            now
        ):
            record: dict[str, Any] = {
                # The attempt's start, as tune's records have it (``at`` is when the first
                # token or the cancel was observed: one TTFT later).
                "ts": round(at - seconds + offset, 6),
                "group": group,
                "prompt_tokens": tokens,
                "replica": replica,
                "attempt": attempt,
            }
            record["ttft" if observed else "cancelled_at"] = round(seconds, 6)
            out.append(record)
        return out
