"""A fleet of scripted replicas for Hedger tests: what each attempt does is chosen per
(request, replica, attempt) by a function, and every attempt's AttemptInfo is recorded.

Scripts come from ``tests/scripted.py`` (first token after ``ttft`` s, ``tokens`` tokens
``gap`` s apart, or an error at ``fail_at``); :class:`Fail` adds errors that carry
``retry_after`` (server pushback).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import trio

import trio_hedge as th
from trio_hedge import AttemptError
from trio_hedge.errors import ErrorKind
from trio_hedge.sources import AttemptInfo

from .scripted import Ledger, Script, _ScriptedIterator


@attrs.frozen
class Fail:
    """Fail ``at`` seconds after the attempt opens, with ``retry_after`` pushback."""

    at: float = 0.1
    kind: ErrorKind = ErrorKind.SERVER_ERROR
    retry_after: float | None = None
    status: int | None = None  # the HTTP status it stands for (a 500: a query of death?)


Behave = Callable[[str, AttemptInfo], "Script | Fail"]


class _Failing:
    def __init__(self, fail: Fail, ledger: Ledger, name: str, info: AttemptInfo) -> None:
        self._fail, self._ledger, self._name, self._info = fail, ledger, name, info
        self._start = trio.current_time()
        ledger.opened.append((name, info.number, self._start))

    def __aiter__(self) -> _Failing:
        return self

    async def __anext__(self) -> str:
        await trio.sleep_until(self._start + self._fail.at)
        raise AttemptError(
            self._fail.kind,
            "scripted failure",
            retry_after=self._fail.retry_after,
            status_code=self._fail.status,
        )

    async def aclose(self) -> None:
        self._ledger.closed.append((self._name, self._info.number, trio.current_time()))


@attrs.define
class Fleet:
    """Replicas named ``names``; ``behave(replica, info)`` picks each attempt's script."""

    names: Sequence[str]
    behave: Behave
    ledger: Ledger = attrs.Factory(Ledger)
    #: (replica, AttemptInfo, Trio time opened) per attempt, in opening order.
    infos: list[tuple[str, AttemptInfo, float]] = attrs.Factory(list)

    def _open(self, name: str, info: AttemptInfo) -> object:
        self.infos.append((name, info, trio.current_time()))
        what = self.behave(name, info)
        if isinstance(what, Fail):
            return _Failing(what, self.ledger, name, info)
        return _ScriptedIterator(name, what, info, self.ledger)

    def sources(self) -> list[th.sources.IteratorSource]:
        return [
            th.iterator_source(lambda info, n=name: self._open(n, info), name=name)  # type: ignore[arg-type,misc]
            for name in self.names
        ]


def table(
    default: Script | Fail, **per_replica: Script | Fail
) -> Callable[[str, AttemptInfo], Script | Fail]:
    """A fixed behaviour per replica name."""
    return lambda name, _info: per_replica.get(name, default)


async def run(stream: th.HedgedStream) -> th.Report:
    """Enter the stream, read it to the end, return the report; errors become the report of
    the error (so a scenario can look at failed requests too)."""
    try:
        async with stream:
            async for _ in stream:
                pass
    except th.HedgeError as exc:
        assert exc.report is not None
        return exc.report
    return stream.report
