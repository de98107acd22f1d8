"""OpenTelemetry spans and GenAI client metrics from [`HedgeEvent`][trio_hedge.events.HedgeEvent]s.

Names follow the GenAI semantic conventions of the installed
``opentelemetry-semantic-conventions`` (read from it, not copied, so they follow its version;
in 0.66b2 they are marked as moving to the GenAI conventions repository, with unchanged
names): a ``chat {model}`` CLIENT span per request with ``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.response.model``, ``gen_ai.usage.input_tokens`` /
``output_tokens``, ``server.address`` / ``server.port`` and ``error.type``; the metrics
``gen_ai.client.operation.duration``, ``gen_ai.client.token.usage`` and
``gen_ai.client.operation.time_to_first_chunk``. Hedging adds ``trio_hedge.*`` attributes and
a child span per attempt (see ``docs/instrumentation.md``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio

from ..events import EventKind, HedgeEvent
from ..report import AttemptRecord, Report

__all__ = ["OpenTelemetryHook"]

_INSTRUMENTATION = "trio_hedge"
# Bucket boundaries the GenAI conventions advise for these histograms.
_DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48]
_DURATION_BUCKETS += [40.96, 81.92]
_TTFC_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5]
_TTFC_BUCKETS += [5.0, 7.5, 10.0]
_TOKEN_BUCKETS = [float(4**i) for i in range(14)]  # 1, 4, 16, … 67,108,864


def _semconv() -> Any:
    """The installed conventions' names (imported lazily: the ``otel`` extra is optional)."""
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
    from opentelemetry.semconv._incubating.metrics import gen_ai_metrics
    from opentelemetry.semconv.attributes import error_attributes, server_attributes

    return gen_ai, gen_ai_metrics, error_attributes, server_attributes


@attrs.define
class _Started:
    span: Any
    started_at: float | None  # seconds from the request's start


@attrs.define
class _Request:
    span: Any
    wall: int  # time.time_ns() at ``trio_time``: maps Trio's clock onto span timestamps
    trio_time: float
    origin: float  # Trio time the request started
    attempts: dict[int, _Started] = attrs.Factory(dict)
    server: dict[int, tuple[str, int | None] | None] = attrs.Factory(dict)
    first_hedge_delay: float | None = None
    response_model: str | None = None
    usage: Mapping[str, Any] | None = None

    def ns(self, trio_time: float) -> int:
        return self.wall + round((trio_time - self.trio_time) * 1e9)


class _AttemptSpan:
    """What the hook returns for ``attempt_started``: the attempt's span, ended when the
    attempt ends (``trio_hedge._hooks.emit`` exits it then, with the attempt's error)."""

    __slots__ = ("_request", "_span")

    def __init__(self, request: _Request, span: Any) -> None:
        self._request, self._span = request, span

    def __enter__(self) -> Any:
        return self._span

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        span = self._span
        if exc is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, str(exc)))
        span.end(end_time=self._request.ns(trio.current_time()))


def _server(address: str) -> tuple[str, int | None] | None:
    """``(host, port)`` from a URL or a ``host:port`` replica name, else ``None``."""
    parts = urlsplit(address if "//" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or (port is None and "." not in parts.hostname):
        return None  # a bare name ("primary") is not a server address
    if port is None and parts.scheme in ("http", "https"):
        port = 443 if parts.scheme == "https" else 80
    return parts.hostname, port


class OpenTelemetryHook:
    """An ``on_event`` hook for [`Hedger`][trio_hedge.Hedger] (or
    [`AioHedger`][trio_hedge.aio.AioHedger]) that traces and measures hedged requests with
    OpenTelemetry (extra ``otel``).

    Spans: one ``chat {model}`` CLIENT span per request, and a child ``chat {model}`` span per
    attempt (the context manager this hook returns for ``attempt_started`` wraps the
    attempt). Span times follow Trio's clock (virtual under ``MockClock``). Spans are not made
    current (the race runs attempts in their own tasks), so spans of the HTTP client do not
    nest under them.

    Metrics: ``gen_ai.client.operation.duration`` (s, per request), ``gen_ai.client.token.usage``
    (``gen_ai.token.type`` input/output) and ``gen_ai.client.operation.time_to_first_chunk``
    (s, the caller-visible TTFT).

    Usage tokens and the response model come from the server: pass them with
    [`observe_response`][trio_hedge.instrumentation.OpenTelemetryHook.observe_response] before the
    stream's ``async with`` exits (e.g. from the usage delta of ``stream.events()``). Without that,
    ``gen_ai.usage.output_tokens`` is the count of content chunks received and
    ``gen_ai.usage.input_tokens`` the request's ``prompt_tokens`` (given or estimated), and the span
    says so with ``trio_hedge.usage.estimated = true``.

    No attribute carries a credential: the hook reads only events (which hold none) and the
    ``replicas``' URLs (which may not carry credentials).

    Args:
        tracer_provider: default the global one.
        meter_provider: default the global one.
        replicas: the Hedger's replicas: their ``base_url``s give ``server.address`` and
            ``server.port`` per replica name (a ``host:port`` name gives them too).
        provider_name: ``gen_ai.provider.name`` (e.g. ``"openai"``), or ``None`` to leave it
            out.

    Raises:
        ImportError: ``opentelemetry-api`` or ``opentelemetry-semantic-conventions`` is
            missing (``pip install "trio-hedge[otel]"``, or from a clone
            ``pip install -e ".[otel]"``).
    """

    def __init__(
        self,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        *,
        replicas: Sequence[object] = (),
        provider_name: str | None = None,
    ) -> None:
        try:
            from opentelemetry import metrics, trace

            gen_ai, gen_ai_metrics, error_attrs, server_attrs = _semconv()
        except ImportError as exc:  # pragma: no cover - exercised without the package
            raise ImportError(
                'OpenTelemetryHook needs the otel extra: pip install "trio-hedge[otel]", '
                'or from a clone pip install -e ".[otel]"'
            ) from exc
        if provider_name is not None and (not isinstance(provider_name, str) or not provider_name):
            raise ValueError(f"provider_name must be a non-empty str or None: {provider_name!r}")
        self._g = gen_ai
        self._chat = gen_ai.GenAiOperationNameValues.CHAT.value
        self._error_type = error_attrs.ERROR_TYPE
        self._address = server_attrs.SERVER_ADDRESS
        self._port = server_attrs.SERVER_PORT
        self._provider = provider_name
        self._servers: dict[str, tuple[str, int | None]] = {}
        for replica in replicas:
            url = getattr(replica, "base_url", None)
            name = getattr(replica, "name", None)
            if isinstance(url, str) and isinstance(name, str) and (where := _server(url)):
                self._servers[name] = where
        self._tracer = trace.get_tracer(_INSTRUMENTATION, tracer_provider=tracer_provider)
        meter = metrics.get_meter(_INSTRUMENTATION, meter_provider=meter_provider)
        self._duration = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_OPERATION_DURATION,
            unit="s",
            description="GenAI operation duration (a hedged request, all attempts).",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self._tokens = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_TOKEN_USAGE,
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS,
        )
        self._ttfc = meter.create_histogram(
            gen_ai_metrics.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK,
            unit="s",
            description="Caller-visible time to the first token (first content chunk).",
            explicit_bucket_boundaries_advisory=_TTFC_BUCKETS,
        )
        # Open requests by HedgeEvent.request_key (the request itself: two requests may
        # carry the same id), and the latest one of each id, for observe_response.
        self._requests: dict[object, _Request] = {}
        self._by_id: dict[str | None, _Request] = {}

    def observe_response(
        self,
        request_id: str,
        *,
        usage: Mapping[str, Any] | None = None,
        response_model: str | None = None,
    ) -> None:
        """Record what the server reported for request ``request_id`` (``stream.request_id``):
        its ``usage`` object (``prompt_tokens``, ``completion_tokens``) and the model that
        answered. Call it before the stream's ``async with`` exits; unknown ids are ignored
        (two requests open with the same id: the later one)."""
        request = self._by_id.get(request_id)
        if request is None:
            return
        if usage is not None:
            request.usage = usage
        if response_model is not None:
            request.response_model = response_model

    # -- events ----------------------------------------------------------------------------------

    def __call__(self, event: HedgeEvent) -> _AttemptSpan | None:
        kind = event.kind
        if kind is EventKind.ATTEMPT_STARTED and event.record is not None:
            return self._attempt_started(event, event.record)
        request = self._requests.get(self._key(event))
        if request is None:
            return None
        record = event.record
        if record is not None and kind in (
            EventKind.COMMITTED,
            EventKind.ATTEMPT_FAILED,
            EventKind.ATTEMPT_CANCELLED,
        ):
            self._attempt_changed(request, record)
        elif kind is EventKind.REQUEST_FINISHED and event.report is not None:
            self._finished(request, event, event.report)
            del self._requests[self._key(event)]
            if self._by_id.get(event.request_id) is request:
                del self._by_id[event.request_id]
        elif kind in (
            EventKind.HEDGE_REFUSED,
            EventKind.FAILOVER_REFUSED,
            EventKind.REPLICA_COOLING,
            EventKind.REPLICA_EJECTED,
        ):
            fields = {"trio_hedge.reason": event.reason or ""}
            if event.replica is not None:
                fields["trio_hedge.replica"] = event.replica
            request.span.add_event(kind.value, fields, timestamp=request.ns(event.time))
        return None

    @staticmethod
    def _key(event: HedgeEvent) -> object:
        return event.request_id if event.request_key is None else event.request_key

    def _model(self, event: HedgeEvent) -> str:
        # The Hedger's group is the request's "model" unless the caller named another group.
        return event.group or "unknown"

    def _attempt_started(self, event: HedgeEvent, record: AttemptRecord) -> _AttemptSpan:
        from opentelemetry import trace

        g = self._g
        request = self._requests.get(self._key(event))
        model = self._model(event)
        name = f"{self._chat} {model}"
        if request is None:
            now = trio.current_time()
            origin = event.time - (record.started_at or 0.0)
            request = _Request(span=None, wall=time.time_ns(), trio_time=now, origin=origin)
            attributes: dict[str, Any] = {
                g.GEN_AI_OPERATION_NAME: self._chat,
                g.GEN_AI_REQUEST_MODEL: model,
                g.GEN_AI_REQUEST_STREAM: True,
            }
            if self._provider is not None:
                attributes[g.GEN_AI_PROVIDER_NAME] = self._provider
            if event.request_id is not None:
                attributes["trio_hedge.request_id"] = event.request_id
            request.span = self._tracer.start_span(
                name,
                kind=trace.SpanKind.CLIENT,
                attributes=attributes,
                start_time=request.ns(origin),
            )
            self._requests[self._key(event)] = request
            self._by_id[event.request_id] = request
        attributes = {
            g.GEN_AI_OPERATION_NAME: self._chat,
            g.GEN_AI_REQUEST_MODEL: model,
            "trio_hedge.attempt.number": record.number,
            "trio_hedge.attempt.trigger": record.trigger,
            "trio_hedge.replica": record.replica,
        }
        server = self._servers.get(record.replica) or _server(record.replica)
        request.server[record.number] = server
        if server is not None:
            attributes[self._address] = server[0]
            if server[1] is not None:
                attributes[self._port] = server[1]
        if record.trigger == "hedge" and record.number > 1:
            previous = request.attempts.get(record.number - 1)
            started = previous.started_at if previous is not None else None
            if started is not None and record.started_at is not None:
                delay = record.started_at - started
                attributes["trio_hedge.hedge_delay"] = delay
                if request.first_hedge_delay is None:
                    request.first_hedge_delay = delay
        start = request.origin + (record.started_at or 0.0)
        span = self._tracer.start_span(
            name,
            context=trace.set_span_in_context(request.span),
            kind=trace.SpanKind.CLIENT,
            attributes=attributes,
            start_time=request.ns(start),
        )
        request.attempts[record.number] = _Started(span, record.started_at)
        return _AttemptSpan(request, span)

    def _attempt_changed(self, request: _Request, record: AttemptRecord) -> None:
        started = request.attempts.get(record.number)
        if started is None:
            return
        span = started.span
        span.set_attribute("trio_hedge.attempt.outcome", record.outcome.value)
        if record.ttft is not None:
            span.set_attribute(self._g.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, record.ttft)
        if record.error is not None:
            span.set_attribute(self._error_type, record.error.kind.value)
            if record.error.status_code is not None:
                span.set_attribute("http.response.status_code", record.error.status_code)
        span.set_attribute("trio_hedge.attempt.tokens_received", record.tokens_received)

    def _finished(self, request: _Request, event: HedgeEvent, report: Report) -> None:
        g = self._g
        for record in report.attempts:
            self._attempt_changed(request, record)
        span = request.span
        model = self._model(event)
        fields: dict[str, Any] = {
            "trio_hedge.hedged": report.hedged,
            "trio_hedge.attempts": report.attempts_sent,
            "trio_hedge.hedges_refused": report.hedges_refused,
            "trio_hedge.wasted_tokens": report.wasted_tokens,
        }
        if report.winner is not None:
            fields["trio_hedge.winner.attempt"] = report.winner
            fields["trio_hedge.winner.replica"] = report.winner_replica or ""
            server = request.server.get(report.winner)
            if server is not None:
                fields[self._address] = server[0]
                if server[1] is not None:
                    fields[self._port] = server[1]
        if request.first_hedge_delay is not None:
            fields["trio_hedge.hedge_delay"] = request.first_hedge_delay
        if report.ttft is not None:
            fields[g.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = report.ttft
        if request.response_model is not None:
            fields[g.GEN_AI_RESPONSE_MODEL] = request.response_model
        input_tokens, output_tokens, estimated = self._usage(request, report)
        if input_tokens is not None:
            fields[g.GEN_AI_USAGE_INPUT_TOKENS] = input_tokens
        if output_tokens is not None:
            fields[g.GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens
        fields["trio_hedge.usage.estimated"] = estimated
        error = report.error
        error_type = None
        if error is not None:
            error_type = getattr(getattr(error, "error", None), "kind", None)
            error_type = error_type.value if error_type is not None else type(error).__name__
            fields[self._error_type] = error_type
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.set_attributes(fields)
        span.end(end_time=request.ns(event.time))

        metric: dict[str, Any] = {
            g.GEN_AI_OPERATION_NAME: self._chat,
            g.GEN_AI_REQUEST_MODEL: model,
        }
        if self._provider is not None:
            metric[g.GEN_AI_PROVIDER_NAME] = self._provider
        if request.response_model is not None:
            metric[g.GEN_AI_RESPONSE_MODEL] = request.response_model
        if self._address in fields:
            metric[self._address] = fields[self._address]
            if self._port in fields:
                metric[self._port] = fields[self._port]
        if error_type is not None:
            metric[self._error_type] = error_type
        if report.total is not None:
            self._duration.record(report.total, {**metric, "trio_hedge.hedged": report.hedged})
        if report.ttft is not None:
            self._ttfc.record(report.ttft, {**metric, "trio_hedge.hedged": report.hedged})
        token_type = g.GEN_AI_TOKEN_TYPE
        if input_tokens is not None:
            self._tokens.record(input_tokens, {**metric, token_type: "input"})
        if output_tokens is not None:
            self._tokens.record(output_tokens, {**metric, token_type: "output"})

    @staticmethod
    def _usage(request: _Request, report: Report) -> tuple[int | None, int | None, bool]:
        usage = request.usage
        if usage is not None:
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            return (
                prompt if isinstance(prompt, int) else None,
                completion if isinstance(completion, int) else None,
                False,
            )
        return report.prompt_tokens, report.token_count, True
