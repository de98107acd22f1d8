"""`Gate`: a recovery attempt's output held back until it has reproduced what the caller has;
`AnchorGate`: the same for a continuation by instruction, whose output begins with a repeat
of the answer's last characters (the anchor).

A recovery after the commit (``_recovery.py``) re-runs the request on another replica (a
*replay*), or asks an engine that repeats its prefix to continue it (llama.cpp's server). Either
way the new answer starts with output the caller already has; relaying it again would duplicate
text, and relaying the rest of a *different* answer would splice two answers together. The gate
compares, per channel (content, reasoning, tool calls), what arrives with what was delivered,
by characters (two replicas cut the same text into different chunks), passes nothing until
every channel has been reproduced exactly, then passes what follows, splitting the delta in
which the reproduced part ends. Anything else is a divergence (`ErrorKind.DIVERGED`): sampled
differently, a different model, a tool call with other arguments.

Tool calls are compared by index, name and arguments, not by id (each replica makes up its
own ids, and the caller keeps the id it was given first: later fragments carry none).

The anchor method (issue 28; the dario gateway's v6.1 resumes targets without assistant
prefill this way): the model is told to repeat the answer's last ~40 characters and go on. Its
repeat is found with a match that ignores how whitespace runs and quote marks are written
(``“ ” ‘ ’`` as ``" '``), within the first `ANCHOR_SEARCH` characters of its output (a short
preamble is dropped with it), and only what follows is relayed. An anchor that is not there, or
is there twice (which repeat ends the answer so far?), is a divergence: the recovery fails, as
a replay that differs does; a model that does not follow the instruction is refused, never
spliced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from ._attempt_error import AttemptError, ErrorKind
from .events import Delta, ToolCallDelta

__all__ = ["ANCHOR_SEARCH", "AnchorGate", "Gate", "anchor_of", "tool_transcript"]

_CONTENT, _REASONING, _TOOLS = 0, 1, 2


def _header(fragment: ToolCallDelta, last_index: int | None) -> str:
    """What a fragment says besides its arguments: which call (when it changes) and its name."""
    if fragment.index == last_index and fragment.name is None:
        return ""
    return f"\x1e{fragment.index}\x1f{fragment.name or ''}\x1f"


def tool_transcript(fragments: Iterable[ToolCallDelta]) -> str:
    """The tool-call fragments as one text, the same however a server chunked them (names
    come whole, on a call's first fragment)."""
    parts: list[str] = []
    last: int | None = None
    for fragment in fragments:
        parts.append(_header(fragment, last))
        parts.append(fragment.arguments)
        last = fragment.index
    return "".join(parts)


class Gate:
    """Holds deltas back until ``content``, ``reasoning`` and the tool calls' ``tools``
    transcript (`tool_transcript`) have each been reproduced exactly; `feed` then returns
    only what follows. A gate with nothing to reproduce is open from the start.

    Raises (from `feed`, `end`):
        AttemptError: kind ``diverged``, when the output differs from what was delivered,
            goes beyond it in one channel before another was reproduced, or finishes first.
    """

    __slots__ = ("_last_index", "_seen", "_want", "held_back", "open")

    def __init__(self, content: str = "", reasoning: str = "", tools: str = "") -> None:
        self._want = (content, reasoning, tools)
        self._seen = [0, 0, 0]
        self._last_index: int | None = None
        self.held_back = 0  # content deltas received and not passed (the reproduced prefix)
        self.open = not (content or reasoning or tools)

    @property
    def verified(self) -> int:
        """Characters reproduced so far, over every channel."""
        return sum(self._seen)

    def feed(self, batch: Sequence[Delta]) -> list[Delta]:
        """What of ``batch`` may be relayed (empty while the prefix is being reproduced)."""
        if self.open:
            return list(batch)
        out: list[Delta] = []
        for delta in batch:
            if self.open:
                out.append(delta)
                continue
            rest = self._match(delta)
            if rest is not None:
                out.append(rest)
        return out

    def end(self) -> None:
        """The attempt's stream ended: fine only once the prefix was reproduced."""
        if not self.open:
            self._diverged("ended before it had reproduced the answer so far")

    def _match(self, delta: Delta) -> Delta | None:
        content = self._consume(_CONTENT, delta.content)
        if delta.content and not content:
            self.held_back += 1
        reasoning = self._consume(_REASONING, delta.reasoning)
        tools: list[ToolCallDelta] = []
        for fragment in delta.tool_calls:
            header = _header(fragment, self._last_index)
            self._last_index = fragment.index
            new_header = self._consume(_TOOLS, header)
            arguments = self._consume(_TOOLS, fragment.arguments)
            if new_header:
                tools.append(fragment)  # a call the caller has not seen: whole
            elif arguments:
                tools.append(ToolCallDelta(fragment.index, arguments=arguments))
        want, seen = self._want, self._seen
        done = all(seen[i] == len(want[i]) for i in (_CONTENT, _REASONING, _TOOLS))
        if not done:
            if content or reasoning or tools:
                self._diverged("went beyond the answer so far before it had reproduced it")
            if delta.finish_reason:
                self._diverged("finished before it had reproduced the answer so far")
            return None
        self.open = True
        if content == delta.content and reasoning == delta.reasoning and not delta.tool_calls:
            return delta if delta.has_output or delta.finish_reason or delta.usage else None
        if not (content or reasoning or tools or delta.finish_reason or delta.usage):
            return None
        return attrs.evolve(
            delta, content=content, reasoning=reasoning, tool_calls=tuple(tools), raw=None
        )

    def _consume(self, channel: int, text: str) -> str:
        """Match ``text`` against what is left to reproduce in ``channel``; the new rest."""
        want = self._want[channel]
        seen = self._seen[channel]
        if not text or seen >= len(want):
            return text
        k = min(len(text), len(want) - seen)
        if text[:k] != want[seen : seen + k]:
            self._diverged(f"differs from the answer so far at character {seen}")
        self._seen[channel] = seen + k
        return text[k:]

    def _diverged(self, what: str) -> None:
        raise AttemptError(ErrorKind.DIVERGED, f"the recovery's output {what}", retryable=False)


#: How far into an anchor continuation's output (characters, whitespace runs as one) its
#: repeat of the anchor may begin: room for a short preamble ("Continuing: …").
ANCHOR_SEARCH = 80
#: The anchor's length: the answer's last characters, extended back to a word's start.
ANCHOR_CHARS = 40
#: Characters of output past the anchor's repeat and as long again the gate reads before it
#: relays anything: a second repeat that close would make the cut ambiguous.
_AMBIGUITY_GAP = 8
_QUOTES = str.maketrans(
    {"\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u00ab": '"', "\u00bb": '"',
     "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'", "\u2033": '"'}
)  # fmt: skip


def anchor_of(text: str) -> str:
    """The anchor of an answer: its last `ANCHOR_CHARS` characters, moved back to the start
    of the word the cut falls in (at most 20 characters more), leading whitespace dropped;
    the whole text when it is shorter."""
    start = max(len(text) - ANCHOR_CHARS, 0)
    if start > 0 and not text[start - 1].isspace():
        back = text.rfind(" ", max(start - 20, 0), start)
        if back >= 0:
            start = back + 1
    return text[start:].lstrip()


def _normalised(text: str) -> tuple[str, list[int]]:
    """``text`` with each whitespace run as one space and typographic quotes as plain ones,
    and for each character of it the index in ``text`` just after the characters it stands
    for."""
    out: list[str] = []
    ends: list[int] = []
    for i, char in enumerate(text.translate(_QUOTES)):
        if char.isspace():
            if out and out[-1] == " ":
                ends[-1] = i + 1
                continue
            char = " "
        out.append(char)
        ends.append(i + 1)
    return "".join(out), ends


class AnchorGate:
    """Holds an anchor continuation's output back until its repeat of ``anchor`` is found
    (see the module); `feed` then returns only what follows it, in the deltas it came in (the
    one the repeat ends inside cut there). Reasoning the model writes before the repeat is
    dropped with it; a tool call before it is a divergence.

    ``ends_with_space``: whether the answer so far ends in whitespace (then whitespace the
    model puts right after its repeat is not relayed twice).

    Raises (from `feed`, `end`):
        AttemptError: kind ``diverged``: no repeat of the anchor near the output's start, a
            repeat found twice, or the output ended first.
    """

    __slots__ = ("_anchor", "_held", "_space", "held_back", "open", "verified")

    def __init__(self, anchor: str, *, ends_with_space: bool = False) -> None:
        self._anchor = _normalised(anchor)[0].strip()
        self._space = ends_with_space
        self._held: list[Delta] = []
        self.held_back = 0
        self.verified = 0
        self.open = not self._anchor

    def feed(self, batch: Sequence[Delta]) -> list[Delta]:
        if self.open:
            return list(batch)
        out: list[Delta] = []
        for delta in batch:
            if self.open:
                out.append(delta)
                continue
            if delta.tool_calls:
                self._diverged("called a tool before repeating the anchor")
            if delta.content or delta.finish_reason or delta.usage is not None:
                self._held.append(delta)
            cut = self._decide(final=delta.finish_reason is not None)
            if cut is not None:
                out += self._release(cut)
        return out

    def end(self) -> None:
        if not self.open:
            self._diverged("ended before repeating the anchor")

    def _decide(self, *, final: bool) -> int | None:
        """Where in the held text the repeat ends, once that is certain (``None``: not yet)."""
        raw = "".join(d.content for d in self._held)
        text, ends = _normalised(raw)
        anchor = self._anchor
        first = text.find(anchor)
        if first < 0 or first > ANCHOR_SEARCH:
            if final or len(text) >= ANCHOR_SEARCH + len(anchor):
                self._diverged("did not begin with a repeat of the answer's last characters")
            return None
        stop = first + len(anchor)
        # A second repeat would make the cut ambiguous: wait until as much text follows the
        # first as the anchor is long and a little more (or the output ends), and look.
        if not final and len(text) < stop + len(anchor) + _AMBIGUITY_GAP:
            return None
        if text.find(anchor, first + 1) >= 0:
            self._diverged("repeated the answer's last characters more than once")
        self.open = True
        self.verified = len(anchor)
        return ends[stop - 1]

    def _release(self, cut: int) -> list[Delta]:
        """The held deltas after character ``cut`` of their text: whole, but the one it falls
        inside (its rest, with no wire form of its own); whitespace first dropped when the
        answer so far ends in it. Content deltas wholly before it are held back."""
        out: list[Delta] = []
        at = 0
        strip = self._space
        for delta in self._held:
            text = delta.content
            end = at + len(text)
            if text and end <= cut:
                self.held_back += 1
            else:
                rest = text[max(cut - at, 0) :]
                if strip and rest:
                    rest = rest.lstrip()
                    strip = not rest
                if rest != text:
                    if not (rest or delta.finish_reason or delta.usage is not None):
                        self.held_back += bool(text)
                        at = end
                        continue
                    delta = attrs.evolve(delta, content=rest, reasoning="", tool_calls=(), raw=None)
                out.append(delta)
            at = end
        self._held = []
        return out

    def _diverged(self, what: str) -> None:
        raise AttemptError(ErrorKind.DIVERGED, f"the anchor continuation {what}", retryable=False)
