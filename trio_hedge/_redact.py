"""Masking secrets in text that came from a server: `Redactor`.

Servers quote credentials back: OpenAI's 401 says "Incorrect API key provided: sk-…",
LiteLLM's proxy says "Received API Key = sk-...1337" (the last four characters), and a
message cut at the message limit may hold any prefix of a key. So
a redactor masks not only whole secrets but *every run of text made of pieces of a secret at
least* `MIN_PIECE` *characters long*, and it runs on the whole message before anything
cuts it (cutting first would leave the part of the key before the cut unmasked).

One other library's logs need the same care: hpack (4.x) logs every header it encodes for
HTTP/2 at DEBUG -- ``Adding b'api-key'=b'…' to the header table`` -- except those h2 marks
sensitive (``authorization``, ``proxy-authorization``, short cookies). A key sent in another
header (Azure's ``api-key``, ``x-api-key``) would show in clear. `protect_in_logs`
registers a redactor with a filter on the ``hpack`` loggers that masks its secrets in their
records (the filter runs only for records a DEBUG level lets through: free otherwise).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections.abc import Iterable

__all__ = ["MIN_PIECE", "REDACTED", "Redactor", "protect_in_logs"]

#: Shortest piece of a secret that is masked (characters). Shorter pieces are ordinary text:
#: masking every 3-letter piece of "sk-proj-…" would mask "sk-" everywhere.
MIN_PIECE = 4
#: What a masked run becomes.
REDACTED = "***"


class Redactor:
    """A callable ``text -> text`` that masks every piece of ``secrets`` of at least
    `MIN_PIECE` characters (also in their JSON- and repr-escaped spellings).

    Secrets shorter than `MIN_PIECE` cannot be told from ordinary text and are not
    masked. Building one is cheap (the index is built on the first call, which only happens
    when an error is being reported); calling it is O(len(text)).
    """

    __slots__ = ("__weakref__", "_pieces", "_secrets")

    def __init__(self, secrets: Iterable[object] = ()) -> None:
        # Only strings are secrets here (a non-str key is refused by the caller's validator).
        self._secrets = tuple(s for s in secrets if isinstance(s, str) and len(s) >= MIN_PIECE)
        self._pieces: frozenset[str] | None = None

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def __repr__(self) -> str:
        return f"Redactor({len(self._secrets)} secrets)"

    def _index(self) -> frozenset[str]:
        pieces: set[str] = set()
        for secret in self._secrets:
            for spelling in {secret, json.dumps(secret)[1:-1], repr(secret)[1:-1]}:
                pieces.update(
                    spelling[i : i + MIN_PIECE] for i in range(len(spelling) - MIN_PIECE + 1)
                )
        self._pieces = frozenset(pieces)
        return self._pieces

    def __call__(self, text: str) -> str:
        if not self._secrets or len(text) < MIN_PIECE:
            return text
        pieces = self._pieces if self._pieces is not None else self._index()
        # Mark every character covered by a piece; each maximal marked run becomes REDACTED.
        covered_to = -1
        runs: list[tuple[int, int]] = []
        for i in range(len(text) - MIN_PIECE + 1):
            if text[i : i + MIN_PIECE] in pieces:
                end = i + MIN_PIECE
                if runs and i <= covered_to:
                    runs[-1] = (runs[-1][0], end)
                else:
                    runs.append((i, end))
                covered_to = end
        if not runs:
            return text
        out: list[str] = []
        last = 0
        for start, end in runs:
            out.append(text[last:start])
            out.append(REDACTED)
            last = end
        out.append(text[last:])
        return "".join(out)


# -- other libraries' DEBUG logs ---------------------------------------------------------------

#: Loggers whose records may hold request header values (see the module docstring).
HEADER_LOGGERS = ("hpack.hpack", "hpack.table")

# Weak references to the live redactors, as an immutable tuple: the filter may run in any
# thread while another registers, and reads it without a lock.
_registered: tuple[weakref.ref[Redactor], ...] = ()
_lock = threading.Lock()
_installed = False


def _mask(value: object) -> object:
    if isinstance(value, bytes):
        text = value.decode("latin-1")
        masked = _mask_text(text)
        return value if masked is text else masked.encode("latin-1")
    if isinstance(value, str):
        return _mask_text(value)
    if isinstance(value, tuple):
        items = tuple(_mask(item) for item in value)
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value


def _mask_text(text: str) -> str:
    for ref in _registered:
        redactor = ref()
        if redactor is not None:
            text = redactor(text)
    return text


class _HeaderLogFilter(logging.Filter):
    """Masks registered secrets in a record's message and arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _registered:
            if isinstance(record.args, tuple):
                record.args = tuple(_mask(arg) for arg in record.args)
            if isinstance(record.msg, str):
                record.msg = _mask_text(record.msg)
        return True


def protect_in_logs(redactor: Redactor) -> None:
    """Mask ``redactor``'s secrets in the records of `HEADER_LOGGERS` for as long as
    ``redactor`` lives (weakly referenced)."""
    global _installed, _registered
    if not redactor:
        return
    with _lock:
        if not _installed:
            log_filter = _HeaderLogFilter()
            for name in HEADER_LOGGERS:
                logging.getLogger(name).addFilter(log_filter)
            _installed = True
        live = tuple(ref for ref in _registered if ref() is not None)
        _registered = (*live, weakref.ref(redactor))
