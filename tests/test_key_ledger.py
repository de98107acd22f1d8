"""LocalKeyLedger: each key's concurrency, request rate and tokens per minute, reserved then
settled, in virtual time. Every scenario has a second key whose service the first one's
traffic must not change."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_hedge.state import KeyLedger, Lease, LocalKeyLedger, Quota, Refusal


def _show(result: Lease | Refusal) -> Any:
    """A lease as the tokens it holds, a refusal as ``(limit, retry_after)``."""
    if isinstance(result, Refusal):
        return (result.limit, round(result.retry_after, 6))
    return result.tokens


def test_the_local_ledger_keeps_the_contract() -> None:
    ledger: KeyLedger = LocalKeyLedger()  # mypy checks the protocol; this, the status
    assert ledger.status == "local"


def test_the_rate_is_a_token_bucket(autojump_clock: trio.testing.MockClock) -> None:
    """A burst of 3, then one request per 0.5 s; a key's limits count its own requests
    only (key b's burst is its own)."""
    a = Quota(rate=2.0, burst=3)
    b = Quota(rate=2.0)  # burst: the rate rounded up, 2

    async def scenario() -> list[Any]:
        ledger = LocalKeyLedger()
        take = ledger.reserve_now
        seen: list[Any] = [_show(take("a", a, 0)) for _ in range(4)]  # the burst, then a wait
        await trio.sleep(0.25)
        seen.append(_show(take("a", a, 0)))  # half a request: still 0.25 s to go
        await trio.sleep(0.25)
        seen += [_show(take("a", a, 0)), _show(take("a", a, 0))]
        seen += [_show(take("b", b, 0)) for _ in range(3)]
        return seen

    seen = trio.run(scenario, clock=autojump_clock)
    assert seen == [
        0, 0, 0, ("rate", 0.5),
        ("rate", 0.25),
        0, ("rate", 0.5),
        0, 0, ("rate", 0.5),
    ]  # fmt: skip


def test_concurrency_counts_leases_held(autojump_clock: trio.testing.MockClock) -> None:
    quota = Quota(max_concurrent=2)

    async def scenario() -> list[Any]:
        ledger = LocalKeyLedger()
        first, second = ledger.reserve_now("a", quota, 0), ledger.reserve_now("a", quota, 0)
        seen = [_show(ledger.reserve_now("a", quota, 0)), _show(ledger.reserve_now("b", quota, 0))]
        assert isinstance(first, Lease) and isinstance(second, Lease)
        await ledger.release(first)
        await ledger.release(first)  # twice: nothing more
        seen.append(_show(ledger.reserve_now("a", quota, 0)))
        seen.append(_show(ledger.reserve_now("a", quota, 0)))
        await ledger.settle(second, 10)
        seen.append(ledger.in_flight("a"))
        return seen

    seen = trio.run(scenario, clock=autojump_clock)
    assert seen == [("concurrency", 1.0), 0, 0, ("concurrency", 1.0), 1]


def test_tokens_are_reserved_then_settled(autojump_clock: trio.testing.MockClock) -> None:
    """1,000 tokens per minute: reservations count in full while held; the settled usage
    replaces them and leaves the window 60 s after (its one-second slot) the settling; a
    release gives the reservation back."""
    quota = Quota(tokens_per_minute=1000)

    async def scenario() -> list[Any]:
        ledger = LocalKeyLedger()
        seen: list[Any] = []
        first = ledger.reserve_now("a", quota, 600)
        second = ledger.reserve_now("a", quota, 400)
        seen.append(_show(ledger.reserve_now("a", quota, 1)))  # 1,000 held: full
        seen.append(_show(ledger.reserve_now("b", quota, 1000)))  # b: its own minute
        assert isinstance(first, Lease) and isinstance(second, Lease)
        await trio.sleep(0.5)
        await ledger.settle(first, 100)  # answered with 100: 500 freed
        seen.append(ledger.tokens("a"))
        seen.append(_show(ledger.reserve_now("a", quota, 501)))  # one too many: until t=60
        await ledger.release(second)  # nothing served: its 400 back
        seen.append(ledger.tokens("a"))
        third = ledger.reserve_now("a", quota, 900)
        seen.append(_show(third))
        await trio.sleep(10.0)  # t = 10.5
        assert isinstance(third, Lease)
        await ledger.settle(third, 950)  # more than reserved: charged as used
        seen.append(ledger.tokens("a"))
        seen.append(_show(ledger.reserve_now("a", quota, 1)))  # 100 + 950 > 1000: until t=60
        await trio.sleep(49.5)  # t = 60: the slot of t = 0.5 has left the window
        seen.append(ledger.tokens("a"))
        seen.append(_show(ledger.reserve_now("a", quota, 50)))
        return seen

    seen = trio.run(scenario, clock=autojump_clock)
    assert seen == [
        ("tokens", 60.0),  # only held leases in the way: the whole window
        1000,
        (100, 400),
        ("tokens", 59.5),
        (100, 0),
        900,
        (1050, 0),
        ("tokens", 49.5),
        (950, 0),
        50,
    ]


def test_a_settle_without_usage_keeps_the_reservation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def scenario() -> tuple[int, int]:
        ledger = LocalKeyLedger()
        lease = ledger.reserve_now("a", Quota(tokens_per_minute=1000), 300)
        assert isinstance(lease, Lease)
        await ledger.settle(lease, None)
        await ledger.settle(lease, 5)  # twice: nothing more
        return ledger.tokens("a")

    assert trio.run(scenario, clock=autojump_clock) == (300, 0)


def test_a_refusal_changes_nothing(autojump_clock: trio.testing.MockClock) -> None:
    """A request refused for its tokens takes nothing from the rate bucket, nor a slot."""
    quota = Quota(max_concurrent=5, rate=1.0, burst=1, tokens_per_minute=100)

    async def scenario() -> list[Any]:
        ledger = LocalKeyLedger()
        seen = [_show(ledger.reserve_now("a", quota, 200)), ledger.in_flight("a")]
        seen.append(_show(ledger.reserve_now("a", quota, 50)))  # the bucket was still full
        return seen

    assert trio.run(scenario, clock=autojump_clock) == [("tokens", 60.0), 0, 50]


def test_a_cancelled_reserve_holds_nothing(autojump_clock: trio.testing.MockClock) -> None:
    async def scenario() -> int:
        ledger = LocalKeyLedger()
        with trio.CancelScope() as scope:
            scope.cancel()
            await ledger.reserve("a", Quota(max_concurrent=1), 10)
        return ledger.in_flight("a")

    assert trio.run(scenario, clock=autojump_clock) == 0


def test_negative_tokens_are_refused_by_name() -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="tokens must be >= 0"):
            LocalKeyLedger().reserve_now("a", Quota(), -1)

    trio.run(scenario)


async def test_concurrent_requests_cannot_overrun_tokens_per_minute() -> None:
    """50 requests of 300 tokens reserved together against 1,000 per minute: 3 admitted
    (LiteLLM let concurrent requests through a 100 TPM limit 6 times, #18730); key b, at the
    same moment, gets its whole minute."""
    ledger = LocalKeyLedger()
    quota = Quota(tokens_per_minute=1000)
    results: list[Lease | Refusal] = []
    other: list[Lease | Refusal] = []

    async def one(key: str, out: list[Lease | Refusal]) -> None:
        out.append(await ledger.reserve(key, quota, 300))

    async with trio.open_nursery() as nursery:
        for _ in range(50):
            nursery.start_soon(one, "a", results)
        for _ in range(3):
            nursery.start_soon(one, "b", other)
    assert sum(isinstance(r, Lease) for r in results) == 3
    assert all(isinstance(r, Lease) for r in other)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["reserve", "settle", "release", "sleep"]),
            st.sampled_from(["a", "b"]),
            st.integers(0, 700),
        ),
        max_size=60,
    )
)
def test_limits_hold_whatever_the_sequence(ops: list[tuple[str, str, int]]) -> None:
    """Whatever mix of reserves, settles (at most the reservation) and releases: no key ever
    holds more than its concurrency, nor more than its tokens per minute (held plus settled
    in the window); key b's limits are never touched by key a's traffic."""
    quota = Quota(max_concurrent=3, tokens_per_minute=1000)

    async def scenario() -> None:
        ledger = LocalKeyLedger()
        leases: dict[str, list[Lease]] = {"a": [], "b": []}
        for op, key, n in ops:
            if op == "reserve":
                result = ledger.reserve_now(key, quota, n)
                if isinstance(result, Lease):
                    leases[key].append(result)
            elif op in ("settle", "release") and leases[key]:
                lease = leases[key].pop(n % len(leases[key]))
                if op == "settle":
                    await ledger.settle(lease, min(n, lease.tokens))
                else:
                    await ledger.release(lease)
            elif op == "sleep":
                await trio.sleep(n / 10)
            for name in ("a", "b"):
                used, held = ledger.tokens(name)
                assert used + held <= 1000
                assert ledger.in_flight(name) == len(leases[name]) <= 3
                assert held == sum(lease.tokens for lease in leases[name])

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
