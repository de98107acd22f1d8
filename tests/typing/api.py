"""The public API as users write it, type-checked by ``mypy --strict`` (``[tool.mypy] files``
in pyproject.toml), as stamina's ``tests/typing/api.py``. It is NOT meant to be executed
(pytest does not collect it: its name does not start with ``test_``); a change to the public
API that breaks this code breaks ``mypy``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import trio
from typing_extensions import assert_type

import trio_hedge
from trio_hedge import (
    AllAttemptsFailed,
    AttemptError,
    FatalAttemptError,
    HedgedStream,
    HedgeError,
    HedgePolicy,
    Hedger,
    HedgerConfig,
    LearnedDelay,
    Replica,
    ReplicasCooling,
    Report,
    RequestFailed,
    StreamInterrupted,
    hedged_stream,
    iterator_source,
)
from trio_hedge.aio import AioHedgedStream, AioHedger, aio_hedged_stream
from trio_hedge.errors import ErrorKind
from trio_hedge.events import Delta, EventKind, FirstToken, HedgeEvent, ToolCallDelta
from trio_hedge.hedger import LoadMonitor
from trio_hedge.instrumentation import LoggingHook
from trio_hedge.policy import (
    Backoff,
    HealthVerdict,
    HedgeBudget,
    HedgerStatistics,
    OutlierDetection,
    RetryThrottle,
    SizeClasses,
)
from trio_hedge.report import AttemptOutcome, AttemptRecord
from trio_hedge.sources import AttemptInfo, HeaderNames, Source
from trio_hedge.sources.probes import LoadProbe, LoadReading
from trio_hedge.transport import make_client

assert_type(trio_hedge.__version__, str)


# -- hedged_stream over iterator sources ---------------------------------------------------


async def tokens(info: AttemptInfo) -> AsyncIterator[str]:
    assert_type(info.number, int)
    assert_type(info.request_id, str)
    yield "Hello"


async def deltas(info: AttemptInfo) -> AsyncIterator[Delta]:
    yield Delta("Hi", finish_reason="stop")


async def one_request() -> str:
    primary = iterator_source(tokens, name="primary")
    backup = iterator_source(deltas, name="backup")
    source: Source = primary  # an IteratorSource is a Source
    assert_type(source.name, str)
    policy = HedgePolicy(hedge_after=0.5, first_token=FirstToken.CONTENT, stall_timeout=10.0)
    async with hedged_stream(None, [primary, backup], policy) as stream:
        assert_type(stream, HedgedStream)
        async for token in stream:
            assert_type(token, str)
        async for delta in stream.events():
            assert_type(delta, Delta)
            assert_type(delta.content, str)
            assert_type(delta.tool_calls, tuple[ToolCallDelta, ...])
            assert_type(delta.finish_reason, str | None)
    return stream.text


# -- Hedger, HedgerConfig, LearnedDelay -----------------------------------------------------


def on_event(event: HedgeEvent) -> None:
    if event.kind is EventKind.COMMITTED and event.record is not None:
        assert_type(event.record.ttft, float | None)
    if event.kind is EventKind.REPLICA_EJECTED:
        assert_type(event.model, str | None)  # None: ejected for every model


def timed(event: HedgeEvent) -> AbstractContextManager[object] | None:
    return None


async def production() -> None:
    config = HedgerConfig(
        hedge_after=LearnedDelay(percentile=0.95, window=300.0, classes=SizeClasses()),
        max_attempts=3,
        budget=HedgeBudget(ratio=0.1),
        throttle=RetryThrottle(),
        backoff=Backoff(),
        outlier_detection=OutlierDetection(),
        attribution=trio_hedge.policy.Attribution(
            caller={"auth"}, replica=[trio_hedge.errors.ErrorKind.NOT_FOUND]
        ),
        first_token_timeout=30.0,
        pick="peak_ewma",
        recovery=trio_hedge.policy.RecoveryPolicy(
            max_first_token=20.0,
            throughput_floor=trio_hedge.policy.ThroughputFloor(window=5.0, ratio=0.1),
        ),
    )
    assert_type(config.recovery.deadline(1.5), float)
    fixed = HedgerConfig(hedge_after=0.8, budget=None, pick="in_order")
    replicas = [
        Replica("http://a:8000/v1", api_key="sk-test", name="a"),
        Replica("http://b:8000/v1", headers={"X-Tenant": "t"}),
        Replica("http://c:8000/v1", name="c", probe="vllm", backup_priority=1),
        Replica("http://d:8080/v1", name="d", probe=LoadProbe("llama.cpp", interval=0.5)),
    ]
    async with (
        make_client(http2=True) as client,
        Hedger(
            replicas,
            config,
            client=client,
            headers=HeaderNames(request_id="X-Request-ID"),
            on_event=[on_event, timed, LoggingHook()],
        ) as hedger,
        Hedger(replicas, fixed) as other,
        LoadMonitor(replicas, client=client) as monitor,
    ):
        shared = Hedger(replicas, fixed, probes=monitor)
        sibling = Hedger(replicas, fleet_of=shared)  # another API of the same servers
        assert_type(sibling.statistics().replicas[0].slow_attempts, int)
        assert_type(monitor.replica_names, tuple[str, ...])
        assert_type(hedger.config, HedgerConfig)
        assert_type(other.hedge_delay(prompt_tokens=100), float | None)
        request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with hedger.stream(request, prompt_tokens=10, group="chat") as stream:
            async for token in stream:
                print(token, end="")
        stats = hedger.statistics()
        assert_type(stats, HedgerStatistics)
        assert_type(stats.replicas[0].predicted_wait, float | None)
        assert_type(stats.hedges_at_once, int)
        assert_type(stats.recovery_hedges, int)
        assert_type(stats.slow_streams, int)
        assert_type(stats.hedges_sent, int)
        assert_type(stats.replicas[0].probe_reading, LoadReading | None)
        assert_type(shared.statistics().replicas[2].probe, str)
        for verdict in stats.replicas[0].verdicts:
            assert_type(verdict, HealthVerdict)
            assert_type(verdict.model, str | None)
            assert_type(verdict.seconds, float)
        assert_type(stats.replicas[0].probe_error, str | None)
        assert_type(hedger.samples(), list[dict[str, Any]])


# -- the report, and catching the exceptions -------------------------------------------------


def read(report: Report) -> None:
    assert_type(report.winner, int | None)
    assert_type(report.ttft, float | None)
    assert_type(report.attempts, tuple[AttemptRecord, ...])
    assert_type(report.tokens_by_model, dict[str, int])
    assert_type(report.slow_streams, int)
    for attempt in report.attempts:
        assert_type(attempt.outcome, AttemptOutcome)
        assert_type(attempt.phase, str)
        assert_type(attempt.model, str | None)
        assert_type(attempt.stream_rate, float | None)
        if attempt.recovery is not None:
            assert_type(attempt.recovery.deadline, float | None)
            assert_type(attempt.recovery.hedged, bool)
        if attempt.error is not None:
            assert_type(attempt.error.kind, ErrorKind)
            assert_type(attempt.error.retryable, bool)
    assert_type(report.error, BaseException | None)


async def careful(hedger: Hedger) -> str | None:
    try:
        async with hedger.stream({"model": "m", "messages": []}) as stream:
            return "".join([t async for t in stream])
    except ReplicasCooling as exc:
        assert_type(exc.retry_in, float)
    except FatalAttemptError as exc:
        assert_type(exc.errors, tuple[AttemptError, ...])
    except AllAttemptsFailed as exc:
        for error in exc.errors:
            assert_type(error.kind, ErrorKind)
    except RequestFailed as exc:
        assert_type(exc.report, Report | None)
    except StreamInterrupted as exc:
        assert_type(exc.text, str)
        assert_type(exc.error, AttemptError)
    except HedgeError as exc:
        assert_type(exc.report, Report | None)
    except (httpx.HTTPError, trio.TooSlowError):
        pass
    return None


# -- asyncio, through trio-asyncio -----------------------------------------------------------


async def from_asyncio(replicas: list[Replica]) -> None:
    async with aio_hedged_stream({"model": "m", "messages": []}, replicas) as stream:
        assert_type(stream, AioHedgedStream)
        async for token in stream:
            assert_type(token, str)
        async for delta in stream.events():
            assert_type(delta, Delta)
    async with AioHedger(replicas, HedgerConfig()) as hedger:
        async with hedger.stream({"model": "m", "messages": []}) as s:
            assert_type(s.report, Report)


# -- a Hedger over your own openai.AsyncOpenAI clients -----------------------------------------


async def with_sdk_clients() -> None:
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletionChunk

    from trio_hedge.sources.openai_sdk import SDKReplica, sdk_chunks, sdk_replicas

    primary = AsyncOpenAI(base_url="https://primary.example.com/v1", api_key="...")
    backup = AsyncOpenAI(base_url="https://backup.example.com/v1", api_key="...")
    replicas = sdk_replicas(
        {"primary": primary, "backup": backup}, overrides={"backup": {"model": "gpt-4o-mini"}}
    )
    assert_type(replicas, list[SDKReplica])
    one = SDKReplica(primary, name="primary", overrides={"temperature": 0.2})
    assert_type(one.name, str)
    async with Hedger(replicas, HedgerConfig(hedge_after=LearnedDelay())) as hedger:
        request = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hello!"}]}
        async with hedger.stream(request) as stream:
            async for token in stream:
                assert_type(token, str)
        async with hedger.stream(request, headers={"X-Tenant": "t1"}) as stream:
            async for chunk in sdk_chunks(stream):
                assert_type(chunk, ChatCompletionChunk)
        assert_type(stream.report.winner_replica, str | None)
    # Mixed with HTTP replicas: the request is a body whose fields are create() arguments.
    mixed = Hedger([one, Replica("https://other.example.com/v1", name="other")])
    async with hedged_stream(request, [one], HedgePolicy(hedge_after=1.0)) as stream:
        assert_type(stream, HedgedStream)
    await mixed.aclose()


# -- the agent APIs: Anthropic Messages and OpenAI Responses -----------------------------------


async def with_agent_apis() -> None:
    from trio_hedge.events import Delta
    from trio_hedge.sources.anthropic import AnthropicReplica, AnthropicSource, MessagesDecoder
    from trio_hedge.sources.openai_responses import (
        ResponsesDecoder,
        ResponsesReplica,
        ResponsesSource,
    )

    claude = [
        AnthropicReplica("https://api.anthropic.com/v1", api_key="sk-ant", name="anthropic"),
        AnthropicReplica("http://vllm:8000/v1", name="vllm", anthropic_version="2023-06-01"),
    ]
    body = {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": []}
    async with Hedger(claude, HedgerConfig(hedge_after=0.5)) as hedger:
        async with hedger.stream(body) as stream:
            async for delta in stream.events():
                assert_type(delta, Delta)
    responses = [ResponsesReplica("https://api.openai.com/v1", api_key="sk", name="openai")]
    async with hedged_stream({"model": "m", "input": "hi"}, responses) as stream:
        assert_type(stream, HedgedStream)
    assert_type(claude[0].api, str)
    assert_type(AnthropicSource, type[AnthropicSource])
    assert_type(MessagesDecoder().feed(b""), list[Delta])
    assert_type(ResponsesDecoder().response_id, str | None)
    assert_type(ResponsesSource, type[ResponsesSource])


async def many_tenants(hedger: Hedger, request: dict[str, Any]) -> float | None:
    """Priority classes, a wait reported, and a key ledger as the gateway keeps one."""
    from trio_hedge.state import KeyLedger, Lease, LocalKeyLedger, Quota, Refusal

    async with hedger.stream(request, priority=5, queued=0.25) as stream:
        async for _ in stream:
            pass
    wait = stream.report.queue_wait
    assert_type(wait, float | None)
    ledger: KeyLedger = LocalKeyLedger()
    lease = await ledger.reserve("team-a", Quota(max_concurrent=2, tokens_per_minute=1000), 300)
    if isinstance(lease, Refusal):
        assert_type(lease.retry_after, float)
        return None
    assert_type(lease, Lease)
    await ledger.settle(lease, 120)
    return wait


# -- shared state: the Redis back ends and the gateway's [state] ----------------------------


async def with_shared_state(nursery: trio.Nursery) -> None:
    from trio_hedge.gateway import GatewayConfig, StateConfig
    from trio_hedge.state import (
        Ejection,
        Lease,
        LocalFleetStore,
        Quota,
        RedisFleetStore,
        RedisKeyLedger,
        Refusal,
        StateChange,
        StoreStatus,
    )

    def apply(change: StateChange) -> None: ...

    store = RedisFleetStore("redis://10.0.0.5:6379/0", prefix="team-a", timeout=0.25)
    await nursery.start(store.run, apply)
    store.publish(Ejection("default", "a", None, 10.0, "server_error"))
    assert_type(store.status, StoreStatus)
    await nursery.start(LocalFleetStore().run, apply)
    ledger = RedisKeyLedger("redis://10.0.0.5:6379/0", fail_closed=True)
    await nursery.start(ledger.run)
    answer = await ledger.reserve("team-a", Quota(max_concurrent=10, tokens_per_minute=10_000), 500)
    assert_type(answer, Lease | Refusal)
    if isinstance(answer, Lease):
        await ledger.settle(answer, 320)
    state = StateConfig(redis_url="redis://10.0.0.5:6379/0", fail_closed=False)
    config = GatewayConfig([Replica("http://10.0.0.1:8000/v1")], workers=2, state=state)
    assert_type(config.workers, int)
    assert_type(config.state.redis_url, str | None)
