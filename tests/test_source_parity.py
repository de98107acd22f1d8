"""The two OpenAI sources agree: the HTTP source (``Replica`` over httpx) and the openai-SDK
source (``OpenAISDKSource`` over an ``AsyncOpenAI`` client) make the same deltas, the same
errors (kind, retryability, ``Retry-After``, status) and the same outcome (a failover, a
``FatalAttemptError``, a ``StreamInterrupted``) of every shared real-world case
(``../shared/sse-cases``) and every fault of the fault matrix (``tests/test_faults.py``),
each served to both by the same loopback server.

Both read a response with one reader (``sources/openai/_http.attempt_for``, ``HTTPAttempt``):
before it, the SDK source iterated the SDK's own stream, and a relay's empty keep-alive
``data:`` line, vLLM's ``{"object":"error",...}`` event and a server that ignores
``stream: true`` each ended the request with ``FatalAttemptError`` (``unknown``) or an
``empty_stream`` where the HTTP source relayed the answer or failed over.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")

import trio_hedge as th  # noqa: E402
from trio_hedge.sources.openai_sdk import OpenAISDKSource, SDKChunkDelta  # noqa: E402

from . import misbehaving as mb  # noqa: E402
from .test_chunks import CASES, needs_cases  # noqa: E402
from .test_faults import FAULTS, Fault, serve  # noqa: E402

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
#: Ends the faults that never send a token (both sources time out alike); long enough that
#: an answer on a loaded machine still arrives (0.25 s timed out answers under CI load).
FIRST_TOKEN_TIMEOUT = 1.0


def _case_script(case: dict[str, Any]) -> mb.Script:
    """Serve a shared case: its status and headers, then its body in its transport pieces."""
    body = case["body"].encode("utf-8")
    cuts = [*(case.get("chunk_boundaries") or []), len(body)]
    head = f"HTTP/1.1 {case['status']} Case\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in case["headers"].items()
    )
    head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"

    async def script(conn: mb.ServerConn) -> None:
        await conn.send(head.encode("latin-1"))
        start = 0
        for cut in cuts:
            if cut > start:
                await conn.send(body[start:cut])
                start = cut
                await trio.testing.wait_all_tasks_blocked()  # the client reads each piece
        await conn.close()

    return script


def _summary(stream: th.HedgedStream, error: BaseException | None, events: list[Any]) -> Any:
    """What a caller can see of one request: the events, the error raised, each attempt."""
    report = stream.report
    return {
        "raised": type(error).__name__ if error is not None else None,
        "events": [
            (e.content, e.reasoning, e.tool_calls, e.finish_reason, e.usage, e.role) for e in events
        ],
        "attempts": [
            (
                a.outcome.value,
                None if a.error is None else a.error.kind.value,
                None if a.error is None else a.error.retryable,
                None if a.error is None else a.error.retry_after,
                None if a.error is None else a.error.status_code,
            )
            for a in report.attempts
        ],
        "text": report.text,
        "winner": report.winner,
    }


async def _run(source: Any, client: httpx.AsyncClient | None) -> tuple[Any, list[Any]]:
    policy = th.HedgePolicy(hedge_after=None, first_token_timeout=FIRST_TOKEN_TIMEOUT)
    stream = th.hedged_stream(
        REQUEST if client is not None else None, [source], policy, client=client
    )
    events: list[Any] = []
    error: BaseException | None = None
    try:
        async with stream:
            async for event in stream.events():
                events.append(event)
    except th.HedgeError as exc:
        error = exc
    return _summary(stream, error, events), events


@contextlib.asynccontextmanager
async def _sdk_client(url: str, *, http2: bool) -> AsyncIterator[Any]:
    http_client = httpx2.AsyncClient(http1=not http2, http2=http2)
    async with openai.AsyncOpenAI(
        base_url=url, api_key="sk-parity", max_retries=0, http_client=http_client
    ) as client:
        yield client


async def _both(url: str, *, http2: bool = False) -> tuple[Any, Any, list[Any]]:
    """(the HTTP source's summary, the SDK source's, the SDK source's events)."""
    http = th.transport.make_client(http1=not http2, http2=http2)
    async with http:
        by_http, _ = await _run(th.Replica(url, name="r"), http)
    async with _sdk_client(url, http2=http2) as client:
        by_sdk, events = await _run(OpenAISDKSource(client, REQUEST, name="r"), None)
    return by_http, by_sdk, events


@needs_cases
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
async def test_both_sources_agree_on_a_shared_case(case: dict[str, Any]) -> None:
    async with mb.RawServer(_case_script(case), name=case["id"]) as server:
        by_http, by_sdk, events = await _both(server.url)
    assert by_sdk == by_http
    assert len(server.connections) == 2  # one request each, the same bytes served
    # The SDK source's events carry the SDK's own chunk objects, whatever the server's shape.
    assert all(isinstance(e, SDKChunkDelta) and e.chunk is not None for e in events)
    assert all(type(e.chunk).__name__ == "ChatCompletionChunk" for e in events)


@pytest.mark.parametrize("case", FAULTS, ids=[f.name for f in FAULTS])
async def test_both_sources_agree_on_a_fault(case: Fault) -> None:
    async with serve(case.primary) as server:
        by_http, by_sdk, _ = await _both(server.url, http2=case.primary.http2)
    assert by_sdk == by_http
