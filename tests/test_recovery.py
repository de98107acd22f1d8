"""Recovery after the commit (issue 17): when the winner breaks mid-answer, the answer goes on
on another replica with no gap and no repeated text, by continuation (the replica declares its
engine's contract) or by replay and verify; a recovery that fails ends the answer as it would
have ended anyway, naming the original failure.

Each trigger is a misbehaving ``FakeReplica`` over a real loopback socket, and every case
asserts the exact text the caller gets, what each recovery sent and what the report says.
The timing cases (a stall, a second caller sharing the Hedger, a cancel during a recovery) run
in virtual time over ``MockReplicas``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge.errors import ErrorKind
from trio_hedge.events import Delta, FirstToken
from trio_hedge.policy import HedgerConfig
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.sources.anthropic import AnthropicReplica
from trio_hedge.sources.openai import merge_tool_calls
from trio_hedge.sources.openai_responses import ResponsesReplica
from trio_hedge.testing import Behaviour, FakeReplica, MockReplicas
from trio_hedge.testing._behaviour import PREFILL_REJECTED

REQUEST: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
N = 12
FULL = "".join(f"tok{i} " for i in range(N))


def prefix(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


#: Failover only (no hedges), no ejection: each case is about one request's recovery.
CONFIG = HedgerConfig(hedge_after=None, outlier_detection=None)
#: For the stalls (real time, over loopback: a bound, never waited out by a normal stream).
STALLING = attrs.evolve(CONFIG, stall_timeout=0.5)


@attrs.frozen
class Case:
    name: str
    primary: Behaviour
    backups: Sequence[tuple[Behaviour, str | None]]  # (behaviour, declared continuation)
    text: str  # exactly what the caller gets
    error: ErrorKind | None = None  # the StreamInterrupted's kind, None: complete
    methods: tuple[str, ...] = ()  # each recovery's method, in order
    verified: tuple[int, ...] = ()
    outcomes: tuple[O, ...] = ()  # of the recovery attempts
    sent: tuple[
        str, ...
    ] = ()  # what each recovery's request was: "original" / "vllm" / "llama.cpp"
    config: HedgerConfig = CONFIG
    broke_at: str = "r0"  # the replica whose failure the StreamInterrupted names


def cut(n: int, **kw: Any) -> Behaviour:
    return Behaviour(tokens=N, cut_after=n, **kw)


GOOD = Behaviour(tokens=N)
OTHER = Behaviour(tokens=[f"other{i} " for i in range(N)])

CASES = [
    Case(
        "cut after 5 tokens, replayed and verified",
        cut(5),
        [(GOOD, None)],
        FULL,
        methods=("replay",),
        verified=(len(prefix(5)),),
        outcomes=(O.WON,),
        sent=("original",),
    ),
    Case(
        "cut after 5 tokens, continued on vLLM (no prefix repeated)",
        cut(5),
        [(attrs.evolve(GOOD, continuation="vllm"), "vllm")],
        FULL,
        methods=("continuation",),
        verified=(0,),
        outcomes=(O.WON,),
        sent=("vllm",),
    ),
    Case(
        "cut after 5 tokens, continued on llama.cpp (its repeated prefix stripped)",
        cut(5),
        [(attrs.evolve(GOOD, continuation="llama.cpp"), "llama.cpp")],
        FULL,
        methods=("continuation",),
        verified=(len(prefix(5)),),
        outcomes=(O.WON,),
        sent=("llama.cpp",),
    ),
    Case(
        "stall after 5 tokens",
        Behaviour(tokens=N, stall_after=5),
        [(GOOD, None)],
        FULL,
        methods=("replay",),
        verified=(len(prefix(5)),),
        outcomes=(O.WON,),
        sent=("original",),
        config=STALLING,
    ),
    Case(
        "malformed event after 5 tokens",
        Behaviour(tokens=N, malformed_after=5),
        [(GOOD, None)],
        FULL,
        methods=("replay",),
        verified=(len(prefix(5)),),
        outcomes=(O.WON,),
        sent=("original",),
    ),
    Case(
        "in-band error after 5 tokens",
        Behaviour(tokens=N, inband_error_after=5),
        [(GOOD, None)],
        FULL,
        methods=("replay",),
        verified=(len(prefix(5)),),
        outcomes=(O.WON,),
        sent=("original",),
    ),
    Case(
        "cut before the finish: the replay reproduces everything and only finishes",
        cut(N),
        [(GOOD, None)],
        FULL,
        methods=("replay",),
        verified=(len(FULL),),
        outcomes=(O.WON,),
        sent=("original",),
    ),
    Case(
        "a fallback that rejects prefill, not declared: replayed",
        cut(5),
        [(attrs.evolve(GOOD, rejects_prefill=True), None)],
        FULL,
        methods=("replay",),
        verified=(len(prefix(5)),),
        outcomes=(O.WON,),
        sent=("original",),
    ),
    Case(
        "a fallback declared vLLM that rejects prefill: the cut is the error, not its 400",
        cut(5),
        [(attrs.evolve(GOOD, rejects_prefill=True), "vllm"), (GOOD, None)],
        prefix(5),
        error=ErrorKind.STREAM_TRUNCATED,
        methods=("continuation",),
        outcomes=(O.FAILED,),
        sent=("vllm",),
    ),
    Case(
        "a replay that diverges: the answer so far, the cut as the error",
        cut(5),
        [(OTHER, None)],
        prefix(5),
        error=ErrorKind.STREAM_TRUNCATED,
        methods=("replay",),
        outcomes=(O.FAILED,),
        sent=("original",),
    ),
    Case(
        "a llama.cpp continuation whose repeated prefix differs: diverged",
        cut(5),
        [(OTHER, "llama.cpp")],
        prefix(5),
        error=ErrorKind.STREAM_TRUNCATED,
        methods=("continuation",),
        outcomes=(O.FAILED,),
        sent=("llama.cpp",),
    ),
    Case(
        "a recovery that fails (503), then another that serves",
        cut(5),
        [(Behaviour(status=503), None), (GOOD, None)],
        FULL,
        methods=("replay", "replay"),
        verified=(0, len(prefix(5))),
        outcomes=(O.FAILED, O.WON),
        sent=("original", "original"),
    ),
    Case(
        "a recovery that stalls while it reproduces the prefix, then another that serves",
        cut(5),
        [(Behaviour(tokens=N, stall_after=2), None), (GOOD, None)],
        FULL,
        methods=("replay", "replay"),
        verified=(0, len(prefix(5))),
        outcomes=(O.FAILED, O.WON),
        sent=("original", "original"),
        config=STALLING,
    ),
    Case(
        "a recovery that breaks too, recovered again",
        cut(3),
        [(cut(8), None), (GOOD, None)],
        FULL,
        methods=("replay", "replay"),
        verified=(len(prefix(3)), len(prefix(8))),
        outcomes=(O.WON, O.WON),
        sent=("original", "original"),
    ),
    Case(
        "no replica left: StreamInterrupted as without recovery",
        cut(5),
        [],
        prefix(5),
        error=ErrorKind.STREAM_TRUNCATED,
    ),
    Case(
        "recovery off (max_recoveries=0)",
        cut(5),
        [(GOOD, None)],
        prefix(5),
        error=ErrorKind.STREAM_TRUNCATED,
        config=attrs.evolve(CONFIG, max_recoveries=0),
    ),
    Case(
        "at most max_recoveries: the second break ends the answer",
        cut(3),
        [(cut(8), None), (GOOD, None)],
        prefix(8),
        error=ErrorKind.STREAM_TRUNCATED,
        methods=("replay",),
        verified=(len(prefix(3)),),
        outcomes=(O.WON,),
        sent=("original",),
        config=attrs.evolve(CONFIG, max_recoveries=1),
        broke_at="r1",
    ),
]


def _sent(body: dict[str, Any]) -> str:
    """Which request a recovery sent: the original, or a continuation of which engine."""
    messages = body["messages"]
    if messages == REQUEST["messages"]:
        assert "continue_final_message" not in body
        return "original"
    assert messages[:-1] == REQUEST["messages"]
    assert messages[-1]["role"] == "assistant"
    if body.get("continue_final_message") is True:
        assert body["add_generation_prompt"] is False
        return "vllm"
    assert "continue_final_message" not in body and "add_generation_prompt" not in body
    return "llama.cpp"


@contextlib.asynccontextmanager
async def _fleet(behaviours: Sequence[Behaviour]) -> AsyncIterator[list[FakeReplica]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(FakeReplica(b, name=f"r{i}"))
            for i, b in enumerate(behaviours)
        ]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_recovery(case: Case) -> None:
    behaviours = [case.primary, *(b for b, _ in case.backups)]
    declared = [None, *(c for _, c in case.backups)]
    async with _fleet(behaviours) as servers:
        replicas = [
            th.Replica(s.url, name=s.name, continuation=c)  # type: ignore[arg-type]
            for s, c in zip(servers, declared, strict=True)
        ]
        async with (
            httpx.AsyncClient() as client,
            th.Hedger(replicas, case.config, client=client) as hedger,
        ):
            got: list[str] = []
            error: th.StreamInterrupted | None = None
            with trio.fail_after(10):
                try:
                    async with hedger.stream(REQUEST) as stream:
                        async for token in stream:
                            got.append(token)
                except th.StreamInterrupted as exc:
                    error = exc
            report = stream.report
            broken = [a.replica for a in report.attempts if a.outcome is O.WON and a.error]
            stats = {r.name: r.failures for r in hedger.statistics().replicas}
        for server in servers:  # every stream closed, none left running on its server
            assert all(r.finished for r in server.requests)
    assert "".join(got) == case.text
    assert report.text == case.text
    if case.error is None:
        assert error is None and report.completed
    else:
        assert error is not None and error.error.kind is case.error  # the original failure
        assert error.error.replica == case.broke_at and error.text == case.text
        assert not report.completed
    recoveries = [a for a in report.attempts if a.trigger == "recovery"]
    assert tuple(a.recovery.method for a in recoveries if a.recovery) == case.methods
    assert tuple(a.outcome for a in recoveries) == case.outcomes
    won = tuple(a.recovery.verified for a in recoveries if a.recovery and a.outcome is O.WON)
    assert won == tuple(v for v, o in zip(case.verified, case.outcomes, strict=False) if o is O.WON)
    chat = [r for s in servers[1:] for r in s.requests if r.path.endswith("/chat/completions")]
    assert tuple(_sent(r.json) for r in chat) == case.sent
    for record in recoveries:  # each goes on from the last attempt that had won
        assert record.recovery is not None
        won_before = [a.number for a in report.attempts[: record.number - 1] if a.outcome is O.WON]
        assert record.recovery.replaces == won_before[-1]
    assert report.recoveries == len(case.outcomes)
    # Every winner that broke counts one failure against its replica, recovered or not.
    for name in broken:
        assert stats[name] >= 1
    assert stats["r0"] == 1
    assert report.attempts[0].outcome is O.WON and report.attempts[0].error is not None


async def test_a_prefill_400_leaves_the_replica_unblamed_and_names_the_cut() -> None:
    # The continuation's 400 is the request's fault (nothing counts against the fallback),
    # the cut is the primary's (one failure), and the error the caller sees is the cut.
    async with _fleet([cut(5), attrs.evolve(GOOD, rejects_prefill=True)]) as servers:
        replicas = [
            th.Replica(servers[0].url, name="r0"),
            th.Replica(servers[1].url, name="r1", continuation="vllm"),
        ]
        async with th.Hedger(replicas, CONFIG) as hedger:
            with pytest.raises(th.StreamInterrupted) as info:
                async with hedger.stream(REQUEST) as stream:
                    [t async for t in stream]
            stats = hedger.statistics()
    assert info.value.error.kind is ErrorKind.STREAM_TRUNCATED
    assert "prefill" not in str(info.value)
    failed = stream.report.attempts[1]
    assert failed.error is not None and failed.error.kind is ErrorKind.INVALID_REQUEST
    assert PREFILL_REJECTED in failed.error.message
    r0, r1 = stats.replicas
    assert (r0.failures, r1.failures) == (1, 0)
    assert stats.recoveries == 1


async def test_a_divergence_is_nobodys_fault() -> None:
    async with _fleet([cut(5), OTHER]) as servers:
        replicas = [th.Replica(s.url, name=s.name) for s in servers]
        async with th.Hedger(replicas, CONFIG) as hedger:
            with pytest.raises(th.StreamInterrupted) as info:
                async with hedger.stream(REQUEST) as stream:
                    [t async for t in stream]
            r0, r1 = hedger.statistics().replicas
    assert info.value.text == prefix(5)
    diverged = stream.report.attempts[1].error
    assert diverged is not None and diverged.kind is ErrorKind.DIVERGED
    assert (r0.failures, r1.failures) == (1, 0)
    broke, replay = stream.report.attempts
    assert broke.ended_at is not None and replay.started_at is not None
    assert broke.ended_at <= replay.started_at  # it ended when it broke, not at the end
    # What the diverging replay received past the prefix was never relayed: wasted.
    assert stream.report.wasted_tokens == stream.report.attempts[1].tokens_received


CALL = ("get_weather", '{"city": "Paris", "unit": "celsius"}')


def _tools(**kw: Any) -> Behaviour:
    return Behaviour(tokens=3, tool_calls=[CALL], finish_reason="tool_calls", **kw)


@pytest.mark.parametrize(
    ("name", "primary", "fragments"),
    [
        ("cut inside the arguments", _tools(cut_after_fragments=2), 2),
        ("cut after the call's last fragment", _tools(cut_after=3), 3),
    ],
)
async def test_tool_calls_are_replayed_never_continued(
    name: str, primary: Behaviour, fragments: int
) -> None:
    # The backup declares vLLM, but tool-call fragments reached the caller: only a replay
    # may go on, and the caller's merged call is the one call, whole, once.
    backup = attrs.evolve(_tools(), continuation="vllm")
    async with _fleet([primary, backup]) as servers:
        replicas = [
            th.Replica(servers[0].url, name="r0"),
            th.Replica(servers[1].url, name="r1", continuation="vllm"),
        ]
        config = attrs.evolve(CONFIG, first_token=FirstToken.ANY_OUTPUT)
        async with th.Hedger(replicas, config) as hedger:
            events: list[Delta] = []
            async with hedger.stream(REQUEST) as stream:
                async for event in stream.events():
                    events.append(event)
    report = stream.report
    assert report.completed
    assert "".join(e.content for e in events) == "tok0 tok1 tok2 "
    calls = merge_tool_calls(events)
    assert calls == [{"id": "call_0", "type": "function", "name": CALL[0], "arguments": CALL[1]}]
    assert [e.finish_reason for e in events if e.finish_reason] == ["tool_calls"]
    (recovery,) = [a.recovery for a in report.attempts if a.recovery is not None]
    assert recovery.method == "replay"
    assert _sent(servers[1].requests[0].json) == "original"
    # The arguments' first half (fragment 2 of 3) or all of them were verified, by name too.
    assert recovery.verified > len("tok0 tok1 tok2 ") + len(CALL[0])


async def test_hedged_stream_recovers_only_when_asked() -> None:
    async with _fleet([cut(5), GOOD]) as servers:
        replicas = [th.Replica(s.url, name=s.name) for s in servers]
        with pytest.raises(th.StreamInterrupted):
            async with th.hedged_stream(REQUEST, replicas, th.HedgePolicy(hedge_after=None)) as s:
                [t async for t in s]
        policy = th.HedgePolicy(hedge_after=None, max_recoveries=1)
        async with th.hedged_stream(REQUEST, replicas, policy) as s:
            assert "".join([t async for t in s]) == FULL
    assert s.report.recoveries == 1


def test_max_recoveries_is_validated() -> None:
    for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_recoveries"):
            HedgerConfig(max_recoveries=bad)  # type: ignore[arg-type]
        with pytest.raises(error, match="max_recoveries"):
            th.HedgePolicy(max_recoveries=bad)  # type: ignore[arg-type]
    assert HedgerConfig().max_recoveries == 2
    assert th.HedgePolicy().max_recoveries == 0
    with pytest.raises(ValueError, match="continuation"):
        th.Replica("http://127.0.0.1:1/v1", continuation="sglang")  # type: ignore[arg-type]


# -- virtual time --------------------------------------------------------------------------------


async def test_a_stalled_winner_recovers_after_exactly_the_stall_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas(
        {
            "a": Behaviour(ttft=0.5, token_delay=0.1, tokens=N, stall_after=5),
            "b": Behaviour(ttft=0.5, token_delay=0.1, tokens=N),
        }
    )
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    config = HedgerConfig(outlier_detection=None, stall_timeout=2.0)  # a learned delay
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, config, client=client) as hedger:
            t0 = trio.current_time()
            times: list[float] = []
            async with hedger.stream(REQUEST) as stream:
                async for _ in stream:
                    times.append(trio.current_time() - t0)
            # The recovery's time to new text (it reproduced 5 tokens first) is no TTFT.
            samples = hedger.samples()
    assert [(s["replica"], s.get("ttft")) for s in samples] == [("a", pytest.approx(0.5))]
    assert stream.report.text == FULL
    # a's last token at 0.9 s, its stall noticed at 2.9 s; b reproduces 5 tokens (0.5 s +
    # 4 × 0.1 s) and its 6th comes 0.1 s later: the caller's gap is the stall plus that.
    assert times[:5] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9])
    assert times[5] == pytest.approx(2.9 + 0.5 + 0.5)
    assert mock.requests["a"][0].disconnected_at == pytest.approx(t0 + 2.9)
    recovery = stream.report.attempts[1]
    assert recovery.started_at == pytest.approx(2.9)
    assert stream.report.ttft == pytest.approx(0.5)  # the request's TTFT is the first commit's


async def test_a_cancel_during_a_recovery_closes_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The caller's own scope around its loop (inside the `async with`): the recovery attempt
    # runs in the stream's nursery, out of that scope's reach, and must still stop.
    mock = MockReplicas({"a": cut(5), "b": Behaviour(ttft=30.0, tokens=N)})
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, CONFIG, client=client) as hedger:
            t0 = trio.current_time()
            async with hedger.stream(REQUEST) as stream:
                with trio.move_on_after(3.0):
                    [t async for t in stream]
            assert trio.current_time() - t0 == pytest.approx(3.0)
            assert hedger.statistics().replicas[1].in_flight == 0
    assert stream.report.text == prefix(5)
    assert stream.report.attempts[1].outcome is O.CANCELLED
    assert mock.requests["b"][0].disconnected_at == pytest.approx(t0 + 3.0)


async def test_another_callers_service_is_unchanged_by_a_recovery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One Hedger, two callers. The measured caller's requests (a slow primary rescued by a
    # hedge) get the same decisions, hedges and TTFTs whether or not, meanwhile, another
    # caller's answers break on that same primary and are recovered on the backup.
    def behave(record: Any) -> Behaviour:
        broken = record.json["messages"][0]["content"] == "break"
        return cut(5, ttft=0.2, token_delay=0.1) if broken else Behaviour(ttft=3.0, tokens=4)

    async def run(with_breaker: bool) -> list[tuple[str | None, bool, float | None]]:
        mock = MockReplicas({"a": behave, "b": Behaviour(ttft=0.3, token_delay=0.1, tokens=N)})
        replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
        config = HedgerConfig(hedge_after=1.0, pick="in_order", stall_timeout=5.0)
        seen: list[tuple[str | None, bool, float | None]] = []
        async with httpx.AsyncClient(transport=mock.transport) as client:
            async with th.Hedger(replicas, config, client=client) as hedger:

                async def breaker() -> None:
                    body = {**REQUEST, "messages": [{"role": "user", "content": "break"}]}
                    for _ in range(3):
                        async with hedger.stream(body) as s:
                            assert "".join([t async for t in s]) == FULL
                        await trio.sleep(1.0)

                async def measured() -> None:
                    for _ in range(4):
                        async with hedger.stream(REQUEST) as s:
                            [t async for t in s]
                        r = s.report
                        assert r.ttft is not None
                        seen.append((r.winner_replica, r.hedged, round(r.ttft, 9)))
                        await trio.sleep(0.5)

                async with trio.open_nursery() as nursery:
                    if with_breaker:
                        nursery.start_soon(breaker)
                    nursery.start_soon(measured)
        return seen

    alone = await run(False)
    assert alone == [("b", True, 1.3)] * 4
    assert await run(True) == alone


@pytest.mark.parametrize("inside", [True, False], ids=["scope inside", "scope outside"])
async def test_a_cancel_at_any_instant_of_a_recovery_closes_everything(
    inside: bool, autojump_clock: trio.testing.MockClock
) -> None:
    # The caller's cancel at every 50 ms from before the cut to after the recovery ended
    # (the cut at 1.0 s, the replay's prefix to 1.9 s, its new text to 2.6 s): nothing hangs,
    # every response is closed, every attempt ends with a final outcome, and the text is a
    # prefix of the one answer (never a repeat).
    timed = {"ttft": 0.5, "token_delay": 0.1}
    for step in range(0, 61):
        at = step * 0.05
        mock = MockReplicas({"a": cut(5, **timed), "b": Behaviour(tokens=N, **timed)})
        replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
        got: list[str] = []
        async with httpx.AsyncClient(transport=mock.transport) as client:
            async with th.Hedger(replicas, CONFIG, client=client) as hedger:
                stream = hedger.stream(REQUEST)
                t0 = trio.current_time()
                with trio.move_on_after(math.inf if inside else at) as outer:
                    async with stream:
                        with trio.move_on_after(at if inside else math.inf):
                            async for token in stream:
                                got.append(token)
                # The block ends at the cancel (inside: ``at`` after the commit at 0.5 s) or
                # at the answer's end, 2.6 s, whichever is first: nothing runs on.
                ended = min((0.5 + at) if inside else at, 2.6)
                assert trio.current_time() - t0 == pytest.approx(ended), at
                with trio.fail_after(5):
                    for name in "ab":
                        for record in mock.requests[name]:
                            await record.wait_finished()
                assert [r.in_flight for r in hedger.statistics().replicas] == [0, 0]
        report = stream.report
        text = "".join(got)
        assert FULL.startswith(text) and report.text.startswith(text), at
        assert all(a.outcome is not O.RUNNING for a in report.attempts), at
        assert report.finished, at
        if at > 2.6 + 1e-9:
            assert text == FULL and not outer.cancelled_caught, at


async def test_a_recovery_is_throttled_like_a_failover(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A first request fails everywhere (two 503s drain a 3-token throttle); the next one's
    # winner is cut: the throttle refuses its recovery as it would a failover, and the
    # answer ends as without recovery.
    def nth(*behaviours: Behaviour) -> Any:
        return lambda record: behaviours[min(record.index, len(behaviours) - 1)]

    mock = MockReplicas(
        {"a": nth(Behaviour(status=503), cut(5)), "b": nth(Behaviour(status=503), GOOD)}
    )
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    config = attrs.evolve(CONFIG, throttle=th.policy.RetryThrottle(max_tokens=3), pick="in_order")
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, config, client=client) as hedger:
            with pytest.raises(th.AllAttemptsFailed):
                async with hedger.stream(REQUEST):
                    pass
            with pytest.raises(th.StreamInterrupted) as info:
                async with hedger.stream(REQUEST) as stream:
                    [t async for t in stream]
            stats = hedger.statistics()
    assert info.value.error.kind is ErrorKind.STREAM_TRUNCATED
    assert info.value.text == prefix(5)
    assert stream.report.recoveries == 0
    assert (stats.recoveries, stats.failover_throttle_refusals) == (0, 1)
    assert len(mock.requests["b"]) == 1


async def test_a_continuation_on_a_backup_priority_replica_carries_both() -> None:
    # A recovery is an attempt after the primary: its continuation body takes the replica's
    # backup_priority too (the engine orders it after its tenants' requests).
    backup = attrs.evolve(GOOD, continuation="vllm")
    async with _fleet([cut(5), backup]) as servers:
        replicas = [
            th.Replica(servers[0].url, name="r0", backup_priority=1),
            th.Replica(servers[1].url, name="r1", continuation="vllm", backup_priority=1),
        ]
        async with th.Hedger(replicas, CONFIG) as hedger:
            async with hedger.stream(REQUEST) as stream:
                got = "".join([t async for t in stream])
    assert got == FULL and stream.report.recoveries == 1
    assert "priority" not in servers[0].requests[0].json  # the primary's body is the request's
    (sent,) = [r.json for r in servers[1].requests]
    assert _sent(sent) == "vllm" and sent["priority"] == 1
    assert sent["messages"][-1] == {"role": "assistant", "content": prefix(5)}


AGENT_APIS = {
    "messages": (
        AnthropicReplica,
        {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
    ),
    "responses": (ResponsesReplica, {"model": "m", "input": "hi"}),
}


@pytest.mark.parametrize("api", AGENT_APIS)
@pytest.mark.parametrize(
    ("name", "primary"),
    [
        ("cut", cut(5)),
        ("malformed event", Behaviour(tokens=N, malformed_after=5)),
        ("in-band error", Behaviour(tokens=N, inband_error_after=5)),
    ],
)
async def test_the_agent_apis_recover_by_replay(api: str, name: str, primary: Behaviour) -> None:
    # The Messages and Responses fakes break in their own events; the recovery replays the
    # request on the next replica and verifies the answer so far before relaying the rest.
    kind, request = AGENT_APIS[api]
    async with _fleet([primary, GOOD]) as servers:
        replicas = [kind(s.url, name=s.name) for s in servers]
        async with th.Hedger(replicas, STALLING) as hedger:
            with trio.fail_after(10):
                async with hedger.stream(request) as stream:
                    got = "".join([t async for t in stream])
    assert got == FULL and stream.report.completed
    (recovery,) = [a.recovery for a in stream.report.attempts if a.recovery is not None]
    assert (recovery.method, recovery.verified) == ("replay", len(prefix(5)))
    assert servers[1].requests[0].json == {**request, "stream": True}  # the request again


@pytest.mark.parametrize("api", AGENT_APIS)
async def test_a_tool_call_cut_in_an_agent_api_is_replayed_whole(api: str) -> None:
    kind, request = AGENT_APIS[api]
    config = attrs.evolve(CONFIG, first_token=FirstToken.ANY_OUTPUT)
    async with _fleet([_tools(cut_after_fragments=2), _tools()]) as servers:
        replicas = [kind(s.url, name=s.name) for s in servers]
        async with th.Hedger(replicas, config) as hedger:
            events: list[Delta] = []
            async with hedger.stream(request) as stream:
                async for event in stream.events():
                    events.append(event)
    assert stream.report.completed and stream.report.recoveries == 1
    assert "".join(e.content for e in events) == "tok0 tok1 tok2 "
    ((name, arguments),) = [(c["name"], c["arguments"]) for c in merge_tool_calls(events)]
    assert (name, arguments) == CALL


@pytest.mark.parametrize("api", AGENT_APIS)
def test_continuation_is_declared_for_chat_replicas_only(api: str) -> None:
    kind, _ = AGENT_APIS[api]
    with pytest.raises(ValueError, match="continuation"):
        kind("http://a.test/v1", continuation="vllm")


async def test_a_cancel_during_a_recovery_is_no_delay_sample(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A recovery's time without new text includes reproducing the answer so far: never a TTFT
    # sample, not even a censored one when the caller leaves during it (nor a lost race: a
    # recovery is never hedged). Else a caller that cancels would move everyone's delay.
    mock = MockReplicas({"a": cut(5), "b": Behaviour(ttft=30.0, tokens=N)})
    replicas = [th.Replica(mock.url(n), name=n) for n in "ab"]
    config = HedgerConfig(outlier_detection=None)  # a learned delay
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.Hedger(replicas, config, client=client) as hedger:
            async with hedger.stream(REQUEST) as stream:
                # (Before b's first-token deadline: 3 × the 1 s fallback delay.)
                with trio.move_on_after(2.5):
                    [t async for t in stream]
            samples = hedger.samples()
            b = hedger.statistics().replicas[1]
    assert stream.report.attempts[1].trigger == "recovery"
    assert stream.report.attempts[1].outcome is O.CANCELLED
    assert [s["replica"] for s in samples] == ["a"]  # a's TTFT, nothing of b's 2.5 s
    assert b.lost_races == 0


@pytest.mark.parametrize("read", ["events", "batches"])
async def test_events_and_batches_keep_a_recoverys_order(read: str) -> None:
    # A recovery's first deltas are queued when it takes over: batches() gives them before
    # anything read after (it once gave the recovery's next read first; the gateway's relay
    # reads batches()). events() reads the same queue.
    cut = Behaviour(tokens=6, token_delay=0.001, cut_after=3)
    async with _fleet([cut, Behaviour(tokens=6, token_delay=0.001)]) as servers:
        replicas = [th.Replica(s.url, name=s.name) for s in servers]
        async with (
            httpx.AsyncClient() as client,
            th.Hedger(replicas, CONFIG, client=client) as hedger,
        ):
            got: list[str] = []
            with trio.fail_after(10):
                async with hedger.stream(REQUEST) as stream:
                    if read == "events":
                        got.extend([d.content async for d in stream.events()])
                    else:
                        got.extend([d.content async for b in stream.batches() for d in b])
            assert stream.recovered == 1 and stream.report.recoveries == 1
    assert "".join(got) == prefix(6)


# -- the caller's token limit across a recovery ---------------------------------------------

#: What an engine at temperature 0 answers: the same tokens every time, cut at the limit.
ENGINE_TOKENS = tuple(f"tok{i} " for i in range(40))


def _limit_of(body: dict[str, Any]) -> int:
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    assert isinstance(limit, int)
    return limit


def engine(record: th.testing.RequestRecord) -> Behaviour:
    """An engine that honours the body's token limit (``finish_reason="length"``) and both
    continuation contracts: vLLM's (only what follows the assistant message) and llama.cpp's
    (the message repeated, then as many new tokens as the limit allows)."""
    body = record.json
    limit = _limit_of(body)
    last = body["messages"][-1]
    if last["role"] != "assistant":
        return Behaviour(tokens=ENGINE_TOKENS[:limit], finish_reason="length")
    have = ENGINE_TOKENS.index(last["content"].rsplit(" ", 2)[-2] + " ") + 1
    assert "".join(ENGINE_TOKENS[:have]) == last["content"]
    after = ENGINE_TOKENS[have : have + limit]
    if body.get("continue_final_message"):
        return Behaviour(tokens=after, finish_reason="length")
    return Behaviour(tokens=ENGINE_TOKENS[:have] + after, finish_reason="length")


@attrs.frozen
class LimitCase:
    name: str
    limits: dict[str, int]  # the request's token-limit fields
    continuation: str | None  # the backup's declared engine
    sent: dict[str, int]  # the limit fields the recovery's body carried
    text: str  # exactly what the caller gets
    overrides: dict[str, Any] = attrs.field(factory=dict)  # the backup's


LIMIT_CASES = [
    LimitCase("vLLM, max_tokens", {"max_tokens": 8}, "vllm", {"max_tokens": 3}, prefix(8)),
    LimitCase(
        "vLLM, max_completion_tokens",
        {"max_completion_tokens": 8},
        "vllm",
        {"max_completion_tokens": 3},
        prefix(8),
    ),
    LimitCase(
        "vLLM, both fields",
        {"max_completion_tokens": 8, "max_tokens": 8},
        "vllm",
        {"max_completion_tokens": 3, "max_tokens": 3},
        prefix(8),
    ),
    LimitCase(
        "llama.cpp (its repeated prefix is not generated: it does not count)",
        {"max_tokens": 8},
        "llama.cpp",
        {"max_tokens": 3},
        prefix(8),
    ),
    LimitCase(
        "replay keeps the limit (it generates the prefix again)",
        {"max_tokens": 8},
        None,
        {"max_tokens": 8},
        prefix(8),
    ),
    LimitCase(
        "a backup whose own limit is below what was delivered: 1, never 0 or less",
        {"max_tokens": 8},
        "vllm",
        {"max_tokens": 1},
        prefix(6),
        overrides={"max_tokens": 4},
    ),
]


def _primary_then_engine(record: th.testing.RequestRecord) -> Behaviour:
    """The primary: cut after 5 tokens on its first request, an honest engine after."""
    return Behaviour(tokens=ENGINE_TOKENS, cut_after=5) if record.index == 0 else engine(record)


async def _answer(hedger: th.Hedger, request: dict[str, Any]) -> tuple[str, list[str], th.Report]:
    """The text, the finish reasons and the report of one request."""
    finishes: list[str] = []
    with trio.fail_after(10):
        async with hedger.stream(request) as stream:
            text = ""
            async for delta in stream.events():
                text += delta.content
                if delta.finish_reason:
                    finishes.append(delta.finish_reason)
    return text, finishes, stream.report


@pytest.mark.parametrize("case", LIMIT_CASES, ids=[c.name for c in LIMIT_CASES])
async def test_a_continuation_asks_only_for_the_tokens_the_caller_has_not_had(
    case: LimitCase,
) -> None:
    # Issue 17: the engine counts only what it generates after the prefill, so a continuation
    # sent with the caller's whole limit would make the answer longer than the caller asked
    # for (5 + 8 tokens for a limit of 8). The second caller on the same Hedger sends its
    # own limit, untouched by the first one's recovery.
    request = {**REQUEST, **case.limits}
    async with _fleet([_primary_then_engine, engine]) as servers:  # type: ignore[list-item]
        replicas = [
            th.Replica(servers[0].url, name="r0"),
            th.Replica(
                servers[1].url,
                name="r1",
                continuation=case.continuation,  # type: ignore[arg-type]
                overrides=case.overrides,
            ),
        ]
        async with th.Hedger(replicas, CONFIG) as hedger:
            first = await _answer(hedger, request)
            second = await _answer(hedger, request)
    text, finishes, report = first
    assert (text, finishes, report.text) == (case.text, ["length"], case.text)
    assert report.completed and report.recoveries == 1
    sent = servers[1].requests[0].json  # the first caller's recovery
    limits = ("max_tokens", "max_completion_tokens")
    assert {k: sent[k] for k in limits if k in sent} == case.sent
    if case.continuation is not None:
        assert sent["messages"][-1] == {"role": "assistant", "content": prefix(5)}
    # The second caller: one attempt, with the limit it sent (or the replica's override),
    # and the whole answer that limit allows.
    (other,) = [r.json for s in servers for r in s.requests[1:]]
    own = case.overrides if other in [r.json for r in servers[1].requests] else {}
    assert {k: other[k] for k in limits if k in other} == {**case.limits, **own}
    assert second[:2] == (prefix(_limit_of(other)), ["length"]) and second[2].recoveries == 0


@pytest.mark.parametrize("continuation", ["vllm", "llama.cpp", None])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_a_break_after_the_last_allowed_token_ends_the_answer_by_length(
    continuation: str | None, field: str
) -> None:
    # The winner sent every token the limit allows and broke before its finish chunk: the
    # caller has the whole answer. Nothing is sent to recover it (a continuation would add
    # a limit's worth of tokens more, a replay would generate it all again for nothing);
    # the answer ends as the engine would have ended it, by length.
    request = {**REQUEST, field: 8}
    primary = Behaviour(tokens=ENGINE_TOKENS[:8], cut_after=8)
    async with _fleet([primary, engine]) as servers:  # type: ignore[list-item]
        replicas = [
            th.Replica(servers[0].url, name="r0"),
            th.Replica(servers[1].url, name="r1", continuation=continuation),  # type: ignore[arg-type]
        ]
        async with th.Hedger(replicas, CONFIG) as hedger:
            text, finishes, report = await _answer(hedger, request)
    assert (text, finishes, report.text) == (prefix(8), ["length"], prefix(8))
    assert report.completed and report.error is None
    assert report.recoveries == 0 and servers[1].requests == []
    (attempt,) = report.attempts  # the winner keeps the failure it had, for the record
    assert attempt.outcome is O.WON and attempt.error is not None
    assert attempt.error.kind is ErrorKind.STREAM_TRUNCATED


async def test_a_break_before_the_last_allowed_token_is_still_recovered() -> None:
    # One token short of the limit is not the end: the recovery asks for the one left.
    request = {**REQUEST, "max_tokens": 8}
    primary = Behaviour(tokens=ENGINE_TOKENS[:7], cut_after=7)
    async with _fleet([primary, engine]) as servers:  # type: ignore[list-item]
        replicas = [
            th.Replica(servers[0].url, name="r0"),
            th.Replica(servers[1].url, name="r1", continuation="vllm"),
        ]
        async with th.Hedger(replicas, CONFIG) as hedger:
            text, finishes, report = await _answer(hedger, request)
    assert (text, finishes, report.recoveries) == (prefix(8), ["length"], 1)
    assert [r.json["max_tokens"] for r in servers[1].requests] == [1]
