"""What the typed-event APIs (Anthropic Messages, OpenAI Responses) share on the wire: an SSE
stream whose data events are JSON objects with a ``type``, read into
[`Delta`][trio_hedge.events.Delta]s by ``EventDecoder`` (each API's decoder subclasses it and
says what each type means), and a whole JSON answer in place of a stream (``decode_whole``).

The rules both APIs follow (``/work/shared/sse-cases-agent/README.md`` gives real-world cases):

* SSE framing is the chat source's decoder (WHATWG: CR/LF/CRLF, comments, BOM, reads split
  anywhere, bounded memory, strict UTF-8).
* The event type is the data's JSON ``type``; the ``event:`` line (optional: several proxies
  send only ``data:`` lines) is used only when the data has none.
* Every data event but keep-alives becomes one Delta, those without output carrying only
  ``raw`` (block starts and stops, signatures, ``response.created``…), so a relay can forward
  the whole stream and a caller can read block metadata; unknown types and keys are never
  errors.
* An event not ended by a blank line when the body ends is discarded, never parsed (WHATWG):
  the body was cut inside it.
* A stream is complete only at the API's terminal event; a body that ends before it is
  ``STREAM_TRUNCATED`` (``EMPTY_STREAM`` when nothing but keep-alives came).
* An ``error`` event is terminal and raises its classified
  [`AttemptError`][trio_hedge.AttemptError]; deltas read before it in the same read are
  returned first, and the error raised by the next call (nothing already sent is lost).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ..errors import AttemptError, ErrorKind
from ..events import Delta
from .openai._errors import Redact, _in_band_error, _is_error, _no_redact, _Sent, _truncate
from .openai._framing import FramedDecoder
from .openai._json import _loads
from .openai._sse import DEFAULT_MAX_EVENT_SIZE, RawEvent

__all__ = ["EventDecoder", "decode_whole"]

_BOM = b"\xef\xbb\xbf"
_SSE_START = (b"data:", b"data\n", b"data\r", b":", b"event:", b"id:", b"retry:")


class EventDecoder(FramedDecoder):
    """Per-response decoder of a typed-event stream (see the module docstring).

    Args:
        max_event_size: bound on one SSE event (see
            [`SSEDecoder`][trio_hedge.sources.openai.SSEDecoder]).
        redact: masks secrets the server quoted back in an error event (default: none).
        sent: the request's body, whose words an error event may quote back: they never
            make the error the replica's (see
            [`classify_http_error`][trio_hedge.sources.openai.classify_http_error]; default
            empty).

    Attributes:
        done: the terminal event was seen; later bytes are ignored.
        data_events: data events seen so far (non-empty data after stripping; keep-alives,
            ``[DONE]`` and errors count, comments and empty ``data:`` lines do not).
        error: the [`AttemptError`][trio_hedge.AttemptError] raised or to be raised next.
        finish_reason: the last finish (stop) reason seen, or ``None``.
        usage: the usage object as it stands, or ``None``.

    Subclasses set `KEEPALIVE_TYPES`, `TERMINAL` (named in the truncation message) and
    implement ``_typed_event`` (one parsed event to a Delta, or ``None``) and ``_whole`` (a
    whole JSON answer to deltas).
    """

    __slots__ = ("_seen",)

    #: Event types that are keep-alives: counted as data events, never as output or progress.
    KEEPALIVE_TYPES: ClassVar[frozenset[str]] = frozenset()
    #: The terminal event, as the truncation message names it.
    TERMINAL: ClassVar[str] = ""

    def __init__(
        self,
        max_event_size: int = DEFAULT_MAX_EVENT_SIZE,
        *,
        redact: Redact = _no_redact,
        sent: bytes = b"",
    ) -> None:
        super().__init__(max_event_size, redact=redact, sent=sent)
        self._seen = 0  # data events other than keep-alives and [DONE]

    # -- what each API says -------------------------------------------------------------

    def _typed_event(self, kind: str, obj: dict[str, Any], raw: str) -> Delta | None:
        """The Delta of one parsed event of type ``kind`` (``raw``: its JSON text); may set
        ``done``, ``finish_reason`` and ``usage``, or raise the event's error."""
        raise NotImplementedError

    def _complete_at_eof(self) -> bool:
        """Whether a body that ends cleanly now (no cut event) is complete without the
        terminal event (a lenient rule some APIs allow)."""
        return False

    def _whole(self, body: bytes) -> list[Delta]:
        """The deltas of a whole JSON answer under an event-stream content type."""
        raise NotImplementedError

    # -- the stream ---------------------------------------------------------------------

    def _end(self) -> list[Delta]:
        if self.done:
            return []
        if self._mode == 2:
            self.data_events = 1
            deltas = self._whole(bytes(self._json))
            self.done = True
            return deltas
        try:
            cut = bool(self._sse.end_raw())  # an event the body ended inside: discarded
        except AttemptError:
            cut = True  # inside a character of its last line
        if not cut and self._complete_at_eof():
            return []
        if self._seen == 0 and not cut:
            raise AttemptError(ErrorKind.EMPTY_STREAM, "the stream ended without an event")
        raise AttemptError(
            ErrorKind.STREAM_TRUNCATED,
            f"the stream ended before {self.TERMINAL}" + (" (inside an event)" if cut else ""),
        )

    def _event(self, event: RawEvent) -> Delta | None:
        sse_type, text = event[0], event[1].strip()
        if not text:
            return None  # an empty keep-alive: not an event
        self.data_events += 1
        if text == "[DONE]":
            return None  # some relays append it; the API's own terminal event ends a stream
        try:
            obj = _loads(text)
        except ValueError:
            if sse_type == "error":
                raise _in_band_error(text, redact=self._redact, sent=self._sent) from None
            if text[0] == ":":
                return None  # an SSE comment a proxy re-wrapped as data
            raise AttemptError(
                ErrorKind.PROTOCOL,
                f"event data is not JSON: {_truncate(self._redact(text))[:80]!r}",
            ) from None
        if type(obj) is not dict:
            if sse_type == "error" or _is_error(obj):
                raise _in_band_error(obj, redact=self._redact, sent=self._sent)
            return None
        kind = obj.get("type")
        if type(kind) is not str or not kind:
            if obj.get("error"):  # {"error": {...}} with no type: an error whatever the line
                raise _in_band_error(obj, redact=self._redact, sent=self._sent)
            kind = sse_type
        if kind in self.KEEPALIVE_TYPES:
            return None
        self._seen += 1
        return self._typed_event(kind, obj, text)


def decode_whole(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    *,
    redact: Redact,
    sent: bytes = b"",
    stream: Callable[[int], EventDecoder],
    answer: Callable[[dict[str, Any]], list[Delta] | None],
    what: str,
) -> list[Delta]:
    """Decode a whole ``application/json`` answer to a streaming request: an error object
    raises its classified [`AttemptError`][trio_hedge.AttemptError]; ``answer`` reads the API's
    own non-streamed answer (``None``: not one); a body that is really an event stream is
    decoded by ``stream(max_event_size)``.

    Raises:
        AttemptError: the classified error; ``PROTOCOL`` for a body that is not JSON or not
            ``what``; ``EMPTY_STREAM`` for an empty body.
    """
    raw = body.strip()
    if raw.startswith(_BOM):
        raw = raw[3:].lstrip()
    if not raw:
        raise AttemptError(ErrorKind.EMPTY_STREAM, "empty JSON answer", status_code=status)
    if raw.startswith(_SSE_START):
        decoder = stream(max(len(body) + 1, DEFAULT_MAX_EVENT_SIZE))
        return decoder.feed(body) + decoder.end()
    try:
        obj = _loads(raw)
    except ValueError:
        raise AttemptError(
            ErrorKind.PROTOCOL, "JSON answer does not parse", status_code=status
        ) from None
    if _is_error(obj) and not (type(obj) is dict and obj.get("object") == "response"):
        raise _in_band_error(obj, headers, status=status, redact=redact, sent=_Sent(sent))
    deltas = answer(obj) if type(obj) is dict else None
    if deltas is None:
        raise AttemptError(
            ErrorKind.PROTOCOL, f"JSON answer is neither {what} nor an error", status_code=status
        )
    return deltas
