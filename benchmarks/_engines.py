"""The real engines the benchmarks run on (``../shared/engine2/``: llama.cpp's ``llama-server``
and vLLM on CPU): where they are built, starting and stopping two replicas, their counters,
and waiting until they are idle. Shared by ``real_engine.py``, ``agent_engines.py`` and
``recovery_engines.py``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs
import httpx
import trio
from rich.console import Console

from trio_hedge.testing import FakeReplica

ROOT = Path(__file__).resolve().parent.parent
ENGINE_DIR = Path(os.environ.get("ENGINE2_DIR", ROOT.parent / "shared" / "engine2"))
LLAMA_HOME = Path(os.environ.get("LS_HOME", Path.home() / ".cache" / "trio-hedge-llama-server"))
VLLM_HOME = Path(os.environ.get("VLLM_HOME", Path.home() / ".cache" / "trio-hedge-vllm-cpu"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_idle(client: httpx.AsyncClient, urls: Sequence[str], model: str) -> None:
    """Let every replica finish what it queued (cancelled prefills included): a one-token
    request waits behind anything still queued there (FIFO)."""
    await trio.sleep(1.0)
    probe = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 1,
    }
    for url in urls:
        response = await client.post(url + "/chat/completions", json=probe, timeout=120)
        response.raise_for_status()


def parse_metrics(text: str, label: str = "") -> dict[str, float]:
    """Prometheus text: each metric's value, summed over the samples whose labels contain
    ``label`` (e.g. ``'finished_reason="length"'``; ``""``: all)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"([^#{\s]+)(\{[^}]*\})?\s+(\S+)", line)
        if match is None or label not in (match.group(2) or ""):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        out[match.group(1)] = out.get(match.group(1), 0.0) + value
    return out


@attrs.frozen
class Counters:
    """What an engine says it did (sums over both replicas); ``None``: it does not say."""

    generated: float | None = None  # output tokens generated
    finished: float | None = None  # requests run to their end


@attrs.define
class Engine:
    """Two running replicas and how to read their load signals."""

    kind: str  # "llama", "vllm", "cpp" (llama-cpp-python), "fake" or "unknown"
    urls: list[str]  # OpenAI base URLs (``…/v1``)
    pids: list[int] = attrs.field(factory=list)  # server processes, for CPU seconds
    fakes: list[FakeReplica] = attrs.field(factory=list)
    leaders: list[int] = attrs.field(factory=list)  # each replica's server pid (started ones)

    def roots(self) -> list[str]:
        return [url.removesuffix("/v1") for url in self.urls]

    async def counters(self, client: httpx.AsyncClient) -> Counters:
        if self.kind == "fake":
            records = [r for f in self.fakes for r in f.requests if r.method == "POST"]
            return Counters(sum(r.tokens_sent for r in records), sum(r.completed for r in records))
        if self.kind not in ("llama", "vllm"):
            return Counters()
        generated = finished = 0.0
        for root in self.roots():
            text = (await client.get(root + "/metrics", timeout=30)).text
            if self.kind == "llama":
                generated += parse_metrics(text).get("llamacpp:tokens_predicted_total", 0.0)
                continue
            generated += parse_metrics(text).get("vllm:generation_tokens_total", 0.0)
            for reason in ("length", "stop"):  # run to an end, not aborted
                where = f'finished_reason="{reason}"'
                finished += parse_metrics(text, where).get("vllm:request_success_total", 0.0)
        return Counters(generated, finished if self.kind == "vllm" else None)

    async def wait_idle(self, client: httpx.AsyncClient, model: str) -> None:
        """Until neither replica has anything running or queued (cancelled prefills
        included)."""
        if self.kind == "fake":
            await trio.sleep(0.05)
            return
        if self.kind not in ("llama", "vllm"):  # "unknown", "cpp": by a request
            await wait_idle(client, self.urls, model)
            return
        deadline = trio.current_time() + 300
        while trio.current_time() < deadline:
            # llama-server notices a cancelled prefill only after 1 s in which no result
            # reached any client (../shared/engine2/README.md): polling faster would keep it.
            await trio.sleep(2.0 if self.kind == "llama" else 0.5)
            if not any([await self._busy(client, root) for root in self.roots()]):
                return
        raise RuntimeError("the replicas did not become idle within 300 s")

    async def _busy(self, client: httpx.AsyncClient, root: str) -> bool:
        if self.kind == "llama":
            slots = (await client.get(root + "/slots", timeout=30)).json()
            return any(slot.get("is_processing") for slot in slots)
        metrics = parse_metrics((await client.get(root + "/metrics", timeout=30)).text)
        return (
            metrics.get("vllm:num_requests_running", 0.0)
            + metrics.get("vllm:num_requests_waiting", 0.0)
            > 0
        )


def detect(urls: Sequence[str]) -> str:
    """Which engine serves ``urls`` (``…/v1``): llama-server answers ``/slots``, vLLM's
    ``/metrics`` has ``vllm:`` gauges."""
    root = urls[0].removesuffix("/v1")
    try:
        if httpx.get(root + "/slots", timeout=5).status_code == 200:
            return "llama"
        if "vllm:num_requests_running" in httpx.get(root + "/metrics", timeout=5).text:
            return "vllm"
    except httpx.HTTPError:
        pass
    return "unknown"


def missing(kind: str) -> str | None:
    """Why the engine ``kind`` cannot be started here, or ``None``."""
    if kind == "llama":
        binary = LLAMA_HOME / "build" / "bin" / "llama-server"
        if not binary.exists() or not (LLAMA_HOME / "tiny-random-llama.gguf").exists():
            return f"no llama-server in {LLAMA_HOME} (bash {ENGINE_DIR}/setup_llama_server.sh)"
    else:
        python = VLLM_HOME / "venv" / "bin" / "python"
        if not python.exists() or not (VLLM_HOME / "tiny-random-llama-hf").exists():
            return f"no vLLM CPU in {VLLM_HOME} (bash {ENGINE_DIR}/setup_vllm_cpu.sh)"
    script = ENGINE_DIR / ("start_llama_server.sh" if kind == "llama" else "start_vllm_cpu.sh")
    if not script.exists():
        return f"no {script} (set ENGINE2_DIR to ../shared/engine2)"
    return None


def group_pids(leader: int) -> list[int]:
    """The processes of ``leader``'s process group (vLLM's API server and engine core)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == leader:
            pids.append(int(stat.parent.name))
    return pids


def start_replica(kind: str, port: int, console: Console, core: int | None = None) -> int:
    """Start one replica of ``kind`` on ``port`` with ``../shared/engine2``'s script (it
    waits until ``/health`` answers); its server's pid (vLLM's: a process group leader).
    ``core``: vLLM's OpenMP threads bound to that CPU (``$BIND`` wins when set). With the
    script's ``auto`` two vLLM replicas on this 2-core machine bound to the same cores and
    one starved the other: another tenant's 4,000-word prefill took 11-25 s on one replica
    and 1.3 s on the other, in every strategy's row alike."""
    name = "start_llama_server.sh" if kind == "llama" else "start_vllm_cpu.sh"
    env = {**os.environ, "NP": os.environ.get("NP", "4")}
    if kind == "vllm" and core is not None and "BIND" not in os.environ:
        env["BIND"] = str(core % (os.cpu_count() or 1))
    done = subprocess.run(["bash", ENGINE_DIR / name, str(port)], env=env, capture_output=True)
    console.print(done.stdout.decode().strip())
    if done.returncode != 0:
        raise RuntimeError(f"{name} {port} failed: {done.stderr.decode()[-2000:]}")
    pid_dir = (LLAMA_HOME if kind == "llama" else VLLM_HOME) / "logs"
    pid_name = "llama-server-{}.pid" if kind == "llama" else "vllm-{}.pid"
    return int((pid_dir / pid_name.format(port)).read_text())


def stop_replica(kind: str, port: int) -> None:
    """Stop the replica the script started on ``port`` (by its recorded pid)."""
    name = "start_llama_server.sh" if kind == "llama" else "start_vllm_cpu.sh"
    subprocess.run(["bash", ENGINE_DIR / name, "stop", str(port)], capture_output=True)


@contextmanager
def started(kind: str, console: Console) -> Iterator[Engine]:
    """Start two replicas of ``kind`` with ``../shared/engine2``'s scripts on free ports;
    stop exactly those on exit."""
    ports = [free_port(), free_port()]
    launched: list[int] = []
    try:
        leaders = []
        for core, port in enumerate(ports):  # one at a time: vLLM's start-up takes ~35 s
            launched.append(port)
            leaders.append(start_replica(kind, port, console, core))
        pids = [pid for leader in leaders for pid in group_pids(leader)] or leaders
        urls = [f"http://127.0.0.1:{port}/v1" for port in ports]
        yield Engine(kind, urls, pids, leaders=leaders)
    finally:
        for port in launched:
            stop_replica(kind, port)
