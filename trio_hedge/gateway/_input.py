"""What a client may send: the request body's JSON read the same way on every install, and
bounds on every client-chosen string the gateway keeps, exports or logs.

One JSON dialect whichever parser is installed (orjson with the ``speed`` extra, else the
standard library's ``json``): strict UTF-8, no ``NaN``/``Infinity`` and no number that is
infinite as a double, no lone surrogate (it could not be sent upstream as UTF-8), at most
`MAX_JSON_DEPTH` levels of nesting (the upstream body is written with ``json.dumps``, which
recurses) and `MAX_JSON_CONTAINERS` arrays and objects, and integers kept exact at any size
(orjson turns those beyond 64 bits into floats: such a body is read with ``json``). A body
outside it is a 400, never a 500.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

__all__ = [
    "MAX_JSON_CONTAINERS",
    "MAX_JSON_DEPTH",
    "MAX_LOGGED_CHARS",
    "MAX_MODEL_CHARS",
    "READ_HEADERS",
    "BadJSON",
    "clip",
    "duplicated",
    "load_json",
    "priority_from",
]

#: The longest ``model`` a request may name (characters; longer: 400). It keys learned
#: delays, is logged with every request and labels metrics; real model ids are far shorter
#: (``ft:gpt-4o-mini-2024-07-18:org:suffix:id`` is 45).
MAX_MODEL_CHARS = 256
#: The deepest nesting of arrays and objects a request body may have (deeper: 400). Tool
#: schemas and multimodal messages nest a few tens of levels at most.
MAX_JSON_DEPTH = 64
#: The most arrays and objects a request body may hold (more: 400). Walking them costs ~1 µs
#: each on the event loop: 4 MiB of ``{},`` (1.4 M objects) took 1.6 s there, stalling every
#: other stream. A long agent conversation with its tools holds a few thousand.
MAX_JSON_CONTAINERS = 100_000
#: The most characters of a client-chosen string (path, method) an access-log line keeps.
MAX_LOGGED_CHARS = 256
#: The request headers whose value the gateway reads: each may come at most once (two
#: ``Authorization`` headers would let the gateway and a proxy disagree about the caller).
READ_HEADERS = (
    b"authorization",
    b"content-length",
    b"idempotency-key",
    b"x-hedge",
    b"x-hedge-after",
    b"x-priority",
    b"x-request-id",
    b"x-api-key",  # the gateway key too, as Anthropic clients send it
)

#: The most digits of an ``X-Priority`` read as a number; a longer one is out of range and
#: clamped by its sign (``int()`` of a long digit string costs quadratic time).
MAX_PRIORITY_DIGITS = 4
_PRIORITY = re.compile(r"[+-]?[0-9]+")


def priority_from(text: str | None, low: int, high: int) -> int | None:
    """An ``X-Priority`` value clamped to ``[low, high]`` (``low`` without one; any integer
    is clamped, negative or huge), or ``None`` when it is not an integer."""
    if text is None:
        return low
    text = text.strip()
    if not _PRIORITY.fullmatch(text):
        return None
    if len(text.lstrip("+-")) > MAX_PRIORITY_DIGITS:
        return low if text.startswith("-") else high
    return min(max(int(text), low), high)


_orjson_loads: Any
try:  # orjson (the "speed" extra) parses a request body ~5x faster than json
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - depends on the environment
    _orjson_loads = None

#: orjson reads an integer beyond 64 bits as a float: one this large may have been one.
_INEXACT = float(2**63)


class BadJSON(ValueError):
    """The body is not JSON the gateway relays; the message says why (never the body)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJSON("a number is too large for a double")
    return value


def _no_constant(_name: str) -> None:
    raise BadJSON("NaN and Infinity are not JSON")


def _scan(obj: Any) -> tuple[str | None, bool]:
    """What is wrong with ``obj``'s shape (nesting deeper than `MAX_JSON_DEPTH`, more than
    `MAX_JSON_CONTAINERS` arrays and objects; ``None``: nothing), and whether it holds a float
    that orjson may have made of an integer (an explicit stack: no recursion; a request has
    tens of nodes, its long strings are one node each)."""
    kind = type(obj)
    if kind is not dict and kind is not list:
        return None, kind is float and not -_INEXACT <= obj < _INEXACT
    todo: list[tuple[Any, int]] = [(obj, 1)]
    maybe_int = False
    budget = MAX_JSON_CONTAINERS - 1
    while todo:
        item, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            return f"the request body nests deeper than {MAX_JSON_DEPTH} levels", maybe_int
        for child in item.values() if type(item) is dict else item:
            kind = type(child)
            if kind is dict or kind is list:
                budget -= 1
                if budget < 0:
                    message = (
                        f"the request body has more than {MAX_JSON_CONTAINERS} arrays and objects"
                    )
                    return message, maybe_int
                todo.append((child, depth + 1))
            elif kind is float and not -_INEXACT <= child < _INEXACT:
                maybe_int = True
    return None, maybe_int


def _strict_json(body: bytes) -> Any:
    """``json`` made as strict as orjson; integers exact."""
    obj = json.loads(body.decode("utf-8"), parse_float=_finite_float, parse_constant=_no_constant)
    if b"\\u" in body:
        # json joins escaped surrogate pairs and keeps a lone surrogate, which is not UTF-8.
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    return obj


def load_json(body: bytes) -> Any:
    """``body`` parsed (see the module docstring for the dialect).

    Raises:
        BadJSON: the body is not UTF-8 JSON, or falls outside the dialect.
    """
    try:
        # orjson is strict already: UTF-8 only, no NaN, no lone surrogate.
        obj = _strict_json(body) if _orjson_loads is None else _orjson_loads(body)
        problem, maybe_int = _scan(obj)
        if maybe_int and _orjson_loads is not None:
            obj = _strict_json(body)  # the integers as the client wrote them
    except BadJSON:
        raise
    except (ValueError, RecursionError):  # UnicodeError is a ValueError
        raise BadJSON("the request body is not valid JSON") from None
    if problem is not None:
        raise BadJSON(problem)
    return obj


def duplicated(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The first of `READ_HEADERS` that comes more than once in ``headers``, or ``None``."""
    seen: set[bytes] = set()
    for name, _value in headers:
        if name in READ_HEADERS:
            if name in seen:
                return name
            seen.add(name)
    return None


def clip(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """``text`` cut to ``limit`` characters (with ``…`` when cut), for a log line."""
    return text if len(text) <= limit else text[: limit - 1] + "…"
