"""Masking secrets in text that came from a server: :class:`Redactor`.

Servers quote credentials back: OpenAI's 401 says "Incorrect API key provided: sk-…",
LiteLLM's proxy says "Received API Key = sk-...1337" (the last four characters), and a
message cut at :data:`trio_hedge.chunks.MAX_MESSAGE_CHARS` may hold any prefix of a key. So
a redactor masks not only whole secrets but *every run of text made of pieces of a secret at
least* :data:`MIN_PIECE` *characters long*, and it runs on the whole message before anything
cuts it (cutting first would leave the part of the key before the cut unmasked).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

__all__ = ["MIN_PIECE", "REDACTED", "Redactor"]

#: Shortest piece of a secret that is masked (characters). Shorter pieces are ordinary text:
#: masking every 3-letter piece of "sk-proj-…" would mask "sk-" everywhere.
MIN_PIECE = 4
#: What a masked run becomes.
REDACTED = "***"


class Redactor:
    """A callable ``text -> text`` that masks every piece of ``secrets`` of at least
    :data:`MIN_PIECE` characters (also in their JSON- and repr-escaped spellings).

    Secrets shorter than :data:`MIN_PIECE` cannot be told from ordinary text and are not
    masked. Building one is cheap (the index is built on the first call, which only happens
    when an error is being reported); calling it is O(len(text)).
    """

    __slots__ = ("_pieces", "_secrets")

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        self._secrets = tuple(s for s in secrets if s and len(s) >= MIN_PIECE)
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
