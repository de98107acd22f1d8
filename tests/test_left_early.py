"""A stream left early leaves nothing for the garbage collector (issue 16), over real loopback
sockets: a ``break`` mid-stream, a cancel, a lost race, an error body cut at its limit, and
an openai-SDK stream however it ends.

httpx and httpcore read a response body through six nested async generators, and the openai
SDK's ``AsyncStream`` adds its own: on bcbad18 each way of leaving early dropped them
unfinished, for Trio's finaliser to close wherever the collector ran (a ``ResourceWarning``:
"Surround its use in 'async with aclosing(...)'"). The seeded fuzz
(``tests/test_cancel_fuzz.py``) checks the same over 500 random races.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio

import trio_hedge as th
from trio_hedge.testing import Behaviour, FakeReplica, fake_replicas

from .misbehaving import GeneratorLeaks

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
STREAMING = Behaviour(ttft=0.0, token_delay=0.001, tokens=200)


async def _break_mid_stream(stream: th.HedgedStream) -> None:
    async with stream:
        async for _ in stream:
            break


async def _cancel_mid_stream(stream: th.HedgedStream) -> None:
    with trio.CancelScope() as scope:
        async with stream:
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    scope.cancel()
                    await trio.lowlevel.checkpoint()  # the cancel lands here, between reads


async def _events_break(stream: th.HedgedStream) -> None:
    async with stream:
        async for delta in stream.events():
            if delta.content:
                break


LEAVE: dict[str, Callable[[th.HedgedStream], Awaitable[None]]] = {
    "break": _break_mid_stream,
    "cancel between reads": _cancel_mid_stream,
    "events() break": _events_break,
}


async def _no_generator_left(run: Callable[[], Awaitable[None]]) -> None:
    leaks = GeneratorLeaks()
    with leaks.recording():
        await run()
        await leaks.settle()
    assert leaks.problems() == []


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
@pytest.mark.parametrize("leave", list(LEAVE), ids=list(LEAVE))
async def test_leaving_a_stream_early_leaves_no_generator(leave: str, http2: bool) -> None:
    async with FakeReplica(STREAMING, http2=http2) as replica:
        async with th.transport.make_client(http1=not http2, http2=http2) as client:

            async def run() -> None:
                stream = th.hedged_stream(REQUEST, [th.Replica(replica.url)], client=client)
                await LEAVE[leave](stream)

            await _no_generator_left(run)


async def _read_to_the_end(stream: th.HedgedStream) -> None:
    async with stream:
        async for _ in stream:
            pass


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
async def test_a_lost_race_leaves_no_generator(http2: bool) -> None:
    # Two replicas with the same TTFT, started together: the loser often reads its own first
    # token in the tick of the winner's commit and is closed right after that read (a tie,
    # as the fuzz draws them). The winner is read to its end. On bcbad18 the loser's
    # generators were dropped in 6 to 20 of the 20 races (three runs).
    same = Behaviour(ttft=0.01, token_delay=0.001, tokens=5)
    async with fake_replicas(same, same, http2=http2) as servers:
        async with th.transport.make_client(http1=not http2, http2=http2) as client:
            replicas = [th.Replica(s.url, name=f"r{i}") for i, s in enumerate(servers)]

            async def run() -> None:
                for _ in range(20):
                    policy = th.HedgePolicy(hedge_after=0.0)
                    stream = th.hedged_stream(REQUEST, replicas, policy, client=client)
                    await _read_to_the_end(stream)
                    assert stream.report.backups_sent == 1

            await _no_generator_left(run)


async def test_an_error_body_cut_at_its_limit_leaves_no_generator() -> None:
    # A 500 whose body is longer than the 4,096 bytes read of it: the read stops early.
    behaviour = Behaviour(status=500, error_message="x" * 20_000)
    async with FakeReplica(behaviour) as replica:
        async with th.transport.make_client() as client:

            async def run() -> None:
                with pytest.raises(th.AllAttemptsFailed):
                    await _break_mid_stream(
                        th.hedged_stream(REQUEST, [th.Replica(replica.url)], client=client)
                    )

            await _no_generator_left(run)


@pytest.mark.parametrize("read", ["break", "to the end"])
async def test_an_openai_sdk_stream_leaves_no_generator(read: str) -> None:
    # Read to its end too: the SDK's own loop leaves its generators at [DONE] (a `break`) and
    # drops them; the source holds them from the first chunk and closes them.
    openai = pytest.importorskip("openai")
    from trio_hedge.sources.openai_sdk import openai_sdk_sources

    async with FakeReplica(STREAMING) as replica:
        async with openai.AsyncOpenAI(base_url=replica.url, api_key="sk-test") as sdk:
            sources = openai_sdk_sources({"sdk": sdk}, **REQUEST)
            leave = _break_mid_stream if read == "break" else _read_to_the_end

            async def run() -> None:
                await leave(th.hedged_stream(None, sources))

            await _no_generator_left(run)
