"""``trio-hedge tune``: choose the hedging policy from your own TTFT logs.

The advice of "The Tail at Scale" (Dean & Barroso, CACM 2013) is to log a while of latencies
and hedge at the percentile you can afford. This replays such a log offline through the
Hedger's own delay learner ([`LearnedDelay`][trio_hedge.LearnedDelay]: per size class,
censoring-aware, the prefill model for classes short of data) and hedge budget
([`HedgeBudget`][trio_hedge.policy.HedgeBudget])
for a few candidate percentiles and budgets, and predicts for each the hedge rate, the extra
requests and a bound on the P99 TTFT the callers would see, then recommends one.

The log: JSON lines, one attempt (or one request) each, in any of three shapes:

* this module's own records, which [`trio_hedge.Hedger.samples`][trio_hedge.Hedger.samples] writes:
  ``ts`` (Unix seconds), ``prompt_tokens`` (or ``prompt_chars``), ``group`` (or ``model``),
  ``replica``, ``attempt`` (1 = the primary; default 1) and one of ``ttft`` (seconds to the first
  token), ``cancelled_at`` (seconds it ran before it was cancelled without one) or ``failed_at``;
* a JSON log formatter's output of [`LoggingHook`][trio_hedge.instrumentation.LoggingHook] (an
  object with the event's ``message`` and its fields under ``trio_hedge``);
* ``LoggingHook``'s text lines as the standard ``logging`` writes them (``committed
  ts=… request_id=… ttft=…``; keep its DEBUG lines: commits are DEBUG).

``LoggingHook`` records are joined per request id: each attempt is a record, the request's
prompt size comes from its ``request_finished`` line.

The replay, per candidate, in time order: each request's primary is hedged when its logged
TTFT exceeds the learned delay at that moment (and the budget allows), each backup's TTFT is
drawn (seeded) from the logged TTFTs of the same group and size class (the replay assumes the
replicas are independent: a fleet that slows down all at once is what the budget is for), and
the learner observes what the Hedger would have observed (the loser censored at the commit).
The caller's TTFT of a hedged request is ``min(primary, delay + backup)``; where the log has
only a lower bound for the primary (it was cancelled: a hedge won, or the caller left), the
backup's time is used, an upper bound: so the P99 printed is a bound, not a guess. A primary
the log saw cancelled before the delay, and not hedged, is imputed from the same class's
longer TTFTs (Efron's redistribution to the right), or its lower bound when there are none.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import re
import sys
from collections.abc import Iterable, Sequence
from typing import IO, Any

import attrs

from .policy._budget import BudgetState, HedgeBudget
from .policy._delay import DelayModel, LearnedDelay
from .policy._quantiles import empirical_quantile

__all__ = [
    "Candidate",
    "Prediction",
    "TTFTRecord",
    "add_parser",
    "parse_records",
    "recommend",
    "replay",
    "run",
]

#: Default candidates: percentiles × budget ratios.
PERCENTILES = (0.8, 0.9, 0.95, 0.99)
BUDGETS = (0.05, 0.1, 0.2)

_EVENT = re.compile(r"\b(committed|attempt_cancelled|attempt_failed|request_finished) (.*)$")
_FIELD = re.compile(r"(\w+)=(\S+)")


@attrs.frozen
class TTFTRecord:
    """One attempt from a log.

    Attributes:
        ts: when it started (Unix seconds, or any clock shared by the whole log).
        group: what the delay is learned per (the model).
        prompt_tokens: the prompt's size in tokens, or ``None`` when unknown.
        replica: where it ran, or ``None``.
        attempt: 1 for a request's primary, 2, 3… for its backups.
        seconds: its TTFT (``observed``), or how long it ran before it was cancelled.
        observed: whether it got a first token.
        failed: it failed before its first token (not a TTFT sample; its request is left out).
    """

    ts: float
    group: str
    prompt_tokens: int | None
    replica: str | None
    attempt: int
    seconds: float
    observed: bool
    failed: bool = False


@attrs.frozen
class Candidate:
    """A policy to try.

    Attributes:
        percentile: the TTFT quantile to hedge at, in ``(0, 1)``.
        budget: the hedge budget, in backups per request, or ``None`` for no budget.
    """

    percentile: float
    budget: float | None

    def describe(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {self.budget:.0%}"
        return f"P{self.percentile * 100:g}, {budget}"

    def code(self) -> str:
        """This candidate as a [`HedgerConfig`][trio_hedge.HedgerConfig] expression, with
        ``th`` standing for ``import trio_hedge as th``."""
        budget = "None" if self.budget is None else f"th.policy.HedgeBudget(ratio={self.budget:g})"
        return (
            f"th.HedgerConfig(hedge_after=th.LearnedDelay(percentile={self.percentile:g}), "
            f"budget={budget})"
        )


@attrs.frozen
class Prediction:
    """What a [`Candidate`][trio_hedge.tune.Candidate] would have done to the log.

    Attributes:
        candidate: the candidate.
        requests: requests replayed.
        hedge_rate: the fraction of requests that would send at least one backup.
        extra: extra requests (backups) per request.
        p50: the callers' median TTFT (seconds); an upper bound where the log only had a
            lower bound for the primary (as for ``p90`` and ``p99``).
        p90: the callers' P90 TTFT (seconds).
        p99: the callers' P99 TTFT (seconds).
        budget_refusals: hedges the budget would have refused.
        ttfts: the per-request TTFTs (for a plot).
    """

    candidate: Candidate
    requests: int
    hedge_rate: float
    extra: float
    p50: float
    p90: float
    p99: float
    budget_refusals: int
    ttfts: tuple[float, ...] = attrs.field(repr=False)


# -- reading ------------------------------------------------------------------------------------


def _number(value: object, what: str, line: int) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"line {line}: {what} must be a number")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"line {line}: {what} must be a number") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"line {line}: {what} must be a finite number >= 0")
    return number


def _tokens(fields: dict[str, Any], line: int, chars_per_token: float) -> int | None:
    if fields.get("prompt_tokens") is not None:
        return round(_number(fields["prompt_tokens"], "prompt_tokens", line))
    if fields.get("prompt_chars") is not None:
        return round(_number(fields["prompt_chars"], "prompt_chars", line) / chars_per_token)
    return None


def _own_record(fields: dict[str, Any], line: int, chars_per_token: float) -> TTFTRecord:
    kinds = [k for k in ("ttft", "cancelled_at", "failed_at") if fields.get(k) is not None]
    if len(kinds) != 1:
        raise ValueError(f"line {line}: give exactly one of ttft, cancelled_at, failed_at")
    (kind,) = kinds
    if "ts" not in fields:
        raise ValueError(f"line {line}: ts (the time, Unix seconds) is missing")
    group = fields.get("group", fields.get("model")) or "default"
    attempt = fields.get("attempt", 1)
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"line {line}: attempt must be an int >= 1")
    replica = fields.get("replica")
    return TTFTRecord(
        ts=_number(fields["ts"], "ts", line),
        group=str(group),
        prompt_tokens=_tokens(fields, line, chars_per_token),
        replica=None if replica is None else str(replica),
        attempt=attempt,
        seconds=_number(fields[kind], kind, line),
        observed=kind == "ttft",
        failed=kind == "failed_at",
    )


def _hook_fields(line: str) -> tuple[str, dict[str, str]] | None:
    """(event kind, fields) of a ``LoggingHook`` text line, or ``None``."""
    match = _EVENT.search(line)
    if match is None:
        return None
    return match[1], dict(_FIELD.findall(match[2]))


def parse_records(lines: Iterable[str], *, chars_per_token: float = 4.0) -> list[TTFTRecord]:
    """The attempts in a log (see the module docs for the shapes accepted), in time order.

    Raises:
        ValueError: a line that is none of the shapes, or a record missing a field (the
            message names the line number and the field, never its content).
    """
    records: list[TTFTRecord] = []
    attempts: list[tuple[int, str, dict[str, Any]]] = []  # LoggingHook attempt lines
    prompts: dict[str, int] = {}  # request id -> prompt tokens (LoggingHook)
    for number, raw in enumerate(lines, 1):
        text = raw.strip()
        if not text:
            continue
        hook: tuple[str, dict[str, Any]] | None = None
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"line {number}: not valid JSON") from None
            if not isinstance(obj, dict):
                raise ValueError(f"line {number}: not a JSON object")
            if isinstance(obj.get("trio_hedge"), dict):
                parsed = _hook_fields(str(obj.get("message", obj.get("msg", ""))))
                if parsed is not None:
                    hook = (parsed[0], dict(obj["trio_hedge"]))
            elif any(k in obj for k in ("ttft", "cancelled_at", "failed_at")):
                records.append(_own_record(obj, number, chars_per_token))
                continue
        else:
            hook = _hook_fields(text)
        if hook is None:
            continue  # another log line: not ours
        kind, fields = hook
        rid = fields.get("request_id")
        if rid is None:
            continue
        if kind == "request_finished":
            if fields.get("prompt_tokens") not in (None, "None"):
                prompts[str(rid)] = round(_number(fields["prompt_tokens"], "prompt_tokens", number))
            continue
        attempts.append((number, kind, fields))
    for number, kind, fields in attempts:
        if "ts" not in fields or "attempt" not in fields:
            raise ValueError(f"line {number}: a LoggingHook line without ts or attempt")
        observed = kind == "committed" and fields.get("ttft") not in (None, "None")
        if observed:
            seconds = _number(fields["ttft"], "ttft", number)
        elif fields.get("ran") is not None:
            seconds = _number(fields["ran"], "ran", number)
        else:
            continue  # an empty answer won (no token to time)
        rid = str(fields["request_id"])
        replica = fields.get("replica")
        records.append(
            TTFTRecord(
                ts=_number(fields["ts"], "ts", number) - seconds,  # the attempt's start
                group=str(fields.get("group") or "default"),
                prompt_tokens=prompts.get(rid),
                replica=None if replica is None else str(replica),
                attempt=int(_number(fields["attempt"], "attempt", number)),
                seconds=seconds,
                observed=observed,
                failed=kind == "attempt_failed",
            )
        )
    records.sort(key=lambda r: r.ts)
    return records


# -- the replay ---------------------------------------------------------------------------------


@attrs.frozen
class _Request:
    ts: float
    group: str
    size_class: int
    tokens: int | None
    seconds: float  # the primary's TTFT, or a lower bound on it
    observed: bool


def _requests(records: Sequence[TTFTRecord], delay: LearnedDelay) -> list[_Request]:
    """The primaries that got a first token or were cancelled (failed ones are left out)."""
    out = []
    for r in records:
        if r.attempt != 1 or r.failed:
            continue
        size = 0 if r.prompt_tokens is None else delay.classes.of(r.prompt_tokens)
        out.append(_Request(r.ts, r.group, size, r.prompt_tokens, r.seconds, r.observed))
    return out


def _pools(
    records: Sequence[TTFTRecord], delay: LearnedDelay
) -> dict[tuple[str, int], list[float]]:
    """The logged TTFTs (every attempt that got a first token), per (group, size class),
    sorted: what a backup's TTFT is drawn from."""
    pools: dict[tuple[str, int], list[float]] = {}
    for r in records:
        if r.observed:
            size = 0 if r.prompt_tokens is None else delay.classes.of(r.prompt_tokens)
            pools.setdefault((r.group, size), []).append(r.seconds)
    everything = sorted(t for ts in pools.values() for t in ts)
    for key in pools:
        pools[key].sort()
    pools[("", -1)] = everything
    return pools


def _draw(pools: dict[tuple[str, int], list[float]], key: tuple[str, int], rng: random.Random,
          above: float = -1.0) -> float | None:  # fmt: skip
    """A logged TTFT of ``key``'s class (of the whole log when the class has none), above
    ``above`` when given; ``None`` when there is none."""
    pool = pools.get(key) or pools[("", -1)]
    if above >= 0:
        start = _bisect_right(pool, above)
        if start == len(pool):
            return None
        return pool[rng.randrange(start, len(pool))]
    return pool[rng.randrange(len(pool))] if pool else None


def _bisect_right(values: list[float], x: float) -> int:
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if x < values[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def replay(
    records: Sequence[TTFTRecord],
    candidate: Candidate,
    *,
    delay: LearnedDelay | None = None,
    replicas: int = 2,
    seed: int = 0,
) -> Prediction:
    """Replay ``records`` through the delay learner and budget of ``candidate``.

    Args:
        records: from [`parse_records`][trio_hedge.tune.parse_records].
        candidate: the percentile and budget to try.
        delay: the other [`LearnedDelay`][trio_hedge.LearnedDelay] settings (window, min_samples,
            classes…); its percentile is replaced by the candidate's. Default the Hedger's.
        replicas: how many replicas a request may use (at most ``replicas − 1`` backups, the
            ``k``-th sent ``k`` hedge delays after the primary).
        seed: for the backups' draws.

    Raises:
        ValueError: no request in ``records`` has a TTFT or a cancellation time.
    """
    base = LearnedDelay() if delay is None else delay
    config = attrs.evolve(base, percentile=candidate.percentile)
    requests = _requests(records, config)
    if not requests or not any(r.observed for r in records):
        raise ValueError("the log holds no primary attempt with a TTFT to replay")
    pools = _pools(records, config)
    model = DelayModel(config)
    budget = None if candidate.budget is None else BudgetState(HedgeBudget(ratio=candidate.budget))
    rng = random.Random(seed)
    # Events in time order: (time, order, request index, seconds since the request's start:
    # kept apart from the time, whose rounding at Unix-time magnitudes is ~1e-7 s). Each
    # request's state: its hedge delay, its attempts (start offset, TTFT: inf when the log
    # does not know it), whether more hedges may go.
    events = [(r.ts, i, i, 0.0) for i, r in enumerate(requests)]
    heapq.heapify(events)
    order = len(events)
    delays: list[float] = [0.0] * len(requests)
    attempts: list[list[tuple[float, float]]] = [[] for _ in requests]
    open_: list[bool] = [True] * len(requests)
    ttfts = [math.inf] * len(requests)
    hedged = [0] * len(requests)
    refused = 0

    def at(i: int, offset: float) -> None:
        nonlocal order
        heapq.heappush(events, (requests[i].ts + offset, order, i, offset))
        order += 1

    def next_check(i: int) -> None:
        """The next moment request ``i`` changes: its commit, or its next hedge delay."""
        caller = min(start + t for start, t in attempts[i])
        hedge = delays[i] * len(attempts[i]) if open_[i] else math.inf
        when = min(caller, hedge)
        if math.isfinite(when):
            at(i, when)

    while events:
        now, _, i, elapsed = heapq.heappop(events)
        r = requests[i]
        key = (r.group, r.size_class)
        if not attempts[i]:  # the request starts
            if budget is not None:
                budget.request(now)
            delays[i] = d = model.delay(r.group, r.size_class, now, r.tokens)
            primary = r.seconds if r.observed else math.inf
            if not r.observed and r.seconds < d:
                # Cancelled (by its caller) before the delay: whether it would have crossed
                # it is unknown; its TTFT is imputed from the class's longer ones.
                primary = _draw(pools, key, rng, above=r.seconds) or r.seconds
            attempts[i].append((0.0, primary))
            open_[i] = replicas > 1
            next_check(i)
            continue
        caller = min(start + t for start, t in attempts[i])
        if caller <= elapsed:  # committed: what the learner sees
            ttfts[i] = caller
            for start, t in attempts[i]:
                if start + t == caller:
                    model.observe(r.group, r.size_class, now, t, True, r.tokens)
                elif start < caller:
                    model.observe(r.group, r.size_class, now, caller - start, False, r.tokens)
            continue
        # The hedge delay has passed with no first token.
        if budget is not None and not budget.allows(now):
            refused += 1
            open_[i] = False
            if not math.isfinite(caller):  # the log's lower bound, or an imputed TTFT
                attempts[i][0] = (0.0, _draw(pools, key, rng, above=r.seconds) or r.seconds)
            next_check(i)
            continue
        if budget is not None:
            budget.spend(now)
        backup = _draw(pools, key, rng)
        assert backup is not None  # the log has at least one TTFT
        hedged[i] += 1
        attempts[i].append((elapsed, backup))
        open_[i] = len(attempts[i]) < replicas
        next_check(i)

    return _prediction(candidate, ttfts, hedged, refused)


def _prediction(
    candidate: Candidate, ttfts: list[float], hedged: list[int], refused: int
) -> Prediction:
    n = len(ttfts)

    def q(p: float) -> float:
        value = empirical_quantile(ttfts, p)
        assert value is not None
        return value

    return Prediction(
        candidate=candidate,
        requests=n,
        hedge_rate=sum(1 for h in hedged if h) / n,
        extra=sum(hedged) / n,
        p50=q(0.5),
        p90=q(0.9),
        p99=q(0.99),
        budget_refusals=refused,
        ttfts=tuple(ttfts),
    )


def baseline(records: Sequence[TTFTRecord], *, delay: LearnedDelay | None = None,
             seed: int = 0) -> Prediction:  # fmt: skip
    """No hedging: each request's primary as logged (a primary the log saw cancelled is
    imputed from the same class's longer TTFTs, else its lower bound)."""
    config = LearnedDelay() if delay is None else delay
    requests = _requests(records, config)
    if not requests:
        raise ValueError("the log holds no primary attempt with a TTFT to replay")
    pools = _pools(records, config)
    rng = random.Random(seed)
    ttfts = []
    for r in requests:
        t = r.seconds
        if not r.observed:
            t = _draw(pools, (r.group, r.size_class), rng, above=r.seconds) or r.seconds
        ttfts.append(t)
    return _prediction(Candidate(percentile=0.5, budget=None), ttfts, [0] * len(ttfts), 0)


def recommend(
    predictions: Sequence[Prediction], max_extra: float, tolerance: float = 0.05
) -> Prediction | None:
    """The cheapest candidate whose P99 bound is within ``tolerance`` of the best among those
    costing at most ``max_extra`` extra requests per request ("the largest percentile whose
    P99 is good enough", ``docs/policy.md``); ties: the lower P99, then a budget that refused
    nothing and sits above the extra requests (so that normal traffic never meets it; the
    smallest such), then no budget last. ``None`` when no candidate is that cheap."""
    affordable = [p for p in predictions if p.extra <= max_extra + 1e-12]
    if not affordable:
        return None
    best = min(p.p99 for p in affordable)
    good = [p for p in affordable if p.p99 <= best * (1 + tolerance) + 1e-12]

    def budget_rank(p: Prediction) -> tuple[int, float]:
        ratio = p.candidate.budget
        if ratio is None:
            return (2, 0.0)
        fits = p.budget_refusals == 0 and ratio >= p.extra
        return (0 if fits else 1, ratio if fits else -ratio)

    return min(good, key=lambda p: (p.extra, p.p99, budget_rank(p)))


# -- the command --------------------------------------------------------------------------------


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated numbers") from None


#: `trio-hedge tune --help`'s description: plain text (argparse prints it as it is).
_DESCRIPTION = (
    "Choose the hedging policy from your own TTFT logs: replay them through the Hedger's delay "
    "learner (LearnedDelay) and hedge budget (HedgeBudget) for a few candidate percentiles and "
    "budgets, print what each would have cost and bought, and recommend one. "
    "LOG: JSON lines, one attempt each, as Hedger.samples() writes them or your own (ts, "
    "prompt_tokens or prompt_chars, and ttft or cancelled_at, in seconds); or LoggingHook's "
    "log lines, as text or from a JSON formatter (keep its DEBUG lines). "
    "Every field and how to read the output: docs/tuning.md."
)


def add_parser(sub: Any) -> None:
    """Add the ``tune`` subcommand to the ``trio-hedge`` parser."""
    tune = sub.add_parser(
        "tune",
        help="replay a TTFT log through the learned delay and budget; recommend a policy",
        description=_DESCRIPTION,
    )
    tune.add_argument(
        "log",
        nargs="+",
        metavar="LOG",
        help="log file(s) in one of the formats above; - reads stdin",
    )
    tune.add_argument(
        "--percentiles",
        default=",".join(f"{p:g}" for p in PERCENTILES),
        help="candidate hedge percentiles, comma-separated (default: %(default)s)",
    )
    tune.add_argument(
        "--budgets",
        default=",".join(f"{b:g}" for b in BUDGETS),
        help="candidate budget ratios, backups per request, comma-separated; 0: no budget "
        "(default: %(default)s)",
    )
    tune.add_argument(
        "--max-extra",
        type=float,
        default=0.1,
        help="the extra requests you can afford, per request (default: %(default)s)",
    )
    tune.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="a P99 this close to the best is good enough: take the cheapest such "
        "(default: %(default)s)",
    )
    tune.add_argument(
        "--window",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="the learner's sliding window: seconds of observations it keeps "
        "(LearnedDelay.window; default: %(default)s)",
    )
    tune.add_argument(
        "--min-samples",
        type=int,
        default=20,
        metavar="N",
        help="observations a size class needs before its own percentile is used "
        "(LearnedDelay.min_samples; default: %(default)s)",
    )
    tune.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="the fleet size (default: as many as the log names, at least 2)",
    )
    tune.add_argument(
        "--chars-per-token",
        type=float,
        default=4.0,
        metavar="CHARS",
        help="characters per token, to size records that give prompt_chars (default: %(default)s)",
    )
    tune.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random draws of backup TTFTs: the same seed, the same table "
        "(default: %(default)s)",
    )
    tune.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="write the CDF of the callers' TTFT to PNG (needs matplotlib; default: no plot)",
    )
    tune.add_argument("--json", action="store_true", help="print the predictions as JSON")


def run(args: argparse.Namespace, out: IO[str]) -> int:
    """Run ``trio-hedge tune`` with parsed ``args``; returns the exit status.

    Raises:
        ValueError: a bad log or argument, a log file that cannot be read (the CLI prints it
            and exits 2).
    """
    percentiles = _floats(args.percentiles, "percentiles")
    budgets = [None if b == 0 else b for b in _floats(args.budgets, "budgets")]
    lines: list[str] = []
    for path in args.log:
        if path == "-":
            lines.extend(sys.stdin)
        else:
            try:
                with open(path, encoding="utf-8") as f:
                    lines.extend(f)
            except OSError as exc:
                raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    records = parse_records(lines, chars_per_token=args.chars_per_token)
    delay = LearnedDelay(window=args.window, min_samples=args.min_samples)
    names = {r.replica for r in records if r.replica is not None}
    replicas = args.replicas if args.replicas is not None else max(2, len(names))
    plain = baseline(records, delay=delay, seed=args.seed)
    predictions = [
        replay(records, Candidate(p, b), delay=delay, replicas=replicas, seed=args.seed)
        for p in percentiles
        for b in budgets
    ]
    best = recommend(predictions, args.max_extra, args.tolerance)
    if args.json:
        out.write(json.dumps(_to_json(plain, predictions, best), indent=2) + "\n")
    else:
        _print(out, records, plain, predictions, best, args.max_extra, replicas)
    if args.plot:
        _plot(args.plot, plain, predictions, best)
        out.write(f"CDF plot: {args.plot}\n")
    return 0


def _to_json(plain: Prediction, predictions: Sequence[Prediction],
             best: Prediction | None) -> dict[str, Any]:  # fmt: skip
    def row(p: Prediction) -> dict[str, Any]:
        return {
            "percentile": p.candidate.percentile,
            "budget": p.candidate.budget,
            "hedge_rate": p.hedge_rate,
            "extra": p.extra,
            "p50": p.p50,
            "p90": p.p90,
            "p99_bound": p.p99,
            "budget_refusals": p.budget_refusals,
        }

    return {
        "requests": plain.requests,
        "no_hedging": {"p50": plain.p50, "p90": plain.p90, "p99": plain.p99},
        "candidates": [row(p) for p in predictions],
        "recommended": None if best is None else row(best),
    }


#: Below this many requests a P99 is little more than the slowest one: the printout says so.
MIN_REQUESTS_FOR_P99 = 100


def _print(out: IO[str], records: Sequence[TTFTRecord], plain: Prediction,
           predictions: Sequence[Prediction], best: Prediction | None, max_extra: float,
           replicas: int) -> None:  # fmt: skip
    censored = sum(1 for r in records if not r.observed and not r.failed)
    groups = sorted({r.group for r in records})
    out.write(
        f"{len(records)} attempts ({censored} cancelled before a first token), "
        f"{plain.requests} requests, groups {', '.join(groups)}, {replicas} replicas\n"
    )
    if plain.requests < MIN_REQUESTS_FOR_P99:
        out.write(
            f"caveat: {plain.requests} requests are too few for a P99 (it takes at least "
            f"{MIN_REQUESTS_FOR_P99}: with fewer, the P99 is about the slowest TTFT seen); "
            "the figures below are rough, collect a longer log\n"
        )
    out.write(
        f"no hedging: TTFT P50 {plain.p50:.3f} s, P90 {plain.p90:.3f} s, P99 {plain.p99:.3f} s\n\n"
    )
    out.write(
        f"{'candidate':<24} {'hedged':>8} {'extra':>8} {'P50':>8} {'P90':>8} {'P99 <=':>8}"
        f" {'refused':>8}\n"
    )
    for p in predictions:
        mark = "  <- recommended" if p is best else ""
        out.write(
            f"{p.candidate.describe():<24} {p.hedge_rate:>8.1%} {p.extra:>8.1%} {p.p50:>8.3f} "
            f"{p.p90:>8.3f} {p.p99:>8.3f} {p.budget_refusals:>8}{mark}\n"
        )
    out.write("\n")
    if best is None:
        out.write(
            f"no candidate costs <= {max_extra:.0%} extra requests: raise --max-extra or try "
            "higher --percentiles\n"
        )
        return
    gain = plain.p99 / best.p99 if best.p99 > 0 else math.inf
    out.write(
        f"recommended: {best.candidate.describe()} (P99 <= {best.p99:.3f} s against "
        f"{plain.p99:.3f} s without hedging, {gain:.1f}x, for {best.extra:.1%} extra requests)\n"
        "    import trio_hedge as th\n"
        f"    {best.candidate.code()}\n"
        "(the replay assumes independent replicas; watch statistics() once it runs)\n"
    )


def _plot(path: str, plain: Prediction, predictions: Sequence[Prediction],
          best: Prediction | None) -> None:  # fmt: skip
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    curves = [("no hedging", plain)] + [(p.candidate.describe(), p) for p in predictions]
    for label, p in curves:
        xs = sorted(p.ttfts)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        width = 2.5 if p is best else 1.0
        ax.plot(xs, ys, label=label + (" (recommended)" if p is best else ""), linewidth=width)
    ax.set(xscale="log", xlabel="caller-visible TTFT (s)", ylabel="CDF", title="trio-hedge tune")
    ax.axhline(0.99, color="grey", linewidth=0.5, linestyle="--")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
