"""Limits that protect the fleet: the admission queue (concurrency per gateway, group and
key; priority classes; token-fair order), each key's leases (its ledger: concurrency, rate,
tokens per minute), body size, and the drain on shutdown.

The queue's decisions are ``_queue.py``'s plain functions; this module does what they say:
it parks a request until its turn (or ``queue_wait``), reserves its key's lease, and settles
it when the request ends. The ledger is a [`KeyLedger`][trio_hedge.state.KeyLedger]: the
in-process one by default, a fleet's shared one when given.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from ..state import KeyLedger, Lease, LocalKeyLedger, Quota, Refusal
from ._config import GatewayConfig, GatewayKey
from ._queue import AdmissionState, Capacity, Outcome, Waiter

__all__ = [
    "BodyTooLarge",
    "ClientGone",
    "Draining",
    "Limiter",
    "Refused",
    "Ticket",
    "read_body",
]

Receive = Callable[[], Awaitable[dict[str, Any]]]


class BodyTooLarge(Exception):
    """The request body is larger than the limit (answered 413)."""


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class Draining(Exception):
    """The gateway is shutting down (answered 503)."""


#: How long the ledger may take to settle or release a lease when a request ends (seconds;
#: shielded: the request is over, its slot is freed after).
LEDGER_TIMEOUT = 1.0
#: A key the ledger refused for concurrency is asked again after at most this long (seconds):
#: its slots are held by other gateways, whose releases this one does not see.
MAX_BLOCK = 0.25


class Refused(Exception):
    """A request not admitted: ``reason`` (``queue_full``, ``queue_timeout``, ``draining``,
    ``key_rate``, ``key_tokens``, ``key_unavailable``, ``too_many_tokens``), ``retry_after``
    seconds (``None``: no estimate) and the ledger's ``limit`` when it refused."""

    def __init__(self, reason: str, retry_after: float | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


@attrs.define(eq=False)
class Ticket:
    """One chat request's hold on the gateway: its place (``waiter``), then its slot (the
    cancel scope the drain cancels) and its key's lease.

    Attributes:
        waiter: its state in the queue.
        priority: its class.
        scope: cancelled by the drain timeout (set once admitted).
        lease: its key's lease (``None`` without gateway keys).
        waited: seconds it spent waiting for its slot.
        reserved: the tokens its lease reserved.
    """

    waiter: Waiter
    priority: int
    scope: trio.CancelScope | None = None
    lease: Lease | None = None
    waited: float = 0.0
    reserved: int = 0
    joined: float | None = None  # when it joined the queue (its body read)
    arrived: trio.Event = attrs.Factory(trio.Event)  # set when its outcome changes


def _wake(waiters: list[Waiter]) -> None:
    for waiter in waiters:
        if waiter.wake is not None:
            waiter.wake()


class Limiter:
    """Chat requests in the gateway: their places, the admission queue, each key's ledger,
    and the drain (see the module docstring).

    While leaving (the drain delay) requests are still admitted but ``/readyz`` says
    ``draining``; while draining, new requests are refused and the waiting ones too; the ones
    running go on until `cancel_all` (the drain timeout) cancels them.
    """

    def __init__(self, config: GatewayConfig, ledger: KeyLedger | None = None) -> None:
        limits = config.limits
        self.limits = limits
        self.max_concurrent = limits.max_concurrent
        self.ledger: KeyLedger = LocalKeyLedger() if ledger is None else ledger
        self.quotas = {key.name: self._quota(key) for key in config.keys}
        self.state = AdmissionState(
            Capacity(
                max_concurrent=limits.max_concurrent,
                max_queue=limits.max_queue,
                groups={g.name: g.max_concurrent for g in config.groups},
                keys={name: q.max_concurrent for name, q in self.quotas.items()},
                completion_weight=limits.completion_weight,
                fallback=limits.retry_after,
                horizon=limits.fairness_horizon,
            )
        )
        self.leaving = False  # /readyz answers 503 "draining"
        self.draining = False  # new requests are refused
        self._scopes: set[trio.CancelScope] = set()
        self._cancelled = False

    def _quota(self, key: GatewayKey) -> Quota:
        limits = self.limits
        rate = key.rate or limits.key_rate
        burst = key.burst or limits.key_burst
        if rate is not None and burst is None:
            burst = max(1, math.ceil(rate))
        return Quota(
            max_concurrent=key.max_concurrent or limits.key_max_concurrent,
            rate=rate,
            burst=burst,
            tokens_per_minute=key.tokens_per_minute or limits.key_tokens_per_minute,
        )

    @property
    def in_flight(self) -> int:
        """Chat requests running now."""
        return self.state.running

    @property
    def queued(self) -> int:
        """Chat requests waiting for a slot now."""
        return self.state.waiting_count

    async def take_rate(self, key: str) -> Refusal | None:
        """Count one request of ``key`` (not a chat request: those count at admission)
        against its rate: ``None`` when allowed, else the ledger's refusal."""
        quota = self.quotas[key]
        if quota.rate is None:
            return None
        result = await self.ledger.reserve(key, Quota(rate=quota.rate, burst=quota.burst), 0)
        if isinstance(result, Refusal):
            return result
        with trio.CancelScope(shield=True):
            await self.ledger.release(result)
        return None

    def enter(self, key: str | None, priority: int) -> Ticket:
        """Take a place for a chat request of ``key`` (``None``: no gateway keys) before its
        body is read. Pair with `done`.

        Raises:
            Draining: the gateway is shutting down.
            Refused: ``queue_full``: every place is taken (by requests of keys holding no
                more places than this one's, or of a class no lower).
        """
        if self.draining:
            raise Draining
        now = trio.current_time()
        waiter, pushed_out = self.state.enter(key or "", priority, now)
        _wake(pushed_out)
        if waiter is None:
            raise Refused("queue_full", self.state.retry_after(None, now))
        return Ticket(waiter, priority)

    def too_many_tokens(self, key: str | None, tokens: int) -> int | None:
        """``key``'s tokens per minute when a request of ``tokens`` could never fit it, else
        ``None``."""
        quota = self.quotas.get(key or "")
        limit = None if quota is None else quota.tokens_per_minute
        return limit if limit is not None and tokens > limit else None

    def join(self, ticket: Ticket, group: str, prompt: int) -> bool:
        """``ticket``'s body is read (for ``group``, ``prompt`` tokens, charged to its key's
        count when it is admitted): it joins the queue. Whether it was admitted at once
        (`admit` then only reserves its lease)."""
        waiter = ticket.waiter
        ticket.joined = trio.current_time()

        def wake() -> None:
            ticket.arrived.set()

        waiter.wake = wake
        _wake(self.state.wait(waiter, group, prompt, ticket.joined))
        return waiter.outcome is Outcome.RUNNING

    async def admit(self, ticket: Ticket, group: str, prompt: int, reserve: int) -> None:
        """Wait for a slot (gateway, ``group``, key) for at most ``queue_wait`` seconds from
        `join` (joined here if it has not), in the queue's order, then reserve the key's
        lease of ``reserve`` tokens (``prompt``: the prompt's estimate, charged to the key's
        count). On return the request runs: ``ticket.scope`` is its drain scope.

        Raises:
            Refused: ``queue_timeout`` (with the drain-rate estimate), ``queue_full``
                (pushed out by another key's request), ``draining``, ``key_rate`` or
                ``key_tokens`` (the ledger's refusal and its ``retry_after``).
        """
        state = self.state
        waiter = ticket.waiter
        key = waiter.key
        quota = self.quotas.get(key)
        if ticket.joined is None:
            self.join(ticket, group, prompt)
        assert ticket.joined is not None
        start = ticket.joined
        deadline = start + self.limits.queue_wait
        while True:
            if waiter.outcome is Outcome.WAITING:
                blocked = state.blocked.get(key)
                with trio.move_on_at(deadline if blocked is None else min(deadline, blocked)):
                    await ticket.arrived.wait()
                ticket.arrived = trio.Event()
                now = trio.current_time()
                if waiter.outcome is Outcome.WAITING:
                    if now >= deadline:
                        raise Refused("queue_timeout", state.retry_after(waiter, now))
                    _wake(state.dispatch(now))  # a key's block ended
                    continue
            if waiter.outcome is Outcome.REFUSED:
                raise Refused(waiter.reason or "queue_full", waiter.retry_after or None)
            assert waiter.outcome is Outcome.RUNNING
            ticket.waited = waiter.since - start
            if quota is not None:
                result = await self.ledger.reserve(key, quota, reserve)
                if isinstance(result, Refusal):
                    now = trio.current_time()
                    if result.limit == "concurrency" and now < deadline:
                        # Its slots are held elsewhere: back in line, the key asked again soon.
                        block = min(result.retry_after, MAX_BLOCK)
                        _wake(state.unadmit(waiter, block, now))
                        continue
                    _wake(state.refuse_running(waiter, now))
                    reason = {
                        "concurrency": "queue_timeout",
                        "tokens": "key_tokens",
                        "unavailable": "key_unavailable",  # a shared ledger, fail_closed
                    }.get(result.limit, "key_rate")
                    raise Refused(reason, result.retry_after)
                ticket.lease = result
                ticket.reserved = reserve
            scope = trio.CancelScope()
            if self._cancelled:
                scope.cancel()
            self._scopes.add(scope)
            ticket.scope = scope
            return

    async def done(
        self,
        ticket: Ticket,
        *,
        served: bool = False,
        prompt: int | None = None,
        completion: int | None = None,
    ) -> None:
        """The request is over, whatever happened: its lease settled (``served``: charged
        ``prompt + completion``, what its answer reported or the gateway counted) or released,
        then its slot and place freed and the next requests admitted. Never raises; waits at
        most `LEDGER_TIMEOUT` for the ledger, shielded."""
        if ticket.scope is not None:
            self._scopes.discard(ticket.scope)
        lease, ticket.lease = ticket.lease, None
        if lease is not None:
            tokens = None
            if prompt is not None and completion is not None:
                tokens = prompt + completion
            with trio.CancelScope(shield=True), trio.move_on_after(LEDGER_TIMEOUT):
                try:
                    if served:
                        await self.ledger.settle(lease, tokens)
                    else:
                        await self.ledger.release(lease)
                except Exception:  # a shared ledger failing: the request is over all the same
                    pass
        waiter = ticket.waiter
        waiter.wake = None
        ran = waiter.outcome is Outcome.RUNNING
        _wake(
            self.state.finish(
                waiter,
                trio.current_time(),
                prompt=prompt if ran and served else None,
                completion=completion if ran and served else None,
            )
        )

    def leave(self) -> None:
        """Say ``draining`` on ``/readyz`` from now on; requests are still admitted."""
        self.leaving = True

    def start_draining(self) -> None:
        """Refuse new requests from now on, and the waiting ones."""
        self.leaving = self.draining = True
        _wake(self.state.drain(trio.current_time()))

    def cancel_all(self) -> None:
        """Cancel every request running (the drain timeout passed)."""
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
