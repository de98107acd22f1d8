"""The deployment files in ``deploy/`` (docs/gateway.md, "Scale-out") are what the docs say:
the gateway's configuration loads as the project reads it, with workers and shared state;
the compose file's stop grace period outlasts the drain; the systemd unit sends SIGTERM to
the supervisor alone (``KillMode=mixed``: each worker would take a second SIGTERM of its own
as "cancel now")."""

from __future__ import annotations

import re
from pathlib import Path

from trio_hedge.gateway import load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_the_gateway_configuration_loads_with_workers_and_redis() -> None:
    config = load_config(DEPLOY / "gateway.toml", environ={"REDIS_URL": "redis://:pw@redis:6379/0"})
    assert config.workers == 2
    assert config.state.redis_url == "redis://:pw@redis:6379/0"
    assert "pw" not in repr(config)
    assert config.host == "0.0.0.0"


def test_compose_outlasts_the_drain_and_names_files_that_exist() -> None:
    compose = (DEPLOY / "compose.yaml").read_text()
    config = load_config(DEPLOY / "gateway.toml", environ={"REDIS_URL": "redis://redis/0"})
    grace = re.search(r"stop_grace_period: (\d+)s", compose)
    assert grace is not None and int(grace[1]) > config.limits.drain_timeout
    for name in re.findall(r"\./([\w.]+):", compose):
        assert (DEPLOY / name).exists(), name
    assert (DEPLOY / "Dockerfile").exists()
    assert "REDIS_URL: redis://redis:6379/0" in compose


def test_the_systemd_unit_signals_the_supervisor_alone() -> None:
    unit = (DEPLOY / "trio-hedge.service").read_text()
    settings = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")
    )
    assert settings["KillMode"] == "mixed"
    assert settings["KillSignal"] == "SIGTERM"
    assert int(settings["TimeoutStopSec"]) > 30  # the default drain_timeout
    assert "--workers" in settings["ExecStart"]
