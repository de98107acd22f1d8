"""Seeded cancellation fuzz over real loopback sockets.

Each race draws, from its own seeded ``random.Random``, the replicas' behaviours (TTFT,
tokens, HTTP errors, resets, in-band errors, empty answers, headers held back, keep-alives,
a refused port, a connect that stays pending), the protocol (HTTP/1.1 or h2c), the hedge delay
and a cancel point: before the first attempt, during a TCP connect, while waiting for headers,
at the commit instant (a deadline, ``first_token_timeout`` or hedge delay equal to the
primary's TTFT, a failure due at the commit), right after the commit, mid-stream, via the
caller's cancel scope at a random time, via ``first_token_timeout``, via ``break``. Ties are
drawn on purpose: two replicas with the same TTFT started together, a hedge delay equal to the
primary's TTFT, a failure due at the same instant as a first token.

After each race it checks the library's promises:

* **every response closed**: no response open in the httpx pool once ``async with`` exited;
* **every server saw its disconnect**: every request of the race ended on its server
  (answered, or the client's disconnect seen: ``RequestRecord.finished``), within a bound;
* **every attempt's outcome final** (won, cancelled, failed, timeout) with an ``ended_at``,
  one winner at most, no attempt started after the commit, ``hedged`` only with a hedge;
* **no request storm**: at most one attempt per replica, each server saw at most one request;
* **the right error type**: only ``HedgeError`` s or the caller's own cancellation come out,
  and each fits what happened (``FatalAttemptError`` only with a request-fault replica,
  ``StreamInterrupted`` only when the winner broke after its first token, with ``.text`` the
  tokens read, no "no first token" when an attempt committed, an empty answer never beating
  an attempt still running);

and, after all races, that no file descriptor or Trio task was left behind, and that no async
generator was left for the garbage collector to finalise (Trio's ``ResourceWarning`` "Surround
its use in 'async with aclosing(...)'": httpx's and httpcore's generators under a response
left early; recorded with the races running when it fired, and failing the test: in the
collector's context ``filterwarnings = error`` could only print it). Any other warning fails
it too.

Running it:

* default: 500 races (about 13 s on 2 cores), seed 8 (this is what ``.ci/run`` runs);
* ``TRIO_HEDGE_FUZZ_RACES=10000 pytest tests/test_cancel_fuzz.py``: the long run (~3.5 min);
* ``TRIO_HEDGE_FUZZ_SEED=<n>``: another sequence of races;
* ``TRIO_HEDGE_FUZZ_REPLAY=<seed>:<race>``: the failure message names each failing race this
  way; this runs that race's draw again, 100 times (``TRIO_HEDGE_FUZZ_RACES`` sets how many).
  The draw is the same each time but real time is not, so a failure that needs a tie shows
  up in some of the runs, not all.

Races run in 4 lanes at once (each lane runs its races one after the other), sharing the
servers, so the timing of one race never depends on another's checks. Each lane has its own
HTTP/1.1 client; all lanes share one h2c client, as a gateway shares one: streams of
concurrent races multiplex on its connections, so a cancel that corrupts a connection (a
write cut in half: ``trio_hedge/_network.py``) breaks other races' streams, and a lost reset
leaves a server working. An event hook files every response under its request id, so "every
response closed" is checked per race even on the shared client, and every client's pool must
be empty at the end. Violations are collected over all races and reported together, grouped
by kind, each with the races that show it.
"""

from __future__ import annotations

import os
import random
import re
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import httpx
import trio

import trio_hedge as th
from trio_hedge.errors import ErrorKind as K
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.testing import Behaviour, FakeReplica, RequestRecord

from . import misbehaving as mb
from .misbehaving import Baseline, Blackhole, GeneratorLeaks, open_responses

RACES = int(os.environ.get("TRIO_HEDGE_FUZZ_RACES", "500"))
SEED = int(os.environ.get("TRIO_HEDGE_FUZZ_SEED", "8"))
REPLAY = os.environ.get("TRIO_HEDGE_FUZZ_REPLAY")
LANES = 4
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
NEVER = 30.0
#: Every race has a first-token deadline (a pending connect would otherwise wait 5 s).
BACKSTOP = 1.0
#: How long a server may take to notice a disconnect (it takes milliseconds).
SOON = 2.0
#: A race that takes longer than this hangs.
HANG = 10.0

FATAL_KINDS = (K.INVALID_REQUEST, K.CONTEXT_LENGTH_EXCEEDED)
FINAL = (O.WON, O.CANCELLED, O.FAILED, O.TIMEOUT)


# -- what a race is made of -------------------------------------------------------------------


@attrs.frozen
class Slot:
    """One replica of a race: a behaviour for a FakeReplica, or a socket that does not
    serve (``"refused"``, ``"blackhole"``)."""

    kind: str
    behaviour: Behaviour | None = None
    #: when set, the slot's decisive event (first token, or error) is due this many seconds
    #: after the race started, whenever its request arrives: two slots with the same ``at``
    #: have their servers' timers expire in the same scheduling tick, so the client reads
    #: both events in one tick too.
    at: float | None = None

    def behaviour_at(self, start: float) -> Behaviour:
        """The behaviour to serve now, for a race that started at ``start``."""
        assert self.behaviour is not None
        if self.at is None:
            return self.behaviour
        delay = max(0.0, start + self.at - trio.current_time())
        if self.behaviour.is_error:
            return attrs.evolve(self.behaviour, error_delay=delay)
        return attrs.evolve(self.behaviour, ttft=delay)

    @property
    def fatal(self) -> bool:
        return self.kind == "400"

    @property
    def breaks_after_commit(self) -> bool:
        return self.kind in ("cut after tokens", "in-band after tokens")

    @property
    def text(self) -> str:
        assert self.behaviour is not None
        return "".join(self.behaviour.token_texts)


TTFTS = (0.0, 0.001, 0.003, 0.01, 0.02)


def draw_slot(rng: random.Random) -> Slot:
    ttft = rng.choice(TTFTS)
    gap = rng.choice((0.0, 0.001, 0.004))
    tokens = rng.randint(1, 4)
    kind = rng.choices(
        [
            "ok",
            "slow",
            "empty",
            "503",
            "429",
            "500",
            "401",
            "400",
            "cut before a token",
            "cut after tokens",
            "in-band before a token",
            "in-band after tokens",
            "headers held back",
            "keep-alives",
            "refused",
            "blackhole",
        ],
        weights=[30, 6, 3, 5, 3, 3, 3, 2, 3, 3, 3, 3, 4, 3, 2, 3],
    )[0]
    b: Behaviour | None
    if kind == "ok":
        b = Behaviour(ttft=ttft, token_delay=gap, tokens=tokens)
    elif kind == "slow":
        b = Behaviour(ttft=NEVER)
    elif kind == "empty":
        b = Behaviour(ttft=ttft, tokens=0)
    elif kind in ("503", "429", "500", "401", "400"):
        b = Behaviour(status=int(kind), error_delay=ttft)
    elif kind == "cut before a token":
        b = Behaviour(ttft=ttft, cut_after=0)
    elif kind == "cut after tokens":
        b = Behaviour(ttft=ttft, token_delay=gap, tokens=4, cut_after=rng.randint(1, 3))
    elif kind == "in-band before a token":
        b = Behaviour(ttft=ttft, inband_error_after=0, inband_error_status=503)
    elif kind == "in-band after tokens":
        b = Behaviour(ttft=ttft, token_delay=gap, tokens=4, inband_error_after=rng.randint(1, 3))
    elif kind == "headers held back":
        b = Behaviour(status=503, error_delay=NEVER)
    elif kind == "keep-alives":
        b = Behaviour(stall_after=0, keepalive_interval=0.002)
    else:
        b = None  # refused, blackhole
    return Slot(kind, b)


@attrs.frozen
class Plan:
    """One race: its replicas, protocol, policy and cancel point."""

    race: str  # "<seed>:<index>"
    slots: tuple[Slot, ...]
    http2: bool
    hedge_after: float | None
    first_token_timeout: float
    cancel: str  # which cancel point
    scope_deadline: float | None = None  # seconds after the start
    cancel_after_tokens: int | None = None  # cancel the scope after reading this many
    break_after: int | None = None
    cancel_on_arrival: bool = False  # cancel when the primary's server has the request

    def describe(self) -> str:
        slots = ", ".join(
            s.kind
            if s.behaviour is None
            else f"{s.kind}({'at' if s.at is not None else 'ttft'}={s.at or s.behaviour.ttft})"
            for s in self.slots
        )
        extras = [
            f"{name}={value}"
            for name, value in (
                ("scope_deadline", self.scope_deadline),
                ("cancel_after_tokens", self.cancel_after_tokens),
                ("break_after", self.break_after),
            )
            if value is not None
        ]
        return (
            f"race {self.race}: cancel={self.cancel!r} {'h2c' if self.http2 else 'http/1.1'} "
            f"hedge_after={self.hedge_after} first_token_timeout={self.first_token_timeout} "
            f"{' '.join(extras)} [{slots}]"
        )


CANCEL_POINTS = (
    "none",
    "break",
    "before the first attempt",
    "during a connect",
    "waiting for headers",
    "at the commit instant",
    "right after the commit",
    "mid-stream",
    "caller's cancel scope",
    "first_token_timeout",
    "two first tokens in one tick",
    "failure at the commit instant",
)


def draw_plan(race: str) -> Plan:
    rng = random.Random(race)
    cancel = rng.choice(CANCEL_POINTS)
    slots = [draw_slot(rng) for _ in range(rng.randint(1, 3))]
    http2 = rng.random() < 0.4
    hedge_after = rng.choice((None, 0.0, 0.002, 0.005, 0.01, 0.02))
    ftt = BACKSTOP
    scope_deadline: float | None = None
    cancel_after_tokens: int | None = None
    break_after: int | None = None
    cancel_on_arrival = False
    ok_ttft = rng.choice((0.003, 0.005, 0.01, 0.02))
    ok_behaviour = Behaviour(ttft=ok_ttft, token_delay=0.001, tokens=rng.randint(1, 4))
    ok = Slot("ok", ok_behaviour)
    jitter = rng.uniform(-0.002, 0.002)
    if cancel == "break":
        break_after = rng.randint(0, 2)
    elif cancel == "during a connect":
        slots[0] = Slot("blackhole")
        how = rng.choice(("scope", "first_token_timeout", "a backup's commit"))
        if how == "scope":
            scope_deadline = rng.uniform(0.0, 0.01)
        elif how == "first_token_timeout":
            ftt = rng.uniform(0.001, 0.01)
        else:
            slots[1:] = [ok]
            hedge_after = rng.choice((0.0, 0.001, 0.003))
    elif cancel == "waiting for headers":
        slots[0] = Slot("headers held back", Behaviour(status=503, error_delay=NEVER))
        how = rng.choice(("on arrival", "first_token_timeout", "a backup's commit"))
        if how == "on arrival":
            cancel_on_arrival = True
        elif how == "first_token_timeout":
            ftt = rng.uniform(0.002, 0.02)
        else:
            slots[1:] = [ok]
            hedge_after = rng.choice((0.0, 0.002, 0.005))
    elif cancel == "at the commit instant":
        slots[0] = Slot("ok", ok_behaviour, at=ok_ttft)  # its first token due at ok_ttft
        how = rng.choice(("scope", "first_token_timeout", "hedge delay"))
        if how == "scope":
            scope_deadline = max(0.0, ok_ttft + jitter)
        elif how == "first_token_timeout":
            ftt = max(0.001, ok_ttft + jitter)
        else:
            hedge_after = ok_ttft  # a tie: the hedge is due as the first token arrives
            if len(slots) == 1:
                slots.append(draw_slot(rng))
    elif cancel == "right after the commit":
        cancel_after_tokens = 0
    elif cancel == "mid-stream":
        cancel_after_tokens = rng.randint(1, 3)
    elif cancel == "caller's cancel scope":
        scope_deadline = rng.uniform(0.0, 0.04)
    elif cancel == "first_token_timeout":
        ftt = rng.uniform(0.001, 0.04)
    elif cancel == "two first tokens in one tick":
        twin = Slot("ok", Behaviour(token_delay=0.001, tokens=3), at=ok_ttft)
        slots[:2] = [twin, twin]
        hedge_after = 0.0
    elif cancel == "failure at the commit instant":
        # The primary's first token and the backup's failure fall due in one tick; a third
        # replica would only be started by that failure, which must not happen once an
        # attempt committed. The hedge delay brings the backup in before that instant and
        # the third only after it.
        failing = Slot("503", Behaviour(status=503), at=ok_ttft)
        slots = [Slot("ok", ok_behaviour, at=ok_ttft), failing, Slot("ok", Behaviour())]
        hedge_after = ok_ttft * 0.6
    return Plan(
        race=race,
        slots=tuple(slots),
        http2=http2,
        hedge_after=hedge_after,
        first_token_timeout=ftt,
        cancel=cancel,
        scope_deadline=scope_deadline,
        cancel_after_tokens=cancel_after_tokens,
        break_after=break_after,
        cancel_on_arrival=cancel_on_arrival,
    )


# -- the servers: FakeReplicas answering per plan ---------------------------------------------


@attrs.define
class Pending:
    """A race in flight: its plan, and what its replicas recorded."""

    plan: Plan
    start: float
    records: list[tuple[int, RequestRecord]] = attrs.Factory(list)  # (slot, record)
    arrived: trio.Event = attrs.Factory(trio.Event)  # the primary's server has the request


@attrs.define
class Fleet:
    h1: list[FakeReplica]
    h2: list[FakeReplica]
    blackhole_url: str
    refused_url: str
    races: dict[str, Pending] = attrs.Factory(dict)
    unknown: int = 0

    def behaviour_for(self, slot: int) -> Callable[[RequestRecord], Behaviour]:
        def behave(record: RequestRecord) -> Behaviour:
            pending = self.races.get(record.headers.get("x-request-id", ""))
            if pending is None or slot >= len(pending.plan.slots):
                self.unknown += 1
                return Behaviour()
            pending.records.append((slot, record))
            if slot == 0:
                pending.arrived.set()
            return pending.plan.slots[slot].behaviour_at(pending.start)

        return behave

    def url(self, plan: Plan, slot: int) -> str:
        kind = plan.slots[slot].kind
        if kind == "refused":
            return self.refused_url
        if kind == "blackhole":
            return self.blackhole_url
        return (self.h2 if plan.http2 else self.h1)[slot].url

    def servers(self) -> list[FakeReplica]:
        return [*self.h1, *self.h2]


@asynccontextmanager
async def fleet() -> AsyncIterator[Fleet]:
    with Blackhole() as hole:
        async with AsyncExitStack() as stack:
            f = Fleet([], [], hole.url, f"http://127.0.0.1:{mb.refused_port()}/v1")
            for http2, servers in ((False, f.h1), (True, f.h2)):
                for slot in range(3):
                    replica = FakeReplica(
                        f.behaviour_for(slot),
                        name=f"{'h2' if http2 else 'h1'}-{slot}",
                        http2=http2,
                    )
                    servers.append(await stack.enter_async_context(replica))
            yield f


# -- one race ---------------------------------------------------------------------------------


class Responses:
    """Every response the fuzz's clients open, filed by request id (an event hook, which
    awaits nothing, so it adds no checkpoint)."""

    def __init__(self) -> None:
        self.by_race: dict[str, list[httpx.Response]] = defaultdict(list)

    async def _file(self, response: httpx.Response) -> None:
        self.by_race[response.request.headers.get("x-request-id", "")].append(response)

    def client(self, **kwargs: bool) -> httpx.AsyncClient:
        return th.transport.make_client(event_hooks={"response": [self._file]}, **kwargs)

    async def close_left_open(self, rid: str) -> bool:
        """Close the race's responses still open; whether there were any."""
        left_open = [r for r in self.by_race.pop(rid, ()) if not r.is_closed]
        with trio.CancelScope(shield=True):
            for response in left_open:  # do not let a leak spill into later races
                await response.aclose()
        return bool(left_open)


@attrs.define
class Lane:
    """Clients for races run one after the other: the lane's own HTTP/1.1 client, and the h2c
    client every lane shares."""

    responses: Responses
    h2: httpx.AsyncClient
    h1: httpx.AsyncClient = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.h1 = self.responses.client()

    def client(self, plan: Plan) -> httpx.AsyncClient:
        return self.h2 if plan.http2 else self.h1

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.h1.aclose()


async def run_race(plan: Plan, fleet: Fleet, lane: Lane) -> list[str]:
    """Run one race; return the broken promises found."""
    found: list[str] = []
    client = lane.client(plan)
    rid = str(uuid.uuid4())
    start = trio.current_time()
    pending = Pending(plan, start)
    fleet.races[rid] = pending
    replicas = [th.Replica(fleet.url(plan, i), name=f"s{i}") for i in range(len(plan.slots))]
    policy = th.HedgePolicy(
        hedge_after=plan.hedge_after, first_token_timeout=plan.first_token_timeout
    )
    stream = th.hedged_stream(REQUEST, replicas, policy, client=client, request_id=rid)
    tokens: list[str] = []
    error: BaseException | None = None
    cancelled = False
    try:
        with trio.fail_after(HANG):
            async with trio.open_nursery() as helpers:
                with trio.CancelScope() as scope:
                    if plan.cancel == "before the first attempt":
                        scope.cancel()
                    if plan.scope_deadline is not None:
                        scope.deadline = start + plan.scope_deadline
                    if plan.cancel_on_arrival:

                        async def cancel_on_arrival() -> None:
                            await pending.arrived.wait()
                            scope.cancel()

                        helpers.start_soon(cancel_on_arrival)
                    try:
                        async with stream:
                            if plan.cancel_after_tokens == 0:
                                scope.cancel()
                            async for token in stream:
                                tokens.append(token)
                                if plan.break_after is not None and len(tokens) > plan.break_after:
                                    break
                                if plan.cancel_after_tokens == len(tokens):
                                    scope.cancel()
                    except th.HedgeError as exc:
                        error = exc
                cancelled = scope.cancelled_caught
                helpers.cancel_scope.cancel()
    except trio.TooSlowError:
        found.append(f"the race hung for {HANG} s")
    except BaseException as exc:
        found.append(f"raised {type(exc).__name__} (not a HedgeError): {exc!r}"[:300])
        error = exc

    # Every response closed, right when `async with` exited.
    if await lane.responses.close_left_open(rid):
        found.append("a response was left open after `async with` exited")
    # Every server saw the end of its request (answered, or the disconnect seen).
    with trio.move_on_after(SOON):
        for _, record in pending.records:
            await record.wait_finished()
    for slot, record in pending.records:
        if not record.finished:
            found.append(
                f"the server of attempt to s{slot} ({plan.slots[slot].kind}) never saw the "
                f"disconnect (tokens sent: {record.tokens_sent})"
            )
    del fleet.races[rid]
    found.extend(check_report(plan, stream.report, error, tokens, cancelled, pending))
    return found


def check_report(
    plan: Plan,
    report: th.Report,
    error: BaseException | None,
    tokens: list[str],
    cancelled: bool,
    pending: Pending,
) -> list[str]:
    found: list[str] = []
    check = lambda ok, message: None if ok else found.append(message)  # noqa: E731
    attempts = report.attempts
    # -- every attempt's outcome final -----------------------------------------------------
    for a in attempts:
        name = f"attempt {a.number} ({a.trigger}, {plan.slots[int(a.replica[1:])].kind})"
        if a.outcome not in FINAL:
            found.append(f"{name} is still {a.outcome.value!r} (no ended_at) after `async with`")
        else:
            check(a.ended_at is not None, f"{name} ({a.outcome.value}) has no ended_at")
        if a.outcome is O.FAILED:
            check(a.error is not None, f"{name} failed without an error")
    winners = [a.number for a in attempts if a.outcome is O.WON]
    check(len(winners) <= 1, f"{len(winners)} winners")
    check(winners == ([report.winner] if report.winner else []), "winner != the WON attempt")
    check(
        report.hedged == any(a.trigger == "hedge" for a in attempts),
        f"hedged={report.hedged} with triggers {[a.trigger for a in attempts]}",
    )
    if report.winner is not None and report.ttft is not None:
        late = [a.number for a in attempts if (a.started_at or 0) > report.ttft + 1e-9]
        check(not late, f"attempt(s) {late} started after the commit")
    # -- no storm ----------------------------------------------------------------------------
    names = [a.replica for a in attempts]
    check(len(names) == len(set(names)) <= len(plan.slots), f"attempts went to {names}")
    seen = [slot for slot, _ in pending.records]
    check(len(seen) == len(set(seen)), f"a server saw the race twice: {seen}")
    check(len(seen) <= len(attempts), f"{len(seen)} requests for {len(attempts)} attempts")
    # -- the right error type ----------------------------------------------------------------
    if error is None or isinstance(error, th.HedgeError):
        check(report.error is error or cancelled, "report.error is not the error raised")
    if isinstance(error, th.FatalAttemptError):
        check(any(s.fatal for s in plan.slots), "FatalAttemptError without a 400 replica")
        check(error.error.kind in FATAL_KINDS, f"FatalAttemptError.error is {error.error!r}")
        check(not error.error.retryable, "FatalAttemptError.error is retryable")
        check(report.winner is None, "FatalAttemptError although an attempt won")
    elif isinstance(error, th.StreamInterrupted):
        winner = plan.slots[int(report.winner_replica[1:])] if report.winner_replica else None
        check(
            winner is not None and winner.breaks_after_commit,
            f"StreamInterrupted ({error.error.kind.value}) from a "
            f"{winner.kind if winner else '?'} winner",
        )
        check(error.text == "".join(tokens), "StreamInterrupted.text is not what was read")
    elif isinstance(error, th.AllAttemptsFailed):
        check(
            report.winner is None,
            f"AllAttemptsFailed({str(error)[:60]!r}) although attempt {report.winner} committed",
        )
        timed_out = bool(error.errors) and error.errors[-1].kind is K.TIMEOUT
        if timed_out and "first_token_timeout" in str(error):
            bad = [a.outcome.value for a in attempts if a.outcome not in (O.TIMEOUT, O.FAILED)]
            check(not bad, f"first_token_timeout, but attempts ended {bad}")
        else:
            answered = [
                slot
                for slot, record in pending.records
                if plan.slots[slot].kind == "empty" and record.completed
            ]
            check(
                not answered or cancelled,
                f"AllAttemptsFailed although s{answered[0] if answered else '?'}'s empty answer "
                f"arrived whole (attempts ended {[a.outcome.value for a in attempts]})",
            )
            check(
                all(a.outcome is O.FAILED for a in attempts) or cancelled,
                f"AllAttemptsFailed with attempts {[a.outcome.value for a in attempts]}",
            )
    elif error is None and not cancelled and report.winner_replica is not None:
        winner = plan.slots[int(report.winner_replica[1:])]
        if plan.break_after is None and winner.behaviour is not None:
            check(
                "".join(tokens) == winner.text,
                f"read {''.join(tokens)!r} from {winner.kind}, expected {winner.text!r}",
            )
            check(report.completed, "a stream read to its end is not completed")
    # -- an empty answer never beats an attempt that was still running ------------------------
    if report.winner is not None and report.winner_replica is not None:
        winner = plan.slots[int(report.winner_replica[1:])]
        if winner.kind == "empty":
            beaten = [
                a.number
                for a in attempts
                if a.outcome is O.CANCELLED and a.ended_at is not None and report.ttft is not None
                if abs(a.ended_at - report.ttft) < 1e-6
            ]
            check(not beaten, f"an empty answer beat running attempt(s) {beaten}")
    return found


# -- the fuzz ---------------------------------------------------------------------------------


def _kind_of(message: str) -> str:
    """A violation's kind: its message with numbers and quoted details blurred."""
    message = re.sub(r"\d+(\.\d+)?", "N", message)
    return re.sub(r"'[^']*'", "'…'", message)[:140]


async def test_cancellation_fuzz() -> None:
    if REPLAY is not None:
        races = [REPLAY] * int(os.environ.get("TRIO_HEDGE_FUZZ_RACES", "100"))
    else:
        races = [f"{SEED}:{i}" for i in range(RACES)]
    plans = [draw_plan(race) for race in races]
    baseline = Baseline.take()
    violations: dict[str, list[str]] = defaultdict(list)
    examples: dict[str, str] = {}
    outcomes: dict[str, int] = defaultdict(int)

    responses = Responses()
    left_open: list[str] = []
    generators = GeneratorLeaks()  # what the garbage collector had to finalise
    with generators.recording():
        async with fleet() as f:
            async with responses.client(http1=False, http2=True) as shared_h2:

                async def lane_runner(lane_plans: Sequence[Plan]) -> None:
                    lane = Lane(responses, shared_h2)
                    try:
                        for plan in lane_plans:
                            generators.running.add(plan.race)
                            try:
                                problems = await run_race(plan, f, lane)
                            finally:
                                generators.running.discard(plan.race)
                            for problem in problems:
                                kind = _kind_of(problem)
                                violations[kind].append(plan.race)
                                examples.setdefault(kind, f"{problem}\n      in {plan.describe()}")
                            outcomes[plan.cancel] += 1
                        if n := open_responses(lane.h1):
                            left_open.append(f"{n} response(s) open in a lane's HTTP/1.1 pool")
                    finally:
                        await lane.aclose()

                async with trio.open_nursery() as nursery:
                    for i in range(LANES):
                        nursery.start_soon(lane_runner, plans[i::LANES])
                if n := open_responses(shared_h2):
                    left_open.append(f"{n} response(s) open in the shared h2c pool")
            with trio.fail_after(SOON):
                for server in f.servers():
                    await server.wait_connections(0)
            assert f.unknown == 0, f"{f.unknown} requests reached a server without a race"
        await generators.settle()
    leaks = left_open + await baseline.changes() + generators.problems()

    assert sum(outcomes.values()) == len(plans)
    if violations or leaks:
        lines = []
        for kind, where in sorted(violations.items(), key=lambda kv: -len(kv[1])):
            shown = ", ".join(where[:5]) + (" …" if len(where) > 5 else "")
            lines.append(f"- {len(where)} race(s): {examples[kind]}\n      races: {shown}")
        lines += [f"- after all races: {leak}" for leak in leaks]
        raise AssertionError(
            f"{sum(len(w) for w in violations.values())} broken promise(s) in "
            f"{len({r for w in violations.values() for r in w})} of {len(plans)} races "
            f"(seed {SEED}; replay one with TRIO_HEDGE_FUZZ_REPLAY=<race>):\n" + "\n".join(lines)
        )
