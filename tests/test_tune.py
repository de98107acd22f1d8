"""``trio-hedge tune``: reading TTFT logs (its own records, ``LoggingHook``'s lines, a JSON
formatter's output), replaying them through the delay learner and budget, and the command on
logs the library itself wrote."""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import hedger as hedger_module
from trio_hedge.cli import main
from trio_hedge.instrumentation import LoggingHook
from trio_hedge.tune import (
    Candidate,
    Prediction,
    TTFTRecord,
    baseline,
    parse_records,
    recommend,
    replay,
)

from .fleet import Fleet, run
from .scripted import Script

# -- reading ------------------------------------------------------------------------------------

OWN = [
    '{"ts": 100.0, "prompt_tokens": 300, "replica": "a", "ttft": 0.25}',
    '{"ts": 101.5, "prompt_chars": 4000, "model": "m", "ttft": 0.5, "attempt": 2}',
    '{"ts": 99.0, "group": "g", "cancelled_at": 1.0}',
    '{"ts": 102.0, "failed_at": 0.1}',
    "",
]


def test_own_records() -> None:
    assert parse_records(OWN) == [
        TTFTRecord(99.0, "g", None, None, 1, 1.0, False),
        TTFTRecord(100.0, "default", 300, "a", 1, 0.25, True),
        TTFTRecord(101.5, "m", 1000, None, 2, 0.5, True),
        TTFTRecord(102.0, "default", None, None, 1, 0.1, False, failed=True),
    ]


HOOK_TEXT = [
    "DEBUG:trio_hedge:attempt_started ts=10.0 request_id=r1 replica=a group=m attempt=1 "
    "trigger=primary outcome=running",
    "DEBUG:trio_hedge:committed ts=12.5 request_id=r1 replica=b group=m attempt=2 "
    "trigger=hedge outcome=won ttft=0.5",
    "DEBUG:trio_hedge:attempt_cancelled ts=12.5 request_id=r1 replica=a group=m attempt=1 "
    "trigger=primary outcome=cancelled ran=2.5",
    "DEBUG:trio_hedge:request_finished ts=12.6 request_id=r1 group=m winner=2 hedged=True "
    "ttft=2.5 prompt_tokens=812",
    "INFO:somebody.else:an unrelated line",
]


def test_logging_hook_lines_are_joined_per_request() -> None:
    assert parse_records(HOOK_TEXT) == [
        TTFTRecord(10.0, "m", 812, "a", 1, 2.5, False),
        TTFTRecord(12.0, "m", 812, "b", 2, 0.5, True),
    ]
    # The same records from a JSON formatter (the fields under "trio_hedge").
    as_json = []
    for line in HOOK_TEXT[:4]:
        message = line.split(":", 2)[2]
        fields = dict(kv.split("=") for kv in message.split()[1:])
        as_json.append(json.dumps({"message": message, "trio_hedge": fields}))
    assert parse_records(as_json) == parse_records(HOOK_TEXT)


BAD = [
    ('{"ts": 1, "ttft": 0.1', "line 1: not valid JSON"),
    ('{"ttft": 0.1}', "line 1: ts"),
    ('{"ts": 1, "ttft": 0.1, "cancelled_at": 0.2}', "line 1: give exactly one of"),
    ('{"ts": 1, "ttft": "soon"}', "line 1: ttft must be a number"),
    ('{"ts": 1, "ttft": -1}', "line 1: ttft must be a finite number >= 0"),
    ('{"ts": 1, "ttft": 0.1, "attempt": 0}', "line 1: attempt must be an int >= 1"),
]


@pytest.mark.parametrize(("line", "error"), BAD, ids=[b[1] for b in BAD])
def test_bad_records_name_the_line(line: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_records([line])


# -- the replay ---------------------------------------------------------------------------------


def _lognormal_log(n: int, rate: float, seed: int = 5) -> list[TTFTRecord]:
    """``n`` requests at ``rate`` per second, TTFT lognormal (median 0.5 s, sigma 0.6)."""
    rng = random.Random(seed)
    return [
        TTFTRecord(i / rate, "g", 100, None, 1, rng.lognormvariate(math.log(0.5), 0.6), True)
        for i in range(n)
    ]


def test_replay_hedges_about_one_minus_the_percentile() -> None:
    records = _lognormal_log(3000, 1.0)
    plain = baseline(records)
    p90 = replay(records, Candidate(0.9, None))
    p99 = replay(records, Candidate(0.99, None))
    # About 10% and 1% of the requests cross their learned delay ...
    assert (p90.hedge_rate, p90.extra) == (0.099, 0.099)
    assert p99.hedge_rate == p99.extra == 32 / 3000
    # ... and the tail shrinks: P99 2.13 s without hedging, 1.72 s at the P90.
    assert plain.p99 == pytest.approx(2.1302, abs=1e-4)
    assert p90.p99 == pytest.approx(1.7174, abs=1e-4)
    assert p99.p99 == pytest.approx(2.0792, abs=1e-4)
    assert p90.p50 == plain.p50  # requests under the delay are untouched


def test_the_budget_refuses_what_it_cannot_afford() -> None:
    # 10 requests a second: at the P80 about 20% would hedge; a 5% budget (plus its floor of
    # 0.5/s over 60 s) refuses the rest.
    records = _lognormal_log(3000, 10.0)
    free = replay(records, Candidate(0.8, None))
    tight = replay(records, Candidate(0.8, 0.05))
    assert (free.extra, free.budget_refusals) == (575 / 3000, 0)
    assert (tight.extra, tight.budget_refusals) == (0.099, 277)
    assert tight.p99 > free.p99
    assert recommend([free, tight], max_extra=0.1) is tight
    assert recommend([free, tight], max_extra=0.05) is None


def test_a_cancelled_primary_is_a_lower_bound() -> None:
    # A log from a hedging client: the slow primaries were cancelled when a backup won.
    # Replayed, the caller's TTFT of a hedged request is bounded by the backup's time.
    records = _lognormal_log(2000, 1.0)
    cancelled = [
        TTFTRecord(r.ts, r.group, r.prompt_tokens, r.replica, 1, 1.2, False)
        if r.seconds > 1.2
        else r
        for r in records
    ]
    assert sum(not r.observed for r in cancelled) == 147
    p90 = replay(cancelled, Candidate(0.9, None))
    assert p90.hedge_rate == 0.1015
    # Those primaries' TTFTs are unknown: a hedged one's caller TTFT is its backup's time,
    # an upper bound (the primary might have answered sooner).
    assert p90.p99 == pytest.approx(1.9872, abs=1e-4)


@pytest.mark.parametrize("budget", [0.1, None])
def test_a_candidates_code_is_the_config_it_describes(budget: float | None) -> None:
    config = eval(Candidate(0.95, budget).code(), {"th": th})
    assert config.hedge_after == th.LearnedDelay(percentile=0.95)
    assert config.budget == (None if budget is None else th.policy.HedgeBudget(ratio=budget))


def test_a_log_without_ttfts_is_an_error() -> None:
    with pytest.raises(ValueError, match="no primary attempt with a TTFT"):
        replay([TTFTRecord(0.0, "g", None, None, 1, 1.0, False)], Candidate(0.9, None))


# -- the command on logs the library wrote -------------------------------------------------------


async def _hedger_log(caplog: pytest.LogCaptureFixture) -> th.Hedger:
    """300 requests, 0.5 s apart, through a Hedger whose replicas are stuck for 3 s 5% of
    the time, logged by LoggingHook at DEBUG."""
    rng = random.Random(11)
    fleet = Fleet(
        ["a", "b"],
        lambda _n, _i: Script(ttft=3.0 if rng.random() < 0.05 else rng.uniform(0.2, 0.4), tokens=1),
    )
    caplog.set_level(logging.DEBUG, logger="trio_hedge")
    config = th.HedgerConfig(budget=None, outlier_detection=None, pick="in_order")
    hedger = th.Hedger(fleet.sources(), config, on_event=[LoggingHook()])
    for i in range(300):
        await run(hedger.stream(None, request_id=f"r{i}", prompt_tokens=100))
        await trio.sleep(0.5)
    return hedger


async def test_tune_reads_the_logging_hooks_log(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    hedger = await _hedger_log(caplog)
    log = tmp_path / "trio_hedge.log"
    log.write_text("\n".join(f"{r.levelname}:{r.name}:{r.getMessage()}" for r in caplog.records))
    records = parse_records(log.read_text().splitlines())
    stats = hedger.statistics()
    assert len(records) == stats.attempts  # every attempt got a first token or was cancelled
    assert sum(not r.observed for r in records) == stats.hedges_sent
    assert {r.prompt_tokens for r in records} == {100}
    assert main(["tune", str(log), "--percentiles", "0.8,0.9", "--budgets", "0,0.1"]) == 0
    out = capsys.readouterr().out
    assert f"{stats.attempts} attempts ({stats.hedges_sent} cancelled" in out
    assert "recommended: P" in out
    # The recommendation pastes as printed: it says what `th` is.
    code = [line.removeprefix("    ") for line in out.splitlines() if line.startswith("    ")]
    assert code[0] == "import trio_hedge as th"
    assert code[1].startswith("th.HedgerConfig(hedge_after=th.LearnedDelay(percentile=")
    namespace: dict[str, object] = {}
    exec(code[0], namespace)
    assert isinstance(eval(code[1], namespace), th.HedgerConfig)


async def test_tune_reads_what_a_hedger_exports(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    hedger = await _hedger_log(caplog)
    samples = hedger.samples()
    stats = hedger.statistics()
    assert len(samples) == stats.attempts  # all in the learner's 300 s window
    assert samples[0].keys() == {"ts", "group", "prompt_tokens", "replica", "attempt", "ttft"}
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    assert main(["tune", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["requests"] == sum(s["attempt"] == 1 for s in samples)
    assert len(result["candidates"]) == 4 * 3
    assert result["recommended"]["extra"] <= 0.1


def test_tune_plots_a_cdf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    log = tmp_path / "log.jsonl"
    log.write_text(
        "".join(
            json.dumps({"ts": r.ts, "prompt_tokens": 100, "ttft": r.seconds}) + "\n"
            for r in _lognormal_log(500, 1.0)
        )
    )
    png = tmp_path / "cdf.png"
    assert main(["tune", str(log), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"CDF plot: {png}" in capsys.readouterr().out


CLI_ERRORS = [
    (["tune", "/nonexistent/ttft.jsonl"], "cannot read /nonexistent/ttft.jsonl"),
    (["tune", "EMPTY"], "no primary attempt with a TTFT"),
    (["tune", "BAD"], "line 2: not valid JSON"),
    (["tune", "BAD", "--percentiles", "ninety"], "--percentiles must be comma-separated"),
]


@pytest.mark.parametrize(("argv", "error"), CLI_ERRORS, ids=[e[1] for e in CLI_ERRORS])
def test_tune_errors_exit_2(
    argv: list[str], error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "EMPTY").write_text("")
    (tmp_path / "BAD").write_text('{"ts": 1, "ttft": 0.1}\n{"ts": \n')
    argv = [str(tmp_path / a) if a in ("EMPTY", "BAD") else a for a in argv]
    assert main(argv) == 2
    assert error in capsys.readouterr().err


def _prediction(percentile: float, budget: float | None, extra: float, p99: float) -> Prediction:
    return Prediction(Candidate(percentile, budget), 100, extra, extra, 0.1, 0.5, p99, 0, ())


RECOMMEND = [
    # (max_extra, tolerance, recommended (percentile, budget))
    (0.1, 0.05, (0.95, 0.1)),  # P95 is within 5% of P90's P99 at half the cost
    (0.1, 0.0, (0.9, 0.1)),  # no tolerance: the best P99 affordable
    (0.3, 0.0, (0.8, None)),  # P80 affordable now; its only budget is none
    (0.01, 0.05, None),  # nothing that cheap
]


@pytest.mark.parametrize(("max_extra", "tolerance", "expected"), RECOMMEND)
def test_recommend(
    max_extra: float, tolerance: float, expected: tuple[float, float | None] | None
) -> None:
    predictions = [
        _prediction(0.8, None, 0.2, 0.9),
        _prediction(0.9, 0.05, 0.09, 1.0),  # a budget below the extra requests it needs
        _prediction(0.9, 0.1, 0.09, 1.0),
        _prediction(0.9, None, 0.09, 1.0),
        _prediction(0.95, 0.2, 0.05, 1.03),
        _prediction(0.95, 0.1, 0.05, 1.03),  # the smallest budget above its extra requests
    ]
    best = recommend(predictions, max_extra, tolerance)
    got = None if best is None else (best.candidate.percentile, best.candidate.budget)
    assert got == expected


async def test_a_hedgers_samples_are_replayed_from_their_attempts_start(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 16: samples() wrote when each attempt's first token (or cancel) was observed, and
    # tune reads `ts` as the attempt's start: every record was replayed one TTFT late (a
    # backup after its own primary's commit, a primary after its backup started).
    fleet = Fleet(["a", "b"], lambda _n, info: Script(ttft=(2.0, 0.5)[info.number - 1], tokens=1))
    config = th.HedgerConfig(
        hedge_after=th.LearnedDelay(fallback=1.0), budget=None, outlier_detection=None
    )
    hedger = th.Hedger(fleet.sources(), attrs.evolve(config, pick="in_order"))
    await trio.sleep(10.0)
    t0 = trio.current_time()
    report = await run(hedger.stream(None, prompt_tokens=100))
    await trio.sleep(5.0)  # exported later: the records do not move
    # Unix time = Trio time + 1,000,000 s, exactly.
    monkeypatch.setattr(
        hedger_module, "time", SimpleNamespace(time=lambda: trio.current_time() + 1e6)
    )
    records = parse_records(json.dumps(record) for record in hedger.samples())
    primary, backup = report.attempts
    assert (primary.started_at, backup.started_at) == (0.0, 1.0)  # from the request's start
    assert records == [
        # Lost: censored when its backup was sent (1.0 s), not at its cancel (1.5 s).
        TTFTRecord(1e6 + t0, "default", 100, "a", 1, 1.0, False),
        TTFTRecord(1e6 + t0 + 1.0, "default", 100, "b", 2, 0.5, True),
    ]


@pytest.mark.parametrize(("requests", "caveat"), [(2, True), (99, True), (100, False)])
def test_a_short_log_says_its_p99_is_rough(
    requests: int, caveat: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A 2-line log printed P99s like any other, with no word that two samples make no P99.
    log = tmp_path / "short.jsonl"
    lines = [json.dumps({"ts": float(i), "ttft": 0.1 + i / 1000}) + "\n" for i in range(requests)]
    log.write_text("".join(lines))
    assert main(["tune", str(log)]) == 0
    out = capsys.readouterr().out
    assert (f"caveat: {requests} requests are too few for a P99" in out) is caveat
    assert "no hedging: TTFT P50" in out
