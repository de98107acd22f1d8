"""Limits that protect the fleet: concurrency, body size, and the drain on shutdown."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["BodyTooLarge", "ClientGone", "Draining", "Limiter", "read_body"]

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
    waiting behind this one. While draining, new requests are refused and the ones in flight
    go on until `cancel_all` (the drain timeout) cancels them.
    """

    def __init__(self, max_concurrent: int) -> None:
        self.max_concurrent = max_concurrent
        self.in_flight = 0
        self.draining = False
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

    def start_draining(self) -> None:
        """Refuse new requests from now on."""
        self.draining = True

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
