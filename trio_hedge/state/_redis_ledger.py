"""`RedisKeyLedger`: each gateway key's admission leases, exact across every process of a
fleet (``coredis``, the ``redis`` extra).

Each limit is checked and taken in one Lua script (atomic in Redis), on Redis' own clock:

* **concurrency**: a sorted set of the key's leases, each scored with its expiry. The
  process holding a lease renews it while its request runs (`RedisKeyLedger.run`, every
  third of ``lease_ttl``); a process that dies stops renewing, and its leases expire within
  ``lease_ttl`` seconds (litellm-rs's admission leases: reserve, settle, cancel, expire).
* **request rate**: a token bucket (``burst`` requests, refilled at ``rate`` per second),
  two fields of a hash.
* **tokens per minute**: a hash of tokens by second, summed over the last 60 (a sliding
  window one second fine). A request reserves its estimate at admission; `settle` replaces
  the reservation with the usage its answer reported, `release` gives it back.

Keys (per gateway key name, which comes from the configuration, never from a client):
``{prefix:k:NAME}:l`` (leases), ``:h`` (each lease's reservation), ``:b`` (bucket), ``:t``
(tokens by second); each expires when unused. Redis unreachable: by default the request is
counted by the ``fallback`` ledger (the process's own, `fail open`); with ``fail_closed``
it is refused (``Refusal.limit == "unavailable"``). While Redis is away every call goes
straight to the fallback (no request waits for a timeout), and the renewal loop tries Redis
again every ``interval``.
"""

from __future__ import annotations

import math
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from ._contracts import KeyLedger, Lease, Quota, Refusal, StoreStatus
from ._link import (
    DEFAULT_PREFIX,
    DEFAULT_TIMEOUT,
    MAX_NAME_CHARS,
    Link,
    Unreachable,
    as_str,
    check_prefix,
)

if TYPE_CHECKING:  # pragma: no cover
    import coredis

__all__ = ["RedisKeyLedger"]

#: Seconds a concurrency refusal asks the client to wait (a lease has no known end).
CONCURRENCY_RETRY = 1.0
#: Settlements kept for a retry while Redis is away (the oldest dropped beyond).
MAX_PENDING = 10_000
#: The sliding window of ``tokens_per_minute``, in seconds.
TOKEN_WINDOW = 60

# KEYS: leases, held, bucket, tokens. ARGV: lease id, lease ttl ms, max concurrent (-1: none),
# rate per second (-1: none), burst, tokens per minute (-1: none), tokens.
# -> {1} admitted, or {0, limit, wait ms}.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local leases, held, bucket, window = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, ttl = ARGV[1], tonumber(ARGV[2])
local most, rate, burst = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local limit, tokens = tonumber(ARGV[6]), tonumber(ARGV[7])
local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
for i = 1, #expired do
  redis.call('ZREM', leases, expired[i])
  redis.call('HDEL', held, expired[i])
end
if most >= 0 and redis.call('ZCARD', leases) >= most then
  return {0, 'concurrency', -1}
end
local level
if rate > 0 then
  local b = redis.call('HMGET', bucket, 'level', 'at')
  level = tonumber(b[1]) or burst
  local at = tonumber(b[2]) or now
  if now > at then level = math.min(burst, level + (now - at) * rate / 1000) end
  if level < 1 then
    return {0, 'rate', math.ceil((1 - level) / rate * 1000)}
  end
end
local second = math.floor(now / 1000)
if limit >= 0 then
  local all = redis.call('HGETALL', window)
  local used, live = 0, {}
  for i = 1, #all, 2 do
    local s, v = tonumber(all[i]), tonumber(all[i + 1])
    if s <= second - 60 then
      redis.call('HDEL', window, all[i])
    else
      used = used + v
      live[#live + 1] = {s, v}
    end
  end
  if used + tokens > limit then
    table.sort(live, function(a, b) return a[1] < b[1] end)
    local need, freed, wait = used + tokens - limit, 0, 60000
    for _, e in ipairs(live) do
      freed = freed + e[2]
      if freed >= need then
        wait = (e[1] + 60) * 1000 - now
        break
      end
    end
    return {0, 'tokens', wait}
  end
  redis.call('HINCRBY', window, second, tokens)
  redis.call('PEXPIRE', window, 61000)
end
if rate > 0 then
  redis.call('HSET', bucket, 'level', tostring(level - 1), 'at', now)
  redis.call('PEXPIRE', bucket, math.ceil(burst / rate * 1000) + 1000)
end
redis.call('ZADD', leases, now + ttl, id)
redis.call('HSET', held, id, second .. ':' .. tokens)
redis.call('PEXPIRE', leases, ttl)
redis.call('PEXPIRE', held, ttl)
return {1}
"""

# KEYS: leases, held, tokens. ARGV: lease id, tokens used (-1: the reservation stands).
_SETTLE = """
local rec = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
local used = tonumber(ARGV[2])
if rec and used >= 0 then
  local sep = string.find(rec, ':')
  local second, reserved = string.sub(rec, 1, sep - 1), tonumber(string.sub(rec, sep + 1))
  if redis.call('HEXISTS', KEYS[3], second) == 1 then
    redis.call('HINCRBY', KEYS[3], second, used - reserved)
  end
end
if rec then return 1 end
return 0
"""

# KEYS: leases, held. ARGV: lease ttl ms, lease ids. -> leases renewed.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local renewed = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], now + ttl, ARGV[i])
    renewed = renewed + 1
  end
end
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return renewed
"""


def _limit(quota: Quota, name: str, *, integer: bool) -> float:
    value = getattr(quota, name)
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise TypeError(f"Quota.{name} must be {'an int' if integer else 'a number'} or None")
    if not math.isfinite(value) or value < (1 if integer else 0) or (not integer and value == 0):
        raise ValueError(f"Quota.{name} must be {'>= 1' if integer else '> 0'}, not {value!r}")
    return value


class RedisKeyLedger:
    """A [`KeyLedger`][trio_hedge.state.KeyLedger] shared by every process of a fleet
    through one Redis: a key limited to 10 concurrent requests gets 10 in all, whatever the
    number of gateways (see the module docs).

    Run `run` in a nursery for as long as the ledger is used (it holds the connection and
    renews this process's leases); before it starts and after it stops, the ledger behaves
    as when Redis is unreachable.

    Args:
        url: ``redis://…``, ``rediss://…`` or ``unix://…`` (never shown with its password).
        fallback: the ledger that counts requests while Redis is unreachable (fail open: the
            process's own limits; the default, required unless ``fail_closed``).
        fail_closed: refuse a key's requests while Redis is unreachable
            (``Refusal(limit="unavailable")``) instead of counting them in ``fallback``.
            Default ``False``. A key without limits is always admitted.
        prefix: what every key starts with. Default ``"trio-hedge"``.
        timeout: seconds one Redis call may take, in ``(0, 10]``; beyond it Redis counts as
            unreachable. Default 0.25.
        lease_ttl: seconds a lease lives unless renewed (renewed every third of it while its
            request runs): how long a dead process's requests keep their slots. In
            ``[1, 600]``. Default 15.
        interval: seconds between two tries of an unreachable Redis. Default 0.5.

    Raises:
        TypeError, ValueError: a bad argument (before any I/O), or no ``fallback`` without
            ``fail_closed``.
    """

    def __init__(
        self,
        url: str,
        *,
        fallback: KeyLedger | None = None,
        fail_closed: bool = False,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = DEFAULT_TIMEOUT,
        lease_ttl: float = 15.0,
        interval: float = 0.5,
    ) -> None:
        self._link = Link(url, timeout, "key ledger")
        self._prefix = check_prefix(prefix)
        if not isinstance(fail_closed, bool):
            raise TypeError(f"fail_closed must be a bool, not {fail_closed!r}")
        if fallback is None and not fail_closed:
            raise ValueError("a fallback ledger is needed unless fail_closed=True")
        for name, value, low, high in (
            ("lease_ttl", lease_ttl, 1.0, 600.0),
            ("interval", interval, 0.01, 60.0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be seconds (a number), not {value!r}")
            if not math.isfinite(value) or not low <= value <= high:
                raise ValueError(f"{name} must be seconds in [{low:g}, {high:g}], not {value!r}")
        self._fallback = fallback
        self._fail_closed = fail_closed
        self._ttl_ms = math.ceil(lease_ttl * 1000)
        self._interval = float(interval)
        self._origin = uuid.uuid4().hex[:12]
        self._serial = 0
        self._client: coredis.Redis[str] | None = None
        #: This process's leases in Redis, by key name then lease id (renewed while held).
        self._held: dict[str, set[str]] = {}
        #: Leases the fallback issued (settled there), and leases of keys without limits.
        self._fallen_back: set[str] = set()
        self._unlimited: set[str] = set()
        #: Settlements that did not reach Redis: (lease, tokens), retried by `run`.
        self._pending: deque[tuple[Lease, int | None]] = deque(maxlen=MAX_PENDING)
        self._wake = trio.Event()

    def __repr__(self) -> str:
        return f"RedisKeyLedger({self._link.where!r}, prefix={self._prefix!r})"

    @property
    def status(self) -> StoreStatus:
        """``"ok"`` while Redis answers, ``"degraded"`` otherwise (and before `run`)."""
        return self._link.status

    @property
    def losses(self) -> int:
        """How many times Redis was found unreachable (each logged once)."""
        return self._link.losses

    def _keys(self, name: str) -> list[str]:
        tag = "{" + f"{self._prefix}:k:{name}" + "}"
        return [f"{tag}:l", f"{tag}:h", f"{tag}:b", f"{tag}:t"]

    def _script(self, lua: str) -> Any:
        client = self._client
        assert client is not None
        return self._link.script(client, lua)

    def _usable(self) -> bool:
        return self._client is not None and self._link.status == "ok"

    # -- admission ---------------------------------------------------------------------------

    async def reserve(self, key: str, quota: Quota, tokens: int) -> Lease | Refusal:
        """Admit one request of ``key`` (its configured name) holding ``tokens``, or say
        which limit refuses it and for how long (see `KeyLedger.reserve`).

        Raises:
            TypeError, ValueError: a bad name (empty, over 256 characters), quota or
                ``tokens`` (before any I/O).
        """
        if not isinstance(key, str) or not 0 < len(key) <= MAX_NAME_CHARS:
            raise ValueError(f"key must be a name of 1 to {MAX_NAME_CHARS} characters")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, not {tokens!r}")
        most = _limit(quota, "max_concurrent", integer=True)
        rate = _limit(quota, "rate", integer=False)
        burst = _limit(quota, "burst", integer=True)
        per_minute = _limit(quota, "tokens_per_minute", integer=True)
        if burst < 0:
            burst = max(1, math.ceil(rate)) if rate > 0 else 0
        self._serial += 1
        lease_id = f"{self._origin}-{self._serial}"
        if most < 0 and rate < 0 and per_minute < 0:
            self._unlimited.add(lease_id)  # nothing to count
            return Lease(key, lease_id, tokens)
        if not self._usable():
            return await self._unshared(key, quota, tokens)
        args = [lease_id, self._ttl_ms, most, rate, burst, per_minute, tokens]
        script = self._script(_RESERVE)
        keys = self._keys(key)
        try:
            reply = await self._link.call(lambda: script(keys=keys, args=args))
        except Unreachable as exc:
            self._link.lost(str(exc))
            self._wake.set()
            return await self._unshared(key, quota, tokens)
        if int(reply[0]) == 1:
            self._held.setdefault(key, set()).add(lease_id)
            return Lease(key, lease_id, tokens)
        limit, wait_ms = as_str(reply[1]), int(reply[2])
        retry = CONCURRENCY_RETRY if wait_ms < 0 else wait_ms / 1000
        return Refusal(limit, retry)  # type: ignore[arg-type]

    async def _unshared(self, key: str, quota: Quota, tokens: int) -> Lease | Refusal:
        if self._fail_closed or self._fallback is None:
            return Refusal("unavailable", self._interval)
        answer = await self._fallback.reserve(key, quota, tokens)
        if isinstance(answer, Lease):
            self._fallen_back.add(answer.id)
        return answer

    async def settle(self, lease: Lease, tokens: int | None) -> None:
        """The request was served: free its slot, charge ``tokens`` (``None``: the
        reservation stands). Bounded by ``timeout`` and shielded from the caller's
        cancellation; what does not reach Redis is retried by `run` (and the lease expires
        anyway)."""
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
            raise TypeError(f"tokens must be an int or None, not {tokens!r}")
        await self._end(lease, None if tokens is None else max(0, tokens))

    async def release(self, lease: Lease) -> None:
        """Nothing was served: free its slot and give its tokens back (the request still
        counts against the rate)."""
        await self._end(lease, 0)

    async def _end(self, lease: Lease, tokens: int | None) -> None:
        if lease.id in self._unlimited:
            self._unlimited.discard(lease.id)
            return
        if lease.id in self._fallen_back:
            self._fallen_back.discard(lease.id)
            assert self._fallback is not None
            with trio.CancelScope(shield=True):
                if tokens == 0:
                    await self._fallback.release(lease)
                else:
                    await self._fallback.settle(lease, tokens)
            return
        held = self._held.get(lease.key)
        if held is None or lease.id not in held:
            return  # settled already (or never ours)
        held.discard(lease.id)
        if not held:
            del self._held[lease.key]
        with trio.CancelScope(shield=True):
            if not await self._settle(lease, tokens):
                self._pending.append((lease, tokens))
                self._wake.set()

    async def _settle(self, lease: Lease, tokens: int | None) -> bool:
        if not self._usable():
            return False
        keys = self._keys(lease.key)
        args = [lease.id, -1 if tokens is None else tokens]
        script = self._script(_SETTLE)
        try:
            await self._link.call(lambda: script(keys=[keys[0], keys[1], keys[3]], args=args))
        except Unreachable as exc:
            self._link.lost(str(exc))
            return False
        return True

    # -- the connection and the renewals ----------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the connection, renew this process's leases every third of ``lease_ttl``,
        retry settlements that did not reach Redis, and look whether Redis is there every
        ``interval`` (the status follows). Started at once (never waits for Redis); runs
        until cancelled."""
        task_status.started()
        try:
            while True:
                try:
                    async with self._link.client() as client:
                        self._client = client
                        await self._upkeep()
                except Exception as exc:  # the client's own machinery failed: a new one
                    self._link.lost(self._link.describe(exc))
                finally:
                    self._client = None
                await trio.sleep(self._interval)
        finally:
            self._link.status = "degraded"

    async def _upkeep(self) -> None:
        renew_every = self._ttl_ms / 3000
        next_renewal = trio.current_time()
        client = self._client
        assert client is not None
        while True:
            try:
                if trio.current_time() >= next_renewal:
                    await self._renew()
                    next_renewal = trio.current_time() + renew_every
                else:  # is Redis there? (the status says so even while nothing is held)
                    await self._link.call(client.ping)
                while self._pending:
                    lease, tokens = self._pending[0]
                    if not await self._settle(lease, tokens):
                        break
                    self._pending.popleft()
            except Unreachable as exc:
                self._link.lost(str(exc))
            with trio.move_on_at(min(next_renewal, trio.current_time() + self._interval)):
                await self._wake.wait()
            self._wake = trio.Event()

    async def _renew(self) -> None:
        script = self._script(_RENEW)
        for name, ids in list(self._held.items()):
            if not ids:
                continue
            keys = self._keys(name)[:2]
            args: list[Any] = [self._ttl_ms, *ids]
            await self._link.call(lambda keys=keys, args=args: script(keys=keys, args=args))  # type: ignore[misc]
