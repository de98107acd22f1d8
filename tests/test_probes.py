"""Load probes (issue 21): engines' pages parsed, one poller per replica in the Hedger's own
nursery, fail open on stale or failing probes, no poll inside a llama-server's cancel window,
decisions from the engines' evidence, and a second caller unharmed by a misbehaving endpoint.

Decisions and schedules in virtual time, over readers of our own (``LoadProbe.reader``); the
HTTP read over real loopback sockets (``FakeReplica.pages``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import HedgerConfig
from trio_hedge.events import EventKind, HedgeEvent
from trio_hedge.hedger import LoadMonitor
from trio_hedge.policy import HedgeBudget, OutlierDetection
from trio_hedge.policy._load import ProbeState
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.sources.probes import (
    LoadProbe,
    LoadReading,
    ProbeError,
    parse_llama_slots,
    parse_metrics,
    parse_sglang_loads,
    read_load,
)
from trio_hedge.testing import (
    Behaviour,
    EnginePage,
    FakeReplica,
    llama_slots_page,
    vllm_metrics_page,
)

from .fleet import Fleet, run, table
from .scripted import Script

FAST = Script(ttft=0.5, tokens=3)
SLOW = Script(ttft=5.0, tokens=3)
PLAIN = HedgerConfig(hedge_after=1.0, budget=None, throttle=None, outlier_detection=None)

IDLE = LoadReading("llama.cpp", slots=4)
#: Another tenant's 8,000-token prompt being prefilled (8 s at the default 1,000 tokens/s).
PREFILLING = LoadReading("llama.cpp", running=1, queued_tokens=8000, slots=4)


class Engine:
    """A reader of our own: answers ``reading`` (or raises ``error``, or hangs), logs when
    each poll started and how many ran at once."""

    def __init__(
        self, reading: LoadReading | None = IDLE, *, error: Exception | None = None
    ) -> None:
        self.reading = reading
        self.error = error
        self.hang = False
        self.polls: list[float] = []
        self.active = 0
        self.max_active = 0

    async def read(self) -> LoadReading:
        self.polls.append(trio.current_time())
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await trio.sleep(0.001)  # a poll takes a little time
            if self.hang:
                await trio.sleep_forever()
            if self.error is not None:
                raise self.error
            assert self.reading is not None
            return self.reading
        finally:
            self.active -= 1


def _probes(engines: dict[str, Engine], engine: str = "llama.cpp", **fields: Any) -> Any:
    return {
        name: LoadProbe(engine, reader=e.read, **fields)  # type: ignore[arg-type]
        for name, e in engines.items()
    }


def _route(report: th.Report) -> list[tuple[str, str, O]]:
    return [(a.replica, a.trigger, a.outcome) for a in report.attempts]


# -- parsing --------------------------------------------------------------------------------------

VLLM_PAGE = vllm_metrics_page(waiting=3, running=2, kv_usage=0.42).body.decode()


@pytest.mark.parametrize(
    ("engine", "text", "expected"),
    [
        ("vllm", VLLM_PAGE, LoadReading("vllm", waiting=3, running=2, kv_usage=0.42)),
        (
            "vllm",  # two engine cores: counts add up, the KV usage is the fuller one's
            'vllm:num_requests_waiting{engine="0"} 1\nvllm:num_requests_waiting{engine="1"} 2\n'
            'vllm:num_requests_running{engine="0"} 1\nvllm:gpu_cache_usage_perc{engine="0"} 0.1\n'
            'vllm:gpu_cache_usage_perc{engine="1"} 0.7\n',
            LoadReading("vllm", waiting=3, running=1, kv_usage=0.7),
        ),
        (
            "llama.cpp",
            "# HELP llamacpp:requests_processing Number of requests processing.\n"
            "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
            "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 5\n"
            "llamacpp:prompt_tokens_total 1234\n",
            LoadReading("llama.cpp", waiting=5, running=2),
        ),
        (
            "sglang",
            'sglang:num_running_reqs{model_name="m"} 4\nsglang:num_queue_reqs{model_name="m"} 7\n'
            'sglang:token_usage{model_name="m"} 0.5\n',
            LoadReading("sglang", waiting=7, running=4, kv_usage=0.5),
        ),
        (
            "sglang",  # newer SGLang: underscores
            "sglang_num_running_reqs 1\nsglang_num_queue_reqs 2\nsglang_token_usage 0.25\n",
            LoadReading("sglang", waiting=2, running=1, kv_usage=0.25),
        ),
        (
            "tgi",
            "# TYPE tgi_queue_size gauge\ntgi_queue_size 6\ntgi_batch_current_size 3\n",
            LoadReading("tgi", waiting=6, running=3),
        ),
    ],
)
def test_metrics_pages_parse(engine: str, text: str, expected: LoadReading) -> None:
    assert parse_metrics(engine, text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "<html>login</html>\n",  # a proxy's page: none of the metrics
        'vllm:num_requests_waiting{engine="0" 3\n',  # broken labels
        "vllm:num_requests_waiting not-a-number\n",
        "",
    ],
)
def test_a_page_without_the_metrics_is_a_probe_error(text: str) -> None:
    with pytest.raises(ProbeError):
        parse_metrics("vllm", text)


def test_llama_slots_parse() -> None:
    page = llama_slots_page([(8000, 2048), None, (30, 30), None]).body
    assert parse_llama_slots(page) == LoadReading(
        "llama.cpp", running=2, queued_tokens=5952, slots=4
    )
    # An older llama-server: "state" instead of "is_processing".
    old = b'[{"id":0,"state":1,"n_prompt_tokens":100,"n_prompt_tokens_processed":40},{"state":0}]'
    assert parse_llama_slots(old) == LoadReading("llama.cpp", running=1, queued_tokens=60, slots=2)
    for bad in (b"not json", b"{}", b"[]", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(ProbeError):
            parse_llama_slots(bad)


#: SGLang's /v1/loads as ``v1_loads.py`` (sgl-project/sglang) writes it: one object per
#: data-parallel rank (the newest versions add ``num_waiting_uncached_tokens``, and drop the
#: ``dp_rank_count`` and ``aggregate`` older ones had).
SGLANG_LOADS = {
    "timestamp": "2026-12-02T01:00:00+00:00",
    "version": "0.5.9",
    "accelerator": None,
    "num_accelerators": 1,
    "loads": [
        {
            "dp_rank": 0,
            "timestamp": 1796000000.0,
            "num_running_reqs": 3,
            "num_waiting_reqs": 2,
            "num_waiting_uncached_tokens": 5000,
            "num_used_tokens": 9000,
            "num_total_tokens": 14000,
            "max_total_num_tokens": 100000,
            "token_usage": 0.09,
            "gen_throughput": 120.5,
            "cache_hit_rate": 0.5,
            "utilization": 0.75,
            "max_running_requests": 48,
            "memory": {"weight_gb": 1.0, "kv_cache_gb": 2.0, "graph_gb": 0.1, "token_capacity": 1},
            "queues": {"waiting": 2, "grammar": 0, "paused": 0, "retracted": 0},
        },
        {
            "dp_rank": 1,
            "num_running_reqs": 1,
            "num_waiting_reqs": 0,
            "num_waiting_uncached_tokens": 0,
            "token_usage": 0.4,
        },
    ],
}
#: An older SGLang's: no uncached token count, an aggregate (ignored).
SGLANG_LOADS_OLD = {
    "timestamp": "2024-01-15T10:30:00+00:00",
    "version": "0.4.0",
    "dp_rank_count": 1,
    "loads": [
        {
            "dp_rank": 0,
            "num_running_reqs": 5,
            "num_waiting_reqs": 2,
            "num_total_reqs": 7,
            "num_used_tokens": 5000,
            "num_total_tokens": 100000,
            "token_usage": 0.05,
            "gen_throughput": 120.5,
            "utilization": 0.75,
        }
    ],
    "aggregate": {"total_running_reqs": 5, "total_waiting_reqs": 2, "total_reqs": 7},
}


def test_sglang_loads_parse() -> None:
    assert parse_sglang_loads(json.dumps(SGLANG_LOADS)) == LoadReading(
        "sglang", waiting=2, running=4, queued_tokens=5000, kv_usage=0.4
    )
    assert parse_sglang_loads(json.dumps(SGLANG_LOADS_OLD).encode()) == LoadReading(
        "sglang", waiting=2, running=5, kv_usage=0.05
    )
    # One rank without the token count: no token count at all (never a part of one).
    ranks = [dict(SGLANG_LOADS["loads"][0]), {"num_running_reqs": 1, "num_waiting_reqs": 4}]
    assert parse_sglang_loads(json.dumps({"loads": ranks})) == LoadReading(
        "sglang", waiting=6, running=4, queued_tokens=None, kv_usage=0.09
    )
    # A usage over 1 (SGLang's is the fullest of several pools) is clamped; null is none.
    assert parse_sglang_loads('{"loads": [{"num_running_reqs": 1, "token_usage": 1.5}]}') == (
        LoadReading("sglang", running=1, kv_usage=1.0)
    )
    assert parse_sglang_loads('{"loads": [{"num_waiting_reqs": 1, "token_usage": null}]}') == (
        LoadReading("sglang", waiting=1)
    )


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"\xff\xfe",
        b"[]",
        b'{"loads": []}',
        b'{"loads": {"0": {}}}',
        b'{"loads": [1, 2]}',
        b'{"aggregate": {"total_running_reqs": 1}}',
        b'{"loads": [{"dp_rank": 0}]}',  # no request counts
        b'{"loads": [{"num_running_reqs": "3"}]}',
        b'{"loads": [{"num_running_reqs": -1}]}',
        b'{"loads": [{"num_running_reqs": 1.5}]}',
        b'{"loads": [{"num_running_reqs": true}]}',
        b'{"loads": [{"num_running_reqs": 1, "token_usage": "full"}]}',
        b'{"loads": [{"num_running_reqs": 1, "token_usage": NaN}]}',
        b'{"loads": [{"num_running_reqs": 1, "num_waiting_uncached_tokens": -5}]}',
        b'{"detail": "Unauthorized"}',  # an admin route without its key
    ],
)
def test_an_unexpected_sglang_loads_page_is_no_reading(body: bytes) -> None:
    with pytest.raises(ProbeError):
        parse_sglang_loads(body)


def test_probe_fields_are_validated_by_name() -> None:
    for fields, name in (
        ({"engine": "ollama"}, "engine"),
        ({"engine": "vllm", "interval": 0}, "interval"),
        ({"engine": "vllm", "max_age": -1}, "max_age"),
        ({"engine": "vllm", "max_body": 0}, "max_body"),
        ({"engine": "vllm", "path": "metrics"}, "path"),
        ({"engine": "vllm", "reader": 3}, "reader"),
    ):
        with pytest.raises((TypeError, ValueError), match=name):
            LoadProbe(**fields)
    with pytest.raises(ValueError, match="probe"):
        th.Replica("http://127.0.0.1:1/v1", probe="ollama")
    with pytest.raises(TypeError, match="backup_priority"):
        th.Replica("http://127.0.0.1:1/v1", backup_priority="low")  # type: ignore[arg-type]
    assert th.Replica("http://127.0.0.1:1/v1", probe="vllm").probe == LoadProbe("vllm")
    assert LoadProbe("llama.cpp").quiet == 1.2 and LoadProbe("vllm").quiet == 0.0
    fleet = Fleet(["a", "b"], table(FAST))
    with pytest.raises(ValueError, match="probes"):
        th.Hedger(fleet.sources(), PLAIN, probes={"c": LoadProbe("vllm", reader=Engine().read)})
    with pytest.raises(ValueError, match="reader"):
        th.Hedger(fleet.sources(), PLAIN, probes={"a": "vllm"})


# -- decisions from evidence (virtual time) -----------------------------------------------------

BUSY_VLLM = LoadReading("vllm", waiting=4, running=8, kv_usage=0.5)
FULL = LoadReading("vllm", running=8, kv_usage=0.99)


@pytest.mark.parametrize(
    ("reading_a", "reading_b", "primary"),
    [
        (PREFILLING, IDLE, "b"),  # another tenant prefills on a: the primary goes elsewhere
        (IDLE, PREFILLING, "a"),
        (BUSY_VLLM, LoadReading("vllm", running=8, kv_usage=0.5), "b"),  # a's queue
        (FULL, LoadReading("vllm", kv_usage=0.2), "b"),  # a's KV cache is saturated
        (IDLE, IDLE, "a"),  # the given order breaks ties
        (None, IDLE, "a"),  # a's probe fails: its own view (no latency yet), the order
    ],
)
async def test_the_primary_goes_where_the_engine_is_free(
    autojump_clock: trio.testing.MockClock,
    reading_a: LoadReading | None,
    reading_b: LoadReading,
    primary: str,
) -> None:
    engines = {
        "a": Engine(reading_a, error=None if reading_a else ProbeError("garbage")),
        "b": Engine(reading_b),
    }
    fleet = Fleet(["a", "b"], table(FAST))
    async with th.Hedger(fleet.sources(), PLAIN, probes=_probes(engines)) as hedger:
        await trio.sleep(0.01)  # the first polls answered
        report = await run(hedger.stream(None))
        stats = {r.name: r for r in hedger.statistics().replicas}
    assert report.attempts[0].replica == primary
    assert stats["a"].probe == ("fresh" if reading_a else "failing")
    # Without probes, the same fleet sends the primary to a (the control).
    control = Fleet(["a", "b"], table(FAST))
    async with th.Hedger(control.sources(), PLAIN) as plain:
        assert (await run(plain.stream(None))).attempts[0].replica == "a"


async def test_a_stale_reading_falls_back_to_the_own_view(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engines = {"a": Engine(PREFILLING), "b": Engine(IDLE)}
    fleet = Fleet(["a", "b"], table(FAST))
    probes = _probes(engines, interval=100.0, max_age=1.0)  # one reading, then none for long
    async with th.Hedger(fleet.sources(), PLAIN, probes=probes) as hedger:
        await trio.sleep(0.01)
        assert (await run(hedger.stream(None))).attempts[0].replica == "b"
        await trio.sleep(2.0)  # a's reading is 2 s old now: no evidence
        stats = {r.name: r for r in hedger.statistics().replicas}
        assert (stats["a"].probe, stats["a"].predicted_wait) == ("stale", None)
        # The own view: b answered in 0.5 s, a has no latency yet -> a, as without probes.
        assert (await run(hedger.stream(None))).attempts[0].replica == "a"
        stats = {r.name: r for r in hedger.statistics().replicas}
    assert (stats["a"].probe_decisions, stats["a"].own_view_decisions) == (1, 1)


def _mixed(name: str, info: th.sources.AttemptInfo) -> Script:
    """A seeded mix of fast, slow and failing attempts (the same for every run)."""
    draw = random.Random(f"{name}/{info.request_id}/{info.number}").random()
    return SLOW if draw < 0.3 else Script(ttft=0.1 + draw, tokens=3)


async def _decisions(
    probes: dict[str, LoadProbe] | None, config: HedgerConfig = PLAIN
) -> list[list[tuple[str, str, O, float]]]:
    fleet = Fleet(["a", "b", "c"], _mixed)
    out = []
    async with th.Hedger(fleet.sources(), config, probes=probes) as hedger:
        for i in range(40):
            report = await run(hedger.stream(None, request_id=f"r{i}"))
            # (Times rounded: the pollers' wake-ups shift the clock's float sums in the last bit.)
            out.append(
                [
                    (a.replica, a.trigger, a.outcome, round(a.started_at or 0.0, 9))
                    for a in report.attempts
                ]
            )
            await trio.sleep(0.3)
    return out


@pytest.mark.parametrize("failure", ["error", "hang", "not a reading"])
async def test_a_failing_probe_fails_open(
    autojump_clock: trio.testing.MockClock, failure: str
) -> None:
    """Every decision of a Hedger whose probes all fail (raise, hang past the timeout, answer
    nonsense) is exactly that of a Hedger without probes: picks, hedges, their times."""
    engines = {n: Engine(error=ProbeError("garbage")) for n in "abc"}
    for e in engines.values():
        e.hang = failure == "hang"
        if failure == "not a reading":
            e.error, e.reading = None, "vllm:num_requests_waiting 3"  # type: ignore[assignment]
    probes = _probes(engines, engine="vllm")
    config = attrs.evolve(PLAIN, hedge_after=th.LearnedDelay(min_samples=5))
    assert await _decisions(probes, config) == await _decisions(None, config)
    assert all(len(e.polls) > 10 for e in engines.values())


# -- the schedule -------------------------------------------------------------------------------


async def _cancel_window_run(quiet: float | None) -> tuple[list[tuple[str, float]], Engine]:
    """Seeded requests whose primary on a is hedged to b and cancelled before its first token;
    returns (replica, time) of every such cancel and a's engine."""
    engines = {"a": Engine(IDLE), "b": Engine(IDLE)}
    cancels: list[tuple[str, float]] = []

    def hook(event: HedgeEvent) -> None:
        record = event.record
        if event.kind is EventKind.ATTEMPT_CANCELLED and record is not None and record.ttft is None:
            assert event.replica is not None
            cancels.append((event.replica, event.time))

    fleet = Fleet(["a", "b"], table(FAST, a=SLOW))
    config = attrs.evolve(PLAIN, pick="in_order", hedge_after=0.3)
    probes = _probes(engines, cancel_quiet=quiet)
    rng = random.Random(21)
    async with th.Hedger(fleet.sources(), config, probes=probes, on_event=[hook]) as hedger:
        async with trio.open_nursery() as nursery:
            at = 0.0
            for i in range(30):
                at += rng.expovariate(1.5)
                nursery.start_soon(_request_at, hedger, at, f"r{i}")
    return cancels, engines["a"]


async def _request_at(hedger: th.Hedger, at: float, request_id: str) -> None:
    await trio.sleep_until(at)
    await run(hedger.stream(None, request_id=request_id))


async def test_no_poll_of_a_llama_server_within_its_cancel_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """llama-server notices a cancel during prefill only after 1 s with no result for any
    request: no poll of it starts within 1.2 s after this Hedger cancelled an attempt there
    without a first token (the same run with the window switched off does poll there)."""

    def inside(cancels: list[tuple[str, float]], polls: list[float]) -> list[float]:
        return [p for _, c in cancels for p in polls if c < p < c + 1.2]

    cancels, engine = await _cancel_window_run(None)
    assert len(cancels) >= 20 and {name for name, _ in cancels} == {"a"}
    assert inside(cancels, engine.polls) == []
    assert len(engine.polls) > 10  # it is still polled between the windows
    cancels, engine = await _cancel_window_run(0.0)  # the control: no window
    assert len(inside(cancels, engine.polls)) > 10


async def test_one_poller_per_replica_for_a_hundred_concurrent_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def polls(requests: int) -> list[Engine]:
        engines = {"a": Engine(LoadReading("vllm")), "b": Engine(LoadReading("vllm"))}
        fleet = Fleet(["a", "b"], table(Script(ttft=0.5, tokens=20, gap=0.05)))
        async with th.Hedger(fleet.sources(), PLAIN, probes=_probes(engines, "vllm")) as h:
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for i in range(requests):
                    nursery.start_soon(_request_at, h, start + i * 0.01, f"r{i}")
            await trio.sleep_until(start + 2.9)
        return list(engines.values())

    busy, quiet = await polls(100), await polls(0)
    for engine, control in zip(busy, quiet, strict=True):
        assert engine.max_active == 1
        assert len(engine.polls) == len(control.polls) == 12  # 0, 0.25, ..., 2.75


async def test_no_poller_outlives_the_hedger_and_errors_come_out_as_themselves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engines = {"a": Engine(IDLE), "b": Engine(IDLE)}
    fleet = Fleet(["a", "b"], table(FAST))
    hedger = th.Hedger(fleet.sources(), PLAIN, probes=_probes(engines))
    with pytest.raises(KeyError):
        async with hedger:
            await trio.sleep(0.9)
            raise KeyError("the body's own error")
    polled = len(engines["a"].polls)
    assert polled == 4  # 0, 0.25, 0.5, 0.75
    await trio.sleep(10.0)
    assert len(engines["a"].polls) == polled  # nothing polls after the `async with`
    # Without `async with` nothing polls at all: the own view, as without probes.
    bare = th.Hedger(fleet.sources(), PLAIN, probes=_probes({"a": Engine(PREFILLING)}))
    assert (await run(bare.stream(None))).attempts[0].replica == "a"
    assert bare.statistics().replicas[0].probe == "waiting"
    await bare.aclose()


# -- one poller per replica for many Hedgers (LoadMonitor) ----------------------------------------


async def _three_hedgers_run(
    shared: bool, engine: str, config: HedgerConfig, behave: Any, rate: float, **fields: Any
) -> tuple[dict[str, Engine], list[tuple[int, str, float]]]:
    """Three Hedgers over the same two replicas (as the gateway's chat, Messages and Responses
    Hedgers are), 30 seeded requests (``rate`` a second) spread over them; their probes a
    shared `LoadMonitor`'s (``shared``) or each Hedger's own. Returns the engines and
    (hedger, replica, time) of every attempt cancelled before its first token."""
    idle = IDLE if engine == "llama.cpp" else LoadReading("vllm")
    engines = {"a": Engine(idle), "b": Engine(idle)}
    probes = _probes(engines, engine, **fields)
    cancels: list[tuple[int, str, float]] = []

    def hook(n: int) -> Any:
        def on(event: HedgeEvent) -> None:
            record, replica = event.record, event.replica
            cancelled = event.kind is EventKind.ATTEMPT_CANCELLED and record is not None
            if cancelled and record.ttft is None and replica is not None:  # type: ignore[union-attr]
                cancels.append((n, replica, event.time))

        return on

    fleet = Fleet(["a", "b"], behave)
    rng = random.Random(17)
    async with LoadMonitor(fleet.sources(), probes=probes if shared else {}) as monitor:
        hedgers = [
            th.Hedger(
                fleet.sources(), config, probes=monitor if shared else probes, on_event=[hook(n)]
            )
            for n in range(3)
        ]
        async with contextlib.AsyncExitStack() as stack:
            for hedger in hedgers:
                await stack.enter_async_context(hedger)
            async with trio.open_nursery() as nursery:
                at = trio.current_time()
                for i in range(30):
                    at += rng.expovariate(rate)
                    nursery.start_soon(_request_at, hedgers[i % 3], at, f"r{i}")
                nursery.start_soon(trio.sleep, 2.9)
    return engines, cancels


async def test_hedgers_sharing_a_monitor_poll_each_replica_as_one_hedger_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three Hedgers over the same replicas, with a LoadMonitor: each engine is polled as one
    Hedger polls it (0, 0.25, ..., 2.75 s: 12 polls, one at a time), whatever the requests;
    each Hedger with its own probes polls three times as often (the cost the monitor saves)."""
    behave = table(Script(ttft=0.05, tokens=5, gap=0.02))
    engines, _ = await _three_hedgers_run(True, "vllm", PLAIN, behave, 15.0)
    assert [len(e.polls) for e in engines.values()] == [12, 12]
    assert {e.max_active for e in engines.values()} == {1}
    alone, _ = await _three_hedgers_run(False, "vllm", PLAIN, behave, 15.0)
    assert [len(e.polls) for e in alone.values()] == [36, 36]


async def test_a_cancel_by_any_hedger_silences_the_shared_poller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """llama-server: after any of the Hedgers sharing a monitor cancels an attempt on a
    before its first token, no poll of a starts for 1.2 s. Each Hedger polling on its own
    sees only its own cancels, and its polls land inside the others' windows."""

    def inside(cancels: list[tuple[int, str, float]], polls: list[float]) -> list[float]:
        return [p for _, name, c in cancels for p in polls if name == "a" and c < p < c + 1.2]

    config = attrs.evolve(PLAIN, pick="in_order", hedge_after=0.3)
    behave = table(FAST, a=SLOW)
    engines, cancels = await _three_hedgers_run(True, "llama.cpp", config, behave, 3.0)
    assert {n for n, _, _ in cancels} == {0, 1, 2} and len(cancels) >= 20
    assert inside(cancels, engines["a"].polls) == []
    polls_b = engines["b"].polls  # b: never cancelled, polled every 0.25 s as by one Hedger
    assert [round(y - x, 9) for x, y in itertools.pairwise(polls_b)] == [0.25] * (len(polls_b) - 1)
    engines, cancels = await _three_hedgers_run(False, "llama.cpp", config, behave, 3.0)
    assert len(inside(cancels, engines["a"].polls)) > 20


async def test_a_monitor_checks_its_replicas_and_hedgers_read_only_theirs() -> None:
    fleet = Fleet(["a", "b"], table(FAST))
    engine = Engine()
    with pytest.raises(ValueError, match="unique"):
        LoadMonitor([*fleet.sources(), *fleet.sources()])
    with pytest.raises(ValueError, match="probes"):
        LoadMonitor(fleet.sources(), probes={"c": LoadProbe("vllm", reader=engine.read)})
    monitor = LoadMonitor(fleet.sources(), probes={"a": LoadProbe("vllm", reader=engine.read)})
    assert monitor.replica_names == ("a",)
    hedger = th.Hedger(fleet.sources(), PLAIN, probes=monitor)
    assert [r.probe for r in hedger.statistics().replicas] == ["waiting", "off"]
    # A replica of the same name elsewhere is not the monitor's.
    probed = LoadMonitor([th.Replica("http://127.0.0.1:1/v1", name="a", probe="vllm")])
    with pytest.raises(ValueError, match="base_url"):
        th.Hedger([th.Replica("http://127.0.0.1:2/v1", name="a")], PLAIN, probes=probed)


# -- hedging on evidence --------------------------------------------------------------------------


@pytest.mark.parametrize("probed", [True, False])
async def test_a_backup_at_once_when_the_engine_says_the_primary_will_be_slow(
    autojump_clock: trio.testing.MockClock, probed: bool
) -> None:
    engines = {"a": Engine(PREFILLING), "b": Engine(IDLE)}
    fleet = Fleet(["a", "b"], table(FAST, a=SLOW))
    outlier = OutlierDetection(consecutive_failures=1)
    config = attrs.evolve(PLAIN, pick="in_order", outlier_detection=outlier)
    probes = _probes(engines) if probed else None
    async with th.Hedger(fleet.sources(), config, probes=probes) as hedger:
        await trio.sleep(0.01)
        start = trio.current_time()
        report = await run(hedger.stream(None))
        stats = hedger.statistics()
    assert _route(report) == [("a", "primary", O.CANCELLED), ("b", "hedge", O.WON)]
    backup = report.attempts[1].started_at
    assert backup is not None
    if probed:
        # At once: the engine said a's prefill would wait 8 s, more than the 1 s delay.
        assert report.attempts[0].started_at == backup
        assert stats.hedges_at_once == 1
        # a lost a race it was never given the fleet's delay for: not slow, not ejected.
        assert stats.ejected == () and stats.replicas[0].consecutive_failures == 0
    else:
        assert math.isclose(backup - (report.attempts[0].started_at or 0.0), 1.0)
        assert stats.hedges_at_once == 0
        # Slow after the full delay: the control counts it slow (never ejected for it with
        # two replicas: b would be left with nothing to hedge to).
        assert stats.ejected == () and stats.replicas[0].slow_attempts == 1
    assert start >= 0


@pytest.mark.parametrize(("probed", "after"), [(True, 0.5), (False, 1.0)])
async def test_a_reading_that_arrives_during_the_delay_sends_the_backup_then(
    autojump_clock: trio.testing.MockClock, probed: bool, after: float
) -> None:
    """The primary went to an idle engine; another tenant's long prompt arrives there just
    after (at 0.3 s). The poll at 0.51 s sees it; the request, which looks again every
    ``interval`` (0.25 s) while it waits out its 1 s delay, sends the backup at 0.5 s, not at
    the timer. A second caller, sent after the reading (its primary on a: ``in_order``), gets
    its backup at once."""
    engines = {"a": Engine(IDLE), "b": Engine(IDLE)}
    fleet = Fleet(["a", "b"], table(FAST, a=SLOW))
    config = attrs.evolve(PLAIN, pick="in_order")
    probes = _probes(engines) if probed else None
    async with th.Hedger(fleet.sources(), config, probes=probes) as hedger:
        await trio.sleep(0.01)
        reports: list[th.Report] = []

        async def tenant_arrives() -> None:
            await trio.sleep(0.3)
            engines["a"].reading = PREFILLING

        async def second() -> None:
            await trio.sleep(0.7)
            reports.append(await run(hedger.stream(None)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(tenant_arrives)
            nursery.start_soon(second)
            first = await run(hedger.stream(None))
        stats = hedger.statistics()
    primary, backup = first.attempts
    assert (primary.replica, backup.replica, backup.outcome) == ("a", "b", O.WON)
    assert primary.started_at is not None and backup.started_at is not None
    assert backup.started_at - primary.started_at == pytest.approx(after)
    assert stats.hedges_at_once == (2 if probed else 0)
    a, b = reports[0].attempts
    assert a.started_at is not None and b.started_at is not None
    assert (a.replica, b.replica, b.started_at - a.started_at) == ("a", "b", (0 if probed else 1))


@pytest.mark.parametrize("probed", [True, False])
async def test_a_cold_hedger_waits_out_a_long_prompts_own_prefill(
    autojump_clock: trio.testing.MockClock, probed: bool
) -> None:
    """Before any prefill model is fitted, the fallback delay (1 s) would hedge a 4,000-token
    prompt whose own prefill takes ~4 s at the probe's 1,000 tokens/s: with a probe its delay
    covers that prefill, and the primary (3 s) answers alone; a short prompt keeps the 1 s."""
    engines = {"a": Engine(IDLE), "b": Engine(IDLE)}
    fleet = Fleet(["a", "b"], table(FAST, a=Script(ttft=3.0, tokens=3)))
    config = attrs.evolve(th.HedgerConfig(), pick="in_order", budget=None, throttle=None)
    probes = _probes(engines) if probed else None
    async with th.Hedger(fleet.sources(), config, probes=probes) as hedger:
        await trio.sleep(0.01)
        report = await run(hedger.stream(None, prompt_tokens=4000))
        short = await run(hedger.stream(None, prompt_tokens=20))
    assert _route(report) == (
        [("a", "primary", O.WON)]
        if probed
        else [("a", "primary", O.CANCELLED), ("b", "hedge", O.WON)]
    )
    # A short prompt's own prefill (0.02 s) is under the fallback: hedged at 1 s either way.
    assert _route(short) == [("a", "primary", O.CANCELLED), ("b", "hedge", O.WON)]


def test_vllm_generated_tokens_counter_parses() -> None:
    page = vllm_metrics_page(running=1, generated=1234).body.decode()
    assert parse_metrics("vllm", page) == LoadReading("vllm", running=1, kv_usage=0.0,
                                                      generated=1234)  # fmt: skip
    assert parse_metrics("vllm", VLLM_PAGE).generated is None  # an older vLLM: no counter


@pytest.mark.parametrize(("counter", "primary"), [(True, "b"), (False, "a")])
async def test_a_vllm_engine_inside_one_long_step_gets_no_primary(
    autojump_clock: trio.testing.MockClock, counter: bool, primary: str
) -> None:
    """vLLM shows another tenant's long prefill as ``running = 1``, like a decode; but a
    decode moves the generated-token count every step, and the prefill does not. a's count
    stands still, b's moves: from the second poll on, a is stalled and the primaries of
    two callers go to b. Without the counter the gauges look alike and a (first) is used,
    then the pick's own view decides: the engines' readings add to what the Hedger saw of
    each replica (a answered in 0.5 s, b is unknown), never replace it."""
    moved = 0

    async def decoding() -> LoadReading:
        nonlocal moved
        moved += 16
        return LoadReading("vllm", running=1, generated=moved if counter else None)

    a = Engine(LoadReading("vllm", running=1, generated=500 if counter else None))
    probes = {"a": LoadProbe("vllm", reader=a.read), "b": LoadProbe("vllm", reader=decoding)}
    fleet = Fleet(["a", "b"], table(FAST))
    config = attrs.evolve(PLAIN, hedge_after=None)
    async with th.Hedger(fleet.sources(), config, probes=probes) as hedger:
        await trio.sleep(0.6)  # polls at 0, 0.25, 0.5: a has not moved for 0.5 s
        first = await run(hedger.stream(None))
        now, stats = trio.current_time(), hedger.statistics()
        second = await run(hedger.stream(None))
    assert [r.attempts[0].replica for r in (first, second)] == [primary, "b"]
    # Stalled since the first poll (at 0): the wait is at least that long.
    assert stats.replicas[0].predicted_wait == (pytest.approx(now) if counter else 0.0)


@pytest.mark.parametrize("probed", [True, False])
async def test_its_own_prompt_on_the_engines_page_is_not_ahead_of_a_request(
    autojump_clock: trio.testing.MockClock, probed: bool
) -> None:
    """Once a poll is taken after the primary started, llama-server's /slots shows the
    request's own prompt left to prefill (4,000 tokens at 1,000/s here): that is not a queue
    ahead of it, and the backup goes on the 1 s timer, as without probes (not at the first
    look, 0.25 s, for its own prefill)."""
    started: list[float] = []

    def hook(event: HedgeEvent) -> None:
        if event.kind is EventKind.ATTEMPT_STARTED and not started:
            started.append(event.time)

    async def own_slot() -> LoadReading:
        await trio.sleep(0.001)
        if not started:
            return IDLE
        left = max(0, round(4000 - 1000 * (trio.current_time() - started[0])))
        return LoadReading("llama.cpp", running=1 if left else 0, queued_tokens=left, slots=4)

    probes = {"a": LoadProbe("llama.cpp", reader=own_slot), "b": LoadProbe("llama.cpp",
              reader=Engine(IDLE).read)}  # fmt: skip
    fleet = Fleet(["a", "b"], table(Script(ttft=4.0, tokens=3)))
    config = attrs.evolve(PLAIN, pick="in_order")
    async with th.Hedger(
        fleet.sources(), config, probes=probes if probed else None, on_event=[hook]
    ) as hedger:
        await trio.sleep(0.01)
        report = await run(hedger.stream(None, prompt_tokens=4000))
        assert hedger.statistics().hedges_at_once == 0
    primary, backup = report.attempts
    assert primary.started_at is not None and backup.started_at is not None
    assert (backup.replica, backup.started_at - primary.started_at) == ("b", 1.0)


@pytest.mark.parametrize(("probed", "after"), [(True, 0.5), (False, 1.0)])
async def test_a_backup_the_budget_refuses_on_evidence_is_still_sent_on_the_timer(
    autojump_clock: trio.testing.MockClock, probed: bool, after: float
) -> None:
    """r2's primary is found queued at 3.25 s while the budget (spent by r0 and r1) refuses a
    backup; r3 adds to the budget at 3.4 s: the backup goes at the next look (3.5 s), and
    without probes on the timer (4.0 s). Refused early, it was lost for good."""
    engines = {"a": Engine(IDLE), "b": Engine(IDLE)}
    fleet = Fleet(["a", "b"], table(FAST, a=SLOW))
    budget = HedgeBudget(ratio=0.5, min_per_second=0.0)
    config = attrs.evolve(PLAIN, pick="in_order", budget=budget)
    reports: dict[str, th.Report] = {}
    async with th.Hedger(
        fleet.sources(), config, probes=_probes(engines) if probed else None
    ) as hedger:
        await trio.sleep(0.01)
        t0 = trio.current_time()

        async def send(name: str, at: float, hedge: bool = True) -> None:
            await trio.sleep_until(t0 + at)
            reports[name] = await run(hedger.stream(None, request_id=name, hedge=hedge))

        async def tenant() -> None:
            await trio.sleep_until(t0 + 3.1)
            engines["a"].reading = PREFILLING

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "r0", 0.0)
            nursery.start_soon(send, "r1", 0.01)
            nursery.start_soon(send, "r2", 3.0)
            nursery.start_soon(tenant)
            nursery.start_soon(send, "r3", 3.4, False)  # between two looks: no tie
    primary, backup = reports["r2"].attempts
    assert primary.started_at is not None and backup.started_at is not None
    assert (backup.replica, backup.trigger) == ("b", "hedge")
    assert backup.started_at - primary.started_at == pytest.approx(after)


def test_vllm_requests_held_before_their_first_step_are_a_stall() -> None:
    """During the first step of another tenant's long prefill vLLM's gauges still show the
    engine idle; its HTTP front (``/load``) already holds the request. Held requests and a
    generated-token count that stands still are a stall; without the count of held requests
    the same gauges say nothing."""
    for in_flight, expected in ((1, 0.5), (None, 0.0)):
        state = ProbeState(LoadProbe("vllm", load_path="/load"))
        idle = LoadReading("vllm", generated=7, in_flight=0 if in_flight else None)
        state.observed(idle, 0.0, 0.0)
        first_step = LoadReading("vllm", generated=7, in_flight=in_flight)
        state.observed(first_step, 0.25, 0.25)
        state.observed(first_step, 0.5, 0.5)
        assert state.stalled_for(first_step, 0.5) == expected


@pytest.mark.parametrize(
    ("stall_began", "now", "expected"),
    [
        (0.0, 0.2, 0.0),  # within one interval: a decode step may still be running
        (0.0, 3.0, 3.0),  # a long step: the wait is at least that long
        (0.0, 10.5, 0.0),  # beyond max_stall (10 s): frozen gauges, no evidence
    ],
)
def test_a_stall_counts_between_one_interval_and_max_stall(
    stall_began: float, now: float, expected: float
) -> None:
    state = ProbeState(LoadProbe("vllm"))
    state.observed(LoadReading("vllm", running=0, generated=7), stall_began, stall_began)
    stuck = LoadReading("vllm", running=1, generated=7)
    state.observed(stuck, stall_began + 0.1, stall_began + 0.1)
    assert state.stalled_for(stuck, now) == expected
    # For an attempt sent as the stall began, the stall may be its own prefill: a 4,000-token
    # prompt's (4 s at 1,000 tokens/s) is taken off; a 20-token prompt's hardly changes it.
    sent = stall_began + 0.2
    assert state.stalled_for(stuck, now, before=sent, own=4000) == 0.0
    assert state.stalled_for(stuck, now, before=sent, own=20) == pytest.approx(
        max(0.0, expected - 0.02) if expected else 0.0
    )
    # A stall on long before the attempt was sent is ahead of it, whatever its size.
    assert state.stalled_for(stuck, now, before=stall_began + 2.0, own=4000) == expected


async def test_a_long_prompt_is_not_queued_behind_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request's own prompt is not ahead of it: a 4,000-token prompt on an idle engine is not
    hedged at once for its own prefill (4 s at 1,000 tokens/s, over the 1 s delay), while a
    second caller's short request, sent during that prefill, sees it and goes elsewhere."""
    engines = {"a": Engine(IDLE), "b": Engine(IDLE)}
    fleet = Fleet(["a", "b"], table(Script(ttft=2.0, tokens=3)))
    async with th.Hedger(fleet.sources(), PLAIN, probes=_probes(engines)) as hedger:
        await trio.sleep(0.01)
        reports: dict[str, th.Report] = {}

        async def one(name: str, tokens: int, at: float) -> None:
            await trio.sleep(at)
            reports[name] = await run(hedger.stream(None, prompt_tokens=tokens))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "long", 4000, 0.0)
            nursery.start_soon(one, "short", 20, 0.1)
        stats = hedger.statistics()
    long, short = reports["long"].attempts, reports["short"].attempts
    assert [(a.replica, a.trigger) for a in long] == [("a", "primary"), ("b", "hedge")]
    assert long[1].started_at is not None and long[0].started_at is not None
    assert math.isclose(long[1].started_at - long[0].started_at, 1.0)  # the delay, not at once
    assert stats.hedges_at_once == 0
    assert short[0].replica == "b"  # the long prompt is queued on a for everyone else


@pytest.mark.parametrize(
    ("reading_b", "sent"),
    [
        (PREFILLING, False),  # b predicted 8 s, a 1.5 s: a backup there only adds load
        (None, True),  # b's probe fails: no evidence is no reason not to hedge
        (IDLE, True),
    ],
)
async def test_no_backup_to_a_replica_predicted_no_faster(
    autojump_clock: trio.testing.MockClock, reading_b: LoadReading | None, sent: bool
) -> None:
    a = LoadReading("llama.cpp", running=1, queued_tokens=1500, slots=4)
    engines = {"a": Engine(a), "b": Engine(reading_b, error=None if reading_b else ProbeError())}
    fleet = Fleet(["a", "b"], table(Script(ttft=2.0, tokens=3), b=SLOW))
    config = attrs.evolve(PLAIN, pick="in_order")
    async with th.Hedger(fleet.sources(), config, probes=_probes(engines)) as hedger:
        await trio.sleep(0.01)
        report = await run(hedger.stream(None))
        stats = hedger.statistics()
    assert [a.replica for a in report.attempts] == (["a", "b"] if sent else ["a"])
    assert stats.saturated_refusals == (0 if sent else 1)
    assert stats.no_replica_refusals == (0 if sent else 1)


async def test_no_backup_when_every_replica_is_saturated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engines = {"a": Engine(FULL), "b": Engine(FULL)}
    fleet = Fleet(["a", "b"], table(Script(ttft=3.0, tokens=3)))
    async with th.Hedger(fleet.sources(), PLAIN, probes=_probes(engines, "vllm")) as hedger:
        await trio.sleep(0.01)
        report = await run(hedger.stream(None))
        assert [a.replica for a in report.attempts] == ["a"]
        assert hedger.statistics().saturated_refusals == 1
        engines["b"].reading = LoadReading("vllm", kv_usage=0.3)  # b frees up
        await trio.sleep(0.3)
        report = await run(hedger.stream(None))
    assert [a.replica for a in report.attempts] == ["b"]  # and takes the primary


# -- over loopback: the HTTP read, a misbehaving endpoint, a second caller ----------------------


async def test_read_load_over_loopback() -> None:
    async with FakeReplica(name="a") as fake, httpx.AsyncClient() as client:
        fake.pages["/metrics"] = vllm_metrics_page(waiting=2, running=1, kv_usage=0.3)
        fake.pages["/slots"] = llama_slots_page([(4000, 1000), None])
        assert await read_load(client, LoadProbe("vllm"), fake.url) == LoadReading(
            "vllm", waiting=2, running=1, kv_usage=0.3
        )
        assert await read_load(client, LoadProbe("llama.cpp"), fake.url) == LoadReading(
            "llama.cpp", running=1, queued_tokens=3000, slots=2
        )
        fake.pages["/v1/loads"] = EnginePage(json.dumps(SGLANG_LOADS))
        loads = LoadProbe("sglang", path="/v1/loads?include=core")
        assert await read_load(client, loads, fake.url) == LoadReading(
            "sglang", waiting=2, running=4, queued_tokens=5000, kv_usage=0.4
        )
        assert [r.path for r in fake.requests] == ["/metrics", "/slots", "/v1/loads?include=core"]
        fake.pages["/load"] = EnginePage('{"server_load": 3}')
        both = LoadProbe("vllm", load_path="/load")
        assert await read_load(client, both, fake.url) == LoadReading(
            "vllm", waiting=2, running=1, kv_usage=0.3, in_flight=3
        )
        for bad in ('{"server_load": -1}', '{"load": 3}', "[3]", '{"server_load": true}'):
            fake.pages["/load"] = EnginePage(bad)
            with pytest.raises(ProbeError, match="server_load"):
                await read_load(client, both, fake.url)
        fake.pages["/load"] = EnginePage("{{", status=200)
        with pytest.raises(ProbeError, match="not JSON"):
            await read_load(client, both, fake.url)
        del fake.pages["/load"]
        fake.requests.clear()
        fake.pages["/v1/loads"] = EnginePage(b'{"loads": [' + b'{"num_running_reqs": 1},' * 50_000)
        with pytest.raises(ProbeError, match="larger than 65536 bytes"):  # a bounded read
            await read_load(client, attrs.evolve(loads, max_body=65536), fake.url)
        for page, message in (
            (EnginePage("garbage {{{"), "none of"),
            (EnginePage(b"x" * (2 << 20)), "larger than 1048576 bytes"),  # a bounded read
            (EnginePage("oops", status=500), "HTTP 500"),
            (EnginePage(b"\xff\xfe\x00"), "UTF-8"),
        ):
            fake.pages["/metrics"] = page
            with pytest.raises(ProbeError, match=message):
                await read_load(client, LoadProbe("vllm"), fake.url)


async def _polled(*fakes: FakeReplica) -> None:
    """Until each fake has had its second poll: the first one's outcome is in by then (a
    poller stores a reading, or its failure, before it starts the next poll)."""
    with trio.fail_after(10):
        for fake in fakes:
            await fake.wait_request(1)


async def _served(
    replicas: list[th.Replica], config: HedgerConfig, *fakes: FakeReplica
) -> tuple[list[list[tuple[str, str, O]]], th.HedgerStatistics]:
    """Two callers' requests through one Hedger: the second caller's routes."""
    routes = []
    async with th.Hedger(replicas, config) as hedger:
        await _polled(*fakes)
        for i in range(4):
            async with trio.open_nursery() as nursery:  # the first caller's, alongside
                nursery.start_soon(run, hedger.stream({"model": "m", "messages": []}))
                report = await run(
                    hedger.stream(
                        {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}
                    )
                )
            routes.append(_route(report))
        stats = hedger.statistics()
    return routes, stats


@pytest.mark.parametrize(
    "page",
    [
        EnginePage("garbage {{{ \x00"),
        EnginePage(b"vllm:num_requests_waiting 1\n" * 200_000),  # 5.6 MB: past max_body
        EnginePage(stall=True),  # headers, then nothing: past the timeout
        EnginePage("", status=503),
    ],
    ids=["garbage", "huge", "stalled", "503"],
)
async def test_a_misbehaving_probe_endpoint_changes_no_callers_service(page: EnginePage) -> None:
    """A replica whose /metrics misbehaves: both callers are served exactly as by a Hedger
    without probes (primary on a, a backup to b at the delay, b wins), and the statistics say
    the probe is failing."""
    slow, fast = Behaviour(ttft=5.0), Behaviour(ttft=0.0)
    config = attrs.evolve(PLAIN, pick="in_order", hedge_after=0.05)
    async with FakeReplica(slow, name="a") as a, FakeReplica(fast, name="b") as b:
        a.pages["/metrics"] = page
        b.pages["/metrics"] = vllm_metrics_page()
        probe = LoadProbe("vllm", timeout=0.2, interval=0.05)
        probed = [
            th.Replica(a.url, name="a", probe=probe),
            th.Replica(b.url, name="b", probe=probe),
        ]
        routes, stats = await _served(probed, config, a, b)
        control, _ = await _served(
            [th.Replica(a.url, name="a"), th.Replica(b.url, name="b")], config
        )
    expected = [("a", "primary", O.CANCELLED), ("b", "hedge", O.WON)]
    assert routes == control == [expected] * 4
    assert stats.replicas[0].probe == "failing" and stats.replicas[0].probe_failures >= 1
    assert stats.replicas[1].probe == "fresh"


async def test_a_llama_server_prefilling_another_tenants_prompt_gets_no_primary() -> None:
    """End to end over loopback: a's /slots shows another tenant's long prefill, so both
    callers' primaries go to b; once a's slot frees, a takes primaries again."""
    async with FakeReplica(name="a") as a, FakeReplica(name="b") as b:
        a.pages["/slots"] = llama_slots_page([(7800, 0), None, None, None])
        b.pages["/slots"] = llama_slots_page([None, None, None, None])
        probe = LoadProbe("llama.cpp", interval=0.05)
        replicas = [
            th.Replica(a.url, name="a", probe=probe),
            th.Replica(b.url, name="b", probe=probe),
        ]
        config = attrs.evolve(PLAIN, hedge_after=None)
        async with th.Hedger(replicas, config) as hedger:
            await _polled(a, b)
            assert {r.probe for r in hedger.statistics().replicas} == {"fresh"}
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            first = [await run(hedger.stream(body)) for _ in range(3)]
            assert {r.attempts[0].replica for r in first} == {"b"}
            assert hedger.statistics().replicas[0].predicted_wait == pytest.approx(7.8)


async def test_backup_priority_goes_on_backups_only() -> None:
    async with FakeReplica(Behaviour(ttft=5.0), name="a") as a, FakeReplica(name="b") as b:
        replicas = [
            th.Replica(a.url, name="a", backup_priority=1),
            th.Replica(b.url, name="b", backup_priority=1),
        ]
        config = attrs.evolve(PLAIN, pick="in_order", hedge_after=0.05)
        async with th.Hedger(replicas, config) as hedger:
            report = await run(hedger.stream({"model": "m", "messages": []}))
    assert _route(report) == [("a", "primary", O.CANCELLED), ("b", "hedge", O.WON)]
    assert "priority" not in a.requests[0].json
    assert b.requests[0].json["priority"] == 1
