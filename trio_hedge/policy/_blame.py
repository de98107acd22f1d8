"""Who is at fault: the one place that decides what an attempt says about its replica.

Many callers share one [`Hedger`][trio_hedge.Hedger], and what one caller sends must not change
what another gets unless the evidence inside that request shows a replica was at fault. Every
consumer of a replica's record -- health and ejection (``_health.py``, ``_fleet.py``), the
retry throttle (``_throttle.py``), cooldowns, the peak-EWMA pick, the delay learner and the
statistics -- asks this module (through `Attribution`) instead of reading error kinds itself:

* **the request's** (`Fault.REQUEST`): nothing changes anywhere -- no failure, no throttle
  token, no cooldown. Errors that are not retryable (400, 422, context length) always are;
  so are the kinds the caller names in ``Attribution.caller`` (a gateway that forwards its
  clients' keys: a 401 is the client's).
* **the replica's** (`Fault.REPLICA`): a transient error of its making (5xx, overload,
  connection, timeout, a broken stream): one failure in its run and a throttle token (given
  back if the same request is then served: the fleet answered it).
* **pushback** (`Fault.PUSHBACK`): a plain rate limit: it cools (replica, model), no failure.
* **undecided** (`Fault.UNDECIDED`): a key, quota or "not found" error (401/403/429 quota/
  404) could be the replica's (misconfigured) or the request's (a model nobody serves, the
  client's own key). It is decided when the request's evidence is complete
  (`Attribution.settle`, at the request's end): the replica's, ejecting (replica, model) at
  once, only if another replica served the same request; else the request's. The failover
  happens at once regardless, and that replica is not tried again by this request.
* **misconfigured** (`Fault.MISCONFIGURED`): the verdict of a settled undecided error, or at
  once for the kinds named in ``Attribution.replica`` (a trusted caller whose 404 always
  means a replica's wrong configuration).

A context-length error is the request's too (nothing counts against the replica), but only
for that replica's window: `outgrew` says the request may still fail over, to a replica that
declares a larger window (``Replica.context_window``); it is fatal only when none does. The
replica's window is learned from it, per (replica, model): a request at least as large goes
elsewhere when another replica can take it. The size is the request's own evidence (its
estimated prompt plus its ``max_tokens``), so a caller asking for a huge ``max_tokens`` teaches
only that a request that large does not fit.

Two more rules live here because they are about blame, not errors:

* **slow** (`is_slow`): an attempt hedged for lack of a first token counts as slow only if
  another attempt of the same request won *and* it had gone without a first token for the
  delay the fleet would have hedged it at: a caller's own shorter ``hedge_after`` is the
  caller's choice, and a loss within it says nothing about the replica.
* **a caller's cancel is a delay sample only past the fleet's delay** (`informs_delay`): an
  attempt the caller (or the request's own failure) cut short, before the delay the fleet
  would have hedged it at, shows nothing about the tail the delay is set at, and counted
  toward ``min_samples`` and the window's cap (instant cancels made a class "learned" from
  one caller's no-information samples and moved every caller's delay). Lost races and
  ``first_token_timeout`` are the fleet's own cuts: always samples.
* **a lost race only raises a latency estimate**: a cancelled attempt's run time is a lower
  bound on its TTFT ("at least this slow"), never evidence that the replica is fast
  (``ReplicaState.observe_lower_bound``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import attrs

from .._attempt_error import REPLICA_KINDS, RETRYABLE_KINDS
from ..errors import AttemptError, ErrorKind

__all__ = ["Attribution", "Fault", "informs_delay", "is_slow", "outgrew"]


class Fault(enum.Enum):
    """Whose fault one attempt's error is (internal)."""

    REQUEST = "request"
    REPLICA = "replica"
    PUSHBACK = "pushback"
    UNDECIDED = "undecided"
    MISCONFIGURED = "misconfigured"


def _kinds(value: object) -> frozenset[ErrorKind]:
    """A set of error kinds from kinds or their names (``"auth"``, as TOML gives them)."""
    if isinstance(value, (str, ErrorKind)) or not isinstance(value, Iterable):
        raise TypeError("must be a collection of ErrorKind (or their names)")
    kinds: set[ErrorKind] = set()
    for item in value:
        if isinstance(item, ErrorKind):
            kinds.add(item)
        elif isinstance(item, str):
            try:
                kinds.add(ErrorKind(item))
            except ValueError:
                raise ValueError(f"unknown error kind {item!r}") from None
        else:
            raise TypeError(f"must hold ErrorKind values or names, not {type(item).__name__}")
    return frozenset(kinds)


def _within(allowed: frozenset[ErrorKind], which: str) -> Any:
    """A validator: the field holds only kinds of ``allowed`` (``which`` names them)."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: frozenset[ErrorKind]) -> None:
        if not value <= allowed:
            raise ValueError(f"{attribute.name} holds only {which}")

    return check


def _caller_kinds(value: object) -> frozenset[ErrorKind]:
    return _named(value, "caller")


def _replica_kinds(value: object) -> frozenset[ErrorKind]:
    return _named(value, "replica")


def _named(value: object, field: str) -> frozenset[ErrorKind]:
    try:
        return _kinds(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{field} {exc}") from None


@attrs.frozen
class Attribution:
    """Whose fault each kind of attempt error is (like stamina's ``on=``: the caller says).

    By default the evidence of the request decides: a transient error (5xx, overload,
    connection, timeout, a broken stream) is its replica's; a plain rate limit cools the
    replica for that model; an error that is not retryable (400, 422, context length) is the
    request's; and a key, quota or "not found" error (``auth``, ``quota_exceeded``,
    ``not_found``) is the replica's (ejecting it for that model at once) only when another
    replica served the same request, else the request's (when every replica tried answers
    the same way, or none answered). See ``docs/guarantees.md``, "Who is blamed for what".

    Attributes:
        caller: kinds that are always the caller's, whatever the evidence: no failure,
            cooldown or throttle token for any replica (the request still fails over; a
            replica it got one from is not tried again by it if the kind is a key, quota or
            "not found" error). E.g. ``{ErrorKind.AUTH}`` for a gateway that forwards its
            clients' own keys. Kinds or their names; only retryable kinds. Default none.
        replica: key, quota and "not found" kinds that are always the replica's, at once (the
            rule before evidence: for one trusted caller whose 404 can only mean a replica's
            wrong configuration). Default none.

    Raises:
        TypeError, ValueError: a field that is not a collection of kinds, a kind not allowed
            in it, or a kind in both.
    """

    caller: frozenset[ErrorKind] = attrs.field(
        default=frozenset(),
        converter=_caller_kinds,
        validator=_within(
            RETRYABLE_KINDS,
            "kinds another attempt may fix (the rest are the request's already)",
        ),
    )
    replica: frozenset[ErrorKind] = attrs.field(
        default=frozenset(),
        converter=_replica_kinds,
        validator=_within(
            REPLICA_KINDS,
            "auth, quota_exceeded and not_found (transient errors are the replica's already)",
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.caller & self.replica:
            raise ValueError("caller and replica must not share a kind")

    def fault(self, error: AttemptError) -> Fault:
        """Whose fault ``error`` is when it happens (`Fault.UNDECIDED`: at the request's end,
        `settle`)."""
        kind = error.kind
        if not error.retryable or kind in self.caller:
            return Fault.REQUEST
        if kind in REPLICA_KINDS:
            return Fault.MISCONFIGURED if kind in self.replica else Fault.UNDECIDED
        if kind is ErrorKind.RATE_LIMIT:
            return Fault.PUSHBACK
        return Fault.REPLICA

    def after_commit(self, error: AttemptError) -> Fault:
        """Whose fault a winner's failure after the commit is (a stall, a cut, an in-band
        error): the replica's (one failure), unless the kind is the caller's."""
        if error.kind in self.caller or not error.retryable:
            return Fault.REQUEST
        return Fault.REPLICA

    @staticmethod
    def settle(*, served_elsewhere: bool) -> Fault:
        """The verdict on an undecided error once the request ended: the replica's (it cannot
        serve what another replica served) or the request's (every replica tried answered
        the same, or none answered)."""
        return Fault.MISCONFIGURED if served_elsewhere else Fault.REQUEST


def outgrew(error: AttemptError) -> bool:
    """Whether ``error`` says the request outgrew its replica's context window: the
    request's fault there, but another replica with a larger window may take it."""
    return error.kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED


def is_slow(*, another_won: bool, waited: float, fleet_delay: float | None) -> bool:
    """Whether a hedged attempt that lost counts as slow: another attempt of its request won,
    and it had waited ``waited`` seconds without a first token, at least the ``fleet_delay``
    the fleet would have hedged it at (``None``: the fleet never hedges on time, so only the
    caller chose to)."""
    return another_won and fleet_delay is not None and waited >= fleet_delay


def informs_delay(*, ended_by_fleet: bool, ran: float, fleet_delay: float | None) -> bool:
    """Whether a cancelled attempt's run time (``ran`` seconds, no first token) is a censored
    sample for the delay learner: always when the fleet ended it (it lost a race, or
    ``first_token_timeout`` passed), else (the caller left, or the request failed elsewhere)
    only once it had run the ``fleet_delay`` the fleet would have hedged it at: earlier, the
    time was the caller's choice and says nothing about the tail the delay is set at."""
    return ended_by_fleet or (fleet_delay is not None and ran >= fleet_delay)
