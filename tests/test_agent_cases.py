"""The Anthropic Messages and OpenAI Responses decoders against the shared real-world cases
(``shared/sse-cases-agent``) at every chunking, then one focused test per rule."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_hedge.errors import AttemptError, ErrorKind
from trio_hedge.events import Delta, FirstToken, counts_as_first_token
from trio_hedge.sources._event_stream import EventDecoder
from trio_hedge.sources.anthropic import MessagesDecoder, decode_message_body
from trio_hedge.sources.openai import classify_http_error, merge_tool_calls
from trio_hedge.sources.openai_responses import ResponsesDecoder, decode_response_body


def _cases_path() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents[1:]:
        candidate = parent / "shared" / "sse-cases-agent" / "cases.json"
        if candidate.exists():
            return candidate
    return here.parents[1].parent / "shared" / "sse-cases-agent" / "cases.json"


CASES_PATH = _cases_path()
CASES: list[dict[str, Any]] = (
    json.loads(CASES_PATH.read_text("utf-8")) if CASES_PATH.exists() else []
)
needs_cases = pytest.mark.skipif(not CASES, reason=f"shared agent cases not found at {CASES_PATH}")

Dialect = tuple[Callable[[], EventDecoder], Callable[..., list[Delta]], str]
DIALECTS: dict[str, Dialect] = {
    "anthropic-messages": (MessagesDecoder, decode_message_body, "tool_use"),
    "openai-responses": (ResponsesDecoder, decode_response_body, "function_call"),
}


def run(
    api: str, status: int, headers: dict[str, str], pieces: list[bytes]
) -> tuple[list[tuple[int, Delta]], AttemptError | None]:
    """(indexed deltas, error), as the HTTP source reads an answer: a non-2xx status is
    classified; a 200 JSON answer decoded whole; an event stream fed one byte at a time (so
    each Delta's event index is known)."""
    new_decoder, decode_body, _ = DIALECTS[api]
    out: list[tuple[int, Delta]] = []
    try:
        if status != 200:
            raise classify_http_error(status, headers, b"".join(pieces), now=0.0)
        if headers.get("content-type", "").startswith("application/json"):
            return [(0, d) for d in decode_body(status, headers, b"".join(pieces))], None
        decoder = new_decoder()
        for piece in pieces:
            for i in range(len(piece)):
                deltas = decoder.feed(piece[i : i + 1])
                out += [(decoder.data_events - 1, d) for d in deltas]
                if decoder.done:
                    break
            if decoder.done:
                break
        out += [(decoder.data_events - 1, d) for d in decoder.end()]
    except AttemptError as exc:
        return out, exc
    return out, None


def case_kind(error: AttemptError) -> str:
    """The cases' vocabulary has no ``not_found``: a 404 is ``invalid_request`` there (not
    retryable against this server, "fall back to another upstream"), which is what the
    library's NOT_FOUND means (the replica's fault: that attempt fails alone)."""
    return "invalid_request" if error.kind is ErrorKind.NOT_FOUND else error.kind.value


def case_retryable(error: AttemptError) -> bool:
    """The cases' ``retryable``: whether trying again *with the same replica and
    credentials* may help. The library's replica-fault kinds (auth, quota, not found) are
    retryable only on another replica, so they count as not retryable here."""
    return error.retryable and not error.replica_fault


def summary(
    api: str, out: list[tuple[int, Delta]], error: AttemptError | None, keys: Any = None
) -> dict[str, Any]:
    calls = merge_tool_calls(d for _, d in out)
    for call in calls:
        call["type"] = DIALECTS[api][2]
    result: dict[str, Any] = {
        "tokens": [d.content for _, d in out if d.content],
        "first_token_index": next(
            (i for i, d in out if counts_as_first_token(d, FirstToken.CONTENT)), None
        ),
        "error_kind": case_kind(error) if error else None,
        "retryable": case_retryable(error) if error else None,
        "retry_after_s": error.retry_after if error else None,
        "reasoning_tokens": [d.reasoning for _, d in out if d.reasoning],
        "first_output_index": next(
            (i for i, d in out if counts_as_first_token(d, FirstToken.ANY_OUTPUT)), None
        ),
        "finish_reason": next((d.finish_reason for _, d in reversed(out) if d.finish_reason), None),
        "usage": next((d.usage for _, d in reversed(out) if d.usage is not None), None),
        "tool_calls": calls,
    }
    if keys is not None:
        result = {k: v for k, v in result.items() if k in keys}
    return result


def splits(body: bytes, case: dict[str, Any]) -> dict[str, list[bytes]]:
    out = {"whole": [body]}
    if case.get("chunk_boundaries"):
        bounds = [0, *case["chunk_boundaries"], len(body)]
        out["boundaries"] = [body[a:b] for a, b in itertools.pairwise(bounds)]
    rng = random.Random(f"{case['id']}-seed")
    for n in range(5):
        cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(1, 10))))
        bounds = [0, *cuts, len(body)]
        out[f"random{n}"] = [body[a:b] for a, b in itertools.pairwise(bounds)]
    return out


def _fed_whole(api: str, case: dict[str, Any], body: bytes) -> list[Delta]:
    """The deltas of the body fed in one read (to check the bytewise pass changed nothing)."""
    decoder = DIALECTS[api][0]()
    deltas: list[Delta] = []
    try:
        deltas += decoder.feed(body)
        deltas += decoder.end()
    except AttemptError:
        deltas += []
    return deltas


@needs_cases
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_shared_agent_case(case: dict[str, Any]) -> None:
    expected = {k: v for k, v in case["expected"].items() if k != "notes"}
    if "retry_after_s" not in expected and expected.get("error_kind"):
        expected["retry_after_s"] = None  # an error with no server hint has none
    body = case["body"].encode("utf-8")
    for name, pieces in splits(body, case).items():
        out, error = run(case["api"], case["status"], case["headers"], pieces)
        got = summary(case["api"], out, error, expected)
        assert got == expected, f"{case['id']} fed {name}: {error!r}"


@needs_cases
@settings(max_examples=100, deadline=None)
@given(st.data())
def test_any_split_of_any_agent_case_gives_the_same_output(data: st.DataObject) -> None:
    case = data.draw(st.sampled_from(CASES))
    body = case["body"].encode("utf-8")
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=12))
    bounds = [0, *sorted(cuts), len(body)]
    pieces = [body[a:b] for a, b in itertools.pairwise(bounds)]
    api, status, headers = case["api"], case["status"], case["headers"]
    whole, whole_error = run(api, status, headers, [body])
    split, split_error = run(api, status, headers, pieces)
    assert summary(api, split, split_error) == summary(api, whole, whole_error)
