"""The throughput floor (issue 28, "slow but alive"): off by default; on, a winner whose tokens
come far below the rate the fleet learned for its replica and model, timed on the producer
side (a caller's own pauses are not the upstream's), is finished elsewhere by the recovery
machinery, bounded by ``max_recoveries`` and counted in the report. In virtual time: exact
instants, and a second caller whose service is unchanged.
"""

from __future__ import annotations

from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.errors import ErrorKind
from trio_hedge.policy import HedgerConfig, OutlierDetection, RecoveryPolicy, ThroughputFloor
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.testing import Behaviour, MockReplicas

REQUEST: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
N = 30
FULL = "".join(f"tok{i} " for i in range(N))
PACE = {"ttft": 0.5, "token_delay": 0.05}  # 20 tokens/s
WINDOW = 2.0
FLOOR = ThroughputFloor(window=WINDOW, ratio=0.1, min_samples=3, min_tokens=8)
CONFIG = HedgerConfig(
    hedge_after=None,
    pick="in_order",
    outlier_detection=None,
    recovery=RecoveryPolicy(throughput_floor=FLOOR),
)
#: After 10 tokens at 20/s, one token a second: alive, and a hundred times too slow.
CRAWL = Behaviour(tokens=N, slow_after=10, slow_token_delay=1.0, **PACE)
FAST = Behaviour(tokens=N, **PACE)
WARM_UP = 3  # requests that teach the fleet a's rate (min_samples)


def _crawl_on_last(record: Any) -> Behaviour:
    return CRAWL if record.index == WARM_UP else FAST


async def _warm(hedger: th.Hedger, times: int = WARM_UP) -> None:
    for _ in range(times):
        async with hedger.stream(REQUEST) as stream:
            assert "".join([t async for t in stream]) == FULL


async def test_a_crawling_winner_is_finished_elsewhere_within_two_windows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"a": _crawl_on_last, "b": FAST})
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, CONFIG, client=client) as hedger:
            await _warm(hedger)
            t0 = trio.current_time()
            async with hedger.stream(REQUEST) as stream:
                text = "".join([t async for t in stream])
            done = trio.current_time() - t0
            stats = hedger.statistics()
    report = stream.report
    assert text == FULL and report.completed  # identical: nothing lost, nothing repeated
    a, b = report.attempts
    assert (a.replica, a.outcome, b.replica, b.trigger, b.outcome) == (
        "a",
        O.WON,
        "b",
        "recovery",
        O.WON,
    )
    assert a.error is not None and a.error.kind is ErrorKind.SLOW_STREAM
    assert b.recovery is not None
    assert (b.recovery.reason, b.recovery.method) == ("slow_stream", "replay")
    # a's 10th token at 0.95 s, its 11th at 1.95 s, its 12th at 2.95 s: the four tokens the
    # floor asks per 2 s of waiting (0.1 × 20/s × 2 s) are not in the 2 s before it (the
    # floor judges at each token: a read is never cut). b replays from 2.95 s: 12 tokens
    # reproduced from 3.45 s, the 13th at 4.05 s (a closed then), the last at 4.90 s.
    assert b.started_at == pytest.approx(2.95)
    assert done == pytest.approx(4.90)
    assert done - 0.95 <= 2 * WINDOW  # from the last token at its learned pace
    assert mock.requests["a"][WARM_UP].disconnected_at == pytest.approx(t0 + 4.05)
    assert (report.slow_streams, stats.slow_streams) == (1, 1)


async def test_the_floor_is_off_by_default(autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas({"a": _crawl_on_last, "b": FAST})
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    config = attrs.evolve(CONFIG, recovery=RecoveryPolicy())
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, config, client=client) as hedger:
            await _warm(hedger)
            t0 = trio.current_time()
            async with hedger.stream(REQUEST) as stream:
                assert "".join([t async for t in stream]) == FULL
    assert trio.current_time() - t0 == pytest.approx(0.95 + 20 * 1.0)  # it crawled to its end
    assert stream.report.recoveries == 0 and mock.requests["b"] == []
    assert all(a.stream_rate is None for a in stream.report.attempts)  # no timing at all


async def test_a_callers_own_pauses_are_not_a_slow_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The caller reads one token a second from a fast stream: the upstream waits on it, not
    # the other way round. Producer-side, the stream is as fast as ever: no recovery.
    mock = MockReplicas({"a": FAST, "b": FAST})
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, CONFIG, client=client) as hedger:
            await _warm(hedger)
            async with hedger.stream(REQUEST) as stream:
                got = []
                async for token in stream:
                    got.append(token)
                    await trio.sleep(1.0)
    assert "".join(got) == FULL and stream.report.recoveries == 0
    assert mock.requests["b"] == []


async def test_no_evidence_no_floor(autojump_clock: trio.testing.MockClock) -> None:
    # Fewer than min_samples winners seen on a: its rate is not known, nothing is judged.
    mock = MockReplicas({"a": lambda r: CRAWL if r.index == 2 else FAST, "b": FAST})
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, CONFIG, client=client) as hedger:
            await _warm(hedger, WARM_UP - 1)
            async with hedger.stream(REQUEST) as stream:
                assert "".join([t async for t in stream]) == FULL
    assert stream.report.recoveries == 0


async def test_a_slow_winner_no_replica_can_take_over_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The floor cuts nothing it cannot replace: b is down (503), so the crawling answer is
    # read on to its end rather than ended, and the failed recovery is in the report.
    mock = MockReplicas(
        {"a": _crawl_on_last, "b": lambda r: FAST if r.index < 0 else Behaviour(status=503)}
    )
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, CONFIG, client=client) as hedger:
            await _warm(hedger)
            async with hedger.stream(REQUEST) as stream:
                assert "".join([t async for t in stream]) == FULL
    report = stream.report
    assert report.completed and report.attempts[0].error is None
    assert [(a.replica, a.outcome) for a in report.attempts] == [("a", O.WON), ("b", O.FAILED)]


async def test_another_callers_service_is_unchanged_by_a_crawl(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One Hedger, two callers on the same replica: the measured caller's tokens arrive at the
    # same instants whether or not another caller's answer crawls there meanwhile and is
    # taken over by b (a's rate, learned from unbroken streams only, stays what it was).
    crawl_body = {**REQUEST, "messages": [{"role": "user", "content": "crawl"}]}

    def on_a(record: Any) -> Behaviour:
        return CRAWL if record.json["messages"][0]["content"] == "crawl" else FAST

    async def run(crawler: bool) -> list[float]:
        mock = MockReplicas({"a": on_a, "b": FAST})
        replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
        seen: list[float] = []
        async with httpx.AsyncClient(transport=mock.transport) as client:
            async with th.Hedger(replicas, CONFIG, client=client) as hedger:
                await _warm(hedger)

                async def crawl() -> None:
                    async with hedger.stream(crawl_body) as s:
                        assert "".join([t async for t in s]) == FULL
                    assert s.report.slow_streams == 1

                async def measured() -> None:
                    t0 = trio.current_time()
                    for _ in range(3):
                        async with hedger.stream(REQUEST) as s:
                            async for _ in s:
                                seen.append(round(trio.current_time() - t0, 9))
                        assert s.report.winner_replica == "a" and s.report.recoveries == 0

                async with trio.open_nursery() as nursery:
                    if crawler:
                        nursery.start_soon(crawl)
                    nursery.start_soon(measured)
        return seen

    alone = await run(False)
    assert len(alone) == 3 * N
    assert await run(True) == alone


#: Ejection at a replica's first failure (no cap): a crawl judged a failure would eject.
TOUCHY = attrs.evolve(
    CONFIG, outlier_detection=OutlierDetection(consecutive_failures=1, max_ejection_percent=100)
)


async def test_a_crawl_is_slow_not_a_failure(autojump_clock: trio.testing.MockClock) -> None:
    # The judge's "crawl": a's crawling answer is finished on b, and a is counted slow in its
    # window, not failed: with ejection at the first failure it stays in, and the next
    # caller is served by it as before (a crawl judged a break ejected a for everyone).
    mock = MockReplicas({"a": _crawl_on_last, "b": FAST})
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, TOUCHY, client=client) as hedger:
            await _warm(hedger)
            async with hedger.stream(REQUEST) as crawled:
                assert "".join([t async for t in crawled]) == FULL
            a = hedger.statistics().replicas[0]
            async with hedger.stream(REQUEST) as after:
                assert "".join([t async for t in after]) == FULL
    assert crawled.report.slow_streams == 1 and crawled.report.winner_replica == "b"
    assert (a.state, a.failures, a.consecutive_failures, a.slow_attempts) == ("healthy", 0, 0, 1)
    assert after.report.winner_replica == "a" and after.report.ttft == pytest.approx(0.5)


async def test_a_crawl_read_on_to_its_end_served_the_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # No replica can take the crawl over (b's recovery answers 503): a reads on to the end,
    # and that is a request served: a's run of failures (one 503 earlier) resets, as any
    # served request's does.
    def on_a(record: Any) -> Behaviour:
        return {WARM_UP: Behaviour(status=503), WARM_UP + 1: CRAWL}.get(record.index, FAST)

    def on_b(record: Any) -> Behaviour:
        return FAST if record.index == 0 else Behaviour(status=503)

    mock = MockReplicas({"a": on_a, "b": on_b})
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    config = attrs.evolve(TOUCHY, outlier_detection=OutlierDetection(consecutive_failures=3))
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, config, client=client) as hedger:
            await _warm(hedger)
            async with hedger.stream(REQUEST) as failed_over:
                assert "".join([t async for t in failed_over]) == FULL
            before = hedger.statistics().replicas[0]
            async with hedger.stream(REQUEST) as crawled:
                assert "".join([t async for t in crawled]) == FULL
            a = hedger.statistics().replicas[0]
    assert failed_over.report.winner_replica == "b"
    assert (before.failures, before.consecutive_failures) == (1, 1)
    report = crawled.report
    assert [(x.replica, x.outcome) for x in report.attempts] == [("a", O.WON), ("b", O.FAILED)]
    assert report.completed and report.attempts[0].error is None
    assert (a.failures, a.consecutive_failures, a.slow_attempts) == (1, 0, 1)
