"""The admission queue's decisions: plain functions of its state and an event, returning what
to do (httpcore's pool decides on its state and returns what to close; the I/O happens after,
in ``_limits.py``). No clock is read here: every call is given ``now``.

What it decides:

* **places**: at most ``max_concurrent + max_queue`` chat requests are in the gateway at once
  (running, waiting, or reading their body). A request arriving when they are all taken is
  refused, unless its key has fewer places than the key with the most (by more than one), or
  a higher class than some waiting request: then that key's newest waiting request of the
  lowest class is refused instead (longest queue drop), so no key can take every place.
* **who runs next**: a waiting request may run when the gateway, its group and its key each
  have a slot. Of those that may, the highest priority class first; within a class, the
  request whose key has received the fewest weighted tokens recently (the Virtual Token
  Counter of Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024: prompt
  tokens charged at admission, ``completion_weight`` times the completion when the answer
  reports it); on a tie, the key with fewer requests running; then arrival order.
  Work-conserving: a slot is never left idle while a request that may use it waits, whatever
  its class or key.

  "Recently": each key's count decays exponentially (``horizon`` seconds), where VTC lifts a
  key joining the backlog to the smallest counter of the keys already waiting. The lift
  gives a key back from idle no credit at all, but it also puts a key sending far below its
  share level with the flood whenever it has a request waiting: each second request of its
  bursts waits behind one of the flood's (``benchmarks/fairness.py --virtual``: the light
  key's P99 wait 0.32-0.35 s with the lift, 0.20-0.26 s, the next slot to free, with the
  decay). The decay's price: a key back from idle goes first until its count catches up,
  about 0.6 × ``horizon`` of the fleet if it floods (1.2 s at the default 2 s; measured
  with two flooding keys). ``horizon=None`` restores the lift and every token counted.
* **Retry-After**: from the queue's drain rate, by Little's law (requests running over the
  mean time one runs, an EWMA of those that finished): a refused request's place in the
  order over that rate (``fallback`` seconds before any request has finished).
"""

from __future__ import annotations

import enum
import math
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import TypeVar

import attrs

_T = TypeVar("_T")

__all__ = ["AdmissionState", "Capacity", "Outcome", "Waiter"]

#: The weight of the newest finished request in the mean service time (an EWMA).
SERVICE_WEIGHT = 0.2
#: The longest Retry-After the queue estimates (seconds).
MAX_RETRY_AFTER = 3600.0
#: A key refused by its ledger for concurrency (its slots held by other gateways) is not
#: tried again for at least this long (seconds).
MIN_BLOCK = 0.05


def _down(counter: Counter[_T], name: _T) -> None:
    """One less of ``name``; none left, no entry (the counters stay as small as the queue)."""
    counter[name] -= 1
    if not counter[name]:
        del counter[name]


class TokenCounters:
    """Each key's weighted tokens received. With a ``horizon`` (seconds), recent ones: a token
    received ``t`` seconds ago counts ``exp(-t / horizon)`` (exponential decay, so a key's
    count is about its tokens per second times ``horizon``); without one, every token ever
    (VTC's counters, which need its lift)."""

    __slots__ = ("_horizon", "_values")

    def __init__(self, horizon: float | None) -> None:
        self._horizon = horizon
        self._values: dict[str, tuple[float, float]] = {}  # key -> (count, as of when)

    def get(self, key: str, now: float) -> float:
        found = self._values.get(key)
        if found is None:
            return 0.0
        value, at = found
        horizon = self._horizon
        if horizon is None or now <= at:
            return value
        return value * math.exp((at - now) / horizon)

    def set(self, key: str, value: float, now: float) -> None:
        self._values[key] = (value, now)

    def add(self, key: str, tokens: float, now: float) -> None:
        self._values[key] = (self.get(key, now) + tokens, now)

    def items(self, now: float) -> dict[str, float]:
        return {key: self.get(key, now) for key in self._values}


class Outcome(str, enum.Enum):
    """Where a request is in the queue."""

    READING = "reading"  # has a place, its body is being read
    WAITING = "waiting"
    RUNNING = "running"  # admitted: holds its gateway, group and key slots
    REFUSED = "refused"  # refused while waiting: ``reason`` says why
    GONE = "gone"  # left: finished, timed out, cancelled


@attrs.define(eq=False, slots=True)
class Waiter:
    """One chat request in the gateway (mutable: the state below changes it).

    Attributes:
        seq: its arrival order (unique).
        key: its gateway key's name (``""`` without gateway keys).
        priority: its class, 0 to 9 (higher first).
        arrived: when it took its place (the caller's clock, seconds).
        group: its group, once its body is read.
        tokens: its prompt tokens (estimated), charged to its key's counter at admission.
        outcome: where it is now.
        reason: why it was refused (``"queue_full"``, ``"draining"``), or ``None``.
        retry_after: the estimate given with a refusal, seconds.
        since: when it began waiting, or was admitted.
        wake: called (by the caller's layer) when its outcome changes while it waits.
        mark: when it first joined the queue: the requests waiting ahead of it on the
            gateway, its group and its key, and those admitted under each until then.
    """

    seq: int
    key: str
    priority: int
    arrived: float
    group: str | None = None
    tokens: int = 0
    outcome: Outcome = Outcome.READING
    reason: str | None = None
    retry_after: float = 0.0
    since: float = 0.0
    wake: Callable[[], None] | None = None
    mark: tuple[int, int, int, int, int, int] | None = None


@attrs.frozen
class Capacity:
    """The queue's limits (``None``: none).

    Attributes:
        max_concurrent: requests running in the gateway.
        max_queue: places beyond ``max_concurrent``.
        groups: requests running per group.
        keys: requests running per key.
        completion_weight: a completion token's weight in the key counters.
        fallback: the Retry-After before any request has finished (seconds).
        fair: ``False``: arrival order within a class, the key counters not looked at
            (first come, first served: ``benchmarks/fairness.py``'s control).
        horizon: how recent the tokens the order counts are (seconds, the decay's time
            constant); ``None``: every token, with VTC's counter lift.
    """

    max_concurrent: int
    max_queue: int
    groups: Mapping[str, int | None] = attrs.field(factory=dict)
    keys: Mapping[str, int | None] = attrs.field(factory=dict)
    completion_weight: float = 2.0
    fallback: float = 1.0
    fair: bool = True
    horizon: float | None = 2.0


class AdmissionState:
    """The queue (see the module docstring). Each method takes ``now`` and returns the
    waiters whose outcome it changed besides the one it was called for (admitted, or
    refused to make room); the caller wakes them."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.places = 0
        self.places_by_key: Counter[str] = Counter()
        self.running = 0
        self.running_by_group: Counter[str] = Counter()
        self.running_by_key: Counter[str] = Counter()
        # priority class -> key -> its waiting requests, in arrival order
        self.waiting: dict[int, dict[str, deque[Waiter]]] = {}
        self.waiting_count = 0
        self.waiting_by_key: Counter[str] = Counter()
        #: The Virtual Token Counter of each key (weighted tokens received).
        self.tokens = TokenCounters(capacity.horizon)
        self._last_admitted: str | None = None
        #: The mean time a request runs (seconds), ``None`` before one finished.
        self.service: float | None = None
        #: Requests admitted, in all, per group and per key (for the drain estimates).
        self.admitted = 0
        self.admitted_by_group: Counter[str] = Counter()
        self.admitted_by_key: Counter[str] = Counter()
        self.waiting_by_group: Counter[str] = Counter()
        self.waiting_by_priority: Counter[int] = Counter()
        #: Keys their ledger refused for concurrency, until when.
        self.blocked: dict[str, float] = {}
        self.draining = False
        self._seq = 0

    # -- arriving ------------------------------------------------------------------------------

    def enter(self, key: str, priority: int, now: float) -> tuple[Waiter | None, list[Waiter]]:
        """A request arrives: ``(its waiter, holding a place, or None: refused; the waiters
        refused to make room for it)``."""
        self._seq += 1
        waiter = Waiter(self._seq, key, priority, now, since=now)
        cap = self.capacity
        if self.draining:
            return None, []
        if self.places < cap.max_concurrent + cap.max_queue:
            self._take_place(waiter)
            return waiter, []
        victim = self._victim()
        if victim is None or not self._outranks(waiter, victim):
            return None, []
        self._refuse(victim, "queue_full", now)
        self._take_place(waiter)
        return waiter, [victim]

    def _take_place(self, waiter: Waiter) -> None:
        self.places += 1
        self.places_by_key[waiter.key] += 1

    def _victim(self) -> Waiter | None:
        """The waiting request to refuse first: of the lowest class waiting, the newest of
        the key holding the most places."""
        if not self.waiting_count:
            return None
        lowest = min(p for p, by_key in self.waiting.items() if by_key)
        by_key = self.waiting[lowest]
        key = max(by_key, key=lambda k: (self.places_by_key[k], by_key[k][-1].seq))
        return by_key[key][-1]

    def _outranks(self, arrival: Waiter, victim: Waiter) -> bool:
        if arrival.priority != victim.priority:
            return arrival.priority > victim.priority
        # Its key would still hold fewer places than the victim's after the swap.
        return self.places_by_key[arrival.key] + 1 < self.places_by_key[victim.key]

    def wait(self, waiter: Waiter, group: str, tokens: int, now: float) -> list[Waiter]:
        """``waiter``'s body is read (it is for ``group``, ``tokens`` prompt tokens): it joins
        the queue, and every request that may run now is admitted (it may be one)."""
        waiter.group = group
        waiter.tokens = tokens
        self._join(waiter, now)
        return self.dispatch(now)

    def _join(self, waiter: Waiter, now: float) -> None:
        key = waiter.key
        if not self.waiting_by_key[key] and self.capacity.horizon is None:
            self._lift(key, now)
        by_key = self.waiting.setdefault(waiter.priority, {})
        queue = by_key.get(key)
        if queue is None:
            queue = by_key[key] = deque()
        if queue and queue[-1].seq > waiter.seq:  # back in (its ledger refused it): in order
            index = next(i for i, w in enumerate(queue) if w.seq > waiter.seq)
            queue.insert(index, waiter)
        else:
            queue.append(waiter)
        if waiter.mark is None:  # its place in line when it first joined (the estimates')
            group = waiter.group or ""
            waiter.mark = (
                sum(n for p, n in self.waiting_by_priority.items() if p >= waiter.priority),
                self.waiting_by_group[group],
                self.waiting_by_key[key],
                self.admitted,
                self.admitted_by_group[group],
                self.admitted_by_key[key],
            )
        self.waiting_count += 1
        self.waiting_by_key[key] += 1
        self.waiting_by_group[waiter.group or ""] += 1
        self.waiting_by_priority[waiter.priority] += 1
        waiter.outcome = Outcome.WAITING
        waiter.since = now

    def _lift(self, key: str, now: float) -> None:
        """VTC's counter lift (counting every token): a key joining the backlog starts from
        the smallest counter of the keys waiting (else of the last key admitted), so that
        capacity it did not use earns it nothing."""
        tokens = self.tokens
        others = [tokens.get(k, now) for k, n in self.waiting_by_key.items() if n and k != key]
        if others:
            floor = min(others)
        elif self._last_admitted is not None:
            floor = tokens.get(self._last_admitted, now)
        else:
            floor = 0.0
        tokens.set(key, max(tokens.get(key, now), floor), now)

    # -- choosing ------------------------------------------------------------------------------

    def choose(self, now: float) -> Waiter | None:
        """The waiting request to admit next, or ``None`` (none may run now)."""
        cap = self.capacity
        if self.running >= cap.max_concurrent or not self.waiting_count:
            return None
        tokens = self.tokens
        for priority in sorted(self.waiting, reverse=True):
            best: Waiter | None = None
            best_rank: tuple[float, int, int] = (math.inf, 0, 0)
            for key, queue in self.waiting[priority].items():
                if not queue or not self._key_has_room(key, now):
                    continue
                for waiter in queue:  # its oldest request whose group has room
                    if self._group_has_room(waiter.group):
                        # Ties (a key just lifted to another's counter): the key with fewer
                        # requests running first, then arrival.
                        rank = (
                            (tokens.get(key, now), self.running_by_key[key], waiter.seq)
                            if cap.fair
                            else (0.0, 0, waiter.seq)
                        )
                        if rank < best_rank:
                            best, best_rank = waiter, rank
                        break
            if best is not None:
                return best
        return None

    def _key_has_room(self, key: str, now: float) -> bool:
        until = self.blocked.get(key)
        if until is not None:
            if until > now:
                return False
            del self.blocked[key]
        limit = self.capacity.keys.get(key)
        return limit is None or self.running_by_key[key] < limit

    def _group_has_room(self, group: str | None) -> bool:
        limit = self.capacity.groups.get(group or "")
        return limit is None or self.running_by_group[group or ""] < limit

    def dispatch(self, now: float) -> list[Waiter]:
        """Admit every waiting request that may run now, best first."""
        admitted: list[Waiter] = []
        while True:
            waiter = self.choose(now)
            if waiter is None:
                return admitted
            self._unqueue(waiter)
            self._admit(waiter, now)
            admitted.append(waiter)

    def _admit(self, waiter: Waiter, now: float) -> None:
        self.running += 1
        self.running_by_group[waiter.group or ""] += 1
        self.running_by_key[waiter.key] += 1
        self.tokens.add(waiter.key, waiter.tokens, now)
        self._last_admitted = waiter.key
        self.admitted += 1
        self.admitted_by_group[waiter.group or ""] += 1
        self.admitted_by_key[waiter.key] += 1
        waiter.outcome = Outcome.RUNNING
        waiter.since = now

    def _unqueue(self, waiter: Waiter) -> None:
        by_key = self.waiting[waiter.priority]
        queue = by_key[waiter.key]
        queue.remove(waiter)
        if not queue:
            del by_key[waiter.key]
            if not by_key:
                del self.waiting[waiter.priority]
        self.waiting_count -= 1
        _down(self.waiting_by_key, waiter.key)
        _down(self.waiting_by_group, waiter.group or "")
        _down(self.waiting_by_priority, waiter.priority)

    # -- leaving -------------------------------------------------------------------------------

    def unadmit(self, waiter: Waiter, retry_in: float, now: float) -> list[Waiter]:
        """``waiter`` was admitted but its key's ledger refused it for concurrency (other
        gateways hold its slots): back in the queue in its arrival order, its key blocked for
        ``retry_in`` seconds (at least `MIN_BLOCK`); the slot goes to another request."""
        self._free_slot(waiter)
        self.tokens.add(waiter.key, -waiter.tokens, now)
        self.blocked[waiter.key] = now + max(retry_in, MIN_BLOCK)
        self._join(waiter, now)
        return self.dispatch(now)

    def refuse_running(self, waiter: Waiter, now: float) -> list[Waiter]:
        """``waiter`` was admitted but its key's ledger refused it (its rate, its tokens per
        minute): it leaves, uncharged, and its slot goes to another request."""
        self._free_slot(waiter)
        self.tokens.add(waiter.key, -waiter.tokens, now)
        self._free_place(waiter)
        waiter.outcome = Outcome.REFUSED
        waiter.reason = "ledger"
        return self.dispatch(now)

    def finish(
        self,
        waiter: Waiter,
        now: float,
        *,
        prompt: int | None = None,
        completion: int | None = None,
    ) -> list[Waiter]:
        """``waiter`` leaves, whatever its state. One that ran is charged what its answer
        reported (``prompt`` in place of the estimate charged at admission, ``completion``
        times ``completion_weight``), and its time running feeds the mean service time."""
        if waiter.outcome is Outcome.RUNNING:
            self._free_slot(waiter)
            ran = now - waiter.since
            service = self.service
            self.service = ran if service is None else service + SERVICE_WEIGHT * (ran - service)
            extra = 0.0
            if prompt is not None:
                extra += prompt - waiter.tokens
            if completion is not None:
                extra += self.capacity.completion_weight * completion
            if extra:
                self.tokens.add(waiter.key, extra, now)
        elif waiter.outcome is Outcome.WAITING:
            self._unqueue(waiter)
        if waiter.outcome is not Outcome.GONE and waiter.outcome is not Outcome.REFUSED:
            self._free_place(waiter)
        waiter.outcome = Outcome.GONE
        return self.dispatch(now)

    def _free_slot(self, waiter: Waiter) -> None:
        self.running -= 1
        self.running_by_group[waiter.group or ""] -= 1
        self.running_by_key[waiter.key] -= 1

    def _free_place(self, waiter: Waiter) -> None:
        self.places -= 1
        self.places_by_key[waiter.key] -= 1
        if not self.places_by_key[waiter.key]:
            del self.places_by_key[waiter.key]

    def _refuse(self, waiter: Waiter, reason: str, now: float) -> None:
        waiter.retry_after = self.retry_after(waiter, now) if reason == "queue_full" else 0.0
        self._unqueue(waiter)
        self._free_place(waiter)
        waiter.outcome = Outcome.REFUSED
        waiter.reason = reason

    def drain(self, now: float) -> list[Waiter]:
        """The gateway is shutting down: no more places, every waiting request refused."""
        self.draining = True
        refused = [w for by_key in self.waiting.values() for q in by_key.values() for w in q]
        for waiter in refused:
            self._refuse(waiter, "draining", now)
        return refused

    # -- estimates -----------------------------------------------------------------------------

    def retry_after(self, waiter: Waiter | None, now: float) -> float:
        """Seconds until ``waiter`` (``None``: a request arriving now, behind every waiting
        one) could run, by the drain rate of the limit that holds it (the gateway's, its
        group's or its key's): its place in line when it joined (the requests of its class or
        a higher one waiting on that limit, then), less the requests admitted under it since,
        over the requests running under it divided by the mean time one runs. A cohort timing
        out together is so told a spread of times, each its own place. ``capacity.fallback``
        before any request has finished; a key its ledger blocks, until the block ends."""
        cap = self.capacity
        if waiter is None:
            scope, running, remaining = 0, self.running, self.waiting_count + 1
        else:
            group, key = waiter.group or "", waiter.key
            if self.running >= cap.max_concurrent:
                scope, running, admitted = 0, self.running, self.admitted
            elif not self._group_has_room(group):
                scope, running = 1, self.running_by_group[group]
                admitted = self.admitted_by_group[group]
            elif not self._key_has_room(key, now):
                if key in self.blocked:
                    return min(MAX_RETRY_AFTER, max(0.0, self.blocked[key] - now))
                scope, running = 2, self.running_by_key[key]
                admitted = self.admitted_by_key[key]
            else:
                return cap.fallback
            mark = waiter.mark
            assert mark is not None  # it joined the queue
            ahead, since = mark[scope], mark[3 + scope]
            remaining = max(1, ahead + 1 - (admitted - since))
        service = self.service
        if service is None or running <= 0:
            return cap.fallback
        return min(MAX_RETRY_AFTER, remaining * service / running)
