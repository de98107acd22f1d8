"""The judge (issue 27): one request's evidence, at each event, into verdicts -- by tables,
without I/O, tasks or a clock; the docs' "who is blamed for what" is the judge's own table;
and the planner keeps no rule about blame and writes no fleet state itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

import trio_hedge
from trio_hedge.errors import AttemptError, ErrorKind
from trio_hedge.policy import Attribution
from trio_hedge.policy._evidence import AttemptEvidence, Evidence, Outcome, Phase
from trio_hedge.policy._judge import (
    RULES,
    Effect,
    Event,
    EventKind,
    Rules,
    Verdict,
    judge,
    rule_rows,
)

ROOT = Path(trio_hedge.__file__).parent.parent
E = EventKind
O = Outcome  # noqa: E741


def err(
    kind: ErrorKind,
    status: int | None = None,
    *,
    retry_after: float | None = None,
    window: int | None = None,
    retryable: bool | None = None,
) -> AttemptError:
    return AttemptError(
        kind,
        "scripted",
        status_code=status,
        retry_after=retry_after,
        context_window=window,
        retryable=retryable,
    )


def att(
    number: int,
    replica: int,
    outcome: Outcome = O.RUNNING,
    *,
    error: AttemptError | None = None,
    started: float = 0.0,
    ttft: float | None = None,
    ended: float | None = None,
    fleet_delay: float | None = 1.0,
    hedged_after: float | None = None,
    refused: str | None = None,
    phase: Phase = Phase.RACE,
    trigger: str = "primary",
) -> AttemptEvidence:
    return AttemptEvidence(
        number=number,
        replica=replica,
        name="ab"[replica],
        trigger=trigger,
        started=started,
        phase=phase,
        fleet_delay=fleet_delay,
        hedged_after=hedged_after,
        refused=refused,
        outcome=outcome,
        error=error,
        ended=ended,
        ttft=ttft,
    )


def ev(*attempts: AttemptEvidence, winner: int | None = None, **fields: Any) -> Evidence:
    fields.setdefault("completed", True)  # the answer read to its end, unless a row says
    evidence = Evidence(
        model="m", group="m", size_class=0, tokens=10, tokens_exact=False, need=None, **fields
    )
    evidence.attempts = {a.number: a for a in attempts}
    evidence.failures = sum(a.outcome is O.FAILED for a in attempts)
    evidence.breaks = sum(a.outcome is O.BROKE for a in attempts)
    evidence.winner = winner
    evidence.began = 0.0
    return evidence


NOT_FOUND = err(ErrorKind.NOT_FOUND, 404)
E500 = err(ErrorKind.SERVER_ERROR, 500)
# An in-band server_error event: no status.
INBAND_500 = AttemptError(ErrorKind.SERVER_ERROR, "scripted", api_type="server_error")
E503 = err(ErrorKind.OVERLOADED, 503)
TRUSTED = Rules(attribution=Attribution(replica={ErrorKind.NOT_FOUND}))

#: (name, evidence, event, expected verdicts as (rule, effect, replica, value)); ``value`` is
#: the seconds of a cooldown, outage or latency, (seconds, observed) of a delay sample, the
#: tokens of a window or a refund, else None. Replica 0 is "a", 1 is "b".
TABLE: list[tuple[str, Evidence, Event, list[tuple[Any, ...]]]] = [
    (
        "a 400 is the request's",
        ev(att(1, 0, O.FAILED, error=err(ErrorKind.INVALID_REQUEST, 400))),
        Event(E.FAILED, 1),
        [("request", "nothing", 0, None)],
    ),
    (
        "after the commit the request's own fault",
        ev(att(1, 0, O.BROKE, error=err(ErrorKind.INVALID_REQUEST), ttft=0.2), winner=1),
        Event(E.BROKE, 1),
        [("after-commit-request", "nothing", 0, None)],
    ),
    (
        "a context-length error stating the window",
        ev(att(1, 0, O.FAILED, error=err(ErrorKind.CONTEXT_LENGTH_EXCEEDED, 400, window=4096))),
        Event(E.FAILED, 1),
        [("context", "window", 0, 4096)],
    ),
    (
        "a context-length error that states no window teaches nothing",
        ev(att(1, 0, O.FAILED, error=err(ErrorKind.CONTEXT_LENGTH_EXCEEDED, 400))),
        Event(E.FAILED, 1),
        [("context", "nothing", 0, None)],
    ),
    (
        "a second turn's 404 is nobody's",
        ev(att(1, 0, O.FAILED, error=NOT_FOUND), affinities=("previous_response_id",)),
        Event(E.FAILED, 1),
        [("affinity", "nothing", 0, None)],
    ),
    (
        "a second turn's 404, b serves: still nobody's at the end",
        ev(
            att(1, 0, O.FAILED, error=NOT_FOUND),
            att(2, 1, O.WON, ttft=0.1, trigger="failover"),
            winner=2,
            affinities=("previous_response_id",),
        ),
        Event(E.FINISHED),
        [("served", "success", 1, None)],
    ),
    (
        "a trusted caller's 404",
        ev(att(1, 0, O.FAILED, error=NOT_FOUND)),
        Event(E.FAILED, 1),
        [("trusted", "eject", 0, None)],
    ),
    (
        "404 at a: decided at the end",
        ev(att(1, 0, O.FAILED, error=NOT_FOUND)),
        Event(E.FAILED, 1),
        [],
    ),
    (
        "404 at a, b serves",
        ev(
            att(1, 0, O.FAILED, error=NOT_FOUND),
            att(2, 1, O.WON, ttft=0.1, trigger="failover"),
            winner=2,
        ),
        Event(E.FINISHED),
        [("misconfigured", "eject", 0, None), ("served", "success", 1, None)],
    ),
    (
        "404 everywhere",
        ev(att(1, 0, O.FAILED, error=NOT_FOUND), att(2, 1, O.FAILED, error=NOT_FOUND)),
        Event(E.FINISHED),
        [("everywhere", "nothing", 0, None), ("everywhere", "nothing", 1, None)],
    ),
    (
        "a 503",
        ev(att(1, 0, O.FAILED, error=E503)),
        Event(E.FAILED, 1),
        [("transient", "failure", 0, None), ("transient", "credit", None, None)],
    ),
    (
        "a request's second 503 takes a token at once",
        ev(att(1, 0, O.FAILED, error=E503), asked_credit=True, credit=True),
        Event(E.FAILED, 1),
        [("transient", "failure", 0, None), ("transient", "debit", None, None)],
    ),
    (
        "a 503 with Retry-After",
        ev(att(1, 0, O.FAILED, error=err(ErrorKind.OVERLOADED, 503, retry_after=2.0))),
        Event(E.FAILED, 1),
        [
            ("pushback", "cool", 0, 2.0),
            ("transient", "failure", 0, None),
            ("transient", "credit", None, None),
        ],
    ),
    (
        "a 500: its health waits for the end, its token does not",
        ev(att(1, 0, O.FAILED, error=E500)),
        Event(E.FAILED, 1),
        [("server-error", "credit", None, None)],
    ),
    (
        "a 500, b serves",
        ev(
            att(1, 0, O.FAILED, error=E500),
            att(2, 1, O.WON, ttft=0.1, trigger="failover"),
            winner=2,
        ),
        Event(E.FINISHED),
        [
            ("server-error", "failure", 0, None),
            ("server-error", "erred", 0, None),
            ("served", "success", 1, None),
        ],
    ),
    (
        "500 everywhere, fleet down",
        ev(att(1, 0, O.FAILED, error=E500), att(2, 1, O.FAILED, error=E500), credit=True),
        Event(E.FINISHED, served_since=frozenset()),
        [
            ("server-error", "failure", 0, None),
            ("server-error", "erred", 0, None),
            ("server-error", "failure", 1, None),
            ("server-error", "erred", 1, None),
            ("unserved", "credit_debited", None, None),
        ],
    ),
    (
        "a query of death",
        ev(
            att(1, 0, O.FAILED, error=E500),
            att(2, 1, O.FAILED, error=E500),
            credit=True,
            taken=1000,
        ),
        Event(E.FINISHED, served_since=frozenset({0, 1})),
        [
            ("query-of-death", "nothing", 0, None),
            ("query-of-death", "erred", 0, None),
            ("query-of-death", "nothing", 1, None),
            ("query-of-death", "erred", 1, None),
            ("query-of-death", "credit_released", None, None),
            ("query-of-death", "refund", None, 1000),
        ],
    ),
    (
        "a 500 from one replica only is no query of death",
        ev(att(1, 0, O.FAILED, error=E500), credit=True),
        Event(E.FINISHED, served_since=frozenset({0})),
        [
            ("server-error", "failure", 0, None),
            ("server-error", "erred", 0, None),
            ("unserved", "credit_debited", None, None),
        ],
    ),
    (
        "a 429 with Retry-After",
        ev(att(1, 0, O.FAILED, error=err(ErrorKind.RATE_LIMIT, 429, retry_after=2.0))),
        Event(E.FAILED, 1),
        [("pushback", "cool", 0, 2.0), ("pushback", "credit", None, None)],
    ),
    (
        "a 429 without Retry-After",
        ev(att(1, 0, O.FAILED, error=err(ErrorKind.RATE_LIMIT, 429))),
        Event(E.FAILED, 1),
        [
            ("rate-limit", "cool", 0, 1.0),
            ("rate-limit", "latency_floor", 0, 1.0),
            ("rate-limit", "credit", None, None),
        ],
    ),
    (
        "a Retry-After past the ceiling",
        ev(att(1, 0, O.FAILED, error=err(ErrorKind.RATE_LIMIT, 429, retry_after=3600.0))),
        Event(E.FAILED, 1),
        [("outage", "outage", 0, 300.0), ("outage", "credit", None, None)],
    ),
    (
        "a primary answers",
        ev(att(1, 0, O.WON, ttft=0.4), winner=1),
        Event(E.COMMITTED, 1),
        [
            ("first-token", "sample", 0, (0.4, True)),
            ("first-token", "latency", 0, 0.4),
            ("first-token", "throttle_success", None, None),
        ],
    ),
    (
        "a primary answers: final at the end",
        ev(att(1, 0, O.WON, ttft=0.4), winner=1),
        Event(E.FINISHED),
        [("served", "success", 0, None)],
    ),
    (
        "a failover answers: the credit and the tokens back",
        ev(
            att(1, 0, O.FAILED, error=E503),
            att(2, 1, O.WON, ttft=0.1, started=0.1, trigger="failover"),
            winner=2,
            credit=True,
            asked_credit=True,
            taken=500,
        ),
        Event(E.COMMITTED, 2),
        [
            ("first-token", "sample", 1, (0.1, True)),
            ("first-token", "latency", 1, 0.1),
            ("first-token", "throttle_success", None, None),
            ("first-token", "credit_released", None, None),
            ("first-token", "refund", None, 500),
        ],
    ),
    (
        "a primary whose hedge was refused",
        ev(att(1, 0, O.WON, ttft=3.0, refused="no_replica"), winner=1),
        Event(E.COMMITTED, 1),
        [
            ("unhedgeable", "sample", 0, (1.0, False)),
            ("first-token", "latency", 0, 3.0),
            ("first-token", "throttle_success", None, None),
        ],
    ),
    (
        "a lost race after the fleet's delay",
        ev(
            att(1, 0, hedged_after=1.0),
            att(2, 1, O.WON, started=1.0, ttft=0.2, trigger="hedge"),
            winner=2,
        ),
        Event(E.COMMITTED, 2),
        [
            ("first-token", "sample", 1, (0.2, True)),
            ("first-token", "latency", 1, 0.2),
            ("first-token", "throttle_success", None, None),
            ("slow", "slow", 0, None),
        ],
    ),
    (
        "a lost race within a caller's shorter delay is not slow",
        ev(
            att(1, 0, hedged_after=0.5),
            att(2, 1, O.WON, started=0.5, ttft=0.2, trigger="hedge"),
            winner=2,
        ),
        Event(E.COMMITTED, 2),
        [
            ("first-token", "sample", 1, (0.2, True)),
            ("first-token", "latency", 1, 0.2),
            ("first-token", "throttle_success", None, None),
        ],
    ),
    (
        "a lost race",
        ev(att(1, 0, O.LOST, ended=1.2, hedged_after=1.0), winner=2),
        Event(E.CANCELLED, 1),
        [("lost", "latency_floor", 0, 1.2), ("lost", "sample", 0, (1.0, False))],
    ),
    (
        "a backup that lost: censored at its cancel",
        ev(att(2, 1, O.LOST, started=1.0, ended=1.5, trigger="hedge"), winner=1),
        Event(E.CANCELLED, 2),
        [("lost", "latency_floor", 1, 0.5), ("lost", "sample", 1, (0.5, False))],
    ),
    (
        "a caller's cancel",
        ev(att(1, 0, O.CANCELLED, ended=0.5)),
        Event(E.CANCELLED, 1),
        [("cancelled", "latency_floor", 0, 0.5)],
    ),
    (
        "a caller's cancel past the fleet's delay",
        ev(att(1, 0, O.CANCELLED, ended=1.3)),
        Event(E.CANCELLED, 1),
        [("cancelled", "latency_floor", 0, 1.3), ("cancelled", "sample", 0, (1.3, False))],
    ),
    (
        "first_token_timeout",
        ev(att(1, 0, O.TIMEOUT, ended=2.0)),
        Event(E.CANCELLED, 1),
        [("timeout", "latency_floor", 0, 2.0), ("timeout", "sample", 0, (2.0, False))],
    ),
    (
        "a winner breaks",
        ev(att(1, 0, O.BROKE, error=err(ErrorKind.STREAM_TRUNCATED), ttft=0.2), winner=1),
        Event(E.BROKE, 1),
        [("break", "failure", 0, None), ("break", "credit", None, None)],
    ),
    (
        "a winner breaks with a 500",
        ev(att(1, 0, O.BROKE, error=INBAND_500, ttft=0.2), winner=1),
        Event(E.BROKE, 1),
        [("break", "credit", None, None)],  # its health at the end: a query of death?
    ),
    (
        "a 500 mid-answer, recovered elsewhere",
        ev(
            att(1, 0, O.BROKE, error=INBAND_500, ttft=0.2),
            att(2, 1, O.WON, ttft=0.1, phase=Phase.RECOVERY, trigger="recovery"),
            winner=2,
            credit=True,
        ),
        Event(E.FINISHED, served_since=frozenset({1})),
        [
            ("break", "failure", 0, None),
            ("break", "erred", 0, None),
            ("served", "success", 1, None),
            ("served", "credit_released", None, None),
        ],
    ),
    (
        "a query of death after the commit",
        ev(
            att(1, 0, O.BROKE, error=INBAND_500, ttft=0.2),
            att(2, 1, O.FAILED, error=INBAND_500, phase=Phase.RECOVERY, trigger="recovery"),
            winner=1,
            credit=True,
            taken=1000,
        ),
        Event(E.FINISHED, served_since=frozenset({1})),
        [
            ("query-of-death", "nothing", 0, None),
            ("query-of-death", "erred", 0, None),
            ("query-of-death", "nothing", 1, None),
            ("query-of-death", "erred", 1, None),
            ("query-of-death", "credit_released", None, None),
            ("query-of-death", "refund", None, 1000),
        ],
    ),
    (
        "a 502 from every replica is no query of death",
        ev(
            att(1, 0, O.FAILED, error=err(ErrorKind.SERVER_ERROR, 502)),
            att(2, 1, O.FAILED, error=err(ErrorKind.SERVER_ERROR, 502)),
            credit=True,
        ),
        Event(E.FINISHED, served_since=frozenset({0, 1})),
        [("unserved", "credit_debited", None, None)],  # each failure counted at the time
    ),
    (
        "the caller leaves before the end",
        ev(att(1, 0, O.WON, ttft=0.1), winner=1, completed=False),
        Event(E.FINISHED),
        [("left", "nothing", 0, None)],
    ),
    (
        "a crawling winner",
        ev(att(1, 0, O.BROKE, error=err(ErrorKind.SLOW_STREAM), ttft=0.2), winner=1),
        Event(E.BROKE, 1),
        [("crawl", "slow", 0, None)],
    ),
    (
        "a recovery's first-token deadline passes",
        ev(
            att(1, 0, O.BROKE, error=err(ErrorKind.STREAM_TRUNCATED), ttft=0.2),
            att(
                2,
                1,
                O.FAILED,
                error=err(ErrorKind.TIMEOUT),
                started=1.0,
                ended=4.0,
                trigger="recovery",
                phase=Phase.RECOVERY,
            ),
            winner=1,
        ),
        Event(E.FAILED, 2),
        [("recovery-deadline", "latency_floor", 1, 3.0)],
    ),
    (
        "a race attempt's timeout is its replica's",
        ev(att(1, 0, O.FAILED, error=err(ErrorKind.TIMEOUT), ended=4.0)),
        Event(E.FAILED, 1),
        [("transient", "failure", 0, None), ("transient", "credit", None, None)],
    ),
    (
        "a winner broke, b recovered it",
        ev(
            att(1, 0, O.BROKE, error=err(ErrorKind.STREAM_TRUNCATED), ttft=0.2),
            att(2, 1, O.WON, ttft=0.3, started=1.0, trigger="recovery", phase=Phase.RECOVERY),
            winner=2,
        ),
        Event(E.FINISHED),
        [("served", "success", 1, None)],
    ),
    (
        "a recovery's first new text is no TTFT",
        ev(
            att(1, 0, O.BROKE, error=err(ErrorKind.STREAM_TRUNCATED), ttft=0.2),
            att(2, 1, O.WON, ttft=0.3, started=1.0, trigger="recovery", phase=Phase.RECOVERY),
            winner=2,
            credit=True,
            asked_credit=True,
        ),
        Event(E.COMMITTED, 2),
        [
            ("first-token", "throttle_success", None, None),
            ("first-token", "credit_released", None, None),
        ],
    ),
    (
        "a winner broke and nothing recovered it: no success",
        ev(att(1, 0, O.BROKE, error=err(ErrorKind.STALL), ttft=0.2), winner=1, credit=True),
        Event(E.FINISHED),
        [("unserved", "credit_debited", None, None)],
    ),
    (
        "503 everywhere",
        ev(att(1, 0, O.FAILED, error=E503), att(2, 1, O.FAILED, error=E503), credit=True),
        Event(E.FINISHED),
        [("unserved", "credit_debited", None, None)],
    ),
]


def _value(v: Verdict) -> Any:
    if v.effect is Effect.SAMPLE:
        return (round(v.seconds, 9), v.observed)
    if v.effect in (Effect.COOL, Effect.OUTAGE, Effect.LATENCY, Effect.LATENCY_FLOOR):
        return round(v.seconds, 9)
    if v.effect in (Effect.WINDOW, Effect.REFUND):
        return v.tokens
    return None


def _verdicts(name: str, evidence: Evidence, event: Event) -> list[tuple[Any, ...]]:
    rules = TRUSTED if "trusted" in name else Rules()
    return [(v.rule, v.effect.value, v.replica, _value(v)) for v in judge(rules, evidence, event)]


@pytest.mark.parametrize(
    ("name", "evidence", "event", "expected"), TABLE, ids=[r[0] for r in TABLE]
)
def test_judge_rules(
    name: str, evidence: Evidence, event: Event, expected: list[tuple[Any, ...]]
) -> None:
    assert _verdicts(name, evidence, event) == expected


def test_the_judge_is_pure() -> None:
    # The same evidence and event give the same verdicts, and judging changes nothing.
    for name, evidence, event, _ in TABLE:
        before = repr(evidence)
        assert _verdicts(name, evidence, event) == _verdicts(name, evidence, event)
        assert repr(evidence) == before


def test_every_rule_is_reached_by_a_scenario() -> None:
    reached = {row[0] for _, evidence, event, expected in TABLE for row in expected}
    assert reached == {rule.id for rule in RULES}
    # And the judge names no rule the table lacks (its verdicts are made unchecked).
    source = (ROOT / "trio_hedge" / "policy" / "_judge.py").read_text()
    named = set(re.findall(r'(?:_v|_retry|_sample|Verdict)\(\s*"([a-z-]+)"', source))
    assert named <= {rule.id for rule in RULES}, named - {rule.id for rule in RULES}
    assert len(named) >= 15


def test_the_docs_table_is_the_judges_table() -> None:
    text = (ROOT / "docs" / "guarantees.md").read_text()
    start = text.index("| what happened | whose | what changes | tests |")
    table = text[start:].split("\n\n", 1)[0].splitlines()
    assert table == rule_rows(), "regenerate it: python -m trio_hedge.policy._judge"


def test_every_test_a_rule_names_exists() -> None:
    defined = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))
    for rule in RULES:
        for test in rule.tests:
            base = test.split("[", 1)[0]
            assert base in defined, f"{rule.id}: no test named {base}"
            if "[" in test:
                row = test.split("[", 1)[1].rstrip("]")
                assert row in {r[0] for r in TABLE} or base != "test_judge_rules", test


#: What changes fleet state: only the writer (and the state's own methods) may call these
#: or assign to the fleet's records.
MUTATORS = {
    "failure",
    "success",
    "eject",
    "push_back",
    "observe",
    "observe_latency",
    "observe_lower_bound",
    "spend",
    "request",
    "refund",
    "succeeded",
    "make",
    "record",
    "started",
    "cancelled",
}


@pytest.mark.parametrize(
    "module", ["_planner.py", "_routing.py", "_recovery_limits.py", "_timing.py"]
)
def test_the_planner_keeps_no_blame_rules_and_writes_no_fleet_state(module: str) -> None:
    # The planner records its request's evidence and asks the judge; the writer applies the
    # verdicts. It neither calls what changes the fleet's records (but through the writer)
    # nor assigns to anything but its own fields and its evidence. Nor does what it asks
    # where an attempt goes, when it hedges and whether a backup may go, or the recovery's
    # limits (functions that return, and assign nothing).
    source = (ROOT / "trio_hedge" / "policy" / module).read_text()
    tree = ast.parse(source)
    inits = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    assert len(inits) == (module == "_planner.py")
    init_ends = max((init.end_lineno or 0 for init in inits), default=0)  # (takes the fleet)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if node.func.attr in MUTATORS and owner != "self._writer":
                problems.append(f"line {node.lineno}: {ast.unparse(node.func)}()")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if module != "_planner.py" and isinstance(target, (ast.Subscript, ast.Attribute)):
                problems.append(f"line {node.lineno}: {ast.unparse(target)} = ...")  # its inputs
            while isinstance(target, ast.Subscript):  # x[k] = ... changes x
                target = target.value
            if isinstance(target, ast.Attribute):
                owner = ast.unparse(target.value)
                if owner not in {
                    "self",
                    "evidence",
                    "attempt",
                    "before",
                    "self._evidence",
                    "applied",
                } or (owner == "self" and target.attr == "_fleet" and node.lineno > init_ends):
                    problems.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
    # And no error kind or fault is read there: whose fault it is, is the judge's.
    assert "Fault." not in source and "ErrorKind." not in source
    assert problems == []
