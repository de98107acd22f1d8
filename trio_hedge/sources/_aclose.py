"""Closing a library's async generator for real: it and every one it is suspended in.

Why: ``async for`` never closes the iterator it leaves, so closing an async generator
suspended inside ``async for x in inner:`` drops ``inner`` (and what ``inner`` is suspended
in) unfinished. The garbage collector then finalises each one wherever it happens to run,
and Trio warns: "Async generator ... was garbage collected before it had been exhausted.
Surround its use in 'async with aclosing(...)'". httpx 0.28 and httpcore 1.0 stack six such
generators under ``Response.aiter_raw()`` (``BoundAsyncStream.__aiter__`` down to
``_receive_response_body``: httpx issue 3686; a fix, httpx PR 3777, is not released), and the
openai SDK's ``AsyncStream`` adds its own on top, so ``aclosing()`` around the outer one
still leaves the rest to the collector (failing cases: ``tests/test_left_early.py``; the
fuzz's 500 races, ``tests/test_cancel_fuzz.py``, left 59 responses' chains on bcbad18).

`aclose_nested` finds the chain before it closes anything (a suspended generator refers to
the one it iterates through its frame; ``gc.get_referents`` reads it, on CPython), holds it,
and closes each one from the outside in, in the calling task, as an exception would unwind
them: each one's own cleanup runs first, then whatever it left open is closed. It is for
generators this library iterates on a library's behalf (httpx, the openai SDK), whose every
inner generator is that stream's alone; a caller's own generator is closed by its own
``aclose`` (what it iterates is its code's to close).
"""

from __future__ import annotations

import gc
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["aclose_chain", "aclose_nested", "nested_chain"]


def _suspended_in(agen: types.AsyncGeneratorType[Any, Any]) -> list[Any]:
    """The async generators ``agen``'s frame holds (the one its ``async for`` iterates)."""
    frame = agen.ag_frame
    if frame is None or agen.ag_running:  # finished, or running (nothing to take from it)
        return []
    # CPython 3.11+ lists a generator's stack through the generator, 3.10 through its frame.
    return [r for r in gc.get_referents(agen, frame) if isinstance(r, types.AsyncGeneratorType)]


def nested_chain(agen: Any) -> list[types.AsyncGeneratorType[Any, Any]]:
    """``agen`` and every unfinished async generator it is suspended in, outermost first."""
    if not isinstance(agen, types.AsyncGeneratorType):
        return []
    chain = [agen]
    seen = {id(agen)}
    for outer in chain:  # grows while it is walked: breadth first
        for inner in _suspended_in(outer):
            if id(inner) not in seen and inner.ag_frame is not None:
                seen.add(id(inner))
                chain.append(inner)
    return chain


async def aclose_nested(agen: Any) -> None:
    """Close ``agen`` (an async generator; anything else is left alone) and every async
    generator it is suspended in, outermost first, in this task (`aclose_chain`)."""
    await aclose_chain(nested_chain(agen))


async def aclose_chain(chain: Sequence[Any]) -> None:
    """Close every async generator of ``chain`` in order (finished ones are skipped). Every one
    is closed even when an earlier close raises (a cancel, a failing cleanup); the first error
    is raised after."""
    error: BaseException | None = None
    for generator in chain:
        try:
            await generator.aclose()
        except BaseException as exc:  # close the rest, then raise the first error
            if error is None:
                error = exc
    if error is not None:
        try:
            raise error
        finally:
            error = None  # no reference cycle through the traceback
