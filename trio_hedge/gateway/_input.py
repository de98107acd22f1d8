"""What a client may send: the request body's JSON read the same way on every install, and
bounds on every client-chosen string the gateway keeps, exports or logs.

One JSON dialect whichever parser is installed (orjson with the ``speed`` extra, else the
standard library's ``json``): strict UTF-8, no ``NaN``/``Infinity`` and no number that is
infinite as a double, no lone surrogate (it could not be sent upstream as UTF-8), at most
`MAX_JSON_DEPTH` levels of nesting (the upstream body is written with ``json.dumps``, which
recurses), and integers kept exact at any size (orjson turns those beyond 64 bits into floats:
such a body is read with ``json``). A body outside it is a 400, never a 500.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_LOGGED_CHARS",
    "MAX_MODEL_CHARS",
    "READ_HEADERS",
    "BadJSON",
    "clip",
    "duplicated",
    "load_json",
]

#: The longest ``model`` a request may name (characters; longer: 400). It keys learned
#: delays, is logged with every request and labels metrics; real model ids are far shorter
#: (``ft:gpt-4o-mini-2024-07-18:org:suffix:id`` is 45).
MAX_MODEL_CHARS = 256
#: The deepest nesting of arrays and objects a request body may have (deeper: 400). Tool
#: schemas and multimodal messages nest a few tens of levels at most.
MAX_JSON_DEPTH = 64
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
    b"x-request-id",
)

_orjson_loads: Any
try:  # orjson (the "speed" extra) parses a request body ~5x faster than json
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - depends on the environment
    _orjson_loads = None

#: 19 digits or more: maybe an integer beyond 64 bits, which orjson would make a float.
_LONG_DIGITS = re.compile(rb"\d{19}")
#: A ``\uD800``-``\uDFFF`` escape: maybe a lone surrogate, which json accepts.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BadJSON(ValueError):
    """The body is not JSON the gateway relays; the message says why (never the body)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJSON("a number is too large for a double")
    return value


def _no_constant(_name: str) -> None:
    raise BadJSON("NaN and Infinity are not JSON")


def _too_deep(obj: object) -> bool:
    """Whether ``obj`` nests deeper than `MAX_JSON_DEPTH` (an explicit stack: no recursion)."""
    todo: list[tuple[object, int]] = [(obj, 1)]
    while todo:
        item, depth = todo.pop()
        children: Iterable[object]
        if type(item) is dict:
            children = item.values()
        elif type(item) is list:
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            return True
        todo.extend((child, depth + 1) for child in children)
    return False


def load_json(body: bytes) -> Any:
    """``body`` parsed (see the module docstring for the dialect).

    Raises:
        BadJSON: the body is not UTF-8 JSON, or falls outside the dialect.
    """
    exact = _orjson_loads is not None and _LONG_DIGITS.search(body) is None
    try:
        if exact:
            obj = _orjson_loads(body)  # strict already: UTF-8, no NaN, no lone surrogate
        else:
            obj = json.loads(
                body.decode("utf-8"), parse_float=_finite_float, parse_constant=_no_constant
            )
            if _SURROGATE_ESCAPE.search(body) is not None:
                # Pairs were joined into one code point; what is left alone cannot be UTF-8.
                json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except BadJSON:
        raise
    except (ValueError, RecursionError):  # UnicodeError is a ValueError
        raise BadJSON("the request body is not valid JSON") from None
    # Each container needs one opening bracket: fewer of them than the bound, no walk needed.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _too_deep(obj):
        raise BadJSON(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
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
