"""The race: staggered attempts, fail fast, commit at the first token, losers cancelled.

The problem. A streamed LLM call spends most of its tail waiting for the first token: a
replica's queue, a long prompt prefilled ahead of ours, a slow or sick node. Another replica
would often answer sooner, but which one cannot be known in advance. It is Happy Eyeballs'
problem (RFC 8305; Trio's ``trio/_highlevel_open_tcp_stream.py``) with first tokens instead of
TCP connections.

The naive extremes both fail:

* **wait forever**: one attempt at a time, the next only when the last fails, waits out every
  queue it lands in; a slow replica's whole delay is the caller's tail;
* **double send**: every replica at once takes the fastest answer but doubles the load (or
  worse), and under load the extra requests lengthen the very queues they race ("The Tail at
  Scale", Dean & Barroso, CACM 2013).

The compromise, as in Happy Eyeballs and gRPC hedging (gRFC A6): start attempt k+1 when
``hedge_delay`` seconds pass with no first token from any running attempt -- a delay near the
P95 of TTFT, so only the slowest few percent of requests pay for a second attempt (Dean &
Barroso's "hedged requests") -- or at once when an attempt fails (failures do not wait out the
delay). The first attempt to produce a first token *commits* (gRPC commits at the first
response headers; a server answers 200 while still queued, so we commit at the first parsed
token), and every other attempt is cancelled so its server stops. How many attempts, when the
delay, and whether a hedge may go now (a budget, gRFC A6's throttle) are the
[`Planner`][trio_hedge.policy.Planner]'s to say; this module only races.

How it runs. The parent loop (`_Race._stagger`, in the caller's own task) starts an
attempt, then waits ``with trio.move_on_after(delay): await news.receive()``: the next attempt
starts after the delay *or* when an attempt fails; no timer tasks. Every failure is one piece of
news in a queue, so failures landing together each start their own attempt, and a failure landing
as the delay ends is a failover, not a hedge. Each attempt runs in a task of the stream's
nursery, inside its own cancel scope, and owns what it opened until the line that hands it over
(`_Race._commit`). The commit cancels the parent loop and every loser's scope and
returns: the caller gets the first token at once, while each loser closes its own stream in
its own task (shielded, bounded); the stream's ``async with`` waits for them before it exits.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import NoReturn

import attrs
import trio

from ._attempt_error import classify_exception, leaves
from ._plan import Planner
from ._source import AttemptInfo, AttemptStream, Source
from ._verify import AnchorGate, Gate
from .errors import AllAttemptsFailed, AttemptError, ErrorKind, FatalAttemptError
from .events import Delta, FirstToken, counts_as_first_token
from .report import AttemptOutcome, RecoveryRecord, _AttemptState, _Recorder

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "FALLBACK_DEADLINE",
    "Committed",
    "Resume",
    "ResumePlan",
    "close_quietly",
    "discard_quietly",
    "race",
]

#: A recovery's first-token deadline (seconds) when the planner gives none
#: (``Planner.recovery_deadline``): a recovery on a replica that never answers still ends.
FALLBACK_DEADLINE = 30.0


@attrs.frozen
class ResumePlan:
    """How one recovery attempt goes on with the answer (``_recovery.py``): the text to
    continue from (``None``: a replay), the instruction that goes with it (the anchor
    method), the gate its output passes, and its record."""

    continue_from: str | None
    instruction: str | None
    gate: Gate | AnchorGate
    record: RecoveryRecord


#: How a recovery race starts each attempt on ``source``.
Resume = Callable[[Source], ResumePlan]


@attrs.frozen
class Committed:
    """The race's result: the winner's open stream and what it read before handing over."""

    number: int
    stream: AttemptStream
    pending: Sequence[Delta]
    ended: bool  # the winner's stream already ended cleanly (a complete, possibly empty answer)
    # The most tokens its source's request lets an answer have (``Source.token_limit``).
    token_limit: int | None = None
    source: Source | None = None


async def close_quietly(stream: AttemptStream, limit: float) -> None:
    """Close ``stream`` even inside a cancelled scope, bounded by ``limit`` seconds."""
    # One scope, shielded and bounded (it runs on every attempt's way out).
    with trio.CancelScope(shield=True, deadline=trio.current_time() + limit):
        try:  # noqa: SIM105 - suppress() would cost a context manager on every close
            await stream.aclose()
        except Exception:  # a failing close must not mask the race's outcome
            pass


async def discard_quietly(stream: AttemptStream, limit: float) -> None:
    """Tell a closed ``stream`` the caller does not keep its answer (``AttemptStream.discard``,
    optional: a Responses attempt deletes its stored response), shielded, within ``limit``
    seconds; a failure is ignored."""
    discard = getattr(stream, "discard", None)
    if discard is None:
        return
    with trio.CancelScope(shield=True, deadline=trio.current_time() + limit):
        try:  # noqa: SIM105 - as close_quietly
            await discard()
        except Exception:
            pass


def _summary(errors: Sequence[AttemptError]) -> str:
    """``"all 2 attempts failed: overloaded (HTTP 503) at a; connection at b"``."""
    n = len(errors)
    head = "the only attempt failed" if n == 1 else f"all {n} attempts failed"
    return head + ": " + "; ".join(e.brief() for e in errors)


def _split_cancelled(
    exc: BaseException,
) -> tuple[BaseException | None, list[BaseException]]:
    """``(the cancellation inside exc or None, every other leaf)``. Trio's own code (a
    connect's Happy Eyeballs nursery, say) may deliver ``Cancelled`` inside a group."""
    if isinstance(exc, trio.Cancelled):
        return exc, []
    if not isinstance(exc, BaseExceptionGroup):
        return None, [exc]
    cancelled, rest = exc.split(trio.Cancelled)
    return cancelled, [] if rest is None else leaves(rest)


#: A message to the parent loop: an attempt ended without a first token ("failed" or
#: "empty": its stream ended cleanly with no token, a complete but empty answer).
_News = tuple[str, int]


class _Capped:
    """An anchor continuation's stream held to the tokens the caller's limit has left: its
    engine was asked for a few more (the anchor's repeat is generated too, and trimmed), so
    the answer ends here, by length, at the caller's limit, as one replica would have ended
    it (the delta that reaches it says ``finish_reason="length"``)."""

    __slots__ = ("_done", "_left", "_stream")

    def __init__(self, stream: AttemptStream, left: int) -> None:
        self._stream = stream
        self._left = left
        self._done = left <= 0

    def take(self, batch: Sequence[Delta]) -> list[Delta]:
        """``batch`` up to the limit."""
        out: list[Delta] = []
        for delta in batch:
            if self._done:
                break
            if delta.content:
                self._left -= 1
                if self._left <= 0:
                    self._done = True
                    if not delta.finish_reason:
                        delta = attrs.evolve(delta, finish_reason="length", raw=None)
            out.append(delta)
        return out

    async def receive(self) -> Sequence[Delta] | None:
        while not self._done:
            batch = await self._stream.receive()
            if batch is None:
                return None
            out = self.take(batch)
            if out:
                return out
        return None

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def discard(self) -> None:
        await discard_quietly(self._stream, math.inf)


class _Relay:
    """The winner of a task-bound attempt (``AttemptStream.task_bound``): its own task keeps
    reading it and hands batches over a channel; closing cancels that task and waits for it."""

    __slots__ = ("_done", "_receive", "_scope")

    def __init__(
        self,
        receive: trio.MemoryReceiveChannel[Sequence[Delta] | Exception | None],
        scope: trio.CancelScope,
        done: trio.Event,
    ) -> None:
        self._receive = receive
        self._scope = scope
        self._done = done

    async def receive(self) -> Sequence[Delta] | None:
        try:
            item = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        self._scope.cancel()
        self._receive.close()
        await self._done.wait()


class _Race:
    def __init__(
        self,
        planner: Planner,
        recorder: _Recorder,
        nursery: trio.Nursery,
        *,
        first_token: FirstToken,
        close_timeout: float,
        first_token_timeout: float | None,
        resume: Resume | None = None,
        stall_timeout: float | None = None,
        limit: int | None = None,
    ) -> None:
        self._planner = planner
        self._observed = getattr(planner, "observes_attempts", True)
        self._recorder = recorder
        self._nursery = nursery
        self._first_token = first_token
        self._close_timeout = close_timeout
        self._first_token_timeout = first_token_timeout
        self._winner: Committed | None = None
        self._fatal: AttemptError | None = None
        self._timed_out = False
        self._decided = False  # a winner, a fatal error or the timeout: nothing more starts
        self._sources: dict[int, Source] = {}
        self._scopes: dict[int, trio.CancelScope] = {}
        # The set of open streams: each is owned by its attempt's task until the line that
        # hands it over (_commit) or its task closes it on the way out.
        self._streams: dict[int, AttemptStream] = {}
        self._pending: dict[int, list[Delta]] = {}
        self._live: set[int] = set()  # attempts that may still produce a first token
        self._answer: int | None = None  # the first attempt that ended with an empty answer
        self._stagger_scope = trio.CancelScope()
        # News for the parent loop, one entry per attempt that ended without a first token
        # (a deque and a parking lot: a memory channel costs more to make, per request).
        self._news: deque[_News] = deque()
        self._news_arrived = trio.lowlevel.ParkingLot()
        # A recovery race (after the commit, `_recovery.py`): its attempts continue an answer
        # the caller has, each through a gate, each under its own first-token deadline, a
        # second one hedged when the planner says; at most ``limit`` start.
        self._resume = resume
        self._gates: dict[int, Gate | AnchorGate] = {}
        self._hedge_delays: dict[int, float | None] = {}
        self._answering: set[int] = set()  # recovery attempts that have given output
        self._stall_timeout = stall_timeout
        self._limit = limit
        self._retry = "failover" if resume is None else "recovery"

    def _changed(self, state: _AttemptState) -> None:
        if not self._observed:  # a frozen record per state change costs; skip it when unused
            return
        record = state.freeze(self._recorder.origin)
        self._planner.attempt_changed(self._sources[state.number], record)

    # -- the parent loop (the caller's task) ------------------------------------------------

    async def run(self) -> Committed:
        timeout = self._first_token_timeout
        if timeout is not None:
            self._stagger_scope.deadline = trio.current_time() + timeout
        try:
            with self._stagger_scope:
                await self._stagger()
            if self._stagger_scope.cancelled_caught and not self._decided:
                # A first token due at the deadline's very instant wins, as one due at the
                # hedge delay's does: let the tasks woken in this tick run first (an
                # attempt's commit decides the race right here).
                await trio.lowlevel.checkpoint()
                if not self._decided:
                    self._timed_out = True  # the deadline passed with no first token
                    self._decide()
        except BaseException:
            # Cancelled from outside (or a KeyboardInterrupt). Nothing may commit into the
            # abandoned race now (an attempt woken in this very tick closes its own stream),
            # and a winner that committed was not handed over: it is closed here.
            self._decided = True
            if self._resume is not None:
                # A recovery runs inside the caller's `async with`: a cancel scope of the
                # caller's around its loop does not reach the nursery's tasks.
                for scope in self._scopes.values():
                    scope.cancel()
            winner, self._winner = self._winner, None
            if winner is not None:
                self._recorder.attempt(winner.number).ended_at = trio.current_time()
                await close_quietly(winner.stream, self._close_timeout)
            raise
        winner, self._winner = self._winner, None
        if winner is not None:
            return winner  # handed over: the caller owns closing it
        failures = tuple(a.error for a in self._recorder.attempts if a.error is not None)
        if self._fatal is not None:
            raise FatalAttemptError(
                f"fatal error, not retried: {self._fatal}", failures, error=self._fatal
            )
        if self._timed_out:
            error = AttemptError(
                ErrorKind.TIMEOUT, f"no first token within first_token_timeout={timeout} s"
            )
            raise AllAttemptsFailed(str(error), (*failures, error))
        if not failures:
            raise AllAttemptsFailed("no attempt could be started", failures)
        raise AllAttemptsFailed(_summary(failures), failures)

    async def _stagger(self) -> None:
        number = len(self._recorder.attempts)  # a recovery race numbers on
        recovering = self._resume is not None
        trigger: str | None = "primary" if not recovering else "recovery"
        started, limit = 0, self._limit
        while trigger is not None and (limit is None or started < limit):
            # A recovery hedged inside the recovery is a "recovery" too (its record says so).
            hedged = trigger == "hedge" and recovering
            if hedged:
                trigger = "recovery"
            source = await self._planner.next_source(number + 1, trigger)
            if source is None:
                break
            if self._decided:  # a commit or a fatal error landed while the planner decided
                return
            number += 1
            started += 1
            self._start(number, source, trigger, hedged=hedged)
            if not recovering:
                delay = self._planner.hedge_delay(number)
            elif limit is not None and started >= limit:
                delay = None  # no recovery left to hedge with
            else:
                delay = self._hedge_delays.get(number)
            trigger = await self._next_trigger(delay, number)
        # Nothing more starts: wait for the running attempts (a commit cancels this wait),
        # and read every piece of news, down to the last one queued in the same tick.
        while self._live or self._news:
            self._take_news(await self._next_news())
        if self._answer is not None:
            # The last news may have been queued already (no checkpoint since): a cancel from
            # outside in this tick, which may already have taken the answer's stream back in
            # its own task, must win over the commit.
            await trio.lowlevel.checkpoint_if_cancelled()
            self._commit_answer(self._answer)

    async def _next_trigger(self, delay: float | None, number: int) -> str | None:
        """Wait for the reason the next attempt starts: ``"failover"`` (an attempt failed),
        ``"hedge"`` (``delay`` passed, or the planner's ``hedge_on_evidence`` said so before,
        and the planner allows a hedge), or ``None`` (an empty answer is in hand: nothing
        more starts)."""
        deadline = trio.current_time() + (math.inf if delay is None else delay)
        evidence = delay and self._resume is None  # (a recovery's hedge waits its delay)
        ask = getattr(self._planner, "hedge_on_evidence", None) if evidence else None
        again = None if ask is None else ask(number)
        while True:
            wake = deadline if again is None else min(deadline, trio.current_time() + again)
            with trio.move_on_at(wake):
                return self._take_news(await self._next_news())
            if again is None or trio.current_time() >= deadline:
                break
            assert ask is not None
            again = ask(number)
            if again is not None and again <= 0:
                break
        # A first token due at the very instant the delay ends wins without a hedge, and a
        # failure at that instant is a failover: let the tasks woken in this tick run first
        # (a commit cancels us right here).
        await trio.lowlevel.checkpoint()
        if self._news:
            return self._take_news(self._news.popleft())
        if self._answering & self._live:
            # A recovery is answering (its prefill is over): a hedge is for a slow first
            # output, and only a failure may start another attempt now.
            return self._take_news(await self._next_news())
        if self._planner.may_hedge():
            return "hedge"
        # The budget said no: the running attempts go on alone; only a failure may still
        # start another attempt.
        self._recorder.hedges_refused += 1
        return self._take_news(await self._next_news())

    def _post(self, news: _News) -> None:
        self._news.append(news)
        self._news_arrived.unpark()

    async def _next_news(self) -> _News:
        while not self._news:
            await self._news_arrived.park()
        return self._news.popleft()

    def _take_news(self, news: _News) -> str | None:
        kind, number = news
        if kind == "empty" and self._answer is None:
            self._answer = number
        return None if self._answer is not None else self._retry

    def _start(self, number: int, source: Source, trigger: str, *, hedged: bool = False) -> None:
        state = _AttemptState(
            number=number,
            replica=source.name,
            trigger=trigger,
            started_at=trio.current_time(),
            model=getattr(source, "model", None),
        )
        rec = self._recorder
        rec.attempts.append(state)
        if trigger == "hedge":
            rec.hedged = True  # a backup really was sent on the hedge delay
        continue_from = instruction = None
        continue_tokens = 0
        if self._resume is not None:
            plan = self._resume(source)
            continue_from, instruction = plan.continue_from, plan.instruction
            self._gates[number] = plan.gate
            added = plan.record.prompt_added
            planner = self._planner
            ask_deadline = getattr(planner, "recovery_deadline", None)
            deadline = FALLBACK_DEADLINE if ask_deadline is None else ask_deadline(source, added)
            ask_delay = getattr(planner, "recovery_hedge_delay", None)
            self._hedge_delays[number] = None if ask_delay is None else ask_delay(source, added)
            state.recovery = attrs.evolve(plan.record, deadline=deadline, hedged=hedged)
            if continue_from is not None:
                continue_tokens = state.recovery.tokens
        self._sources[number] = source
        self._live.add(number)
        self._changed(state)
        info = AttemptInfo(
            request_id=rec.request_id,
            number=number,
            trigger=trigger,
            idempotency_key=rec.idempotency_key,
            continue_from=continue_from,
            continue_tokens=continue_tokens,
            instruction=instruction,
        )
        scope = self._scopes[number] = trio.CancelScope()
        self._nursery.start_soon(
            self._attempt, state, source, info, scope, name=f"trio_hedge attempt {number}"
        )

    # -- one attempt (its own task) --------------------------------------------------------

    async def _attempt(
        self, state: _AttemptState, source: Source, info: AttemptInfo, scope: trio.CancelScope
    ) -> None:
        number = state.number
        with scope:
            try:
                if self._resume is None:
                    await self._read(state, source, info)
                else:
                    await self._read_gated(state, source, info)
            except BaseException as exc:
                # Settle first, close after: a failure starts the next attempt at once, not
                # after this attempt's close.
                to_raise = self._settle(state, source, exc, scope)
                if to_raise is exc:
                    raise
                if to_raise is not None:
                    raise to_raise from None
            finally:
                stream = self._streams.pop(number, None)
                if stream is not None:
                    if scope.cancel_called and self._recorder.winner is not None:
                        # A loser: its close costs CPU (an HTTP close is ~0.5 ms) on the one
                        # thread the winner's first token also needs. Yield once so the
                        # caller, woken by the same commit, gets the token out first; the
                        # loser's server hears of it one scheduling tick later.
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    await self._close(stream)
                    if self._resume is not None:
                        # A recovery that never took over: the caller never gets its answer.
                        await discard_quietly(stream, self._close_timeout)
        if scope.cancel_called:
            self._ended_early(state)

    def _settle(
        self, state: _AttemptState, source: Source, exc: BaseException, scope: trio.CancelScope
    ) -> BaseException | None:
        """Record how an attempt ended on ``exc``; return what must propagate, if anything."""
        cancelled, others = _split_cancelled(exc)
        if any(not isinstance(e, Exception) for e in others):
            return exc  # KeyboardInterrupt, SystemExit: never data
        if cancelled is not None or scope.cancel_called:
            # Cancelled (maybe inside a group from Trio's own code, say a pending connect),
            # or an error raised while being cancelled: either way this attempt was stopped.
            self._ended_early(state)
            return cancelled
        self._failed(state, source, classify_exception(exc))
        return None

    async def _close(self, stream: AttemptStream) -> None:
        if getattr(stream, "task_bound", False):
            # Its own scopes may still be open in this task: enter no scope of ours.
            try:  # noqa: SIM105 - suppress() is a context manager too (harmless, but kept plain)
                await stream.aclose()
            except Exception:
                pass
        else:
            await close_quietly(stream, self._close_timeout)

    async def _read(self, state: _AttemptState, source: Source, info: AttemptInfo) -> None:
        number = state.number
        stream = await source.open(info)
        self._streams[number] = stream  # no checkpoint since open() returned: owned
        pending = self._pending[number] = []
        rule = self._first_token
        while True:
            batch = await stream.receive()
            if batch is None:  # ended cleanly before any first token: an answer all the same,
                self._post(("empty", number))  # which waits for the others
                self._live.discard(number)
                await trio.sleep_forever()
            pending.extend(batch)
            state.tokens_received += sum(1 for d in batch if d.content)
            for delta in batch:
                if counts_as_first_token(delta, rule):
                    if not self._commit(state):
                        self._ended_early(state)  # too late: another won, or the caller left
                    elif getattr(stream, "task_bound", False):
                        await self._relay(number, stream)
                    return

    async def _read_gated(self, state: _AttemptState, source: Source, info: AttemptInfo) -> None:
        """A recovery attempt: its output passes the gate (held back while it reproduces the
        answer so far); it commits at the first delta that follows. Until its first output
        (any content, reasoning or tool-call fragment: the reproduced prefix too) it is held
        to its first-token deadline (`RecoveryRecord.deadline`): a prefill is no stall. From
        then on ``stall_timeout`` bounds each silence, as it does the winner's."""
        number = state.number
        recovery = state.recovery
        assert recovery is not None
        first_by = math.inf if recovery.deadline is None else state.started_at + recovery.deadline
        stream: AttemptStream | None = None
        with trio.move_on_at(first_by):
            stream = await source.open(info)
            self._streams[number] = stream  # no checkpoint since open() returned: owned
        if stream is None:
            self._no_output(recovery.deadline)
        assert stream is not None
        gate = self._gates[number]
        stall = self._stall_timeout
        progress_at: float | None = None  # the last output's time; None before the first
        while True:
            if progress_at is None:
                wake = first_by
            else:
                wake = math.inf if stall is None else progress_at + stall
            if wake == math.inf:
                batch = await stream.receive()
            else:
                with trio.move_on_at(wake) as waited:
                    batch = await stream.receive()
                if waited.cancelled_caught:
                    if progress_at is None:
                        self._no_output(recovery.deadline)
                    raise AttemptError(
                        ErrorKind.STALL, f"no progress for stall_timeout={stall} s in a recovery"
                    )
            if batch is None:
                gate.end()  # raises unless the answer so far was reproduced
                self._pending[number] = []
                self._post(("empty", number))  # the whole answer was reproduced, nothing more
                self._live.discard(number)
                await trio.sleep_forever()
            state.tokens_received += sum(1 for d in batch if d.content)
            if any(d.has_output for d in batch):
                now = trio.current_time()
                if progress_at is None:
                    state.recovery = recovery = attrs.evolve(
                        recovery, first_output=now - state.started_at
                    )
                    self._answering.add(number)
                progress_at = now
            relayed = gate.feed(batch)
            if relayed and not any(d.has_output or d.finish_reason for d in relayed):
                # An open gate (a vLLM continuation) passes its role-only opening: no new
                # text yet, nothing to commit on (the caller has its role already).
                relayed = []
            if relayed:
                limit = getattr(source, "token_limit", None)
                if isinstance(gate, AnchorGate) and limit is not None:
                    capped = _Capped(stream, limit - recovery.tokens)
                    relayed = capped.take(relayed)
                    self._streams[number] = stream = capped
                self._pending[number] = relayed
                state.recovery = attrs.evolve(
                    recovery, verified=gate.verified, held_back=gate.held_back
                )
                if not self._commit(state):
                    self._ended_early(state)
                elif getattr(stream, "task_bound", False):
                    await self._relay(number, stream)
                return

    @staticmethod
    def _no_output(deadline: float | None) -> NoReturn:
        raise AttemptError(
            ErrorKind.TIMEOUT,
            f"no output within the recovery's first-token deadline of {deadline:g} s",
        )

    async def _relay(self, number: int, stream: AttemptStream) -> None:
        """Serve a task-bound winner: read it here, hand batches to the caller's task."""
        send, receive = trio.open_memory_channel[Sequence[Delta] | Exception | None](0)
        done = trio.Event()
        scope = self._scopes[number]
        assert self._winner is not None
        self._winner = attrs.evolve(self._winner, stream=_Relay(receive, scope, done))
        self._streams[number] = stream  # this task still owns and closes the real stream
        try:
            with send:
                while True:
                    try:
                        batch = await stream.receive()
                    except Exception as exc:
                        await send.send(exc)
                        return
                    await send.send(batch)
                    if batch is None:
                        return
        except trio.BrokenResourceError:
            return  # the caller closed the winner
        finally:
            stream = self._streams.pop(number)
            await self._close(stream)
            done.set()

    # -- decisions (synchronous: nothing else runs in between) ------------------------------

    def _decide(self) -> None:
        """A winner, a fatal error or the timeout: stop the parent loop and every loser."""
        self._decided = True
        self._stagger_scope.cancel()
        winner = None if self._winner is None else self._winner.number
        for number, scope in self._scopes.items():
            if number != winner or self._answer == winner:
                scope.cancel()
        self._live.clear()

    def _commit(self, state: _AttemptState) -> bool:
        """``state``'s attempt produced the first token. Returns whether it won."""
        if self._decided:
            return False  # another attempt committed (or failed fatally) in the same tick
        number = state.number
        now = trio.current_time()
        state.outcome = AttemptOutcome.WON
        state.ttft = now - state.started_at
        self._hand_over(number, ended=False, now=now)
        self._changed(state)
        return True

    def _commit_answer(self, number: int) -> None:
        """Commit the empty answer of ``number``: no other attempt can still answer."""
        if self._decided:
            return
        state = self._recorder.attempt(number)
        now = trio.current_time()
        state.outcome = AttemptOutcome.WON
        self._hand_over(number, ended=True, now=now)
        self._changed(state)

    def _hand_over(self, number: int, *, ended: bool, now: float) -> None:
        stream = self._streams.pop(number)  # the one line that takes it from its task
        source = self._sources[number]
        limit = getattr(source, "token_limit", None)
        self._winner = Committed(number, stream, self._pending.pop(number), ended, limit, source)
        self._recorder.winner = number
        if self._resume is None:  # a recovery serves an answer committed long ago
            self._recorder.committed_at = now
        self._decide()

    def _ended_early(self, state: _AttemptState) -> None:
        """Cancelled: a loser, the timeout, a fatal error elsewhere, or the caller left."""
        self._live.discard(state.number)
        if state.outcome is not AttemptOutcome.RUNNING:
            return  # the winner (its relay ended), or already failed
        state.outcome = AttemptOutcome.TIMEOUT if self._timed_out else AttemptOutcome.CANCELLED
        state.ended_at = trio.current_time()
        self._changed(state)

    def _failed(self, state: _AttemptState, source: Source, error: AttemptError) -> None:
        if error.replica is None:
            error.replica = source.name
        state.outcome = AttemptOutcome.FAILED
        state.error = error
        state.ended_at = trio.current_time()
        self._live.discard(state.number)
        self._changed(state)
        if self._decided:
            return
        fails_over = getattr(self._planner, "fails_over", None)
        if not error.retryable and (fails_over is None or not fails_over(error)):
            self._fatal = error
            self._decide()
        else:
            self._post(("failed", state.number))


async def race(
    planner: Planner,
    recorder: _Recorder,
    nursery: trio.Nursery,
    *,
    first_token: FirstToken,
    close_timeout: float,
    first_token_timeout: float | None = None,
    resume: Resume | None = None,
    stall_timeout: float | None = None,
    limit: int | None = None,
) -> Committed:
    """Race attempts, as tasks of ``nursery``, until one produces a first token.

    Returns at the commit, without waiting for the losers: they close their streams in their
    own tasks, which ``nursery`` waits for.

    With ``resume``, a *recovery* race (after the winner broke, ``_recovery.py``): attempts
    are numbered on from the recorder's, start with ``trigger="recovery"`` (at most
    ``limit``: the next after a failure, or as a hedge when the planner's
    ``recovery_hedge_delay`` passes with no new text and ``may_hedge`` allows), pass a gate
    and commit at the first delta after the answer so far; each is abandoned at its
    first-token deadline (``recovery_deadline``) without output, and ``stall_timeout`` bounds
    each silence after its first output; the request's TTFT stays.

    Returns:
        the `Committed` winner; its stream is open and owned by the caller.

    Raises:
        FatalAttemptError: an attempt failed with an error that is the request's fault.
        AllAttemptsFailed: every attempt the planner allowed failed, or no first token came
            within ``first_token_timeout`` seconds.
        HedgeError: what the planner raised (e.g. every replica cooling too long).
    """
    return await _Race(
        planner,
        recorder,
        nursery,
        first_token=first_token,
        close_timeout=close_timeout,
        first_token_timeout=first_token_timeout,
        resume=resume,
        stall_timeout=stall_timeout,
        limit=limit,
    ).run()
