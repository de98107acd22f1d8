"""Deprecated: the chunk codec is `trio_hedge.sources.openai` now (removed in the next
release)."""

from ._deprecated import moved_attributes, warn_moved_module

warn_moved_module(__name__, "trio_hedge.sources.openai")

__getattr__ = moved_attributes(
    __name__,
    dict.fromkeys(
        (
            "ChunkDecoder",
            "classify_http_error",
            "decode_json_body",
            "merge_tool_calls",
            "parse_retry_after",
        ),
        "trio_hedge.sources.openai",
    ),
)
