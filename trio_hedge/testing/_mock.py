"""Fake replicas inside the process, over ``httpx.MockTransport``, for exact virtual time.

The response body is an async byte stream that ``trio.sleep``s per the behaviour and yields one
SSE event per chunk, so under ``trio.testing.MockClock(autojump_threshold=0)`` every time is
exact. (``httpx.ASGITransport`` would buffer the whole body: useless for streaming.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import httpx
import trio

from ._behaviour import (
    KEEPALIVE,
    BehaviourSource,
    Chunk,
    Cut,
    Head,
    RequestLog,
    RequestRecord,
    Stall,
    Step,
    Wait,
    render_response,
)

__all__ = ["MockReplicas"]

_DOMAIN = ".test"


def _cut_error(request: httpx.Request, *, body_started: bool) -> httpx.RemoteProtocolError:
    # The messages httpx gives for the same events over a real connection.
    message = (
        "peer closed connection without sending complete message body"
        if body_started
        else "Server disconnected without sending a response."
    )
    return httpx.RemoteProtocolError(message, request=request)


class _MockBody(httpx.AsyncByteStream):
    """The rest of an answer after its headers, one chunk per ``__anext__``.

    A hand-written iterator rather than an async generator: nothing is left for the garbage
    collector to finalise when the client stops early.
    """

    def __init__(self, steps: Sequence[Step], record: RequestRecord, request: httpx.Request):
        self._steps = list(steps)
        self._at = 0
        self._record = record
        self._request = request
        self._keepalive: float | None = None

    def __aiter__(self) -> _MockBody:
        return self

    async def __anext__(self) -> bytes:
        record = self._record
        if record.finished:
            raise StopAsyncIteration
        if self._keepalive is not None:  # stalled, with keep-alives
            await trio.sleep(self._keepalive)
            return KEEPALIVE
        while self._at < len(self._steps):
            step = self._steps[self._at]
            self._at += 1
            if isinstance(step, Wait):
                await trio.sleep(step.seconds)
            elif isinstance(step, Chunk):
                await trio.lowlevel.checkpoint()  # like a network read: let others run
                record.note_sent(step.tokens)
                if self._at == len(self._steps):
                    # All sent: a client that stops after `[DONE]` has not disconnected early.
                    record.note_finished(completed=True)
                return step.data
            elif isinstance(step, Stall):
                if step.keepalive_interval is None:
                    await trio.sleep_forever()
                self._keepalive = step.keepalive_interval
                return await self.__anext__()
            elif isinstance(step, Cut):
                record.note_finished()
                raise _cut_error(self._request, body_started=True)
            else:  # pragma: no cover (a second Head cannot happen)
                raise AssertionError(f"unexpected step {step!r}")
        record.note_finished(completed=True)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        # The client closed the response before the end: that is the disconnect.
        self._record.note_finished(disconnected=True)


class MockReplicas:
    """In-process fake replicas, addressed by host name:

    ```python
    mock = MockReplicas({"primary": Behaviour(ttft=5), "backup": Behaviour(ttft=0.5)})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        ... client.stream("POST", mock.url("primary") + "/chat/completions", ...)
    mock.requests["primary"][0].disconnected_at
    ```

    Routes and answers are those of [`FakeReplica`][trio_hedge.testing.FakeReplica] (the same
    renderer). A replica's ``disconnected_at`` is when the client closed the response (``aclose``)
    before its end, or when the client was cancelled while waiting for the headers. A host that is
    not a replica raises ``httpx.ConnectError``. All times are ``trio.current_time()`` seconds.

    Args:
        behaviours: replica name → [`Behaviour`][trio_hedge.testing.Behaviour] or
            ``(RequestRecord) -> Behaviour``. The URL host is ``<name>.test`` (a bare ``<name>``
            works too).
        model: the model name listed by ``/v1/models``.
    """

    def __init__(self, behaviours: Mapping[str, BehaviourSource], *, model: str = "fake-model"):
        #: Replica name → behaviour; may be changed between requests.
        self.behaviours: dict[str, BehaviourSource] = dict(behaviours)
        self.model = model
        self._logs = {name: RequestLog(name) for name in self.behaviours}
        #: The transport to give to ``httpx.AsyncClient(transport=...)``.
        self.transport = httpx.MockTransport(self._handle)

    def url(self, name: str) -> str:
        """The OpenAI base URL of replica ``name``: ``"http://<name>.test/v1"``."""
        if name not in self.behaviours:
            raise KeyError(name)
        return f"http://{name}{_DOMAIN}/v1"

    @property
    def requests(self) -> dict[str, list[RequestRecord]]:
        """Replica name → its requests in arrival order."""
        return {name: log.records for name, log in self._logs.items()}

    async def wait_request(self, name: str, index: int) -> RequestRecord:
        """Wait until request ``index`` to replica ``name`` has arrived."""
        return await self._logs[name].wait_request(index)

    async def wait_finished(self, name: str, index: int) -> RequestRecord:
        """Wait until replica ``name`` is done with request ``index``."""
        return await self._logs[name].wait_finished(index)

    async def wait_disconnected(self, name: str, index: int) -> RequestRecord:
        """Wait until request ``index`` to ``name`` ends by a client disconnect;
        ``AssertionError`` if it ends otherwise."""
        return await self._logs[name].wait_disconnected(index)

    def _name_for(self, request: httpx.Request) -> str:
        host = request.url.host
        name = host.removesuffix(_DOMAIN)
        if name not in self.behaviours:
            raise httpx.ConnectError(f"no fake replica at {host!r}", request=request)
        return name

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        name = self._name_for(request)
        path = request.url.raw_path.decode("ascii")
        record = self._logs[name].new(
            method=request.method,
            path=path,
            headers={k.lower(): v for k, v in request.headers.items()},
            body=request.content,
            http_version="1.1",
        )
        steps = render_response(record, self.behaviours[name], model=self.model)
        # Carry out the steps before the headers here; the rest goes to the body stream.
        try:
            for at, step in enumerate(steps):
                if isinstance(step, Wait):
                    await trio.sleep(step.seconds)
                elif isinstance(step, Head):
                    record.status = step.status
                    body = _MockBody(steps[at + 1 :], record, request)
                    return httpx.Response(step.status, headers=list(step.headers), stream=body)
                elif isinstance(step, Stall):
                    await trio.sleep_forever()
                elif isinstance(step, Cut):
                    record.note_finished()
                    raise _cut_error(request, body_started=False)
            raise AssertionError("an answer without headers")  # pragma: no cover
        except trio.Cancelled:
            record.note_finished(disconnected=True)  # the client gave up waiting
            raise
