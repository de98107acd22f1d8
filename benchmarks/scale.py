"""Many concurrent hedged streams in one process: open time, memory, added latency, leaks.

Two fake replicas (``trio_hedge.testing.FakeReplica``, HTTP/1.1) run **in the same process
and Trio run** as the client, so their ``RequestRecord`` times share the caller's clock (their
CPU is counted too, equally for every variant). ``--streams`` requests (default 1,000) start at
once; each holds its stream open until all have committed, then reads it to the end:

* 85% normal: the primary answers (server TTFT 10 ms, 4 tokens 10 ms apart);
* 10% hedged: the primary is slow to first token (5 s), ``hedge_after`` 50 ms, the backup
  answers (other requests use ``hedge_after`` 30 s, so the burst itself does not hedge);
* 5% failing: the primary answers 503, the backup answers at once (failover).

Variants, interleaved, ``--repeat`` times, each for two waves on the same client (wave 1: cold
pool; wave 2: the pool holds wave 1's idle keep-alive connections):

* ``raw sockets``: ``trio.open_tcp_stream`` + a hand-written request, read until the first
  token (all normal requests): the floor;
* ``httpx only, make_client()``: plain ``client.stream`` + ``aiter_lines`` through
  ``make_client()``, no trio_hedge (all normal requests): what httpx itself costs;
* ``make_client(), same requests``: ``hedged_stream`` through ``make_client()`` doing the
  requests plain httpx does (all normal: nothing hedged, nothing failing), the control that
  isolates the library's own cost;
* ``one httpx pool``: ``hedged_stream`` through one ``httpx.AsyncClient`` with unlimited
  ``Limits`` (httpx's default ``max_connections=100`` would make the 101st held stream wait
  forever); its wave 2 is skipped unless ``--one-pool-waves 2`` (it is quadratic in idle
  connections: minutes at 1,000);
* ``make_client()``: ``hedged_stream`` through ``trio_hedge.transport.make_client()``.

Figures: time to open all (last commit − start), CPU seconds for it, P50/P99 latency added by
the client (caller-visible TTFT − the winner's server TTFT − the winner's start offset, i.e. the
hedge delay or failover wait; for raw sockets: time to first token − server TTFT), memory per
open stream (at "all committed", each variant in a fresh subprocess: the RSS delta of a
wave of ``--streams``, then the tracemalloc total of a wave of at most 250), and what is
left after the client closes (server-side connections, file descriptors, Trio tasks: must
all be 0).

Then, with the replica in its own process (``trio-hedge fake``; 10,000 streams need as many
sockets on each side), the client CPU per stream at ``--scaling SMALL,LARGE`` streams (default
1,000 and 10,000) for plain httpx and ``hedged_stream``, all started at once.

Targets (issue 12): 1,000 hedged streams open in <= 1.3x the time plain httpx takes for the
same requests through the same client; the cost per stream flat from 1,000 to 10,000 streams
(CPU per stream at 10,000 <= 1.3x that at 1,000). With CPython's default garbage-collector
thresholds the cost per stream grows for plain httpx too (every collection of the older
generations walks all live objects); the check is run with the default (the library must add
no growth of its own) and with gen 0 at 100,000 (as `trio-hedge serve` sets it).

Run: ``python benchmarks/scale.py`` (``--quick``: 100 streams, 1 repetition, scaling 100 and
1,000).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import attrs
import httpx
import trio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, open_fds, percentile, rss_bytes, verdict

import trio_hedge as th
from trio_hedge.testing import Behaviour, FakeReplica, RequestRecord
from trio_hedge.transport import make_client

NORMAL = Behaviour(ttft=0.01, token_delay=0.01, tokens=4)
SLOW = Behaviour(ttft=5.0, token_delay=0.01, tokens=4)
FAIL = Behaviour(status=503)
HEDGE_AFTER = 0.05
NO_HEDGE_AFTER = 30.0
SAME = "make_client(), same requests"
VARIANTS = (
    "raw sockets",
    "httpx only, make_client()",
    SAME,
    "one httpx pool",
    "make_client()",
)
#: tracemalloc slows a run ~5x: it measures this many streams (memory per stream is flat).
MEMORY_TRACED_STREAMS = 250


def choose(record: RequestRecord) -> Behaviour:
    """The replicas' behaviour: the request's class is in the body's ``user`` field."""
    kind = record.json.get("user") if isinstance(record.json, dict) else None
    primary = record.headers.get("x-hedge-attempt", "1") == "1"
    if primary and kind == "slow":
        return SLOW
    if primary and kind == "fail":
        return FAIL
    return NORMAL


def kinds(n: int, seed: int = 1) -> list[str]:
    out = ["slow"] * (n // 10) + ["fail"] * (n // 20)
    out += ["ok"] * (n - len(out))
    random.Random(seed).shuffle(out)
    return out


@attrs.define
class Wave:
    open_s: float = 0.0
    open_cpu: float = 0.0
    added: list[float] = attrs.field(factory=list)
    hedged_won: int = 0
    failovers: int = 0
    rss_per_stream: float = 0.0
    traced_per_stream: float = 0.0


def _count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return walk(root)


def _server_ttft(record: RequestRecord) -> float:
    assert record.first_token_at is not None
    return record.first_token_at - record.received_at


class _Gate:
    """Counts commits; opens when all ``n`` have committed and notes the time."""

    def __init__(self, n: int, memory: bool) -> None:
        self.n = n
        self.count = 0
        self.event = trio.Event()
        self.t0 = trio.current_time()
        self.cpu0 = time.process_time()
        self.memory = memory
        self.rss0 = rss_bytes() if memory else 0
        self.wave = Wave()

    def committed(self) -> None:
        self.count += 1
        if self.count == self.n:
            w = self.wave
            w.open_s = trio.current_time() - self.t0
            w.open_cpu = time.process_time() - self.cpu0
            if self.memory:
                w.rss_per_stream = (rss_bytes() - self.rss0) / self.n
                if tracemalloc.is_tracing():
                    w.traced_per_stream = tracemalloc.get_traced_memory()[0] / self.n
            self.event.set()


async def _raw_wave(replica: FakeReplica, n: int, memory: bool) -> Wave:
    gate = _Gate(n, memory)
    starts: dict[str, float] = {}
    firsts: dict[str, float] = {}

    async def one(i: int) -> None:
        rid = f"raw-{i}-{random.random()}"
        body = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"content-type: application/json\r\nx-request-id: {rid}\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        starts[rid] = trio.current_time()
        stream = await trio.open_tcp_stream("127.0.0.1", replica.port)
        async with stream:
            await stream.send_all(head + body)
            buf = b""
            while b'"content":"' not in buf:
                more = await stream.receive_some(65536)
                if not more:
                    raise RuntimeError("raw: the server closed early")
                buf += more
            firsts[rid] = trio.current_time()
            gate.committed()
            await gate.event.wait()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    for record in replica.requests[-n:]:
        rid = record.headers["x-request-id"]
        gate.wave.added.append(firsts[rid] - starts[rid] - _server_ttft(record))
    return gate.wave


async def _httpx_wave(
    client: httpx.AsyncClient, replica: FakeReplica, n: int, memory: bool
) -> Wave:
    """Plain httpx streams (no trio_hedge), all normal: what httpx itself costs."""
    gate = _Gate(n, memory)
    starts: dict[str, float] = {}
    firsts: dict[str, float] = {}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def one(i: int) -> None:
        rid = f"httpx-{i}-{random.random()}"
        starts[rid] = trio.current_time()
        headers = {"x-request-id": rid}
        async with client.stream(
            "POST", replica.url + "/chat/completions", json=body, headers=headers
        ) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if '"content":"' in line:
                    break
            firsts[rid] = trio.current_time()
            gate.committed()
            await gate.event.wait()
            async for _ in lines:
                pass

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    for record in replica.requests[-n:]:
        rid = record.headers["x-request-id"]
        gate.wave.added.append(firsts[rid] - starts[rid] - _server_ttft(record))
    return gate.wave


async def _hedged_wave(
    client: httpx.AsyncClient,
    replicas: list[FakeReplica],
    n: int,
    memory: bool,
    mixed: bool = True,
) -> Wave:
    gate = _Gate(n, memory)
    pair = [th.Replica(replicas[0].url, name="a"), th.Replica(replicas[1].url, name="b")]
    reports: dict[str, th.Report] = {}
    slow = th.HedgePolicy(hedge_after=HEDGE_AFTER)
    other = th.HedgePolicy(hedge_after=NO_HEDGE_AFTER)

    async def one(kind: str) -> None:
        request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": kind}
        stream = th.hedged_stream(request, pair, slow if kind == "slow" else other, client=client)
        async with stream:
            gate.committed()
            await gate.event.wait()
            text = "".join([t async for t in stream])
        if text != "tok0 tok1 tok2 tok3 ":
            raise AssertionError(f"wrong text {text!r}")
        reports[stream.request_id] = stream.report

    async with trio.open_nursery() as nursery:
        for kind in kinds(n) if mixed else ["ok"] * n:
            nursery.start_soon(one, kind)
    records = {
        (r.headers["x-request-id"], r.headers["x-hedge-attempt"]): r
        for replica in replicas
        for r in replica.requests
        if "x-request-id" in r.headers
    }
    for rid, report in reports.items():
        assert report.winner is not None and report.ttft is not None
        winner = next(a for a in report.attempts if a.number == report.winner)
        assert winner.started_at is not None
        record = records[(rid, str(report.winner))]
        gate.wave.added.append(report.ttft - _server_ttft(record) - winner.started_at)
        gate.wave.hedged_won += winner.trigger == "hedge"
        gate.wave.failovers += winner.trigger == "failover"
    return gate.wave


def _one_pool_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
    )


async def run_variant(variant: str, n: int, waves: int, memory: bool = False) -> list[Wave]:
    """Run ``waves`` waves of one variant against fresh replicas; check for leaks."""
    fds0 = open_fds()
    tasks0 = _count_tasks()
    out: list[Wave] = []
    async with FakeReplica(choose, name="a") as a, FakeReplica(choose, name="b") as b:
        if variant == "raw sockets":
            for _ in range(waves):
                out.append(await _raw_wave(a, n, memory))
        elif variant == "httpx only, make_client()":
            async with make_client() as client:
                for _ in range(waves):
                    out.append(await _httpx_wave(client, a, n, memory))
        else:
            client = _one_pool_client() if variant == "one httpx pool" else make_client()
            async with client:
                for _ in range(waves):
                    out.append(await _hedged_wave(client, [a, b], n, memory, variant != SAME))
        with trio.fail_after(10):
            await a.wait_connections(0)
            await b.wait_connections(0)
    leaks = {"fds": open_fds() - fds0, "tasks": _count_tasks() - tasks0}
    if any(leaks.values()):
        raise RuntimeError(f"{variant}: left behind {leaks}")
    return out


def _memory_child(variant: str, n: int) -> None:
    """In a fresh process: warm up, then measure one wave with RSS and tracemalloc."""

    async def main() -> None:
        await run_variant(variant, 20, 1)  # imports, caches, first connections
        gc.collect()
        (wave,) = await run_variant(variant, n, 1, memory=True)
        print(json.dumps({"rss": wave.rss_per_stream, "traced": 0.0}))
        tracemalloc.start()
        m = min(n, MEMORY_TRACED_STREAMS)
        (wave,) = await run_variant(variant, m, 1, memory=True)
        tracemalloc.stop()
        print(json.dumps({"traced": wave.traced_per_stream}))

    trio.run(main)


def _memory(variant: str, n: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", variant, "--streams", str(n)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    lines = out.strip().splitlines()
    rss: float = json.loads(lines[-2])["rss"]
    traced: float = json.loads(lines[-1])["traced"]
    return {"rss": rss, "traced": traced}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--one-pool-waves", type=int, default=1, choices=(1, 2))
    parser.add_argument("--quick", action="store_true", help="smoke check: 100 streams, 1 rep")
    parser.add_argument(
        "--scaling",
        default="1000,10000",
        metavar="SMALL,LARGE",
        help="cost per stream at these two sizes, the replica in its own process ('0,0': skip)",
    )
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        _memory_child(args.memory_child, args.streams)
        return 0
    if args.quick:
        args.streams, args.repeat, args.scaling = 100, 1, "100,1000"
    n = args.streams
    console = Console(width=150)
    console.print(
        f"scale: streams={n:,} (10% hedged after {HEDGE_AFTER * 1000:.0f} ms, 5% 503 then "
        f"failover) repeat={args.repeat} servers=in-process FakeReplica x2 (HTTP/1.1) "
        f"nproc={os.cpu_count()} httpx={httpx.__version__} trio={trio.__version__}"
    )
    waves_of = {v: (args.one_pool_waves if v == "one httpx pool" else 2) for v in VARIANTS}
    results: dict[str, list[list[Wave]]] = {v: [] for v in VARIANTS}
    trio.run(run_variant, "make_client()", 20, 1)  # warm-up
    for _ in range(args.repeat):
        for variant in VARIANTS:
            results[variant].append(trio.run(run_variant, variant, n, waves_of[variant]))
    memory = {v: _memory(v, n) for v in VARIANTS}

    table = Table(title=f"{n:,} concurrent streams, median of {args.repeat}")
    columns = (
        "variant",
        "wave",
        "open all (s)",
        "CPU (s)",
        "× raw",
        "added P50 (ms)",
        "added P99 (ms)",
        "RSS/stream (KiB)",
        "traced/stream (KiB)",
    )
    for c in columns:
        table.add_column(c, justify="left" if c in ("variant",) else "right")
    open_time: dict[tuple[str, int], float] = {}
    for variant in VARIANTS:
        for w in range(waves_of[variant]):
            waves = [rep[w] for rep in results[variant]]
            open_time[variant, w] = median([x.open_s for x in waves])
            added = [a for x in waves for a in x.added]
            mem = memory[variant] if w == 0 else None
            table.add_row(
                variant,
                str(w + 1),
                f"{open_time[variant, w]:.3f}",
                f"{median([x.open_cpu for x in waves]):.3f}",
                f"{open_time[variant, w] / open_time['raw sockets', w]:.2f}",
                f"{percentile(added, 50) * 1000:.1f}",
                f"{percentile(added, 99) * 1000:.1f}",
                f"{mem['rss'] / 1024:.1f}" if mem else "",
                f"{mem['traced'] / 1024:.1f}" if mem else "",
            )
    console.print(table)
    last = results["make_client()"][-1][0]
    console.print(
        f"make_client() wave 1: {last.hedged_won} won by a hedge, {last.failovers} by a "
        f"failover, out of {n}; leaks after every run: 0 server connections, 0 fds, 0 tasks"
    )
    for w in (0, 1):
        ratio = open_time[SAME, w] / open_time["httpx only, make_client()", w]
        console.print(
            verdict(
                ratio <= 1.3,
                f"hedged_stream, same requests, wave {w + 1}: open all in {ratio:.2f}x plain "
                "httpx's time through the same client (<= 1.3x)",
            )
        )
    for w in (0, 1):
        ratio = open_time["make_client()", w] / open_time["httpx only, make_client()", w]
        raw = open_time["make_client()", w] / open_time["raw sockets", w]
        console.print(
            f"info: mixed workload (15% more requests: hedges, failovers) wave {w + 1}: "
            f"{ratio:.2f}x plain httpx, {raw:.2f}x raw sockets"
        )
    ratio = open_time["one httpx pool", 0] / open_time["raw sockets", 0]
    console.print(f"info: one httpx pool wave 1: {ratio:.2f}x the raw-socket time")
    console.print(verdict(True, "no sockets, fds or tasks left after any run"))
    small, large = (int(x) for x in args.scaling.split(","))
    if large:
        _scaling(console, small, large)
    return 0


# -- cost per stream from 1,000 to 10,000 streams ----------------------------------------------


async def _scaling_wave(url: str, n: int, hedged: bool) -> tuple[float, float]:
    """``n`` streams at once through one make_client(), each held open until all have their
    first token, then read to the end; (seconds to open all, client CPU seconds for it)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    pair = [th.Replica(url, name="a"), th.Replica(url, name="b")]
    policy = th.HedgePolicy(hedge_after=NO_HEDGE_AFTER)
    async with make_client() as client:
        gate = _Gate(n, False)

        async def one() -> None:
            if hedged:
                stream = th.hedged_stream(body, pair, policy, client=client)
                async with stream:
                    gate.committed()
                    await gate.event.wait()
                    text = "".join([t async for t in stream])
            else:
                text = ""
                async with client.stream("POST", url + "/chat/completions", json=body) as r:
                    lines = r.aiter_lines()
                    async for line in lines:
                        if '"content":"' in line:
                            break
                    gate.committed()
                    await gate.event.wait()
                    async for _ in lines:
                        pass
                    text = "tok0 tok1 tok2 tok3 "
            if text != "tok0 tok1 tok2 tok3 ":
                raise AssertionError(f"wrong text {text!r}")

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
    return gate.wave.open_s, gate.wave.open_cpu


#: CPython's gen-0 collection threshold that `trio-hedge serve` sets (its --gc-threshold).
TUNED_GC = 100_000


def _scaling(console: Console, small: int, large: int) -> None:
    """The replica in its own process (``trio-hedge fake``): ``large`` streams need as many
    sockets on each side, more than one process may open here. Run with CPython's default
    garbage-collector thresholds and with gen 0 at :data:`TUNED_GC`: each collection of the
    older generations walks every live object, so with thousands of streams alive the default
    collector costs more per stream the more streams there are (plain httpx alike)."""
    command = [sys.executable, "-m", "trio_hedge", "fake", "--port", "0", "--ttft", "0.01"]
    command += ["--tpot", "0.01", "--tokens", "4", "--quiet"]
    fake = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    default = gc.get_threshold()
    tuned = f"gen0 {TUNED_GC:,}"
    try:
        assert fake.stdout is not None
        url = fake.stdout.readline().split("listening on ")[1].strip()
        table = Table(title=f"cost per stream, {small:,} vs {large:,} streams at once")
        columns = ("variant", "GC", "streams", "open all (s)", "per stream (ms)", "CPU/stream (ms)")
        for c in columns:
            table.add_column(c, justify="left" if c in ("variant", "GC") else "right")
        per: dict[tuple[str, str, int], float] = {}
        for label in ("default", tuned):
            if label == tuned:
                gc.set_threshold(TUNED_GC, default[1], default[2])
            for hedged, name in ((False, "httpx only"), (True, "hedged_stream")):
                trio.run(_scaling_wave, url, 50, hedged)  # warm-up
                for n in (small, large):
                    gc.collect()
                    seconds, cpu = trio.run(_scaling_wave, url, n, hedged)
                    per[name, label, n] = cpu / n
                    table.add_row(
                        name, label, f"{n:,}", f"{seconds:.2f}", f"{seconds / n * 1e3:.3f}",
                        f"{cpu / n * 1e3:.3f}",
                    )  # fmt: skip
        console.print(table)
        for label in ("default", tuned):
            growth = {
                name: per[name, label, large] / per[name, label, small]
                for name in ("httpx only", "hedged_stream")
            }
            text = (
                f"GC {label}: CPU per stream at {large:,} = {growth['hedged_stream']:.2f}x that "
                f"at {small:,} for hedged_stream, {growth['httpx only']:.2f}x for plain httpx"
            )
            if label == "default":
                relative = growth["hedged_stream"] / growth["httpx only"]
                console.print(verdict(relative <= 1.15, f"{text}: no growth of the library's own"))
            else:
                console.print(verdict(growth["hedged_stream"] <= 1.3, f"{text} (flat: <= 1.3x)"))
    finally:
        gc.set_threshold(*default)
        fake.terminate()
        fake.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
