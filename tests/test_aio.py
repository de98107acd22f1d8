"""asyncio code consuming a hedged stream through trio-asyncio."""

from __future__ import annotations

import asyncio

import pytest
import trio
import trio.testing

trio_asyncio = pytest.importorskip("trio_asyncio")

import trio_hedge as th  # noqa: E402
from trio_hedge.aio import aio_hedged_stream  # noqa: E402

from .scripted import Ledger, Script, sources  # noqa: E402


async def _consume(ledger: Ledger, limit: int | None) -> tuple[list[str], th.Report]:
    got: list[str] = []
    async with aio_hedged_stream(
        None, sources(ledger, Script(ttft=5.0), Script(ttft=0.5, tokens=4))
    ) as stream:
        async for token in stream:
            got.append(token)
            if limit is not None and len(got) == limit:
                break
    return got, stream.report


@pytest.mark.parametrize("limit", [None, 1])
async def test_asyncio_consumer(limit: int | None, autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()
    async with trio_asyncio.open_loop():
        got, report = await trio_asyncio.aio_as_trio(_consume)(ledger, limit)
    expected = [f"backup:{i} " for i in range(4)]
    assert got == (expected if limit is None else expected[:1])
    assert report.winner == 2
    assert report.ttft == 1.5
    assert ledger.open_now == 0


async def test_asyncio_cancel_closes_everything(autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()

    async def consume_with_timeout() -> None:
        await asyncio.wait_for(_consume(ledger, None), timeout=0.7)

    async with trio_asyncio.open_loop():
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await trio_asyncio.aio_as_trio(consume_with_timeout)()
    assert ledger.open_now == 0
    assert len(ledger.opened) == 1


async def test_asyncio_failure_is_typed(autojump_clock: trio.testing.MockClock) -> None:
    ledger = Ledger()

    async def consume() -> None:
        async with aio_hedged_stream(None, sources(ledger, Script(fail_at=0.1))):
            pass

    async with trio_asyncio.open_loop():
        with pytest.raises(th.AllAttemptsFailed):
            await trio_asyncio.aio_as_trio(consume)()
    assert ledger.open_now == 0
