"""The admission queue's decisions (``gateway/_queue.py``: plain functions of its state and
an event) by scenario tables, and the Limiter that carries them out (``gateway/_limits.py``)
in virtual time. Every scenario has a second key or class whose service the first one's
traffic must not change beyond what the rules say."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from trio_hedge.gateway import GatewayConfig, GatewayKey, Group, Limits
from trio_hedge.gateway._limits import Limiter, Refused, Ticket
from trio_hedge.gateway._queue import AdmissionState, Capacity, Outcome, Waiter
from trio_hedge.sources import Replica
from trio_hedge.state import Lease, LocalKeyLedger, Quota, Refusal, StoreStatus

# -- the decisions, by scenario tables ---------------------------------------------------------

#: One step: (time, event, request name, details). A request's name is its key then a number
#: (``a1``: key "a"). Events: ``arrive`` (details: priority, group, prompt tokens),
#: ``finish`` (details: prompt, completion reported), ``leave`` (timed out or cancelled),
#: ``drain``.
Step = tuple[float, str, str, tuple[Any, ...]]


def play(capacity: Capacity, steps: Sequence[Step]) -> list[str]:
    """Each step's effect: ``"a1 runs"``, ``"b2 waits"``, ``"c1 refused queue_full"``."""
    state = AdmissionState(capacity)
    waiters: dict[str, Waiter] = {}
    names: dict[int, str] = {}
    log: list[str] = []

    def changed(found: list[Waiter]) -> None:
        for waiter in found:
            name = names[waiter.seq]
            log.append(
                f"{name} runs"
                if waiter.outcome is Outcome.RUNNING
                else f"{name} refused {waiter.reason}"
            )

    for at, event, name, details in steps:
        if event == "arrive":
            priority, group, tokens = details
            waiter, pushed = state.enter(name[0], priority, at)
            changed(pushed)
            if waiter is None:
                log.append(f"{name} refused {'draining' if state.draining else 'queue_full'}")
                continue
            names[waiter.seq] = name
            waiters[name] = waiter
            admitted = state.wait(waiter, group, tokens, at)
            if waiter not in admitted:
                log.append(f"{name} waits")
            changed(admitted)
        elif event == "finish":
            prompt, completion = details
            changed(state.finish(waiters[name], at, prompt=prompt, completion=completion))
        elif event == "leave":
            changed(state.finish(waiters[name], at))
        elif event == "drain":
            changed(state.drain(at))
    return log


ONE = Capacity(max_concurrent=1, max_queue=100)
THREE = Capacity(max_concurrent=3, max_queue=100)


def arrive(at: float, name: str, priority: int = 0, group: str = "g", tokens: int = 100) -> Step:
    return (at, "arrive", name, (priority, group, tokens))


def finish(at: float, name: str, prompt: int | None = None, completion: int | None = None) -> Step:
    return (at, "finish", name, (prompt, completion))


# fmt: off
SCENARIOS: dict[str, tuple[Capacity, list[Step], list[str]]] = {
    "one key: arrival order": (
        ONE,
        [arrive(0, "a1"), arrive(1, "a2"), arrive(2, "a3"), finish(3, "a1"), finish(4, "a2")],
        ["a1 runs", "a2 waits", "a3 waits", "a2 runs", "a3 runs"],
    ),
    "a higher class first, whatever its arrival": (
        ONE,
        [arrive(0, "a1"), arrive(1, "b1", 0), arrive(2, "c1", 5), finish(3, "a1"), finish(4, "c1")],
        ["a1 runs", "b1 waits", "c1 waits", "c1 runs", "b1 runs"],
    ),
    # Token-fair: h queued 3 requests first; l's goes next, as it received fewer tokens
    # recently (h: 100 charged at h1's admission, l: none).
    "the key with fewer tokens goes first": (
        ONE,
        [
            arrive(0, "h1"), arrive(0.1, "h2"), arrive(0.2, "h3"), arrive(0.5, "l1"),
            finish(1, "h1"), finish(2, "l1"),
        ],
        ["h1 runs", "h2 waits", "h3 waits", "l1 waits", "l1 runs", "h2 runs"],
    ),
    # A key sending far below its share goes first with every request of a burst: h has
    # received 300 tokens (decaying), l 100 after l1.
    "a key below its share goes first in every burst": (
        THREE,
        [
            arrive(0, "h1"), arrive(0, "h2"), arrive(0, "h3"), arrive(0, "h4"), arrive(0, "h5"),
            arrive(0.1, "l1"), arrive(0.2, "l2"), finish(1, "h1"), finish(1.1, "h2"),
        ],
        [
            "h1 runs", "h2 runs", "h3 runs", "h4 waits", "h5 waits", "l1 waits", "l2 waits",
            "l1 runs", "l2 runs",
        ],
    ),
    # VTC's lift (every token counted): l joining the backlog levels with h (300), goes first
    # on the tie (fewer running), then waits behind h for its second request.
    "with VTC's lift, a burst alternates with the flood": (
        attrs.evolve(THREE, horizon=None),
        [
            arrive(0, "h1"), arrive(0, "h2"), arrive(0, "h3"), arrive(0, "h4"), arrive(0, "h5"),
            arrive(0.1, "l1"), arrive(0.2, "l2"), finish(1, "h1"), finish(1.1, "h2"),
        ],
        [
            "h1 runs", "h2 runs", "h3 runs", "h4 waits", "h5 waits", "l1 waits", "l2 waits",
            "l1 runs", "h4 runs",
        ],
    ),
    # The lift: h ran 10 requests alone (1,000 tokens); l joining the backlog starts from
    # h's counter, so it gets no credit for capacity it did not use: they alternate.
    "with VTC's lift, no credit for capacity a key did not use": (
        attrs.evolve(ONE, horizon=None),
        [
            *[s for i in range(10) for s in (arrive(i, f"h{i}"), finish(i + 0.5, f"h{i}"))],
            arrive(20, "hA"), arrive(20.1, "hB"), arrive(20.2, "hC"), arrive(20.3, "l1"),
            arrive(20.4, "l2"), arrive(20.5, "l3"), finish(21, "hA"), finish(22, "hB"),
            finish(23, "l1"), finish(24, "hC"),
        ],
        [
            *[f"h{i} runs" for i in range(10)], "hA runs", "hB waits", "hC waits", "l1 waits",
            "l2 waits", "l3 waits", "hB runs", "l1 runs", "hC runs", "l2 runs",
        ],
    ),
    # Decayed, 10 s later h's 1,000 tokens count for nothing: the keys share as equals.
    "recently: old tokens count for nothing": (
        ONE,
        [
            *[s for i in range(10) for s in (arrive(i, f"h{i}"), finish(i + 0.5, f"h{i}"))],
            arrive(40, "hA"), arrive(40.1, "hB"), arrive(40.2, "l1"), arrive(40.3, "l2"),
            finish(41, "hA"), finish(42, "l1"), finish(43, "hB"),
        ],
        [
            *[f"h{i} runs" for i in range(10)], "hA runs", "hB waits", "l1 waits", "l2 waits",
            "l1 runs", "hB runs", "l2 runs",
        ],
    ),
    # The answer's reported usage: a's 50 completion tokens weigh 2 each (VTC's 2:1), so a
    # has received 100 + 100 = 200 tokens, b 100 + 0 (its prompt reported as 100).
    "completion tokens weigh completion_weight": (
        Capacity(max_concurrent=2, max_queue=100, completion_weight=2.0),
        [
            arrive(0, "a1"), arrive(0, "b1"), arrive(1, "a2"), arrive(1.1, "b2"),
            finish(2, "a1", 100, 50), finish(2, "b1", 100, 0),
        ],
        ["a1 runs", "b1 runs", "a2 waits", "b2 waits", "b2 runs", "a2 runs"],
    ),
    "without completion tokens, arrival order": (
        Capacity(max_concurrent=2, max_queue=100, completion_weight=2.0),
        [
            arrive(0, "a1"), arrive(0, "b1"), arrive(1, "a2"), arrive(1.1, "b2"),
            finish(2, "a1", 100, 0), finish(2, "b1", 100, 0),
        ],
        ["a1 runs", "b1 runs", "a2 waits", "b2 waits", "a2 runs", "b2 runs"],
    ),
    # Work-conserving: group g is at its limit, so a request for group k runs although
    # it came later, from a lower class.
    "a full group blocks no other group": (
        Capacity(max_concurrent=4, max_queue=100, groups={"g": 1}),
        [arrive(0, "a1", 5, "g"), arrive(1, "a2", 5, "g"), arrive(2, "b1", 0, "k")],
        ["a1 runs", "a2 waits", "b1 runs"],
    ),
    "a key at its own limit waits; another key runs": (
        Capacity(max_concurrent=4, max_queue=100, keys={"a": 1}),
        [arrive(0, "a1"), arrive(1, "a2"), arrive(2, "b1"), finish(3, "a1")],
        ["a1 runs", "a2 waits", "b1 runs", "a2 runs"],
    ),
    # Places: 1 running + 2 waiting. A key with fewer places takes the newest waiting place
    # of the key with the most (longest queue drop); a key with as many is refused.
    "no key can take every place": (
        Capacity(max_concurrent=1, max_queue=2),
        [
            arrive(0, "h1"), arrive(0.1, "h2"), arrive(0.2, "h3"), arrive(1, "l1"),
            arrive(2, "h4"), arrive(3, "l2"),
        ],
        [
            "h1 runs",
            "h2 waits",
            "h3 waits",
            "h3 refused queue_full",
            "l1 waits",
            "h4 refused queue_full",
            "l2 refused queue_full",  # l would hold 2 places, h 2: no swap
        ],
    ),
    "a higher class takes a lower class's place": (
        Capacity(max_concurrent=1, max_queue=1),
        [arrive(0, "a1"), arrive(1, "a2", 0), arrive(2, "b1", 3), arrive(3, "c1", 3)],
        ["a1 runs", "a2 waits", "a2 refused queue_full", "b1 waits", "c1 refused queue_full"],
    ),
    "a request that leaves gives its place back": (
        Capacity(max_concurrent=1, max_queue=1),
        [arrive(0, "a1"), arrive(1, "a2"), (2, "leave", "a2", ()), arrive(3, "a3")],
        ["a1 runs", "a2 waits", "a3 waits"],
    ),
    "draining refuses every waiting request": (
        ONE,
        [arrive(0, "a1"), arrive(1, "a2"), arrive(1, "b1"), (2, "drain", "", ()), arrive(3, "c1")],
        [
            "a1 runs", "a2 waits", "b1 waits", "a2 refused draining", "b1 refused draining",
            "c1 refused draining",
        ],
    ),
}
# fmt: on


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_queue_decides(name: str) -> None:
    capacity, steps, expected = SCENARIOS[name]
    assert play(capacity, steps) == expected


def test_retry_after_follows_the_drain_rate() -> None:
    """Little's law: 2 running, each ~1 s; the n-th waiting request runs in about n / 2 s.
    Before any request finished: the fallback."""
    state = AdmissionState(Capacity(max_concurrent=2, max_queue=100, fallback=1.0))
    waiters = []
    for _ in range(5):
        waiter, _ = state.enter("a", 0, 0.0)
        assert waiter is not None
        state.wait(waiter, "g", 10, 0.0)
        waiters.append(waiter)
    assert [w.outcome for w in waiters].count(Outcome.RUNNING) == 2
    assert state.retry_after(waiters[4], 0.0) == 1.0  # nothing finished yet
    state.finish(waiters[0], 1.0)  # ran 1 s; waiters[2] runs
    assert state.service == 1.0
    assert [state.retry_after(w, 1.0) for w in waiters[3:]] == [0.5, 1.0]
    assert state.retry_after(None, 1.0) == 1.5  # a request arriving now: behind both
    top, _ = state.enter("b", 5, 1.0)
    assert top is not None
    state.wait(top, "g", 10, 1.0)
    # A higher class is placed ahead of everyone; the others keep the place in line they
    # joined with (an estimate: a class that came after is not counted).
    assert [state.retry_after(w, 1.0) for w in (top, *waiters[3:])] == [0.5, 0.5, 1.0]
    # A cohort leaving together is told a spread: each its own place, not "first" in turn.
    state.finish(waiters[3], 1.0)
    assert state.retry_after(waiters[4], 1.0) == 1.0
    state.finish(waiters[1], 3.0)  # ran 3 s: the mean moves a fifth of the way
    assert state.service == pytest.approx(1.4)


def test_a_key_its_ledger_refused_waits_its_block() -> None:
    """Other gateways hold a's slots: a's request goes back in line, b's runs meanwhile;
    after the block a is admitted again."""
    state = AdmissionState(Capacity(max_concurrent=2, max_queue=10))
    a, _ = state.enter("a", 0, 0.0)
    b, _ = state.enter("b", 0, 0.0)
    assert a is not None and b is not None
    assert state.wait(a, "g", 10, 0.0) == [a]
    assert state.unadmit(a, 0.5, 0.0) == []  # back in line; a blocked until 0.5
    assert a.outcome is Outcome.WAITING and state.tokens.get("a", 0.0) == 0
    assert state.retry_after(a, 0.1) == 0.4
    assert state.wait(b, "g", 10, 0.1) == [b]
    assert state.dispatch(0.4) == []
    assert state.dispatch(0.5) == [a]


def test_state_is_given_back_whatever_happens() -> None:
    state = AdmissionState(Capacity(max_concurrent=1, max_queue=3, keys={"a": 1}))
    seen = []
    for key in "aab":
        waiter, _ = state.enter(key, 0, 0.0)
        assert waiter is not None
        seen.append(waiter)
    state.wait(seen[0], "g", 1, 0.0)
    state.wait(seen[1], "g", 1, 0.0)
    state.refuse_running(seen[0], 0.1)  # its ledger said no: a1 leaves, a2 runs
    assert seen[1].outcome is Outcome.RUNNING
    for waiter in seen:
        state.finish(waiter, 1.0)  # running, refused, still reading its body
    assert (state.places, state.running, state.waiting_count) == (0, 0, 0)
    assert not state.places_by_key and not state.waiting and not state.waiting_by_key


# -- the Limiter: waits, timeouts and leases in virtual time -----------------------------------


def _config(**limits: Any) -> GatewayConfig:
    keys = limits.pop("keys", ())
    groups = limits.pop("groups", None)
    replica = Replica("http://127.0.0.1:9/v1", name="r")
    made = [Group("g", ["r"]), Group("k", ["r"])] if groups is None else groups
    return GatewayConfig([replica], made, keys=keys, limits=Limits(**limits))


async def _request(
    limiter: Limiter,
    key: str | None,
    out: dict[str, Any],
    name: str,
    *,
    hold: float = 1.0,
    priority: int = 0,
    group: str = "g",
    tokens: int = 100,
) -> None:
    """One request through the limiter: ``out[name]`` is ``(admitted at, waited)`` or the
    refusal's ``(reason, retry_after)``."""
    ticket: Ticket | None = None
    try:
        ticket = limiter.enter(key, priority)
        await limiter.admit(ticket, group, tokens, tokens)
        out[name] = (trio.current_time(), ticket.waited)
        await trio.sleep(hold)
    except Refused as refused:
        out[name] = (refused.reason, refused.retry_after)
    finally:
        if ticket is not None:
            await limiter.done(ticket, served=True, prompt=tokens, completion=0)


async def test_the_queue_waits_then_refuses_with_the_drain_rate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """2 slots, 1 s per request, 6 requests 10 ms apart, queue_wait 1.5 s: two run at once,
    two when those end, the last two time out with the drain estimate: their places in line
    (1st, 2nd) over 2 slots of 1 s, 0.5 and 1.0 s (both would have run 0.46 s later: the
    estimate is within one request's time)."""
    limiter = Limiter(_config(max_concurrent=2, queue_wait=1.5))
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(_request, limiter, None, out, f"r{i}")
            await trio.sleep(0.01)
    assert out == {
        "r0": (0.0, 0.0),
        "r1": (0.01, 0.0),
        "r2": (1.0, pytest.approx(0.98)),
        "r3": (1.01, pytest.approx(0.98)),
        "r4": ("queue_timeout", 0.5),
        "r5": ("queue_timeout", 1.0),
    }
    assert (limiter.state.places, limiter.in_flight, limiter.queued) == (0, 0, 0)


async def test_a_flooding_key_does_not_delay_another_key_beyond_one_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Key a keeps 20 requests waiting on 2 slots; key b's requests, arriving among them,
    each wait at most until the next slot frees (the same as without the flood: b's own
    service is unchanged but for the request running when it came)."""
    keys = (GatewayKey("sk-a", "a"), GatewayKey("sk-b", "b"))
    limiter = Limiter(_config(max_concurrent=2, queue_wait=100.0, keys=keys))
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(_request, limiter, "a", out, f"a{i}")
        await trio.sleep(2.25)
        for i in range(3):
            nursery.start_soon(functools.partial(_request, limiter, "b", out, f"b{i}", hold=0.1))
            await trio.sleep(2.0)
    waits = [out[f"b{i}"][1] for i in range(3)]
    # Each until the next of a's slots frees (3.0, 5.0, 7.1: b1's short turn moved a's),
    # ahead of the 10+ requests a had waiting.
    assert waits == pytest.approx([0.75, 0.75, 0.85])
    # Work-conserving: a got every other slot-second, its last request admitted at 9.2
    # (20 s of a's work and 0.3 s of b's on 2 slots).
    assert max(v[0] for k, v in out.items() if k.startswith("a")) == pytest.approx(9.2)


async def test_a_request_that_leaves_while_waiting_leaves_nothing_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = Limiter(_config(max_concurrent=1, queue_wait=10.0))
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_request, limiter, None, out, "first")
        await trio.sleep(0.1)
        with trio.move_on_after(0.2):  # the client leaves while it waits
            await _request(limiter, None, out, "gone")
        assert (limiter.state.places, limiter.queued) == (1, 0)
        nursery.start_soon(_request, limiter, None, out, "next")
    assert "gone" not in out and out["next"] == (1.0, pytest.approx(0.7))
    assert (limiter.state.places, limiter.in_flight, limiter.queued) == (0, 0, 0)


async def test_tokens_per_minute_refuse_at_admission(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """a's 1,000 tokens a minute: two requests of 400 run, the third is refused (429 with
    the window's estimate), b is served all the while; a request larger than the whole
    minute is known at once."""
    keys = (GatewayKey("sk-a", "a", tokens_per_minute=1000), GatewayKey("sk-b", "b"))
    limiter = Limiter(_config(max_concurrent=10, keys=keys))
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        for name, key in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("b2", "b")):
            nursery.start_soon(functools.partial(_request, limiter, key, out, name, tokens=400))
            await trio.lowlevel.checkpoint()
    assert out["a3"] == ("key_tokens", 60.0)
    assert [out[n][0] for n in ("a1", "a2", "b1", "b2")] == [0.0] * 4
    assert limiter.too_many_tokens("a", 1001) == 1000
    assert limiter.too_many_tokens("a", 1000) is None
    assert limiter.too_many_tokens("b", 10**9) is None


class _ElsewhereLedger(LocalKeyLedger):
    """A shared ledger where other gateways hold key a's only slot until ``free_at``."""

    def __init__(self, free_at: float) -> None:
        super().__init__()
        self.free_at = free_at
        self.asked = 0

    @property
    def status(self) -> StoreStatus:
        return "ok"

    async def reserve(self, key: str, quota: Quota, tokens: int) -> Lease | Refusal:
        self.asked += 1
        if key == "a" and trio.current_time() < self.free_at:
            await trio.lowlevel.checkpoint()
            return Refusal("concurrency", 1.0)
        return await super().reserve(key, quota, tokens)


async def test_a_key_held_by_other_gateways_waits_for_its_ledger(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The ledger says a's slot is held elsewhere until 0.6 s: a's request waits in line
    (asked again every 0.25 s at most), b's is served at once; with queue_wait passed
    before, it is refused."""
    keys = (GatewayKey("sk-a", "a", max_concurrent=1), GatewayKey("sk-b", "b"))
    ledger = _ElsewhereLedger(free_at=0.6)
    limiter = Limiter(_config(max_concurrent=4, queue_wait=5.0, keys=keys), ledger)
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_request, limiter, "a", out, "a1")
        nursery.start_soon(_request, limiter, "b", out, "b1")
    assert out["b1"] == (0.0, 0.0)
    assert out["a1"] == (0.75, 0.75)  # asked at 0, 0.25, 0.5 (refused), 0.75
    assert ledger.asked == 5
    ledger = _ElsewhereLedger(free_at=100.0)
    limiter = Limiter(_config(max_concurrent=4, queue_wait=0.9, keys=keys), ledger)
    await _request(limiter, "a", out, "a2")
    assert out["a2"] == ("queue_timeout", pytest.approx(0.1))  # until the ledger's next look
    assert (limiter.state.places, limiter.in_flight) == (0, 0)
