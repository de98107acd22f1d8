"""OpenTelemetryHook: spans per request and attempt, GenAI metrics, with the SDK's in-memory
exporters; names checked against the installed semantic conventions."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio.testing

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics
from opentelemetry.semconv.attributes import error_attributes, server_attributes
from opentelemetry.trace import SpanKind, StatusCode

import trio_hedge as th
from trio_hedge.instrumentation import OpenTelemetryHook
from trio_hedge.testing import Behaviour, fake_replicas

from .fleet import Fail, Fleet, run
from .scripted import Script

CONFIG = th.HedgerConfig(hedge_after=1.0, budget=None, throttle=None, outlier_detection=None)
NAMES = ["a.internal:8000", "b.internal:8001"]
SEMCONV = {
    value
    for module in (gen_ai_attributes, server_attributes, error_attributes)
    for key, value in vars(module).items()
    if key.isupper() and isinstance(value, str)
}


class Telemetry:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.tracer_provider = tracer_provider
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def hook(self, **kwargs: Any) -> OpenTelemetryHook:
        return OpenTelemetryHook(self.tracer_provider, self.meter_provider, **kwargs)

    def finished(self) -> list[ReadableSpan]:
        # By start, the request before its first attempt (they start together).
        spans = self.spans.get_finished_spans()
        return sorted(spans, key=lambda s: (s.start_time or 0, s.parent is not None))

    def metrics(self) -> dict[str, list[Any]]:
        data = self.reader.get_metrics_data()
        found: dict[str, list[Any]] = {}
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    found[metric.name] = list(metric.data.data_points)
        return found


def _fleet() -> Fleet:
    # r0: the primary is slow and the backup wins at 1.5 s; r1: the primary is overloaded at
    # 0.1 s and the backup answers after a failover.
    def behave(replica: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if info.request_id == "r1" and info.number == 1:
            return Fail(at=0.1, kind=th.errors.ErrorKind.OVERLOADED)
        return Script(ttft=5.0 if info.number == 1 else 0.5, tokens=3, gap=0.1)

    return Fleet(NAMES, behave)


def _seconds(ns: int | None) -> float:
    assert ns is not None
    return ns / 1e9


async def test_two_requests_with_one_id_get_their_own_spans(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A client sends the same X-Request-ID twice at once: the quick request (0.3 s) and the
    # slow one (2.1 s) each get their own request span, ended at their own end. On bcbad18
    # the two shared one span, ended when the quick one finished.
    telemetry = Telemetry()
    hook = telemetry.hook()
    scripts = iter([Script(ttft=2.0, tokens=2), Script(ttft=0.2, tokens=2)])
    fleet = Fleet(NAMES[:1], lambda _r, _info: next(scripts))
    config = th.HedgerConfig(hedge_after=None, budget=None)
    hedger = th.Hedger(fleet.sources(), config, on_event=[hook])
    async with trio.open_nursery() as nursery:
        for model in ("slow", "quick"):
            body = {"model": model, "messages": []}
            nursery.start_soon(run, hedger.stream(body, request_id="same"))
            await trio.lowlevel.checkpoint()
    requests = [s for s in telemetry.finished() if s.parent is None]
    took = sorted(
        (s.name, round(_seconds(s.end_time) - _seconds(s.start_time), 6)) for s in requests
    )
    assert took == [("chat quick", 0.3), ("chat slow", 2.1)]
    assert hook._requests == {} and hook._by_id == {}


async def test_a_span_per_request_and_per_attempt(autojump_clock: trio.testing.MockClock) -> None:
    telemetry = Telemetry()
    hook = telemetry.hook(provider_name="openai")
    hedger = th.Hedger(_fleet().sources(), CONFIG, on_event=[hook])
    report = await run(hedger.stream({"model": "m1", "messages": []}, request_id="r0"))
    request, first, second = telemetry.finished()

    assert request.name == first.name == second.name == "chat m1"
    assert request.kind is SpanKind.CLIENT and request.parent is None
    assert first.parent is not None and first.parent.span_id == request.context.span_id
    assert second.parent is not None and second.parent.span_id == request.context.span_id
    # Times follow Trio's (virtual) clock: the request took 1.7 s, the backup started at the
    # hedge delay, the loser was cancelled at the commit.
    assert _seconds(request.end_time) - _seconds(request.start_time) == pytest.approx(1.7)
    assert _seconds(second.start_time) - _seconds(request.start_time) == pytest.approx(1.0)
    assert _seconds(first.end_time) - _seconds(request.start_time) == pytest.approx(1.5)

    attributes = dict(request.attributes or {})
    assert attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "m1",
        "gen_ai.request.stream": True,
        "gen_ai.provider.name": "openai",
        "trio_hedge.request_id": "r0",
        "server.address": "b.internal",
        "server.port": 8001,
        "gen_ai.response.time_to_first_chunk": pytest.approx(1.5),
        "gen_ai.usage.input_tokens": report.prompt_tokens,
        "gen_ai.usage.output_tokens": 3,
        "trio_hedge.usage.estimated": True,
        "trio_hedge.hedged": True,
        "trio_hedge.attempts": 2,
        "trio_hedge.hedges_refused": 0,
        "trio_hedge.wasted_tokens": 0,
        "trio_hedge.winner.attempt": 2,
        "trio_hedge.winner.replica": "b.internal:8001",
        "trio_hedge.hedge_delay": pytest.approx(1.0),
    }
    assert dict(first.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "m1",
        "trio_hedge.attempt.number": 1,
        "trio_hedge.attempt.trigger": "primary",
        "trio_hedge.replica": "a.internal:8000",
        "server.address": "a.internal",
        "server.port": 8000,
        "trio_hedge.attempt.outcome": "cancelled",
        "trio_hedge.attempt.tokens_received": 0,
    }
    second_attributes = dict(second.attributes or {})
    assert second_attributes["trio_hedge.attempt.trigger"] == "hedge"
    assert second_attributes["trio_hedge.attempt.outcome"] == "won"
    assert second_attributes["trio_hedge.hedge_delay"] == pytest.approx(1.0)
    assert second_attributes["gen_ai.response.time_to_first_chunk"] == pytest.approx(0.5)
    # Every standard-looking name is one the installed conventions define.
    for span in (request, first, second):
        for key in span.attributes or {}:
            assert key.startswith("trio_hedge.") or key in SEMCONV, key
    assert all(span.status.status_code is StatusCode.UNSET for span in (request, first, second))


async def test_failed_attempts_and_requests_carry_error_type(
    autojump_clock: trio.testing.MockClock,
) -> None:
    telemetry = Telemetry()
    hedger = th.Hedger(_fleet().sources(), CONFIG, on_event=[telemetry.hook()])
    await run(hedger.stream({"model": "m1", "messages": []}, request_id="r1"))
    request, failed, backup = telemetry.finished()
    failed_attributes = dict(failed.attributes or {})
    assert failed_attributes[error_attributes.ERROR_TYPE] == "overloaded"
    assert failed_attributes["trio_hedge.attempt.outcome"] == "failed"
    assert failed.status.status_code is StatusCode.ERROR
    assert dict(backup.attributes or {})["trio_hedge.attempt.trigger"] == "failover"
    assert error_attributes.ERROR_TYPE not in (request.attributes or {})

    # A request that fails as a whole: error.type on the request span and the metrics.
    fleet = Fleet(["a"], lambda r, i: Fail(at=0.2, kind=th.errors.ErrorKind.RATE_LIMIT))
    telemetry = Telemetry()
    hedger = th.Hedger(fleet.sources(), CONFIG, on_event=[telemetry.hook()])
    await run(hedger.stream({"model": "m1", "messages": []}, request_id="r2"))
    request, _ = telemetry.finished()
    assert dict(request.attributes or {})[error_attributes.ERROR_TYPE] == "AllAttemptsFailed"
    assert request.status.status_code is StatusCode.ERROR
    (duration,) = telemetry.metrics()[gen_ai_metrics.GEN_AI_CLIENT_OPERATION_DURATION]
    assert duration.attributes[error_attributes.ERROR_TYPE] == "AllAttemptsFailed"


async def test_genai_metrics_and_reported_usage(autojump_clock: trio.testing.MockClock) -> None:
    telemetry = Telemetry()
    hook = telemetry.hook()
    hedger = th.Hedger(_fleet().sources(), CONFIG, on_event=[hook])
    stream = hedger.stream({"model": "m1", "messages": []}, request_id="r0")
    async with stream:
        async for _ in stream:
            pass
        hook.observe_response(
            stream.request_id,
            usage={"prompt_tokens": 11, "completion_tokens": 7},
            response_model="m1-2024",
        )
    await run(hedger.stream({"model": "m1", "messages": []}, request_id="r1"))

    (request, _, _, _, _, _) = telemetry.finished()
    attributes = dict(request.attributes or {})
    assert attributes["gen_ai.usage.input_tokens"] == 11
    assert attributes["gen_ai.usage.output_tokens"] == 7
    assert attributes["gen_ai.response.model"] == "m1-2024"
    assert attributes["trio_hedge.usage.estimated"] is False

    metrics = telemetry.metrics()
    durations = metrics[gen_ai_metrics.GEN_AI_CLIENT_OPERATION_DURATION]
    assert sorted(round(p.sum, 6) for p in durations) == [0.8, 1.7]
    ttfc = metrics[gen_ai_metrics.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK]
    assert sorted(round(p.sum, 6) for p in ttfc) == [0.6, 1.5]
    assert {p.attributes["trio_hedge.hedged"] for p in ttfc} == {True, False}
    usage = metrics[gen_ai_metrics.GEN_AI_CLIENT_TOKEN_USAGE]
    by_type = {
        (p.attributes["gen_ai.token.type"], p.attributes.get("gen_ai.response.model")): p.sum
        for p in usage
    }
    assert by_type[("input", "m1-2024")] == 11 and by_type[("output", "m1-2024")] == 7
    assert by_type[("output", None)] == 3
    assert all(p.attributes["gen_ai.operation.name"] == "chat" for p in usage)
    assert hook._requests == {}


async def test_no_key_in_any_attribute_over_http() -> None:
    key = "sk-otel-secret-0123456789"
    telemetry = Telemetry()
    echo = Behaviour(status=401, error_message=f"Incorrect API key provided: {key}")
    async with fake_replicas(echo, Behaviour(tokens=2)) as (bad, good):
        replicas = [th.Replica(r.url, api_key=key) for r in (bad, good)]
        hook = telemetry.hook(replicas=replicas)
        async with httpx.AsyncClient() as client:
            hedger = th.Hedger(replicas, CONFIG, client=client, on_event=[hook])
            await run(hedger.stream({"model": "m", "messages": [{"role": "user", "content": key}]}))
    spans = telemetry.finished()
    assert len(spans) == 3
    everything = [
        *(str(v) for s in spans for v in (s.attributes or {}).values()),
        *(str(s.status.description) for s in spans),
        *(str(e.attributes) for s in spans for e in s.events),
        *(str(p.attributes) for points in telemetry.metrics().values() for p in points),
    ]
    assert not [text for text in everything if key in text or key[:12] in text]
    addresses = {dict(s.attributes or {}).get("server.address") for s in spans}
    assert addresses == {"127.0.0.1"}


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="provider_name"):
        OpenTelemetryHook(provider_name="")


async def test_the_request_span_nests_under_the_callers_span(
    autojump_clock: trio.testing.MockClock,
) -> None:
    telemetry = Telemetry()
    hedger = th.Hedger(_fleet().sources(), CONFIG, on_event=[telemetry.hook()])
    tracer = telemetry.tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("handle request") as app:
        await run(hedger.stream({"model": "m1", "messages": []}, request_id="r0"))
    request = next(
        s
        for s in telemetry.finished()
        if s.name == "chat m1"
        and s.parent is not None
        and s.parent.span_id == app.get_span_context().span_id
    )
    assert dict(request.attributes or {})["trio_hedge.request_id"] == "r0"
