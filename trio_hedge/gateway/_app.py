"""The gateway's ASGI application: routes, authentication, limits, metrics, access log.

Routes: ``POST /v1/chat/completions`` (``_forward.py``), ``POST /v1/messages`` and
``POST /v1/responses`` (``_agent.py``: the same race in the Anthropic Messages and OpenAI
Responses APIs), ``GET /v1/models`` (the replicas'
lists, merged), ``GET /healthz`` (the process is up), ``GET /readyz`` (ready while not
draining and at least one replica is eligible), ``GET /metrics`` (Prometheus text).
Authentication (when gateway keys are configured) covers ``/v1/*``: ``Authorization: Bearer``
or, as Anthropic clients send it, ``x-api-key``.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any

import httpx
import trio

from .. import Hedger, Replica
from ..policy import ReplicaStatistics
from ..state import FleetStore, KeyLedger
from ._agent import agent_forwarder
from ._config import GatewayConfig, GatewayKey
from ._errors import ErrorAnswer, short
from ._forward import (
    ChatForwarder,
    Rejected,
    _watch_disconnect,
    completion_allowance,
    prompt_estimate,
)
from ._http import Exchange, Receive, Scope, Send
from ._input import priority_from
from ._limits import BodyTooLarge, ClientGone, Draining, Limiter, Refused, Ticket, read_body
from ._metrics import ACCESS_LOGGER, GatewayMetrics

__all__ = ["GatewayApp"]

logger = logging.getLogger("trio_hedge.gateway")

#: How long ``/v1/models`` waits for the replicas' own lists (seconds).
MODELS_TIMEOUT = 5.0
#: How long the body of a request refused for its framing is read before the answer
#: (seconds).
REFUSED_BODY_SECONDS = 5.0

_ROUTES = {
    "/v1/chat/completions": "POST",
    "/v1/models": "GET",
    "/healthz": "GET",
    "/readyz": "GET",
    "/metrics": "GET",
}


def _content_length(ex: Exchange) -> int | None:
    value = ex.header(b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


async def _answer_defect(ex: Exchange) -> None:
    answer = ErrorAnswer(500, "internal error in the gateway", code="internal_error")
    try:
        if not ex.started:
            await ex.error(answer)
        elif not ex.finished:
            await ex.body(answer.event(), more=False)
    except Exception:  # the client is gone: nothing more to tell it
        pass


def _ambiguous(ex: Exchange) -> ErrorAnswer | None:
    """A refusal for a request whose framing or caller is ambiguous: both ``Content-Length``
    and ``Transfer-Encoding`` (a request-smuggling precondition), or a header the gateway
    reads sent twice (which ``Authorization`` counts: the gateway's or a proxy's?)."""
    headers = ex.headers
    if b"transfer-encoding" in headers and b"content-length" in headers:
        message = "a request must not have both Content-Length and Transfer-Encoding"
        return ErrorAnswer(400, message, code="ambiguous_framing", param="Content-Length")
    if ex.duplicate is not None:
        name = ex.duplicate.decode("latin-1")
        return ErrorAnswer(400, f"{name} must be sent once", code="duplicate_header", param=name)
    bearer = _bearer(headers.get(b"authorization", b""))
    key = headers.get(b"x-api-key", b"").strip()
    if bearer and key and not hmac.compare_digest(bearer, key):
        # The gateway reads the bearer token; a proxy or replica may read x-api-key.
        message = "Authorization and x-api-key name two different keys: send one"
        return ErrorAnswer(400, message, code="ambiguous_credentials", param="x-api-key")
    return None


def _bearer(value: bytes) -> bytes:
    """The token of an ``Authorization: Bearer`` value (``b""`` for another scheme)."""
    return value[7:].strip() if value[:7].lower() == b"bearer " else b""


def _no_route(path: str) -> str:
    """The 404 message for ``path``: what to change when a client put ``/v1`` in its base URL
    and an SDK that adds ``/v1`` itself (the Anthropic SDKs) doubled it."""
    message = f"no route {path}"
    if path.startswith("/v1/v1/"):
        message += (
            f" (did you mean {path[3:]}? The Anthropic SDKs add /v1 themselves: give them "
            "base_url='http://HOST:PORT', without /v1; the OpenAI SDKs want "
            "base_url='http://HOST:PORT/v1')"
        )
    return message


class GatewayApp:
    """An ASGI 3 application serving one [`GatewayConfig`][trio_hedge.gateway.GatewayConfig].

    Args:
        config: the configuration.
        hedgers: one long-lived [`Hedger`][trio_hedge.Hedger] per group name.
        client: the ``httpx.AsyncClient`` the Hedgers share (for ``/v1/models``).
        metrics: the `GatewayMetrics` whose hook the Hedgers call.
        agent_hedgers: per API (``"anthropic"``, ``"responses"``), one Hedger per group over
            the same replicas speaking that API (``_agent.py``); an API without them has no
            route (404).
        ledger: where each gateway key's leases are kept (concurrency, rate, tokens per
            minute): a [`KeyLedger`][trio_hedge.state.KeyLedger], shared by a fleet of
            gateways; default a [`LocalKeyLedger`][trio_hedge.state.LocalKeyLedger] (this
            process only). The admission queue itself stays in the process.
        store: the fleet store the Hedgers share their slow state through (``/readyz``
            says its status; ``/metrics`` too). Default none: nothing shared.

    The caller owns the Hedgers, the client and the ledger (``serve()`` opens and closes
    them).
    """

    def __init__(
        self,
        config: GatewayConfig,
        hedgers: Mapping[str, Hedger],
        client: httpx.AsyncClient,
        metrics: GatewayMetrics,
        agent_hedgers: Mapping[str, Mapping[str, Hedger]] | None = None,
        ledger: KeyLedger | None = None,
        *,
        store: FleetStore | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.limiter = Limiter(config, ledger)
        self.metrics = metrics
        metrics.queued.set_function(lambda: self.limiter.queued)
        self._hedgers = hedgers
        #: Every Hedger, by API ("chat" for chat completions) and group: /readyz, /metrics.
        self._all: dict[str, Mapping[str, Hedger]] = {"chat": hedgers, **(agent_hedgers or {})}
        self._client = client
        self._keys = tuple((k.key.encode(), k) for k in config.keys)
        self._by_name = {k.name: k for k in config.keys}
        secrets = [k.key for k in config.keys]
        self._chat = ChatForwarder(config, hedgers, metrics, secrets)
        self._forwarders: dict[str, ChatForwarder] = {"/v1/chat/completions": self._chat}
        #: The ``api`` label of each forwarding route (as the replica-state gauges say it).
        self._api_of = {"/v1/chat/completions": "chat"}
        for api, by_group in (agent_hedgers or {}).items():
            path, forwarder = agent_forwarder(api, config, by_group, metrics, secrets)
            self._forwarders[path] = forwarder
            self._api_of[path] = api
        self._routes = {**_ROUTES, **dict.fromkeys(self._forwarders, "POST")}
        named = [m for g in config.groups for m in g.models if not any(c in m for c in "*?[")]
        # The models the replicas' overrides ask for: what each attempt's tokens count under.
        named += [
            r.overrides["model"]
            for r in config.replicas
            if isinstance(r.overrides.get("model"), str)
        ]
        metrics.watch(self._all, named)
        if store is not None:
            metrics.watch_state({"fleet": store})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await _lifespan(receive, send)
            return
        if kind == "websocket":  # no websockets: refused 403 (a return would be a 500)
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        if kind != "http":
            return
        ex = Exchange(scope, receive, send)
        ex.record.started = time.time()
        path = ex.record.path
        try:
            await self._route(ex, path, ex.record.method)
        except Exception as exc:  # a defect: answered 500, never an empty answer
            logger.error("request %s: %s", ex.record.request_id, type(exc).__name__)
            ex.record.error = "internal_error"
            await _answer_defect(ex)
        finally:
            label = path if path in self._routes else "other"
            record = ex.record
            status = str(record.status)
            self.metrics.requests.labels(label, status).inc()
            if record.ttft is not None and record.group is not None:
                api = self._api_of.get(path, "chat")
                self.metrics.observe_ttft(api, record.group, record.model, record.ttft)
            if ex.record.key is not None:
                self.metrics.key_requests.labels(ex.record.key, status).inc()
            ACCESS_LOGGER.info(ex.record.line())

    def _styled(self, path: str, answer: ErrorAnswer) -> ErrorAnswer:
        """``answer`` in the shape of the API ``path`` speaks (each route answers in its own,
        auth and limits included: a Messages client gets Anthropic's error object)."""
        forwarder = self._forwarders.get(path)
        return answer if forwarder is None else forwarder.style(answer)

    async def _route(self, ex: Exchange, path: str, method: str) -> None:
        refusal = _ambiguous(ex)
        if refusal is not None:
            self.metrics.refused.labels("invalid").inc()
            # Read (and drop) the body first: the server would cut the answer short on
            # seeing bytes after a body it has not finished reading.
            limit = self.config.limits.max_body_bytes
            with trio.move_on_after(REFUSED_BODY_SECONDS), suppress(BodyTooLarge, ClientGone):
                await read_body(ex.receive, limit, None)
            # Then the connection is closed (RFC 9112 section 6.1 for CL + TE): the server
            # and a proxy in front may disagree where this request ends, and which is next.
            await ex.error(self._styled(path, refusal), [(b"connection", b"close")])
            return
        wanted = self._routes.get(path)
        if wanted is None:
            await ex.error(ErrorAnswer(404, _no_route(path), code="not_found"))
            return
        if method != wanted:
            answer = ErrorAnswer(405, f"{method} is not allowed on {path}", code="method")
            await ex.error(self._styled(path, answer), [(b"allow", wanted.encode())])
            return
        if path.startswith("/v1/") and self._keys:
            key = self._caller(ex)
            if key is None:
                self.metrics.refused.labels("auth").inc()
                answer = ErrorAnswer(
                    401,
                    "a valid gateway key is required (Authorization: Bearer …, or x-api-key)",
                    code="invalid_api_key",
                )
                await ex.error(self._styled(path, answer), [(b"www-authenticate", b"Bearer")])
                return
            ex.record.key = key.name
            if path not in self._forwarders:  # a chat request counts at its admission
                over = await self.limiter.take_rate(key.name)
                if over is not None:
                    self.metrics.refused.labels("key_rate").inc()
                    await ex.error(self._styled(path, _key_refusal("key_rate", over.retry_after)))
                    return
        forwarder = self._forwarders.get(path)
        if forwarder is not None:
            await self._forward(ex, forwarder)
        elif path == "/v1/models":
            await self._models(ex)
        elif path == "/healthz":
            await ex.json(200, b'{"status":"ok"}')
        elif path == "/readyz":
            await self._ready(ex)
        else:
            data = self.metrics.render()
            await ex.respond(200, data, [(b"content-type", b"text/plain; version=0.0.4")])

    def _caller(self, ex: Exchange) -> GatewayKey | None:
        """The gateway key the request sends, or ``None``."""
        token = _bearer(ex.headers.get(b"authorization", b""))
        if not token:  # Anthropic clients send their key as x-api-key
            token = ex.headers.get(b"x-api-key", b"").strip()
        found = None
        for secret, key in self._keys:  # every key compared, each in constant time
            if hmac.compare_digest(token, secret):
                found = key
        return found

    def _priority(self, ex: Exchange, forwarder: ChatForwarder) -> int:
        """The request's class: its key's (or the limits') default, or ``X-Priority`` when
        the operator allows it, clamped to the key's range (never below its default).

        Raises:
            Rejected: 400 for an ``X-Priority`` that is not an integer.
        """
        key = self._by_name.get(ex.record.key or "")
        low, high = self.config.priorities(key)
        if not self.config.limits.priority_header:
            return low
        priority = priority_from(ex.header(b"x-priority"), low, high)
        if priority is None:
            answer = ErrorAnswer(
                400, "X-Priority must be an integer", code="invalid_request", param="X-Priority"
            )
            raise Rejected(forwarder.style(answer))
        return priority

    async def _forward(self, ex: Exchange, forwarder: ChatForwarder) -> None:
        """A chat request (every API's): a place in the gateway, its body, its slot from the
        admission queue and its key's lease, the race, then everything given back."""
        limits = self.config.limits
        refused = self.metrics.refused
        declared = _content_length(ex)
        try:
            priority = self._priority(ex, forwarder)
        except Rejected as rejected:
            refused.labels("invalid").inc()
            await ex.error(rejected.answer, [(b"connection", b"close")])
            return
        try:
            ticket = self.limiter.enter(ex.record.key, priority)
        except Draining:
            refused.labels("draining").inc()
            await ex.error(forwarder.style(_draining(limits.retry_after)), _CLOSE)
            return
        except Refused as full:
            refused.labels(full.reason).inc()
            await ex.error(forwarder.style(self._queue_refusal(full)))
            return
        ex.record.priority = priority
        timeout = limits.request_timeout
        deadline_at = math.inf if timeout is None else trio.current_time() + timeout
        try:
            await self._admitted(ex, forwarder, ticket, declared, deadline_at)
        finally:
            await self._done(ex, ticket)

    async def _admitted(
        self,
        ex: Exchange,
        forwarder: ChatForwarder,
        ticket: Ticket,
        declared: int | None,
        deadline_at: float,
    ) -> None:
        limits = self.config.limits
        refused = self.metrics.refused
        try:
            body = None
            # A client trickling its body holds a place: it has body_timeout for it.
            body_by = min(deadline_at, trio.current_time() + (limits.body_timeout or math.inf))
            with trio.move_on_at(body_by):
                body = await read_body(ex.receive, limits.max_body_bytes, declared)
            if body is None:
                name, limit = (
                    ("request_timeout", limits.request_timeout)
                    if body_by == deadline_at
                    else ("body_timeout", limits.body_timeout)
                )
                message = f"the request body took longer than {name}={limit} s"
                # Closed: the rest of the body may still come, and is not a request.
                await ex.error(
                    forwarder.style(ErrorAnswer(408, message, code="request_timeout")), _CLOSE
                )
                return
            request, group, options, streaming = forwarder.prepare(ex, body)
            del body  # parsed: its bytes are not held for the whole request
        except BodyTooLarge:
            refused.labels("body_size").inc()
            message = f"the request body is larger than max_body_bytes={limits.max_body_bytes}"
            await ex.error(forwarder.style(ErrorAnswer(413, message, code="request_too_large")))
            return
        except Rejected as rejected:
            refused.labels("invalid").inc()
            await ex.error(rejected.answer)
            return
        except ClientGone:
            ex.record.status, ex.record.error = 499, "client_disconnected"
            return
        prompt = prompt_estimate(request, group.hedger.chars_per_token)
        reserve = prompt + completion_allowance(request, limits.completion_reserve)
        ex.record.prompt_tokens = prompt  # until the answer reports its own
        key = ex.record.key
        limit = self.limiter.too_many_tokens(key, reserve)
        if limit is not None:
            refused.labels("key_tokens").inc()
            message = (
                f"this request may use {reserve} tokens (its prompt, estimated, and its "
                f"max_tokens), more than this gateway key's tokens_per_minute={limit}: "
                "lower max_tokens"
            )
            answer = ErrorAnswer(429, message, code="tokens_limit_exceeded")
            await ex.error(forwarder.style(answer))
            return
        refusal = None
        try:
            with trio.move_on_at(deadline_at) as waiting:
                if self.limiter.join(ticket, group.name, prompt):
                    await self.limiter.admit(ticket, group.name, prompt, reserve)
                else:
                    refusal = await self._wait_in_queue(ex, ticket, group.name, prompt, reserve)
            if waiting.cancelled_caught:
                refusal = Refused("queue_timeout", None)
        except Refused as refused_now:
            refusal = refused_now
        if ex.record.status == 499:  # the client left while it waited: nothing went upstream
            return
        if refusal is not None:
            refused.labels(refusal.reason).inc()
            await ex.error(forwarder.style(self._queue_refusal(refusal)))
            return
        assert ticket.scope is not None
        metrics = self.metrics
        ex.record.queue_wait = ticket.waited
        metrics.queue_wait.labels(str(ticket.priority)).observe(ticket.waited)
        if key is not None:
            metrics.key_in_flight.labels(key).inc()
        try:
            await forwarder.handle(
                ex,
                request,
                group,
                options,
                streaming,
                ticket.scope,
                deadline_at,
                priority=ticket.priority,
                queued=ticket.waited,
            )
        finally:
            if key is not None:
                metrics.key_in_flight.labels(key).dec()

    async def _wait_in_queue(
        self, ex: Exchange, ticket: Ticket, group: str, prompt: int, reserve: int
    ) -> Refused | None:
        """`Limiter.admit` for a request that waits, watching its client: one that leaves
        gives its place back at once (status 499), not when its turn or ``queue_wait``
        comes."""
        refusal = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, ex, nursery.cancel_scope)
            try:
                await self.limiter.admit(ticket, group, prompt, reserve)
            except Refused as refused:
                refusal = refused
            nursery.cancel_scope.cancel()
        return refusal

    async def _done(self, ex: Exchange, ticket: Ticket) -> None:
        """Give back what the request held; charge its key what it was served."""
        record = ex.record
        served = record.winner is not None or bool(record.tokens)
        prompt = completion = None
        if served:
            prompt = record.prompt_tokens or 0
            completion = record.completion_tokens
            if completion is None:  # no usage reported: the content tokens relayed
                completion = record.tokens or 0
            if record.key is not None:
                self.metrics.key_tokens.labels(record.key).inc(prompt + completion)
        await self.limiter.done(ticket, served=served, prompt=prompt, completion=completion)

    def _queue_refusal(self, refusal: Refused) -> ErrorAnswer:
        """The answer for a request the queue or its key's ledger did not admit."""
        limits = self.config.limits
        retry_after = refusal.retry_after
        reason = refusal.reason
        if reason in ("key_rate", "key_tokens"):
            return _key_refusal(reason, retry_after)
        if reason == "draining":
            return _draining(limits.retry_after)
        if retry_after is None:
            retry_after = limits.retry_after
        if reason == "key_unavailable":
            # [state] fail_closed: the fleet's count of this key cannot be reached, and the
            # operator chose to refuse what it cannot count.
            message = "this gateway key's shared limits cannot be checked now (fail_closed)"
            return ErrorAnswer(
                503, message, code="key_unavailable", retry_after=retry_after, should_retry=True
            )
        if reason == "queue_full":
            message = (
                f"the gateway is full: {limits.max_concurrent} requests running and "
                f"{limits.max_queue} places in its queue taken"
            )
            # Waiting that long, then retrying, is what the queue would have done.
            return ErrorAnswer(
                503,
                message,
                code="queue_full",
                retry_after=retry_after,
                should_retry=short(retry_after),
            )
        message = f"no slot for this request within queue_wait={limits.queue_wait} s"
        # It waited as long as the operator allows: a retry would only queue it again.
        return ErrorAnswer(503, message, code="queue_timeout", retry_after=retry_after)

    async def _models(self, ex: Exchange) -> None:
        """The models this gateway serves: those the replicas' own ``/models`` lists name
        (merged, first seen first) that a group takes and races on a replica that listed
        it, and the group model names that are not patterns. A model a replica lists but
        no group of it takes would be refused (404): it is left out."""
        found: dict[str, dict[str, Any]] = {}
        lists: list[list[dict[str, Any]]] = [[] for _ in self.config.replicas]
        forwarded = ex.header(b"authorization") if self.config.forward_client_key else None

        async def fetch(index: int, replica: Replica) -> None:
            headers = dict(replica.headers)
            if replica.api_key is not None:
                headers["authorization"] = f"Bearer {replica.api_key}"
            elif forwarded:
                headers["authorization"] = forwarded
            with trio.move_on_after(MODELS_TIMEOUT):
                try:
                    response = await self._client.get(f"{replica.base_url}/models", headers=headers)
                    data = response.json().get("data") if response.status_code == 200 else None
                except (httpx.HTTPError, ValueError, AttributeError):
                    return  # this replica's list is missing; the others still count
                if isinstance(data, list):
                    lists[index] = [m for m in data if isinstance(m, dict) and "id" in m]

        async with trio.open_nursery() as nursery:
            for index, replica in enumerate(self.config.replicas):
                nursery.start_soon(fetch, index, replica)
        config = self.config
        for replica, models in zip(config.replicas, lists, strict=True):
            for model in models:
                name = str(model["id"])
                group = config.group_for(name)
                if group is not None and replica.name in group.replicas:
                    found.setdefault(name, model)
        for group in self.config.groups:
            for name in group.models:
                if not any(c in name for c in "*?["):
                    found.setdefault(
                        name, {"id": name, "object": "model", "created": 0, "owned_by": "gateway"}
                    )
        data = json.dumps({"object": "list", "data": list(found.values())}).encode()
        await ex.json(200, data)

    async def _ready(self, ex: Exchange) -> None:
        """``GET /readyz``: `readiness` of every Hedger's statistics, 503 unless ready; and
        ``state``: the shared state's status (``local``, ``ok``, ``degraded``: Redis
        unreachable, this process runs on its own view and stays ready: fail open)."""
        stats = {
            api: {name: hedger.statistics().replicas for name, hedger in by_group.items()}
            for api, by_group in self._all.items()
        }
        status, body = readiness(stats, draining=self.limiter.leaving)
        body["state"] = "local" if self.store is None else self.store.status
        await ex.json(200 if status == "ready" else 503, json.dumps(body).encode())


def readiness(
    stats: Mapping[str, Mapping[str, Sequence[ReplicaStatistics]]], *, draining: bool
) -> tuple[str, dict[str, Any]]:
    """``(status, body)`` of ``/readyz`` from each route's (API's) groups' replica
    statistics: ``"draining"``, ``"ready"`` or ``"no eligible replica"``.

    Ready while not draining and some group has a replica in service (not ejected whole).
    A model out on every replica (a provider's per-model rate limit, a model that failed to
    load) leaves it ready: every instance of a gateway sees the same upstream, so a load
    balancer cannot route around it, and taking every instance out would refuse every
    model's requests, not one's (the request for that model gets its own answer, with
    ``Retry-After``). Such models are listed in the body (``models_out``: group -> models
    with every replica out) as the replica states are. Evidence on any route counts.
    ``groups``: each replica's worst state over the routes, ``apis``: each route's own."""
    apis: dict[str, dict[str, dict[str, str]]] = {}
    groups: dict[str, dict[str, str]] = {}
    out: dict[str, dict[str, set[str]]] = {}  # group -> model -> replicas out for it
    whole: dict[str, set[str]] = {}  # group -> replicas ejected whole
    for api, by_group in stats.items():
        apis[api] = {}
        for name, replicas in by_group.items():
            states = {r.name: r.state for r in replicas}
            apis[api][name] = states
            merged = groups.setdefault(name, {})
            for replica, state in states.items():
                merged[replica] = max(state, merged.get(replica, state), key=_READY_ORDER.index)
            models = out.setdefault(name, {})
            for r in replicas:
                if r.state == "ejected":
                    whole.setdefault(name, set()).add(r.name)
                for model in (*r.cooling_models, *r.ejected_models):
                    models.setdefault(model, set()).add(r.name)
    eligible = any(len(whole.get(name, ())) < len(members) for name, members in groups.items())
    models_out = {}
    for name, members in groups.items():
        down = whole.get(name, set())
        gone = sorted(
            m for m, outs in out.get(name, {}).items() if len(outs | down) >= len(members)
        )
        if gone:
            models_out[name] = gone
    status = "draining" if draining else "ready" if eligible else "no eligible replica"
    return status, {"status": status, "groups": groups, "apis": apis, "models_out": models_out}


_CLOSE = [(b"connection", b"close")]


def _draining(retry_after: float) -> ErrorAnswer:
    # Another instance can take it: the one answer where a retry surely helps.
    return ErrorAnswer(
        503,
        "the gateway is shutting down",
        code="shutdown",
        retry_after=retry_after,
        should_retry=True,
    )


def _key_refusal(reason: str, retry_after: float | None) -> ErrorAnswer:
    """429 for a key over its request rate or its tokens per minute."""
    what = "request rate" if reason == "key_rate" else "tokens per minute"
    code = "rate_limit_exceeded" if reason == "key_rate" else "tokens_limit_exceeded"
    wait = "" if retry_after is None else f": retry in {retry_after:.3g} s"
    return ErrorAnswer(
        429,
        f"this gateway key's {what} is used up{wait}",
        code=code,
        retry_after=retry_after,
        should_retry=short(retry_after),
    )


#: A replica's states, best first: its worst over the routes is its /readyz state.
_READY_ORDER = ("healthy", "degraded", "ejected")


async def _lifespan(receive: Receive, send: Send) -> None:
    """ASGI lifespan: nothing to set up (``serve()`` owns the resources)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
