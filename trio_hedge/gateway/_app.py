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
from ..state import FleetStore
from ._agent import agent_forwarder
from ._config import GatewayConfig, GatewayKey
from ._errors import ErrorAnswer
from ._forward import ChatForwarder, Rejected
from ._http import Exchange, Receive, Scope, Send
from ._limits import BodyTooLarge, ClientGone, Draining, KeyLimiter, Limiter, read_body
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
        store: the fleet store the Hedgers share their slow state through (``/readyz``
            says its status; ``/metrics`` too). Default none: nothing shared.

    The caller owns the Hedgers and the client (``serve()`` opens and closes them).
    """

    def __init__(
        self,
        config: GatewayConfig,
        hedgers: Mapping[str, Hedger],
        client: httpx.AsyncClient,
        metrics: GatewayMetrics,
        agent_hedgers: Mapping[str, Mapping[str, Hedger]] | None = None,
        *,
        store: FleetStore | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.limiter = Limiter(config.limits.max_concurrent)
        self.metrics = metrics
        self._hedgers = hedgers
        #: Every Hedger, by API ("chat" for chat completions) and group: /readyz, /metrics.
        self._all: dict[str, Mapping[str, Hedger]] = {"chat": hedgers, **(agent_hedgers or {})}
        self._client = client
        self.keys = KeyLimiter(config.keys, config.limits)
        self._keys = tuple((k.key.encode(), k) for k in config.keys)
        secrets = [k.key for k in config.keys]
        self._chat = ChatForwarder(config, hedgers, metrics, secrets)
        self._forwarders: dict[str, ChatForwarder] = {"/v1/chat/completions": self._chat}
        for api, by_group in (agent_hedgers or {}).items():
            path, forwarder = agent_forwarder(api, config, by_group, metrics, secrets)
            self._forwarders[path] = forwarder
        self._routes = {**_ROUTES, **dict.fromkeys(self._forwarders, "POST")}
        named = (m for g in config.groups for m in g.models if not any(c in m for c in "*?["))
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
            status = str(ex.record.status)
            self.metrics.requests.labels(label, status).inc()
            if ex.record.key is not None:
                self.metrics.key_requests.labels(ex.record.key, status).inc()
            ACCESS_LOGGER.info(ex.record.line())

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
            await ex.error(refusal, [(b"connection", b"close")])
            return
        wanted = self._routes.get(path)
        if wanted is None:
            await ex.error(ErrorAnswer(404, f"no route {path}", code="not_found"))
            return
        if method != wanted:
            answer = ErrorAnswer(405, f"{method} is not allowed on {path}", code="method")
            await ex.error(answer, [(b"allow", wanted.encode())])
            return
        if path.startswith("/v1/") and self._keys:
            key = self._caller(ex)
            if key is None:
                self.metrics.refused.labels("auth").inc()
                answer = ErrorAnswer(
                    401,
                    "a valid gateway key is required (Authorization: Bearer …)",
                    code="invalid_api_key",
                )
                await ex.error(answer, [(b"www-authenticate", b"Bearer")])
                return
            ex.record.key = key.name
            wait = self.keys.take(key.name)
            if wait is not None:
                self.metrics.refused.labels("key_rate").inc()
                answer = ErrorAnswer(
                    429,
                    f"this gateway key's request rate is used up: retry in {wait:.3g} s",
                    code="rate_limit_exceeded",
                    retry_after=wait,
                )
                await ex.error(answer)
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

    async def _forward(self, ex: Exchange, forwarder: ChatForwarder) -> None:
        limits = self.config.limits
        refused = self.metrics.refused
        declared = _content_length(ex)
        try:
            admitted = self.limiter.admit()
        except Draining:
            refused.labels("draining").inc()
            answer = ErrorAnswer(
                503, "the gateway is shutting down", code="shutdown", retry_after=limits.retry_after
            )
            await ex.error(answer, [(b"connection", b"close")])
            return
        except trio.WouldBlock:
            refused.labels("concurrency").inc()
            answer = ErrorAnswer(
                503,
                f"too many requests in flight (max_concurrent={limits.max_concurrent})",
                code="overloaded",
                retry_after=limits.retry_after,
            )
            await ex.error(answer)
            return
        key = ex.record.key
        if key is not None and not self.keys.admit(key):
            self.limiter.release(admitted)
            refused.labels("key_concurrency").inc()
            answer = ErrorAnswer(
                429,
                "too many requests in flight for this gateway key",
                code="concurrency_limit_exceeded",
                retry_after=limits.retry_after,
            )
            await ex.error(answer)
            return
        if key is not None:
            self.metrics.key_in_flight.labels(key).inc()
        timeout = limits.request_timeout
        deadline_at = math.inf if timeout is None else trio.current_time() + timeout
        try:
            try:
                body = None
                # A client trickling its body holds a slot: it has body_timeout for it.
                body_by = min(deadline_at, trio.current_time() + (limits.body_timeout or math.inf))
                with trio.move_on_at(body_by):
                    body = await read_body(ex.receive, limits.max_body_bytes, declared)
                if body is None:
                    name, limit = (
                        ("request_timeout", timeout)
                        if body_by == deadline_at
                        else ("body_timeout", limits.body_timeout)
                    )
                    message = f"the request body took longer than {name}={limit} s"
                    # Closed: the rest of the body may still come, and is not a request.
                    await ex.error(
                        ErrorAnswer(408, message, code="request_timeout"),
                        [(b"connection", b"close")],
                    )
                    return
                request, group, options, streaming = forwarder.prepare(ex, body)
                del body  # parsed: its bytes are not held for the whole request
            except BodyTooLarge:
                refused.labels("body_size").inc()
                message = f"the request body is larger than max_body_bytes={limits.max_body_bytes}"
                await ex.error(ErrorAnswer(413, message, code="request_too_large"))
                return
            except Rejected as rejected:
                refused.labels("invalid").inc()
                await ex.error(rejected.answer)
                return
            except ClientGone:
                ex.record.status, ex.record.error = 499, "client_disconnected"
                return
            await forwarder.handle(ex, request, group, options, streaming, admitted, deadline_at)
        finally:
            self.limiter.release(admitted)
            if key is not None:
                self.keys.release(key)
                self.metrics.key_in_flight.labels(key).dec()

    async def _models(self, ex: Exchange) -> None:
        """The replicas' own ``/models`` lists, merged (first seen first), and the group
        model names that are not patterns."""
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
        for models in lists:
            for model in models:
                found.setdefault(str(model["id"]), model)
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
        status, body = readiness(stats, draining=self.limiter.draining)
        body["state"] = "local" if self.store is None else self.store.status
        await ex.json(200 if status == "ready" else 503, json.dumps(body).encode())


def readiness(
    stats: Mapping[str, Mapping[str, Sequence[ReplicaStatistics]]], *, draining: bool
) -> tuple[str, dict[str, Any]]:
    """``(status, body)`` of ``/readyz`` from each route's (API's) groups' replica
    statistics: ``"draining"``, ``"ready"`` or ``"no eligible replica"``.

    Ready while not draining and some group is serving: a replica of it is in service (not
    ejected whole) and no model it has seen has every replica out (ejected or cooling for
    that model). Evidence on any route counts. A replica out for one model only serves the
    others: with replicas serving different models, a failing request per model once took
    the gateway out (readiness reads the scopes). ``groups``: each replica's worst state over
    the routes, ``apis``: each route's own."""
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
    eligible = False
    for name, members in groups.items():
        down = whole.get(name, set())
        if len(down) < len(members) and all(
            len(outs | down) < len(members) for outs in out.get(name, {}).values()
        ):
            eligible = True
    status = "draining" if draining else "ready" if eligible else "no eligible replica"
    return status, {"status": status, "groups": groups, "apis": apis}


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
