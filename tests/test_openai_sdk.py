"""The openai SDK under Trio, and OpenAISDKSource racing users' own AsyncOpenAI clients
against fake replicas over real loopback sockets."""

from __future__ import annotations

import pytest
import trio

openai = pytest.importorskip("openai")

import trio_hedge as th  # noqa: E402
from trio_hedge.errors import ErrorKind  # noqa: E402
from trio_hedge.sources.openai_sdk import (  # noqa: E402
    OpenAISDKSource,
    SDKChunkDelta,
    openai_sdk_sources,
    sdk_chunks,
)
from trio_hedge.testing import Behaviour, FakeReplica, fake_replicas  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]
KEY = "sk-test-secret-0123456789"


def _client(replica: FakeReplica, **kwargs: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=replica.url, api_key=KEY, **kwargs)


# -- the finding: AsyncOpenAI works under Trio, and a cancel closes its response ---------------


async def test_async_openai_streams_under_trio_and_a_cancel_closes_the_response() -> None:
    async with FakeReplica(Behaviour(ttft=0.0, token_delay=0.01, tokens=500)) as replica:
        client = _client(replica, max_retries=0)
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        seen = 0
        with trio.move_on_after(0.05) as scope:
            async for chunk in stream:
                seen += bool(chunk.choices and chunk.choices[0].delta.content)
        cancelled_at = trio.current_time()
        assert scope.cancelled_caught and seen > 0
        with trio.fail_after(1):
            record = await replica.wait_disconnected(0)
        assert record.disconnected_at is not None
        assert record.disconnected_at - cancelled_at < 0.050
        await stream.close()
        await client.close()


# -- the source ---------------------------------------------------------------------------------


async def test_race_over_sdk_clients_yields_tokens_and_chunks() -> None:
    async with fake_replicas(
        Behaviour(ttft=5.0), Behaviour(ttft=0.05, tokens=3), names=["p", "b"]
    ) as (p, b):
        async with _client(p) as cp, _client(b) as cb:
            sources = openai_sdk_sources(
                {"primary": cp, "backup": cb},
                model="m",
                messages=MESSAGES,
                overrides={"backup": {"model": "small"}},
            )
            stream = th.hedged_stream(None, sources, th.HedgePolicy(hedge_after=0.05))
            async with stream:
                chunks = [c async for c in sdk_chunks(stream)]
            with trio.fail_after(1):
                await p.wait_disconnected(0)
    assert stream.report.winner == 2 and stream.report.winner_replica == "backup"
    assert stream.report.hedged
    assert all(type(c).__name__ == "ChatCompletionChunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "tok0 tok1 tok2 "
    )
    assert b.requests[0].json["model"] == "small" and b.requests[0].json["stream"] is True
    assert p.requests[0].json["model"] == "m"
    headers = b.requests[0].headers
    assert headers["x-request-id"] == stream.request_id and headers["x-hedge-attempt"] == "2"


async def test_tokens_and_events_carry_the_chunk() -> None:
    async with FakeReplica(Behaviour(tokens=2, usage=True)) as replica, _client(replica) as c:
        source = OpenAISDKSource(
            c,
            {"model": "m", "messages": MESSAGES, "stream_options": {"include_usage": True}},
            name="one",
        )
        async with th.hedged_stream(None, [source]) as stream:
            events = [e async for e in stream.events()]
    assert all(isinstance(e, SDKChunkDelta) and e.chunk is not None for e in events)
    assert "".join(e.content for e in events) == "tok0 tok1 "
    assert events[-1].usage is not None and events[-1].usage["completion_tokens"] == 2
    assert any(e.finish_reason == "stop" for e in events)
    assert stream.report.completed


# Each case: what the primary does -> the error kind recorded, and whether the backup answered
# (a failover at once: the SDK's own retries would have delayed it and hidden the failure).
FAILURES = [
    (Behaviour(status=503, retry_after=1), ErrorKind.OVERLOADED, 1.0, True),
    (Behaviour(status=500), ErrorKind.SERVER_ERROR, None, True),
    (Behaviour(status=429, retry_after=2), ErrorKind.RATE_LIMIT, 2.0, True),
    (Behaviour(status=401), ErrorKind.AUTH, None, True),
    (Behaviour(status=404), ErrorKind.NOT_FOUND, None, True),
    (Behaviour(inband_error_after=0, inband_error_status=429), ErrorKind.RATE_LIMIT, None, True),
    (Behaviour(cut_after=0), ErrorKind.STREAM_TRUNCATED, None, True),  # after the role chunk
    (Behaviour(status=400), ErrorKind.INVALID_REQUEST, None, False),
]


@pytest.mark.parametrize(
    ("primary", "kind", "retry_after", "fails_over"),
    FAILURES,
    ids=[f"{b.status}-{k.value}" for b, k, _, _ in FAILURES],
)
async def test_sdk_errors_are_classified_like_http_errors(
    primary: Behaviour, kind: ErrorKind, retry_after: float | None, fails_over: bool
) -> None:
    async with fake_replicas(primary, Behaviour(tokens=2), names=["p", "b"]) as (p, b):
        # The user's client retries by default (max_retries=2): attempts must not.
        async with _client(p) as cp, _client(b) as cb:
            sources = openai_sdk_sources({"p": cp, "b": cb}, model="m", messages=MESSAGES)
            stream = th.hedged_stream(None, sources, th.HedgePolicy(hedge_after=None))
            if fails_over:
                async with stream:
                    assert "".join([t async for t in stream]) == "tok0 tok1 "
            else:
                with pytest.raises(th.FatalAttemptError):
                    async with stream:
                        pass
    first = stream.report.attempts[0]
    assert first.error is not None and first.error.kind is kind
    assert first.error.retry_after == retry_after
    assert len(p.requests) == 1  # no retry inside the attempt
    assert len(b.requests) == (1 if fails_over else 0)


async def test_a_cut_after_data_interrupts_and_keys_never_leak() -> None:
    async with FakeReplica(Behaviour(tokens=3, cut_after=1)) as replica, _client(replica) as c:
        source = OpenAISDKSource(c, {"model": "m", "messages": MESSAGES})
        with pytest.raises(th.StreamInterrupted) as info:
            async with th.hedged_stream(None, [source]) as stream:
                async for _ in stream:
                    pass
    assert info.value.error.kind is ErrorKind.STREAM_TRUNCATED
    assert info.value.text == "tok0 "
    assert KEY not in repr(source)


async def test_a_key_echoed_by_the_server_is_masked() -> None:
    echo = Behaviour(status=401, error_message=f"Incorrect API key provided: {KEY}")
    async with FakeReplica(echo) as replica, _client(replica) as c:
        source = OpenAISDKSource(c, {"model": "m", "messages": MESSAGES})
        with pytest.raises(th.AllAttemptsFailed) as info:
            async with th.hedged_stream(None, [source]):
                pass
    assert KEY not in str(info.value)
    assert KEY not in str(info.value.errors[0]) and "***" in str(info.value.errors[0])


def test_bad_arguments_are_refused_before_any_io() -> None:
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key=KEY)
    with pytest.raises(TypeError, match="sync client"):
        OpenAISDKSource(openai.OpenAI(api_key=KEY), {"model": "m", "messages": []})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'model'"):
        OpenAISDKSource(client, {"messages": []})
    with pytest.raises(ValueError, match="stream=False"):
        OpenAISDKSource(client, {"model": "m", "messages": [], "stream": False})
    with pytest.raises(ValueError, match="unknown replicas"):
        openai_sdk_sources({"a": client}, overrides={"b": {}}, model="m", messages=[])
    (source,) = openai_sdk_sources([client], model="m", messages=[])
    assert source.name == "127.0.0.1:9"
