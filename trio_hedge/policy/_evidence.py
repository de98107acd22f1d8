"""What one request saw: its evidence, one value the planner owns and the judge reads.

Each attempt's replica, trigger and phase (the race for the first token, or a recovery after
the commit), when it started, the delay the fleet would have hedged it at, whether a backup
was sent for it (and when) or refused, how it ended and with what error; the request's sizes
(marked exact or estimated), the model, and the affinities its source declares (a
``previous_response_id``: only the replica that stored it can answer). Nothing here decides
anything: ``_judge.py`` turns this evidence into verdicts, ``_writer.py`` applies them.
"""

from __future__ import annotations

import enum

import attrs

from ..errors import AttemptError
from ..report import RecoveryRecord

__all__ = ["AttemptEvidence", "Evidence", "Outcome", "Phase"]


class Phase(enum.Enum):
    """When an attempt ran: racing for the request's first token, or recovering an answer
    whose winner broke after the commit."""

    RACE = "race"
    RECOVERY = "recovery"


class Outcome(enum.Enum):
    """How an attempt ended, as the judge reads it."""

    RUNNING = "running"
    WON = "won"
    FAILED = "failed"
    LOST = "lost"  # cancelled because another attempt of the request won
    TIMEOUT = "timeout"  # first_token_timeout ended it
    CANCELLED = "cancelled"  # the caller left, or the request failed elsewhere
    BROKE = "broke"  # a winner that failed after the commit


_WON = Outcome.WON  # read at every request's end: a module constant loads faster


@attrs.define(slots=True)
class AttemptEvidence:
    """One attempt of the request (internal)."""

    number: int
    replica: int  # its index in the fleet
    name: str
    trigger: str
    started: float
    phase: Phase = Phase.RACE
    #: The delay the fleet would have hedged it at (learned or fixed, not a caller's own
    #: shorter one), asked when its hedge delay was; ``None``: never on time, or not asked.
    fleet_delay: float | None = None
    #: Seconds after its start a backup was sent for it (a hedge), or ``None``.
    hedged_after: float | None = None
    #: Why a backup for it was refused (``"budget"``, ``"throttle"``, ``"no_replica"``), or
    #: ``None``: then its time to a first token is not what a hedged request would see.
    refused: str | None = None
    outcome: Outcome = Outcome.RUNNING
    error: AttemptError | None = None
    ended: float | None = None
    ttft: float | None = None
    #: A recovery's own record (phase ``RECOVERY``): its first-token deadline, when its first
    #: output came, whether it was sent as a hedge inside the recovery, why the winner
    #: before it was replaced (``reason``: ``"slow_stream"`` is a crawl, not a break).
    recovery: RecoveryRecord | None = None


@attrs.define(slots=True)
class Evidence:
    """One request's evidence (internal): owned by its planner, read by the judge."""

    model: str
    group: str
    size_class: int
    #: The prompt's tokens, and whether that is the caller's exact count or an estimate.
    tokens: int | None
    tokens_exact: bool
    #: The context window it needs (prompt plus the answer it allows; an estimate unless
    #: ``tokens_exact``), ``None``: unknown.
    need: int | None
    #: What only some replicas can answer (``"previous_response_id"``, ``"conversation"``):
    #: a "not found" there is nobody's fault.
    affinities: tuple[str, ...] = ()
    attempts: dict[int, AttemptEvidence] = attrs.Factory(dict)
    #: The attempt serving the answer now (the race's winner, then a recovery's), or None.
    winner: int | None = None
    #: Whether the request's first failure went on the throttle's credit (granted by the
    #: writer: then debited at the end unless the request was served).
    credit: bool = False
    #: Whether the request asked for credit already (only its first failure may).
    asked_credit: bool = False
    #: Throttle thousandths its failures took at once (given back if it is served).
    taken: int = 0
    began: float | None = None  # when its primary started
    failures: int = 0  # attempts that failed before a first token
    breaks: int = 0  # winners (a recovery's too) that broke after the commit
    completed: bool = False  # at the end: the answer was read to its end (Report.completed)

    @property
    def answered(self) -> bool:
        """Whether the attempt serving the answer now (the race's winner, or a recovery's)
        committed and has not broken."""
        winner = self.winner
        return winner is not None and self.attempts[winner].outcome is _WON
