"""What happened to one hedged request: [`Report`][trio_hedge.Report] (the request: winner, TTFT,
TPOT, gaps, text, wasted tokens, error), [`AttemptRecord`][trio_hedge.report.AttemptRecord] (one
attempt: replica, start, TTFT, outcome, error),
[`RecoveryRecord`][trio_hedge.report.RecoveryRecord] (what a recovery after the commit resumed
from) and [`AttemptOutcome`][trio_hedge.report.AttemptOutcome].

The race and the stream fill a mutable `_Recorder` as things happen; ``stream.report``
hands out a frozen [`Report`][trio_hedge.Report] snapshot, during the stream and after it (also when
it ended in an error). All times are seconds on Trio's clock, as offsets from the moment the
request started, so they are exact in virtual time.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from ._attempt_error import AttemptError, ErrorKind

__all__ = ["AttemptOutcome", "AttemptRecord", "RecoveryRecord", "Report"]


class AttemptOutcome(str, enum.Enum):
    """How one attempt ended (``running`` while it is still going)."""

    RUNNING = "running"
    """still going."""
    WON = "won"
    """produced the first token first; its tokens were relayed."""
    CANCELLED = "cancelled"
    """cancelled: another attempt won, a fatal error ended the request, or the caller left."""
    FAILED = "failed"
    """failed with an error before the commit."""
    TIMEOUT = "timeout"
    """stopped by ``first_token_timeout`` before any attempt produced a first token."""


@attrs.frozen
class RecoveryRecord:
    """What a recovery attempt (``trigger="recovery"``) resumed: the winner before it broke
    after the commit, and the answer went on here (see ``docs/recovery.md``).

    Attributes:
        replaces: the number of the attempt whose failure it recovers.
        position: characters of answer text the caller had when that attempt broke.
        tokens: content tokens the caller had then.
        method: ``"continuation"`` (the text so far was sent as a final assistant message,
            by the replica's declared engine contract), ``"anchor"`` (the text so far as an
            assistant turn and an instruction to go on, repeating its last characters first:
            the repeat found and trimmed) or ``"replay"`` (the original request again, its
            output held back until it reproduced what the caller had).
        verified: characters of output (content, reasoning, tool-call names and arguments)
            this attempt reproduced before anything was relayed from it; 0 for a
            continuation that does not repeat its prefix (vLLM's).
        held_back: content tokens received and not relayed (the reproduced prefix, or an
            anchor's repeat): wasted tokens of a recovery that won.
        reason: the kind of the failure it recovers from (``"stream_truncated"``,
            ``"stall"``, ``"slow_stream"``: the throughput floor…), or ``None`` when unknown.
        deadline: seconds from its start it had to give its first output (any content,
            reasoning or tool-call fragment, the reproduced prefix included) before it was
            abandoned and the next recovery tried: its first-token deadline, from what the
            fleet learned for its replica, model and prompt size (``docs/recovery.md``), or
            ``None`` when it had none.
        first_output: seconds from its start to its first output, or ``None`` (none came).
            Its ``ttft`` is when it committed, once it had reproduced the answer so far.
        hedged: whether it was sent as a hedge inside the recovery (a second recovery while
            another one was still waiting for its first output), not after a failure.
        prompt_added: estimated prompt tokens its request carried beyond the original
            request's: the answer so far for a continuation, and an anchor's instruction;
            0 for a replay.
    """

    replaces: int
    position: int
    tokens: int
    method: str
    verified: int = 0
    held_back: int = 0
    reason: str | None = None
    deadline: float | None = None
    first_output: float | None = None
    hedged: bool = False
    prompt_added: int = 0

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class AttemptRecord:
    """One attempt of a request.

    Attributes:
        number: 1 for the primary, 2 for the first backup, …
        replica: the replica's name.
        trigger: ``"primary"``, ``"hedge"`` (the hedge delay passed), ``"failover"`` (an
            earlier attempt failed before its first token) or ``"recovery"`` (the winner broke
            after the commit and the answer goes on here; ``recovery`` says from where).
        started_at: seconds from the request's start to this attempt's start.
        ttft: seconds from this attempt's start to its first token, or ``None``.
        ended_at: seconds from the request's start to when it failed or was cancelled (for
            the winner: when the stream ended or broke), or ``None`` while running.
        outcome: an [`AttemptOutcome`][trio_hedge.report.AttemptOutcome].
        error: the [`AttemptError`][trio_hedge.AttemptError] when it failed, else ``None``.
        tokens_received: content tokens this attempt received; for a loser these are wasted
            tokens.
        recovery: for a recovery attempt, a [`RecoveryRecord`][trio_hedge.report.RecoveryRecord];
            else ``None``. A winner that broke after the commit keeps ``outcome="won"`` and
            has its ``error``.
        model: the model its request asked for (the request's ``model``, or the replica's
            ``overrides``), when its source says (``Source.model``); ``None`` otherwise.
        stream_rate: after its commit, the content tokens per second its stream gave the
            caller, timed on the producer side (the seconds the caller waited on it; its own
            pauses excluded, as the stall clock is): measured only while a throughput floor
            is on (``RecoveryPolicy.throughput_floor``), else ``None``.
    """

    number: int
    replica: str
    trigger: str
    started_at: float | None
    ttft: float | None
    ended_at: float | None
    outcome: AttemptOutcome
    error: AttemptError | None = attrs.field(default=None, eq=False)
    tokens_received: int = 0
    recovery: RecoveryRecord | None = None
    model: str | None = None
    stream_rate: float | None = None

    @property
    def phase(self) -> str:
        """When it ran: ``"race"`` (before the commit: a primary, hedge or failover) or
        ``"recovery"`` (after it: ``trigger="recovery"``). A race winner that broke after
        the commit is ``"race"`` with ``outcome="won"`` and its ``error``."""
        return "recovery" if self.trigger == "recovery" else "race"

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "replica": self.replica,
            "trigger": self.trigger,
            "started_at": self.started_at,
            "ttft": self.ttft,
            "ended_at": self.ended_at,
            "outcome": self.outcome.value,
            "error": self.error.to_dict() if self.error is not None else None,
            "tokens_received": self.tokens_received,
            "recovery": self.recovery.to_dict() if self.recovery is not None else None,
            "model": self.model,
            "stream_rate": self.stream_rate,
        }


@attrs.frozen
class Report:
    """A snapshot of one hedged request.

    Attributes:
        request_id: the id every attempt carried (a UUID4 string).
        attempts: one [`AttemptRecord`][trio_hedge.report.AttemptRecord] per started attempt, in
            start order.
        winner: the winning attempt's number, or ``None`` (not committed, or failed); after a
            recovery, the recovery attempt that serves the answer now.
        hedged: whether a backup was sent because the hedge delay passed.
        hedges_refused: backups the hedge budget refused for this request.
        ttft: caller-visible time to first token (seconds from the request's start to the
            commit), or ``None``.
        total: seconds from the request's start to the end of the stream, or ``None`` while
            it is still open.
        token_count: content tokens received from the winner (relayed, or queued to be).
        tpot_mean: mean time per output token after the first (seconds), or ``None`` with
            fewer than two tokens.
        max_gap: the largest inter-token gap after the first token (seconds), or ``None``.
        text: the text relayed so far (the partial answer, when the stream failed).
        finished: whether the stream has ended (normally or not).
        completed: whether the winner's answer was read to its end (``False`` while it is
            open, and when the caller left early or it failed).
        error: the error that ended the request, or ``None``.
        prompt_tokens: the request's prompt size in tokens (given by the caller or estimated
            at ~4 characters per token), when known; used for cost accounting.
        idempotency_key: the idempotency key every attempt carried, or ``None``.
        queue_wait: seconds the request waited before its race began (a gateway's admission
            queue: ``Hedger.stream(queued=...)``), or ``None`` when not given. Not part of
            ``ttft``, ``total`` nor any attempt's times, which start with the race.
    """

    request_id: str
    attempts: tuple[AttemptRecord, ...]
    winner: int | None
    hedged: bool
    hedges_refused: int
    ttft: float | None
    total: float | None
    token_count: int
    tpot_mean: float | None
    max_gap: float | None
    text: str
    finished: bool
    completed: bool
    error: BaseException | None = attrs.field(default=None, eq=False)
    prompt_tokens: int | None = None
    idempotency_key: str | None = None
    queue_wait: float | None = None

    @property
    def attempts_sent(self) -> int:
        """Attempts started (primary included): the number of times the prompt was sent."""
        return len(self.attempts)

    @property
    def backups_sent(self) -> int:
        """Attempts started after the primary (hedges and failovers)."""
        return max(0, len(self.attempts) - 1)

    @property
    def prompt_tokens_resent(self) -> int | None:
        """Prompt tokens sent again by backups (``prompt_tokens × backups_sent``): the extra
        prefill the hedging cost, or ``None`` when the prompt size is unknown."""
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens * self.backups_sent

    @property
    def winner_replica(self) -> str | None:
        """The winning attempt's replica name, or ``None``."""
        for attempt in self.attempts:
            if attempt.number == self.winner:
                return attempt.replica
        return None

    @property
    def recoveries(self) -> int:
        """Recovery attempts started after the commit (``trigger="recovery"``)."""
        return sum(1 for a in self.attempts if a.trigger == "recovery")

    @property
    def tokens_by_model(self) -> dict[str, int]:
        """Content tokens each model generated for this request, as received (every attempt:
        the winner's, a broken winner's, a recovery's reproduced prefix, the losers'), by
        the attempt's ``model`` (an attempt whose source names none counts under its
        replica's name): what the fleet spent on the answer, to bill or budget by model."""
        out: dict[str, int] = {}
        for a in self.attempts:
            key = a.model if a.model is not None else a.replica
            out[key] = out.get(key, 0) + a.tokens_received
        return out

    @property
    def slow_streams(self) -> int:
        """Winners the throughput floor took the answer from (``ErrorKind.SLOW_STREAM``)."""
        slow = ErrorKind.SLOW_STREAM
        return sum(1 for a in self.attempts if a.error is not None and a.error.kind is slow)

    @property
    def wasted_tokens(self) -> int:
        """Content tokens received and never relayed: by attempts that lost or failed, and
        the prefix a recovery reproduced before its new text (``held_back``)."""
        wasted = 0
        for a in self.attempts:
            if a.outcome is not AttemptOutcome.WON:
                wasted += a.tokens_received
            elif a.recovery is not None:
                wasted += a.recovery.held_back
        return wasted

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (used by ``trio-hedge --json``). Holds no credentials."""
        error: dict[str, Any] | None = None
        if self.error is not None:
            error = {"type": type(self.error).__name__, "message": str(self.error)}
            # The kind that decided: the fatal error's, the interrupting error's, or (every
            # attempt failed) the last one's, with every attempt's kind in start order.
            failures = getattr(self.error, "errors", None)
            if isinstance(failures, tuple) and failures:
                error["kinds"] = [e.kind.value for e in failures if isinstance(e, AttemptError)]
            inner = getattr(self.error, "error", None)
            if not isinstance(inner, AttemptError) and failures:
                inner = failures[-1]
            if isinstance(inner, AttemptError):
                error["kind"] = inner.kind.value
        return {
            "request_id": self.request_id,
            "winner": self.winner,
            "winner_replica": self.winner_replica,
            "hedged": self.hedged,
            "hedges_refused": self.hedges_refused,
            "ttft": self.ttft,
            "total": self.total,
            "token_count": self.token_count,
            "tpot_mean": self.tpot_mean,
            "max_gap": self.max_gap,
            "wasted_tokens": self.wasted_tokens,
            "attempts_sent": self.attempts_sent,
            "backups_sent": self.backups_sent,
            "recoveries": self.recoveries,
            "slow_streams": self.slow_streams,
            "tokens_by_model": self.tokens_by_model,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_resent": self.prompt_tokens_resent,
            "idempotency_key": self.idempotency_key,
            "queue_wait": self.queue_wait,
            "finished": self.finished,
            "completed": self.completed,
            "text": self.text,
            "attempts": [a.to_dict() for a in self.attempts],
            "error": error,
        }


@attrs.define(slots=True)
class _AttemptState:
    number: int
    replica: str
    trigger: str
    started_at: float
    ttft: float | None = None
    ended_at: float | None = None
    outcome: AttemptOutcome = AttemptOutcome.RUNNING
    error: AttemptError | None = None
    tokens_received: int = 0
    recovery: RecoveryRecord | None = None
    model: str | None = None
    # Producer-side timing after the commit (only with a throughput floor): seconds waited
    # on its stream and the content tokens that came during those waits.
    waited: float = 0.0
    waited_tokens: int = 0

    def freeze(self, origin: float) -> AttemptRecord:
        """The public record, with times as offsets from ``origin`` (the request's start)."""
        return AttemptRecord(
            number=self.number,
            replica=self.replica,
            trigger=self.trigger,
            started_at=self.started_at - origin,
            ttft=self.ttft,
            ended_at=None if self.ended_at is None else self.ended_at - origin,
            outcome=self.outcome,
            error=self.error,
            tokens_received=self.tokens_received,
            recovery=self.recovery,
            model=self.model,
            stream_rate=self.waited_tokens / self.waited
            if self.waited > 0 and self.waited_tokens
            else None,
        )


@attrs.define(slots=True)
class _Recorder:
    """Mutable state behind [`Report`][trio_hedge.Report]; times are absolute on Trio's clock."""

    request_id: str
    origin: float = 0.0
    attempts: list[_AttemptState] = attrs.Factory(list)
    winner: int | None = None
    hedged: bool = False
    hedges_refused: int = 0
    committed_at: float | None = None
    ended_at: float | None = None
    token_count: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    max_gap: float | None = None
    chunks: list[str] = attrs.Factory(list)
    error: BaseException | None = None
    completed: bool = False
    prompt_tokens: int | None = None
    idempotency_key: str | None = None
    queue_wait: float | None = None

    def attempt(self, number: int) -> _AttemptState:
        return self.attempts[number - 1]

    def snapshot(self) -> Report:
        o = self.origin
        tpot = None
        if self.token_count >= 2 and self.first_token_time is not None:
            assert self.last_token_time is not None
            tpot = (self.last_token_time - self.first_token_time) / (self.token_count - 1)
        return Report(
            request_id=self.request_id,
            attempts=tuple(a.freeze(o) for a in self.attempts),
            winner=self.winner,
            hedged=self.hedged,
            hedges_refused=self.hedges_refused,
            ttft=None if self.committed_at is None else self.committed_at - o,
            total=None if self.ended_at is None else self.ended_at - o,
            token_count=self.token_count,
            tpot_mean=tpot,
            max_gap=self.max_gap,
            text="".join(self.chunks),
            finished=self.ended_at is not None,
            completed=self.completed,
            error=self.error,
            prompt_tokens=self.prompt_tokens,
            idempotency_key=self.idempotency_key,
            queue_wait=self.queue_wait,
        )
