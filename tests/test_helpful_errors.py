"""Misconfigured replicas fail with an error that says what is wrong, over real sockets:
a base URL without ``/v1`` (a bare 404), an ``https://`` URL on a plain-HTTP port (an
opaque TLS error), a web page where an event stream was expected (an "empty stream")."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import trio

import trio_hedge as th
from trio_hedge.errors import ErrorKind
from trio_hedge.testing import Behaviour, FakeReplica

from .threaded import raw_server

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
POLICY = th.HedgePolicy(hedge_after=None)


async def _error(replica: th.Replica) -> th.AttemptError:
    stream = th.hedged_stream(REQUEST, [replica], POLICY)
    with pytest.raises(th.RequestFailed) as caught:
        async with stream:
            pass
    (error,) = caught.value.errors
    assert stream.report.attempts[0].error is error
    return error


async def test_a_base_url_without_v1_names_the_url_it_called() -> None:
    async with FakeReplica(Behaviour()) as server:
        base = server.base_url
        error = await _error(th.Replica(base))  # forgot the /v1
    assert error.kind is ErrorKind.NOT_FOUND
    assert error.retryable and error.replica_fault
    assert f"POST {base}/chat/completions" in error.message
    assert "/v1" in error.message


async def test_the_summary_line_carries_the_hint() -> None:
    # The last line of a traceback is what a newcomer reads: it said only "not_found (HTTP 404)
    # at 127.0.0.1:PORT", the hint was in .errors[0].
    async with FakeReplica(Behaviour()) as server:
        host = server.base_url.removeprefix("http://")
        stream = th.hedged_stream(REQUEST, [th.Replica(server.base_url)], POLICY)
        with pytest.raises(th.AllAttemptsFailed) as caught:
            async with stream:
                pass
    assert str(caught.value) == (
        f"the only attempt failed: not_found (HTTP 404) at {host}: base_url usually ends in /v1"
    )
    (error,) = caught.value.errors
    assert error.hint == "base_url usually ends in /v1"
    assert "usually ends in" not in str(error)  # the message says it its own way, once


async def test_an_error_without_a_hint_reads_as_before() -> None:
    async with FakeReplica(Behaviour(status=503)) as server:
        host = server.base_url.removeprefix("http://")
        with pytest.raises(th.AllAttemptsFailed) as caught:
            async with th.hedged_stream(REQUEST, [th.Replica(server.url)], POLICY):
                pass
    assert str(caught.value) == f"the only attempt failed: overloaded (HTTP 503) at {host}"


async def test_a_bare_404_names_the_url_it_called() -> None:
    body = json.dumps({"detail": "Not Found"}).encode()  # FastAPI's default 404
    async with raw_server(404, [("content-type", "application/json")], body) as url:
        base = url.removesuffix("/v1")
        error = await _error(th.Replica(base, path="/chat/completions"))
    assert error.kind is ErrorKind.NOT_FOUND
    assert error.message.startswith("Not Found (POST ")
    assert f"{base}/chat/completions" in error.message


@contextlib.asynccontextmanager
async def _hangs_up() -> AsyncIterator[str]:
    async with FakeReplica(Behaviour()) as server:  # h11 drops a ClientHello: EOF
        yield server.url


def _answers_400() -> contextlib.AbstractAsyncContextManager[str]:
    # What uvicorn, llama.cpp's httplib and nginx do: "HTTP/1.1 400" to the ClientHello.
    return raw_server(400, [("content-type", "text/plain")], b"Bad Request", at_once=True)


@pytest.mark.parametrize("server", [_hangs_up, _answers_400], ids=["hangs-up", "answers-400"])
async def test_https_on_a_plain_http_port_says_so(
    server: Callable[[], contextlib.AbstractAsyncContextManager[str]],
) -> None:
    async with server() as plain:
        url = plain.replace("http://", "https://")
        error = await _error(th.Replica(url))
    assert error.kind is ErrorKind.PROTOCOL  # the replica's misconfiguration: try the next
    assert error.retryable
    assert "plain-HTTP" in error.message
    assert f"POST {url}/chat/completions" in error.message
    assert "http://" in error.message


async def test_a_web_page_where_an_event_stream_was_expected_says_so() -> None:
    page = b"<!doctype html><html><head><title>Sign in</title></head><body></body></html>"
    async with raw_server(200, [("content-type", "text/html; charset=utf-8")], page) as url:
        error = await _error(th.Replica(url))
    assert error.kind is ErrorKind.PROTOCOL
    assert error.status_code == 200
    assert "text/html" in error.message
    assert f"POST {url}/chat/completions" in error.message


async def test_plain_http_on_a_tls_port_says_so() -> None:
    # nginx's answer to http:// on its TLS port: a 400 page. The URL is wrong, not the request.
    page = (
        b"<html><head><title>400 The plain HTTP request was sent to HTTPS port</title></head>"
        b"<body><center><h1>400 Bad Request</h1></center><center>The plain HTTP request was "
        b"sent to HTTPS port</center><hr><center>nginx</center></body></html>"
    )
    async with raw_server(400, [("content-type", "text/html")], page) as url:
        error = await _error(th.Replica(url))
    assert error.kind is ErrorKind.PROTOCOL
    assert error.retryable  # not fatal: another replica may be configured right
    assert "https://" in error.message
    assert f"POST {url}/chat/completions" in error.message


# -- the Trio API called from asyncio code ----------------------------------------------------


def _run_in_stock_asyncio(coro: Coroutine[Any, Any, None]) -> None:
    # A plain SelectorEventLoop: another test's trio_asyncio import may have installed its
    # loop policy, which asyncio.run would pick up.
    loop = asyncio.SelectorEventLoop()
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()


def test_the_trio_api_from_asyncio_points_to_trio_hedge_aio() -> None:
    # What an asyncio user writes first: Trio's own error was "must be called from async
    # context", with no word of the cause or of trio_hedge.aio.
    async def main() -> None:
        async with th.hedged_stream(REQUEST, [th.Replica("http://127.0.0.1:9/v1")], POLICY):
            pass

    with pytest.raises(RuntimeError) as caught:
        _run_in_stock_asyncio(main())
    message = str(caught.value)
    assert "asyncio code" in message
    assert "trio_hedge.aio" in message and "aio_hedged_stream" in message
    assert "trio_asyncio.run(" in message


def test_a_hedger_from_asyncio_points_to_trio_hedge_aio() -> None:
    async def main() -> None:
        async with th.Hedger([th.Replica("http://127.0.0.1:9/v1")]):
            pass

    with pytest.raises(RuntimeError, match=r"trio_hedge\.aio \(aio_hedged_stream, AioHedger\)"):
        _run_in_stock_asyncio(main())


def test_the_trio_api_from_trio_is_unchanged() -> None:
    async def main() -> None:
        async with FakeReplica(Behaviour(tokens=["a"])) as server:
            async with th.hedged_stream(REQUEST, [th.Replica(server.url)], POLICY) as stream:
                assert [token async for token in stream] == ["a"]

    trio.run(main)


async def test_a_failed_requests_traceback_is_short_and_keeps_the_chain() -> None:
    # Two refused connections printed 163 lines, most of them httpx's and httpcore's frames.
    import traceback

    import httpx

    closed = [th.Replica("http://127.0.0.1:9/v1", name="a"), th.Replica("http://127.0.0.1:9/v1")]
    with pytest.raises(th.AllAttemptsFailed) as caught:
        async with th.hedged_stream(REQUEST, closed, POLICY):
            pass
    printed = "".join(traceback.format_exception(caught.value))
    assert len(printed.splitlines()) < 80, printed
    for error in caught.value.errors:
        assert isinstance(error.__cause__, httpx.ConnectError)  # the chain is all there
        assert error.__cause__.__traceback__ is None  # without the HTTP stack's frames
        assert error.__traceback__ is not None  # the attempt's own frames stay
    assert "httpx.ConnectError: " in printed
    # Each attempt's error is named by its public home, not the private module defining it.
    assert "trio_hedge.errors.AttemptError: connection" in printed
    assert "trio_hedge._" not in printed.replace("trio_hedge/_", "")  # paths of frames aside
