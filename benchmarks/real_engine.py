"""Hedging on real LLM servers: two llama.cpp replicas, one seeded schedule, every strategy.

What it runs. Two OpenAI-compatible llama.cpp servers (llama-cpp-python, a tiny random-weight
model: real prefill whose cost grows with the prompt, one request at a time in FIFO order,
real SSE framing; ``../shared/engine/``). It starts them itself when the engine is installed
(``$ENGINE_HOME``, default ``~/.cache/trio-hedge-engine``), each with ``--n_threads 1
--n_threads_batch 1 --interrupt_requests False``; without it, it says so and exits 0 (CI does
not build the engine). ``--replica URL`` (twice) runs against any OpenAI-compatible servers
instead, a user's own fleet (``--model`` names the model; server CPU is then not measured).

The schedule (seeded, the same for every strategy): Poisson arrivals at ``--rate`` requests/s;
each prompt is a run of words from the model's vocabulary (one word = one token): short ones
of 20-80 words, and ``--long-fraction`` of them long (2,000 words, ~2 s of prefill). By
default the long prompts come from **other tenants**: a plain httpx client sends each to a
random replica, unseen by the library, and only the library's own (short) requests are
measured; that is the case hedging exists for. ``--tenants self`` sends them through the
library too (a lone client: routing alone can then see them).

The strategies, one after another over the same schedule, each on idle replicas:
* no hedging: one attempt to a random (seeded) replica;
* fixed P90 delay: ``hedged_stream`` with ``hedge_after`` = the no-hedging run's short-request
  P90 TTFT (an oracle: tuned on that very run), random primary, the other as backup;
* the ``Hedger`` with its defaults (learned delay, budget, throttle, peak-EWMA pick), after a
  warm-up of ``--warmup`` short requests;
* the same at the P90 (``LearnedDelay(percentile=0.9)``, the default before this benchmark
  showed the P95 as good for half the hedges), and with the least-loaded pick (what the pick
  was before issue 9);
* routing only: the ``Hedger``'s pick with ``hedge_after=None`` (the control that separates
  routing from hedging);
* double send: ``hedge_after=0``, both replicas at once, the first token wins.

Reported per strategy: the library's short-request TTFT P50/P90/P99/max (from the scheduled
send to the first content token), extra requests (attempts beyond one per request), short
requests whose primary went to a replica busy with a long prompt (one was in flight there
when it was sent), hedges while the primary was busy vs idle, long prompts hedged (the
library's own, with ``--tenants self``), and the CPU seconds the two servers spent.

Run: ``python benchmarks/real_engine.py`` (240 requests, ~10 minutes with the warm-ups);
``--quick`` for a smoke run (40 requests). Run it on a quiet machine: the load average is
printed with the figures.

``--scenario evidence`` (issue 21): the engines people self-host, with other tenants' load.
``--engine llama`` (default) or ``vllm`` starts two replicas of ``../shared/engine2/``
(llama-server ``-np 4``, vLLM CPU), ``cpp`` two of llama-cpp-python; ``--replica URL`` twice
runs against any fleet. Another tenant (plain httpx, unseen by the library) sends a long
prompt (4,000 words; 2,000 on llama-cpp-python) every ``--long-every`` seconds (6 on
llama-server, 4 on vLLM: each replica prefills one about a third / a fifth of the time),
alternating between the replicas (``--pattern alternate``) or all on the first (``one``);
the library sends 60 short streaming requests (Poisson, 2/s) and ``--own-long`` (2) long
prompts of its own, between the tenant's. Every strategy starts cold (no warm-up): no
hedging, the fixed delay tuned on the no-hedging run (its P90), double send, the Hedger
without probes, routing only with probes, the Hedger with probes, and smg 1.13.0 and
vllm-router 0.1.17 with each of their policies (``benchmarks/_routers.py``: installed in a
venv of their own; skipped with a message without it). Reported: short-request TTFT
P50/P99/max over all requests and over the warm part (from the ``--warm-from``-th, 20),
extra requests, primaries sent to a replica busy with a long prompt, the library's long
prompts hedged, backups sent at once on evidence, probe polls, the engines' CPU seconds; and
PASS/FAIL for the issue's targets. ``--scenario cancel-cost``: on one llama-server, a
7,800-word prompt cancelled by its caller 0.5 s after it was sent, with no prober, with the
Hedger's probe and with the same probe polling on without a quiet window: the prompt tokens
the engine computed for it (its log's ``stop processing: n_tokens``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from rich.console import Console
from rich.table import Table

import trio_hedge as th
from trio_hedge.report import AttemptOutcome
from trio_hedge.sources.probes import LoadProbe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import percentile
from _engines import free_port, wait_idle

ENGINE_HOME = Path(os.environ.get("ENGINE_HOME", Path.home() / ".cache" / "trio-hedge-engine"))
MODEL_FILE = "tiny-random-llama.gguf"
#: Words of the engine's tiny vocabulary (``../shared/engine/make_model.py``): each one,
#: preceded by a space, is exactly one token, so a prompt of N words is ~N tokens.
_VOCABULARY = """the of and to in is that it was for on are as with his they at be this have from
or one had by word but not what all were we when your can said there use an each which she do
how their if will up other about out many then them these so some her would make like him into
time has look two more write go see number no way could people my than first water been call
who oil its now find long down day did get come made may part over new sound take only little
work know place year live me back give most very after thing our just name good sentence man
think say great where help through much before line right too mean old any same tell boy
follow came want show also around form three small set put end does another well large must big
even such because turn here why ask went men read need land different home us move try kind
hand picture again change off play spell air away animal house point page letter mother answer
found study still learn should world hello token stream server model test client queue fast
slow request engine"""
WORDS = _VOCABULARY.split()

NONE = "no hedging"
FIXED = "fixed P90 delay (oracle)"
HEDGER = "Hedger (defaults)"
HEDGER_P90 = "Hedger, P90"
HEDGER_LEAST = "Hedger, least-loaded pick"
ROUTING = "routing only (Hedger, hedge_after=None)"
DOUBLE = "double send"
#: Short names for ``--strategies``, in the order they run.
STRATEGIES = {
    "none": NONE,
    "fixed": FIXED,
    "hedger": HEDGER,
    "p90": HEDGER_P90,
    "least": HEDGER_LEAST,
    "routing": ROUTING,
    "double": DOUBLE,
}


@attrs.frozen
class Params:
    requests: int = 240
    rate: float = 2.5  # requests per second
    long_fraction: float = 0.05
    long_words: int = 2000
    short_words: tuple[int, int] = (20, 80)
    max_tokens: int = 16
    warmup: int = 60  # short requests before the schedule, for the Hedger rows
    seed: int = 1
    tenants: str = "others"


@attrs.frozen
class Item:
    """One request of the schedule."""

    index: int
    at: float  # seconds after the schedule starts
    words: int
    long: bool
    tenant: bool  # sent by another client, around the library
    replica: int  # the tenant's replica, or the random primary of the fixed strategies


def make_schedule(p: Params, count: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    now = 0.0
    items = []
    for i in range(count):
        now += rng.expovariate(p.rate)
        long = rng.random() < p.long_fraction
        words = p.long_words if long else rng.randint(*p.short_words)
        tenant = long and p.tenants == "others"
        items.append(Item(i, now, words, long, tenant, rng.randrange(2)))
    return items


def texts(schedule: Sequence[Item], seed: int) -> dict[int, str]:
    """A prompt per item: the sizes are the schedule's, the words are drawn anew for each
    strategy (llama.cpp reuses the KV cache of a prompt that starts like the previous one on
    the same replica: a repeated prompt would prefill in no time)."""
    rng = random.Random(seed)
    return {item.index: " ".join(rng.choice(WORDS) for _ in range(item.words)) for item in schedule}


@attrs.define
class Outcome:
    item: Item
    ttft: float | None  # caller-visible, seconds
    attempts: int
    hedged: bool
    primary: str | None  # the primary's replica name
    sent_at: float  # Trio time
    ended_at: float
    error: str | None = None
    trace: str = ""  # the attempts: replica, trigger, start, TTFT or outcome
    cancelled: int = 0  # losers the library cancelled
    failed: int = 0  # attempts that failed on their own before the commit


# -- the servers --------------------------------------------------------------------------------


def engine_paths(home: Path) -> tuple[Path, Path] | None:
    """(python, model) of the engine built by ``../shared/engine/setup.sh``, or ``None``."""
    python, model = home / "venv" / "bin" / "python", home / MODEL_FILE
    if not python.exists() or not model.exists():
        return None
    check = subprocess.run(
        [str(python), "-c", "import llama_cpp.server"], capture_output=True, check=False
    )
    return (python, model) if check.returncode == 0 else None


@contextmanager
def llama_replicas(
    python: Path, model: Path, log_dir: Path, count: int = 2
) -> Iterator[list[tuple[str, int]]]:
    """Start ``count`` llama.cpp servers; yield ``[(base URL, pid)]``; stop them on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    try:
        for i in range(count):
            port = free_port()
            log = open(log_dir / f"llama-{i}.log", "wb")  # noqa: SIM115 - closed with the process
            procs.append(
                subprocess.Popen(
                    [
                        str(python), "-m", "llama_cpp.server", "--model", str(model),
                        "--model_alias", "tiny", "--host", "127.0.0.1", "--port", str(port),
                        "--n_ctx", "4096", "--n_threads", "1", "--n_threads_batch", "1",
                        "--interrupt_requests", "False", "--verbose", "False",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
            urls.append(f"http://127.0.0.1:{port}/v1")
        deadline = time.monotonic() + 120
        for url, proc in zip(urls, procs, strict=True):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama.cpp server exited (see {log_dir})")
                try:
                    if httpx.get(url + "/models", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama.cpp server did not start (see {log_dir})")
                time.sleep(0.2)
        yield [(url, proc.pid) for url, proc in zip(urls, procs, strict=True)]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def cpu_seconds(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds of the processes (Linux ``/proc``), or ``None``."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


# -- the strategies -----------------------------------------------------------------------------


def body(p: Params, model: str, text: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": p.max_tokens,
        "temperature": 0.0,
    }


async def _read(stream: th.HedgedStream, sent_at: float) -> float | None:
    ttft = None
    async with stream:
        async for _token in stream:
            if ttft is None:
                ttft = trio.current_time() - sent_at
    return ttft


Send = Callable[[Item, float], Awaitable[Outcome]]


#: Builds one request body: ``(params, model, prompt text) -> JSON body`` (chat completions
#: by default; ``benchmarks/agent_engines.py`` passes the Messages and Responses bodies).
MakeBody = Callable[[Params, str, str], dict[str, Any]]


def fixed(
    replicas: Sequence[th.Replica], client: httpx.AsyncClient, p: Params, model: str,
    hedge_after: float | None, prompts: dict[int, str], make_body: MakeBody = body,
) -> Send:  # fmt: skip
    """``hedged_stream`` with a fixed delay (``None``: never), the item's random primary
    first and the other replica as backup."""
    policy = th.HedgePolicy(hedge_after=hedge_after, first_token_timeout=120.0)

    async def send(item: Item, sent_at: float) -> Outcome:
        order = [replicas[item.replica], replicas[1 - item.replica]]
        request = make_body(p, model, prompts[item.index])
        stream = th.hedged_stream(request, order, policy, client=client)
        return await _outcome(item, stream, sent_at)

    return send


def hedger_send(
    hedger: th.Hedger, p: Params, model: str, prompts: dict[int, str], make_body: MakeBody = body
) -> Send:
    async def send(item: Item, sent_at: float) -> Outcome:
        stream = hedger.stream(make_body(p, model, prompts[item.index]))  # prompt size estimated
        return await _outcome(item, stream, sent_at)

    return send


async def _outcome(item: Item, stream: th.HedgedStream, sent_at: float) -> Outcome:
    error = None
    ttft = None
    try:
        ttft = await _read(stream, sent_at)
    except th.HedgeError as exc:
        error = type(exc).__name__
    report = stream.report
    trace = " ".join(
        f"{a.replica}/{a.trigger}@{a.started_at or 0:.3f}:"
        + (f"{a.ttft:.3f} " if a.ttft is not None else "")
        + a.outcome.value
        for a in report.attempts
    )
    return Outcome(
        trace=trace,
        item=item,
        ttft=ttft,
        attempts=len(report.attempts),
        hedged=report.hedged,
        primary=report.attempts[0].replica if report.attempts else None,
        sent_at=sent_at,
        ended_at=trio.current_time(),
        error=error,
        cancelled=sum(a.outcome is AttemptOutcome.CANCELLED for a in report.attempts),
        failed=sum(a.outcome is AttemptOutcome.FAILED for a in report.attempts),
    )


def chat_text(event: dict[str, Any]) -> bool:
    """Whether one chat-completions SSE event carries answer text."""
    choices = event.get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


async def tenant(
    client: httpx.AsyncClient, url: str, p: Params, model: str, item: Item, text: str,
    make_body: MakeBody = body, path: str = "/chat/completions",
    has_text: Callable[[dict[str, Any]], bool] = chat_text,
) -> Outcome:  # fmt: skip
    """Another client's request, straight to one replica (``url + path``), read to its end;
    its TTFT is the first event ``has_text`` says carries text."""
    sent_at = trio.current_time()
    ttft = None
    payload = make_body(p, model, text) | {"stream": True}
    async with client.stream("POST", url + path, json=payload) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {") and has_text(json.loads(line[6:])):
                ttft = trio.current_time() - sent_at
    return Outcome(item, ttft, 1, False, f"r{item.replica}", sent_at, trio.current_time())


Tenant = Callable[[httpx.AsyncClient, str, Item, str], Awaitable[Outcome]]


async def run_schedule(
    schedule: Sequence[Item], send: Send, client: httpx.AsyncClient, urls: Sequence[str],
    p: Params, model: str, prompts: dict[int, str], send_tenant: Tenant | None = None,
) -> list[Outcome]:  # fmt: skip
    """Run the schedule: the library's items through ``send``, the other tenants' through
    ``send_tenant(client, url, item, text)`` (default: a chat-completions ``tenant``)."""
    outcomes: list[Outcome] = []

    async def one(item: Item, sent_at: float) -> None:
        if item.tenant:
            text, url = prompts[item.index], urls[item.replica]
            if send_tenant is None:
                outcomes.append(await tenant(client, url, p, model, item, text))
            else:
                outcomes.append(await send_tenant(client, url, item, text))
        else:
            outcomes.append(await send(item, sent_at))

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for item in schedule:
            await trio.sleep_until(start + item.at)
            nursery.start_soon(one, item, start + item.at)
    return sorted(outcomes, key=lambda o: o.item.index)


# -- measuring ----------------------------------------------------------------------------------


@attrs.frozen
class Row:
    name: str
    ttft: tuple[float, float, float, float]  # P50, P90, P99, max of short requests
    requests: int
    extra: float  # %
    errors: int
    to_busy: int  # short requests whose primary went to a replica busy with a long prompt
    hedged_busy: tuple[int, int]  # (hedged, primaries busy)
    hedged_idle: tuple[int, int]  # (hedged, primaries idle)
    long_hedged: tuple[int, int]  # the library's own long prompts: (hedged, sent)
    server_cpu: float | None  # seconds, both replicas
    load: float  # 1-minute load average after the run


def busy_intervals(outcomes: Sequence[Outcome]) -> dict[str, list[tuple[float, float]]]:
    """When each replica had a long prompt in flight (sent, not finished)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for o in outcomes:
        if o.item.long and o.primary is not None:
            out.setdefault(o.primary, []).append((o.sent_at, o.ended_at))
    return out


def summarize(name: str, outcomes: Sequence[Outcome], cpu: float | None) -> Row:
    busy = busy_intervals(outcomes)
    own = [o for o in outcomes if not o.item.tenant]
    short = [o for o in own if not o.item.long]
    ttfts = [o.ttft if o.ttft is not None else math.inf for o in short]

    def was_busy(o: Outcome) -> bool:
        return any(a <= o.sent_at < b for a, b in busy.get(o.primary or "", []))

    on_busy = [o for o in short if was_busy(o)]
    on_idle = [o for o in short if not was_busy(o)]
    long = [o for o in own if o.item.long]
    return Row(
        name=name,
        ttft=(
            percentile(ttfts, 50),
            percentile(ttfts, 90),
            percentile(ttfts, 99),
            max(ttfts),
        ),
        requests=len(own),
        extra=100 * (sum(o.attempts for o in own) - len(own)) / max(1, len(own)),
        errors=sum(o.error is not None for o in own),
        to_busy=len(on_busy),
        hedged_busy=(sum(o.hedged for o in on_busy), len(on_busy)),
        hedged_idle=(sum(o.hedged for o in on_idle), len(on_idle)),
        long_hedged=(sum(o.hedged for o in long), len(long)),
        server_cpu=cpu,
        load=os.getloadavg()[0],
    )


def print_table(console: Console, rows: Sequence[Row], p: Params) -> None:
    table = Table(
        title=f"Short-request TTFT on two llama.cpp replicas ({p.requests} requests at "
        f"{p.rate:g}/s, {p.long_fraction:.0%} long prompts from "
        f"{'other tenants' if p.tenants == 'others' else 'this client'})"
    )
    table.add_column("strategy")
    table.add_column("TTFT P50 / P90 / P99 / max (s)", justify="right")
    table.add_column("extra req", justify="right")
    table.add_column("primary busy", justify="right")
    table.add_column("hedged | busy", justify="right")
    table.add_column("hedged | idle", justify="right")
    table.add_column("long hedged", justify="right")
    table.add_column("server CPU (s)", justify="right")
    table.add_column("load", justify="right")
    for r in rows:
        table.add_row(
            r.name + (f" ({r.errors} errors)" if r.errors else ""),
            " / ".join(f"{v:.3f}" for v in r.ttft),
            f"{r.extra:.1f}%",
            f"{r.to_busy}",
            f"{r.hedged_busy[0]} of {r.hedged_busy[1]}",
            f"{r.hedged_idle[0]} of {r.hedged_idle[1]}",
            f"{r.long_hedged[0]} of {r.long_hedged[1]}",
            "-" if r.server_cpu is None else f"{r.server_cpu:.1f}",
            f"{r.load:.2f}",
        )
    console.print(table)


def check_targets(console: Console, rows: Sequence[Row]) -> bool:
    """PASS/FAIL for issue 9's targets, for the Hedger with its defaults (the P95) and, for
    comparison, at the P90. The exit status follows the defaults."""
    by = {r.name: r for r in rows}
    if DOUBLE not in by or ROUTING not in by:
        return True
    double, routing = by[DOUBLE], by[ROUTING]
    met: dict[str, bool] = {}
    for name in (HEDGER, HEDGER_P90):
        if name not in by:
            continue
        ours = by[name]
        checks = [
            (
                f"{name}: short-request P99 TTFT <= 1.3x double send's ({ours.ttft[2]:.3f} vs "
                f"1.3 x {double.ttft[2]:.3f} = {1.3 * double.ttft[2]:.3f} s)",
                ours.ttft[2] <= 1.3 * double.ttft[2],
            ),
            (f"{name}: <= 8% extra requests ({ours.extra:.1f}%)", ours.extra <= 8),
            (
                f"{name}: no long prompt hedged ({ours.long_hedged[0]} of "
                f"{ours.long_hedged[1]} sent by the library)",
                ours.long_hedged[0] == 0,
            ),
            (
                f"{name}: lower short-request P99 TTFT than routing alone ({ours.ttft[2]:.3f} "
                f"vs {routing.ttft[2]:.3f} s)",
                ours.ttft[2] < routing.ttft[2],
            ),
        ]
        if HEDGER_LEAST in by:
            least = by[HEDGER_LEAST]
            checks.append(
                (
                    f"{name}: fewer short requests sent to a busy replica than the "
                    f"least-loaded pick ({ours.to_busy} vs {least.to_busy})",
                    ours.to_busy < least.to_busy,
                )
            )
        for text, ok in checks:
            console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] {text}")
        met[name] = all(ok for _, ok in checks)
    return met.get(HEDGER, True)


# -- issue 21: engine evidence, on the engines people self-host -----------------------------------

PROBES_ROUTING = "routing only, with probes"
#: Issue 27's control: the defaults but for slowness, which counted against a replica's health
#: as a run (busy is not broken).
HEDGER_NOSLOW = "Hedger, count_slow off"
PROBES = "Hedger with probes"
PROBES_PRIORITY = "Hedger with probes, backups at priority 1"
#: The evidence scenario's strategies (``--scenario evidence``), in the order they run; a
#: router name stands for one row per policy of ``_routers.POLICIES``.
EVIDENCE_STRATEGIES = {
    "none": NONE,
    "fixed": FIXED,
    "double": DOUBLE,
    "hedger": HEDGER,
    "hedger-noslow": HEDGER_NOSLOW,
    "routing": ROUTING,
    "probe-routing": PROBES_ROUTING,
    "probes": PROBES,
    "probes-priority": PROBES_PRIORITY,
    "smg": "smg",
    "vllm-router": "vllm-router",
}
#: Per engine: the other tenants' long prompt (words ~ tokens) and the seconds between two of
#: them, so that with ``alternate`` each replica prefills one about a third of the time.
EVIDENCE_DEFAULTS = {"llama": (4000, 6.0), "vllm": (4000, 4.0), "cpp": (2000, 3.0)}
#: The probe each engine is read with (llama-cpp-python publishes no load).
PROBE_ENGINE = {"llama": "llama.cpp", "vllm": "vllm"}


@attrs.frozen
class Evidence:
    """The evidence scenario: ``requests`` short streaming requests (Poisson at ``rate``)
    and ``own_long`` long prompts of the library's own (spread evenly: are they hedged?);
    another tenant's long prompts every ``every`` seconds from ``offset``, alternating
    between the replicas (``pattern="alternate"``) or all on the first (``"one"``)."""

    pattern: str = "alternate"
    every: float = 6.0
    offset: float = 1.0
    own_long: int = 2
    warm_from: int = 20


def evidence_schedule(p: Params, e: Evidence, seed: int) -> list[Item]:
    rng = random.Random(seed)
    raw: list[tuple[float, int, bool, bool, int]] = []  # at, words, long, tenant, replica
    now = 0.0
    for _ in range(p.requests):
        now += rng.expovariate(p.rate)
        raw.append((now, rng.randint(*p.short_words), False, False, rng.randrange(2)))
    span = now
    # The library's own long prompts come between two of the tenant's, spread over the run
    # (one at the same time as the tenant's would leave no free replica: nothing could help a
    # short request then, and the table would measure the schedule).
    gaps = max(1, int((span - e.offset) / e.every))
    for k in range(e.own_long):
        gap = (k * gaps) // e.own_long + gaps // (2 * e.own_long)
        raw.append((e.offset + e.every * (gap + 0.5), p.long_words, True, False, k % 2))
    at, k = e.offset, 0
    while at < span:
        raw.append((at, p.long_words, True, True, k % 2 if e.pattern == "alternate" else 0))
        at, k = at + e.every, k + 1
    raw.sort()
    return [Item(i, *fields) for i, fields in enumerate(raw)]


def routed(
    url: str, client: httpx.AsyncClient, p: Params, model: str, prompts: dict[int, str]
) -> Send:
    """Through a router: one attempt to its URL (it picks the worker), never hedged."""
    policy = th.HedgePolicy(hedge_after=None, first_token_timeout=120.0)
    replica = th.Replica(url, name="router")

    async def send(item: Item, sent_at: float) -> Outcome:
        stream = th.hedged_stream(body(p, model, prompts[item.index]), [replica], policy,
                                  client=client)  # fmt: skip
        return await _outcome(item, stream, sent_at)

    return send


@attrs.frozen
class EvidenceRow:
    row: Row
    warm: tuple[float, float, float]  # P50, P99, max of the warm part's short requests
    polls: int | None  # probe polls, both replicas (None: no probes)
    poll_failures: int | None
    at_once: int  # backups sent at once on the engine's evidence
    delays: str  # the Hedger's delays at the end
    tenant: tuple[float, float]  # the other tenant's TTFT: P50, max
    #: The Hedger's ejections of replicas that never failed, its hedges refused for want of a
    #: replica, and its replicas' (times ejected, failures).
    healthy_ejected: int = 0
    no_replica: int = 0
    ejections: str = ""


def _three(values: Sequence[float]) -> tuple[float, float, float]:
    return (percentile(values, 50), percentile(values, 99), max(values)) if values else (
        math.nan, math.nan, math.nan)  # fmt: skip


def _warm(outcomes: Sequence[Outcome], warm_from: int) -> tuple[float, float, float]:
    short = [o for o in outcomes if not o.item.tenant and not o.item.long]
    return _three([o.ttft if o.ttft is not None else math.inf for o in short[warm_from:]])


async def run_evidence(
    engine: Any, p: Params, e: Evidence, model: str, names: Sequence[str], console: Console,
    out: Path, verbose: float | None = None,
) -> list[EvidenceRow]:  # fmt: skip
    """Every strategy over one seeded schedule, each on idle replicas, cold."""
    from _routers import POLICIES, router, router_missing

    schedule = evidence_schedule(p, e, p.seed)
    urls: list[str] = engine.urls
    pids: list[int] = engine.pids
    probe: str | LoadProbe | None = PROBE_ENGINE.get(engine.kind)
    if probe == "vllm":
        async with httpx.AsyncClient() as check:
            root = urls[0].removesuffix("/v1")
            if (await check.get(root + "/load", timeout=10)).status_code == 200:
                # --enable-server-load-tracking: requests held before their first step;
                # every 0.1 s (llm-d's picker scrapes every 0.05 s): vLLM stops a cancelled
                # prefill at its next step whatever is polled, so polling costs no prefill.
                probe = LoadProbe("vllm", load_path="/load", interval=0.1)
        console.print(f"vLLM probe: {probe!r}")
    rows: list[EvidenceRow] = []
    p90: float | None = None
    async with th.transport.make_client() as client:
        await engine.wait_idle(client, model)
        for number, name in enumerate(names):
            runs: list[tuple[str, Any]] = []
            if name in POLICIES:
                why = router_missing(name)
                if why is None and engine.kind not in ("llama", "vllm", "unknown"):
                    why = f"its workers need GET /health (the {engine.kind} engine has none)"
                if why is not None:
                    console.print(f"skipping {name}: {why}")
                    continue
                runs = [(f"{name} {policy}", policy) for policy in POLICIES[name]]
            elif name == PROBES_PRIORITY and engine.kind != "vllm":
                console.print(f"skipping {name}: only vLLM (--scheduling-policy priority) here")
                continue
            elif name in (PROBES, PROBES_ROUTING, PROBES_PRIORITY) and probe is None:
                console.print(f"skipping {name}: the {engine.kind} engine publishes no load")
                continue
            elif name == FIXED and p90 is None:
                console.print(f"skipping {FIXED}: it needs the {NONE} run first")
                continue
            else:
                runs = [(name, None)]
            for label, policy in runs:
                # Fresh words for every run: llama.cpp reuses a cached prompt prefix.
                prompts = texts(schedule, p.seed * 1000 + len(rows) + 100 * number)
                hedger: th.Hedger | None = None
                began = time.monotonic()
                cpu_before = cpu_seconds(pids) if pids else None
                if policy is not None:
                    roots = [u.removesuffix("/v1") for u in urls]
                    with router(name, policy, roots, out / "routers" / f"{label}.log") as url:
                        await engine.wait_idle(client, model)
                        cpu_before = cpu_seconds(pids) if pids else None
                        send = routed(url, client, p, model, prompts)
                        outcomes = await run_schedule(
                            schedule, send, client, urls, p, model, prompts
                        )
                elif name in (HEDGER, HEDGER_NOSLOW, ROUTING, PROBES, PROBES_ROUTING,
                              PROBES_PRIORITY):  # fmt: skip
                    with_probes = name in (PROBES, PROBES_ROUTING, PROBES_PRIORITY)
                    priority = 1 if name == PROBES_PRIORITY else None
                    replicas = [
                        th.Replica(
                            u,
                            name=f"r{i}",
                            probe=probe if with_probes else None,
                            backup_priority=priority,
                        )
                        for i, u in enumerate(urls)
                    ]
                    config = th.HedgerConfig(first_token_timeout=120.0)
                    if name in (ROUTING, PROBES_ROUTING):
                        config = attrs.evolve(config, hedge_after=None)
                    if name == HEDGER_NOSLOW:
                        config = attrs.evolve(
                            config, outlier_detection=th.policy.OutlierDetection(count_slow=False)
                        )
                    hedger = th.Hedger(replicas, config, client=client)
                    async with hedger:  # the probes poll only inside
                        outcomes = await run_schedule(
                            schedule, hedger_send(hedger, p, model, prompts), client, urls, p,
                            model, prompts,
                        )  # fmt: skip
                else:
                    replicas = [th.Replica(u, name=f"r{i}") for i, u in enumerate(urls)]
                    delay = {NONE: None, DOUBLE: 0.0, FIXED: p90}[name]
                    send = fixed(replicas, client, p, model, delay, prompts)
                    outcomes = await run_schedule(schedule, send, client, urls, p, model, prompts)
                await engine.wait_idle(client, model)
                cpu_after = cpu_seconds(pids) if pids else None
                cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
                row = summarize(label, outcomes, cpu)
                if name == NONE:
                    p90 = row.ttft[1]
                polls = failures = None
                at_once = 0
                delays = ""
                healthy_ejected = no_replica = 0
                ejections = ""
                if hedger is not None:
                    stats = hedger.statistics()
                    at_once = stats.hedges_at_once
                    no_replica = stats.no_replica_refusals
                    healthy_ejected = sum(
                        r.times_ejected for r in stats.replicas if r.failures == 0
                    )
                    ejections = ", ".join(
                        f"{r.name}: {r.times_ejected} ({r.failures} failures)"
                        for r in stats.replicas
                    )
                    if with_probes:
                        polls = sum(r.probe_polls for r in stats.replicas)
                        failures = sum(r.probe_failures for r in stats.replicas)
                    delays = ", ".join(
                        f"{d.size_class}: {d.delay:.3f}{'' if d.learned else '*'}"
                        for d in stats.delays
                    )
                if name == FIXED:
                    delays = f"{p90:.3f}"
                tenant = [o.ttft or math.inf for o in outcomes if o.item.tenant]
                rows.append(EvidenceRow(row, _warm(outcomes, e.warm_from), polls, failures,
                                        at_once, delays, (percentile(tenant, 50),
                                                          max(tenant)), healthy_ejected,
                                        no_replica, ejections))  # fmt: skip
                console.print(
                    f"  {label}: {time.monotonic() - began:.0f} s, P99 {row.ttft[2]:.3f} s, "
                    f"warm P99 {rows[-1].warm[1]:.3f} s, extra {row.extra:.1f}%, "
                    f"load {row.load:.2f}" + (f"; delays {delays}" if delays else "")
                )
                if verbose is not None:
                    _show(console, outcomes, verbose)
    return rows


def _show(console: Console, outcomes: Sequence[Outcome], slower_than: float) -> None:
    t0 = min(o.sent_at for o in outcomes)
    for o in outcomes:
        if o.item.long or o.hedged or (o.ttft or math.inf) > slower_than:
            who = "tenant" if o.item.tenant else "own"
            console.print(
                f"    #{o.item.index} {who} {o.item.words} words at {o.sent_at - t0:.2f} s: "
                f"TTFT {'-' if o.ttft is None else f'{o.ttft:.3f}'} s, to {o.primary} "
                f"(ended {o.ended_at - t0:.2f} s) {o.trace}"
            )


def print_evidence(
    console: Console, rows: Sequence[EvidenceRow], p: Params, e: Evidence, engine: str
) -> None:
    where = "alternating between the replicas" if e.pattern == "alternate" else "on one replica"
    table = Table(
        title=f"Short-request TTFT on two {engine} replicas: {p.requests} short requests at "
        f"{p.rate:g}/s, another tenant's {p.long_words}-word prompts every {e.every:g} s "
        f"{where}, {e.own_long} long prompts of the library's own; cold start included"
    )
    table.add_column("strategy")
    table.add_column("all: P50 / P99 / max (s)", justify="right")
    table.add_column(f"warm (from #{e.warm_from}): P50 / P99 / max", justify="right")
    table.add_column("extra req", justify="right")
    table.add_column("primary busy", justify="right")
    table.add_column("long hedged", justify="right")
    table.add_column("at once", justify="right")
    table.add_column("probe polls (failed)", justify="right")
    table.add_column("tenant TTFT P50 / max", justify="right")
    table.add_column("server CPU (s)", justify="right")
    table.add_column("delays (s)", justify="right")
    table.add_column("load", justify="right")
    for er in rows:
        r = er.row
        table.add_row(
            r.name + (f" ({r.errors} errors)" if r.errors else ""),
            " / ".join(f"{v:.3f}" for v in (r.ttft[0], r.ttft[2], r.ttft[3])),
            " / ".join(f"{v:.3f}" for v in er.warm),
            f"{r.extra:.1f}%",
            "-" if r.name.split()[0] in ("smg", "vllm-router") else str(r.to_busy),
            f"{r.long_hedged[0]} of {r.long_hedged[1]}",
            str(er.at_once),
            "-" if er.polls is None else f"{er.polls} ({er.poll_failures})",
            f"{er.tenant[0]:.2f} / {er.tenant[1]:.2f}",
            "-" if r.server_cpu is None else f"{r.server_cpu:.1f}",
            er.delays or "-",
            f"{r.load:.2f}",
        )
    console.print(table)


def check_evidence(console: Console, rows: Sequence[EvidenceRow], engine: str = "llama") -> bool:
    """PASS/FAIL for issue 21's targets, for the Hedger with probes."""
    by = {er.row.name: er for er in rows}
    if PROBES not in by:
        return True
    ours = by[PROBES]
    p99 = ours.row.ttft[2]
    checks: list[tuple[str, bool]] = []
    if DOUBLE in by:
        double = by[DOUBLE].row.ttft[2]
        checks.append((f"short-request P99 <= 1.2x double send's ({p99:.3f} vs 1.2 x "
                       f"{double:.3f} = {1.2 * double:.3f} s)", p99 <= 1.2 * double))  # fmt: skip
    checks.append((f"<= 5% extra requests ({ours.row.extra:.1f}%)", ours.row.extra <= 5))
    routers = [er for er in rows if er.row.name.split()[0] in ("smg", "vllm-router")]
    if routers:
        best = min(routers, key=lambda er: er.row.ttft[2])
        text = (f"P99 <= 0.25x the best router policy's ({p99:.3f} vs 0.25 x "
                f"{best.row.ttft[2]:.3f} = {0.25 * best.row.ttft[2]:.3f} s, "
                f"{best.row.name})")  # fmt: skip
        if engine == "vllm" and DOUBLE in by:
            # Decided for vLLM on 2 cores: the spare replica shares the cores with the busy
            # one, so it is judged against double send on the same machine (which pays the
            # same shared cores); the router ratio is information.
            console.print(f"(information) {text}: {p99 / best.row.ttft[2]:.2f}x")
            double = by[DOUBLE].row.ttft[2]
            checks.append((f"P99 <= double send's on the same cores ({p99:.3f} vs "
                           f"{double:.3f} s)", p99 <= double))  # fmt: skip
        else:
            checks.append((text, p99 <= 0.25 * best.row.ttft[2]))
    checks.append((f"whole-run P99 <= 1.5x warm P99 ({p99:.3f} vs 1.5 x {ours.warm[1]:.3f} = "
                   f"{1.5 * ours.warm[1]:.3f} s)", p99 <= 1.5 * ours.warm[1]))  # fmt: skip
    hedged, sent = ours.row.long_hedged
    checks.append((f"no long prompt hedged ({hedged} of {sent})", hedged == 0))
    for text, ok in checks:
        console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] {PROBES}: {text}")
    return all(ok for _, ok in checks)


# -- issue 21: what a cancelled loser's prefill costs, with and without a prober --------------

#: The probers compared: none, the Hedger's llama.cpp probe (quiet for 1.2 s after a cancel
#: there), and the same polling on without a quiet window (what a naive prober does).
CANCEL_PROBERS: dict[str, LoadProbe | None] = {
    "no prober": None,
    "Hedger's probe (quiet 1.2 s after a cancel)": LoadProbe("llama.cpp"),
    "probe without a quiet window": LoadProbe("llama.cpp", cancel_quiet=0.0),
}


def _released(log: Path, offset: int) -> list[int]:
    """The ``n_tokens`` of every slot released in llama-server's log after byte ``offset``
    (``slot release: … stop processing: n_tokens = N``): the prompt tokens computed for a
    request, its own end or the moment it noticed its client was gone."""
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return [int(m.group(1)) for m in re.finditer(r"stop processing: n_tokens = (\d+)", text)]


async def run_cancel_cost(
    engine: Any, log: Path, words: int, cancel_after: float, repeats: int, console: Console
) -> list[tuple[str, list[int], int]]:
    """Per prober: a ``words``-word prompt sent through a one-replica Hedger and cancelled by
    its caller after ``cancel_after`` s (before its first token: a loser's fate), ``repeats``
    times; the prompt tokens the engine computed for it (from its log), and the polls."""
    rng = random.Random(7)
    out = []
    async with th.transport.make_client() as client:
        for label, probe in CANCEL_PROBERS.items():
            computed, polls = [], 0
            for _ in range(repeats):
                text = " ".join(rng.choice(WORDS) for _ in range(words))
                replica = th.Replica(engine.urls[0], name="r0", probe=probe)
                config = th.HedgerConfig(hedge_after=None, first_token_timeout=120.0)
                offset = (await trio.Path(log).stat()).st_size
                async with th.Hedger([replica], config, client=client) as hedger:
                    await trio.sleep(0.6)  # the prober has read the engine
                    request = {"model": "tiny", "messages": [{"role": "user", "content": text}],
                               "max_tokens": 4}  # fmt: skip
                    with trio.move_on_after(cancel_after):
                        async with hedger.stream(request) as stream:
                            async for _ in stream:
                                break
                    # The prober keeps polling (or keeps quiet) while the engine runs on.
                    await trio.sleep(max(15.0, words / 400))
                    polls += hedger.statistics().replicas[0].probe_polls
                released = _released(log, offset)
                computed.append(released[-1] if released else -1)
            console.print(f"  {label}: prompt tokens computed {computed}, polls {polls}")
            out.append((label, computed, polls))
    return out


def main_cancel_cost(args: argparse.Namespace, console: Console) -> int:
    """``--scenario cancel-cost`` (issue 21): on one llama-server."""
    from _engines import LLAMA_HOME, missing, started

    why = missing("llama")
    if why is not None:
        console.print(f"SKIP: {why}: nothing to measure.")
        return 0
    words = 2000 if args.quick else 7800
    repeats = 1 if args.quick else 3
    with started("llama", console) as engine:
        port = engine.urls[0].removesuffix("/v1").rsplit(":", 1)[1]
        log = LLAMA_HOME / "logs" / f"llama-server-{port}.log"
        rows = trio.run(run_cancel_cost, engine, log, words, 0.5, repeats, console)
    table = Table(
        title=f"A {words}-word prompt cancelled by its caller 0.5 s after it was sent (before "
        "its first token), on llama-server -np 4: the prompt tokens the engine computed for it"
    )
    table.add_column("prober")
    table.add_column("prompt tokens computed (each run)", justify="right")
    table.add_column("polls", justify="right")
    for label, computed, polls in rows:
        table.add_row(label, ", ".join(map(str, computed)), str(polls))
    console.print(table)
    by = {label: computed for label, computed, _ in rows}
    none_label, ours_label, naive_label = CANCEL_PROBERS
    ours, none = by[ours_label], by[none_label]
    # Within 1%: the engine stops at a batch boundary (2,048 tokens), give or take the few
    # tokens of the slot's own bookkeeping.
    ok = max(ours) <= 1.01 * max(none)
    console.print(f"[{'green' if ok else 'red'}]{'PASS' if ok else 'FAIL'}[/] the Hedger's probe "
                  f"costs a cancelled prefill what no prober does, within 1% ({max(ours)} vs "
                  f"{max(none)}; without the quiet window {max(by[naive_label])})")  # fmt: skip
    return 0 if ok or args.quick else 1


# -- main ---------------------------------------------------------------------------------------


async def run_all(
    p: Params, urls: Sequence[str], pids: Sequence[int], model: str, names: Sequence[str],
    console: Console, verbose: float | None = None, samples: Path | None = None,
) -> list[Row]:  # fmt: skip
    schedule = make_schedule(p, p.requests, p.seed)
    warmup = make_schedule(attrs.evolve(p, long_fraction=0.0), p.warmup, p.seed + 1)
    rows: list[Row] = []
    replicas = [th.Replica(url, name=f"r{i}") for i, url in enumerate(urls)]
    p90: float | None = None
    async with th.transport.make_client() as client:
        await wait_idle(client, urls, model)
        for number, name in enumerate(names):
            prompts = texts(schedule, p.seed * 1000 + number)
            hedger: th.Hedger | None = None
            if name in (HEDGER, HEDGER_P90, HEDGER_LEAST, ROUTING):
                config = {
                    HEDGER: th.HedgerConfig(),
                    HEDGER_P90: th.HedgerConfig(hedge_after=th.LearnedDelay(percentile=0.9)),
                    HEDGER_LEAST: th.HedgerConfig(pick="least_loaded"),
                    ROUTING: th.HedgerConfig(hedge_after=None),
                }[name]
                config = attrs.evolve(config, first_token_timeout=120.0)
                hedger = th.Hedger(replicas, config, client=client)
                send = hedger_send(hedger, p, model, prompts)
                if warmup:
                    warm = texts(warmup, p.seed * 1000 + 500 + number)
                    await run_schedule(
                        warmup, hedger_send(hedger, p, model, warm), client, urls, p, model, warm
                    )
                    await wait_idle(client, urls, model)
            elif name == FIXED:
                if p90 is None:
                    console.print(f"skipping {FIXED}: it needs the {NONE} run first")
                    continue
                send = fixed(replicas, client, p, model, p90, prompts)
            else:
                delay = None if name == NONE else 0.0
                send = fixed(replicas, client, p, model, delay, prompts)
            began = time.monotonic()
            cpu_before = cpu_seconds(pids) if pids else None
            outcomes = await run_schedule(schedule, send, client, urls, p, model, prompts)
            await wait_idle(client, urls, model)
            cpu_after = cpu_seconds(pids) if pids else None
            cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
            row = summarize(name, outcomes, cpu)
            rows.append(row)
            if verbose:
                _show(console, outcomes, verbose)
            if name == NONE:
                p90 = row.ttft[1]
            extra = ""
            if hedger is not None and name == HEDGER and samples is not None:
                # What the Hedger learned from, in the records `trio-hedge tune` reads.
                samples.parent.mkdir(parents=True, exist_ok=True)
                with samples.open("w") as f:
                    f.writelines(json.dumps(record) + "\n" for record in hedger.samples())
                extra += f"; its samples: {samples}"
            if hedger is not None and name != ROUTING:
                stats = hedger.statistics()
                delays = ", ".join(
                    f"class {d.size_class}: {d.delay:.3f} s{'' if d.learned else ' (model)'}"
                    for d in stats.delays
                )
                extra = f"; delays {delays}" + extra
            console.print(
                f"  {name}: {time.monotonic() - began:.0f} s, P99 {row.ttft[2]:.3f} s, "
                f"extra {row.extra:.1f}%, load {row.load:.2f}{extra}"
                + (f"; fixed delay {p90:.3f} s" if name == FIXED and p90 is not None else "")
            )
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d = Params()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--replica", action="append", metavar="URL", help="use these servers")
    parser.add_argument("--model", default="tiny", help="the model name (with --replica)")
    parser.add_argument("--engine-home", type=Path, default=ENGINE_HOME)
    parser.add_argument("--requests", type=int, default=d.requests)
    parser.add_argument("--rate", type=float, default=d.rate)
    parser.add_argument("--long-fraction", type=float, default=d.long_fraction)
    parser.add_argument("--long-words", type=int, default=d.long_words)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--warmup", type=int, default=d.warmup)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--tenants", choices=("others", "self"), default=d.tenants)
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated, from {','.join(STRATEGIES)} (fixed needs none before it)",
    )
    parser.add_argument("--quick", action="store_true", help="40 requests, a smoke run")
    parser.add_argument(
        "--scenario",
        choices=("tail", "evidence", "busy", "cancel-cost"),
        default="tail",
        help="tail: issue 9's mixed schedule on llama-cpp-python (the default); evidence: "
        "issue 21's, other tenants' long prompts on the engines of ../shared/engine2 with "
        "probes and routers; busy: issue 27's, 240 short requests in 60 s beside the other "
        "tenant (several runs: --runs); cancel-cost: the prefill a cancelled request costs on "
        "llama-server, with and without a prober",
    )
    parser.add_argument(
        "--engine",
        choices=("auto", "cpp", "llama", "vllm"),
        default="auto",
        help="cpp: llama-cpp-python (../shared/engine); llama: llama-server -np 4, vllm: vLLM "
        "CPU (../shared/engine2). auto: cpp for tail, llama for evidence",
    )
    parser.add_argument("--pattern", choices=("alternate", "one"), default="alternate")
    parser.add_argument("--long-every", type=float, default=None, metavar="SECONDS")
    parser.add_argument("--own-long", type=int, default=Evidence().own_long)
    parser.add_argument("--warm-from", type=int, default=Evidence().warm_from)
    parser.add_argument(
        "--show-slower-than",
        type=float,
        default=None,
        metavar="SECONDS",
        help="print every long prompt, every hedged request and every request slower than "
        "SECONDS, with its attempts",
    )
    parser.add_argument("--runs", type=int, default=3, help="busy: runs (seeds seed, seed+1...)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    parser.add_argument(
        "--samples",
        type=Path,
        default=Path(__file__).parent / "out" / "real_engine_samples.jsonl",
        help="where the Hedger row's TTFT samples go (JSON lines, for trio-hedge tune)",
    )
    return parser.parse_args(argv)


def main_evidence(args: argparse.Namespace, console: Console) -> int:
    """``--scenario evidence`` (issue 21)."""
    from _engines import Engine, detect, missing, started

    kind = "llama" if args.engine == "auto" else args.engine
    words, every = EVIDENCE_DEFAULTS[kind]
    long_words = words if args.long_words == Params().long_words else args.long_words
    p = Params(
        requests=20
        if args.quick
        else (60 if args.requests == Params().requests else args.requests),
        rate=2.0 if args.rate == Params().rate else args.rate,
        long_fraction=0.0,
        long_words=long_words,
        max_tokens=args.max_tokens,
        warmup=0,
        seed=args.seed,
        tenants="others",
    )
    e = Evidence(
        pattern=args.pattern,
        every=args.long_every or every,
        own_long=args.own_long,
        warm_from=min(args.warm_from, p.requests // 2),
    )
    keys = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if args.strategies == ",".join(STRATEGIES):
        keys = [k for k in EVIDENCE_STRATEGIES if k != "probes-priority" or kind == "vllm"]
    unknown = [k for k in keys if k not in EVIDENCE_STRATEGIES]
    if unknown:
        console.print(f"unknown strategies {unknown}; choose from {list(EVIDENCE_STRATEGIES)}")
        return 2
    names = [EVIDENCE_STRATEGIES[k] for k in keys]
    if kind == "vllm" and args.replica is None:
        # /load: the requests vLLM's HTTP front holds, counted as they arrive (a probe reads
        # them with LoadProbe(load_path="/load")).
        os.environ.setdefault("EXTRA_ARGS", "--enable-server-load-tracking")
    if PROBES_PRIORITY in names and kind == "vllm" and args.replica is None:
        # vLLM refuses a priority unless it schedules by priority; with every priority 0 the
        # policy serves in arrival order, as FCFS does, so the other rows are unchanged.
        os.environ.setdefault("POLICY", "priority")
    console.print(
        f"parameters: {attrs.asdict(p)}, {attrs.asdict(e)}; load average {os.getloadavg()}, "
        f"nproc {os.cpu_count()}"
    )
    run = functools.partial(
        run_evidence, p=p, e=e, model=args.model, names=names, console=console, out=args.out,
        verbose=args.show_slower_than,
    )  # fmt: skip
    label = {"llama": "llama-server -np 4", "vllm": "vLLM CPU", "cpp": "llama-cpp-python"}
    if args.replica:
        if len(args.replica) != 2:
            console.print("give --replica exactly twice (two replicas)")
            return 2
        engine = Engine(detect(args.replica), args.replica)
        rows = trio.run(functools.partial(run, engine))
    elif kind == "cpp":
        paths = engine_paths(args.engine_home)
        if paths is None:
            console.print(f"SKIP: no llama-cpp-python engine in {args.engine_home} (bash "
                          "../shared/engine/setup.sh), and no --replica URL given.")  # fmt: skip
            return 0
        with llama_replicas(*paths, args.out / "real_engine_logs") as servers:
            engine = Engine("cpp", [u for u, _ in servers], [pid for _, pid in servers])
            rows = trio.run(functools.partial(run, engine))
    else:
        why = missing(kind)
        if why is not None:
            console.print(f"SKIP: {why}, and no --replica URL given: nothing to measure.")
            return 0
        with started(kind, console) as engine:
            rows = trio.run(functools.partial(run, engine))
    print_evidence(console, rows, p, e, label.get(engine.kind, engine.kind))
    ok = check_evidence(console, rows, engine.kind)
    if args.quick:
        console.print("(--quick: 20 requests; targets are indicative only)")
    return 0 if ok or args.quick else 1


#: ``--scenario busy``'s strategies: the defaults, their control for the slowness rule, the
#: engine evidence, double send, and the routers people deploy.
BUSY_STRATEGIES = ("hedger", "hedger-noslow", "probes", "double", "smg")


def main_busy(args: argparse.Namespace, console: Console) -> int:
    """``--scenario busy`` (issue 27): on two llama-server ``-np 4`` replicas another
    tenant's 4,000-word prompts alternate between them (every 6 s) while the library sends
    240 short streaming requests in 60 s (4/s), several runs (one request decides a P99 of
    240). The targets: the defaults' P99 <= 1.0 s in every run, and no ejection of a replica
    that never failed (on c6222d8 the run rule for slowness ejected one 3 and 4 times, then
    refused 88 and 72 hedges for want of a replica: P99 6.78 and 4.43 s)."""
    from _engines import Engine, detect, missing, started

    kind = "llama" if args.engine == "auto" else args.engine
    words, every = EVIDENCE_DEFAULTS[kind]
    quick = args.quick
    p = Params(
        requests=24 if quick else (240 if args.requests == Params().requests else args.requests),
        rate=4.0 if args.rate == Params().rate else args.rate,
        long_fraction=0.0,
        long_words=words,
        max_tokens=args.max_tokens,
        warmup=0,
        seed=args.seed,
        tenants="others",
    )
    e = Evidence(pattern=args.pattern, every=args.long_every or every, own_long=0, warm_from=40)
    keys = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if args.strategies == ",".join(STRATEGIES):
        keys = list(BUSY_STRATEGIES)
    names = [EVIDENCE_STRATEGIES[k] for k in keys]
    console.print(
        f"parameters: {attrs.asdict(p)}, {attrs.asdict(e)}, runs {args.runs}; load average "
        f"{os.getloadavg()}, nproc {os.cpu_count()}"
    )
    runs = 1 if quick else args.runs
    every_run: list[list[EvidenceRow]] = []

    def measure(engine: Any) -> None:
        for k in range(runs):
            q = attrs.evolve(p, seed=p.seed + k)
            console.print(f"run {k + 1} of {runs} (seed {q.seed})")
            every_run.append(trio.run(functools.partial(
                run_evidence, engine, q, e, args.model, names, console, args.out,
                args.show_slower_than,
            )))  # fmt: skip

    if args.replica:
        if len(args.replica) != 2:
            console.print("give --replica exactly twice (two replicas)")
            return 2
        measure(Engine(detect(args.replica), args.replica))
    else:
        why = missing(kind)
        if why is not None:
            console.print(f"SKIP: {why}, and no --replica URL given: nothing to measure.")
            return 0
        with started(kind, console) as engine:
            measure(engine)
    table = Table(
        title=f"Short-request TTFT on two {kind} replicas beside another tenant: {p.requests} "
        f"short requests at {p.rate:g}/s, the tenant's {words}-word prompts every {e.every:g} s "
        "alternating; each run cold"
    )
    table.add_column("strategy")
    table.add_column("run")
    table.add_column("P50 / P99 / max (s)", justify="right")
    table.add_column("extra req", justify="right")
    table.add_column("ejections (failures)", justify="right")
    table.add_column("hedges refused: no replica", justify="right")
    table.add_column("tenant TTFT P50 / max", justify="right")
    table.add_column("delays (s)", justify="right")
    table.add_column("load", justify="right")
    for k, rows in enumerate(every_run):
        for er in rows:
            r = er.row
            table.add_row(
                r.name + (f" ({r.errors} errors)" if r.errors else ""),
                str(k + 1),
                " / ".join(f"{v:.3f}" for v in (r.ttft[0], r.ttft[2], r.ttft[3])),
                f"{r.extra:.1f}%",
                er.ejections or "-",
                str(er.no_replica),
                f"{er.tenant[0]:.2f} / {er.tenant[1]:.2f}",
                er.delays or "-",
                f"{r.load:.2f}",
            )
    console.print(table)
    ok = True
    for k, rows in enumerate(every_run):
        by = {er.row.name: er for er in rows}
        if HEDGER not in by:
            continue
        ours = by[HEDGER]
        for text, good in (
            (f"run {k + 1}: the defaults' P99 <= 1.0 s ({ours.row.ttft[2]:.3f} s)",
             ours.row.ttft[2] <= 1.0),
            (f"run {k + 1}: no replica that never failed ejected ({ours.healthy_ejected})",
             ours.healthy_ejected == 0),
        ):  # fmt: skip
            console.print(f"[{'green' if good else 'red'}]{'PASS' if good else 'FAIL'}[/] {text}")
            ok = ok and good
    if quick:
        console.print("(--quick: 24 requests, one run; targets are indicative only)")
    return 0 if ok or quick else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.scenario != "tail":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        run = {"evidence": main_evidence, "busy": main_busy}.get(args.scenario, main_cancel_cost)
        return run(args, Console(width=220))
    # A kill (SIGTERM) unwinds like Ctrl-C, so the servers this started are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    console = Console(width=160)
    p = Params(
        requests=40 if args.quick else args.requests,
        rate=args.rate,
        long_fraction=args.long_fraction,
        long_words=args.long_words,
        max_tokens=args.max_tokens,
        warmup=25 if args.quick else args.warmup,
        seed=args.seed,
        tenants=args.tenants,
    )
    keys = [n.strip() for n in args.strategies.split(",") if n.strip()]
    unknown = [k for k in keys if k not in STRATEGIES]
    if unknown:
        console.print(f"unknown strategies {unknown}; choose from {list(STRATEGIES)}")
        return 2
    names = [STRATEGIES[k] for k in keys]
    console.print(
        f"parameters: {attrs.asdict(p)}; load average {os.getloadavg()}, nproc {os.cpu_count()}"
    )
    if args.replica:
        if len(args.replica) != 2:
            console.print("give --replica exactly twice (two replicas)")
            return 2
        rows = trio.run(
            run_all, p, args.replica, [], args.model, names, console, args.show_slower_than,
            args.samples,
        )  # fmt: skip
    else:
        engine = engine_paths(args.engine_home)
        if engine is None:
            console.print(
                f"SKIP: no llama.cpp engine in {args.engine_home} (build it with "
                "`bash ../shared/engine/setup.sh`, ~17 minutes once per machine), and no "
                "--replica URL given: nothing to measure."
            )
            return 0
        with llama_replicas(*engine, args.out / "real_engine_logs") as servers:
            urls = [u for u, _ in servers]
            pids = [pid for _, pid in servers]
            rows = trio.run(
                run_all, p, urls, pids, "tiny", names, console, args.show_slower_than,
                args.samples,
            )  # fmt: skip
    print_table(console, rows, p)
    ok = check_targets(console, rows)
    if args.quick:
        console.print("(--quick: 40 requests; targets are indicative only)")
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
