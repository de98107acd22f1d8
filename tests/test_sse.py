"""The SSE decoder: WHATWG "server-sent events" parsing rules, one test per rule, and
split-invariance (a read boundary anywhere changes nothing)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_hedge.errors import AttemptError, ErrorKind
from trio_hedge.sources.openai import SSEDecoder, SSEEvent


def decode(*chunks: bytes, max_event_size: int = 1_048_576) -> list[SSEEvent]:
    decoder = SSEDecoder(max_event_size)
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    return events + decoder.end()


def datas(*chunks: bytes) -> list[str]:
    return [event.data for event in decode(*chunks)]


def bytewise(body: bytes) -> list[bytes]:
    return [body[i : i + 1] for i in range(len(body))]


@pytest.mark.parametrize("end", [b"\n", b"\r", b"\r\n"])
def test_line_ends(end: bytes) -> None:
    body = b"data: a" + end + end + b"data: b" + end + end
    assert datas(body) == ["a", "b"]
    assert datas(*bytewise(body)) == ["a", "b"]


def test_crlf_split_across_reads_is_one_line_end() -> None:
    # CR ends one read, LF starts the next: one line end, so no blank line in between.
    assert datas(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n") == ["a\nb"]


def test_final_cr_dispatches_without_waiting_for_the_next_read() -> None:
    decoder = SSEDecoder()
    assert [e.data for e in decoder.feed(b"data: x\r\r")] == ["x"]
    assert decoder.feed(b"\n") == []  # the LF of a split CRLF: not another blank line
    assert [e.data for e in decoder.feed(b"data: y\r\n\r\n")] == ["y"]


def test_mixed_line_ends() -> None:
    assert datas(b"data: a\r\ndata: b\rdata: c\n\r\n") == ["a\nb\nc"]


def test_unicode_separators_are_not_line_ends() -> None:
    text = "a\u2028b\u2029c\u0085d\x0be\x0cf\x1cg"
    body = f"data: {text}\n\n".encode()
    assert datas(body) == [text]
    assert datas(*bytewise(body)) == [text]


def test_multibyte_split_anywhere() -> None:
    body = "data: 你好 🌍\n\n".encode()
    for cut in range(len(body)):
        assert datas(body[:cut], body[cut:]) == ["你好 🌍"]


def test_data_with_and_without_space() -> None:
    assert datas(b"data:x\n\ndata: x\n\ndata:  x\n\n") == ["x", "x", " x"]


def test_field_without_colon_and_empty_data() -> None:
    # "data" alone is the data field with an empty value; "data:" dispatches data "".
    assert datas(b"data\n\ndata:\n\ndata\ndata\n\n") == ["", "", "\n"]


def test_multi_line_data_joined_with_lf() -> None:
    assert datas(b'data: {"a":\ndata: 1}\n\n') == ['{"a":\n1}']


def test_comments_and_meta_only_blocks_dispatch_nothing() -> None:
    body = b": ping\n\nretry: 3000\n\nid: 7\n\nevent: x\n\n: c\n\n"
    assert decode(body) == []


def test_event_id_retry_fields() -> None:
    events = decode(b"event: error\nid: 1\nretry: 250\ndata: a\n\ndata: b\n\nid\ndata: c\n\n")
    assert events == [
        SSEEvent("a", "error", "1", 250),
        SSEEvent("b", "message", "1", 250),  # the last event ID persists (WHATWG)
        SSEEvent("c", "message", "", 250),  # "id" with no value resets it
    ]


def test_invalid_retry_and_id_with_nul_are_ignored() -> None:
    events = decode(b"retry: 1a\nretry: -5\nid: a\x00b\ndata: x\n\n")
    assert events == [SSEEvent("x", "message", None, None)]


def test_unknown_fields_ignored() -> None:
    assert datas(b"foo: bar\nDATA: no\ndata: yes\n\n") == ["yes"]


def test_bom_stripped_once_even_split() -> None:
    body = b"\xef\xbb\xbfdata: a\n\n"
    for cut in range(1, 5):
        assert datas(body[:cut], body[cut:]) == ["a"]
    # A second BOM is part of the text (here: of a field name, so the line is ignored).
    assert datas(b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\ndata: b\n\n") == ["b"]


def test_end_flushes_an_event_missing_its_blank_line() -> None:
    assert datas(b"data: a\n\ndata: [DONE]\n") == ["a", "[DONE]"]
    assert datas(b"data: a\n\ndata: [DONE]") == ["a", "[DONE]"]


def test_max_event_size_bounds_one_line() -> None:
    decoder = SSEDecoder(max_event_size=100)
    decoder.feed(b"data: " + b"x" * 50)
    with pytest.raises(AttemptError) as info:
        decoder.feed(b"x" * 60)
    assert info.value.kind is ErrorKind.PROTOCOL


def test_max_event_size_bounds_many_data_lines() -> None:
    decoder = SSEDecoder(max_event_size=100)
    with pytest.raises(AttemptError) as info:
        for _ in range(20):
            decoder.feed(b"data: 0123456789\n")
    assert info.value.kind is ErrorKind.PROTOCOL


def test_max_event_size_fast_path() -> None:
    decoder = SSEDecoder(max_event_size=10)
    with pytest.raises(AttemptError):
        decoder.feed(b"data: " + b"x" * 20 + b"\n\n")


def test_events_below_the_limit_pass_and_limit_is_per_event() -> None:
    decoder = SSEDecoder(max_event_size=100)
    for _ in range(100):
        assert len(decoder.feed(b"data: " + b"x" * 80 + b"\n\n")) == 1


def test_long_line_in_tiny_reads_is_linear() -> None:
    decoder = SSEDecoder()
    for _ in range(200_000):
        decoder.feed(b"xxxxx")
    assert decoder.feed(b"\n\n") == []


@pytest.mark.parametrize(
    "body",
    [b"data: \xff\n\n", b"data: \xc3\x28\n\n", b"data: \xed\xa0\x80\n\n", b": \x80 comment\n\n"],
)
def test_invalid_utf8_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(AttemptError) as info:
        decode(body)
    assert info.value.kind is ErrorKind.PROTOCOL
    with pytest.raises(AttemptError):
        decode(*bytewise(body))


def test_cut_inside_a_character_at_end_is_a_protocol_error() -> None:
    decoder = SSEDecoder()
    decoder.feed("data: 你".encode()[:-1])
    with pytest.raises(AttemptError) as info:
        decoder.end()
    assert info.value.kind is ErrorKind.PROTOCOL


def test_random_splits_of_a_rich_stream() -> None:
    body = (
        b"\xef\xbb\xbf: hi\r\n\r\nretry: 10\n\nevent: e\nid: 3\ndata: 1\r\ndata:2\r\r"
        + "data: é\u2028😀\n\n".encode()
        + b"data: x\r\n"
    )
    expected = decode(body)
    assert [e.data for e in expected] == ["1\n2", "é\u2028😀", "x"]
    rng = random.Random(7)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(1, 12)))
        bounds = [0, *cuts, len(body)]
        assert decode(*(body[a:b] for a, b in itertools.pairwise(bounds))) == expected


_FRAGMENTS = st.sampled_from(
    [
        b"data: ",
        b"data:",
        b"data",
        b"event: ",
        b"id: ",
        b"retry: 5",
        b": c",
        b"\n",
        b"\r",
        b"\r\n",
        b"x",
        "é😀\u2028".encode(),
        b"\xef\xbb\xbf",
        b"{}",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_FRAGMENTS, max_size=30), st.lists(st.integers(0, 400), max_size=8))
def test_any_split_gives_the_same_events(parts: list[bytes], cuts: list[int]) -> None:
    body = b"".join(parts)
    whole = decode(body)
    bounds = [0, *sorted(c for c in cuts if c <= len(body)), len(body)]
    assert decode(*(body[a:b] for a, b in itertools.pairwise(bounds))) == whole
    assert decode(*bytewise(body)) == whole


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=5))
def test_arbitrary_bytes_raise_only_attempt_error(body: bytes, cuts: list[int]) -> None:
    bounds = [0, *sorted(c for c in cuts if c <= len(body)), len(body)]
    try:
        decode(*(body[a:b] for a, b in itertools.pairwise(bounds)), max_event_size=64)
    except AttemptError as exc:
        assert exc.kind is ErrorKind.PROTOCOL


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["", "message_start", "error", "a:b", "é"]),
            st.text(
                alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"),
                max_size=20,
            ),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_typed_event_fast_path_agrees_with_the_general_path(
    events: list[tuple[str, str]],
) -> None:
    """One ``event:`` + ``data:`` event per read (the Messages and Responses APIs' shape)
    takes a fast path; it gives what the line-by-line path gives for the same bytes."""
    reads = [f"event: {name}\ndata: {value}\n\n".encode() for name, value in events]
    fast = SSEDecoder()
    general = SSEDecoder()
    got = [e for read in reads for e in fast.feed_raw(read)]
    want = [
        e for read in reads for e in general.feed_raw(b"\n" + read[:-1]) + general.feed_raw(b"\n")
    ]
    assert got == want == [(name or "message", value, None, None) for name, value in events]


def test_typed_event_fast_path_bounds_and_utf8() -> None:
    with pytest.raises(AttemptError):
        SSEDecoder(max_event_size=4).feed_raw(b"event: x\ndata: 123456\n\n")
    with pytest.raises(AttemptError):
        SSEDecoder().feed_raw(b"event: x\ndata: \xff\n\n")
