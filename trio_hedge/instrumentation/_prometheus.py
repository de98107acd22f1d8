"""Prometheus metrics from [`HedgeEvent`][trio_hedge.events.HedgeEvent]s (needs
``prometheus-client``)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ..events import EventKind, HedgeEvent

__all__ = ["PrometheusHook"]

#: Collectors already registered, per registry and prefix: a second hook (a second Hedger in
#: the same process) shares them instead of registering the same names again, which
#: prometheus-client refuses (``Duplicated timeseries in CollectorRegistry``).
_SHARED: weakref.WeakKeyDictionary[Any, dict[str, _Collectors]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class _Collectors:
    def __init__(self, prom: Any, prefix: str, registry: Any) -> None:
        kw = {"registry": registry}
        self.requests = prom.Counter(
            f"{prefix}_requests", "Finished hedged requests.", ["hedged", "outcome"], **kw
        )
        self.attempts = prom.Counter(
            f"{prefix}_attempts",
            "Attempts by how they ended.",
            ["replica", "trigger", "outcome"],
            **kw,
        )
        self.backups_won = prom.Counter(
            f"{prefix}_backups_won", "Backups that won the race.", ["replica"], **kw
        )
        self.refused = prom.Counter(
            f"{prefix}_hedges_refused", "Backups not sent.", ["reason"], **kw
        )
        self.failovers_refused = prom.Counter(
            f"{prefix}_failovers_refused", "Failovers not sent.", ["reason"], **kw
        )
        self.replica_events = prom.Counter(
            f"{prefix}_replica_events",
            "Replica cooldowns and ejections.",
            ["replica", "kind"],
            **kw,
        )
        self.ttft = prom.Histogram(
            f"{prefix}_ttft_seconds",
            "Caller-visible time to first token (seconds).",
            buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
            **kw,
        )


def _collectors(prom: Any, registry: Any, prefix: str) -> _Collectors:
    with _LOCK:
        by_prefix = _SHARED.setdefault(registry, {})
        found = by_prefix.get(prefix)
        if found is None:
            found = by_prefix[prefix] = _Collectors(prom, prefix, registry)
        return found


class PrometheusHook:
    """An ``on_event`` hook that keeps Prometheus metrics, named after Finagle's backup
    request counters:

    - ``trio_hedge_requests_total{hedged,outcome}``: finished requests (``outcome`` is
      ``ok`` or the error type);
    - ``trio_hedge_attempts_total{replica,trigger,outcome}``: attempts by how they ended;
    - ``trio_hedge_backups_won_total{replica}``: backups that won (Finagle ``backups_won``);
    - ``trio_hedge_hedges_refused_total{reason}``: Finagle ``budget_exhausted``, by reason;
    - ``trio_hedge_failovers_refused_total{reason}``: failovers not sent (throttle, no
      usable replica);
    - ``trio_hedge_replica_events_total{replica,kind}``: cooldowns and ejections;
    - ``trio_hedge_ttft_seconds``: caller-visible time to first token (histogram).

    Several hooks in one process (one per [`Hedger`][trio_hedge.Hedger], say) with the same
    registry and prefix share one set of collectors, so their counts add up; give each its own
    ``registry`` (or ``prefix``) to keep them apart. Metric names and labels are listed in
    ``docs/instrumentation.md``.

    Args:
        registry: a ``prometheus_client.CollectorRegistry``; default the global one.
        prefix: metric name prefix. Default ``"trio_hedge"``.

    Raises:
        ImportError: ``prometheus-client`` is not installed.
    """

    def __init__(self, registry: Any = None, *, prefix: str = "trio_hedge") -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:  # pragma: no cover - exercised without the package
            raise ImportError(
                "PrometheusHook needs prometheus-client: pip install prometheus-client"
            ) from exc
        if registry is None:
            registry = prom.REGISTRY
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty str, not {prefix!r}")
        shared = _collectors(prom, registry, prefix)
        self._requests = shared.requests
        self._attempts = shared.attempts
        self._backups_won = shared.backups_won
        self._refused = shared.refused
        self._failovers_refused = shared.failovers_refused
        self._replica_events = shared.replica_events
        self._ttft = shared.ttft

    def __call__(self, event: HedgeEvent) -> None:
        kind = event.kind
        record = event.record
        if record is not None and kind in (
            EventKind.COMMITTED,
            EventKind.ATTEMPT_FAILED,
            EventKind.ATTEMPT_CANCELLED,
        ):
            self._attempts.labels(record.replica, record.trigger, record.outcome.value).inc()
            if kind is EventKind.COMMITTED and record.number > 1:
                self._backups_won.labels(record.replica).inc()
        elif kind is EventKind.HEDGE_REFUSED:
            self._refused.labels(event.reason or "unknown").inc()
        elif kind is EventKind.FAILOVER_REFUSED:
            self._failovers_refused.labels(event.reason or "unknown").inc()
        elif kind in (EventKind.REPLICA_COOLING, EventKind.REPLICA_EJECTED):
            self._replica_events.labels(event.replica or "", kind.value).inc()
        elif kind is EventKind.REQUEST_FINISHED and event.report is not None:
            report = event.report
            outcome = "ok" if report.error is None else type(report.error).__name__
            self._requests.labels(str(report.hedged).lower(), outcome).inc()
            if report.ttft is not None:
                self._ttft.observe(report.ttft)
