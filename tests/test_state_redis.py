"""The shared-state back ends against a real ``redis-server`` on loopback (started per test,
stopped, paused and restarted under load; never a mock): what one process publishes reaches
the others and never itself; a process that joins late reads the state; Redis gone fails
open and catches up; every call is bounded; nothing grows without bound; the password never
shows. The key ledger is exact across instances (the same test bodies for every back end of
``KeyLedger``), and across two OS processes.

Times here are Redis' (TTLs, its clock): the few waits poll for a condition, bounded."""

from __future__ import annotations

import functools
import json
import logging
import math
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from trio_hedge.state import (
    Cooldown,
    DelaySample,
    Ejection,
    FleetStore,
    KeyLedger,
    Lease,
    LocalFleetStore,
    LocalKeyLedger,
    Quota,
    RedisFleetStore,
    RedisKeyLedger,
    Refusal,
    StateChange,
    _redis,  # the decoder, tested directly
)

from .redis_support import RedisServer, needs_redis

pytestmark = needs_redis

#: A bound on every wait for another process or for Redis (seconds): never a sleep.
BOUND = 10.0
#: Fast rounds for tests (the default is 0.25 s), and a timeout a busy machine does not
#: reach by accident (a slow answer counts as Redis lost: not what these tests kill it for).
FAST: dict[str, Any] = {"interval": 0.05, "timeout": 1.0}


async def until(condition: Callable[[], bool], bound: float = BOUND) -> None:
    """Poll ``condition`` (state another process or Redis changes) until true, bounded."""
    with trio.fail_after(bound):
        while not condition():  # noqa: ASYNC110 - another process: polled
            await trio.sleep(0.01)


@asynccontextmanager
async def running(store: FleetStore) -> AsyncIterator[list[StateChange]]:
    """``store``'s sync loop for the block; what it hands to apply."""
    got: list[StateChange] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run, got.append)
        yield got
        nursery.cancel_scope.cancel()


# -- the fleet store ---------------------------------------------------------------------------

CHANGES: list[StateChange] = [
    Ejection("g", "a", None, 30.0, "server_error"),
    Ejection("g", "b", "m", 30.0, "not_found"),
    Cooldown("g", "a", "m", 30.0, "rate_limit"),
    DelaySample("g", "m", 2, 0.25, True, 700, "a"),
    DelaySample("g", "m", 2, 1.5, False, None, "b"),
]


def _same(got: StateChange, sent: StateChange, *, within: float = 1.0) -> bool:
    """``got`` is ``sent`` seen later: its remaining time shorter (or its age older) by at
    most ``within`` seconds, everything else equal."""
    if type(got) is not type(sent):
        return False
    if isinstance(sent, DelaySample):
        assert isinstance(got, DelaySample)
        return (
            got.fleet,
            got.group,
            got.size_class,
            got.seconds,
            got.observed,
            got.tokens,
            got.replica,
        ) == (
            sent.fleet,
            sent.group,
            sent.size_class,
            sent.seconds,
            sent.observed,
            sent.tokens,
            sent.replica,
        ) and sent.age <= got.age <= sent.age + within
    assert isinstance(got, (Ejection, Cooldown)) and isinstance(sent, (Ejection, Cooldown))
    return (got.fleet, got.replica, got.model, got.reason) == (
        sent.fleet,
        sent.replica,
        sent.model,
        sent.reason,
    ) and sent.seconds - within <= got.seconds <= sent.seconds


async def test_what_one_process_publishes_reaches_the_others_never_itself(
    redis_server: RedisServer,
) -> None:
    a, b, c = (RedisFleetStore(redis_server.url, **FAST) for _ in range(3))
    async with running(a) as at_a, running(b) as at_b, running(c) as at_c:
        await until(lambda: a.status == b.status == c.status == "ok")
        for change in CHANGES:
            a.publish(change)
        await until(lambda: len(at_b) == len(at_c) == len(CHANGES))
        b.publish(Ejection("g", "c", None, 30.0, "timeout"))
        await until(lambda: len(at_a) == 1 and len(at_c) == len(CHANGES) + 1)
    for got in (at_b, at_c[: len(CHANGES)]):
        assert all(_same(x, y) for x, y in zip(got, CHANGES, strict=True)), got
    sent = Ejection("g", "c", None, 30.0, "timeout")
    assert len(at_a) == 1 and _same(at_a[0], sent) and _same(at_c[-1], sent)
    assert len(at_b) == len(CHANGES)  # b never got its own back
    assert (a.sent, b.sent, a.applied, b.applied) == (len(CHANGES), 1, 1, len(CHANGES))


async def test_a_process_that_joins_late_reads_the_state_once(redis_server: RedisServer) -> None:
    # A process started after the changes gets what is still in force (not what expired),
    # the samples with their ages, and nothing twice when the stream goes on.
    a = RedisFleetStore(redis_server.url, **FAST)
    async with running(a):
        for change in [*CHANGES, Cooldown("g", "b", "m", 0.2, "rate_limit")]:
            a.publish(change)
        await until(lambda: a.sent == len(CHANGES) + 1)
        late = RedisFleetStore(redis_server.url, **FAST)
        await trio.sleep(0.3)  # the 0.2 s cooldown's TTL passes in Redis
        async with running(late) as got:
            await until(lambda: len(got) == len(CHANGES))
            a.publish(DelaySample("g", "m", 2, 0.3, True, 700, "a"))
            await until(lambda: len(got) == len(CHANGES) + 1)
            await trio.sleep(0.3)  # a few more rounds: nothing comes twice
    assert len(got) == len(CHANGES) + 1
    by_kind = sorted(got[: len(CHANGES)], key=lambda x: CHANGES.index(_match(x)))
    assert all(_same(x, y, within=2.0) for x, y in zip(by_kind, CHANGES, strict=True))
    assert _same(got[-1], DelaySample("g", "m", 2, 0.3, True, 700, "a"))


def _match(change: StateChange) -> StateChange:
    return next(c for c in CHANGES if _same(change, c, within=5.0))


async def test_redis_gone_fails_open_then_catches_up(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Redis killed mid-run: both stores say "degraded" (one log line each), publishing never
    # blocks nor raises; Redis back (empty: restarted): "ok" again, and what was published
    # meanwhile reaches the other process.
    caplog.set_level(logging.INFO, "trio_hedge.state")
    a, b = RedisFleetStore(redis_server.url, **FAST), RedisFleetStore(redis_server.url, **FAST)
    async with running(a), running(b) as at_b:
        await until(lambda: a.status == b.status == "ok")
        redis_server.stop()
        await until(lambda: a.status == b.status == "degraded")
        for _ in range(3):  # never waits, never raises
            a.publish(Ejection("g", "a", None, 30.0, "server_error"))
        await trio.sleep(0.3)  # several failing rounds each: still one line per loss
        lost = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(lost) == a.losses + b.losses and a.losses >= 1 and b.losses >= 1
        redis_server.start()
        await until(lambda: a.status == b.status == "ok")
        await until(lambda: len(at_b) == 3)
    assert all(_same(x, Ejection("g", "a", None, 30.0, "server_error"), within=3) for x in at_b)
    back = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(back) == a.losses + b.losses  # one line each way per loss


async def test_a_stuck_redis_is_bounded_by_the_timeout(redis_server: RedisServer) -> None:
    # Redis stops answering (SIGSTOP): the store turns "degraded" after its timeout, never
    # hangs its loop, and "ok" once Redis answers again.
    a = RedisFleetStore(redis_server.url, interval=0.05, timeout=0.1)
    async with running(a):
        await until(lambda: a.status == "ok")
        redis_server.pause()
        try:
            a.publish(Ejection("g", "a", None, 30.0, "x"))
            with trio.fail_after(2.0):
                await until(lambda: a.status == "degraded")
        finally:
            redis_server.resume()
        await until(lambda: a.status == "ok")
        await until(lambda: a.sent == 1)


async def test_nothing_a_client_sends_grows_the_keys(redis_server: RedisServer) -> None:
    # 2,000 models (a client chooses the model) each rate-limit a replica and give a sample:
    # Redis holds at most max_keys state keys (and the stream and the index), each sample
    # list at most max_samples entries.
    a = RedisFleetStore(redis_server.url, max_keys=50, max_samples=10, **FAST)
    async with running(a):
        for i in range(2000):
            a.publish(Cooldown("g", "a", f"model-{i}", 60.0, "rate_limit"))
            a.publish(DelaySample("g", "one-model", 0, 0.1, True, 10, "a"))
        await until(lambda: a.sent == 4000)
        client = a._link.client()
        async with client:
            keys = await client.keys("*")
            lengths = [await client.llen(k) for k in keys if ":d:" in k]
    assert len(keys) <= 50 + 2
    assert lengths == [10]


async def test_data_that_is_not_ours_is_ignored(redis_server: RedisServer) -> None:
    # Another program (or version) writes to the stream: malformed entries, wrong types,
    # out-of-range values, overlong names. None reaches apply; the store goes on.
    a, b = RedisFleetStore(redis_server.url, **FAST), RedisFleetStore(redis_server.url, **FAST)
    bad = [
        "not json",
        json.dumps({"x": 1}),
        json.dumps([["e", "g", "a", None, "ten", "r"]]),
        json.dumps([["e", "g", "a", None, math.inf, "r"]]),
        json.dumps([["c", "g", "a", None, 5, "r"]]),  # a cooldown needs a model
        json.dumps([["d", "g", "m", -1, 0.1, 1, 10, "a", 0]]),
        json.dumps([["d", "g", "m", 0, 0.1, 2, 10, "a", 0]]),
        json.dumps([["e", "x" * 300, "a", None, 5, "r"]]),
        json.dumps([["z"]]),
    ]
    async with running(a) as got:
        await until(lambda: a.status == "ok")
        client = b._link.client()
        async with client:
            for value in bad:
                await client.xadd("{trio-hedge}:changes", {"o": "x", "t": "1", "v": value})
            await client.xadd("{trio-hedge}:changes", {"o": "x", "t": "zz", "v": "[]"})
        b.publish(Ejection("g", "a", None, 30.0, "ok"))
        async with running(b):
            await until(lambda: len(got) == 1)
    assert _same(got[0], Ejection("g", "a", None, 30.0, "ok"))


async def test_the_password_never_shows(caplog: pytest.LogCaptureFixture) -> None:
    # A Redis that wants a password, given the wrong one: the store says "degraded" and
    # why, and neither password appears in its repr, its log lines, or an error.
    caplog.set_level(logging.DEBUG)
    server = RedisServer(password="right-password-1234")
    server.start()
    try:
        url = f"redis://:wrong-secret-5678@127.0.0.1:{server.port}/0"
        store = RedisFleetStore(url, **FAST)
        ledger = RedisKeyLedger(url, fail_closed=True, **FAST)
        async with running(store), trio.open_nursery() as nursery:
            await nursery.start(ledger.run)
            await until(lambda: store.losses >= 1 and ledger.losses >= 1)
            refused = await ledger.reserve("k", Quota(max_concurrent=1), 1)
            nursery.cancel_scope.cancel()
    finally:
        server.close()
    assert refused == Refusal("unavailable", 0.05)
    text = "\n".join(r.getMessage() for r in caplog.records) + repr(store) + repr(ledger)
    for secret in ("wrong-secret-5678", "right-password-1234"):
        assert secret not in text
    assert "redis://***@127.0.0.1" in repr(store)
    with pytest.raises(ValueError) as info:
        RedisFleetStore("http://user:wrong-secret-5678@host")
    assert "wrong-secret" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h", "must start with redis://"),
        ("redis://", "names no host"),
        ("redis://h:99999", "not a valid URL"),
        ("unix://", "no socket path"),
    ],
)
def test_bad_settings_are_refused_before_any_io(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisFleetStore(url)
    with pytest.raises(ValueError, match="timeout"):
        RedisFleetStore("redis://h", timeout=0)
    with pytest.raises(ValueError, match="prefix"):
        RedisFleetStore("redis://h", prefix="a{b}")
    with pytest.raises(ValueError, match="fallback"):
        RedisKeyLedger("redis://h")


# -- the same bodies over both fleet stores ----------------------------------------------------


@pytest.fixture(params=["local", "redis"])
def store_pair(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> tuple[FleetStore, FleetStore]:
    if request.param == "local":
        return LocalFleetStore(), LocalFleetStore()
    return RedisFleetStore(redis_server.url, **FAST), RedisFleetStore(redis_server.url, **FAST)


async def test_a_process_never_gets_its_own_changes_back(
    store_pair: tuple[FleetStore, FleetStore],
) -> None:
    a, _ = store_pair
    async with running(a) as got:
        for change in CHANGES:
            a.publish(change)
        await trio.sleep(0.3)  # several rounds
    assert got == []


async def test_the_sync_loop_starts_at_once_whatever_the_store(
    store_pair: tuple[FleetStore, FleetStore], redis_server: RedisServer
) -> None:
    redis_server.stop()  # for the Redis store: nobody there
    a, _ = store_pair
    with trio.fail_after(0.05):
        async with running(a):
            a.publish(CHANGES[0])
    assert a.status in ("local", "degraded")


# -- the key ledger: the same bodies for every KeyLedger ---------------------------------------


class Counting:
    """The smallest in-process KeyLedger (concurrency only), the fallback in these tests."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.serial = 0

    @property
    def status(self) -> str:
        return "local"

    async def reserve(self, key: str, quota: Quota, tokens: int) -> Lease | Refusal:
        most = quota.max_concurrent
        if most is not None and self.held.get(key, 0) >= most:
            return Refusal("concurrency", 1.0)
        self.held[key] = self.held.get(key, 0) + 1
        self.serial += 1
        return Lease(key, f"local-{self.serial}", tokens)

    async def settle(self, lease: Lease, tokens: int | None) -> None:
        self.held[lease.key] -= 1

    async def release(self, lease: Lease) -> None:
        self.held[lease.key] -= 1


@asynccontextmanager
async def ledgers(kind: str, url: str, **options: Any) -> AsyncIterator[list[KeyLedger]]:
    """Two ledgers that must count as one: two instances sharing one Redis (two gateway
    processes), or one in-process ledger seen twice (one process)."""
    if kind == "local":
        local = LocalKeyLedger()
        yield [local, local]
        return
    # A burst of 200 reserves on a busy machine takes longer than the default timeout: a
    # slow answer counts as Redis unreachable (and falls back), which is not what is tested.
    options = {**FAST, "timeout": 2.0, **options}
    made = [RedisKeyLedger(url, fallback=Counting(), **options) for _ in range(2)]
    async with trio.open_nursery() as nursery:
        for ledger in made:
            await nursery.start(ledger.run)
        await until(lambda: all(x.status == "ok" for x in made))
        yield list(made)
        nursery.cancel_scope.cancel()


BACKENDS = ["redis", "local"]


async def _reserve_all(
    pair: list[KeyLedger], count: int, quota: Quota, tokens: int = 1
) -> list[Lease | Refusal]:
    """``count`` requests of key "k" at once, alternating between the two ledgers."""
    out: list[Lease | Refusal] = []

    async def one(ledger: KeyLedger) -> None:
        out.append(await ledger.reserve("k", quota, tokens))

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, pair[i % 2])
    return out


def _admitted(answers: list[Lease | Refusal]) -> list[Lease]:
    return [a for a in answers if isinstance(a, Lease)]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_concurrency_is_exact_across_instances(
    backend: str, redis_server: RedisServer
) -> None:
    async with ledgers(backend, redis_server.url) as pair:
        quota = Quota(max_concurrent=10)
        answers = await _reserve_all(pair, 50, quota)
        leases = _admitted(answers)
        assert len(leases) == 10
        assert {r.limit for r in answers if isinstance(r, Refusal)} == {"concurrency"}
        owner = {lease.id: pair[i % 2] for i, lease in enumerate(leases)}
        for lease in leases[:3]:
            await _owner(pair, lease).release(lease)
        assert len(_admitted(await _reserve_all(pair, 50, quota))) == 3
        assert owner  # every lease was someone's


def _owner(pair: list[KeyLedger], lease: Lease) -> KeyLedger:
    """The ledger that issued ``lease`` (a Redis lease is settled where it was taken)."""
    for ledger in pair:
        if isinstance(ledger, RedisKeyLedger) and any(
            lease.id in ids for ids in ledger._held.values()
        ):
            return ledger
    return pair[0]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_request_rate_is_exact_across_instances(
    backend: str, redis_server: RedisServer
) -> None:
    # 60 per minute: a bucket of 60 refilled at one a minute; 200 requests at once get 60.
    async with ledgers(backend, redis_server.url) as pair:
        quota = Quota(rate=1 / 60, burst=60)
        answers = await _reserve_all(pair, 200, quota)
    assert len(_admitted(answers)) == 60
    refused = [r for r in answers if isinstance(r, Refusal)]
    assert {r.limit for r in refused} == {"rate"}
    assert all(0 < r.retry_after <= 60 for r in refused)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_tokens_per_minute_reserve_then_settle(
    backend: str, redis_server: RedisServer
) -> None:
    # 1,000 tokens a minute, each request reserving 100: 10 admitted. Settling 5 on their
    # usage of 20 gives 5 × 80 back; releasing 1 gives its 100 back; a settle without usage
    # keeps the reservation.
    async with ledgers(backend, redis_server.url) as pair:
        quota = Quota(tokens_per_minute=1000)
        leases = _admitted(await _reserve_all(pair, 30, quota, tokens=100))
        assert len(leases) == 10
        for lease in leases[:5]:
            await _owner(pair, lease).settle(lease, 20)
        await _owner(pair, leases[5]).release(leases[5])
        await _owner(pair, leases[6]).settle(leases[6], None)
        # Used now: 5 × 20 + 4 × 100 = 500: five more of 100 fit, not six.
        answers = await _reserve_all(pair, 8, quota, tokens=100)
    assert len(_admitted(answers)) == 5
    refused = [r for r in answers if isinstance(r, Refusal)]
    assert {r.limit for r in refused} == {"tokens"} and all(r.retry_after <= 60 for r in refused)


async def test_a_dead_instances_leases_expire(redis_server: RedisServer) -> None:
    # Instance A holds 10 slots and dies (its renewals stop): B is refused until A's leases
    # expire (lease_ttl 2 s), then admitted. While A lived, it renewed them past their TTL.
    quota = Quota(max_concurrent=10)
    fallback = Counting()
    slow_ok = {"interval": 0.05, "timeout": 2.0, "lease_ttl": 2.0}  # a busy machine: no false loss
    a = RedisKeyLedger(redis_server.url, fallback=fallback, **slow_ok)
    b = RedisKeyLedger(redis_server.url, fallback=fallback, **slow_ok)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.run)
        async with trio.open_nursery() as a_alive:
            await a_alive.start(a.run)
            await until(lambda: a.status == b.status == "ok")
            assert len(_admitted(await _reserve_all([a, a], 10, quota))) == 10
            await trio.sleep(3.0)  # past the TTL: renewed, still held
            assert isinstance(await b.reserve("k", quota, 1), Refusal)
            a_alive.cancel_scope.cancel()  # A "dies": nothing renews its leases
        died = trio.current_time()
        while isinstance(answer := await b.reserve("k", quota, 1), Refusal):
            assert trio.current_time() - died < 2.0 + BOUND  # the TTL, and a bound
            await trio.sleep(0.05)
        assert isinstance(answer, Lease)
        assert trio.current_time() - died > 1.0  # not before the leases could have expired
        assert fallback.held == {}  # Redis answered throughout: nothing fell back
        nursery.cancel_scope.cancel()


async def test_redis_gone_fails_open_or_closed(redis_server: RedisServer) -> None:
    # Redis killed: the default ledger counts in its fallback (this process's own limit),
    # fail_closed refuses ("unavailable"); neither waits for a timeout per request; a key
    # without limits is admitted either way. Back: shared again, and a settlement that
    # could not reach Redis is retried (its slot freed).
    quota = Quota(max_concurrent=2)
    fallback = Counting()
    open_ = RedisKeyLedger(redis_server.url, fallback=fallback, **FAST)
    closed = RedisKeyLedger(redis_server.url, fail_closed=True, **FAST)
    async with trio.open_nursery() as nursery:
        for ledger in (open_, closed):
            await nursery.start(ledger.run)
        await until(lambda: open_.status == closed.status == "ok")
        held = await open_.reserve("k", quota, 1)
        assert isinstance(held, Lease)
        redis_server.stop()
        await open_.release(held)  # does not reach Redis: kept for later
        await until(lambda: open_.status == closed.status == "degraded")
        started = trio.current_time()
        fell_back = [await open_.reserve("k", quota, 1) for _ in range(3)]
        refused = await closed.reserve("k", quota, 1)
        unlimited = await closed.reserve("free", Quota(), 1)
        assert trio.current_time() - started < 0.05  # nobody waited for Redis
        assert [isinstance(x, Lease) for x in fell_back] == [True, True, False]
        assert refused == Refusal("unavailable", 0.05)
        assert isinstance(unlimited, Lease)
        for lease in _admitted(fell_back):
            await open_.release(lease)
        assert fallback.held == {"k": 0}
        redis_server.start()  # empty: as a restarted Redis is
        await until(lambda: open_.status == closed.status == "ok")
        assert len(_admitted(await _reserve_all([open_, closed], 6, quota))) == 2
        nursery.cancel_scope.cancel()


LEDGER_PROCESS = textwrap.dedent(
    """
    import json, sys, trio
    from trio_hedge.state import RedisKeyLedger, Quota, Lease
    url, count = sys.argv[1], int(sys.argv[2])
    quota = Quota(**json.loads(sys.argv[3]))

    async def main():
        ledger = RedisKeyLedger(url, fail_closed=True, timeout=5.0)
        async with trio.open_nursery() as nursery:
            await nursery.start(ledger.run)
            while ledger.status != "ok":
                await trio.sleep(0.01)
            print("ready", flush=True)
            sys.stdin.readline()  # both processes go together
            leases = []

            async def one():
                answer = await ledger.reserve("k", quota, 100)
                if isinstance(answer, Lease):
                    leases.append(answer)

            async with trio.open_nursery() as requests:
                for _ in range(count):
                    requests.start_soon(one)
            print("admitted", len(leases), flush=True)
            sys.stdin.readline()  # held until both have asked
            for lease in leases:
                await ledger.settle(lease, 100)
            nursery.cancel_scope.cancel()
        print("done", flush=True)

    trio.run(main)
    """
)


@pytest.mark.parametrize(
    ("quota", "limit"),
    [
        ({"max_concurrent": 10}, 10),
        ({"rate": 1 / 60, "burst": 60}, 60),
        ({"tokens_per_minute": 5000}, 50),
        ({"max_concurrent": 10, "rate": 1 / 60, "burst": 60, "tokens_per_minute": 5000}, 10),
    ],
    ids=["10 concurrent", "60 a minute", "5,000 tokens a minute", "all three"],
)
async def test_two_processes_together_get_exactly_the_keys_limits(
    redis_server: RedisServer, quota: dict[str, Any], limit: int
) -> None:
    # Two OS processes, one Redis, 100 requests each at once for one key, every admitted one
    # held until both processes have asked: 10 concurrent, 60 a minute, 5,000 tokens a
    # minute (100 per request): exactly that many in all, however the two interleave.
    async with trio.open_nursery() as nursery:
        processes = []
        for _ in range(2):
            command = [sys.executable, "-c", LEDGER_PROCESS, redis_server.url, "100"]
            command.append(json.dumps(quota))
            run = functools.partial(trio.run_process, command, stdin=-1, stdout=-1, check=True)
            process: trio.Process = await nursery.start(run)
            processes.append(process)
        outputs = [b""] * 2

        async def until_said(i: int, word: bytes) -> None:
            stdout = processes[i].stdout
            assert stdout is not None
            while word not in outputs[i]:
                chunk = await stdout.receive_some()
                assert chunk, outputs[i]
                outputs[i] += chunk

        with trio.fail_after(BOUND * 3):
            for i in range(2):
                await until_said(i, b"ready")
            for p in processes:
                assert p.stdin is not None
                await p.stdin.send_all(b"go\n")
            for i in range(2):
                await until_said(i, b"admitted")
            for p in processes:
                assert p.stdin is not None
                await p.stdin.send_all(b"release\n")
            for i in range(2):
                await until_said(i, b"done")
    admitted = [int(o.decode().split("admitted")[1].split()[0]) for o in outputs]
    assert sum(admitted) == limit, admitted


def test_snapshot_values_are_checked() -> None:
    # The decoder refuses a value with fields of the wrong kind (a fuzz-like table).
    assert _redis.decode(["e", "g", "a", None, 5, "r"], 1.0) == Ejection("g", "a", None, 4.0, "r")
    assert _redis.decode(["e", "g", "a", None, 5, "r"], 6.0) is None  # expired meanwhile
    assert _redis.decode(["d", "g", "m", 1, 0.2, 1, None, "a", 3], 2.0) == DelaySample(
        "g", "m", 1, 0.2, True, None, "a", 5.0
    )
    for bad in (["d", "g", "m", True, 0.2, 1, None, "a", 3], ["c", "g", "a", "m", -1, "r"], [1]):
        assert _redis.decode(bad, 0.0) is None
