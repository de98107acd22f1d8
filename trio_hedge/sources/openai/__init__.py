"""The OpenAI-compatible chat-completions source, over httpx.

- :class:`Replica`: one endpoint (URL, model, key, headers); :class:`HeaderNames`: which
  headers carry the request id and attempt number; :class:`OpenAIChatSource`: a replica bound
  to one request (what the race starts attempts from).
- :class:`ChunkDecoder`: response bytes in, :class:`~trio_hedge.events.Delta` s out (SSE
  framing by :class:`SSEDecoder`, then chunk JSON); :func:`merge_tool_calls` assembles tool
  call fragments; :func:`decode_json_body` reads a non-streamed answer.
- :func:`classify_http_error`, :func:`parse_retry_after`: what an HTTP error or an in-band
  error means for the race (an :class:`~trio_hedge.errors.AttemptError` of some
  :class:`~trio_hedge.errors.ErrorKind`, with its ``Retry-After``).

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
