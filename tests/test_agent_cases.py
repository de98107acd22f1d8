"""The Anthropic Messages and OpenAI Responses decoders against the shared real-world cases
(``shared/sse-cases-agent``) at every chunking, then one focused test per rule."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
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

from .test_chunks import shared_cases
from .test_chunks import splits as chat_splits

CASES_PATH = shared_cases("sse-cases-agent")
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
        _same_as_read(api, pieces, [d for _, d in out], exc)
        return out, exc
    _same_as_read(api, pieces, [d for _, d in out], None)
    return out, None


def _same_as_read(
    api: str, pieces: list[bytes], deltas: list[Delta], error: AttemptError | None
) -> None:
    """The pieces fed as they are (the reads the case gives: whole events take the SSE
    decoder's fast paths) give what the byte-at-a-time pass gave."""
    decoder = DIALECTS[api][0]()
    got: list[Delta] = []
    kind = None
    try:
        for piece in pieces:
            got += decoder.feed(piece)
            if decoder.done:
                break
        got += decoder.end()
    except AttemptError as exc:
        kind = exc.kind
    assert (got, [d.raw for d in got], kind) == (
        deltas,
        [d.raw for d in deltas],
        error.kind if error else None,
    )


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
    """The chat cases' splits, and one read per event, as servers flush them (the SSE
    decoder's fast paths)."""
    out = chat_splits(body, case)
    ends = [i + 2 for i in range(len(body)) if body.startswith(b"\n\n", i)]
    out["events"] = [body[a:b] for a, b in itertools.pairwise([0, *ends, len(body)]) if b > a]
    return out


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


# -- one rule at a time ----------------------------------------------------------------------


def _sse(*events: dict[str, Any] | str) -> bytes:
    out = []
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event)
        out.append(f"data: {data}\n\n")
    return "".join(out).encode()


def _decode(api: str, body: bytes) -> tuple[list[Delta], AttemptError | None]:
    out, error = run(api, 200, {"content-type": "text/event-stream"}, [body])
    return [d for _, d in out], error


AM = "anthropic-messages"
OR = "openai-responses"
START = {"type": "message_start", "message": {"usage": {"input_tokens": 3, "output_tokens": 1}}}
STOP_DELTA = {
    "type": "message_delta",
    "delta": {"stop_reason": "end_turn"},
    "usage": {"output_tokens": 2},
}


def _text(index: int, text: str) -> dict[str, Any]:
    return {
        "type": "content_block_delta",
        "index": index,
        "delta": {"type": "text_delta", "text": text},
    }


def _error(kind: str, message: str = "m") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


@pytest.mark.parametrize(
    ("body", "tokens", "kind"),
    [
        # An event the body ends inside (no blank line) is discarded, never parsed.
        (
            _sse(START, _text(0, "a")) + b"data: " + json.dumps(_text(0, "b")).encode(),
            ["a"],
            ErrorKind.STREAM_TRUNCATED,
        ),
        (
            _sse(START, _text(0, "a"), STOP_DELTA) + b'data: {"type":"message_stop"}\n',
            ["a"],
            ErrorKind.STREAM_TRUNCATED,
        ),
        # Lenient: a clean end right after the stop reason is complete; before it, not.
        (_sse(START, _text(0, "a"), STOP_DELTA), ["a"], None),
        (_sse(START, _text(0, "a"), STOP_DELTA, {"type": "ping"}), ["a"], None),
        (_sse(START, _text(0, "a")), ["a"], ErrorKind.STREAM_TRUNCATED),
        (_sse(START), [], ErrorKind.STREAM_TRUNCATED),
        # Nothing but pings and comments: empty.
        (_sse({"type": "ping"}, {"type": "ping"}) + b": comment\n\n", [], ErrorKind.EMPTY_STREAM),
        (b"", [], ErrorKind.EMPTY_STREAM),
        # The event line names an event whose data has no type.
        (b"event: message_stop\ndata: {}\n\n", [], None),
        # In-band errors by meaning.
        (
            _sse(START, _text(0, "a"), _error("overloaded_error", "Overloaded")),
            ["a"],
            ErrorKind.OVERLOADED,
        ),
        (_sse(_error("rate_limit_error")), [], ErrorKind.RATE_LIMIT),
        (_sse(_error("api_error")), [], ErrorKind.SERVER_ERROR),
        (_sse(_error("SomePythonException")), [], ErrorKind.SERVER_ERROR),
        (_sse(_error("invalid_request_error")), [], ErrorKind.INVALID_REQUEST),
        (
            _sse(_error("invalid_request_error", "prompt is too long: 210000 tokens")),
            [],
            ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        ),
        (
            _sse(
                _error("invalid_request_error", "Your credit balance is too low to access the API")
            ),
            [],
            ErrorKind.QUOTA_EXCEEDED,
        ),
        (_sse(_error("authentication_error")), [], ErrorKind.AUTH),
        (_sse(_error("permission_error")), [], ErrorKind.AUTH),
        (_sse(_error("not_found_error")), [], ErrorKind.NOT_FOUND),
        (_sse(_error("request_too_large")), [], ErrorKind.INVALID_REQUEST),
        (_sse({"error": {"type": "overloaded_error", "message": "x"}}), [], ErrorKind.OVERLOADED),
    ],
)
def test_messages_rules(body: bytes, tokens: list[str], kind: ErrorKind | None) -> None:
    deltas, error = _decode(AM, body)
    assert [d.content for d in deltas if d.content] == tokens
    assert (error.kind if error else None) is kind


def test_messages_tool_input_given_whole_in_its_start() -> None:
    block = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}
    body = _sse(
        START,
        {"type": "content_block_start", "index": 0, "content_block": block},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"y":'},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": "2}"},
        },
        {"type": "content_block_stop", "index": 1},
        {"type": "message_stop"},
    )
    deltas, error = _decode(AM, body)
    assert error is None
    assert merge_tool_calls(deltas) == [
        {"id": "toolu_1", "type": "function", "name": "f", "arguments": '{"x": 1}'},
        {"id": "toolu_2", "type": "function", "name": "g", "arguments": '{"y":2}'},
    ]


def test_messages_signature_is_kept_in_raw() -> None:
    signature = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "signature_delta", "signature": "EqQB"},
    }
    deltas, error = _decode(AM, _sse(START, signature, {"type": "message_stop"}))
    assert error is None and not any(d.has_output for d in deltas)
    assert [json.loads(d.raw or "{}").get("delta", {}).get("signature") for d in deltas] == [
        None,
        "EqQB",
        None,
    ]


def test_messages_error_behind_tokens_in_one_read_keeps_the_tokens() -> None:
    decoder = MessagesDecoder()
    deltas = decoder.feed(_sse(START, _text(0, "a"), _error("overloaded_error")))
    assert [d.content for d in deltas] == ["", "a"]
    assert decoder.error is not None and decoder.error.kind is ErrorKind.OVERLOADED
    with pytest.raises(AttemptError):
        decoder.feed(b"")


def test_whole_message_answer() -> None:
    body = {
        "type": "message",
        "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "hi"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 1, "output_tokens": 2},
    }
    (delta,) = decode_message_body(200, {}, json.dumps(body).encode())
    assert (delta.content, delta.reasoning, delta.finish_reason) == ("hi", "hm", "tool_use")
    assert delta.tool_calls[0].arguments == '{"a": 1}' and delta.usage == body["usage"]
    with pytest.raises(AttemptError) as info:
        decode_message_body(200, {}, json.dumps(_error("overloaded_error")).encode())
    assert info.value.kind is ErrorKind.OVERLOADED
    with pytest.raises(AttemptError) as info:
        decode_message_body(200, {}, b'{"object": "list"}')
    assert info.value.kind is ErrorKind.PROTOCOL


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (529, _error("overloaded_error", "Overloaded"), ErrorKind.OVERLOADED),
        (
            400,
            _error(
                "invalid_request_error",
                "Your credit balance is too low to access the Anthropic API.",
            ),
            ErrorKind.QUOTA_EXCEEDED,
        ),
        (
            400,
            _error(
                "invalid_request_error",
                "input length and `max_tokens` exceed context limit: 1 + 2 > 2",
            ),
            ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        ),
        (
            413,
            _error("request_too_large", "Request exceeds the maximum allowed number of bytes."),
            ErrorKind.INVALID_REQUEST,
        ),
        (
            400,
            {
                "error": {
                    "message": "Previous response with id 'resp_1' not found.",
                    "type": "invalid_request_error",
                    "code": "previous_response_not_found",
                }
            },
            ErrorKind.NOT_FOUND,
        ),
        (
            400,
            {"error": {"message": "bad", "type": "invalid_request_error", "code": None}},
            ErrorKind.INVALID_REQUEST,
        ),
    ],
)
def test_http_errors_of_both_apis(status: int, body: dict[str, Any], kind: ErrorKind) -> None:
    assert classify_http_error(status, {}, json.dumps(body).encode()).kind is kind


CREATED = {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}}
COMPLETED = {
    "type": "response.completed",
    "response": {"id": "resp_1", "status": "completed", "usage": {"total_tokens": 3}},
}


@pytest.mark.parametrize(
    ("body", "tokens", "kind"),
    [
        # A part whose text came with no delta: its .done text, once; with deltas: not again.
        (
            _sse(
                CREATED,
                {"type": "response.output_text.done", "item_id": "m1", "text": "whole"},
                COMPLETED,
            ),
            ["whole"],
            None,
        ),
        (
            _sse(
                CREATED,
                {"type": "response.output_text.delta", "item_id": "m1", "delta": "a"},
                {"type": "response.output_text.done", "item_id": "m1", "text": "a"},
                COMPLETED,
            ),
            ["a"],
            None,
        ),
        # [DONE] after the terminal event is ignored; [DONE] alone completes nothing.
        (_sse(CREATED, COMPLETED, "[DONE]"), [], None),
        (
            _sse(
                CREATED,
                {"type": "response.output_text.delta", "item_id": "m", "delta": "a"},
                "[DONE]",
            ),
            ["a"],
            ErrorKind.STREAM_TRUNCATED,
        ),
        (_sse("[DONE]", {"type": "keepalive"}) + b": c\n\n", [], ErrorKind.EMPTY_STREAM),
        # Item-level .done events do not complete a response.
        (
            _sse(CREATED, {"type": "response.output_item.done", "item": {"type": "message"}}),
            [],
            ErrorKind.STREAM_TRUNCATED,
        ),
        # Errors: flat or nested, field by field; response.failed with or without its error.
        (
            _sse({"type": "error", "code": "rate_limit_exceeded", "message": "slow down"}),
            [],
            ErrorKind.RATE_LIMIT,
        ),
        (
            _sse(
                {
                    "type": "error",
                    "error": {
                        "type": "invalid_request_error",
                        "code": "context_length_exceeded",
                        "message": "x",
                    },
                }
            ),
            [],
            ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        ),
        (
            _sse({"type": "error", "code": "RESOURCE_EXHAUSTED", "message": "x"}),
            [],
            ErrorKind.RATE_LIMIT,
        ),
        (
            _sse(
                CREATED,
                {
                    "type": "response.failed",
                    "response": {"error": {"code": "server_error", "message": "x"}},
                },
            ),
            [],
            ErrorKind.SERVER_ERROR,
        ),
        (
            _sse(
                CREATED,
                {
                    "type": "response.failed",
                    "response": {"error": {"code": "invalid_prompt", "message": "x"}},
                },
            ),
            [],
            ErrorKind.INVALID_REQUEST,
        ),
        (
            _sse(CREATED, {"type": "response.failed", "response": {"error": None}}),
            [],
            ErrorKind.SERVER_ERROR,
        ),
    ],
)
def test_responses_rules(body: bytes, tokens: list[str], kind: ErrorKind | None) -> None:
    deltas, error = _decode(OR, body)
    assert [d.content for d in deltas if d.content] == tokens
    assert (error.kind if error else None) is kind


def test_responses_function_call_arguments_from_done_or_item() -> None:
    body = _sse(
        CREATED,
        {
            "type": "response.output_item.added",
            "item": {
                "id": "fc_1",
                "type": "function_call",
                "call_id": "call_1",
                "name": "f",
                "arguments": "",
            },
        },
        {
            "type": "response.function_call_arguments.done",
            "item_id": "fc_1",
            "arguments": '{"a":1}',
        },
        {
            "type": "response.output_item.done",
            "item": {
                "id": "fc_1",
                "type": "function_call",
                "call_id": "call_1",
                "name": "f",
                "arguments": '{"a":1}',
            },
        },
        # A call announced only by its output_item.done (a relay dropped the rest).
        {
            "type": "response.output_item.done",
            "item": {
                "id": "fc_2",
                "type": "function_call",
                "call_id": "call_2",
                "name": "g",
                "arguments": "{}",
            },
        },
        COMPLETED,
    )
    deltas, error = _decode(OR, body)
    assert error is None
    assert merge_tool_calls(deltas) == [
        {"id": "call_1", "type": "function", "name": "f", "arguments": '{"a":1}'},
        {"id": "call_2", "type": "function", "name": "g", "arguments": "{}"},
    ]
    decoder = ResponsesDecoder()
    decoder.feed(body)
    assert decoder.response_id == "resp_1" and not decoder.sent_text and decoder.done


def test_whole_response_answer() -> None:
    body = {
        "object": "response",
        "status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"},
        "error": None,
        "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
            {"type": "message", "content": [{"type": "output_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        ],
        "usage": {"total_tokens": 3},
    }
    (delta,) = decode_response_body(200, {}, json.dumps(body).encode())
    assert (delta.content, delta.reasoning, delta.finish_reason) == (
        "hi",
        "hm",
        "max_output_tokens",
    )
    assert delta.tool_calls[0].id == "call_1"
    failed = {**body, "status": "failed", "error": {"code": "rate_limit_exceeded", "message": "x"}}
    with pytest.raises(AttemptError) as info:
        decode_response_body(200, {}, json.dumps(failed).encode())
    assert info.value.kind is ErrorKind.RATE_LIMIT


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([AM, OR]), st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_attempt_error(api: str, body: bytes) -> None:
    decoder = DIALECTS[api][0]()
    try:
        decoder.feed(body)
        decoder.end()
    except AttemptError:
        pass
