"""OpenAI-compatible chunk semantics: the shared real-world cases at every chunking, then one
focused test per rule (content shapes, in-band errors, HTTP error classes, Retry-After)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_hedge.errors import AttemptError, ErrorKind
from trio_hedge.events import Delta, ToolCallDelta
from trio_hedge.sources.openai import (
    ChunkDecoder,
    _json,
    classify_http_error,
    decode_json_body,
    merge_tool_calls,
    parse_retry_after,
)


def shared_cases(folder: str = "sse-cases") -> Path:
    """``$SSE_CASES/cases.json`` when set (for ``sse-cases``), else ``shared/<folder>/cases.json``
    next to the checkout, or next to any directory above it (a git worktree under ``wt/`` finds
    the same shared folder as the main checkout)."""
    if folder == "sse-cases" and os.environ.get("SSE_CASES"):
        return Path(os.environ["SSE_CASES"]) / "cases.json"
    here = Path(__file__).resolve()
    for parent in here.parents[1:]:
        candidate = parent / "shared" / folder / "cases.json"
        if candidate.exists():
            return candidate
    return here.parents[1].parent / "shared" / folder / "cases.json"


CASES_PATH = shared_cases()
CASES: list[dict[str, Any]] = (
    json.loads(CASES_PATH.read_text("utf-8")) if CASES_PATH.exists() else []
)
needs_cases = pytest.mark.skipif(
    not CASES,
    reason=f"shared SSE cases not found at {CASES_PATH} (SSE_CASES=DIR names another folder)",
)


# -- running a case as the HTTP source would ---------------------------------------------------


def run(
    status: int, headers: dict[str, str], pieces: list[bytes]
) -> tuple[list[tuple[int, Delta]], AttemptError | None]:
    """(indexed deltas, error): status != 200 -> classify_http_error; 200 + JSON ->
    decode_json_body; else ChunkDecoder fed piece by piece."""
    out: list[tuple[int, Delta]] = []
    try:
        if status != 200:
            raise classify_http_error(status, headers, b"".join(pieces), now=0.0)
        if headers.get("content-type", "").startswith("application/json"):
            out = [(0, d) for d in decode_json_body(status, headers, b"".join(pieces))]
        else:
            decoder = ChunkDecoder()
            try:
                for piece in pieces:
                    _indexed(decoder, piece, out)
                    if decoder.done:
                        break
                out += [(decoder.data_events - 1, d) for d in decoder.end()]
            finally:
                # The same bytes in the case's own pieces give the same deltas: the index
                # pass above (one byte at a time) changed nothing but the splits.
                assert [d for _, d in out] == _deltas_in_pieces(pieces)[: len(out)]
    except AttemptError as exc:
        return out, exc
    return out, None


def _indexed(
    decoder: ChunkDecoder, piece: bytes, out: list[tuple[int, Delta]] | None = None
) -> list[tuple[int, Delta]]:
    """``decoder.feed(piece)``, each Delta paired with the 0-based index of its data event
    (added to ``out`` as they come, so an error keeps those before it): fed one byte at a
    time, at most one event ends per call, so the index is the count of data events so far
    minus one."""
    out = [] if out is None else out
    for i in range(len(piece)):
        deltas = decoder.feed(piece[i : i + 1])
        assert len(deltas) <= 1
        out += [(decoder.data_events - 1, d) for d in deltas]
        if decoder.done:
            break
    return out


def _deltas_in_pieces(pieces: list[bytes]) -> list[Delta]:
    """The deltas of ``pieces`` fed as they are (the splits the case gives)."""
    decoder = ChunkDecoder()
    out: list[Delta] = []
    try:
        for piece in pieces:
            out += decoder.feed(piece)
            if decoder.done:
                break
        out += decoder.end()
    except AttemptError:
        pass
    return out


def summary(
    out: list[tuple[int, Delta]], error: AttemptError | None, keys: Any = None
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "tokens": [d.content for _, d in out if d.content],
        "first_token_index": next((i for i, d in out if d.content), None),
        "error_kind": error.kind.value if error else None,
        "retryable": error.retryable if error else None,
        "retry_after_s": error.retry_after if error else None,
        "reasoning_tokens": [d.reasoning for _, d in out if d.reasoning],
        "first_output_index": next((i for i, d in out if d.has_output), None),
        "finish_reason": next((d.finish_reason for _, d in reversed(out) if d.finish_reason), None),
        "usage": next((d.usage for _, d in reversed(out) if d.usage is not None), None),
        "tool_calls": merge_tool_calls(d for _, d in out),
    }
    if keys is not None:
        result = {k: v for k, v in result.items() if k in keys}
    return result


def splits(body: bytes, case: dict[str, Any]) -> dict[str, list[bytes]]:
    out = {"whole": [body], "bytewise": [body[i : i + 1] for i in range(len(body))]}
    if case.get("chunk_boundaries"):
        bounds = [0, *case["chunk_boundaries"], len(body)]
        out["boundaries"] = [body[a:b] for a, b in itertools.pairwise(bounds)]
    rng = random.Random(f"{case['id']}-seed")
    for n in range(10):
        cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(1, 10))))
        bounds = [0, *cuts, len(body)]
        out[f"random{n}"] = [body[a:b] for a, b in itertools.pairwise(bounds)]
    return out


@needs_cases
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_shared_case(case: dict[str, Any]) -> None:
    expected = {k: v for k, v in case["expected"].items() if k != "notes"}
    body = case["body"].encode("utf-8")
    for name, pieces in splits(body, case).items():
        out, error = run(case["status"], case["headers"], pieces)
        got = summary(out, error, expected)
        assert got == expected, f"{case['id']} fed {name}: {error!r}"


@needs_cases
@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_split_of_any_case_gives_the_same_output(data: st.DataObject) -> None:
    case = data.draw(st.sampled_from(CASES))
    body = case["body"].encode("utf-8")
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=12))
    bounds = [0, *sorted(cuts), len(body)]
    pieces = [body[a:b] for a, b in itertools.pairwise(bounds)]
    whole, whole_error = run(case["status"], case["headers"], [body])
    split, split_error = run(case["status"], case["headers"], pieces)
    assert summary(split, split_error) == summary(whole, whole_error)


@needs_cases
def test_json_fallback_gives_identical_results(monkeypatch: pytest.MonkeyPatch) -> None:
    with_orjson = [run(c["status"], c["headers"], [c["body"].encode()]) for c in CASES]
    monkeypatch.setattr(_json, "_orjson_loads", None)
    without = [run(c["status"], c["headers"], [c["body"].encode()]) for c in CASES]
    assert [summary(*r) for r in without] == [summary(*r) for r in with_orjson]


_PIECES = st.sampled_from(
    [
        b"data: ",
        b"data:",
        b"event: error\n",
        b"\n",
        b"\r\n",
        b": keep-alive\n\n",
        b"[DONE]",
        b'{"choices":[{"delta":{"content":"x"}}]}',
        b'{"choices":[{"delta":{},"finish_reason":"stop"}]}',
        b'{"choices":[],"usage":{"total_tokens":1}}',
        b'{"error":{"message":"m","code":429}}',
        b'{"error":"plain"}',
        b'{"object":"error","message":"bad","code":400}',
        b"{",
        b"}",
        b'"',
        b"[]",
        b"null",
        "é".encode(),
        b"\xff",
        b"\xef\xbb\xbf",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.lists(_PIECES, max_size=20).map(b"".join)))
def test_arbitrary_bytes_raise_only_attempt_error(body: bytes) -> None:
    for pieces in ([body], [body[i : i + 1] for i in range(len(body))]):
        decoder = ChunkDecoder(max_event_size=128)
        try:
            for piece in pieces:
                decoder.feed(piece)
            decoder.end()
        except AttemptError:
            pass
    for call in (
        lambda: classify_http_error(500, {}, body),
        lambda: decode_json_body(200, {}, body),
    ):
        with contextlib.suppress(AttemptError):
            call()


# -- helpers for the focused tests --------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if delta is not None:
        choice["delta"] = delta
    obj = {"object": "chat.completion.chunk", "choices": [choice], **extra}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def decode_all(*pieces: bytes) -> list[Delta]:
    decoder = ChunkDecoder()
    out: list[Delta] = []
    for piece in pieces:
        out += decoder.feed(piece)
    return out + decoder.end()


def error_of(*pieces: bytes) -> AttemptError:
    with pytest.raises(AttemptError) as info:
        decode_all(*pieces)
    return info.value


# -- content, reasoning, tool calls, usage --------------------------------------------------------


def test_fast_path_and_general_path_agree() -> None:
    fast = decode_all(chunk({"content": "a"}), DONE)
    general = decode_all(chunk({"content": "a", "role": "assistant"}), DONE)
    assert fast == [Delta("a")]
    assert general == [Delta("a", role="assistant")]


def test_role_only_and_empty_chunks_are_not_output() -> None:
    deltas = decode_all(
        chunk({"role": "assistant", "content": ""}),
        chunk({}),
        chunk(None),
        b'data: {"choices":[]}\n\n',
        b'data: {"id":"x"}\n\n',
        chunk({"content": "hi"}, "stop"),
        DONE,
    )
    assert [d.has_output for d in deltas] == [False, True]
    assert deltas[0] == Delta(role="assistant")


def test_list_content_text_parts_only_and_thinking_is_reasoning() -> None:
    parts = [
        {"type": "thinking", "thinking": [{"type": "text", "text": "hmm"}]},
        {"type": "text", "text": "An"},
        {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "swer"},
    ]
    (delta,) = decode_all(chunk({"content": parts}, "stop"), DONE)
    assert (delta.content, delta.reasoning) == ("Answer", "hmm")


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_reasoning_fields(key: str) -> None:
    deltas = decode_all(chunk({key: "think", "content": None}), chunk({"content": "ok"}, "stop"))
    assert [(d.reasoning, d.content) for d in deltas] == [("think", ""), ("", "ok")]


def test_both_reasoning_aliases_are_not_doubled() -> None:
    (delta,) = decode_all(chunk({"reasoning_content": "r", "reasoning": "r"}, "stop"))
    assert delta.reasoning == "r"


def test_tool_call_fragments_and_merge() -> None:
    deltas = decode_all(
        chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "g"}}]}),
        chunk({"tool_calls": [{"index": 0, "id": None, "function": {"arguments": '{"a"'}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": {"b": 2}}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": None, "arguments": ":1}"}}]}),
        chunk({"tool_calls": [{"index": 0}]}),  # nothing in it: no fragment
        chunk({}, "tool_calls"),
        DONE,
    )  # fmt: skip
    assert deltas[0].tool_calls == (ToolCallDelta(0, "c1", "f", ""),)
    assert len(deltas) == 6
    assert merge_tool_calls(deltas) == [
        {"id": "c1", "type": "function", "name": "f", "arguments": '{"a":1}'},
        {"id": "c2", "type": "function", "name": "g", "arguments": '{"b":2}'},
    ]


def test_tool_call_without_index_uses_position_and_legacy_function_call() -> None:
    (delta,) = decode_all(
        chunk({"tool_calls": [{"id": "a", "function": {"name": "x"}},
                              {"id": "b", "function": {"name": "y"}}]}, "tool_calls"),
    )  # fmt: skip
    assert [(t.index, t.id) for t in delta.tool_calls] == [(0, "a"), (1, "b")]
    (legacy,) = decode_all(chunk({"function_call": {"name": "f", "arguments": "{}"}}, "stop"))
    assert legacy.tool_calls == (ToolCallDelta(0, None, "f", "{}"),)


@pytest.mark.parametrize(
    "where",
    [
        lambda u: chunk({}, "stop", usage=u),
        lambda u: b'data: {"choices":[],"usage":' + json.dumps(u).encode() + b"}\n\n",
        lambda u: chunk({}, "stop", x_groq={"id": "r", "usage": u}),
        lambda u: (
            b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop","usage":'
            + json.dumps(u).encode()
            + b"}]}\n\n"
        ),
    ],
    ids=["top-level", "choices-less", "x_groq", "in-choice"],
)
def test_usage_wherever_it_is(where: Any) -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    decoder = ChunkDecoder()
    deltas = decoder.feed(chunk({"content": "a"}, usage=None) + where(usage) + DONE)
    assert deltas[-1].usage == usage
    assert decoder.usage == usage


def test_huge_usage_integers_are_exact() -> None:
    usage = {"total_tokens": 2**70}
    (delta,) = decode_all(b'data: {"choices":[],"usage":{"total_tokens":%d}}\n\n' % 2**70, DONE)
    assert delta.usage == usage
    assert type(delta.usage["total_tokens"]) is int


def test_choice_index_zero_is_picked_for_n_greater_than_one() -> None:
    other = b'data: {"choices":[{"index":1,"delta":{"content":"B"}}]}\n\n'
    deltas = decode_all(other, chunk({"content": "A"}), other, chunk({}, "stop"))
    assert [d.content for d in deltas] == ["A", ""]


def test_empty_finish_reason_is_none() -> None:
    decoder = ChunkDecoder()
    (delta,) = decoder.feed(chunk({"content": "a"}, ""))
    assert delta.finish_reason is None
    with pytest.raises(AttemptError) as info:
        decoder.end()
    assert info.value.kind is ErrorKind.STREAM_TRUNCATED


# -- completion, truncation, counting ------------------------------------------------------


def test_finish_reason_without_done_is_complete() -> None:
    assert decode_all(chunk({"content": "a"}), chunk({}, "length"))[-1].finish_reason == "length"


def test_last_event_without_blank_line_is_still_read() -> None:
    deltas = decode_all(chunk({"content": "a"}), chunk({}, "stop")[:-1])
    assert deltas[-1].finish_reason == "stop"
    assert decode_all(chunk({"content": "a"}), b"data: [DONE]") == [Delta("a")]


def test_bytes_after_done_are_ignored() -> None:
    decoder = ChunkDecoder()
    assert decoder.feed(chunk({"content": "a"}) + DONE + b"garbage\xff{{{\n\n") == [Delta("a")]
    assert decoder.done
    assert decoder.feed(b'data: {"error": "late"}\n\n') == []
    assert decoder.end() == []


def test_empty_stream() -> None:
    for body in (b"", b": ping\n\n", b"retry: 5\n\ndata:\n\n", b"\n\n\n"):
        assert error_of(body).kind is ErrorKind.EMPTY_STREAM


def test_truncated_inside_a_character() -> None:
    body = chunk({"content": "a"}) + 'data: {"choices":[{"delta":{"content":"你'.encode()[:-1]
    assert error_of(body).kind is ErrorKind.STREAM_TRUNCATED


def test_data_events_counting() -> None:
    decoder = ChunkDecoder()
    decoder.feed(b": c\n\nretry: 1\n\nid: 2\n\ndata:\n\ndata:  \n\n")
    assert decoder.data_events == 0
    indexed = _indexed(decoder, b'data: {"x":1}\n\n' + chunk({"content": "a"}) + DONE)
    assert indexed == [(1, Delta("a"))]
    assert decoder.data_events == 3


def test_non_json_data_is_a_protocol_error_but_rewrapped_comment_is_not() -> None:
    assert error_of(b"data: hello\n\n").kind is ErrorKind.PROTOCOL
    assert decode_all(b"data: : OPENROUTER PROCESSING\n\n", chunk({"content": "a"}, "stop"))


def test_event_too_large_is_protocol() -> None:
    decoder = ChunkDecoder(max_event_size=64)
    with pytest.raises(AttemptError) as info:
        decoder.feed(chunk({"content": "x" * 100}))
    assert info.value.kind is ErrorKind.PROTOCOL


def test_json_body_under_event_stream_content_type() -> None:
    body = b'\xef\xbb\xbf\n{"error":{"message":"Rate limit exceeded","code":429}}'
    decoder = ChunkDecoder()
    assert decoder.feed(body[:2]) == []
    assert decoder.feed(body[2:]) == []
    with pytest.raises(AttemptError) as info:
        decoder.end()
    assert info.value.kind is ErrorKind.RATE_LIMIT
    ok = ChunkDecoder()
    ok.feed(b'{"object":"chat.completion","choices":[{"message":{"content":"hi"},'
            b'"finish_reason":"stop"}]}')  # fmt: skip
    assert ok.end() == [Delta("hi", finish_reason="stop")]
    assert ok.data_events == 1


# -- in-band errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "kind", "retryable"),
    [
        (b'{"error":{"message":"boom","type":"server_error"}}', ErrorKind.SERVER_ERROR, True),
        (b'{"error":"Internal error"}', ErrorKind.SERVER_ERROR, True),
        (b'{"error":"Rate limit exceeded"}', ErrorKind.RATE_LIMIT, True),
        (b'{"error":{"message":"x","code":"429"}}', ErrorKind.RATE_LIMIT, True),
        (b'{"object":"error","message":"m","type":"BadRequestError","code":400}',
         ErrorKind.INVALID_REQUEST, False),
        (b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}',
         ErrorKind.OVERLOADED, True),
        (b'[{"error":{"code":503,"message":"unavailable","status":"UNAVAILABLE"}}]',
         ErrorKind.OVERLOADED, True),
        (b'{"error":{"message":"This model\'s maximum context length is 10 tokens"}}',
         ErrorKind.CONTEXT_LENGTH_EXCEEDED, False),
        (b'{"error":{"message":"quota","type":"insufficient_quota"}}',
         ErrorKind.QUOTA_EXCEEDED, True),
        (b'{"error":{"message":"bad key","type":"authentication_error"}}', ErrorKind.AUTH, True),
        (b'{"error":{"message":"no such model","code":"model_not_found"}}',
         ErrorKind.NOT_FOUND, True),
    ],
)  # fmt: skip
def test_in_band_errors(payload: bytes, kind: ErrorKind, retryable: bool) -> None:
    error = error_of(chunk({"role": "assistant"}), b"data: " + payload + b"\n\n", DONE)
    assert (error.kind, error.retryable) == (kind, retryable)


def test_event_error_frame_with_text_or_json() -> None:
    assert error_of(b"event: error\ndata: upstream died\n\n").kind is ErrorKind.SERVER_ERROR
    error = error_of(b'event: error\ndata: {"message":"Overloaded"}\n\n')
    assert error.kind is ErrorKind.OVERLOADED
    assert error.message == "Overloaded"


def test_error_null_on_a_chunk_is_not_an_error() -> None:
    assert decode_all(chunk({"content": "a"}, "stop", error=None)) == [
        Delta("a", finish_reason="stop")
    ]


def test_tokens_before_an_error_in_the_same_read_are_kept() -> None:
    decoder = ChunkDecoder()
    body = chunk({"content": "a"}) + b'data: {"error":{"message":"m"}}\n\n'
    assert decoder.feed(body) == [Delta("a")]
    assert decoder.error is not None
    with pytest.raises(AttemptError):
        decoder.feed(b"")
    with pytest.raises(AttemptError):
        decoder.end()


# -- non-SSE JSON answers -----------------------------------------------------------------------


def test_whole_completion() -> None:
    body = json.dumps(
        {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "reasoning_content": "r",
                        "tool_calls": [{"id": "c", "type": "function",
                                        "function": {"name": "f", "arguments": "{}"}}],
                    },
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"total_tokens": 3},
        }
    ).encode()  # fmt: skip
    (delta,) = decode_json_body(200, {}, body)
    assert delta.reasoning == "r"
    assert delta.finish_reason == "tool_calls"
    assert delta.usage == {"total_tokens": 3}
    assert merge_tool_calls([delta]) == [
        {"id": "c", "type": "function", "name": "f", "arguments": "{}"}
    ]


def test_json_body_with_done_appended_and_sse_body_as_json() -> None:
    body = b'{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    assert [d.content for d in decode_json_body(200, {}, body)] == ["hi"]
    sse = chunk({"content": "a"}) + chunk({}, "stop") + DONE
    assert [d.content for d in decode_json_body(200, {}, sse)] == ["a", ""]


@pytest.mark.parametrize("body", [b"", b"not json", b'{"foo": 1}', b"[1, 2]"])
def test_json_body_that_is_not_an_answer(body: bytes) -> None:
    with pytest.raises(AttemptError) as info:
        decode_json_body(200, {}, body)
    assert info.value.kind in (ErrorKind.PROTOCOL, ErrorKind.EMPTY_STREAM)


def test_json_error_body_carries_retry_after() -> None:
    with pytest.raises(AttemptError) as info:
        decode_json_body(200, {"retry-after": "7"}, b'{"error":{"message":"slow down","code":429}}')
    assert (info.value.kind, info.value.retry_after) == (ErrorKind.RATE_LIMIT, 7.0)


# -- HTTP errors ----------------------------------------------------------------------------------


def err(message: str, **extra: Any) -> bytes:
    return json.dumps({"error": {"message": message, **extra}}).encode()


@pytest.mark.parametrize(
    ("status", "body", "kind", "retryable"),
    [
        (429, err("Rate limit reached for requests"), ErrorKind.RATE_LIMIT, True),
        (429, err("You exceeded your current quota, please check your plan and billing details.",
                  type="insufficient_quota"), ErrorKind.QUOTA_EXCEEDED, True),
        (429, err("Quota exceeded for quota metric per minute. Please retry in 3s."),
         ErrorKind.RATE_LIMIT, True),
        (402, err("Insufficient Balance"), ErrorKind.QUOTA_EXCEEDED, True),
        (403, err("Your credit balance is too low"), ErrorKind.QUOTA_EXCEEDED, True),
        (403, err("Forbidden"), ErrorKind.AUTH, True),
        (401, err("Incorrect API key provided"), ErrorKind.AUTH, True),
        (400, err("API key not valid. Please pass a valid API key."), ErrorKind.AUTH, True),
        (408, b"", ErrorKind.TIMEOUT, True),
        (503, b"Service Unavailable", ErrorKind.OVERLOADED, True),
        (529, err("Overloaded", type="overloaded_error"), ErrorKind.OVERLOADED, True),
        (500, err("The engine is currently overloaded"), ErrorKind.OVERLOADED, True),
        (500, err("boom"), ErrorKind.SERVER_ERROR, True),
        (502, b"<html><body>Bad gateway</body></html>", ErrorKind.SERVER_ERROR, True),
        (504, b"", ErrorKind.SERVER_ERROR, True),
        (400, err("bad temperature"), ErrorKind.INVALID_REQUEST, False),
        (400, err("x", code="context_length_exceeded"), ErrorKind.CONTEXT_LENGTH_EXCEEDED, False),
        (400, err("prompt is too long: 210000 tokens > 200000 maximum"),
         ErrorKind.CONTEXT_LENGTH_EXCEEDED, False),
        (413, b"Payload Too Large", ErrorKind.INVALID_REQUEST, False),
        (404, err("model not found"), ErrorKind.NOT_FOUND, True),
        (405, b"", ErrorKind.INVALID_REQUEST, False),
        (422, b'{"detail":[{"loc":["body"],"msg":"field required"}]}',
         ErrorKind.INVALID_REQUEST, False),
    ],
)  # fmt: skip
def test_classify_http_error(status: int, body: bytes, kind: ErrorKind, retryable: bool) -> None:
    error = classify_http_error(status, {}, body)
    assert (error.kind, error.retryable, error.status_code) == (kind, retryable, status)
    assert error.message


def test_error_message_is_the_servers_and_bounded() -> None:
    assert classify_http_error(400, {}, b'{"detail":"nope"}').message == "nope"
    assert classify_http_error(400, {}, err("x" * 5000)).message.startswith("xxx")
    assert len(classify_http_error(400, {}, err("x" * 5000)).message) <= 300
    assert len(classify_http_error(500, {}, b"y" * 5000).message) <= 300
    assert classify_http_error(502, {}, b"<html>x</html>").message == "HTTP 502 Bad Gateway"
    # A body cut by the caller's bound is not JSON any more: its text is still used.
    assert "cut" in classify_http_error(500, {}, err("cut here")[:28]).message


def test_classify_http_error_takes_retry_after() -> None:
    error = classify_http_error(429, httpx.Headers({"Retry-After": "3"}), b"")
    assert error.retry_after == 3.0
    assert classify_http_error(503, {"retry-after": "120"}, b"").retry_after == 120.0


# -- Retry-After (RFC 9110 §10.2.3) --------------------------------------------------------------


def test_retry_after_seconds_and_ms_precedence() -> None:
    assert parse_retry_after({}) is None
    assert parse_retry_after({"retry-after": "5"}) == 5.0
    assert parse_retry_after({"retry-after": "5", "retry-after-ms": "4321"}) == 4.321
    assert parse_retry_after({"retry-after": "5", "x-ms-retry-after-ms": "250"}) == 0.25
    both = {"retry-after-ms": "100", "x-ms-retry-after-ms": "250", "retry-after": "5"}
    assert parse_retry_after(both) == 0.1
    assert parse_retry_after({"retry-after-ms": "junk", "retry-after": "2"}) == 2.0


def test_retry_after_http_date() -> None:
    date = "Wed, 21 Oct 2015 07:28:00 GMT"
    now = 1445412470.0  # 07:27:50 GMT that day
    assert parse_retry_after({"retry-after": date}, now=now) == 10.0
    assert parse_retry_after({"retry-after": date}, now=now + 100) == 0.0  # in the past
    # Without `now`, relative to the response's own Date header (no clock skew).
    headers = {"retry-after": date, "date": "Wed, 21 Oct 2015 07:27:30 GMT"}
    assert parse_retry_after(headers) == 30.0


@pytest.mark.parametrize("value", ["-1", "soon", "", "nan", "inf", "Wed, 99 Foo 2015"])
def test_retry_after_invalid(value: str) -> None:
    assert parse_retry_after({"retry-after": value}, now=0.0) is None


def test_retry_after_header_names_case_insensitive() -> None:
    assert parse_retry_after(httpx.Headers({"Retry-After-Ms": "1500"})) == 1.5
    assert parse_retry_after({"Retry-After": "4"}) == 4.0


def test_deltas_keep_the_raw_event_data_for_relaying() -> None:
    role = '{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    token = '{"choices":[{"delta":{"content":"Hi"}}]}'
    tool = (
        '{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1",'
        '"function":{"name":"f","arguments":"{}"}}]}}]}'
    )
    usage = '{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}'
    body = "".join(f"data:{e}\r\n\r\n" for e in (role, token, tool, usage)) + "data: [DONE]\n\n"
    deltas = ChunkDecoder().feed(body.encode())
    assert [d.raw for d in deltas] == [role, token, tool, usage]
    # raw is neither part of equality nor shown in the repr.
    assert deltas[1] == Delta("Hi") and "raw" not in repr(deltas[1])
    # A whole JSON answer has no event to relay.
    (whole,) = decode_json_body(
        200, {}, b'{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}]}'
    )
    assert whole.raw is None
