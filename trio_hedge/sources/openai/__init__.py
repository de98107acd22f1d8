"""The OpenAI-compatible chat-completions source, over httpx.

- [`Replica`][trio_hedge.sources.Replica]: one endpoint (URL, model, key, headers);
  [`HeaderNames`][trio_hedge.sources.HeaderNames]: which headers carry the request id and attempt
  number; [`OpenAIChatSource`][trio_hedge.sources.OpenAIChatSource]: a replica bound to one request
  (what the race starts attempts from).
- [`ChunkDecoder`][trio_hedge.sources.openai.ChunkDecoder]: response bytes in,
  [`Delta`][trio_hedge.events.Delta]s out (SSE framing by
  [`SSEDecoder`][trio_hedge.sources.openai.SSEDecoder], then chunk JSON);
  [`merge_tool_calls`][trio_hedge.sources.openai.merge_tool_calls] assembles tool call fragments;
  [`decode_json_body`][trio_hedge.sources.openai.decode_json_body] reads a non-streamed answer.
- [`classify_http_error`][trio_hedge.sources.openai.classify_http_error],
  [`parse_retry_after`][trio_hedge.sources.openai.parse_retry_after]: what an HTTP error or an
  in-band error means for the race (an [`AttemptError`][trio_hedge.AttemptError] of some
  [`ErrorKind`][trio_hedge.errors.ErrorKind], with its ``Retry-After``).

Inside, one job per module: ``_http`` (requests and responses), ``_codec`` (chunk JSON to
deltas), ``_sse`` (SSE framing), ``_errors`` (error classification), ``_json`` (the JSON
parser both use).
"""

from ._codec import ChunkDecoder, decode_json_body, merge_tool_calls
from ._errors import classify_http_error, parse_retry_after
from ._http import HeaderNames, OpenAIChatSource, Replica
from ._sse import DEFAULT_MAX_EVENT_SIZE, SSEDecoder, SSEEvent

__all__ = [
    "DEFAULT_MAX_EVENT_SIZE",
    "ChunkDecoder",
    "HeaderNames",
    "OpenAIChatSource",
    "Replica",
    "SSEDecoder",
    "SSEEvent",
    "classify_http_error",
    "decode_json_body",
    "merge_tool_calls",
    "parse_retry_after",
]
