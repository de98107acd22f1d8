"""An incremental Server-Sent Events decoder over raw bytes (no I/O).

It follows the WHATWG HTML Living Standard, section 9.2 "Server-sent events", subsection
"Parsing an event stream" and "Interpreting an event stream"
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):

* lines end at CR, LF or CRLF only -- never at U+2028, U+2029, U+0085 or the other separators
  ``str.splitlines`` knows, which may appear raw inside JSON strings; a CR ending one read and
  an LF starting the next are *one* line end;
* a leading U+FEFF BOM is ignored (once, at the start of the stream);
* a line starting with ``:`` is a comment; ``field:value`` loses exactly one space after the
  colon; a line without a colon is a field with an empty value;
* ``data`` lines are joined with ``"\\n"``; ``event`` sets the type (default ``"message"``);
  ``id`` sets the last event ID unless it contains U+0000; ``retry`` is used only if all ASCII
  digits; other fields are ignored;
* an event is dispatched at a blank line, and only if at least one ``data`` line was seen (so
  ``retry:``/``id:``-only blocks and comment-only blocks dispatch nothing, while ``data:`` with
  an empty value dispatches an event whose data is ``""``).

Choices this module makes where the standard leaves room or where we deviate on purpose:

* **An** ``error:`` **line is an error event**: ``error: {…}`` is read as ``event: error``
  with that data. The standard ignores unknown fields, but llama.cpp's server sent its
  errors so until September 2025 (ggml-org/llama.cpp#16104, fixed by #16109), followed by
  ``data: [DONE]``: ignoring it turns "the request exceeds the available context size"
  into an empty, successful answer.

* **Invalid UTF-8 raises** ``AttemptError(ErrorKind.PROTOCOL)`` (the standard decodes with
  U+FFFD replacement). A server that sends invalid UTF-8 is broken; before the first token
  another replica may be sane, after it the caller learns the text would have been corrupt.
  Decoding is per complete line over the raw bytes: CR and LF never occur inside a UTF-8
  multi-byte sequence, so a read boundary inside a character changes nothing.
* **End of stream flushes**: the standard discards an event not yet ended by a blank line. We
  dispatch it from [`SSEDecoder.end`][trio_hedge.sources.openai.SSEDecoder.end] (an unterminated
  last line counts as a line) because real servers end with ``data: [DONE]`` and no blank line; the
  caller decides what an incomplete last event means (the chunk codec treats one that does not parse
  as a truncated stream).
* **Bounded memory**: an event's data plus an unfinished line may not exceed
  ``max_event_size`` (counted in characters of complete lines plus bytes of the unfinished
  one, so never more than ~4x that many bytes of memory); beyond it the decoder raises
  ``AttemptError(ErrorKind.PROTOCOL)``.

Why not httpx-sse (0.4.3), which the issue asked to consider first: fed through its own
``SSELineDecoder`` + ``SSEDecoder`` (as ``aiter_sse`` does), it fails at every chunking:

* SSE-09 (``retry: 3000\\n\\nid: 7\\n\\n`` before the first data): it dispatches
  ``ServerSentEvent(retry=3000)`` and ``ServerSentEvent(id="7")`` with empty data; WHATWG
  dispatches nothing when the data buffer is empty. Worse, once an ``id`` was seen, every
  later blank line (e.g. after each ``: ping`` comment) dispatches another empty event.
* CR-only framing: ``feed(b"data: x\\r\\r")`` gives nothing until the *next* read arrives
  (it holds the trailing CR back), so a whole event is dispatched one read late -- a
  first-token latency bug for hedging.
* A leading BOM: ``aiter_text`` decodes with plain ``utf-8``, the first line becomes
  ``"\\ufeffdata: ..."`` and the first event is lost.
* No size limit: a line without a terminator is buffered without bound.

It is also slower (CPU per event, Python 3.11, 216-byte chunk events, best of 5): one event
per read 1.36 µs vs 0.61 µs for
[`SSEDecoder.feed_raw`][trio_hedge.sources.openai.SSEDecoder.feed_raw] (1.21 µs for
[`feed`][trio_hedge.sources.openai.SSEDecoder.feed], which builds ``SSEEvent`` objects); 250 events
per read 0.81 µs vs 0.36 µs.
"""

from __future__ import annotations

import attrs

from ...errors import AttemptError, ErrorKind

__all__ = ["DEFAULT_MAX_EVENT_SIZE", "SSEDecoder", "SSEEvent"]

DEFAULT_MAX_EVENT_SIZE = 1_048_576
"""Default bound on one event (its data plus an unfinished line): 1 MiB."""

_BOM = b"\xef\xbb\xbf"


@attrs.frozen(slots=True)
class SSEEvent:
    """One dispatched server-sent event.

    Attributes:
        event: the event type (``"message"`` when the block had no ``event:`` field).
        data: the ``data`` lines joined with ``"\\n"`` (may be ``""``).
        id: the stream's last event ID when the event was dispatched (it persists across
            events, as the standard says), or ``None`` if no ``id:`` field was seen yet.
        retry: the reconnection time in milliseconds last set by a ``retry:`` field of the
            stream, or ``None`` if none was seen yet.
    """

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


# The raw form the hot path passes around: (event type, data, last event id, retry).
RawEvent = tuple[str, str, str | None, int | None]


def _protocol(message: str) -> AttemptError:
    return AttemptError(ErrorKind.PROTOCOL, message)


class SSEDecoder:
    """Incremental SSE decoder: feed it the response body's bytes as they arrive.

    Args:
        max_event_size: bound on one event's data plus any unfinished line (characters /
            bytes, see the module docstring); exceeding it raises
            ``AttemptError(ErrorKind.PROTOCOL)``.

    After it raised an [`AttemptError`][trio_hedge.AttemptError] the decoder is broken: later calls
    raise again. When invalid UTF-8 follows complete events in one read, those events are returned
    and the error is kept in `pending_error` and raised by the next call.
    """

    __slots__ = (
        "_buf",
        "_cr",
        "_data",
        "_event",
        "_size",
        "_start",
        "last_event_id",
        "max_event_size",
        "pending_error",
        "retry",
    )

    def __init__(self, max_event_size: int = DEFAULT_MAX_EVENT_SIZE) -> None:
        if max_event_size < 1:
            raise ValueError("max_event_size must be positive")
        self.max_event_size = max_event_size
        #: the last event ID buffer (``None`` until an ``id:`` field).
        self.last_event_id: str | None = None
        #: the reconnection time in ms from the last valid ``retry:`` field, or ``None``.
        self.retry: int | None = None
        #: an error found after the events the last call returned; the next call raises it.
        self.pending_error: AttemptError | None = None
        self._buf = bytearray()  # bytes of an unfinished line (or of a possible BOM)
        self._cr = False  # the last read ended with CR: an LF starting the next is skipped
        self._start = True  # still deciding about a leading BOM
        self._data: list[str] = []  # data lines of the event being built
        self._event = ""  # event type buffer
        self._size = 0  # characters in _data (plus one per line)

    # -- public API ---------------------------------------------------------------------

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Decode the next bytes of the stream; return the events they complete.

        Raises:
            AttemptError: ``PROTOCOL`` for invalid UTF-8 or an event larger than
                ``max_event_size``.
        """
        return [SSEEvent(d, t, i, r) for t, d, i, r in self.feed_raw(data)]

    def end(self) -> list[SSEEvent]:
        """The stream ended: dispatch what is pending (see "End of stream flushes").

        Raises:
            AttemptError: ``PROTOCOL`` if the unfinished last line is invalid UTF-8 (e.g. the
                stream was cut inside a character).
        """
        return [SSEEvent(d, t, i, r) for t, d, i, r in self.end_raw()]

    # -- hot path -------------------------------------------------------------------------

    def feed_raw(self, data: bytes) -> list[RawEvent]:
        """Like [`feed`][trio_hedge.sources.openai.SSEDecoder.feed], returning
        ``(event, data, id, retry)`` tuples (no objects: this is the per-token hot path of
        [`ChunkDecoder`][trio_hedge.sources.openai.ChunkDecoder])."""
        if self.pending_error is not None:
            raise self.pending_error
        if self._cr or self._start or self._buf:
            data = self._prepare(data)
            if not data:
                return []
        elif (
            # Fast path: one whole ``data: ...`` event per read, as LLM servers flush them.
            data.endswith(b"\n\n")
            and data.startswith(b"data: ")
            and data.find(b"\n") == len(data) - 2
            and not self._data
            and b"\r" not in data
        ):
            if len(data) - 8 > self.max_event_size:
                raise _protocol(f"event larger than max_event_size={self.max_event_size}")
            try:
                value = data[6:-2].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _protocol(f"invalid UTF-8 in event stream: {exc.reason}") from None
            event = (self._event or "message", value, self.last_event_id, self.retry)
            self._event = ""
            return [event]
        elif data.startswith(b"event: ") and data.endswith(b"\n\n") and not self._data:
            # Fast path of the typed-event APIs (Anthropic Messages, OpenAI Responses): one
            # whole ``event: …`` + ``data: …`` event per read.
            line = data.find(b"\n")
            if (
                data.startswith(b"data: ", line + 1)
                and data.find(b"\n", line + 1) == len(data) - 2
                and b"\r" not in data
            ):
                if len(data) - line - 9 > self.max_event_size:
                    raise _protocol(f"event larger than max_event_size={self.max_event_size}")
                try:
                    name = data[7:line].decode("utf-8")
                    value = data[line + 7 : -2].decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise _protocol(f"invalid UTF-8 in event stream: {exc.reason}") from None
                self._event = ""
                return [(name or "message", value, self.last_event_id, self.retry)]
        # Normalise line ends. A final CR ends its line now (dispatch must not wait for the
        # next read); remember it so an LF starting the next read is not a second line end.
        if b"\r" in data:
            self._cr = data[-1] == 13
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        cut = data.rfind(b"\n")
        if cut < 0:
            self._buf += data
            self._check_size()
            return []
        if cut + 1 < len(data):
            self._buf += data[cut + 1 :]
            self._check_size()
        try:
            text = data[:cut].decode("utf-8")
        except UnicodeDecodeError as exc:
            # Deliver the lines before the bad one (the caller may be done by then, e.g. at
            # ``[DONE]``); the error is raised now if there are none, else by the next call.
            error = _protocol(f"invalid UTF-8 in event stream: {exc.reason}")
            good = data.rfind(b"\n", 0, exc.start)
            events = self._lines(data[:good].decode("utf-8").split("\n")) if good >= 0 else []
            self._buf.clear()
            self.pending_error = error
            if not events:
                raise error from None
            return events
        return self._lines(text.split("\n"))

    def end_raw(self) -> list[RawEvent]:
        """Like [`end`][trio_hedge.sources.openai.SSEDecoder.end], returning raw tuples."""
        if self.pending_error is not None:
            raise self.pending_error
        out: list[RawEvent] = []
        if self._buf:
            rest = bytes(self._buf)
            self._buf.clear()
            if self._start and _BOM.startswith(rest):
                rest = b""
            self._start = False
            if rest:
                try:
                    line = rest.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise _protocol(f"invalid UTF-8 at end of stream: {exc.reason}") from None
                out = self._lines([line])
        if self._data:
            out.extend(self._lines([""]))
        return out

    # -- internals ------------------------------------------------------------------------

    def _prepare(self, data: bytes) -> bytes:
        """The slow path: skip the LF of a split CRLF, strip a BOM, join an unfinished line."""
        if self._cr and data:
            self._cr = False
            if data[0] == 10:
                data = data[1:]
        if self._start:
            data = bytes(self._buf) + data
            self._buf.clear()
            if len(data) < 3 and _BOM.startswith(data):
                self._buf += data  # maybe the start of a BOM: wait for more bytes
                return b""
            self._start = False
            if data.startswith(_BOM):
                data = data[3:]
            return data
        if self._buf:
            if b"\n" not in data and b"\r" not in data:
                # Still no line end: append in place (amortised O(1), so a long line fed in
                # many small reads costs O(n), not O(n^2)).
                self._buf += data
                self._check_size()
                return b""
            data = bytes(self._buf) + data
            self._buf.clear()
        return data

    def _check_size(self) -> None:
        if len(self._buf) + self._size > self.max_event_size:
            raise _protocol(f"event larger than max_event_size={self.max_event_size}")

    def _lines(self, lines: list[str]) -> list[RawEvent]:
        out: list[RawEvent] = []
        data = self._data
        for line in lines:
            if not line:
                # Blank line: dispatch if the data buffer is non-empty, then reset.
                if data:
                    out.append(
                        (self._event or "message", "\n".join(data), self.last_event_id, self.retry)
                    )
                    data.clear()
                    self._size = 0
                self._event = ""
                continue
            if line.startswith("data:"):
                value = line[6:] if line.startswith(" ", 5) else line[5:]
            elif line[0] == ":":
                continue  # comment (keep-alives such as ": OPENROUTER PROCESSING")
            else:
                name, colon, value = line.partition(":")
                if colon and value.startswith(" "):
                    value = value[1:]
                if name == "event":
                    self._event = value
                    continue
                if name == "id":
                    if "\0" not in value:
                        self.last_event_id = value
                    continue
                if name == "retry":
                    if value.isascii() and value.isdigit():
                        self.retry = int(value)
                    continue
                if name == "error":
                    # Not an SSE field: llama.cpp's server before ggml-org/llama.cpp#16109
                    # (2025-09) sent its errors so, then ``data: [DONE]``. Ignored, as the
                    # standard says, a context-length error became an empty answer.
                    self._event = "error"
                elif name != "data":
                    continue  # unknown field: ignored
            data.append(value)
            self._size += len(value) + 1
            if self._size + len(self._buf) > self.max_event_size:
                raise _protocol(f"event larger than max_event_size={self.max_event_size}")
        return out
