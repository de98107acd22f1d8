"""The load-aware routers people deploy in front of LLM replicas, for comparison rows:
smg 1.13.0 (the SGLang / Shepherd Model Gateway) and vllm-router 0.1.17.

Neither is a dependency of trio_hedge: install them into a venv of their own (they are Rust
binaries behind a Python launcher; ``$ROUTERS_BIN``, default ``~/.venvs/routers/bin``)::

    python3 -m venv ~/.venvs/routers
    ~/.venvs/routers/bin/pip install smg==1.13.0 vllm-router==0.1.17

Both route to workers that answer ``GET /health`` with 200 (``llama-server`` and vLLM do;
llama-cpp-python's server does not) and proxy ``/v1/chat/completions`` as it is. Each is
started as its users start it (``--worker-urls``, ``--policy``), with its Prometheus exporter
on a free port (both default to the same one), and stopped on exit.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
from _engines import free_port

ROUTERS_BIN = Path(os.environ.get("ROUTERS_BIN", Path.home() / ".venvs" / "routers" / "bin"))

#: The policies compared, per router: round robin (the baseline every router has) and each
#: load-aware one. smg's ``least_load`` scores queued tokens / throughput with a KV barrier;
#: ``cache_aware`` (its default) routes on prefix overlap, then on load when unbalanced.
POLICIES: dict[str, tuple[str, ...]] = {
    "smg": ("round_robin", "power_of_two", "least_load", "cache_aware"),
    "vllm-router": ("round_robin", "power_of_two", "sticky_least_loaded", "cache_aware"),
}
VERSIONS = {"smg": "1.13.0", "vllm-router": "0.1.17"}


def router_missing(name: str) -> str | None:
    """Why router ``name`` cannot run here, or ``None``."""
    if not (ROUTERS_BIN / name).exists():
        return (
            f"no {name} in {ROUTERS_BIN} (python3 -m venv ~/.venvs/routers && "
            f"~/.venvs/routers/bin/pip install {name}=={VERSIONS[name]})"
        )
    return None


@contextmanager
def router(name: str, policy: str, roots: Sequence[str], log: Path) -> Iterator[str]:
    """Run router ``name`` with ``policy`` over the workers at ``roots`` (``http://host:port``);
    yield its OpenAI base URL (``…/v1``) once a request through it is answered."""
    port = free_port()
    command = [str(ROUTERS_BIN / name)]
    if name == "smg":
        command.append("launch")
    command += [
        "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *roots,
        "--policy", policy, "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        ping = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited (see {log})")
            try:
                if httpx.post(url + "/chat/completions", json=ping, timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not answer within 60 s (see {log})")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
