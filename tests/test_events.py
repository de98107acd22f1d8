"""The richer event iterator and the first-token rule, over HTTP in virtual time."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import HedgePolicy
from trio_hedge.events import FirstToken
from trio_hedge.testing import Behaviour, MockReplicas

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _sse(*chunks: dict[str, object]) -> list[bytes]:
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


def _delta(**delta: object) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


class _Timed(httpx.AsyncByteStream):
    """Each piece after its own delay (seconds) — a reasoning model thinking, then answering."""

    def __init__(self, pieces: list[tuple[float, bytes]]) -> None:
        self._pieces = pieces

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for delay, piece in self._pieces:
            await trio.sleep(delay)
            yield piece


THINKER = [
    (0.0, _sse(_delta(role="assistant"))[0]),
    (0.2, _sse(_delta(reasoning_content="think "))[0]),
    (0.3, _sse(_delta(tool_calls=[{"index": 0, "id": "c1", "function": {"name": "f"}}]))[0]),
    (0.5, _sse(_delta(content="answer"))[0]),
    (0.0, _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})[0]),
    (0.0, _sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})[0]),
    (0.0, b"data: [DONE]\n\n"),
]


@pytest.mark.parametrize(
    ("rule", "commit_at"),
    [
        (FirstToken.CONTENT, 1.0),
        (FirstToken.CONTENT_OR_REASONING, 0.2),
        (FirstToken.ANY_OUTPUT, 0.2),
    ],
)
async def test_first_token_rule_and_events(
    rule: FirstToken, commit_at: float, autojump_clock: trio.testing.MockClock
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Timed(THINKER)
        )

    policy = HedgePolicy(hedge_after=None, first_token=rule)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        stream = th.hedged_stream(REQUEST, [th.Replica("http://x.test/v1")], policy, client=client)
        async with stream:
            assert stream.report.ttft == commit_at
            events = [e async for e in stream.events()]
    assert [e.role for e in events if e.role] == ["assistant"]
    assert "".join(e.reasoning for e in events) == "think "
    assert [tc.name for e in events for tc in e.tool_calls] == ["f"]
    assert "".join(e.content for e in events) == "answer"
    assert [e.finish_reason for e in events if e.finish_reason] == ["stop"]
    assert [e.usage for e in events if e.usage] == [{"prompt_tokens": 3, "completion_tokens": 2}]
    assert stream.report.text == "answer"
    assert stream.report.token_count == 1


async def test_events_break_early_closes_the_winner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"a": Behaviour(ttft=0.5, token_delay=0.1, tokens=5)})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        replicas = [th.Replica(mock.url("a"), name="a")]
        async with th.hedged_stream(REQUEST, replicas, client=client) as stream:
            async for event in stream.events():
                if event.content:
                    break
    record = mock.requests["a"][0]
    assert record.disconnected_at is not None
    assert stream.report.text == "tok0 "


async def test_iterator_source_yielding_deltas(autojump_clock: trio.testing.MockClock) -> None:
    async def thinker(info: th.sources.AttemptInfo):  # type: ignore[no-untyped-def]
        await trio.sleep(0.1)
        yield th.events.Delta(reasoning="hmm ")
        await trio.sleep(0.1)
        yield th.events.Delta(content="yes")

    source = th.iterator_source(thinker, name="thinker")
    policy = HedgePolicy(first_token=FirstToken.CONTENT_OR_REASONING)
    async with th.hedged_stream(None, [source], policy) as stream:
        assert stream.report.ttft == 0.1
        tokens = [t async for t in stream]
    assert tokens == ["yes"]


def _joined(*chunks: dict[str, object]) -> bytes:
    return b"".join(_sse(*chunks)[:-1])


BURSTS = [  # four reads: the events of each arrive together
    (0.0, _joined(_delta(role="assistant"), _delta(content="a"))),
    (0.1, _joined(_delta(content="b"), _delta(content="c"), _delta(content="d"))),
    (0.1, _joined(_delta(content="e"))),
    (0.0, _joined({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})),
    (0.0, b"data: [DONE]\n\n"),
]


@pytest.mark.parametrize("first", [0, 1, 3])
async def test_batches_yield_what_each_read_brought(
    first: int, autojump_clock: trio.testing.MockClock
) -> None:
    """``batches()`` yields the events read before the commit, then each read's events
    together (what the gateway writes with one send); after ``first`` events taken one by
    one through ``events()``, it goes on from there: nothing repeated, nothing lost."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Timed(BURSTS)
        )

    policy = HedgePolicy(hedge_after=None, first_token=FirstToken.ANY_OUTPUT)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        stream = th.hedged_stream(REQUEST, [th.Replica("http://x.test/v1")], policy, client=client)
        async with stream:
            singles = []
            events = stream.events()
            for _ in range(first):
                singles.append(await events.__anext__())
            batches = [b async for b in stream.batches()]

    def names(events: list[th.events.Delta]) -> list[str]:
        return [e.role or e.content or e.finish_reason or "" for e in events]

    reads = [["assistant", "a"], ["b", "c", "d"], ["e"], ["stop"]]
    flat = [name for read in reads for name in read]
    assert names(singles) == flat[:first]
    assert [names(b) for b in batches] == _rest(reads, first)
    assert stream.report.text == "abcde"
    assert stream.report.completed


def _rest(reads: list[list[str]], taken: int) -> list[list[str]]:
    """The reads after ``taken`` events went one by one: the rest of a read comes as one."""
    out = []
    for read in reads:
        if taken >= len(read):
            taken -= len(read)
            continue
        out.append(read[taken:])
        taken = 0
    return out
