"""Many tenants, one fleet: does a key flooding the gateway leave another key's TTFT alone?

The fleet has a fixed service rate. One fake replica (``_common.py``'s server, in a process
of its own) answers every request after ``--ttft`` seconds (its prefill), then a mean of
``--tokens`` tokens a mean ``--pace`` ms apart (drawn per request from [1, 2 × tokens - 1]
and [0, 2 × pace]: answers differ in length, and with every request taking exactly as long
the slots would free in lock-step); the gateway, in a process of its own as in production,
runs ``--slots`` requests at once (its ``max_concurrent``): ``slots / (ttft + tokens × pace)``
requests per second, no more. Two gateway keys send the same requests (the same prompt, the
same answer lengths on average), with the official openai SDK (``AsyncOpenAI``, its default
retries on):

* **light**: Poisson arrivals at ``--light-rate`` requests per second;
* **heavy**: Poisson arrivals at ``--ratio`` times that, 10× the light key's tokens, which
  with the light key's is more than the fleet serves: a queue builds.

The light key's TTFT is measured at the client (call to response head, the SDK's retries
included: the gateway answers at the first token, so the queue wait is in it), alone and
with the flood, under:

* **token-fair queue** (the gateway's default: the waiting request whose key received the
  fewest weighted tokens goes first, VTC);
* **first come, first served** (the same queue in arrival order: the control that isolates
  the order);
* **per-key limit** (what LiteLLM-style routers deploy: the heavy key may hold at most
  ``slots - --reserve`` slots, the rest kept for others; arrival order);
* **no queue** (the gateway before issue 30: 503 past ``max_concurrent``; the SDK retries
  it after its Retry-After).

A fair queue cannot do better than the next slot to free: with the fleet saturated, slots
free about every ``1 / rate`` seconds, at random, so the light key's P99 wait is about
``ln(100) / rate`` (0.23 s at 20 requests per second, against a 2 s prefill). What the flood
costs the heavy key is its served requests per second (completions inside the measured
window) against what the fleet serves it alone, less what the light key takes:
work-conserving means it gets all of the spare capacity.

Several runs, each with its own seeded arrivals shared by every scenario (paired), because one
request decides a P99 of a hundred; the P99 pooled over the runs too. ``--virtual`` runs the
same gateway queue (``Limiter``: the same code) in virtual time, without HTTP, over many more
requests: the policy's own figures, free of this machine's scheduling noise.

Run: ``python benchmarks/fairness.py`` (``--quick``: a smoke run; ``--help`` for flags).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import openai
import trio
import trio.testing
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

import trio_hedge as th
from trio_hedge.gateway import GatewayConfig, GatewayKey, Group, Limits, serve
from trio_hedge.gateway import _limits as limits_module
from trio_hedge.gateway._forward import prompt_estimate
from trio_hedge.gateway._limits import Limiter, Refused
from trio_hedge.gateway._queue import Capacity

LIGHT = GatewayKey("sk-bench-light-0123456789", "light")
HEAVY = GatewayKey("sk-bench-heavy-0123456789", "heavy")
#: Every request: the same prompt; answers of the same lengths on average.
PROMPT = "Summarise the quarterly report in three bullet points, please. " * 4
MESSAGES = [{"role": "user", "content": PROMPT}]


@attrs.frozen
class Scenario:
    name: str
    heavy: bool = True
    light: bool = True
    fair: bool = True
    max_queue: int = 256
    heavy_slots: int | None = None  # the heavy key's own max_concurrent


SCENARIOS = [
    Scenario("light alone", heavy=False),
    Scenario("heavy alone", light=False),
    Scenario("token-fair queue (default)"),
    Scenario("first come, first served (control)", fair=False),
    Scenario("per-key limit (heavy <= slots - reserve)", fair=False),
    Scenario("no queue: 503 past max_concurrent", max_queue=0),
]


@attrs.define
class Outcome:
    light_ttfts: list[float] = attrs.Factory(list)
    light_done: list[float] = attrs.Factory(list)
    light_refused: int = 0
    light_sent: int = 0
    heavy_served: int = 0
    heavy_refused: int = 0
    heavy_ttfts: list[float] = attrs.Factory(list)
    warmup: float = 0.0
    end: float = 0.0

    @property
    def seconds(self) -> float:
        """The measured window's length."""
        return self.end - self.warmup

    @property
    def heavy_rate(self) -> float:
        return self.heavy_served / self.seconds if self.seconds else 0.0

    @property
    def light_rate(self) -> float:
        """The light key's completions per second inside the measured window."""
        window = [d for d in self.light_done if self.warmup <= d < self.end]
        return len(window) / self.seconds if self.seconds else 0.0


@attrs.frozen
class Traffic:
    """One run's requests: (arrival, key, tokens, pace ms) in arrival order."""

    requests: tuple[tuple[float, GatewayKey, int, float], ...]

    @classmethod
    def draw(cls, args: argparse.Namespace, seed: int) -> Traffic:
        rng = random.Random(seed)
        out = []
        for key, rate in ((LIGHT, args.light_rate), (HEAVY, args.light_rate * args.ratio)):
            at = rng.expovariate(rate)
            while at < args.seconds:
                tokens = rng.randint(1, 2 * args.tokens - 1)
                out.append((at, key, tokens, rng.uniform(0, 2 * args.pace)))
                at += rng.expovariate(rate)
        return cls(tuple(sorted(out, key=lambda r: r[0])))


def _recorder(
    scenario: Scenario, out: Outcome, start: float
) -> Callable[[GatewayKey, float, int, float, float], None]:
    """What each request's end adds to ``out``: ``(key, arrival, status, ttft, now)``."""

    def record(key: GatewayKey, at: float, status: int, ttft: float, now: float) -> None:
        done = now - start
        if key is LIGHT:
            if at < out.warmup:
                return
            out.light_sent += 1
            if status == 200:
                out.light_ttfts.append(ttft)
                out.light_done.append(done)
            else:
                out.light_refused += 1
            return
        if status == 200 and out.warmup <= done < out.end:
            out.heavy_served += 1
        if at >= out.warmup:
            if status == 200:
                out.heavy_ttfts.append(ttft)
            else:
                out.heavy_refused += 1

    return record


@contextmanager
def patched_order(fair: bool) -> Iterator[None]:
    """The gateway's queue in token-fair order (its default) or in arrival order (the
    control), by the queue's own switch (``Capacity.fair``)."""
    original = limits_module.Capacity
    limits_module.Capacity = functools.partial(Capacity, fair=fair)  # type: ignore[misc]
    try:
        yield
    finally:
        limits_module.Capacity = original  # type: ignore[misc]


def gateway_config(spec: dict[str, Any]) -> GatewayConfig:
    replica = th.Replica(spec["url"], name="fleet")
    hedger = th.HedgerConfig(
        hedge_after=None,  # one replica: the queue, not hedging, is measured
        first_token=th.events.FirstToken.ANY_OUTPUT,
        budget=None,
        throttle=None,
        outlier_detection=None,
        max_recoveries=0,
    )
    heavy = attrs.evolve(HEAVY, max_concurrent=spec["heavy_slots"])
    return GatewayConfig(
        [replica],
        [Group("fleet", ["fleet"], hedger=hedger)],
        port=0,
        keys=(LIGHT, heavy),
        limits=Limits(
            max_concurrent=spec["slots"],
            max_queue=spec["max_queue"],
            queue_wait=spec["queue_wait"],
            drain_timeout=1.0,
        ),
    )


def _spec(scenario: Scenario, args: argparse.Namespace, port: int) -> dict[str, Any]:
    return {
        "url": f"http://127.0.0.1:{port}/d{round(args.ttft * 1000)}/v1",
        "heavy_slots": scenario.heavy_slots,
        "slots": args.slots,
        "max_queue": scenario.max_queue,
        "queue_wait": args.queue_wait,
        "fair": scenario.fair,
    }


# -- over real sockets -------------------------------------------------------------------------


def run_gateway(spec: dict[str, Any]) -> None:
    """The gateway process: prints its port, serves until SIGINT/SIGTERM."""
    config = gateway_config(spec)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            (base,) = await nursery.start(functools.partial(serve, config, handle_signals=True))
            print(base.rsplit(":", 1)[1], flush=True)

    with patched_order(spec["fair"]):
        trio.run(main)


@contextmanager
def gateway_process(spec: dict[str, Any]) -> Iterator[int]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--gateway", json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline())
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def drive(
    scenario: Scenario, args: argparse.Namespace, port: int, traffic: Traffic
) -> Outcome:
    """Send the scenario's share of ``traffic`` with the openai SDK; what each key got."""
    out = Outcome(warmup=args.warmup, end=args.seconds)
    start = trio.current_time()
    record = _recorder(scenario, out, start)
    clients = {
        key.name: openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=key.key, timeout=120.0
        )
        for key in (LIGHT, HEAVY)
    }

    async def one(at: float, key: GatewayKey, tokens: int, pace: float) -> None:
        await trio.sleep_until(start + at)
        sent = trio.current_time()
        create = clients[key.name].chat.completions.with_streaming_response.create
        try:
            async with create(
                model="m",
                messages=MESSAGES,  # type: ignore[arg-type]
                stream=True,
                max_tokens=tokens,
                extra_body={"x_pace_ms": round(pace, 3)},
            ) as response:
                ttft = trio.current_time() - sent  # the head comes at the first token
                async for _ in response.iter_bytes():
                    pass
            record(key, at, 200, ttft, trio.current_time())
        except openai.APIStatusError as error:
            record(key, at, error.status_code, math.nan, trio.current_time())
        except openai.APIError:
            record(key, at, 0, math.nan, trio.current_time())

    async with trio.open_nursery() as nursery:
        for at, key, tokens, pace in traffic.requests:
            if (key is LIGHT and scenario.light) or (key is HEAVY and scenario.heavy):
                nursery.start_soon(one, at, key, tokens, pace)
    for client in clients.values():
        await client.close()
    return out


def run_over_sockets(
    scenario: Scenario, args: argparse.Namespace, port: int, traffic: Traffic
) -> Outcome:
    with gateway_process(_spec(scenario, args, port)) as gateway:
        return trio.run(drive, scenario, args, gateway, traffic)


# -- in virtual time -----------------------------------------------------------------------------


async def simulate(scenario: Scenario, args: argparse.Namespace, traffic: Traffic) -> Outcome:
    """The gateway's own queue (``Limiter``, its ledger and its decisions) in virtual time:
    each admitted request holds its slot for its service time; a refused one is counted."""
    with patched_order(scenario.fair):
        limiter = Limiter(gateway_config(_spec(scenario, args, 1)))
    out = Outcome(warmup=args.warmup, end=args.seconds)
    start = trio.current_time()
    record = _recorder(scenario, out, start)
    prompt = prompt_estimate({"messages": MESSAGES}, 4.0)

    async def one(at: float, key: GatewayKey, tokens: int, pace: float) -> None:
        await trio.sleep_until(start + at)
        ticket = None
        try:
            ticket = limiter.enter(key.name, 0)
            await limiter.admit(ticket, "fleet", prompt, prompt + tokens)
        except Refused:
            record(key, at, 503, math.nan, trio.current_time())
            return
        finally:
            if ticket is not None and ticket.scope is None:
                await limiter.done(ticket)
        try:
            await trio.sleep(args.ttft)
            record(
                key,
                at,
                200,
                trio.current_time() - start - at,
                trio.current_time() + tokens * pace / 1000,
            )
            await trio.sleep(tokens * pace / 1000)
        finally:
            await limiter.done(ticket, served=True, prompt=prompt, completion=tokens)

    async with trio.open_nursery() as nursery:
        for at, key, tokens, pace in traffic.requests:
            if (key is LIGHT and scenario.light) or (key is HEAVY and scenario.heavy):
                nursery.start_soon(one, at, key, tokens, pace)
    return out


def run_in_virtual_time(
    scenario: Scenario, args: argparse.Namespace, port: int, traffic: Traffic
) -> Outcome:
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(simulate, scenario, args, traffic, clock=clock)


# -- the table ---------------------------------------------------------------------------------


def _p(values: Sequence[float], q: float) -> float:
    return _common.percentile(values, q) if values else math.nan


def report(
    console: Console,
    title: str,
    scenarios: Sequence[Scenario],
    results: dict[str, list[Outcome]],
) -> list[tuple[str, float, float]]:
    """Print the table; ``(run, light P99 / alone, heavy's share of the spare)`` of the
    token-fair queue, per run and pooled."""
    alone = results["light alone"]
    heavy_alone = results["heavy alone"]
    table = Table(title=title)
    for column in (
        "scenario",
        "run",
        "light P50",
        "light P99",
        "P99 / alone",
        "light refused",
        "heavy served/s",
        "of spare",
        "heavy refused",
        "heavy P50",
    ):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    verdicts = []
    for scenario in scenarios:
        runs = results[scenario.name]
        pooled = Outcome(
            light_ttfts=[t for o in runs for t in o.light_ttfts],
            light_refused=sum(o.light_refused for o in runs),
            light_sent=sum(o.light_sent for o in runs),
            heavy_ttfts=[t for o in runs for t in o.heavy_ttfts],
            heavy_refused=sum(o.heavy_refused for o in runs),
        )
        rows: list[tuple[str, Outcome, float, float]] = []
        for run, outcome in enumerate(runs):
            spare = heavy_alone[run].heavy_rate - outcome.light_rate
            share = outcome.heavy_rate / spare if scenario.heavy and spare > 0 else math.nan
            rows.append((str(run + 1), outcome, _p(alone[run].light_ttfts, 99), share))
        if len(runs) > 1:
            shares = [s for *_, s in rows if not math.isnan(s)]
            share = sum(shares) / len(shares) if shares else math.nan
            base = _p([t for o in alone for t in o.light_ttfts], 99)
            rows.append(("all", pooled, base, share))
        for name, outcome, base, share in rows:
            p99 = _p(outcome.light_ttfts, 99)
            sent = outcome.light_sent
            heavy_rate = (
                sum(o.heavy_rate for o in runs) / len(runs) if name == "all" else outcome.heavy_rate
            )
            table.add_row(
                scenario.name if name == "1" else "",
                name,
                f"{_p(outcome.light_ttfts, 50):.3f}" if scenario.light else "",
                f"{p99:.3f}" if scenario.light else "",
                f"{p99 / base:.2f}x" if scenario.light else "",
                f"{outcome.light_refused / sent:.0%}" if sent else "",
                f"{heavy_rate:.1f}" if scenario.heavy else "",
                f"{share:.0%}" if not math.isnan(share) else "",
                str(outcome.heavy_refused) if scenario.heavy else "",
                f"{_p(outcome.heavy_ttfts, 50):.3f}" if scenario.heavy else "",
            )
            if scenario.name.startswith("token-fair"):
                verdicts.append((name, p99 / base, share))
    console.print(table)
    return verdicts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=40.0, help="per scenario and run")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds not measured")
    parser.add_argument("--light-rate", type=float, default=2.5, help="requests per second")
    parser.add_argument("--ratio", type=float, default=10.0, help="heavy rate / light rate")
    parser.add_argument("--slots", type=int, default=44, help="the gateway's max_concurrent")
    parser.add_argument("--reserve", type=int, default=10, help="slots kept from the heavy key")
    parser.add_argument("--ttft", type=float, default=2.0, help="the replica's, seconds")
    parser.add_argument("--tokens", type=int, default=5, help="tokens an answer has, mean")
    parser.add_argument("--pace", type=float, default=40.0, help="ms between tokens, mean")
    parser.add_argument("--queue-wait", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--virtual", action="store_true", help="also in virtual time")
    parser.add_argument("--virtual-seconds", type=float, default=600.0)
    parser.add_argument("--quick", action="store_true", help="smoke run: one short run")
    parser.add_argument("--gateway", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gateway:
        run_gateway(json.loads(args.gateway))
        return 0
    if args.quick:
        args.runs, args.seconds, args.warmup, args.virtual_seconds = 1, 6.0, 2.0, 60.0
    console = Console(width=160)
    service = args.ttft + args.tokens * args.pace / 1000
    capacity = args.slots / service
    offered = args.light_rate * (1 + args.ratio)
    console.print(
        f"fleet: {args.slots} slots x {service:.2f} s a request = {capacity:.1f} requests/s; "
        f"offered: light {args.light_rate:g}/s + heavy {args.light_rate * args.ratio:g}/s = "
        f"{offered:g}/s ({offered / capacity:.0%} of the fleet); a fair queue's floor for the "
        f"light key's P99 wait: ln(100) / {capacity:.1f} = {math.log(100) / capacity:.3f} s"
    )
    scenarios = [
        attrs.evolve(s, heavy_slots=args.slots - args.reserve) if "per-key" in s.name else s
        for s in SCENARIOS
    ]
    verdicts = []
    if args.virtual:
        virtual = argparse.Namespace(**{**vars(args), "seconds": args.virtual_seconds})
        results: dict[str, list[Outcome]] = {s.name: [] for s in scenarios}
        for run in range(args.runs):
            traffic = Traffic.draw(virtual, args.seed + run)
            for scenario in scenarios:
                results[scenario.name].append(run_in_virtual_time(scenario, virtual, 0, traffic))
        title = (
            f"in virtual time: the gateway's queue alone, {args.runs} run(s) of "
            f"{args.virtual_seconds:g} s (light TTFT = queue wait + prefill)"
        )
        report(console, title, scenarios, results)
    results = {s.name: [] for s in scenarios}
    with _common.server_process() as port:
        for run in range(args.runs):
            traffic = Traffic.draw(args, args.seed + run)
            for scenario in scenarios:
                results[scenario.name].append(run_over_sockets(scenario, args, port, traffic))
    title = (
        f"over real sockets, the openai SDK as the client: {args.runs} run(s) of "
        f"{args.seconds:g} s per scenario, the first {args.warmup:g} s not measured"
    )
    verdicts = report(console, title, scenarios, results)
    for name, ratio, share in verdicts:
        console.print(
            _common.verdict(
                ratio <= 1.2 and share >= 0.95,
                f"run {name}: with the flood the light key's P99 TTFT is {ratio:.2f}x its run "
                f"alone (target <= 1.2x); the heavy key got {share:.0%} of the spare capacity "
                "(target: all of it, >= 95%)",
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
