"""Deprecated: the HTTP source is `trio_hedge.sources.openai` now, its SSL context
[`trio_hedge.transport.shared_ssl_context`][trio_hedge.transport.shared_ssl_context] (removed in the
next release)."""

from .._deprecated import moved_attributes, warn_moved_module

warn_moved_module(__name__, "trio_hedge.sources.openai")

__getattr__ = moved_attributes(
    __name__,
    {
        **dict.fromkeys(
            ("HeaderNames", "OpenAIChatSource", "Replica"), "trio_hedge.sources.openai"
        ),
        "shared_ssl_context": "trio_hedge.transport",
    },
)
