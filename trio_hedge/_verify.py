"""`Gate`: a recovery attempt's output held back until it has reproduced what the caller has.

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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from ._attempt_error import AttemptError, ErrorKind
from .events import Delta, ToolCallDelta

__all__ = ["Gate", "tool_transcript"]

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
