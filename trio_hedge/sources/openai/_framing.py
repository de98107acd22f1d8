"""What every event-stream decoder of the HTTP sources shares (chat completions, Anthropic
Messages, OpenAI Responses): SSE framing over raw bytes, a whole JSON body sniffed in place of
a stream, and an error found behind deltas of the same read deferred to the next call, so the
text before an in-band error is never lost. Each API's decoder says what an event means
(``_event``) and when a body that ends is complete (``_end``)."""

from __future__ import annotations

from typing import Any

from ...errors import AttemptError, ErrorKind
from ...events import Delta
from ._errors import Redact, _no_redact, _Sent
from ._sse import DEFAULT_MAX_EVENT_SIZE, RawEvent, SSEDecoder

__all__ = ["FramedDecoder"]

_BOM = b"\xef\xbb\xbf"


class FramedDecoder:
    """The shared machinery; see the module docstring. Subclasses implement ``_event`` (one
    SSE event to a Delta or ``None``; it may set ``done`` or raise) and ``_end``."""

    __slots__ = (
        "_json",
        "_mode",
        "_redact",
        "_sent",
        "_sse",
        "data_events",
        "done",
        "error",
        "finish_reason",
        "usage",
    )

    def __init__(
        self,
        max_event_size: int = DEFAULT_MAX_EVENT_SIZE,
        *,
        redact: Redact = _no_redact,
        sent: bytes = b"",
    ) -> None:
        self._sse = SSEDecoder(max_event_size)
        self._redact = redact
        # The request's body: its words, quoted back in an error event, never make the
        # error the replica's (``_errors._Sent``).
        self._sent = _Sent(sent)
        self._mode = 0  # 0: undecided (only whitespace so far), 1: SSE, 2: whole JSON body
        self._json = bytearray()
        self.done = False
        self.error: AttemptError | None = None
        self.data_events = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def feed(self, data: bytes) -> list[Delta]:
        """Decode the next bytes of the body; return the Deltas of the events they complete.

        When an error event follows Deltas in the same read, those Deltas are returned and
        the error is raised by the next ``feed`` or ``end`` (it is also in `error` at once):
        the text before an in-band error is never lost.

        Raises:
            AttemptError: an in-band error event (classified), or ``PROTOCOL`` (bad SSE, an
                event that is not JSON, an event over ``max_event_size``).
        """
        if self.error is not None:
            raise self.error
        if self.done:
            return []
        if self._mode != 1:
            data = self._sniff(data)
            if not data:
                return []
        out: list[Delta] = []
        try:
            for event in self._sse.feed_raw(data):
                delta = self._event(event)
                if delta is not None:
                    out.append(delta)
                if self.done:
                    break
            else:
                if self._sse.pending_error is not None:
                    raise self._sse.pending_error
        except AttemptError as exc:
            self.error = exc
            if not out:
                raise
        return out

    def end(self) -> list[Delta]:
        """The body ended: return the last Deltas, or raise if the stream is incomplete.

        Raises:
            AttemptError: ``STREAM_TRUNCATED`` (data came, but the stream is not complete
                by its API's rule: for chat completions neither ``[DONE]`` nor a finish
                reason), ``EMPTY_STREAM`` (no data event), or an error from the last event.
        """
        if self.error is not None:
            raise self.error
        try:
            return self._end()
        except AttemptError as exc:
            self.error = exc
            raise

    def _event(self, event: RawEvent) -> Delta | None:
        raise NotImplementedError

    def _end(self) -> list[Delta]:
        raise NotImplementedError

    def _sniff(self, data: bytes) -> bytes:
        """Until the first significant byte: decide between SSE and a whole JSON body."""
        buf = self._json
        buf += data
        if len(buf) > self._sse.max_event_size:
            raise AttemptError(ErrorKind.PROTOCOL, "answer larger than max_event_size")
        if self._mode == 2:
            return b""
        raw = bytes(buf)
        if len(raw) < 3 and _BOM.startswith(raw):
            return b""  # maybe the start of a BOM
        head = raw[3:] if raw.startswith(_BOM) else raw
        head = head.lstrip(b" \t\r\n")
        if not head:
            return b""  # only blank lines so far: no meaning in either format
        if head[0] in b"{[":
            self._mode = 2
            self._json = bytearray(head)
            return b""
        self._mode = 1
        buf.clear()
        return raw
