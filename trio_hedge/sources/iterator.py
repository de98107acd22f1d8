"""Any async-iterator factory as a [`Source`][trio_hedge.sources.Source] (another SDK, a non-HTTP
source)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from .._source import AttemptInfo
from ..events import Delta

__all__ = ["IteratorSource", "iterator_source"]

Item = str | Delta
Factory = Callable[[AttemptInfo], AsyncIterator[Item] | Awaitable[AsyncIterator[Item]]]


class _IteratorAttempt:
    __slots__ = ("_iterator",)

    #: See [`AttemptStream`][trio_hedge.sources.AttemptStream]: an iterator object is read from
    #: any task.
    task_bound = False

    def __init__(self, iterator: AsyncIterator[Item]) -> None:
        self._iterator = iterator

    async def receive(self) -> Sequence[Delta] | None:
        # Items that carry nothing (empty strings) are skipped: they are not tokens.
        while True:
            try:
                item = await self._iterator.__anext__()
            except StopAsyncIteration:
                return None
            if isinstance(item, str):
                if item:
                    return (Delta(content=item),)
            elif isinstance(item, Delta):
                return (item,)
            else:
                raise TypeError(f"an iterator source must yield str or Delta, not {item!r}")

    async def aclose(self) -> None:
        aclose = getattr(self._iterator, "aclose", None)
        if aclose is not None:
            await aclose()


class _GeneratorAttempt(_IteratorAttempt):
    """An async generator may keep a cancel scope or nursery open across ``yield``, which
    breaks if another task resumes it (Trio: "cancel scope stack corrupted"; PEP 789): it is
    read and closed only by the task that opened it."""

    __slots__ = ()
    task_bound = True


class IteratorSource:
    """Races whatever ``factory(info)`` returns: an async iterator of ``str`` tokens or
    [`Delta`][trio_hedge.events.Delta] events (or an awaitable of one). Exceptions it raises are
    classified (``OSError`` → connection, ``TimeoutError`` → timeout, others fatal) unless
    they are [`AttemptError`][trio_hedge.AttemptError] already; an exception group is classified by
    its errors.

    An async generator is safe even when it keeps a cancel scope or nursery open across
    ``yield``: it is read and closed only in its attempt's own task, which relays its items to
    the caller after the commit (a task switch per item). Any other async iterator is read
    directly by whichever task needs the next item, so it must hold no cancel scope or
    nursery between calls."""

    def __init__(self, factory: Factory, *, name: str) -> None:
        if not callable(factory):
            raise TypeError(f"factory must be callable, not {factory!r}")
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty str")
        self._factory = factory
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"IteratorSource(name={self._name!r})"

    async def open(self, info: AttemptInfo) -> _IteratorAttempt:
        made = self._factory(info)
        if inspect.isawaitable(made):
            made = await made
        if not hasattr(made, "__anext__"):
            raise TypeError(f"factory must return an async iterator, not {made!r}")
        if inspect.isasyncgen(made):
            return _GeneratorAttempt(made)  # type: ignore[arg-type]  # the items are checked
        return _IteratorAttempt(made)


def iterator_source(factory: Factory, *, name: str) -> IteratorSource:
    """Wrap ``factory`` (called once per attempt with its
    [`AttemptInfo`][trio_hedge.sources.AttemptInfo]) as a [`Source`][trio_hedge.sources.Source] that
    `hedged_stream` can race."""
    return IteratorSource(factory, name=name)
