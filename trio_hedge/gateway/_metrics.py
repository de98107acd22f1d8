"""Prometheus metrics (``GET /metrics``) and the JSON access log, one line per request.

Metrics live in the gateway's own registry (two gateways in one process, as in tests, do not
collide): the library's [`PrometheusHook`][trio_hedge.instrumentation.PrometheusHook] counters
(requests, attempts, backups won, hedges refused, replica events, TTFT histogram), the
gateway's requests by path and status, requests in flight and waiting in the admission
queue, the time they waited, relayed tokens, each key's tokens, refusals by reason, the TTFT
per API, group and model, and, read from every Hedger's ``statistics()`` at scrape time (each
group's, on each route: chat completions, Messages, Responses), every replica's state, the
learned hedge delays and the hedge budget's use, and each probed replica's engine reading:
what this instance has learned on its own; and whether the shared state (``[state]``, Redis)
is reachable. ``deploy/grafana/`` has a dashboard of them and ``deploy/prometheus/`` the
alert rules.

With ``--workers N`` (a ``worker`` index given), the counters, the histogram and the in-flight
gauges are aggregated over the workers the way prometheus-client's multiprocess mode does
(each process writes its values to a file in ``PROMETHEUS_MULTIPROC_DIR``, which the
supervisor makes; a scrape sums them): whichever worker answers ``/metrics``, the totals are
the gateway's. What is read live from a process's own Hedgers (replica states, learned
delays, probe readings, Trio tasks, the shared state's status) cannot be summed: it carries a
``worker`` label, and is the answering worker's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import attrs
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from .. import Hedger, Report
from ..instrumentation import PrometheusHook
from ..policy import ReplicaStatistics
from ..state import StoreStatus

__all__ = [
    "ACCESS_LOGGER",
    "MAX_MODEL_LABELS",
    "OTHER_MODELS",
    "AccessRecord",
    "GatewayMetrics",
    "ModelLabels",
]

#: The logger of the access log: one JSON object per line, per request.
ACCESS_LOGGER = logging.getLogger("trio_hedge.gateway.access")

_STATES = ("healthy", "degraded", "ejected")


def _count_tasks() -> int:
    """Trio tasks alive in this run (a leak shows as a count that keeps growing)."""

    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    root = trio.lowlevel.current_root_task()
    return 0 if root is None else walk(root)


#: The queue-wait histogram's buckets (seconds).
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: The ``model`` label of every model outside `ModelLabels`.
OTHER_MODELS = "(other)"
#: The most model names `ModelLabels` learns from answered requests.
MAX_MODEL_LABELS = 100


class ModelLabels:
    """The model names metrics may carry as a label, so that clients cannot grow
    ``/metrics`` by naming models: the names the groups give literally (not patterns), and
    the first `MAX_MODEL_LABELS` others a replica answered (a first token: no replica
    answers for a made-up model). Every other model is `OTHER_MODELS`."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = {"default", *names}  # "default": the delay group of no model
        self._learned = 0

    def served(self, model: str | None) -> None:
        """A replica answered a request for ``model``."""
        if model is not None and model not in self._names and self._learned < MAX_MODEL_LABELS:
            self._names.add(model)
            self._learned += 1

    def label(self, model: str) -> str:
        return model if model in self._names else OTHER_MODELS


#: The states a load probe's reading can be in (``ReplicaStatistics.probe``, not ``off``).
PROBE_STATES = ("fresh", "stale", "failing", "waiting")


class _HedgerCollector(Collector):
    """Every Hedger's state (per API and group), read when Prometheus scrapes (inside Trio);
    and each probed replica's engine reading, once per replica (every Hedger reads the
    gateway's one poller of it)."""

    def __init__(self, hedgers: Mapping[str, Mapping[str, Hedger]], models: ModelLabels) -> None:
        self._hedgers = hedgers
        self._models = models

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "trio_hedge_gateway_replica_state",
            "1 for the replica's current state (healthy, degraded: out for some models only, "
            "ejected), per API and group.",
            labels=["api", "group", "replica", "state"],
        )
        in_flight = GaugeMetricFamily(
            "trio_hedge_gateway_replica_in_flight",
            "Attempts in flight per replica, per API and group.",
            labels=["api", "group", "replica"],
        )
        delay = GaugeMetricFamily(
            "trio_hedge_gateway_hedge_delay_seconds",
            "The hedge delay a request gets now, per API, group, model and prompt-size class.",
            labels=["api", "group", "model", "size_class", "learned"],
        )
        budget = GaugeMetricFamily(
            "trio_hedge_gateway_hedge_budget_used",
            "Backups sent over what the hedge budget allows in its window now (1: exhausted), "
            "per API and group.",
            labels=["api", "group"],
        )
        tasks = GaugeMetricFamily("trio_hedge_gateway_trio_tasks", "Trio tasks alive.")
        try:
            trio.lowlevel.current_task()
        except RuntimeError:  # not inside Trio (a stray scrape from another thread)
            return
        probed: dict[str, ReplicaStatistics] = {}
        for api, groups in self._hedgers.items():
            for group, hedger in groups.items():
                stats = hedger.statistics()
                for r in stats.replicas:
                    for name in _STATES:
                        value = 1.0 if r.state == name else 0.0
                        state.add_metric([api, group, r.name, name], value)
                    in_flight.add_metric([api, group, r.name], r.in_flight)
                    if r.probe != "off":
                        probed.setdefault(r.name, r)
                # Models outside the label set are folded into one series per size class (the
                # longest of their delays).
                delays: dict[tuple[str, str, str], float] = {}
                for d in stats.delays:
                    key = (self._models.label(d.group), str(d.size_class), str(d.learned).lower())
                    delays[key] = max(d.delay, delays.get(key, d.delay))
                for (model, size_class, learned), seconds in delays.items():
                    delay.add_metric([api, group, model, size_class, learned], seconds)
                config = hedger.config.budget
                if config is not None and stats.budget_window is not None:
                    requests, backups = stats.budget_window
                    allowed = config.ratio * requests + config.min_per_second * config.window
                    budget.add_metric([api, group], backups / allowed if allowed > 0 else 1.0)
        tasks.add_metric([], _count_tasks())
        yield from (state, in_flight, delay, budget, tasks)
        yield from _probe_metrics(probed)


def _probe_metrics(probed: Mapping[str, ReplicaStatistics]) -> Iterator[Metric]:
    """Each probed replica's engine reading (labels: the configured replica names only)."""
    status = GaugeMetricFamily(
        "trio_hedge_gateway_probe_status",
        "1 for the load probe's state: fresh (its reading is used), stale, failing, waiting.",
        labels=["replica", "status"],
    )
    age = GaugeMetricFamily(
        "trio_hedge_gateway_probe_age_seconds",
        "Seconds since the replica's engine was last read (absent before the first reading).",
        labels=["replica"],
    )
    counts = {
        field: GaugeMetricFamily(f"trio_hedge_gateway_probe_{field}", what, labels=["replica"])
        for field, what in (
            ("waiting", "Requests the engine holds but has not started, at the last reading."),
            ("running", "Requests the engine is processing, at the last reading."),
            ("queued_tokens", "Prompt tokens the engine has still to prefill (when it says)."),
            ("kv_usage", "The engine's KV cache's used fraction (when it says)."),
        )
    }
    polls = CounterMetricFamily(
        "trio_hedge_gateway_probe_polls", "Polls of the replica's engine.", labels=["replica"]
    )
    failures = CounterMetricFamily(
        "trio_hedge_gateway_probe_failures",
        "Polls of the replica's engine that gave no reading.",
        labels=["replica"],
    )
    for name, r in probed.items():
        for value in PROBE_STATES:
            status.add_metric([name, value], 1.0 if r.probe == value else 0.0)
        if r.probe_age is not None:
            age.add_metric([name], r.probe_age)
        reading = r.probe_reading
        if reading is not None:
            for field, family in counts.items():
                value = getattr(reading, field)
                if value is not None:
                    family.add_metric([name], value)
        polls.add_metric([name], r.probe_polls)
        failures.add_metric([name], r.probe_failures)
    yield from (status, age, *counts.values(), polls, failures)


class _Shared(Protocol):
    @property
    def status(self) -> StoreStatus: ...


class _StateCollector(Collector):
    """Whether the shared state is reachable: read from each back end at scrape time."""

    def __init__(self, backends: Mapping[str, _Shared]) -> None:
        self._backends = backends

    def collect(self) -> Iterator[Metric]:
        degraded = GaugeMetricFamily(
            "trio_hedge_gateway_state_degraded",
            "1 while the shared state (Redis) is unreachable and this process runs on its own "
            "(fail open), per back end (fleet: ejections, cooldowns, delay samples); 0 while "
            "it is reachable or nothing is shared.",
            labels=["backend"],
        )
        status = GaugeMetricFamily(
            "trio_hedge_gateway_state_status",
            "1 for the shared state's status per back end: local (nothing shared), ok, degraded.",
            labels=["backend", "status"],
        )
        losses = CounterMetricFamily(
            "trio_hedge_gateway_state_losses",
            "Times the shared state (Redis) was found unreachable, per back end.",
            labels=["backend"],
        )
        for name, backend in self._backends.items():
            now = backend.status
            degraded.add_metric([name], 1.0 if now == "degraded" else 0.0)
            for value in ("local", "ok", "degraded"):
                status.add_metric([name, value], 1.0 if now == value else 0.0)
            losses.add_metric([name], getattr(backend, "losses", 0))
        yield from (degraded, status, losses)


class _Labelled(Collector):
    """Another collector's metrics with one more label (``worker``)."""

    def __init__(self, collector: Collector, name: str, value: str) -> None:
        self._collector = collector
        self._name = name
        self._value = value

    def collect(self) -> Iterator[Metric]:
        for metric in self._collector.collect():
            out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            out.samples = [
                Sample(s.name, {**s.labels, self._name: self._value}, s.value, s.timestamp)
                for s in metric.samples
            ]
            yield out


class GatewayMetrics:
    """The gateway's registry and metrics; `hook` goes on every Hedger's ``on_event``.

    ``worker``: this process's index among ``--workers`` (its counters are then aggregated
    over the workers through ``PROMETHEUS_MULTIPROC_DIR``; see the module docs)."""

    def __init__(self, worker: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.hook = PrometheusHook(self.registry)
        self.worker = worker
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR") if worker is not None else None
        self._multiprocess = folder
        #: What is read live from this process at each scrape (per worker, not summed).
        self._live: list[Collector] = []
        kw: dict[str, Any] = {"registry": self.registry}
        self.requests = Counter(
            "trio_hedge_gateway_requests",
            "HTTP requests answered, by path and status (499: the client left).",
            ["path", "status"],
            **kw,
        )
        self.in_flight = Gauge(
            "trio_hedge_gateway_in_flight",
            "Chat requests in flight (streams open).",
            multiprocess_mode="livesum",
            **kw,
        )
        self.tokens = Counter(
            "trio_hedge_gateway_tokens", "Content tokens relayed to clients.", **kw
        )
        self.generated = Counter(
            "trio_hedge_gateway_generated_tokens",
            "Content tokens each model generated for the gateway's answers, by model and "
            "replica (every attempt: winners, broken winners, recoveries, losers), as "
            "received: what the fleet spent, to bill or budget by model.",
            ["model", "replica"],
            **kw,
        )
        self.refused = Counter(
            "trio_hedge_gateway_refused",
            "Requests refused before any upstream attempt, by reason.",
            ["reason"],
            **kw,
        )
        self.key_requests = Counter(
            "trio_hedge_gateway_key_requests",
            "Requests answered per gateway key (its configured name), by status.",
            ["key", "status"],
            **kw,
        )
        self.key_in_flight = Gauge(
            "trio_hedge_gateway_key_in_flight",
            "Chat requests in flight per gateway key (its configured name).",
            ["key"],
            multiprocess_mode="livesum",
            **kw,
        )
        self.ttft = Histogram(
            "trio_hedge_gateway_ttft_seconds",
            "Client-visible time to first token (seconds), per API, group and model.",
            ["api", "group", "model"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
            **kw,
        )
        self.queued = Gauge(
            "trio_hedge_gateway_queued",
            "Chat requests waiting for a slot in the admission queue.",
            **kw,
        )
        self.queue_wait = Histogram(
            "trio_hedge_gateway_queue_wait_seconds",
            "Seconds admitted chat requests waited for their slot (0: at once), by class.",
            ["priority"],
            buckets=QUEUE_WAIT_BUCKETS,
            **kw,
        )
        self.key_tokens = Counter(
            "trio_hedge_gateway_key_tokens",
            "Tokens (prompt plus completion) charged per gateway key (its configured name): "
            "the usage answers reported, else the gateway's estimate and count.",
            ["key"],
            **kw,
        )
        self.models = ModelLabels(())

    def observe_ttft(self, api: str, group: str, model: str | None, seconds: float) -> None:
        """One answered request's TTFT (``model`` folded as `ModelLabels` says)."""
        self.ttft.labels(api, group, self.models.label(model or "default")).observe(seconds)

    def watch(
        self, hedgers: Mapping[str, Mapping[str, Hedger]], models: Iterable[str] = ()
    ) -> None:
        """Export the state of these Hedgers (API -> group name -> Hedger) at each scrape,
        with a ``model`` label for the names in ``models`` (and those learned:
        `ModelLabels`)."""
        self.models = ModelLabels(models)
        self._add_live(_HedgerCollector(hedgers, self.models))

    def watch_state(self, backends: Mapping[str, _Shared]) -> None:
        """Export the status of the shared-state back ends (name -> back end) at each
        scrape."""
        self._add_live(_StateCollector(backends))

    def _add_live(self, collector: Collector) -> None:
        if self.worker is not None:
            collector = _Labelled(collector, "worker", str(self.worker))
        if self._multiprocess:
            self._live.append(collector)
        else:
            self.registry.register(collector)

    def generated_by(self, report: Report) -> None:
        """Count what each attempt of ``report`` generated (``generated``: model labels as
        `ModelLabels` allows, replicas by their configured names)."""
        for attempt in report.attempts:
            if attempt.tokens_received:
                model = self.models.label(attempt.model or OTHER_MODELS)
                self.generated.labels(model, attempt.replica).inc(attempt.tokens_received)

    def render(self) -> bytes:
        """The Prometheus text exposition (call inside Trio)."""
        if not self._multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, self._multiprocess)  # type: ignore[no-untyped-call]
        for collector in self._live:
            registry.register(collector)
        return generate_latest(registry)


@attrs.define(slots=True)
class AccessRecord:
    """What one request's access-log line says. Never a header value or a key."""

    request_id: str
    method: str
    path: str
    client: str | None
    started: float  # time.time()
    status: int = 0
    key: str | None = None  # the gateway key's name
    model: str | None = None
    group: str | None = None
    stream: bool | None = None
    hedge: str | None = None  # "off", or the X-Hedge-After seconds in effect
    winner: str | None = None
    attempts: int | None = None
    hedged: bool | None = None
    ttft: float | None = None
    tokens: int | None = None
    wasted_tokens: int | None = None
    recoveries: int | None = None
    # Content tokens each model generated for the answer (every attempt, as received).
    generated: dict[str, int] | None = None
    error: str | None = None  # a kind or reason, never a message
    prompt_tokens: int | None = None  # the usage the answer reported
    completion_tokens: int | None = None
    priority: int | None = None  # its class in the admission queue
    queue_wait: float | None = None  # seconds it waited for its slot
    # The request's report (not logged: the metrics read it when the request ends).
    report: Report | None = attrs.field(default=None, repr=False)

    def line(self) -> str:
        """The JSON line (fields that are ``None`` left out)."""
        fields: dict[str, object] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        fields["started"] = round(self.started, 6)
        fields["duration"] = round(time.time() - self.started, 6)
        if self.ttft is not None:
            fields["ttft"] = round(self.ttft, 6)
        if self.queue_wait is not None:
            fields["queue_wait"] = round(self.queue_wait, 6)
        return json.dumps(fields)


_FIELDS = tuple(f.name for f in attrs.fields(AccessRecord) if f.name != "report")
