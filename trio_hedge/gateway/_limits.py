"""Limits that protect the fleet: concurrency, body size, each key's share, and the drain on
shutdown."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from ._config import GatewayKey, Limits

__all__ = ["BodyTooLarge", "ClientGone", "Draining", "KeyLimiter", "Limiter", "read_body"]

Receive = Callable[[], Awaitable[dict[str, Any]]]


class BodyTooLarge(Exception):
    """The request body is larger than the limit (answered 413)."""


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class Draining(Exception):
    """The gateway is shutting down (answered 503)."""


class Limiter:
    """Chat requests in flight, bounded; and the drain.

    No queue: past ``max_concurrent`` a request is refused at once (503 with
    ``Retry-After``), so a client or load balancer can try another instance instead of
    waiting behind this one. While leaving (the drain delay) requests are still admitted but
    ``/readyz`` says ``draining``; while draining, new requests are refused and the ones in
    flight go on until `cancel_all` (the drain timeout) cancels them.
    """

    def __init__(self, max_concurrent: int) -> None:
        self.max_concurrent = max_concurrent
        self.in_flight = 0
        self.leaving = False  # /readyz answers 503 "draining"
        self.draining = False  # new requests are refused
        self._scopes: set[trio.CancelScope] = set()
        self._cancelled = False

    def admit(self) -> trio.CancelScope:
        """Count one more request in flight; give it a cancel scope the drain timeout
        cancels. Pair with `release`.

        Raises:
            Draining: the gateway is shutting down.
            trio.WouldBlock: ``max_concurrent`` requests are already in flight.
        """
        if self.draining:
            raise Draining
        if self.in_flight >= self.max_concurrent:
            raise trio.WouldBlock
        scope = trio.CancelScope()
        if self._cancelled:
            scope.cancel()
        self.in_flight += 1
        self._scopes.add(scope)
        return scope

    def release(self, scope: trio.CancelScope) -> None:
        """The request admitted with ``scope`` is over."""
        self._scopes.discard(scope)
        self.in_flight -= 1

    def leave(self) -> None:
        """Say ``draining`` on ``/readyz`` from now on; requests are still admitted."""
        self.leaving = True

    def start_draining(self) -> None:
        """Refuse new requests from now on."""
        self.leaving = self.draining = True

    def cancel_all(self) -> None:
        """Cancel every request in flight (the drain timeout passed)."""
        self._cancelled = True
        for scope in list(self._scopes):
            scope.cancel()


async def read_body(receive: Receive, limit: int, declared: int | None) -> bytes:
    """The whole request body, refusing more than ``limit`` bytes (also when the declared
    ``Content-Length`` says so, before reading anything).

    Raises:
        BodyTooLarge: the body is (or says it is) larger than ``limit``.
        ClientGone: the client disconnected first.
    """
    if declared is not None and declared > limit:
        raise BodyTooLarge
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        body += message.get("body", b"")
        if len(body) > limit:
            raise BodyTooLarge
        if not message.get("more_body", False):
            return bytes(body)


class KeyLimiter:
    """Each gateway key's own limits: chat requests in flight, and a request rate (a token
    bucket of ``burst`` requests refilled at ``rate`` per second, Trio time). State is one
    entry per configured key: a client cannot make more of it.
    """

    def __init__(self, keys: Iterable[GatewayKey], limits: Limits) -> None:
        self._keys: dict[str, _KeyState] = {}
        for key in keys:
            concurrent = key.max_concurrent or limits.key_max_concurrent
            rate = key.rate or limits.key_rate
            burst = key.burst or limits.key_burst
            if rate is not None and burst is None:
                burst = max(1, math.ceil(rate))
            self._keys[key.name] = _KeyState(concurrent, rate, float(burst or 0))
        self.in_flight = {name: 0 for name in self._keys}

    def take(self, name: str) -> float | None:
        """Count one request of key ``name`` against its rate: ``None`` when allowed, else
        the seconds until one more would be."""
        state = self._keys[name]
        rate = state.rate
        if rate is None:
            return None
        now = trio.current_time()
        tokens = min(state.burst, state.tokens + (now - state.at) * rate)
        state.at = now
        if tokens >= 1.0:
            state.tokens = tokens - 1.0
            return None
        state.tokens = tokens
        return (1.0 - tokens) / rate

    def admit(self, name: str) -> bool:
        """One more chat request of key ``name`` in flight, unless it is at its limit
        (then ``False``). Pair a ``True`` with `release`."""
        limit = self._keys[name].max_concurrent
        if limit is not None and self.in_flight[name] >= limit:
            return False
        self.in_flight[name] += 1
        return True

    def release(self, name: str) -> None:
        """A chat request of key ``name`` admitted by `admit` is over."""
        self.in_flight[name] -= 1


class _KeyState:
    __slots__ = ("at", "burst", "max_concurrent", "rate", "tokens")

    def __init__(self, max_concurrent: int | None, rate: float | None, burst: float) -> None:
        self.max_concurrent = max_concurrent
        self.rate = rate
        self.burst = burst
        self.tokens = burst  # a full bucket to start with
        self.at = -math.inf
