"""No part of an API key ever shows: not in a repr, an exception (str, repr, causes,
``ExceptionGroup`` children, tracebacks), a ``Report`` or its ``to_dict()``, a hook event, a
log line at DEBUG (httpx, httpcore, h2, hpack and our own, over real sockets, HTTP/1.1 and
HTTP/2), or the CLI's output -- also when servers quote the key back.

"Part" means any piece of 4 or more characters, in the key's raw, JSON-escaped or
repr-escaped spelling. The servers here quote keys the ways real ones do: OpenAI's 401
("Incorrect API key provided: sk-…"), LiteLLM's proxy ("Received API Key = sk-...1337", the
last four characters), an in-band error event, a body cut by the client's 4 KiB read bound, a
non-JSON event -- each placed so that the key straddles a cut (the 300-character message
bound, the 80-character excerpt), where masking after cutting leaks the head of the key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import trio

import trio_hedge as th
from trio_hedge.cli import format_report, main
from trio_hedge.instrumentation import LoggingHook
from trio_hedge.sources.openai._errors import MAX_MESSAGE_CHARS
from trio_hedge.testing import Behaviour, FakeReplica, fake_replicas

from .threaded import raw_server, serve_in_thread

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
KEYS = [
    pytest.param("sk-'q\"B\\7 %20 %s~x!Zq9w", id="quotes-backslash-percent-space"),
    pytest.param("sk-Lm3xP0aWv2YsHq7zTr5u", id="plain"),
]
POLICY = th.HedgePolicy(hedge_after=None, first_token_timeout=10.0)


# -- what counts as a leak ---------------------------------------------------------------------


def pieces(key: str) -> set[str]:
    out: set[str] = set()
    for spelling in {key, json.dumps(key)[1:-1], repr(key)[1:-1]}:
        out.update(spelling[i : i + 4] for i in range(len(spelling) - 3))
    return out


class Seen:
    """Every text a user could see, labelled by where it came from."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, str]] = []

    def add(self, where: str, text: object) -> None:
        self.texts.append((where, text if isinstance(text, str) else repr(text)))

    def exception(self, where: str, exc: BaseException) -> None:
        self.add(f"{where}: traceback", "".join(traceback.format_exception(exc)))
        todo, done = [exc], set()
        while todo:
            e = todo.pop()
            if id(e) in done:
                continue
            done.add(id(e))
            self.add(f"{where}: str({type(e).__name__})", str(e))
            self.add(f"{where}: repr({type(e).__name__})", repr(e))
            self.add(f"{where}: args", repr(e.args))
            for attr in ("message", "errors", "error", "text"):
                if hasattr(e, attr):
                    self.add(f"{where}: .{attr}", repr(getattr(e, attr)))
            report = getattr(e, "report", None)
            if report is not None:
                self.report(f"{where}: .report", report)
            todo += [c for c in (e.__cause__, e.__context__) if c is not None]
            todo += list(getattr(e, "exceptions", ()))

    def report(self, where: str, report: th.Report) -> None:
        self.add(f"{where}: repr", repr(report))
        self.add(f"{where}: to_dict", json.dumps(report.to_dict()))
        self.add(f"{where}: format_report", format_report(report))
        for attempt in report.attempts:
            self.add(f"{where}: attempt", repr(attempt))

    def logs(self, caplog: pytest.LogCaptureFixture) -> None:
        self.add("logs: text", caplog.text)
        for record in caplog.records:
            self.add(f"logs: {record.name}", record.getMessage())
            self.add(f"logs: {record.name} args", repr(record.args))

    def assert_clean(self, key: str) -> None:
        assert self.texts
        for where, text in self.texts:
            for piece in pieces(key):
                at = text.find(piece)
                assert at < 0, f"{where} shows {piece!r}: …{text[max(0, at - 60) : at + 60]}…"


# -- servers that quote the key --------------------------------------------------------------


def openai_401(key: str) -> Behaviour:
    # The key starts 8 characters before the message bound: cut first, and 8 survive.
    pad = "x" * (MAX_MESSAGE_CHARS - 1 - 8 - len("Incorrect API key provided: "))
    message = f"Incorrect API key provided: {pad}{key}. You can find your API key at …"
    return Behaviour(status=401, error_message=message)


def litellm_401(key: str) -> Behaviour:
    message = (
        f"Authentication Error, Invalid proxy server token passed. Received API Key = "
        f"sk-...{key[-4:]}, Key Hash (Token) =61def79. Unable to find token in cache or "
        "`LiteLLM_VerificationTokenTable`"
    )
    return Behaviour(status=401, error_message=message)


def in_band(key: str, after: int) -> Behaviour:
    pad = "y" * (MAX_MESSAGE_CHARS - 1 - 8 - len("upstream rejected "))
    return Behaviour(
        tokens=3, inband_error_after=after, error_message=f"upstream rejected {pad}{key} here"
    )


GOOD = Behaviour(tokens=2)


@contextlib.asynccontextmanager
async def raw(kind: str, key: str) -> AsyncIterator[str]:
    """Bodies the fake replica cannot send: a JSON error body cut by the 4 KiB read bound
    across the key, and a non-JSON event with the key across the 80-character excerpt."""
    if kind == "cut-body":
        head = b'{"error": {"type": "invalid_request_error", "message": "'
        filler = b"z" * (4096 - len(head) - 6)
        body = head + filler + key.encode() + b' is not valid"}}' + b" " * 100
        async with raw_server(400, [("content-type", "application/json")], body) as url:
            yield url
    else:
        event = b"data: " + b"w" * 70 + key.encode() + b" oops\n\n"
        async with raw_server(200, [("content-type", "text/event-stream")], event) as url:
            yield url


def h2_clients() -> list[Callable[[], httpx.AsyncClient]]:
    return [
        lambda: httpx.AsyncClient(http1=False, http2=True),
        lambda: th.transport.make_client(http1=False, http2=True),
    ]


# -- running requests and collecting everything ------------------------------------------------


async def run_stream(seen: Seen, stream: th.HedgedStream, where: str) -> None:
    try:
        async with stream:
            async for _ in stream:
                pass
    except th.HedgeError as exc:
        seen.exception(where, exc)
    seen.report(where, stream.report)


async def run_all(
    seen: Seen, key: str, urls: list[str], client: httpx.AsyncClient | None = None
) -> None:
    """The same replicas through hedged_stream (each alone, then together) and a Hedger."""
    replicas = [
        th.Replica(url, api_key=key, name=f"r{i}", headers={"X-Api-Key": key})
        for i, url in enumerate(urls)
    ]
    seen.add("repr(replicas)", repr(replicas))
    for replica in replicas:
        await run_stream(seen, th.hedged_stream(REQUEST, [replica], POLICY, client=client), "one")
    await run_stream(seen, th.hedged_stream(REQUEST, replicas, POLICY, client=client), "all")
    events: list[th.events.HedgeEvent] = []
    config = th.HedgerConfig(hedge_after=None, first_token_timeout=10.0)
    hooks = [events.append, LoggingHook(logging.getLogger("trio_hedge.test"))]
    async with th.Hedger(replicas, config, client=client, on_event=hooks) as hedger:
        seen.add("repr(hedger)", repr(hedger))
        await run_stream(seen, hedger.stream(REQUEST), "hedger")
        seen.add("statistics", repr(hedger.statistics()))
    for event in events:
        seen.add(f"event {event.kind.value}", repr(event))


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)  # every logger: httpx, httpcore, h2, hpack, trio_hedge
    yield caplog


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", KEYS)
async def test_quoted_keys_never_show_over_http1(
    key: str, debug_logs: pytest.LogCaptureFixture
) -> None:
    seen = Seen()
    behaviours = [openai_401(key), litellm_401(key), in_band(key, 0), in_band(key, 1), GOOD]
    async with fake_replicas(*behaviours) as servers:
        await run_all(seen, key, [s.url for s in servers])
    for kind in ("cut-body", "not-json"):
        async with raw(kind, key) as url:
            await run_all(seen, key, [url])
    seen.logs(debug_logs)
    assert any("HTTP Request" in text for _, text in seen.texts)  # httpx did log
    seen.assert_clean(key)


@pytest.mark.parametrize("make_client", h2_clients(), ids=["httpx", "make_client"])
@pytest.mark.parametrize("key", KEYS)
async def test_quoted_keys_never_show_over_http2(
    key: str, make_client: Callable[[], httpx.AsyncClient], debug_logs: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("h2")
    seen = Seen()
    behaviours = [openai_401(key), litellm_401(key), in_band(key, 0), in_band(key, 1), GOOD]
    async with fake_replicas(*behaviours, http2=True) as servers, make_client() as client:
        await run_all(seen, key, [s.url for s in servers], client)
        assert servers[-1].requests[-1].http_version == "2"
    seen.logs(debug_logs)
    assert any(name.startswith("logs: hpack") for name, _ in seen.texts)  # hpack did log
    seen.assert_clean(key)


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("sk-Lm3xP0aWv2YsHq7z\n", id="read-from-a-file"),
        pytest.param("sk-ünïcødé-Lm3xP0aW", id="unicode"),
        pytest.param("sk-Lm3xP0aW\0v2YsHq7z", id="nul"),
        pytest.param(" sk-Lm3xP0aWv2YsHq7z", id="leading-space"),
    ],
)
async def test_keys_an_http_header_cannot_carry_fail_at_construction_unquoted(
    key: str, debug_logs: pytest.LogCaptureFixture
) -> None:
    """The failing case on the old code: the key went out, h11 refused the header and its
    ``LocalProtocolError("Illegal header value b'Bearer sk-…\\n'")`` became the attempt's
    error message (and the report's, and the CLI's)."""
    seen = Seen()
    for field in ("api_key", "headers"):
        kwargs: dict[str, Any] = (
            {"api_key": key} if field == "api_key" else {"headers": {"X-Api-Key": key}}
        )
        with pytest.raises(ValueError) as caught:
            th.Replica("http://127.0.0.1:9/v1", **kwargs)
        seen.exception(field, caught.value)
    seen.logs(debug_logs)
    seen.assert_clean(key.strip("\n\0 "))


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_cli_output_never_shows_the_key(
    key: str,
    as_json: bool,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    debug_logs: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("TH_SECRET_KEY", key)
    seen = Seen()
    for behaviours in ([openai_401(key), litellm_401(key)], [in_band(key, 1)]):
        with serve_in_thread(lambda b=behaviours: fake_replicas(*b)) as servers:
            args = ["stream", "--model", "m", "--api-key-env", "TH_SECRET_KEY", "hi"]
            for server in servers:
                args[1:1] = ["--replica", server.url]
            status = main([*args, "--json"] if as_json else args)
        out = capsys.readouterr()
        assert status == 1
        assert (
            "AllAttemptsFailed" if len(servers) == 2 else "StreamInterrupted"
        ) in out.out + out.err
        seen.add("stdout", out.out)
        seen.add("stderr", out.err)
    seen.logs(debug_logs)
    seen.assert_clean(key)


async def test_the_replica_repr_and_its_source_hide_key_and_header_values() -> None:
    key = "sk-Lm3xP0aWv2YsHq7zTr5u"
    replica = th.Replica("http://127.0.0.1:9/v1", api_key=key, headers={"api-key": key})
    seen = Seen()
    seen.add("repr", repr(replica))
    seen.add("str", str(replica))
    async with FakeReplica(GOOD) as server, httpx.AsyncClient() as client:
        source = th.Replica(server.url, api_key=key).bind(REQUEST, client)
        seen.add("source", repr(source))
        with trio.fail_after(5):
            attempt = await source.open(th.sources.AttemptInfo("rid", 1, "primary"))
            seen.add("attempt", repr(attempt))
            await attempt.aclose()
    seen.assert_clean(key)
