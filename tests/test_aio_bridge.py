"""The asyncio bridge: batched hand-over, events(), back-pressure, AioHedger, and asyncio
cancellation closing every upstream response over real loopback sockets."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import sniffio
import trio
import trio.testing

trio_asyncio = pytest.importorskip("trio_asyncio")

import trio_hedge as th  # noqa: E402
from trio_hedge.aio import AioHedgedStream, AioHedger, aio_hedged_stream  # noqa: E402
from trio_hedge.testing import Behaviour, fake_replicas  # noqa: E402

from .scripted import Ledger, Script, sources  # noqa: E402

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def in_asyncio(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run the asyncio coroutine function ``fn`` on a fresh trio-asyncio loop."""
    async with trio_asyncio.open_loop():
        return await trio_asyncio.aio_as_trio(fn)(*args)


class _Burst:
    """One receive() hands over ``n`` content deltas at once, then the end."""

    def __init__(self, n: int, log: list[str]) -> None:
        self._n, self._log, self._sent = n, log, False

    async def receive(self) -> list[th.events.Delta] | None:
        await trio.lowlevel.checkpoint()
        if self._sent:
            return None
        self._sent = True
        self._log.append("read")
        return [th.events.Delta(role="assistant")] + [
            th.events.Delta(content=f"t{i} ") for i in range(self._n)
        ]

    async def aclose(self) -> None:
        self._log.append("closed")


class _BurstSource:
    name = "burst"

    def __init__(self, n: int) -> None:
        self.n = n
        self.log: list[str] = []

    async def open(self, info: th.sources.AttemptInfo) -> _Burst:
        return _Burst(self.n, self.log)


class _Counter:
    """Counts numbered tokens as the source produces them (for back-pressure)."""

    def __init__(self, n: int) -> None:
        self.produced = 0
        self._n = n

    def __aiter__(self) -> _Counter:
        return self

    async def __anext__(self) -> str:
        await trio.lowlevel.checkpoint()
        if self.produced == self._n:
            raise StopAsyncIteration
        self.produced += 1
        return f"{self.produced - 1} "


class _TaskCounter(trio.abc.Instrument):
    def __init__(self) -> None:
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


# -- batching ------------------------------------------------------------------------------------


async def test_a_burst_is_one_hand_over_not_a_task_per_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = _BurstSource(200)
    counter = _TaskCounter()

    async def consume() -> list[str]:
        async with aio_hedged_stream(None, [source]) as stream:
            trio.lowlevel.add_instrument(counter)
            try:
                return [token async for token in stream]
            finally:
                trio.lowlevel.remove_instrument(counter)

    tokens = await in_asyncio(consume)
    assert tokens == [f"t{i} " for i in range(200)]
    # The old bridge started one Trio task (trio_as_future) per token: 200 here.
    assert counter.spawned <= 2, counter.spawned
    assert source.log == ["read", "closed"]


class _Paced:
    """``n`` tokens, each after a checkpoint: the consumer finds the buffer empty every time,
    so every token is a hand-over of its own (a real server's pace)."""

    def __init__(self, n: int) -> None:
        self._i, self._n = 0, n

    def __aiter__(self) -> _Paced:
        return self

    async def __anext__(self) -> str:
        await trio.sleep(0.001)
        if self._i == self._n:
            raise StopAsyncIteration
        self._i += 1
        return f"p{self._i - 1} "


async def test_a_paced_token_is_handed_over_without_a_loop_round(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A future per hand-over queued the consumer's wake-up on the trio-asyncio loop: one
    # loop.call_soon (and a round of its Trio task) per paced token, 100 here.
    source = th.iterator_source(lambda info: _Paced(100), name="paced")
    scheduled: list[object] = []

    async def consume() -> tuple[list[str], set[str | None], set[bool]]:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        real_call_soon = loop.call_soon

        def counting_call_soon(callback: Any, *args: Any, **kwargs: Any) -> Any:
            scheduled.append(callback)
            return real_call_soon(callback, *args, **kwargs)

        got, libraries, tasks = [], set(), set()
        loop.call_soon = counting_call_soon  # type: ignore[method-assign]
        try:
            async with aio_hedged_stream(None, [source]) as stream:
                async for token in stream:
                    got.append(token)
                    # The consumer resumed by the pump still runs as asyncio code, in its task.
                    libraries.add(sniffio.current_async_library())
                    tasks.add(asyncio.current_task() is me)
                    await asyncio.sleep(0)  # and asyncio works from there
        finally:
            del loop.call_soon
        return got, libraries, tasks

    got, libraries, tasks = await in_asyncio(consume)
    assert got == [f"p{i} " for i in range(100)]
    assert libraries == {"asyncio"} and tasks == {True}
    # asyncio.sleep(0) is one call_soon per token; the hand-overs add at most the commit, the
    # end and the pump's own start and result (a future per hand-over: 100 more).
    assert len(scheduled) <= 100 + 6, len(scheduled)


async def test_cancelling_a_consumer_waiting_for_a_paced_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = th.iterator_source(lambda info: _Paced(10_000), name="paced")

    got: list[str] = []

    async def read() -> None:
        async with aio_hedged_stream(None, [source]) as stream:
            async for token in stream:
                got.append(token)

    async def consume() -> str:
        try:  # cancelled between two tokens: while it waits on a hand-over
            await asyncio.wait_for(read(), 0.0105)
        except asyncio.TimeoutError:
            return "timed out"
        return "ended"

    assert await in_asyncio(consume) == "timed out"
    assert got == [f"p{i} " for i in range(10)]


async def test_events_and_tokens_share_one_queue(autojump_clock: trio.testing.MockClock) -> None:
    source = _BurstSource(3)

    async def consume() -> tuple[list[th.events.Delta], list[str]]:
        async with aio_hedged_stream(None, [source]) as stream:
            events = []
            async for event in stream.events():
                events.append(event)
                if event.content:
                    break
            return events, [token async for token in stream]

    events, rest = await in_asyncio(consume)
    assert events == [th.events.Delta(role="assistant"), th.events.Delta(content="t0 ")]
    assert rest == ["t1 ", "t2 "]


async def test_the_pump_reads_at_most_buffer_ahead(autojump_clock: trio.testing.MockClock) -> None:
    counter = _Counter(100)
    seen: list[int] = []

    async def consume() -> list[str]:
        source = th.iterator_source(lambda info: counter, name="counter")
        async with aio_hedged_stream(None, [source], buffer=8) as stream:
            got = []
            async for token in stream:
                got.append(token)
                await asyncio.sleep(1)  # a slow consumer (virtual time)
                seen.append(counter.produced - len(got))
            return got

    got = await in_asyncio(consume)
    assert got == [f"{i} " for i in range(100)]
    assert max(seen) <= 8 + 1  # the buffer, and the delta in the pump's hand


async def test_tokens_before_an_interruption_come_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()

    async def consume() -> tuple[list[str], BaseException | None]:
        got: list[str] = []
        try:
            async with aio_hedged_stream(
                None, sources(ledger, Script(ttft=0.1, tokens=5, fail_after_tokens=3))
            ) as stream:
                async for token in stream:
                    got.append(token)
        except th.StreamInterrupted as exc:
            return got, exc
        return got, None

    got, error = await in_asyncio(consume)
    assert got == ["primary:0 ", "primary:1 ", "primary:2 "]
    assert isinstance(error, th.StreamInterrupted) and error.text == "".join(got)
    assert ledger.open_now == 0


def test_bad_arguments_fail_before_any_io() -> None:
    with pytest.raises(ValueError, match="buffer"):
        aio_hedged_stream(None, [_BurstSource(1)], buffer=0)
    with pytest.raises(ValueError, match="replicas"):
        aio_hedged_stream(None, [])
    with pytest.raises(TypeError, match="stream must be a HedgedStream"):
        AioHedgedStream(object())  # type: ignore[arg-type]


def test_plain_asyncio_gets_a_clear_error() -> None:
    async def consume() -> None:
        async with aio_hedged_stream(None, [_BurstSource(1)]):
            pass

    # trio_asyncio's import installs its loop policy: build a stock asyncio loop by hand.
    loop = asyncio.SelectorEventLoop()
    try:
        with pytest.raises(RuntimeError, match=r"trio_asyncio\.run"):
            loop.run_until_complete(consume())
    finally:
        loop.close()


# -- AioHedger -----------------------------------------------------------------------------------


async def test_aio_hedger_is_shared_by_asyncio_tasks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()
    events: list[th.events.HedgeEvent] = []
    config = th.HedgerConfig(hedge_after=1.0, budget=None, throttle=None)

    async def main() -> tuple[list[str], th.policy.HedgerStatistics]:
        async with AioHedger(
            sources(ledger, Script(ttft=5.0, tokens=1), Script(ttft=0.5, tokens=1)),
            config,
            on_event=[events.append],
        ) as hedger:

            async def one(i: int) -> str:
                async with hedger.stream(None, request_id=f"r{i}") as stream:
                    return "".join([t async for t in stream])

            answers = await asyncio.gather(*(one(i) for i in range(3)))
            assert hedger.hedge_delay() == 1.0
            return answers, hedger.statistics()

    answers, stats = await in_asyncio(main)
    # Three concurrent requests each went to a replica first (least loaded), and whichever
    # got the slow primary hedged to the other one.
    assert sorted(answers) == sorted(["backup:0 "] * len(answers))
    assert stats.requests == 3 and stats.finished == 3
    assert {e.request_id for e in events if e.kind is th.events.EventKind.REQUEST_FINISHED} == {
        "r0",
        "r1",
        "r2",
    }
    assert ledger.open_now == 0


async def test_aio_hedger_refuses_streams_after_close() -> None:
    async def main() -> None:
        hedger = AioHedger([_BurstSource(1)])
        await hedger.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            hedger.stream(None)

    await in_asyncio(main)


# -- cancellation from asyncio closes every upstream response (real sockets) ---------------------

LIMIT = 0.050  # seconds from the asyncio cancellation to the server seeing the disconnect


async def _cancel_case(how: str, *, committed: bool) -> None:
    """Two fake replicas; asyncio code cancels the request ``how``, either during the race
    (both attempts open, no first token) or after the commit (the winner streaming)."""
    slow = Behaviour(ttft=30.0, tokens=3)
    streaming = Behaviour(ttft=0.0, token_delay=0.02, tokens=1000)
    behaviours = (slow, streaming) if committed else (slow, slow)
    async with fake_replicas(*behaviours) as replicas, httpx.AsyncClient() as client:
        targets = [th.Replica(r.url, name=r.name) for r in replicas]
        policy = th.HedgePolicy(hedge_after=0.01)
        cancelled_at: list[float] = []

        async def both_sent() -> None:
            for r in replicas:
                await r.wait_request(0)

        async def consume() -> None:
            async with aio_hedged_stream(REQUEST, targets, policy, client=client) as stream:
                async for _ in stream:
                    if how == "break":
                        cancelled_at.append(trio.current_time())
                        break
            await asyncio.sleep(0)

        async def race_then_cancel() -> None:
            if how == "break":
                await consume()
                return
            if how == "timeout" and sys.version_info >= (3, 11):
                # asyncio.timeout: cancel at a deadline, without knowing it in advance here.
                deadline = asyncio.get_running_loop().time() + 3600
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(deadline) as cm:
                        task = asyncio.ensure_future(consume())
                        await trio_asyncio.trio_as_aio(both_sent)()
                        if committed:
                            await asyncio.sleep(0.05)
                        cancelled_at.append(trio.current_time())
                        cm.reschedule(asyncio.get_running_loop().time())
                        await task
                return
            task = asyncio.ensure_future(consume())
            await trio_asyncio.trio_as_aio(both_sent)()
            if committed:
                await asyncio.sleep(0.05)  # the winner is streaming
            cancelled_at.append(trio.current_time())
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        async with trio_asyncio.open_loop():
            await trio_asyncio.aio_as_trio(race_then_cancel)()
        (t_cancel,) = cancelled_at
        for replica in replicas:
            with trio.fail_after(1):
                record = await replica.wait_finished(0)
            if record.completed:
                continue
            assert record.disconnected_at is not None, record
            lag = record.disconnected_at - t_cancel
            assert lag < LIMIT, f"{replica.name} saw the disconnect {lag * 1000:.1f} ms late"


@pytest.mark.parametrize("committed", [False, True], ids=["during-race", "after-commit"])
async def test_task_cancel_closes_every_upstream(committed: bool) -> None:
    await _cancel_case("cancel", committed=committed)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is Python 3.11+")
@pytest.mark.parametrize("committed", [False, True], ids=["during-race", "after-commit"])
async def test_asyncio_timeout_closes_every_upstream(committed: bool) -> None:
    await _cancel_case("timeout", committed=committed)


async def test_break_then_leaving_closes_the_winner() -> None:
    await _cancel_case("break", committed=True)


async def test_a_second_cancel_does_not_cut_the_close_short(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = Ledger()

    async def consume() -> None:
        async with aio_hedged_stream(
            None, sources(ledger, Script(ttft=0.1, tokens=100, gap=1.0, close_delay=0.5))
        ) as stream:
            async for _ in stream:
                pass

    async def cancel_twice() -> tuple[int, float]:
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(2)  # streaming
        task.cancel()
        await asyncio.sleep(0.2)  # the pump is closing the winner (0.5 s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return ledger.open_now, trio.current_time()

    start = trio.current_time()
    open_now, ended = await in_asyncio(cancel_twice)
    assert open_now == 0  # the task ended only after the winner was closed
    assert ended - start == pytest.approx(2.5)
