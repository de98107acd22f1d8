"""The recovery gate (``trio_hedge._verify.Gate``), by property: however two replicas chunk
one answer, a replay's relayed output is exactly what follows the delivered prefix, in every
channel (content, reasoning, tool calls); any difference is a divergence, never relayed."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_hedge._verify import Gate, tool_transcript
from trio_hedge.errors import AttemptError, ErrorKind
from trio_hedge.events import Delta, ToolCallDelta

TEXT = st.text(alphabet="ab c", min_size=1, max_size=40)


def chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a]


@given(TEXT, st.data())
def test_a_replay_relays_exactly_what_follows(text: str, data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(text)))
    cuts = data.draw(st.lists(st.integers(0, 100), max_size=10))
    gate = Gate(text[:at])
    out: list[Delta] = []
    for piece in chunks(text, cuts):
        out.extend(gate.feed([Delta(content=piece)]))
    out.extend(gate.feed([Delta(finish_reason="stop")]))
    assert "".join(d.content for d in out) == text[at:]
    assert out[-1].finish_reason == "stop"
    assert gate.verified == at


@given(TEXT, st.data())
def test_a_difference_is_a_divergence(text: str, data: st.DataObject) -> None:
    at = data.draw(st.integers(1, len(text)))
    where = data.draw(st.integers(0, at - 1))
    other = text[:where] + ("x" if text[where] != "x" else "y") + text[where + 1 :]
    cuts = data.draw(st.lists(st.integers(0, 100), max_size=10))
    gate = Gate(text[:at])
    relayed: list[Delta] = []
    with pytest.raises(AttemptError) as info:
        for piece in chunks(other, cuts):
            relayed.extend(gate.feed([Delta(content=piece)]))
        gate.end()
    assert info.value.kind is ErrorKind.DIVERGED and not info.value.retryable
    assert relayed == []


def test_a_shorter_replay_is_a_divergence() -> None:
    gate = Gate("abc")
    assert gate.feed([Delta(content="ab")]) == []
    with pytest.raises(AttemptError):
        gate.feed([Delta(finish_reason="stop")])
    with pytest.raises(AttemptError):
        Gate("abc").end()


def test_tool_calls_are_compared_by_name_and_arguments_not_id() -> None:
    delivered = [
        ToolCallDelta(0, id="call_x", name="f", arguments=""),
        ToolCallDelta(0, arguments='{"a": '),
    ]
    gate = Gate("hi", tools=tool_transcript(delivered))
    replay = [
        Delta(content="h"),
        Delta(content="i"),
        Delta(tool_calls=(ToolCallDelta(0, id="call_other", name="f", arguments='{"a"'),)),
        Delta(tool_calls=(ToolCallDelta(0, arguments=": 1}"),)),
        Delta(tool_calls=(ToolCallDelta(1, id="call_2", name="g", arguments="{}"),)),
    ]
    out = [d for delta in replay for d in gate.feed([delta])]
    assert [d.tool_calls for d in out] == [
        (ToolCallDelta(0, arguments="1}"),),
        (ToolCallDelta(1, id="call_2", name="g", arguments="{}"),),
    ]
    with pytest.raises(AttemptError):  # another function at the same index
        Gate(tools=tool_transcript(delivered)).feed(
            [Delta(tool_calls=(ToolCallDelta(0, id="c", name="h", arguments='{"a": '),))]
        )


def test_new_output_in_one_channel_before_another_is_reproduced_diverges() -> None:
    gate = Gate("ab", reasoning="think")
    with pytest.raises(AttemptError):
        gate.feed([Delta(content="abc")])  # content went on, the reasoning never came
