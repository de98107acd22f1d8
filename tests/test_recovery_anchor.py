"""The anchor method and guided decoding (issue 28).

The anchor method resumes a target without assistant prefill by instruction: the text so far
as an assistant turn, then a user turn asking the model to repeat the text's last ~40
characters and go on; the repeat is found with a whitespace- and quote-normalised match and
trimmed. Tested on fakes that really keep, drop, pad or mangle the boundary characters: each
accepted answer is exactly the one answer, and a repeat that is lost, doubled or missing is
refused (the answer ends as without recovery, never spliced).

Guided decoding (a JSON schema, a grammar, vLLM's ``guided_*``) is never continued: a
continuation would restart the constraint at its root.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import pytest
import trio

import trio_hedge as th
from trio_hedge._verify import ANCHOR_SEARCH, AnchorGate, anchor_of
from trio_hedge.errors import AttemptError, ErrorKind
from trio_hedge.events import Delta
from trio_hedge.policy import HedgerConfig
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.sources.anthropic import AnthropicReplica
from trio_hedge.sources.openai._http import is_guided
from trio_hedge.sources.openai_responses import ResponsesReplica
from trio_hedge.testing import Behaviour, FakeReplica

CONFIG = HedgerConfig(hedge_after=None, outlier_detection=None)
REQUEST: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
#: Words with quotes in them, so the quote-normalising match has something to do.
WORDS = tuple(f'w{i} "q{i}" ' if i % 3 == 1 else f"w{i} " for i in range(30))
FULL = "".join(WORDS)
CUT_AT = 14


def prefix(n: int) -> str:
    return "".join(WORDS[:n])


@contextlib.asynccontextmanager
async def _fleet(behaviours: Sequence[Behaviour]) -> AsyncIterator[list[FakeReplica]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(FakeReplica(b, name=f"r{i}"))
            for i, b in enumerate(behaviours)
        ]


@attrs.frozen
class Case:
    echo: str
    accepted: bool


CASES = [
    Case("keep", True),
    Case("trim", True),  # the boundary whitespace dropped
    Case("space", True),  # whitespace runs and line breaks of its own
    Case("curly", True),  # typographic quotes for plain ones
    Case("preamble", True),  # "Continuing from there: " before the repeat
    Case("lose", False),  # the anchor's last character dropped: not the text we have
    Case("twice", False),  # which repeat ends the answer so far? ambiguous
    Case("none", False),  # no repeat: a model that does not follow the instruction
]


async def _run(
    primary: Behaviour, backup: Behaviour, kind: type[th.Replica] = th.Replica, **request: Any
) -> tuple[str, th.Report, th.StreamInterrupted | None, list[FakeReplica]]:
    body = {**REQUEST, **request}
    async with _fleet([primary, backup]) as servers:
        replicas = [
            kind(servers[0].url, name="r0"),
            kind(servers[1].url, name="r1", continuation="anchor"),
        ]
        error = None
        got: list[str] = []
        async with th.Hedger(replicas, CONFIG) as hedger:
            with trio.fail_after(10):
                try:
                    async with hedger.stream(body) as stream:
                        async for token in stream:
                            got.append(token)
                except th.StreamInterrupted as exc:
                    error = exc
        for server in servers:
            assert all(r.finished for r in server.requests)
    assert "".join(got) == stream.report.text
    return "".join(got), stream.report, error, servers


@pytest.mark.parametrize("case", CASES, ids=[c.echo for c in CASES])
async def test_an_anchor_continuation(case: Case) -> None:
    # The backup rejects assistant prefill (a hosted model's 400): only the anchor method's
    # request, which ends with a user turn, can go on there.
    primary = Behaviour(tokens=WORDS, cut_after=CUT_AT)
    backup = Behaviour(
        tokens=WORDS, continuation="anchor", anchor_echo=case.echo, rejects_prefill=True
    )
    text, report, error, servers = await _run(primary, backup, max_tokens=64)
    (recovery,) = [a for a in report.attempts if a.recovery is not None]
    assert recovery.recovery is not None and recovery.recovery.method == "anchor"
    sent = servers[1].requests[0].json
    said, asked = sent["messages"][-2:]
    assert said == {"role": "assistant", "content": prefix(CUT_AT)}
    anchor = anchor_of(prefix(CUT_AT))
    assert asked["role"] == "user" and f"<<<{anchor}>>>" in asked["content"]
    assert len(anchor) >= 40 and prefix(CUT_AT).endswith(anchor)
    # The limit less the 14 tokens had, plus the repeat's allowance (24).
    assert sent["max_tokens"] == 64 - CUT_AT + 24
    if case.accepted:
        assert error is None and text == FULL and report.completed
        assert recovery.outcome is O.WON
        assert recovery.recovery.verified == len(" ".join(anchor.split()))
    else:
        assert error is not None and error.error.kind is ErrorKind.STREAM_TRUNCATED
        assert text == prefix(CUT_AT)  # what the caller had: nothing spliced
        assert recovery.outcome is O.FAILED and recovery.error is not None
        assert recovery.error.kind is ErrorKind.DIVERGED


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        (AnthropicReplica, {"max_tokens": 64}),
        (ResponsesReplica, {"input": "hi", "max_output_tokens": 64, "store": False}),
    ],
    ids=["messages", "responses"],
)
async def test_the_agent_apis_take_the_anchor_method(
    kind: type[th.Replica], fields: dict[str, Any]
) -> None:
    # A Messages or Responses target cannot be continued by prefill; by anchor it can.
    primary = Behaviour(tokens=WORDS, cut_after=CUT_AT)
    backup = Behaviour(tokens=WORDS, continuation="anchor", anchor_echo="space")
    text, report, error, servers = await _run(primary, backup, kind, **fields)
    assert error is None and text == FULL
    (recovery,) = [a.recovery for a in report.attempts if a.recovery is not None]
    assert recovery.method == "anchor"
    sent = servers[1].requests[0].json
    turns = sent["input"] if kind is ResponsesReplica else sent["messages"]
    assert [t["role"] for t in turns[-2:]] == ["assistant", "user"]
    limit = "max_output_tokens" if kind is ResponsesReplica else "max_tokens"
    assert sent[limit] == 64 - CUT_AT + 24


async def test_an_anchor_continuation_keeps_the_callers_limit() -> None:
    # The engine is asked for the anchor's repeat on top of what is left (14 + 10 = 24 of a
    # 24-token limit): the answer still ends by length at exactly the caller's limit.
    primary = Behaviour(tokens=WORDS, cut_after=CUT_AT)
    backup = Behaviour(tokens=WORDS, continuation="anchor")
    text, report, error, _ = await _run(primary, backup, max_tokens=24)
    assert error is None and text == prefix(24) and report.token_count == 24


def _feed(gate: AnchorGate, *texts: str) -> str:
    out = []
    for i, text in enumerate(texts):
        finish = "stop" if i == len(texts) - 1 else None
        out += gate.feed([Delta(text, finish_reason=finish)])
    return "".join(d.content for d in out)


def test_the_anchor_gate_table() -> None:
    anchor = "the quick brown fox"
    table: list[tuple[str, tuple[str, ...], str | None]] = [
        ("exact", ("the quick ", "brown fox", " jumps", " over"), " jumps over"),
        ("newlines", ("the\nquick  brown\tfox", " jumps"), " jumps"),
        ("mid-word repeat", ("the quick brown foxes", " run"), "es run"),
        ("a preamble", ("Sure: the quick brown fox", " jumps"), " jumps"),
        ("nothing after", ("the quick brown fox",), ""),
        ("missing", ("a slow green turtle ", "walks"), None),
        ("twice", ("the quick brown fox the quick brown fox", " jumps"), None),
        ("late", ("x" * (ANCHOR_SEARCH + 1) + " the quick brown fox", " jumps"), None),
    ]
    for name, texts, expected in table:
        gate = AnchorGate(anchor)
        if expected is None:
            with pytest.raises(AttemptError) as info:
                _feed(gate, *texts)
            assert info.value.kind is ErrorKind.DIVERGED, name
        else:
            assert _feed(gate, *texts) == expected, name
            assert gate.verified == len(anchor), name
    # The text so far ends in a space: the model's own space after the repeat is not doubled.
    assert _feed(AnchorGate("brown fox ", ends_with_space=True), "brown fox jumps") == "jumps"
    # An output that ends before the repeat was decided is a divergence, never a cut answer.
    gate = AnchorGate(anchor)
    assert gate.feed([Delta("the quick")]) == []
    with pytest.raises(AttemptError):
        gate.end()


def test_anchor_of() -> None:
    text = "One two three four five six seven eight nine ten eleven twelve."
    anchor = anchor_of(text)
    assert text.endswith(anchor) and 40 <= len(anchor) <= 60
    assert anchor == "five six seven eight nine ten eleven twelve."  # from a word's start
    assert anchor_of("short text") == "short text"


# -- guided decoding ---------------------------------------------------------------------------

GUIDED = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    {"response_format": {"type": "json_object"}},
    {"guided_json": {"type": "object"}},
    {"guided_regex": "[a-z]+"},
    {"guided_choice": ["a", "b"]},
    {"guided_grammar": "root ::= 'a'"},
    {"structured_outputs": {"json": {}}},
    {"grammar": "root ::= 'a'"},
    {"json_schema": {"type": "object"}},
    {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
]


def test_what_counts_as_guided() -> None:
    for fields in GUIDED:
        assert is_guided({**REQUEST, **fields}), fields
    for fields in (
        {},
        {"response_format": {"type": "text"}},
        {"text": {"format": {"type": "text"}}},
    ):
        assert not is_guided({**REQUEST, **fields}), fields


@pytest.mark.parametrize("declared", ["vllm", "llama.cpp", "anchor"])
@pytest.mark.parametrize(
    "fields", GUIDED[:4], ids=["json_schema", "json_object", "guided_json", "guided_regex"]
)
async def test_guided_decoding_is_never_continued(declared: str, fields: dict[str, Any]) -> None:
    # The backup declares a continuation, but the request is under guided decoding: the
    # recovery replays the original request and verifies it (no assistant turn is sent).
    primary = Behaviour(tokens=WORDS, cut_after=CUT_AT)
    backup = Behaviour(tokens=WORDS, continuation="vllm" if declared == "vllm" else None)
    async with _fleet([primary, backup]) as servers:
        replicas = [
            th.Replica(servers[0].url, name="r0"),
            th.Replica(servers[1].url, name="r1", continuation=declared),  # type: ignore[arg-type]
        ]
        async with th.Hedger(replicas, CONFIG) as hedger:
            with trio.fail_after(10):
                async with hedger.stream({**REQUEST, **fields}) as stream:
                    text = "".join([t async for t in stream])
    assert text == FULL
    (recovery,) = [a.recovery for a in stream.report.attempts if a.recovery is not None]
    assert recovery.method == "replay"
    assert servers[1].requests[0].json == {**REQUEST, **fields, "stream": True}


async def test_a_replica_override_that_guides_is_never_continued() -> None:
    # The constraint may come from the replica's overrides, not the request.
    primary = Behaviour(tokens=WORDS, cut_after=CUT_AT)
    async with _fleet([primary, Behaviour(tokens=WORDS, continuation="vllm")]) as servers:
        replicas = [
            th.Replica(servers[0].url, name="r0"),
            th.Replica(
                servers[1].url,
                name="r1",
                continuation="vllm",
                overrides={"guided_regex": '[a-z0-9 "]+'},
            ),
        ]
        async with th.Hedger(replicas, CONFIG) as hedger:
            async with hedger.stream(REQUEST) as stream:
                assert "".join([t async for t in stream]) == FULL
    (recovery,) = [a.recovery for a in stream.report.attempts if a.recovery is not None]
    assert recovery.method == "replay"
