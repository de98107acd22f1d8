"""`LocalKeyLedger`: the in-process [`KeyLedger`][trio_hedge.state.KeyLedger] (one process's
admission leases; a fleet of gateways shares the Redis one instead).

Each key's limits, as [`Quota`][trio_hedge.state.Quota] says them at each call:

* **concurrency**: leases held at once;
* **rate**: a token bucket of ``burst`` requests refilled at ``rate`` per second (full to
  start with; ``burst`` defaults to ``rate`` rounded up, at least 1);
* **tokens per minute**: reserve, then settle. A lease's reservation counts in full while it is
  held (so requests running together cannot overrun the limit between them: LiteLLM's
  concurrent requests went through a 100 TPM limit 6 times, BerriAI/litellm#18730); at its
  settling the usage its answer reported replaces it, and counts for the next 60 s (a sliding
  window kept in 60 one-second slots, so a key's state is bounded whatever its traffic).
  litellm-rs's admission leases (reserve / settle / cancel) are the model.

A refused ``reserve`` changes nothing: the request counts against no limit. Settling or
releasing a lease twice, or one this ledger did not grant, does nothing. Times are Trio's
clock (virtual in tests). State is one entry per key name it is asked about: the caller bounds
the names (the gateway asks only for its configured keys).
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections import deque

import trio

from ._contracts import Lease, Quota, Refusal, StoreStatus

__all__ = ["CONCURRENCY_RETRY_AFTER", "TOKEN_WINDOW", "LocalKeyLedger"]

#: The tokens-per-minute window, in seconds, and its slots (one per second).
TOKEN_WINDOW = 60.0
_SLOTS = 60
_SLOT_WIDTH = TOKEN_WINDOW / _SLOTS
#: A concurrency refusal's ``retry_after``: when one of the key's leases ends is not known in
#: advance, so it is a polling interval (seconds).
CONCURRENCY_RETRY_AFTER = 1.0


class _Key:
    __slots__ = ("bucket", "bucket_at", "held", "in_flight", "slots", "used")

    def __init__(self) -> None:
        self.in_flight = 0
        self.bucket = math.nan  # the rate bucket's tokens (full on first use)
        self.bucket_at = -math.inf
        self.held = 0  # tokens reserved by leases not settled yet
        self.slots: deque[list[int]] = deque()  # [slot index, tokens settled in it]
        self.used = 0  # settled tokens in the window (sum over slots)

    def prune(self, now: float) -> None:
        oldest = math.floor(now / _SLOT_WIDTH) - _SLOTS + 1
        slots = self.slots
        while slots and slots[0][0] < oldest:
            self.used -= slots.popleft()[1]

    def charge(self, now: float, tokens: int) -> None:
        index = math.floor(now / _SLOT_WIDTH)
        slots = self.slots
        if slots and slots[-1][0] == index:
            slots[-1][1] += tokens
        else:
            slots.append([index, tokens])
        self.used += tokens

    def tokens_retry_after(self, now: float, excess: int) -> float:
        """Seconds until ``excess`` settled tokens have left the window (the whole window
        when the leases held now are in the way: their end is not known)."""
        freed = 0
        for index, tokens in self.slots:
            freed += tokens
            if freed >= excess:
                return max(0.0, (index + _SLOTS) * _SLOT_WIDTH - now)
        return TOKEN_WINDOW


def _burst(quota: Quota) -> float:
    if quota.burst is not None:
        return float(quota.burst)
    assert quota.rate is not None
    return float(max(1, math.ceil(quota.rate)))


class LocalKeyLedger:
    """Each key's admission leases in this process (see the module docstring).

    Example:
        ```python
        ledger = LocalKeyLedger()
        quota = Quota(max_concurrent=2, tokens_per_minute=10_000)
        lease = await ledger.reserve("team-a", quota, 1_200)
        if isinstance(lease, Refusal):
            ...  # lease.limit, lease.retry_after
        else:
            try:
                ...  # serve it
            finally:
                await ledger.settle(lease, 830)  # the usage the answer reported
        ```
    """

    def __init__(self) -> None:
        self._keys: dict[str, _Key] = {}
        self._leases: dict[str, tuple[_Key, int]] = {}
        # Lease ids: unique across processes (a random prefix) and cheap (a counter).
        self._prefix = uuid.uuid4().hex[:16]
        self._serial = itertools.count(1)

    @property
    def status(self) -> StoreStatus:
        """Always ``"local"``: nothing is shared."""
        return "local"

    def _key(self, key: str) -> _Key:
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _Key()
        return state

    def reserve_now(self, key: str, quota: Quota, tokens: int) -> Lease | Refusal:
        """`reserve` without a checkpoint (a plain function of the ledger and the clock).

        Raises:
            ValueError: ``tokens`` is negative.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, not {tokens!r}")
        now = trio.current_time()
        state = self._key(key)
        limit = quota.max_concurrent
        if limit is not None and state.in_flight >= limit:
            return Refusal("concurrency", CONCURRENCY_RETRY_AFTER)
        per_minute = quota.tokens_per_minute
        if per_minute is not None:
            state.prune(now)
            excess = state.used + state.held + tokens - per_minute
            if excess > 0:
                return Refusal("tokens", state.tokens_retry_after(now, excess))
        rate = quota.rate
        if rate is not None:
            burst = _burst(quota)
            bucket = burst if math.isnan(state.bucket) else state.bucket
            bucket = min(burst, bucket + (now - state.bucket_at) * rate)
            state.bucket_at = now
            state.bucket = bucket
            if bucket < 1.0:
                return Refusal("rate", (1.0 - bucket) / rate)
            state.bucket = bucket - 1.0
        state.in_flight += 1
        state.held += tokens
        lease = Lease(key, f"{self._prefix}-{next(self._serial)}", tokens)
        self._leases[lease.id] = (state, tokens)
        return lease

    async def reserve(self, key: str, quota: Quota, tokens: int) -> Lease | Refusal:
        """Admit one request of ``key`` holding ``tokens`` (its estimate: prompt plus the
        completion it may ask for), or say which limit refuses it (checked in this order:
        concurrency, tokens, rate) and in how many seconds it could be admitted: for
        concurrency `CONCURRENCY_RETRY_AFTER`, for tokens until enough settled tokens leave
        the window (the whole window when the leases held now are in the way), for the rate
        until the bucket holds one request.

        Raises:
            ValueError: ``tokens`` is negative.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            return self.reserve_now(key, quota, tokens)
        finally:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def settle_now(self, lease: Lease, tokens: int | None) -> None:
        """`settle` without a checkpoint."""
        found = self._leases.pop(lease.id, None)
        if found is None:
            return
        state, reserved = found
        state.in_flight -= 1
        state.held -= reserved
        charged = reserved if tokens is None else max(0, tokens)
        if charged:
            now = trio.current_time()
            state.prune(now)
            state.charge(now, charged)

    async def settle(self, lease: Lease, tokens: int | None) -> None:
        """The request is over and was served: free its slot, and charge ``tokens`` (its
        reported usage; ``None``: unknown, the reservation stands) to the next 60 s."""
        self.settle_now(lease, tokens)  # done before the checkpoint: a cancel loses nothing
        await trio.lowlevel.checkpoint()

    def release_now(self, lease: Lease) -> None:
        """`release` without a checkpoint."""
        found = self._leases.pop(lease.id, None)
        if found is not None:
            state, reserved = found
            state.in_flight -= 1
            state.held -= reserved

    async def release(self, lease: Lease) -> None:
        """The request is over and nothing was served: free its slot and give its reserved
        tokens back (the request still counts against the rate)."""
        self.release_now(lease)  # done before the checkpoint: a cancel loses nothing
        await trio.lowlevel.checkpoint()

    def in_flight(self, key: str) -> int:
        """Leases of ``key`` held now."""
        state = self._keys.get(key)
        return 0 if state is None else state.in_flight

    def tokens(self, key: str) -> tuple[int, int]:
        """``(settled in the last 60 s, reserved by leases held)`` for ``key``."""
        state = self._keys.get(key)
        if state is None:
            return 0, 0
        state.prune(trio.current_time())
        return state.used, state.held
