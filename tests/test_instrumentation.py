"""Ready-made on_event hooks: logging and Prometheus."""

from __future__ import annotations

import logging

import pytest
import trio.testing

import trio_hedge as th
from trio_hedge.instrumentation import LoggingHook, PrometheusHook

from .fleet import Fail, Fleet, run
from .scripted import Script

CONFIG = th.HedgerConfig(
    hedge_after=1.0, budget=None, throttle=None, outlier_detection=None, pick="in_order"
)


def _fleet() -> Fleet:
    # request r0: the primary is slow and the backup wins; r1: the primary fails over.
    def behave(replica: str, info: th.sources.AttemptInfo) -> Script | Fail:
        if info.request_id == "r1" and info.number == 1:
            return Fail(at=0.1, kind=th.errors.ErrorKind.RATE_LIMIT, retry_after=0.5)
        return Script(ttft=5.0 if info.number == 1 else 0.5, tokens=2)

    return Fleet(["a", "b"], behave)


async def test_logging_hook(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_hedge")
    fleet = _fleet()
    hedger = th.Hedger(fleet.sources(), CONFIG, on_event=[LoggingHook()])
    for rid in ("r0", "r1"):
        await run(hedger.stream(None, request_id=rid))
    lines = [r.getMessage() for r in caplog.records]
    assert any("committed" in ln and "request_id=r0" in ln and "attempt=2" in ln for ln in lines)
    failed = [r for r in caplog.records if "attempt_failed" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.INFO]
    assert "error=rate_limit" in failed[0].getMessage()
    assert failed[0].trio_hedge["replica"] == "a"  # type: ignore[attr-defined]
    assert any("request_finished" in ln and "hedged=True" in ln for ln in lines)


async def test_prometheus_hook(autojump_clock: trio.testing.MockClock) -> None:
    prom = pytest.importorskip("prometheus_client")
    registry = prom.CollectorRegistry()
    fleet = _fleet()
    hedger = th.Hedger(fleet.sources(), CONFIG, on_event=[PrometheusHook(registry)])
    for rid in ("r0", "r1"):
        await run(hedger.stream(None, request_id=rid))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("trio_hedge_requests_total", hedged="true", outcome="ok") == 1
    assert value("trio_hedge_requests_total", hedged="false", outcome="ok") == 1
    assert value("trio_hedge_backups_won_total", replica="b") == 2
    assert value("trio_hedge_attempts_total", replica="a", trigger="primary", outcome="failed") == 1
    assert (
        value("trio_hedge_attempts_total", replica="a", trigger="primary", outcome="cancelled") == 1
    )
    assert value("trio_hedge_replica_events_total", replica="a", kind="replica_cooling") == 1
    assert value("trio_hedge_ttft_seconds_count") == 2
    assert value("trio_hedge_ttft_seconds_sum") == pytest.approx(1.5 + 0.6)
