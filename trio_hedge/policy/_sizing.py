"""How big a request's prompt is, in tokens: given by the caller, or estimated; and which
log-spaced size class that puts it in (``SizeClasses``, the classes the delay is learned in).

The estimate is deliberately crude (about 4 characters of text per token, the usual rule of
thumb for English with BPE tokenizers, plus a few tokens of framing per message): it only has
to put a prompt in the right *log-spaced* size class, where a factor of 1.5 rarely matters.
Pass ``prompt_tokens`` to [`trio_hedge.Hedger.stream`][trio_hedge.Hedger.stream] when you know
better.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from .._validate import integer, number

__all__ = ["SizeClasses", "estimate_prompt_tokens"]

#: Tokens of framing per chat message (role markers, separators).
MESSAGE_OVERHEAD = 4


def _text_chars(value: Any) -> int:
    """Characters of text in a message's content: a string, or a list of parts (only the
    ``text`` parts count; images and audio are not estimated). Lists and tuples alike: the
    openai SDK's ``create()`` arguments may hold either."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        total = 0
        for part in value:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    total += len(text)
        return total
    return 0


def estimate_prompt_tokens(
    request: Mapping[str, Any] | None, *, chars_per_token: float = 4.0
) -> int:
    """Estimate a chat request's prompt size in tokens.

    Counts the text of every message in ``request["messages"]`` (string contents and the
    ``text`` of content parts), of ``request["prompt"]`` (completions API) and of tool
    definitions (as JSON-ish text length), divides by ``chars_per_token`` and adds
    `MESSAGE_OVERHEAD` tokens per message.

    Args:
        request: the JSON body, or ``chat.completions.create()``'s keyword arguments (the
            same fields; sequences may be tuples), or ``None`` (then 0).
        chars_per_token: characters per token; default 4.0.

    Returns:
        the estimate, a non-negative int.

    Raises:
        ValueError: ``chars_per_token`` is not positive.
    """
    if not chars_per_token > 0:
        raise ValueError(f"chars_per_token must be > 0, not {chars_per_token!r}")
    if request is None:
        return 0
    chars = 0
    messages = request.get("messages")
    count = 0
    if isinstance(messages, (list, tuple)):
        for message in messages:
            if isinstance(message, Mapping):
                count += 1
                chars += _text_chars(message.get("content"))
    chars += _text_chars(request.get("prompt"))
    tools = request.get("tools")
    if isinstance(tools, (list, tuple)):
        chars += len(repr(tools))
    return math.ceil(chars / chars_per_token) + MESSAGE_OVERHEAD * count


@attrs.frozen
class SizeClasses:
    """Log-spaced classes of prompt size (estimated prompt tokens).

    Class 0 holds prompts below ``first`` tokens; class ``k ≥ 1`` holds
    ``[first·base^(k−1), first·base^k)``; the last class (``count − 1``) holds everything
    above. With the defaults: < 256, 256–511, 512–1023, …, ≥ 131,072 tokens.

    Attributes:
        first: the upper bound of class 0, in tokens. Default 256.
        base: the ratio between successive class bounds (> 1). Default 2.0.
        count: how many classes (bounds memory). Default 11.

    Raises:
        TypeError, ValueError: on a bad field.
    """

    first: int = attrs.field(default=256, validator=integer(1))
    base: float = attrs.field(default=2.0, validator=number(1.0, open_lo=True))
    count: int = attrs.field(default=11, validator=integer(1))

    def of(self, tokens: int) -> int:
        """The class of a prompt of ``tokens`` tokens."""
        if tokens < self.first:
            return 0
        k = int(math.log(tokens / self.first) / math.log(self.base) + 1e-9) + 1
        return min(k, self.count - 1)

    def bounds(self, index: int) -> tuple[int, int | None]:
        """``(low, high)`` token bounds of class ``index`` (``high`` exclusive, ``None`` for
        the open last class)."""
        low = 0 if index == 0 else math.ceil(self.first * self.base ** (index - 1))
        high = None if index >= self.count - 1 else math.ceil(self.first * self.base**index)
        return low, high
