"""`RedisFleetStore`: the fleet's slow state shared by every gateway process through Redis
(``coredis``, the ``redis`` extra).

What is kept where (every key under ``{prefix}``, one Redis Cluster hash slot):

* ``{prefix}:e:[fleet, replica, model]`` / ``{prefix}:c:[…]``: an ejection or a cooldown per
  (fleet, replica, model), its expiry the key's TTL (a longer one replaces a shorter one,
  never the reverse);
* ``{prefix}:d:[fleet, group, size_class]``: the learned delay's most recent TTFT samples (a
  list of at most ``max_samples``, each stamped with Redis' own clock, kept ``sample_window``
  seconds);
* ``{prefix}:changes``: a stream of every batch published (at most ``STREAM_LENGTH``
  batches), which each process reads from where it stopped: the changes of the last second
  without reading the state again;
* ``{prefix}:index``: the state keys above by expiry, at most ``max_keys`` (beyond it the
  soonest to expire are deleted), so that no traffic makes the keys grow without bound.

Times cross processes as durations measured on Redis' clock (``TIME`` inside each script):
no process's clock is compared with another's. A process reads the state once when it
starts (and whenever it may have missed part of the stream: Redis restarted, or it was
away), then follows the stream. The batch is written with the state it carries in one Lua
script, so the read of the state and the stream's position agree: what the stream will
bring is skipped in the state, and nothing is applied twice.

Nothing on a request's path waits for Redis: `RedisFleetStore.publish` appends to a bounded
queue, and `RedisFleetStore.run` (the sync loop, in the owner's nursery) sends it and fetches
the other processes' changes every ``interval`` seconds, each call bounded by ``timeout``.
When Redis is unreachable it fails open: ``status`` is ``"degraded"`` (logged once), the
process goes on with its own view, and when Redis is back it sends what is still queued and
reads the state again.
"""

from __future__ import annotations

import functools
import json
import math
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from ._contracts import Cooldown, DelaySample, Ejection, StateChange, StoreStatus
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

__all__ = ["RedisFleetStore"]

#: Seconds between two rounds of the sync loop (send, then fetch): an ejection one process
#: decides reaches the others within about two rounds.
SYNC_INTERVAL = 0.25
#: Batches the change stream keeps (approximately: Redis trims whole blocks).
STREAM_LENGTH = 1000
#: The longest ejection or cooldown shared (seconds); a longer one is shared as this long.
MAX_SHARED_SECONDS = 3600.0
#: Changes sent per script call (a round sends the queue in such batches).
BATCH = 500
#: Stream entries read per call, and calls per round at most.
FETCH = 200
FETCH_CALLS = 20
#: State keys read per call while reading the whole state.
SNAPSHOT_CHUNK = 64

# KEYS: stream, index, then one state key per change. ARGV: origin, stream length, index
# cap, samples kept, sample TTL (ms), the batch (JSON), then (kind, ttl ms, value) per change.
_PUBLISH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*',
    'o', ARGV[1], 't', now, 'v', ARGV[6])
local stamp = id .. '|' .. now .. '|' .. ARGV[1] .. '|'
local keep = tonumber(ARGV[4])
local sample_ttl = tonumber(ARGV[5])
for i = 3, #KEYS do
  local at = 7 + (i - 3) * 3
  local kind, ttl, value = ARGV[at], tonumber(ARGV[at + 1]), ARGV[at + 2]
  local key = KEYS[i]
  local expires
  if kind == 'd' then
    redis.call('LPUSH', key, stamp .. value)
    redis.call('LTRIM', key, 0, keep - 1)
    redis.call('PEXPIRE', key, sample_ttl)
    expires = now + sample_ttl
  else
    local left = redis.call('PTTL', key)
    if left < ttl then
      redis.call('SET', key, stamp .. value, 'PX', ttl)
      left = ttl
    end
    expires = now + left
  end
  redis.call('ZADD', KEYS[2], expires, key)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if extra > 0 then
  local gone = redis.call('ZPOPMIN', KEYS[2], extra)
  for j = 1, #gone, 2 do redis.call('DEL', gone[j]) end
end
return id
"""

# KEYS: stream. ARGV: cursor (an entry id), count. -> now, first id, last id, entries.
_FETCH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local entries = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])
return {now, first[1] and first[1][1] or '', last[1] and last[1][1] or '', entries}
"""

# KEYS: index, stream. -> now, the stream's last id, the live state keys.
_SNAPSHOT_KEYS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
return {now, last[1] and last[1][1] or '', redis.call('ZRANGE', KEYS[1], 0, -1)}
"""

# KEYS: state keys. -> now, then per key {'s', pttl, value} | {'l', values...} | {'n'}.
_SNAPSHOT_VALUES = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
for i = 1, #KEYS do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  if kind == 'string' then
    out[i + 1] = {'s', redis.call('PTTL', KEYS[i]), redis.call('GET', KEYS[i])}
  elseif kind == 'list' then
    local values = redis.call('LRANGE', KEYS[i], 0, -1)
    table.insert(values, 1, 'l')
    out[i + 1] = values
  else
    out[i + 1] = {'n'}
  end
end
return out
"""


def _entry_id(text: str) -> tuple[int, int]:
    """A stream entry id ``ms-seq`` as a comparable pair (``(-1, -1)`` for none)."""
    ms, _, seq = text.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return (-1, -1)


def _name(value: object) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS else None


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _tokens(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def encode(change: StateChange, elapsed: float) -> tuple[str, list[Any], float] | None:
    """``(kind, key parts, ttl seconds)`` and the JSON list of ``change`` ``elapsed`` seconds
    after it was published: remaining seconds for an ejection or cooldown, the sample's age
    for a delay sample. ``None``: nothing to share (expired, or a name too long)."""
    if isinstance(change, DelaySample):
        if not (_name(change.fleet) and _name(change.group) and _name(change.replica)):
            return None
        value = [
            "d",
            change.fleet,
            change.group,
            change.size_class,
            change.seconds,
            1 if change.observed else 0,
            change.tokens,
            change.replica,
            change.age + elapsed,
        ]
        return "d", value, 0.0
    kind = "e" if isinstance(change, Ejection) else "c"
    model = change.model
    if not (_name(change.fleet) and _name(change.replica)) or (
        model is not None and not _name(model)
    ):
        return None
    left = min(change.seconds - elapsed, MAX_SHARED_SECONDS)
    if not left > 0:
        return None
    reason = change.reason[:MAX_NAME_CHARS]
    return kind, [kind, change.fleet, change.replica, model, left, reason], left


def decode(value: object, elapsed: float) -> StateChange | None:
    """The change a JSON list (`encode`'s) says, ``elapsed`` seconds after it was written;
    ``None`` for anything malformed, out of range or expired (another version's, or another
    program's, data must never reach the fleet)."""
    if not isinstance(value, list) or not value:
        return None
    kind = value[0]
    if kind in ("e", "c") and len(value) == 6:
        _, fleet, replica, model, seconds, reason = value
        left = _seconds(seconds)
        if left is None or not isinstance(reason, str):
            return None
        left = min(left, MAX_SHARED_SECONDS) - elapsed
        fleet, replica = _name(fleet), _name(replica)
        if left <= 0 or fleet is None or replica is None:
            return None
        reason = reason[:MAX_NAME_CHARS]
        if kind == "e":
            if model is not None and _name(model) is None:
                return None
            return Ejection(fleet, replica, model, left, reason)
        if _name(model) is None:
            return None
        return Cooldown(fleet, replica, model, left, reason)
    if kind == "d" and len(value) == 9:
        _, fleet, group, size_class, seconds, observed, tokens, replica, age = value
        fleet, group, replica = _name(fleet), _name(group), _name(replica)
        took, ago = _seconds(seconds), _seconds(age)
        if fleet is None or group is None or replica is None or took is None or ago is None:
            return None
        if isinstance(size_class, bool) or not isinstance(size_class, int) or size_class < 0:
            return None
        if observed not in (0, 1) or (tokens is not None and _tokens(tokens) is None):
            return None
        return DelaySample(
            fleet, group, size_class, took, observed == 1, tokens, replica, ago + elapsed
        )
    return None


class RedisFleetStore:
    """A [`FleetStore`][trio_hedge.state.FleetStore] shared by every process of a fleet
    through one Redis (see the module docs for what is kept where).

    Args:
        url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://…`` (TLS) or
            ``unix://…``. Never shown with its password (reprs, logs, errors).
        prefix: what every key starts with (several fleets in one Redis: one prefix each).
            Default ``"trio-hedge"``.
        timeout: seconds one Redis call may take; beyond it Redis counts as unreachable for
            this round. In ``(0, 10]``. Default 0.25.
        interval: seconds between two rounds of the sync loop (send, fetch); at most 1.
            Default 0.25.
        max_queue: changes waiting to be sent at most (the oldest is dropped beyond: while
            Redis is away). Default 10,000.
        max_samples: TTFT samples kept per (fleet, group, size class) in Redis. Default 256.
        sample_window: seconds a sample is kept in Redis (a process reading the state when
            it starts gets the samples of this long). Default 300 (``LearnedDelay.window``'s
            default).
        max_keys: ejection, cooldown and sample keys kept at most (the soonest to expire
            are deleted beyond). Default 4096.

    Raises:
        TypeError, ValueError: a bad argument (before any I/O; never quoting the URL).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = DEFAULT_TIMEOUT,
        interval: float = SYNC_INTERVAL,
        max_queue: int = 10_000,
        max_samples: int = 256,
        sample_window: float = 300.0,
        max_keys: int = 4096,
    ) -> None:
        self._link = Link(url, timeout, "fleet state")
        self._prefix = check_prefix(prefix)
        for name, value, high in (
            ("interval", interval, 1.0),
            ("sample_window", sample_window, MAX_SHARED_SECONDS),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be seconds (a number), not {value!r}")
            if not math.isfinite(value) or not 0 < value <= high:
                raise ValueError(f"{name} must be seconds in (0, {high:g}], not {value!r}")
        for name, count in (
            ("max_queue", max_queue),
            ("max_samples", max_samples),
            ("max_keys", max_keys),
        ):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"{name} must be an int >= 1, not {count!r}")
        self._interval = float(interval)
        self._max_samples = max_samples
        self._sample_window = float(sample_window)
        self._max_keys = max_keys
        tag = "{" + self._prefix + "}"
        self._stream = f"{tag}:changes"
        self._index = f"{tag}:index"
        self._tag = tag
        #: This process's changes are marked with it (and never handed back to it).
        self.origin = uuid.uuid4().hex[:16]
        self._queue: deque[tuple[float, StateChange]] = deque(maxlen=max_queue)
        self._cursor = "0-0"
        self._resync = True
        self._defect: BaseException | None = None
        #: Changes dropped before they were sent (the queue full while Redis was away, a
        #: name too long, expired while waiting); sent to Redis; applied from others.
        self.dropped = 0
        self.sent = 0
        self.applied = 0

    def __repr__(self) -> str:
        return f"RedisFleetStore({self._link.where!r}, prefix={self._prefix!r})"

    @property
    def status(self) -> StoreStatus:
        """``"ok"`` while Redis answers, ``"degraded"`` before the first answer and while it
        does not (the process runs on its own view)."""
        return self._link.status

    @property
    def losses(self) -> int:
        """How many times Redis was found unreachable (each logged once)."""
        return self._link.losses

    def publish(self, change: StateChange) -> None:
        """Queue ``change`` for the other processes (never blocks, never raises; call
        inside Trio)."""
        queue = self._queue
        if len(queue) == queue.maxlen:
            self.dropped += 1
        queue.append((trio.current_time(), change))

    async def run(
        self,
        apply: Callable[[StateChange], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The sync loop (see the module docs): started at once (it never waits for Redis),
        runs until cancelled. ``apply`` gets every change another process published, and
        what the state holds when this process (re)joins; an exception from ``apply`` is a
        defect and propagates."""
        task_status.started()
        while True:
            try:
                async with self._link.client() as client:
                    await self._rounds(client, apply)
            except Exception as exc:  # the client's own machinery failed: a new one
                defect, self._defect = self._defect, None
                if defect is not None:
                    raise defect from None
                self._link.lost(self._link.describe(exc))
                self._resync = True
            await trio.sleep(self._interval)

    async def _rounds(
        self, client: coredis.Redis[str], apply: Callable[[StateChange], None]
    ) -> None:
        while True:
            try:
                if self._resync:
                    await self._snapshot(client, apply)
                await self._send(client)
                await self._fetch(client, apply)
            except Unreachable as exc:
                self._link.lost(str(exc))
                self._resync = True
            await trio.sleep(self._interval)

    def _apply(self, apply: Callable[[StateChange], None], changes: Iterable[StateChange]) -> None:
        for change in changes:
            try:
                apply(change)
            except BaseException as exc:
                self._defect = exc
                raise
            self.applied += 1

    # -- send --------------------------------------------------------------------------------

    async def _send(self, client: coredis.Redis[str]) -> None:
        queue = self._queue
        while queue:
            now = trio.current_time()
            batch: list[tuple[float, StateChange]] = []
            keys = [self._stream, self._index]
            args: list[Any] = []
            values: list[str] = []
            while queue and len(batch) < BATCH:
                queued_at, change = queue.popleft()
                batch.append((queued_at, change))
                encoded = encode(change, now - queued_at)
                if encoded is None:
                    self.dropped += 1
                    continue
                kind, value, ttl = encoded
                if kind == "d" and value[8] > self._sample_window:
                    self.dropped += 1
                    continue
                text = json.dumps(value, separators=(",", ":"))
                values.append(text)
                # The state key: (fleet, replica, model) or (fleet, group, size class).
                keys.append(self._key(kind, value[1:4]))
                args += [kind, max(1, math.ceil(ttl * 1000)), text]
            if not values:
                continue
            head: list[Any] = [
                self.origin,
                STREAM_LENGTH,
                self._max_keys,
                self._max_samples,
                math.ceil(self._sample_window * 1000),
                "[" + ",".join(values) + "]",
            ]
            script = self._link.script(client, _PUBLISH)
            try:
                await self._link.call(functools.partial(script, keys=keys, args=head + args))
            except Unreachable:
                # Back in front, in order (the oldest beyond the queue's bound are dropped):
                # sent when Redis returns, if they have not expired by then.
                queue.extendleft(reversed(batch))
                raise
            self.sent += len(values)

    def _key(self, kind: str, parts: Sequence[Any]) -> str:
        return f"{self._tag}:{kind}:" + json.dumps(list(parts), separators=(",", ":"))

    # -- fetch -------------------------------------------------------------------------------

    async def _fetch(
        self, client: coredis.Redis[str], apply: Callable[[StateChange], None]
    ) -> None:
        script = self._link.script(client, _FETCH)
        for _ in range(FETCH_CALLS):
            cursor = self._cursor
            reply = await self._link.call(
                lambda cursor=cursor: script(keys=[self._stream], args=[cursor, FETCH])  # type: ignore[misc]
            )
            now, first, last, entries = int(reply[0]), as_str(reply[1]), as_str(reply[2]), reply[3]
            position = _entry_id(cursor)
            if position != (0, 0) and (
                not last or _entry_id(last) < position or _entry_id(first) > position
            ):
                # Redis restarted (the stream is gone, or behind us), or it was trimmed past
                # where this process stopped: read the whole state again.
                self._resync = True
                await self._snapshot(client, apply)
                return
            changes: list[StateChange] = []
            for entry in entries:
                entry_id, fields = as_str(entry[0]), entry[1]
                self._cursor = entry_id
                changes += self._entry_changes(fields, now)
            self._apply(apply, changes)
            if len(entries) < FETCH:
                return

    def _entry_changes(self, fields: Any, now: int) -> list[StateChange]:
        """The changes of one stream entry another process published (none of ours)."""
        if isinstance(fields, dict):
            table = {as_str(k): as_str(v) for k, v in fields.items()}
        else:
            flat = [as_str(x) for x in fields]
            table = dict(zip(flat[::2], flat[1::2], strict=False))
        if table.get("o") == self.origin:
            return []
        try:
            stamp = int(table.get("t", ""))
            batch = json.loads(table.get("v", ""))
        except ValueError:
            return []
        if not isinstance(batch, list):
            return []
        elapsed = max(0.0, (now - stamp) / 1000)
        return [c for c in (decode(v, elapsed) for v in batch) if c is not None]

    # -- the whole state ---------------------------------------------------------------------

    async def _snapshot(
        self, client: coredis.Redis[str], apply: Callable[[StateChange], None]
    ) -> None:
        """Read every live key (this process (re)joins), then follow the stream from where
        the state was read: what the stream brings after it is skipped here."""
        keys_script = self._link.script(client, _SNAPSHOT_KEYS)
        reply = await self._link.call(lambda: keys_script(keys=[self._index, self._stream]))
        last = as_str(reply[1]) or "0-0"
        members = [as_str(k) for k in reply[2]]
        cursor = _entry_id(last)
        changes: list[StateChange] = []
        samples: list[DelaySample] = []
        values_script = self._link.script(client, _SNAPSHOT_VALUES)
        for start in range(0, len(members), SNAPSHOT_CHUNK):
            chunk = members[start : start + SNAPSHOT_CHUNK]
            got = await self._link.call(lambda chunk=chunk: values_script(keys=chunk))  # type: ignore[misc]
            now = int(got[0])
            for item in got[1:]:
                for change in self._stored(item, now, cursor):
                    if isinstance(change, DelaySample):
                        samples.append(change)
                    else:
                        changes.append(change)
        samples.sort(key=lambda s: -s.age)  # oldest first, as they were observed
        self._apply(apply, changes)
        self._apply(apply, samples)
        self._cursor = last
        self._resync = False

    def _stored(self, item: Any, now: int, cursor: tuple[int, int]) -> list[StateChange]:
        """The changes one state key holds (``id|stamp|origin|json`` values), without this
        process's own and those the stream will bring (written after ``cursor``)."""
        if not isinstance(item, list) or not item:
            return []
        kind = as_str(item[0])
        if kind == "s" and len(item) == 3:
            ttl_ms, raw = int(item[1]), [item[2]]
        elif kind == "l":
            ttl_ms, raw = -1, item[1:]
        else:
            return []
        out: list[StateChange] = []
        for text in raw:
            parts = as_str(text).split("|", 3)
            if len(parts) != 4 or parts[2] == self.origin or _entry_id(parts[0]) > cursor:
                continue
            try:
                stamp, value = int(parts[1]), json.loads(parts[3])
            except ValueError:
                continue
            if kind == "s" and isinstance(value, list) and len(value) == 6:
                # The key's own TTL says how long it has left: exact, whatever the stamp.
                value = [*value[:4], max(ttl_ms, 0) / 1000, value[5]]
                change = decode(value, 0.0)
            else:
                change = decode(value, max(0.0, (now - stamp) / 1000))
            if change is not None:
                if isinstance(change, DelaySample) and change.age > self._sample_window:
                    continue
                out.append(change)
        return out
