"""The contracts every shared-state back end keeps (values and protocols; no I/O here).

Times cross process boundaries as *durations* (seconds from now), never as one process's
clock: each process's Trio clock has its own origin (and is virtual in tests). A back end
converts to its store's time (Redis TTLs, wall-clock stamps) and back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import attrs
import trio

__all__ = [
    "Cooldown",
    "DelaySample",
    "Ejection",
    "FleetStore",
    "KeyLedger",
    "Lease",
    "Quota",
    "Refusal",
    "StateChange",
    "StoreStatus",
]

#: ``"local"``: in-process only; ``"ok"``: shared and reachable; ``"degraded"``: shared but
#: unreachable now (the process runs on its local copy and catches up when it returns).
StoreStatus = Literal["local", "ok", "degraded"]


@attrs.frozen
class Ejection:
    """In fleet ``fleet`` (a gateway group's name; a Hedger's own name), ``replica`` is out
    for ``model`` (``None``: for every model) for ``seconds`` from now, for ``reason`` (an
    error kind's value, ``"slow"``, ...).

    Attributes:
        fleet: the fleet view's name (a gateway group).
        replica: the replica's configured name.
        model: the model it is out for; ``None``: every model.
        seconds: how long from now, in seconds.
        reason: why, for logs and metrics.
    """

    fleet: str
    replica: str
    model: str | None
    seconds: float
    reason: str


@attrs.frozen
class Cooldown:
    """``replica`` takes no attempt for ``model`` for ``seconds`` from now (server pushback:
    ``Retry-After``, or the bounded default for a 429 without one).

    Attributes:
        fleet: the fleet view's name (a gateway group).
        replica: the replica's configured name.
        model: the model it cools for.
        seconds: how long from now, in seconds.
        reason: why (an error kind's value), for logs and metrics.
    """

    fleet: str
    replica: str
    model: str
    seconds: float
    reason: str


@attrs.frozen
class DelaySample:
    """One TTFT observation for fleet ``fleet``'s hedge delay learner: ``seconds`` to the
    first token (``observed``) or at least that (a censored sample: cancelled without one),
    ``age`` seconds ago, for a request of learning group ``group`` (by default its model) and
    ``size_class``, with ``tokens`` prompt tokens (``None``: unknown), on ``replica``.

    Attributes:
        fleet: the fleet view's name (a gateway group).
        group: the learning group (by default the request's model).
        size_class: the prompt's size class in the learner.
        seconds: the TTFT, or its lower bound when censored, in seconds.
        observed: ``True``: a first token came; ``False``: censored.
        tokens: the prompt's tokens, ``None`` when unknown.
        replica: the replica's configured name.
        age: how long ago it was observed, in seconds. Default 0.
    """

    fleet: str
    group: str
    size_class: int
    seconds: float
    observed: bool
    tokens: int | None
    replica: str
    age: float = 0.0


StateChange = Ejection | Cooldown | DelaySample


class FleetStore(Protocol):
    """Where the fleet writer's slow state is shared (in-process: nowhere; Redis: every
    gateway process of the fleet)."""

    @property
    def status(self) -> StoreStatus: ...

    def publish(self, change: StateChange) -> None:
        """Queue ``change`` for the other processes. Never blocks and never raises: the
        queue is bounded (the oldest change is dropped when full) and nothing on a request's
        path waits for the store."""
        ...

    async def run(
        self,
        apply: Callable[[StateChange], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The sync loop, run in a nursery the owner opens: sends what was published, fetches
        what the other processes published (at least every second) and hands each of theirs
        to ``apply`` (the writer; never this process's own). Fails open: an unreachable store
        makes ``status`` ``"degraded"``, never an exception out of here."""
        ...


@attrs.frozen
class Quota:
    """One key's limits (``None``: unlimited): requests in flight, a request rate (a token
    bucket of ``burst`` refilled at ``rate`` per second) and tokens per minute (prompt plus
    completion, a sliding 60 s window).

    Attributes:
        max_concurrent: requests in flight at once.
        rate: requests per second, refilling the bucket.
        burst: requests at once beyond ``rate`` (the bucket's size).
        tokens_per_minute: prompt plus completion tokens per sliding minute.
    """

    max_concurrent: int | None = None
    rate: float | None = None
    burst: int | None = None
    tokens_per_minute: int | None = None


@attrs.frozen
class Lease:
    """An admitted request's hold on its key's quota: one concurrency slot, one request of
    the rate, ``tokens`` reserved of the minute's tokens, until settled or released.

    Attributes:
        key: the key's configured name, never the key itself.
        id: this lease, unique in the fleet.
        tokens: the tokens reserved.
    """

    key: str
    id: str
    tokens: int


@attrs.frozen
class Refusal:
    """Why a key's request is not admitted now, and in how many seconds it could be.

    Attributes:
        limit: the limit that refuses it; ``"unavailable"``: a shared ledger that cannot
            count now (Redis unreachable) and is configured to refuse then (``fail_closed``).
        retry_after: seconds until a retry could be admitted (an estimate, >= 0).
    """

    limit: Literal["concurrency", "rate", "tokens", "unavailable"]
    retry_after: float


class KeyLedger(Protocol):
    """Each key's admission leases (in-process, or shared by a fleet's gateways)."""

    @property
    def status(self) -> StoreStatus: ...

    async def reserve(self, key: str, quota: Quota, tokens: int) -> Lease | Refusal:
        """Admit one request of ``key`` holding ``tokens`` (its estimate: prompt plus the
        completion it may ask for), or say which limit refuses it and for how long."""
        ...

    async def settle(self, lease: Lease, tokens: int | None) -> None:
        """The request is over and was served: free its slot and charge ``tokens`` (the usage
        its answer reported; ``None``: unknown, the reservation stands) in place of the
        reservation."""
        ...

    async def release(self, lease: Lease) -> None:
        """The request is over and nothing was served: free its slot and give its reserved
        tokens back (the request still counts against the rate)."""
        ...
