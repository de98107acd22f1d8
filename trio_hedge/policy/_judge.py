"""The judge: one request's evidence, at each event, turned into verdicts on the fleet.

Every consumer of what a request saw -- health and ejection, cooldowns, the retry throttle,
the peak-EWMA pick, the delay learner, the learned context windows and readiness -- reads it
through one place: `judge`, a plain synchronous function of the request's evidence
(``_evidence.py``) and one event (an attempt failed, the first
token, an attempt cancelled, the winner broke, the request finished). It returns
`Verdict`\\ s -- a scope (nobody, a replica, a replica for one model, the fleet) and an effect --
and does nothing: the fleet's one writer (``_writer.py``) applies them. So "who is blamed
for what" is one table (`RULES`); ``docs/guarantees.md`` prints it, and a test checks that the
two agree and that every rule is reached by a scenario.

Anchors: Finagle's one ``ResponseClassifier`` read by failure accrual, retries and stats
alike; Envoy's outlier detector, told each host's result with its origin; httpcore's pool,
which decides on pure state and returns what to do, the I/O after.

The rules that took the most thought:

* **A success is final only when the request ends unbroken.** A winner that breaks after
  the commit counts one failure at the break; its replica's run is reset only when a request
  it served ends without a break (a replica that breaks every stream used to be reset by each
  commit and was never ejected).
* **Blame waits for the evidence.** A key, quota or "not found" error, and a plain 500, are
  the replica's only when another replica served the same request; from every replica tried
  they are the request's (a model nobody serves, a caller's key, a *query of death* -- a
  request that crashes every server it reaches, while those servers serve everyone else).
* **Affinity is nobody's fault.** A "not found" for a request bound to state only one
  replica holds (a Responses ``previous_response_id``) says the replica lacks that state.
* **Busy is not broken.** A lost race moves the pick (the loser's latency estimate rises)
  and counts against health only *relative to the other replicas* (``_writer.py``'s slow
  detector, as Envoy's success-rate detection compares hosts), never as a run of one. So
  does a winner that crawls below the throughput floor; a recovery not begun by its
  first-token deadline (its prompt is the whole answer so far) only raises the pick's
  estimate.
* **The throttle decides a failover at the failure that causes it** (gRFC A6's check,
  taken where the failure happens, not a scheduler batch later): a request's first failure
  goes on credit, released when it is served and debited at its end if not; the writer
  bounds the credit by the hedge budget, so a fleet that fails whole still stays within
  the storm bound.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import NamedTuple

import attrs

from ..errors import AttemptError, ErrorKind
from ._blame import Attribution, Fault
from ._evidence import AttemptEvidence, Evidence, Outcome, Phase

__all__ = [
    "QUERY_OF_DEATH_WINDOW",
    "RULES",
    "Effect",
    "Event",
    "EventKind",
    "Rule",
    "Rules",
    "Scope",
    "Verdict",
    "judge",
]


#: Seconds before a request's end within which another request's first token shows the fleet
#: serving: then a 500 from every replica the request reached is the request's (a query of
#: death). A fleet failing whole stops serving: once its last first token is this old, its
#: 500s count against the replicas again (and the throttle closes).
QUERY_OF_DEATH_WINDOW = 10.0


class Scope(enum.Enum):
    """What a verdict changes: nothing, one replica (every model), one replica for one model,
    or the fleet (throttle, delay learner)."""

    NOBODY = "nobody"
    REPLICA = "replica"
    REPLICA_MODEL = "replica+model"
    FLEET = "fleet"


class Effect(enum.Enum):
    """What a verdict does (the writer's vocabulary)."""

    NOTHING = "nothing"  # recorded: the rule that found nobody at fault
    FAILURE = "failure"  # one failure in the replica's run (ejected at consecutive_failures)
    SUCCESS = "success"  # the run of failures and the ejection count reset (final)
    EJECT = "eject"  # ejected for the model at once (its own misconfiguration)
    OUTAGE = "outage"  # ejected for the model for ``seconds`` (a Retry-After past the ceiling)
    COOL = "cool"  # no attempt for the model for ``seconds``
    SLOW = "slow"  # lost a race after the fleet's delay: slow, in its window
    #: It answered first (``seconds``, its TTFT): a sample for the peak-EWMA pick, and an
    #: attempt judged not slow in its window.
    LATENCY = "latency"
    LATENCY_FLOOR = "latency_floor"  # its latency is at least ``seconds`` (never lowered)
    SAMPLE = "sample"  # a delay-learner sample: ``seconds``, ``observed`` or censored
    WINDOW = "window"  # its context window for the model is ``tokens`` (stated by the server)
    CREDIT = "credit"  # the request's first failure asks the throttle for credit
    DEBIT = "debit"  # one throttle token taken
    CREDIT_RELEASED = "credit_released"  # served: the credit is given back, nothing taken
    CREDIT_DEBITED = "credit_debited"  # unserved: the credit becomes a token taken
    REFUND = "refund"  # served: the tokens its failures took (``tokens`` thousandths) back
    THROTTLE_SUCCESS = "throttle_success"  # a first token: the throttle's token_ratio back
    #: It answered a 500: not "serving other requests" again until its next first token
    #: (the query-of-death rule's evidence: a fleet that fails whole is no query of death).
    ERRED = "erred"


_SCOPES = {
    Effect.NOTHING: Scope.NOBODY,
    Effect.FAILURE: Scope.REPLICA,
    Effect.SUCCESS: Scope.REPLICA,
    Effect.EJECT: Scope.REPLICA_MODEL,
    Effect.OUTAGE: Scope.REPLICA_MODEL,
    Effect.COOL: Scope.REPLICA_MODEL,
    Effect.SLOW: Scope.REPLICA,
    Effect.LATENCY: Scope.REPLICA,
    Effect.LATENCY_FLOOR: Scope.REPLICA,
    Effect.SAMPLE: Scope.FLEET,
    Effect.WINDOW: Scope.REPLICA_MODEL,
    Effect.ERRED: Scope.REPLICA,
    Effect.CREDIT: Scope.FLEET,
    Effect.DEBIT: Scope.FLEET,
    Effect.CREDIT_RELEASED: Scope.FLEET,
    Effect.CREDIT_DEBITED: Scope.FLEET,
    Effect.REFUND: Scope.FLEET,
    Effect.THROTTLE_SUCCESS: Scope.FLEET,
}


class Verdict(NamedTuple):
    """One thing a request's evidence changes (internal): ``rule`` says which row of `RULES`
    found it. (A named tuple: a request makes a handful, on every request's path.)"""

    rule: str
    effect: Effect
    replica: int | None = None  # the replica's index; None for the fleet or nobody
    model: str | None = None  # for a replica+model verdict
    seconds: float = 0.0
    observed: bool = True  # a SAMPLE: a first token (True) or censored (False)
    tokens: int = 0  # a WINDOW's size; a REFUND's thousandths
    reason: str = ""  # an error kind's value, "slow": for events, logs and metrics
    attempt: int = 0  # the attempt it is about (a SAMPLE's, for the learner's record)
    #: A SAMPLE's time (the Trio time it stands for: the attempt's start plus ``seconds``),
    #: or ``None``: now.
    at: float | None = None
    #: A LATENCY or LATENCY_FLOOR of a time to first token: the writer takes off what the
    #: prefill model puts down to the prompt's size (a long prompt does not mark its replica
    #: slow), with the model as it stands once this event's sample is in.
    excess: bool = False

    @property
    def scope(self) -> Scope:
        return _SCOPES[self.effect]


class EventKind(enum.Enum):
    FAILED = "attempt failed"
    COMMITTED = "first token"
    CANCELLED = "attempt cancelled"
    BROKE = "winner broke after the commit"
    FINISHED = "request finished"


class Event(NamedTuple):
    """What happened (internal): ``number`` is the attempt; ``served_since``: at the end, the
    replicas serving other requests lately (a first token in the last
    `QUERY_OF_DEATH_WINDOW` seconds, and none of their 500s since it): a query of death is
    known by it."""

    kind: EventKind
    number: int = 0
    served_since: frozenset[int] = frozenset()


@attrs.frozen
class Rules:
    """What the judge needs of the configuration (internal; from ``HedgerConfig``).

    Attributes:
        attribution: whose fault each kind of error is (the caller's overrides).
        count_slow: whether slowness may count against health (relative, ``_writer.py``).
        max_pushback_wait: seconds of ``Retry-After`` that are a wait; longer is an outage
            of that replica for that model. ``None``: every pushback is a wait.
        rate_limit_cooldown: seconds a 429 without ``Retry-After`` cools its replica for
            that model.
        max_ejection: the longest ejection, seconds (an outage's too).
    """

    attribution: Attribution = attrs.field(factory=Attribution)
    count_slow: bool = True
    max_pushback_wait: float | None = 10.0
    rate_limit_cooldown: float = 1.0
    max_ejection: float = 300.0


@attrs.frozen
class Rule:
    """One row of "who is blamed for what" (``docs/guarantees.md``)."""

    id: str
    what: str
    whose: str
    changes: str
    tests: tuple[str, ...]


#: Every rule the judge applies, in the order of ``docs/guarantees.md``'s table (generated
#: from this: ``tests/test_judge.py`` checks both ways).
RULES: tuple[Rule, ...] = (
    Rule(
        "request",
        "an error that is the request's: not retryable (400, 413, 422; a usage-policy "
        "refusal), or a kind in `Attribution.caller` (a forwarded key's 401)",
        "the request's",
        "nothing; before the commit the request fails (`FatalAttemptError`)",
        ("test_judge_rules[a 400 is the request's]", "test_whose_fault_an_error_is"),
    ),
    Rule(
        "after-commit-request",
        "after the commit, an in-band error that is the request's (not retryable)",
        "the request's",
        "nothing; the stream ends with `StreamInterrupted` (partial text kept), not recovered",
        (
            "test_judge_rules[after the commit the request's own fault]",
            "test_the_requests_own_fault_after_the_commit_is_not_recovered",
        ),
    ),
    Rule(
        "context",
        "a context-length error",
        "the request's, for that replica's window",
        "the request may fail over to a replica that declares a larger window; the window is "
        "learned for (replica, model) only when the server states it (`maximum context length "
        "is 4096`, llama-server's `n_ctx`): an estimated size never teaches it",
        (
            "test_judge_rules[a context-length error stating the window]",
            "test_a_window_is_learned_only_from_a_stated_size",
        ),
    ),
    Rule(
        "affinity",
        'a "not found" for a request bound to state only some replicas hold (a Responses '
        "`previous_response_id`, a `conversation`)",
        "nobody's",
        "nothing: the replica lacks that state, not the model",
        (
            "test_judge_rules[a second turn's 404 is nobody's]",
            "test_a_second_turn_ejects_nobody",
        ),
    ),
    Rule(
        "trusted",
        "a kind in `Attribution.replica` (a trusted caller)",
        "that replica's, for that model, at once",
        "ejected for that model at once (the cap applies)",
        ("test_judge_rules[a trusted caller's 404]", "test_whose_fault_an_error_is"),
    ),
    Rule(
        "misconfigured",
        "404/401/403/quota from one replica while another served the same request",
        "that replica's, for that model",
        "ejected for that model at once (the cap applies), decided at the request's end; "
        "the failover was at once",
        ("test_judge_rules[404 at a, b serves]", "test_whose_fault_an_error_is"),
    ),
    Rule(
        "everywhere",
        "404/401/403/quota and no replica served the request (a model nobody serves, the "
        "caller's own key)",
        "the request's",
        "nothing",
        (
            "test_judge_rules[404 everywhere]",
            "test_a_bad_request_changes_nothing_another_caller_gets",
        ),
    ),
    Rule(
        "transient",
        "a transient error: 503, 5xx other than 500, connection, timeout, a truncated, empty or "
        "malformed stream",
        "its replica's",
        "one failure in its run; a throttle token (the request's first on credit)",
        ("test_judge_rules[a 503]", "test_one_replica_down_every_request_is_served"),
    ),
    Rule(
        "server-error",
        "a 500 (or an in-band `server_error`) while another replica served the request, or "
        "while the replicas tried served nobody else",
        "its replica's, decided at the request's end",
        "one failure in its run; its throttle token stands; it serves nobody else until its "
        "next first token (for the query-of-death rule)",
        (
            "test_judge_rules[a 500, b serves]",
            "test_judge_rules[500 everywhere, fleet down]",
            "test_a_fleet_failing_whole_right_after_serving_gets_one_attempt_per_request",
        ),
    ),
    Rule(
        "query-of-death",
        "a 500 from every replica tried (two or more), before or after the commit, while the "
        "fleet serves other requests (another request's first token there in the last 10 s, "
        "and no 500 since)",
        "the request's (a query of death)",
        "nothing: no failure, its throttle tokens given back",
        (
            "test_judge_rules[a query of death]",
            "test_judge_rules[a query of death after the commit]",
            "test_a_query_of_death_leaves_another_callers_rescues",
            "test_a_query_of_death_after_the_commit_leaves_another_callers_rescues",
        ),
    ),
    Rule(
        "pushback",
        "a 429 or 503 with `Retry-After` up to `max_pushback_wait`",
        "pushback, for that model",
        "(replica, model) cools that long, and takes attempts again the moment it ends; a "
        "throttle token (on credit as above); a 503 is also one failure",
        (
            "test_judge_rules[a 429 with Retry-After]",
            "test_pushback_for_one_model_does_not_cool_another",
        ),
    ),
    Rule(
        "rate-limit",
        "a 429 without `Retry-After`",
        "pushback, for that model",
        "(replica, model) cools for `rate_limit_cooldown` (1 s); its latency estimate is at "
        "least that, so the pick moves; a throttle token",
        (
            "test_judge_rules[a 429 without Retry-After]",
            "test_a_429_without_retry_after_moves_the_primary",
        ),
    ),
    Rule(
        "outage",
        "a `Retry-After` longer than `max_pushback_wait` (an hour's quota reset)",
        "that replica's, for that model",
        "ejected for that model for the `Retry-After` (at most `max_ejection`): an outage, not "
        "a wait (cooling as long when the ejection cap holds it in); a throttle token",
        (
            "test_judge_rules[a Retry-After past the ceiling]",
            "test_a_long_retry_after_is_an_outage",
        ),
    ),
    Rule(
        "first-token",
        "an attempt's first token (the commit)",
        "—",
        "its TTFT is a delay sample and a latency sample; the throttle gets `token_ratio` back, "
        "and the tokens and credit its request's failures took",
        ("test_judge_rules[a primary answers]", "test_one_replica_down_every_request_is_served"),
    ),
    Rule(
        "unhedgeable",
        "the first token of an attempt whose backup was refused (no replica, budget, throttle)",
        "—",
        "a delay sample censored at its delay, not its TTFT: the tail is not learned from "
        "requests that had nowhere to hedge",
        (
            "test_judge_rules[a primary whose hedge was refused]",
            "test_requests_that_could_not_hedge_do_not_raise_the_delay",
        ),
    ),
    Rule(
        "lost",
        "an attempt cancelled because another attempt of its request won",
        "nobody's",
        "its latency estimate may only rise (the run time is a lower bound); a delay sample "
        "censored when its backup was sent, if that was at the fleet's own delay (censored at "
        "the cancel, every loser added its backup's TTFT and the delay ratcheted up)",
        (
            "test_judge_rules[a lost race]",
            "test_a_lost_race_never_makes_the_loser_look_fast",
            "test_loser_censoring_does_not_ratchet_the_delay",
        ),
    ),
    Rule(
        "slow",
        "an attempt that lost a race after waiting the fleet's own delay (not a caller's "
        "shorter `hedge_after`)",
        "its replica's, relative to the others",
        "counted slow in its window: ejected only when its share of slow attempts is "
        "`slow_margin` above another replica's over `slow_window`, and never when fewer than "
        "two replicas would be left for a request to hedge between (`count_slow=False`: "
        "nothing)",
        (
            "test_judge_rules[a lost race after the fleet's delay]",
            "test_busy_replicas_are_not_ejected_for_losing_races",
            "test_a_short_hedge_delay_is_the_callers_choice",
        ),
    ),
    Rule(
        "cancelled",
        "an attempt the caller cancelled (or its request's failure elsewhere cut short)",
        "the caller's choice",
        "a delay sample censored at its run time only past the fleet's delay; its latency "
        "estimate may only rise",
        (
            "test_judge_rules[a caller's cancel]",
            "test_a_callers_cancel_is_a_delay_sample_only_past_the_fleets_delay",
        ),
    ),
    Rule(
        "timeout",
        "an attempt `first_token_timeout` ended",
        "the fleet's cut",
        "a delay sample censored at its run time; its latency estimate may only rise",
        ("test_judge_rules[first_token_timeout]",),
    ),
    Rule(
        "break",
        "the winner breaks after the commit (a cut, a stall, a malformed event, a transient "
        "in-band error)",
        "its replica's",
        "one failure in its run, at the break (a 500's at the request's end, as "
        "`server-error`: a query of death?); the recovery is a failover, its throttle "
        "decided then",
        (
            "test_judge_rules[a winner breaks]",
            "test_judge_rules[a winner breaks with a 500]",
            "test_judge_rules[a 500 mid-answer, recovered elsewhere]",
            "test_a_replica_that_breaks_every_stream_is_ejected",
        ),
    ),
    Rule(
        "crawl",
        "the winner's tokens fall below the throughput floor (`ThroughputFloor`: alive, "
        "far slower than its replica's learned rate)",
        "its replica's, relative to the others",
        "counted slow in its window, as a slow lost race is (not a failure, no throttle "
        "token); the answer is finished elsewhere, or read on to its end when no replica "
        "can take it over (then it served the request)",
        (
            "test_judge_rules[a crawling winner]",
            "test_a_crawl_is_slow_not_a_failure",
        ),
    ),
    Rule(
        "recovery-deadline",
        "a recovery with no output by its first-token deadline (its prompt is the whole "
        "answer so far)",
        "nobody's: busy, not broken",
        "its latency estimate may only rise; no failure, no throttle token; the recovery goes "
        "on on another replica",
        (
            "test_judge_rules[a recovery's first-token deadline passes]",
            "test_a_busy_recovery_replica_is_not_blamed",
        ),
    ),
    Rule(
        "served",
        "the request ends with its whole answer read, unbroken (recovered or not)",
        "—",
        "success for the replica that finished the answer: its run of failures and its "
        "ejection count reset",
        (
            "test_judge_rules[a primary answers]",
            "test_a_replica_that_breaks_every_stream_is_ejected",
        ),
    ),
    Rule(
        "left",
        "the caller leaves before the answer's end (its own deadline, a client gone)",
        "—",
        "nothing: no success (the replica may have been about to stall), no failure; the "
        "first token's samples stand",
        (
            "test_judge_rules[the caller leaves before the end]",
            "test_a_stalled_winner_the_caller_left_is_not_a_success",
        ),
    ),
    Rule(
        "unserved",
        "the request ends unserved, its first failure on credit",
        "—",
        "the credit becomes a throttle token taken",
        ("test_judge_rules[503 everywhere]", "test_a_failing_fleet_stays_within_the_storm_bound"),
    ),
)


#: Verdicts are made on every request's path: no checks here (test_judge.py checks that every
#: rule a verdict names is one of `RULES`, and that each is reached).
_v = Verdict


def stated_window(error: AttemptError) -> int | None:
    """The context window a context-length error states (``AttemptError.context_window``),
    or ``None``."""
    window = error.context_window
    return window if window is not None and window > 0 else None


def _throttle(evidence: Evidence) -> Verdict:
    """A failure's throttle verdict: the request's first asks for credit, the rest debit."""
    if not evidence.asked_credit:
        return _v("transient", _EFFECT_CREDIT)
    return _v("transient", _EFFECT_DEBIT)


def _retry(rule: str, verdict: Verdict) -> Verdict:
    return verdict._replace(rule=rule)


def _pushback(
    rules: Rules, evidence: Evidence, attempt: AttemptEvidence, error: AttemptError, fault: Fault
) -> list[Verdict]:
    """A rate limit or an overloaded replica that says when to come back."""
    r, model = attempt.replica, evidence.model
    after = error.retry_after
    out: list[Verdict] = []
    reason = error.kind.value
    ceiling = rules.max_pushback_wait
    if after is not None and after > 0 and ceiling is not None and after > ceiling:
        seconds = min(after, rules.max_ejection)
        out.append(
            _v("outage", _EFFECT_OUTAGE, replica=r, model=model, seconds=seconds, reason=reason)
        )
        out.append(_retry("outage", _throttle(evidence)))
        return out
    if after is None or after <= 0:
        if fault is not Fault.PUSHBACK:
            return out  # a 503 without Retry-After: a transient failure only
        rule = "rate-limit"
        after = rules.rate_limit_cooldown
    else:
        rule = "pushback"
    if after > 0:
        out.append(_v(rule, _EFFECT_COOL, replica=r, model=model, seconds=after, reason=reason))
        if rule == "rate-limit":
            # It said nothing of when: the pick stays off it beyond the guess, as its
            # latency estimate decays (with a Retry-After it is back at the very moment).
            out.append(_v(rule, _EFFECT_LATENCY_FLOOR, replica=r, seconds=after))
    if fault is Fault.PUSHBACK:
        out.append(_retry(rule, _throttle(evidence)))
    return out


#: In-band error types that are the server's own internal error: a 500 inside a stream
#: already begun (the OpenAI APIs' ``server_error``, Anthropic's ``api_error``).
_INTERNAL_ERROR_TYPES = frozenset({"server_error", "api_error"})


def _is_500(error: AttemptError | None) -> bool:
    """A server's own internal error: an HTTP 500, or an in-band internal error event (no
    status: the stream had begun). Not a 502/504: a proxy's word on its upstream."""
    if error is None or error.kind is not _ERRORKIND_SERVER_ERROR:
        return False
    status = error.status_code
    return status == 500 or (status is None and error.api_type in _INTERNAL_ERROR_TYPES)


def _affinity_miss(evidence: Evidence, error: AttemptError) -> bool:
    return bool(evidence.affinities) and error.kind is _ERRORKIND_NOT_FOUND


def _failed(rules: Rules, evidence: Evidence, attempt: AttemptEvidence) -> list[Verdict]:
    error = attempt.error
    assert error is not None
    r, model = attempt.replica, evidence.model
    if error.kind is _ERRORKIND_CONTEXT_LENGTH_EXCEEDED:
        window = stated_window(error)
        if window is None:
            return [_v("context", _EFFECT_NOTHING, replica=r)]
        return [_v("context", _EFFECT_WINDOW, replica=r, model=model, tokens=window)]
    if (
        attempt.phase is _PHASE_RECOVERY
        and error.kind is _ERRORKIND_TIMEOUT
        and (attempt.recovery is None or attempt.recovery.first_output is None)
    ):
        # A recovery's prompt is the whole answer so far: a replica that has not begun it
        # by its deadline is busy, not broken (the recovery goes on elsewhere). Its wait is
        # a floor beyond the request's prefill, as a lost race's is (its own prompt is
        # longer still: the floor errs high, never low).
        ran = (attempt.ended or attempt.started) - attempt.started
        return [_v("recovery-deadline", _EFFECT_LATENCY_FLOOR, replica=r, seconds=ran, excess=True)]
    fault = rules.attribution.fault(error)
    if fault is Fault.REQUEST:
        return [_v("request", _EFFECT_NOTHING, replica=r)]
    if _affinity_miss(evidence, error):
        return [_v("affinity", _EFFECT_NOTHING, replica=r)]
    if fault is Fault.MISCONFIGURED:
        return [_v("trusted", _EFFECT_EJECT, replica=r, model=model, reason=error.kind.value)]
    if fault is Fault.UNDECIDED:
        return []  # settled at the request's end (_settle)
    out = _pushback(rules, evidence, attempt, error, fault)
    if fault is Fault.PUSHBACK:
        return out
    # Fault.REPLICA: a transient error of its making.
    if any(v.effect is _EFFECT_OUTAGE for v in out):
        return out
    if not _is_500(error):
        out.append(_v("transient", _EFFECT_FAILURE, replica=r, reason=error.kind.value))
    # A 500's health waits for the end (a query of death?); its throttle token does not.
    out.append(
        _retry("server-error", _throttle(evidence)) if _is_500(error) else _throttle(evidence)
    )
    return out


def _sample(
    rule: str, attempt: AttemptEvidence, seconds: float, *, observed: bool = True
) -> Verdict:
    """A delay sample of ``attempt``: ``seconds`` from its start, observed or censored."""
    # Positional (it is made on every request's path): rule, effect, replica, model,
    # seconds, observed, tokens, reason, attempt, at.
    return Verdict(
        rule, _EFFECT_SAMPLE, attempt.replica, None, seconds, observed, 0, "",
        attempt.number, attempt.started + seconds,
    )  # fmt: skip


_THROTTLE_SUCCESS = Verdict("first-token", Effect.THROTTLE_SUCCESS)


def _committed(evidence: Evidence, attempt: AttemptEvidence) -> list[Verdict]:
    out: list[Verdict] = []
    r = attempt.replica
    if attempt.phase is _PHASE_RACE and attempt.ttft is not None:
        if attempt.refused is not None and attempt.fleet_delay is not None:
            # Nowhere to hedge: what it waited past its delay says nothing of a hedged
            # request's tail.
            seconds = min(attempt.ttft, attempt.fleet_delay)
            out.append(_sample("unhedgeable", attempt, seconds, observed=False))
        else:
            out.append(_sample("first-token", attempt, attempt.ttft))
        out.append(_v("first-token", _EFFECT_LATENCY, replica=r, seconds=attempt.ttft, excess=True))
    out.append(_THROTTLE_SUCCESS)
    if evidence.credit:
        out.append(_v("first-token", _EFFECT_CREDIT_RELEASED))
    if evidence.taken:
        out.append(_v("first-token", _EFFECT_REFUND, tokens=evidence.taken))
    if attempt.phase is _PHASE_RACE and len(evidence.attempts) > 1:
        for other in evidence.attempts.values():
            if (
                other is not attempt
                and other.outcome is _OUTCOME_RUNNING
                and other.phase is _PHASE_RACE
                and other.hedged_after is not None
                and other.fleet_delay is not None
                and attempt.ttft is not None
                and (attempt.started + attempt.ttft) - other.started >= other.fleet_delay
            ):
                out.append(_v("slow", _EFFECT_SLOW, replica=other.replica, reason="slow"))
    return out


def _cancelled(attempt: AttemptEvidence) -> list[Verdict]:
    if attempt.phase is _PHASE_RECOVERY or attempt.ttft is not None or attempt.ended is None:
        return []  # a recovery's time to new text is no TTFT, not even a censored one
    r = attempt.replica
    ran = attempt.ended - attempt.started
    fleet_delay = attempt.fleet_delay
    floor = _v("lost", _EFFECT_LATENCY_FLOOR, replica=r, seconds=ran, excess=True)
    if attempt.outcome is _OUTCOME_LOST:
        out = [floor]
        # Censored when its backup was sent (what the fleet knew when it decided), if that
        # was at the fleet's own delay; an attempt nothing was sent for (the backup that
        # lost), when it was cancelled.
        censor = ran if attempt.hedged_after is None else attempt.hedged_after
        if attempt.hedged_after is None or (
            fleet_delay is not None and censor >= fleet_delay - 1e-9
        ):
            out.append(_sample("lost", attempt, censor, observed=False))
        return out
    if attempt.outcome is _OUTCOME_TIMEOUT:
        return [
            _retry("timeout", floor),
            _sample("timeout", attempt, ran, observed=False),
        ]
    out = [_retry("cancelled", floor)]
    if fleet_delay is not None and ran >= fleet_delay:
        out.append(_sample("cancelled", attempt, ran, observed=False))
    return out


def transient(rules: Rules, error: AttemptError) -> bool:
    """Whether ``error`` is its replica's transient fault or pushback (a 5xx, a rate limit,
    a connection error...): worth one more try on a preferred replica before a fallback."""
    return rules.attribution.fault(error) in (Fault.REPLICA, Fault.PUSHBACK)


def recoverable(rules: Rules, error: AttemptError) -> bool:
    """Whether a winner that broke with ``error`` after the commit may be recovered: not when
    the error is the request's own (it would fail the same way anywhere)."""
    return error.retryable and error.kind not in rules.attribution.caller


def _broke(rules: Rules, evidence: Evidence, attempt: AttemptEvidence) -> list[Verdict]:
    error = attempt.error
    assert error is not None
    r = attempt.replica
    if not recoverable(rules, error):
        return [_v("after-commit-request", _EFFECT_NOTHING, replica=r)]
    if error.kind is _ERRORKIND_SLOW_STREAM:
        # Alive, only slow: counted slow in its window (relative to the others, as a lost
        # race after the fleet's delay is), not a failure in its run nor a throttle token.
        return [_v("crawl", _EFFECT_SLOW, replica=r, reason=error.kind.value)]
    if _is_500(error):
        # A 500 mid-answer: its health waits for the end, as before the commit (a query of
        # death crashes the decode on every replica); the throttle decides the recovery now.
        return [_retry("break", _throttle(evidence))]
    return [
        _v("break", _EFFECT_FAILURE, replica=r, reason=error.kind.value),
        _retry("break", _throttle(evidence)),
    ]


def _settle(rules: Rules, evidence: Evidence, event: Event) -> list[Verdict]:
    """Errors whose fault waited for the request's end: key, quota and "not found" errors,
    and 500s."""
    out: list[Verdict] = []
    attempts = evidence.attempts
    # Failed before a first token, or a winner (a recovery's too) that broke with a 500.
    failed = [
        a
        for a in attempts.values()
        if a.outcome is _OUTCOME_FAILED or (a.outcome is _OUTCOME_BROKE and _is_500(a.error))
    ]
    if not failed:
        return out
    winner = evidence.winner
    served_by = None if winner is None else attempts[winner].replica
    all_500 = (
        not evidence.answered
        and len(failed) == len(attempts)
        and all(_is_500(a.error) for a in failed)
        and len({a.replica for a in failed}) >= 2
    )
    # Every replica it reached answered 500 while the fleet served other requests: the
    # request's fault (a whole fleet failing serves nobody, and stays the replicas' fault).
    query_of_death = all_500 and bool(event.served_since)
    for a in failed:
        error = a.error
        assert error is not None
        r = a.replica
        served_elsewhere = served_by is not None and served_by != r
        fault = rules.attribution.fault(error)
        if fault is Fault.REQUEST or fault is Fault.MISCONFIGURED:
            continue  # decided when it happened
        if fault is Fault.UNDECIDED:
            if _affinity_miss(evidence, error):
                continue  # decided when it happened
            if served_elsewhere:
                out.append(
                    _v(
                        "misconfigured",
                        _EFFECT_EJECT,
                        replica=r,
                        model=evidence.model,
                        reason=error.kind.value,
                    )
                )
            else:
                out.append(_v("everywhere", _EFFECT_NOTHING, replica=r))
        elif _is_500(error):
            if query_of_death:
                out.append(_v("query-of-death", _EFFECT_NOTHING, replica=r))
                out.append(_v("query-of-death", _EFFECT_ERRED, replica=r))
            else:
                rule = "break" if a.outcome is _OUTCOME_BROKE else "server-error"
                out.append(_v(rule, _EFFECT_FAILURE, replica=r, reason=error.kind.value))
                out.append(_v(rule, _EFFECT_ERRED, replica=r))
    if query_of_death:
        if evidence.credit:
            out.append(_v("query-of-death", _EFFECT_CREDIT_RELEASED))
        if evidence.taken:
            out.append(_v("query-of-death", _EFFECT_REFUND, tokens=evidence.taken))
    return out


def _finished(rules: Rules, evidence: Evidence, event: Event) -> list[Verdict]:
    out = _settle(rules, evidence, event) if evidence.failures or evidence.breaks else []
    served = evidence.answered
    if served:
        assert evidence.winner is not None
        final = evidence.attempts[evidence.winner]
        if evidence.completed:
            out.append(_v("served", _EFFECT_SUCCESS, replica=final.replica, model=evidence.model))
        else:
            # The caller left before the answer's end: whether the replica would have finished
            # it (or stalled, as a replica that breaks every stream would) is not known.
            out.append(_v("left", _EFFECT_NOTHING, replica=final.replica))
    if evidence.credit and not any(v.rule == "query-of-death" for v in out):
        # Credit still out: a break's, after the commit (its recovery did not answer), or the
        # first failure of a request nothing served.
        if served:
            out.append(_v("served", _EFFECT_CREDIT_RELEASED))
        else:
            out.append(_v("unserved", _EFFECT_CREDIT_DEBITED))
    return out


def judge(rules: Rules, evidence: Evidence, event: Event) -> list[Verdict]:
    """The verdicts ``event`` makes of ``evidence`` (see the module docs and `RULES`). Pure:
    reads its arguments, changes nothing; the fleet's writer applies what it returns."""
    kind = event.kind
    if kind is _EVENTKIND_COMMITTED:
        return _committed(evidence, evidence.attempts[event.number])
    if kind is _EVENTKIND_FINISHED:
        return _finished(rules, evidence, event)
    attempt = evidence.attempts[event.number]
    if kind is _EVENTKIND_FAILED:
        return _failed(rules, evidence, attempt)
    if kind is _EVENTKIND_CANCELLED:
        return _cancelled(attempt)
    return _broke(rules, evidence, attempt)


def rule_rows(rules: Iterable[Rule] = RULES) -> list[str]:
    """The rules as the rows of ``docs/guarantees.md``'s table ("Who is blamed for what")."""
    rows = ["| what happened | whose | what changes | tests |", "| --- | --- | --- | --- |"]
    for rule in rules:
        tests = ", ".join(f"`{t}`" for t in rule.tests)
        rows.append(f"| {rule.what} | {rule.whose} | {rule.changes} | {tests} |")
    return rows


if __name__ == "__main__":  # regenerate docs/guarantees.md's table: python -m ...
    print("\n".join(rule_rows()))


# Enum members read on every request's path, as module constants: loading one is about
# ten times faster than the class attribute (EnumType resolves it on each access).
_EFFECT_COOL = Effect.COOL
_EFFECT_CREDIT = Effect.CREDIT
_EFFECT_CREDIT_DEBITED = Effect.CREDIT_DEBITED
_EFFECT_CREDIT_RELEASED = Effect.CREDIT_RELEASED
_EFFECT_DEBIT = Effect.DEBIT
_EFFECT_EJECT = Effect.EJECT
_EFFECT_ERRED = Effect.ERRED
_EFFECT_FAILURE = Effect.FAILURE
_EFFECT_LATENCY = Effect.LATENCY
_EFFECT_LATENCY_FLOOR = Effect.LATENCY_FLOOR
_EFFECT_NOTHING = Effect.NOTHING
_EFFECT_OUTAGE = Effect.OUTAGE
_EFFECT_REFUND = Effect.REFUND
_EFFECT_SAMPLE = Effect.SAMPLE
_EFFECT_SLOW = Effect.SLOW
_EFFECT_SUCCESS = Effect.SUCCESS
_EFFECT_WINDOW = Effect.WINDOW
_ERRORKIND_CONTEXT_LENGTH_EXCEEDED = ErrorKind.CONTEXT_LENGTH_EXCEEDED
_ERRORKIND_NOT_FOUND = ErrorKind.NOT_FOUND
_ERRORKIND_SERVER_ERROR = ErrorKind.SERVER_ERROR
_ERRORKIND_SLOW_STREAM = ErrorKind.SLOW_STREAM
_ERRORKIND_TIMEOUT = ErrorKind.TIMEOUT
_EVENTKIND_CANCELLED = EventKind.CANCELLED
_EVENTKIND_COMMITTED = EventKind.COMMITTED
_EVENTKIND_FAILED = EventKind.FAILED
_EVENTKIND_FINISHED = EventKind.FINISHED
_OUTCOME_BROKE = Outcome.BROKE
_OUTCOME_FAILED = Outcome.FAILED
_OUTCOME_LOST = Outcome.LOST
_OUTCOME_RUNNING = Outcome.RUNNING
_OUTCOME_TIMEOUT = Outcome.TIMEOUT
_PHASE_RACE = Phase.RACE
_PHASE_RECOVERY = Phase.RECOVERY
