"""Against llmock, a third-party OpenAI-compatible mock server (not ours: a fair check that we
speak the protocol as real servers do). Skips when it is not installed in ~/.venvs/llmock."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

import trio_hedge as th

LLMOCK = Path(os.environ.get("LLMOCK", Path.home() / ".venvs" / "llmock" / "bin" / "llmock"))

pytestmark = pytest.mark.skipif(
    not LLMOCK.exists(),
    reason=f"llmock is not installed at {LLMOCK} (python3 -m venv ~/.venvs/llmock && "
    "~/.venvs/llmock/bin/pip install llmock==0.2.2)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_llmock() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            *(str(LLMOCK), "serve", "--host", "127.0.0.1", "--port", str(port)),
            *("--log-level", "warning", "--stream-chunk-delay-ms", "20"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30  # readiness, bounded: not a sleep "to wait enough"
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("llmock did not become healthy within 30 s")


@pytest.fixture(scope="module")
def llmocks() -> Iterator[tuple[str, str]]:
    started = [_start_llmock(), _start_llmock()]
    try:
        yield started[0][1], started[1][1]
    finally:
        for proc, _ in started:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture
def fresh(llmocks: tuple[str, str]) -> tuple[str, str]:
    for base in llmocks:
        httpx.post(f"{base}/_llmock/reset", timeout=5).raise_for_status()
    return llmocks


REQUEST = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hi"}]}


async def _abandoned(base: str, within: float) -> list[dict[str, object]]:
    """llmock journals a request when it ends; poll (bounded) for the primary's record."""
    async with httpx.AsyncClient() as client:
        with trio.move_on_after(within):
            while True:
                records = (await client.get(f"{base}/_llmock/requests")).json()["requests"]
                if records:
                    return list(records)
                await trio.sleep(0.05)
    return []


async def test_slow_first_token_primary_is_hedged_and_abandoned(fresh: tuple[str, str]) -> None:
    primary, backup = fresh
    scenario = {"behaviors": [{"type": "slow_first_token", "seconds": 3, "times": None}]}
    async with httpx.AsyncClient() as client:
        (await client.post(f"{primary}/_llmock/scenario", json=scenario)).raise_for_status()
        replicas = [th.Replica(primary + "/v1", name="primary"), th.Replica(backup + "/v1")]
        stream = th.hedged_stream(REQUEST, replicas, th.HedgePolicy(hedge_after=0.3), client=client)
        async with stream:
            text = "".join([t async for t in stream])
    report = stream.report
    assert text.strip()
    assert report.winner == 2
    assert report.hedged
    assert report.ttft is not None and report.ttft < 3
    assert report.attempts[0].outcome is th.report.AttemptOutcome.CANCELLED
    records = await _abandoned(primary, within=10)
    assert len(records) == 1
    assert records[0]["completed"] is False  # llmock saw the client abandon it
    assert records[0]["chunks_sent"] == 0  # it never got to generate for the loser


async def test_rate_limited_primary_fails_over_at_once(fresh: tuple[str, str]) -> None:
    primary, backup = fresh
    scenario = {"behaviors": [{"type": "fail", "status": 429, "retry_after": 2, "times": 1}]}
    async with httpx.AsyncClient() as client:
        (await client.post(f"{primary}/_llmock/scenario", json=scenario)).raise_for_status()
        replicas = [th.Replica(primary + "/v1", name="primary"), th.Replica(backup + "/v1")]
        stream = th.hedged_stream(REQUEST, replicas, th.HedgePolicy(hedge_after=5), client=client)
        async with stream:
            assert [t async for t in stream]
    first, second = stream.report.attempts
    assert first.error is not None
    assert first.error.kind is th.errors.ErrorKind.RATE_LIMIT
    assert first.error.retry_after == 2
    assert second.trigger == "failover"
    assert second.started_at is not None and second.started_at < 1.0  # not after hedge_after


def test_cli_stream_against_llmock(fresh: tuple[str, str]) -> None:
    primary, backup = fresh
    env = {**os.environ, "FAKE_KEY": "sk-secret-never-printed"}
    done = subprocess.run(
        [
            *(sys.executable, "-m", "trio_hedge", "stream", "--replica", primary + "/v1"),
            *("--replica", backup + "/v1", "--model", "gpt-4o-mini", "--hedge-after", "1"),
            *("--api-key-env", "FAKE_KEY", "--json", "Say hi"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["text"].strip()
    assert payload["winner"] == 1
    assert "sk-secret" not in done.stdout + done.stderr
