"""Deprecated: the SSE decoder is `trio_hedge.sources.openai` now (removed in the next
release)."""

from ._deprecated import moved_attributes, warn_moved_module

warn_moved_module(__name__, "trio_hedge.sources.openai")

__getattr__ = moved_attributes(
    __name__,
    dict.fromkeys(
        ("DEFAULT_MAX_EVENT_SIZE", "SSEDecoder", "SSEEvent"), "trio_hedge.sources.openai"
    ),
)
