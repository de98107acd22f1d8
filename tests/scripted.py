"""Scripted sources for virtual-time tests of the race engine: each replica follows a script
(first token after ``ttft`` seconds, then ``tokens`` tokens ``gap`` seconds apart, or an
error at ``fail_at``), and a shared ledger records every attempt opened and closed."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from trio_hedge import AttemptError, iterator_source
from trio_hedge.errors import ErrorKind
from trio_hedge.events import Delta
from trio_hedge.sources import AttemptInfo, IteratorSource


@attrs.frozen
class Script:
    ttft: float = 0.5
    tokens: int = 3
    gap: float = 0.1
    fail_at: float | None = None  # seconds after the attempt opens
    fail_kind: ErrorKind = ErrorKind.SERVER_ERROR
    fail_after_tokens: int | None = None  # fail mid-stream after this many tokens
    cut_kind: ErrorKind = ErrorKind.STREAM_TRUNCATED  # ... with this kind
    stall_after_tokens: int | None = None  # go silent forever after this many tokens
    close_delay: float = 0.0  # seconds aclose() takes (a slow close: TLS, a busy server)
    reasoning: bool = False  # the tokens are reasoning deltas, not content


@attrs.define
class Ledger:
    opened: list[tuple[str, int, float]] = attrs.Factory(list)  # (replica, attempt, time)
    closed: list[tuple[str, int, float]] = attrs.Factory(list)

    @property
    def open_now(self) -> int:
        return len(self.opened) - len(self.closed)


class _ScriptedIterator:
    def __init__(self, name: str, script: Script, info: AttemptInfo, ledger: Ledger) -> None:
        self._name, self._script, self._info, self._ledger = name, script, info, ledger
        self._sent = 0
        self._closed = False
        self._start = trio.current_time()
        ledger.opened.append((name, info.number, self._start))

    def __aiter__(self) -> _ScriptedIterator:
        return self

    async def __anext__(self) -> str | Delta:
        s = self._script
        if s.fail_at is not None and self._sent == 0:
            await trio.sleep_until(self._start + s.fail_at)
            raise AttemptError(s.fail_kind, f"scripted {s.fail_kind.value}")
        if self._sent == s.fail_after_tokens:
            raise AttemptError(s.cut_kind, f"scripted {s.cut_kind.value} after the commit")
        if self._sent == s.stall_after_tokens:
            await trio.sleep_forever()
        if self._sent >= s.tokens:
            raise StopAsyncIteration
        await trio.sleep_until(self._start + s.ttft + self._sent * s.gap)
        self._sent += 1
        text = f"{self._name}:{self._sent - 1} "
        return Delta(reasoning=text) if s.reasoning else text

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if self._script.close_delay:
                await trio.sleep(self._script.close_delay)
            self._ledger.closed.append((self._name, self._info.number, trio.current_time()))


def scripted(name: str, script: Script, ledger: Ledger) -> IteratorSource:
    return iterator_source(lambda info: _ScriptedIterator(name, script, info, ledger), name=name)


def sources(ledger: Ledger, *scripts: Script) -> Sequence[IteratorSource]:
    names = ["primary", "backup", "third", "fourth"]
    return [scripted(names[i], s, ledger) for i, s in enumerate(scripts)]


class _Interrupting(_ScriptedIterator):
    """Raises KeyboardInterrupt ``at`` seconds after opening, as Trio delivers a Ctrl-C to
    whichever task is running."""

    def __init__(self, at: float, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self._at = at

    async def __anext__(self) -> str:
        await trio.sleep_until(self._start + self._at)
        raise KeyboardInterrupt


def interrupting(name: str, at: float, ledger: Ledger) -> IteratorSource:
    return iterator_source(lambda info: _Interrupting(at, name, Script(), info, ledger), name=name)
