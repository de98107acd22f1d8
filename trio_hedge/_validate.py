"""Every input validator of the library, in one place: bad input fails at construction, before
any I/O, with a ``TypeError`` or ``ValueError`` naming the field.

- attrs validators for the config classes ([`HedgePolicy`][trio_hedge.HedgePolicy],
  [`HedgerConfig`][trio_hedge.HedgerConfig], [`LearnedDelay`][trio_hedge.LearnedDelay], the budget,
  throttle, back-off and outlier detection): durations in seconds, counts, fractions.
- checks of what is sent on the wire, shared by [`Replica`][trio_hedge.sources.Replica],
  [`hedged_stream`][trio_hedge.hedged_stream] and [`stream`][trio_hedge.Hedger.stream]: header names
  and values, API keys, request ids, JSON bodies.

Two rules hold for every message the wire checks raise:

* it names the field (``api_key``, ``headers['X-Api-Key']``, ``request['temperature']``);
* it never quotes the value: a rejected value is most often a credential (an API key read
  from a file, with its trailing newline), and an exception message ends up in logs, reports
  and terminals. Only its type, the position and the *kind* of a bad character are named.

Why so strict about header values: an HTTP/1.1 client library rejects a header value with a
CR, LF or NUL (RFC 9110 §5.5; h11 raises ``LocalProtocolError("Illegal header value
b'Bearer sk-…\\n'")``, quoting the whole key), httpx raises ``UnicodeEncodeError`` (whose
``args`` hold the whole value) for a non-ASCII one, and h11 also refuses leading or trailing
whitespace. Each of those would surface *during* the request, as a transport error that
quotes the secret. Checking here turns them into a clear error up front.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

__all__ = [
    "MAX_PRIORITY",
    "Validator",
    "check_api_key",
    "check_header_name",
    "check_header_value",
    "check_headers",
    "check_json_body",
    "check_priority",
    "check_queued",
    "check_request_headers",
    "check_request_hedge_after",
    "check_request_id",
    "fraction",
    "integer",
    "number",
    "optional_instance_of",
    "positive_int",
    "positive_int_or_none",
    "positive_seconds",
    "positive_seconds_or_none",
    "seconds_or_none",
]

# -- attrs validators for the config classes ------------------------------------------------

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def number(lo: float | None = None, *, open_lo: bool = False) -> Validator:
    """A finite real number (not a bool), ``>= lo`` (``> lo`` with ``open_lo``)."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{attribute.name} must be a number, not {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{attribute.name} must be a finite number, not {value!r}")
        if lo is not None and (value <= lo if open_lo else value < lo):
            op = ">" if open_lo else ">="
            raise ValueError(f"{attribute.name} must be {op} {lo}, not {value!r}")

    return check


def integer(lo: int) -> Validator:
    """An int (not a bool) ``>= lo``."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{attribute.name} must be an int, not {value!r}")
        if value < lo:
            raise ValueError(f"{attribute.name} must be >= {lo}, not {value!r}")

    return check


#: An int (not a bool) ``>= 1``.
positive_int = integer(1)


def positive_int_or_none(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """``None`` or an int (not a bool) ``>= 1``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be an int or None, not {value!r}")
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, not {value!r}")


def fraction(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A number strictly between 0 and 1."""
    number(0.0, open_lo=True)(_inst, attribute, value)
    assert isinstance(value, (int, float))
    if value >= 1.0:
        raise ValueError(f"{attribute.name} must be < 1, not {value!r}")


def seconds_or_none(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """``None`` or finite seconds ``>= 0``. One rule for every duration: "never" is ``None``,
    not infinity."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{attribute.name} must be seconds (a number) or None, not {value!r}")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{attribute.name} must be >= 0 seconds, not {value!r}")
    if math.isinf(value):
        raise ValueError(
            f"{attribute.name} must be finite seconds (None means never), not {value!r}"
        )


def positive_seconds_or_none(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """``None`` or finite seconds ``> 0``."""
    seconds_or_none(inst, attribute, value)
    if value is not None and value == 0:
        raise ValueError(f"{attribute.name} must be > 0 seconds, not {value!r}")


def positive_seconds(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Finite seconds ``> 0``."""
    if value is None:
        raise TypeError(f"{attribute.name} must be seconds (a number), not None")
    positive_seconds_or_none(inst, attribute, value)


def optional_instance_of(kind: type) -> Validator:
    """``None`` or an instance of ``kind``."""
    return attrs.validators.optional(attrs.validators.instance_of(kind))


# -- what is sent on the wire -----------------------------------------------------------------

# RFC 9110 §5.6.2: token = 1*tchar.
_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _describe(char: str) -> str:
    """What kind of character ``char`` is, without showing it."""
    if char in "\r\n":
        return "a line break (CR or LF)"
    if char == "\0":
        return "a NUL character"
    if char in " \t":
        return "whitespace"
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return "a control character"
    if not char.isascii():
        return "a non-ASCII character"
    return "a character not allowed there"


def _bad_value_char(value: str) -> int:
    """Index of the first character not allowed in an HTTP header value we send, or -1.

    Allowed: visible ASCII, and spaces or tabs *between* visible characters (RFC 9110 §5.5
    field-value, without obs-text: httpx encodes header values as ASCII)."""
    for index, char in enumerate(value):
        if not (" " <= char <= "~" or char == "\t"):
            return index
    if value[:1] in (" ", "\t"):
        return 0
    if value[-1:] in (" ", "\t"):
        return len(value) - 1
    return -1


def check_header_value(value: object, field: str, *, allow_empty: bool = True) -> None:
    """Raise unless ``value`` is a ``str`` an HTTP header can carry unchanged.

    Raises:
        TypeError: not a ``str`` (the message names the type only).
        ValueError: empty (unless ``allow_empty``), or a CR, LF, NUL, other control
            character, non-ASCII character, or leading/trailing whitespace (the message
            names the kind of character and its index, never the value).
    """
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, not {type(value).__name__}")
    if not value and not allow_empty:
        raise ValueError(f"{field} must not be empty")
    index = _bad_value_char(value)
    if index < 0:
        return
    char = value[index]
    where = f"at index {index} of {len(value)}"
    if char in " \t" and index in (0, len(value) - 1):
        raise ValueError(
            f"{field} has leading or trailing whitespace ({where}); was it read from a file? "
            "Strip it."
        )
    hint = "; was it read from a file? Strip the trailing newline" if char in "\r\n" else ""
    raise ValueError(
        f"{field} contains {_describe(char)} ({where}), which an HTTP header cannot carry{hint}"
    )


def check_api_key(value: object, field: str = "api_key") -> None:
    """Raise unless ``value`` is ``None`` or a non-empty ``str`` that fits in
    ``Authorization: Bearer …`` (see `check_header_value`)."""
    if value is None:
        return
    check_header_value(value, field, allow_empty=False)


def check_header_name(value: object, field: str) -> None:
    """Raise unless ``value`` is a ``str`` HTTP field name (an RFC 9110 token). The message
    never quotes the name: a misplaced secret may be sitting in it."""
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{field} must not be empty")
    for index, char in enumerate(value):
        if char not in _TCHAR:
            raise ValueError(
                f"{field} contains {_describe(char)} at index {index}; an HTTP header name is "
                "a token of letters, digits and !#$%&'*+-.^_`|~ (RFC 9110 §5.6.2)"
            )


def check_headers(headers: object, field: str) -> None:
    """Raise unless ``headers`` is a mapping of valid header names to valid values. A bad
    value is reported by its (valid) header name, never by its content."""
    if not isinstance(headers, Mapping):
        raise TypeError(f"{field} must be a mapping of header names to values")
    for position, (name, value) in enumerate(headers.items()):
        check_header_name(name, f"{field}: header name #{position + 1}")
        check_header_value(value, f"{field}[{name!r}]")


def check_request_id(value: object, field: str = "request_id") -> None:
    """Raise unless ``value`` is ``None`` or a non-empty ``str`` that fits in a header (it is
    sent as ``X-Request-ID`` on every attempt)."""
    if value is None:
        return
    check_header_value(value, field, allow_empty=False)


def check_json_body(body: object, field: str) -> None:
    """Raise unless ``body`` is a mapping that encodes to strict JSON (RFC 8259).

    Python's `json` writes ``NaN`` and ``Infinity`` by default, which no JSON parser
    is bound to accept (servers answer 400, or worse, parse them differently); other objects
    (``bytes``, sets, dataclasses…) cannot be encoded at all. Checking here costs one
    ``json.dumps`` (C-accelerated; ~20 µs for a 10 KB body) and finds the problem before any
    attempt starts, which matters for a [`Hedger`][trio_hedge.Hedger]: it binds replicas lazily,
    inside the race, where a bad body would otherwise fail each attempt in turn.

    Raises:
        TypeError: not a mapping, a key that is not a ``str``, or a value JSON cannot encode
            (the message gives its path and type).
        ValueError: ``NaN`` or an infinity (the message gives its path), or a cycle.
    """
    if not isinstance(body, Mapping):
        raise TypeError(f"{field} must be a mapping (a JSON object), not {type(body).__name__}")
    body = dict(body)  # what the source sends: a top-level Mapping becomes a dict
    try:
        json.dumps(body, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        pass
    else:
        return
    _find_json_problem(body, field, set())
    raise ValueError(f"{field} does not encode to JSON")  # pragma: no cover - defensive


def _find_json_problem(value: Any, path: str, seen: set[int]) -> None:
    """Walk ``value`` and raise the first problem ``json.dumps`` would meet, by path."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            kind = "NaN" if math.isnan(value) else "an infinity"
            raise ValueError(f"{path} is {kind}, which JSON cannot carry (RFC 8259 §6)")
        return
    if isinstance(value, (dict, list, tuple)):
        if id(value) in seen:
            raise ValueError(f"{path} contains itself (a cycle), which JSON cannot encode")
        seen.add(id(value))
        if isinstance(value, dict):
            for key, item in value.items():
                # json.dumps writes str, int, float, bool and None keys (as strings).
                if key is not None and not isinstance(key, (str, int, float)):
                    raise TypeError(f"{path} has a key of type {type(key).__name__}")
                _find_json_problem(item, f"{path}[{key!r}]", seen)
        else:
            for index, item in enumerate(value):
                _find_json_problem(item, f"{path}[{index}]", seen)
        seen.discard(id(value))
        return
    raise TypeError(f"{path} is a {type(value).__name__}, which JSON cannot encode")


def check_request_hedge_after(value: object) -> float | None:
    """A per-request hedge delay: ``None`` or finite seconds >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"hedge_after must be seconds (a number) or None, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"hedge_after must be finite seconds >= 0, not {value!r}")
    return float(value)


#: Priority classes run from 0 (the default, the lowest) to this (the highest).
MAX_PRIORITY = 9


def check_priority(value: object, name: str = "priority") -> int:
    """A priority class: an int (not a bool) from 0 to `MAX_PRIORITY`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {value!r}")
    if not 0 <= value <= MAX_PRIORITY:
        raise ValueError(f"{name} must be from 0 to {MAX_PRIORITY}, not {value!r}")
    return value


def check_queued(value: object) -> float | None:
    """Seconds a request waited before its race: ``None`` or finite seconds >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"queued must be seconds (a number) or None, not {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"queued must be finite seconds >= 0, not {value!r}")
    return float(value)


def check_request_headers(headers: object) -> dict[str, str] | None:
    """Per-request extra headers, checked like every header the library sends (values never
    quoted), with lower-case names as the source's own headers: one key per name."""
    if headers is None:
        return None
    check_headers(headers, "headers")
    assert isinstance(headers, Mapping)
    return {name.lower(): value for name, value in headers.items()}
