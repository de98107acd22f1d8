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
import math
import time
from collections.abc import Mapping
from typing import Any

import httpx
import trio

from .. import Hedger, Replica
from ._agent import agent_forwarder
from ._config import GatewayConfig
from ._errors import ErrorAnswer
from ._forward import ChatForwarder, Rejected
from ._http import Exchange, Receive, Scope, Send
from ._limits import BodyTooLarge, ClientGone, Draining, Limiter, read_body
from ._metrics import ACCESS_LOGGER, GatewayMetrics

__all__ = ["GatewayApp"]

#: How long ``/v1/models`` waits for the replicas' own lists (seconds).
MODELS_TIMEOUT = 5.0

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

    The caller owns the Hedgers and the client (``serve()`` opens and closes them).
    """

    def __init__(
        self,
        config: GatewayConfig,
        hedgers: Mapping[str, Hedger],
        client: httpx.AsyncClient,
        metrics: GatewayMetrics,
        agent_hedgers: Mapping[str, Mapping[str, Hedger]] | None = None,
    ) -> None:
        self.config = config
        self.limiter = Limiter(config.limits.max_concurrent)
        self.metrics = metrics
        self._hedgers = hedgers
        self._client = client
        self._keys = tuple(k.encode() for k in config.keys)
        self._chat = ChatForwarder(config, hedgers, metrics, config.keys)
        self._forwarders: dict[str, ChatForwarder] = {"/v1/chat/completions": self._chat}
        for api, by_group in (agent_hedgers or {}).items():
            path, forwarder = agent_forwarder(api, config, by_group, metrics, config.keys)
            self._forwarders[path] = forwarder
        self._routes = {**_ROUTES, **dict.fromkeys(self._forwarders, "POST")}
        metrics.watch(hedgers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await _lifespan(receive, send)
            return
        if kind != "http":
            return  # no websockets
        ex = Exchange(scope, receive, send)
        ex.record.started = time.time()
        path = ex.record.path
        try:
            await self._route(ex, path, ex.record.method)
        finally:
            label = path if path in self._routes else "other"
            self.metrics.requests.labels(label, str(ex.record.status)).inc()
            ACCESS_LOGGER.info(ex.record.line())

    async def _route(self, ex: Exchange, path: str, method: str) -> None:
        wanted = self._routes.get(path)
        if wanted is None:
            await ex.error(ErrorAnswer(404, f"no route {path}", code="not_found"))
            return
        if method != wanted:
            answer = ErrorAnswer(405, f"{method} is not allowed on {path}", code="method")
            await ex.error(answer, [(b"allow", wanted.encode())])
            return
        if path.startswith("/v1/") and not self._authorized(ex):
            self.metrics.refused.labels("auth").inc()
            answer = ErrorAnswer(
                401,
                "a valid gateway key is required (Authorization: Bearer …)",
                code="invalid_api_key",
            )
            await ex.error(answer, [(b"www-authenticate", b"Bearer")])
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

    def _authorized(self, ex: Exchange) -> bool:
        if not self._keys:
            return True
        value = ex.headers.get(b"authorization", b"")
        token = value[7:].strip() if value[:7].lower() == b"bearer " else b""
        if not token:  # Anthropic clients send their key as x-api-key
            token = ex.headers.get(b"x-api-key", b"").strip()
        ok = False
        for key in self._keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(token, key)
        return ok

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
        timeout = limits.request_timeout
        deadline_at = math.inf if timeout is None else trio.current_time() + timeout
        try:
            try:
                body = b""
                with trio.move_on_at(deadline_at):  # a client trickling its body holds a slot
                    body = await read_body(ex.receive, limits.max_body_bytes, declared)
                if trio.current_time() >= deadline_at:
                    message = f"the request body took longer than request_timeout={timeout} s"
                    await ex.error(ErrorAnswer(408, message, code="request_timeout"))
                    return
                request, group, options, streaming = forwarder.prepare(ex, body)
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
        groups: dict[str, dict[str, str]] = {}
        eligible = False
        for name, hedger in self._hedgers.items():
            states = {r.name: r.state for r in hedger.statistics().replicas}
            groups[name] = states
            eligible = eligible or any(s == "healthy" for s in states.values())
        draining = self.limiter.draining
        status = "draining" if draining else "ready" if eligible else "no eligible replica"
        data = json.dumps({"status": status, "groups": groups}).encode()
        await ex.json(200 if status == "ready" else 503, data)


async def _lifespan(receive: Receive, send: Send) -> None:
    """ASGI lifespan: nothing to set up (``serve()`` owns the resources)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
