"""One HTTP exchange over raw ASGI: request headers in, a response out.

A small raw ASGI layer rather than a framework: the token path is one dict and one ``send``
per event (``docs/gateway.md`` has the measurement behind the choice).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from ._errors import ErrorAnswer
from ._input import clip, duplicated
from ._metrics import AccessRecord

__all__ = ["HOLD_HEAD", "Exchange", "Receive", "Scope", "Send", "request_id_from"]

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = Iterable[tuple[bytes, bytes]]

#: The scope key of an HTTP/1.1 request's ``send_head(send, message)`` (``_server.py``): the
#: response head is written together with the first body bytes sent after it.
HOLD_HEAD = "trio_hedge.hold_head"


def request_id_from(value: str | None) -> str:
    """The client's ``X-Request-ID`` when it is a UUID (in canonical form), else a new
    UUID4: the id goes upstream too, and some servers refuse one that is not a UUID."""
    if value:
        try:
            return str(uuid.UUID(value))
        except ValueError:
            pass
    return str(uuid.uuid4())


class Exchange:
    """The request's scope and channels, its access record, and what was sent so far."""

    __slots__ = (
        "_send_head",
        "duplicate",
        "finished",
        "headers",
        "receive",
        "record",
        "send",
        "started",
    )

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.receive = receive
        self.send = send
        self._send_head: Callable[[Send, dict[str, Any]], Awaitable[None]] | None = scope.get(
            HOLD_HEAD
        )
        raw = scope.get("headers") or []
        # Names are lower-case in ASGI; a repeated header keeps its last value here, and
        # `duplicate` names a header the gateway reads that came twice (the request is refused).
        self.headers: dict[bytes, bytes] = dict(raw)
        self.duplicate = None if len(self.headers) == len(raw) else duplicated(raw)
        client = scope.get("client")
        self.record = AccessRecord(
            request_id=request_id_from(self.header(b"x-request-id")),
            method=clip(scope.get("method", "")),
            path=clip(scope.get("path", "")),
            client=client[0] if client else None,
            started=0.0,
        )
        self.started = False  # the status line was sent
        self.finished = False  # the last body byte was sent

    def header(self, name: bytes) -> str | None:
        """A request header's value, or ``None``."""
        value = self.headers.get(name)
        return None if value is None else value.decode("latin-1")

    async def start(self, status: int, headers: Headers = (), *, with_body: bool = False) -> None:
        """Send the status line and headers (``x-request-id`` added); ``with_body``: in
        one write with the body bytes the caller sends next, at once (where the server
        can: one segment and one wake-up of the client, not two, before the first token)."""
        self.started = True
        self.record.status = status
        message = {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"x-request-id", self.record.request_id.encode()), *headers],
        }
        if with_body and self._send_head is not None:
            await self._send_head(self.send, message)
        else:
            await self.send(message)

    async def body(self, data: bytes, *, more: bool) -> None:
        """Send body bytes; ``more=False`` ends the response."""
        if not more:
            self.finished = True
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def respond(self, status: int, data: bytes, headers: Headers = ()) -> None:
        """A whole response."""
        length = (b"content-length", str(len(data)).encode())
        await self.start(status, [length, *headers], with_body=True)
        await self.body(data, more=False)

    async def json(self, status: int, data: bytes, headers: Headers = ()) -> None:
        """A whole JSON response."""
        await self.respond(status, data, [(b"content-type", b"application/json"), *headers])

    async def error(self, answer: ErrorAnswer, headers: Headers = ()) -> None:
        """An OpenAI-shaped error response (with ``Retry-After`` when the answer has one)."""
        if self.record.error is None:
            self.record.error = answer.code or answer.type
        await self.respond(answer.status, answer.body(), [*answer.headers(), *headers])
