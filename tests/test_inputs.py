"""Bad input fails at construction -- ``Replica(...)``, ``hedged_stream(...)``,
``Hedger.stream(...)`` -- before any I/O, with a ``TypeError``/``ValueError`` that names the
field and never quotes the value."""

from __future__ import annotations

import math
from typing import Any

import attrs
import httpx
import pytest

import trio_hedge as th
from trio_hedge.testing import Behaviour, FakeReplica

URL = "http://127.0.0.1:9/v1"
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
KEY = "sk-Zq7wQ2vX9rT4"


@attrs.frozen
class Bad:
    """One bad input: the call, the exception, what the message names, what it must hide."""

    name: str
    call: Any
    error: type[Exception]
    names: str
    hidden: str = KEY


def _replica(**kw: Any) -> th.Replica:
    return th.Replica(URL, **kw)


def _hedged(**kw: Any) -> th.HedgedStream:
    return th.hedged_stream(kw.pop("request", REQUEST), [_replica()], **kw)


def _hedger_stream(**kw: Any) -> th.HedgedStream:
    hedger = th.Hedger([_replica()])
    return hedger.stream(kw.pop("request", REQUEST), **kw)


CASES = [
    # -- the API key -------------------------------------------------------------------------
    Bad("key read from a file", lambda: _replica(api_key=KEY + "\n"), ValueError, "api_key"),
    Bad("key with CRLF", lambda: _replica(api_key=KEY + "\r\n"), ValueError, "api_key"),
    Bad(
        "key with CR inside",
        lambda: _replica(api_key=KEY[:5] + "\r" + KEY[5:]),
        ValueError,
        "api_key",
    ),
    Bad("key with NUL", lambda: _replica(api_key=KEY + "\0"), ValueError, "api_key"),
    Bad("key with a tab at the end", lambda: _replica(api_key=KEY + "\t"), ValueError, "api_key"),
    Bad("key with a leading space", lambda: _replica(api_key=" " + KEY), ValueError, "api_key"),
    Bad("key with a control char", lambda: _replica(api_key=KEY + "\x1b"), ValueError, "api_key"),
    Bad("key with a non-ASCII char", lambda: _replica(api_key=KEY + "é"), ValueError, "api_key"),
    Bad(
        "key with a zero-width space",
        lambda: _replica(api_key=KEY + "\u200b"),
        ValueError,
        "api_key",
    ),
    Bad("empty key", lambda: _replica(api_key=""), ValueError, "api_key"),
    Bad("bytes key", lambda: _replica(api_key=KEY.encode()), TypeError, "api_key"),
    Bad("int key", lambda: _replica(api_key=1234567890), TypeError, "api_key", "1234567890"),
    # -- extra headers -----------------------------------------------------------------------
    Bad(
        "header value with LF",
        lambda: _replica(headers={"X-Api-Key": KEY + "\n"}),
        ValueError,
        "X-Api-Key",
    ),
    Bad(
        "header value with NUL",
        lambda: _replica(headers={"X-Api-Key": "\0" + KEY}),
        ValueError,
        "X-Api-Key",
    ),
    Bad(
        "header value not str",
        lambda: _replica(headers={"X-Api-Key": KEY.encode()}),
        TypeError,
        "X-Api-Key",
    ),
    Bad("header value an int", lambda: _replica(headers={"X-Retries": 3}), TypeError, "X-Retries"),
    Bad("header name with LF", lambda: _replica(headers={KEY + "\n": "v"}), ValueError, "headers"),
    Bad(
        "header name with a space",
        lambda: _replica(headers={"X " + KEY: "v"}),
        ValueError,
        "headers",
    ),
    Bad(
        "header name with a colon",
        lambda: _replica(headers={KEY + ":": "v"}),
        ValueError,
        "headers",
    ),
    Bad("header name empty", lambda: _replica(headers={"": "v"}), ValueError, "headers"),
    Bad("header name not str", lambda: _replica(headers={1: "v"}), TypeError, "headers"),
    Bad(
        "header names with LF",
        lambda: th.sources.HeaderNames(request_id="X-Id\n"),
        ValueError,
        "request_id",
    ),
    Bad(
        "attempt header with CR",
        lambda: th.sources.HeaderNames(attempt="X-N\r"),
        ValueError,
        "attempt",
    ),
    # -- request_id --------------------------------------------------------------------------
    Bad("request_id with LF", lambda: _hedged(request_id=KEY + "\n"), ValueError, "request_id"),
    Bad("request_id with NUL", lambda: _hedged(request_id="\0" + KEY), ValueError, "request_id"),
    Bad("request_id not str", lambda: _hedged(request_id=12345), TypeError, "request_id"),
    Bad("request_id empty", lambda: _hedged(request_id=""), ValueError, "request_id"),
    Bad(
        "Hedger: request_id with CRLF",
        lambda: _hedger_stream(request_id=KEY + "\r\n"),
        ValueError,
        "request_id",
    ),
    Bad(
        "Hedger: request_id non-ASCII",
        lambda: _hedger_stream(request_id=KEY + "ü"),
        ValueError,
        "request_id",
    ),
    # -- the JSON body -----------------------------------------------------------------------
    Bad(
        "NaN",
        lambda: _hedged(request={**REQUEST, "temperature": math.nan}),
        ValueError,
        "request['temperature']",
    ),
    Bad(
        "inf",
        lambda: _hedged(request={**REQUEST, "top_p": math.inf}),
        ValueError,
        "request['top_p']",
    ),
    Bad(
        "-inf deep",
        lambda: _hedged(request={**REQUEST, "logit_bias": {"50256": -math.inf}}),
        ValueError,
        "request['logit_bias']['50256']",
    ),
    Bad(
        "bytes content",
        lambda: _hedged(
            request={"model": "m", "messages": [{"role": "user", "content": KEY.encode()}]}
        ),
        TypeError,
        "request['messages'][0]['content']",
    ),
    Bad("a set", lambda: _hedged(request={**REQUEST, "stop": {"a"}}), TypeError, "request['stop']"),
    Bad(
        "Hedger: NaN",
        lambda: _hedger_stream(request={**REQUEST, "temperature": math.nan}),
        ValueError,
        "request['temperature']",
    ),
    Bad(
        "Hedger: bytes",
        lambda: _hedger_stream(request={**REQUEST, "user": KEY.encode()}),
        TypeError,
        "request['user']",
    ),
    Bad(
        "Hedger: an idempotency key read from a file",
        lambda: _hedger_stream(idempotency_key=KEY + "\n"),
        ValueError,
        "idempotency_key",
    ),
    Bad(
        "a key twice: api_key and an Authorization header",
        lambda: _replica(api_key=KEY, headers={"Authorization": "Bearer " + KEY}),
        ValueError,
        "api_key",
    ),
    Bad(
        "overrides: NaN",
        lambda: _replica(overrides={"temperature": math.nan}),
        ValueError,
        "overrides['temperature']",
    ),
    Bad(
        "overrides: object",
        lambda: _replica(overrides={"x": object()}),
        TypeError,
        "overrides['x']",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_raises_at_construction_naming_the_field_not_the_value(case: Bad) -> None:
    with pytest.raises(case.error) as caught:
        case.call()
    message = str(caught.value)
    assert case.names in message
    for text in (message, repr(caught.value)):
        assert case.hidden not in text
        # No piece of the hidden value either (4 characters or more).
        hidden = case.hidden
        assert not any(hidden[i : i + 4] in text for i in range(len(hidden) - 3)), text


def test_a_good_key_with_odd_but_legal_characters_is_accepted() -> None:
    key = "sk-'q\"b\\s %20 ~!x"  # quotes, backslash, space, % -- all fine in a header
    replica = th.Replica(URL, api_key=key, headers={"X-Trace": "a b", "X-Empty": ""})
    assert key not in repr(replica)


async def test_bad_body_reaches_no_server() -> None:
    """The failing case on the old code: NaN went out as ``NaN`` (not JSON), and the Hedger,
    which binds replicas lazily, only found a non-encodable body inside the race."""
    async with FakeReplica(Behaviour(tokens=2)) as server:
        replica = th.Replica(server.url)
        body = {**REQUEST, "temperature": math.nan}
        with pytest.raises(ValueError, match="NaN"):
            th.hedged_stream(body, [replica])
        async with th.Hedger([replica]) as hedger:
            with pytest.raises(ValueError, match="NaN"):
                hedger.stream(body)
            with pytest.raises(TypeError, match=r"request\['user'\] is a bytes"):
                hedger.stream({**REQUEST, "user": b"x"})
            # A good body still goes through.
            async with hedger.stream(REQUEST) as stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 "
        assert len(server.requests) == 1


async def test_extra_headers_are_checked_when_bound() -> None:
    async with httpx.AsyncClient() as client:
        with pytest.raises(ValueError, match=r"extra_headers\['X-Id'\]") as caught:
            _replica().bind(REQUEST, client, extra_headers={"X-Id": KEY + "\n"})
    assert KEY not in str(caught.value)


async def test_a_source_bound_directly_never_serialises_nan() -> None:
    async with httpx.AsyncClient() as client:
        with pytest.raises(ValueError, match=r"request\['temperature'\] is NaN"):
            _replica().bind({**REQUEST, "temperature": math.nan}, client)


async def test_header_names_differing_only_in_case_are_sent_once() -> None:
    async with FakeReplica(Behaviour()) as server:
        replica = th.Replica(server.url, headers={"Accept": "text/event-stream", "X-A": "1"})
        source = replica.bind(REQUEST, httpx.AsyncClient(), extra_headers={"x-a": "2"})
        async with source._client:
            attempt = await source.open(
                th.sources.AttemptInfo(request_id="r", number=1, trigger="primary")
            )
            await attempt.aclose()
    headers = server.requests[0].headers
    assert headers["accept"] == "text/event-stream"  # one value, not "…, text/event-stream"
    assert headers["x-a"] == "2"
