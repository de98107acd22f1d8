"""The fault matrix: misbehaving servers on real loopback sockets.

Each case puts a misbehaving primary in front of a healthy backup (``with backup``), and
where it makes sense also alone (``alone``), and asserts the library's three promises:

1. **Every response it opens is closed, and its server sees the disconnect**: after
   ``async with`` exits no response is left open in the httpx pool, every request each server
   received has ended (answered, or seen disconnecting), every connection the servers accepted
   is closed once the client is, and no file descriptor or Trio task of this process is left
   behind (``/proc/self/fd`` and the task tree under the root task, before and after).
2. **No request storm**: each server received exactly the requests the case calls for.
3. **The report says what really happened**: which exception (and its ``.error`` /
   ``.text``), the winner, every attempt's trigger, outcome (final, never ``running``, with an
   ``ended_at``) and error kind, ``hedged`` and ``backups_sent``.

The expected semantics (``docs/index.md``, issue 8): transient errors fail over at once;
replica-fault errors (401/403, quota, 404) fail that attempt only and fail over at once;
request-fault errors (400/413/422, context length) raise ``FatalAttemptError`` whose
``.error`` is that error and cancel every attempt; errors after the commit raise
``StreamInterrupted`` with the partial text; ``first_token_timeout`` raises
``AllAttemptsFailed`` with the attempts' outcome ``timeout``; ``report.hedged`` only when a
backup was really sent on the hedge delay; the first token reaches the caller at the commit
even when a loser's close is slow; an empty answer does not beat an attempt still running.

The servers live in ``tests/misbehaving.py`` (raw sockets, byte by byte) and
``trio_hedge.testing.FakeReplica`` (its knobs, HTTP/1.1 and h2c). Times are real but short:
no case waits for anything but an event, with a bound.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio

import trio_hedge as th
from trio_hedge.errors import ErrorKind as K
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.testing import Behaviour, FakeReplica

from . import misbehaving as mb
from .misbehaving import Baseline, Blackhole, RawServer, ServerConn, open_responses

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
BACKUP = Behaviour(ttft=0.01, tokens=2)
BACKUP_TEXT = "tok0 tok1 "
#: A bound for things that happen within milliseconds (a server noticing a close).
SOON = 2.0
#: A hedge delay no case reaches: an attempt that starts did so because of a failure.
NEVER = 30.0
HEDGE = 0.05
FIRST_TOKEN_TIMEOUT = 0.25

QUOTA = "You exceeded your current quota, please check your plan and billing details."
CONTEXT = "This model's maximum context length is 8192 tokens. Please reduce the length."


# -- scripts: what a raw primary does with the request ----------------------------------------


async def reset_before_headers(c: ServerConn) -> None:
    await c.reset()


async def reset_after_headers(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.reset()


async def reset_after_role(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT])
    await c.reset()


async def reset_after_tokens(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT, mb.token_event("a "), mb.token_event("b ")])
    await c.reset()


async def truncated_before_token(c: ServerConn) -> None:
    # A well-formed body that ends without a token, finish reason or [DONE].
    await c.send(mb.SSE_HEAD + mb.chunk(mb.ROLE_EVENT) + mb.END_OF_BODY)


async def truncated_after_tokens(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT, mb.token_event("a "), mb.token_event("b ")])
    await c.send(mb.END_OF_BODY)


async def truncated_inside_an_event(c: ServerConn) -> None:
    half = mb.token_event("c ")[:20]
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT, mb.token_event("a "), mb.token_event("b "), half])
    await c.send(mb.END_OF_BODY)


async def fin_inside_the_body(c: ServerConn) -> None:
    # The chunked body never ends: the connection closes (FIN) after two tokens.
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT, mb.token_event("a "), mb.token_event("b ")])
    await c.close()


async def empty_body(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD + mb.END_OF_BODY)


async def garbage_status_line(c: ServerConn) -> None:
    await c.send(b"\x00\x01\xfe garbage, not HTTP\r\n\r\n")
    await c.close()


async def garbage_event(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT, b"data: \x00\x01 certainly not json\n\n"])
    await c.hold()


async def garbage_after_tokens(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT, mb.token_event("a "), mb.token_event("b ")])
    await c.send_chunks([b"data: {\x00 not json\n\n"])
    await c.hold()


BAD_UTF8 = b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe\xc3("}}]}\n\n'


async def invalid_utf8(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT, BAD_UTF8])
    await c.hold()


async def invalid_utf8_after_tokens(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT, mb.token_event("a "), mb.token_event("b "), BAD_UTF8])
    await c.hold()


async def huge_event(c: ServerConn) -> None:
    # One event of 1 MiB + 4 KiB (the bound is 1 MiB), never terminated.
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT, b'data: {"choices":[{"delta":{"content":"'])
    piece = b"x" * 65536
    for _ in range(17):
        await c.send_chunks([piece])
    await c.hold()


async def keepalives_only(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.send_chunks([mb.ROLE_EVENT])
    while True:  # comments only, forever: never a token
        await c.send_chunks([b": keep-alive\n\n", b":\n\n", b"data:\n\n"])
        await trio.sleep(0.01)


DRIP_TOKENS = ("caf\u00e9 ", "\u65e5\u672c ", "\U0001f600 ", "ok")


async def byte_drip(c: ServerConn) -> None:
    # A healthy answer, one byte per write, each read by the client before the next is sent:
    # every split point, inside the status line, a chunk size, a CRLF and multi-byte UTF-8.
    body = b"".join(mb.chunk(event) for event in mb.healthy_body(DRIP_TOKENS))
    await c.drip(mb.SSE_HEAD + body + mb.END_OF_BODY)


async def headers_never_sent(c: ServerConn) -> None:
    await c.hold()


async def headers_then_silence(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.hold()


async def html_page(c: ServerConn) -> None:
    body = b"<!doctype html><html><body><h1>Welcome to nginx!</h1></body></html>"
    await c.send(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (len(body), body)
    )


async def unused(c: ServerConn) -> None:  # a TLS server's script: the handshake fails first
    raise AssertionError("a plain-HTTP request got through a TLS handshake")


# -- the primaries and what is expected of them -----------------------------------------------


@attrs.frozen
class Primary:
    """The misbehaving primary: a raw script, a FakeReplica behaviour, or no server at all."""

    script: mb.Script | None = None
    behaviour: Behaviour | None = None
    refused: bool = False
    blackhole: bool = False
    tls: bool = False  # the raw server speaks TLS
    scheme: str | None = None  # the URL's scheme when it is not the server's own
    http2: bool = False  # FakeReplicas speak h2c and the client uses it (prior knowledge)


#: Shapes: what the library must make of the primary.
FAILOVER = "fails over"  # an error before the first token: the next attempt starts at once
FATAL = "fatal"  # the request's fault: FatalAttemptError, every attempt cancelled
INTERRUPTED = "interrupted"  # an error after the commit: StreamInterrupted, partial text
NO_TOKEN = "no token"  # never a token: hedged on time; alone, first_token_timeout
WINS = "wins"  # a healthy answer despite the odd bytes


@attrs.frozen
class Fault:
    name: str
    primary: Primary
    shape: str
    kind: K | None = None  # the primary attempt's error kind
    text: str = ""  # INTERRUPTED: the partial text; WINS: the whole text
    message: str | None = attrs.field(default=None, kw_only=True)  # a regex on its message
    retry_after: float | None = attrs.field(default=None, kw_only=True)
    #: other kinds that would be as right (where issue 8 leaves the kind open)
    also: tuple[K, ...] = attrs.field(default=(), kw_only=True)
    #: requests the primary's server sees (default: 1, or 0 when nothing listens)
    requests: int | None = attrs.field(default=None, kw_only=True)


def raw(script: mb.Script, **kw: Any) -> Primary:
    return Primary(script=script, **kw)


def fake(behaviour: Behaviour, **kw: Any) -> Primary:
    return Primary(behaviour=behaviour, **kw)


# The request-fault errors arrive after a delay, so that a hedged backup is running when they
# land (it must be cancelled).
LATE = 0.2

FAULTS = [
    # -- connections --------------------------------------------------------------------------
    Fault("connection refused", Primary(refused=True), FAILOVER, K.CONNECTION),
    Fault("connect pending (SYN dropped)", Primary(blackhole=True), NO_TOKEN),
    Fault("reset before headers", raw(reset_before_headers), FAILOVER, K.CONNECTION),
    Fault("reset after headers", raw(reset_after_headers), FAILOVER, K.CONNECTION),
    Fault("reset after the role chunk", raw(reset_after_role), FAILOVER, K.STREAM_TRUNCATED),
    Fault("reset after tokens", raw(reset_after_tokens), INTERRUPTED, K.STREAM_TRUNCATED, "a b "),
    Fault("headers never sent", raw(headers_never_sent), NO_TOKEN),
    Fault("headers, then silence", raw(headers_then_silence), NO_TOKEN),
    # -- truncation ---------------------------------------------------------------------------
    Fault("truncated before a token", raw(truncated_before_token), FAILOVER, K.STREAM_TRUNCATED),
    Fault(
        "truncated after tokens",
        raw(truncated_after_tokens),
        INTERRUPTED,
        K.STREAM_TRUNCATED,
        "a b ",
    ),
    Fault(
        "truncated inside an event",
        raw(truncated_inside_an_event),
        INTERRUPTED,
        K.STREAM_TRUNCATED,
        "a b ",
    ),
    Fault(
        "FIN inside the chunked body",
        raw(fin_inside_the_body),
        INTERRUPTED,
        K.STREAM_TRUNCATED,
        "a b ",
    ),
    Fault("empty body", raw(empty_body), FAILOVER, K.EMPTY_STREAM),
    # -- bytes that break the protocol --------------------------------------------------------
    Fault("garbage status line", raw(garbage_status_line), FAILOVER, K.CONNECTION),
    Fault("garbage event", raw(garbage_event), FAILOVER, K.PROTOCOL),
    Fault("garbage after tokens", raw(garbage_after_tokens), INTERRUPTED, K.PROTOCOL, "a b "),
    Fault("invalid UTF-8", raw(invalid_utf8), FAILOVER, K.PROTOCOL),
    Fault(
        "invalid UTF-8 after tokens",
        raw(invalid_utf8_after_tokens),
        INTERRUPTED,
        K.PROTOCOL,
        "a b ",
    ),
    Fault("huge event", raw(huge_event), FAILOVER, K.PROTOCOL, message="max_event_size"),
    Fault("keep-alive comments only", raw(keepalives_only), NO_TOKEN),
    Fault("byte drip", raw(byte_drip), WINS, text="".join(DRIP_TOKENS)),
    Fault(
        "200 text/html",
        raw(html_page),
        FAILOVER,
        K.EMPTY_STREAM,
        also=(K.PROTOCOL,),
        message="text/html",  # issue 8: the error says so
    ),
    # -- HTTP errors and pushback -------------------------------------------------------------
    Fault(
        "429 Retry-After",
        fake(Behaviour(status=429, retry_after=2)),
        FAILOVER,
        K.RATE_LIMIT,
        retry_after=2.0,
    ),
    Fault(
        "503 Retry-After",
        fake(Behaviour(status=503, retry_after=1)),
        FAILOVER,
        K.OVERLOADED,
        retry_after=1.0,
    ),
    Fault("500", fake(Behaviour(status=500)), FAILOVER, K.SERVER_ERROR),
    Fault("408", fake(Behaviour(status=408)), FAILOVER, K.TIMEOUT),
    Fault("401 (the replica's fault)", fake(Behaviour(status=401)), FAILOVER, K.AUTH),
    Fault("403 (the replica's fault)", fake(Behaviour(status=403)), FAILOVER, K.AUTH),
    Fault("404 (the replica's fault)", fake(Behaviour(status=404)), FAILOVER, K.NOT_FOUND),
    Fault(
        "429 quota (the replica's fault)",
        fake(Behaviour(status=429, error_message=QUOTA)),
        FAILOVER,
        K.QUOTA_EXCEEDED,
    ),
    Fault("400", fake(Behaviour(status=400, error_delay=LATE)), FATAL, K.INVALID_REQUEST),
    Fault("413", fake(Behaviour(status=413, error_delay=LATE)), FATAL, K.INVALID_REQUEST),
    Fault("422", fake(Behaviour(status=422, error_delay=LATE)), FATAL, K.INVALID_REQUEST),
    Fault(
        "400 context length",
        fake(Behaviour(status=400, error_delay=LATE, error_message=CONTEXT)),
        FATAL,
        K.CONTEXT_LENGTH_EXCEEDED,
    ),
    # -- in-band errors -----------------------------------------------------------------------
    Fault(
        "in-band server error before the first token",
        fake(Behaviour(inband_error_after=0)),
        FAILOVER,
        K.SERVER_ERROR,
    ),
    Fault(
        "in-band rate limit before the first token",
        fake(Behaviour(inband_error_after=0, inband_error_status=429)),
        FAILOVER,
        K.RATE_LIMIT,
    ),
    Fault(
        "in-band auth error before the first token",
        fake(Behaviour(inband_error_after=0, inband_error_status=401)),
        FAILOVER,
        K.AUTH,
    ),
    Fault(
        "in-band context length before the first token",
        fake(
            Behaviour(
                ttft=LATE, inband_error_after=0, inband_error_status=400, error_message=CONTEXT
            )
        ),
        FATAL,
        K.CONTEXT_LENGTH_EXCEEDED,
    ),
    Fault(
        "in-band error after tokens",
        fake(Behaviour(tokens=4, inband_error_after=2)),
        INTERRUPTED,
        K.SERVER_ERROR,
        "tok0 tok1 ",
    ),
    # -- TLS mismatch -------------------------------------------------------------------------
    Fault(
        "TLS to a plain-HTTP port",
        fake(Behaviour(), scheme="https"),
        FAILOVER,
        K.CONNECTION,
        also=(K.PROTOCOL,),
        message=r"(?i)\b(tls|ssl|https)\b",  # issue 8: the error says so
        requests=0,  # a ClientHello is no HTTP request
    ),
    Fault("plain HTTP to a TLS port", raw(unused, tls=True, scheme="http"), FAILOVER, K.CONNECTION),
    # -- HTTP/2 (h2c): the server resets a stream (RST_STREAM) ---------------------------------
    Fault(
        "h2c RST_STREAM before the first token",
        fake(Behaviour(ttft=0.01, cut_after=0), http2=True),
        FAILOVER,
        K.STREAM_TRUNCATED,
    ),
    Fault(
        "h2c RST_STREAM after tokens",
        fake(Behaviour(ttft=0.01, tokens=4, cut_after=2), http2=True),
        INTERRUPTED,
        K.STREAM_TRUNCATED,
        "tok0 tok1 ",
    ),
    Fault("h2c 503", fake(Behaviour(status=503), http2=True), FAILOVER, K.OVERLOADED),
    Fault(
        "h2c headers held back",
        fake(Behaviour(status=503, error_delay=NEVER), http2=True),
        NO_TOKEN,
    ),
    Fault(
        "h2c keep-alives only",
        fake(Behaviour(ttft=0.0, stall_after=0, keepalive_interval=0.01), http2=True),
        NO_TOKEN,
    ),
]


# -- servers under one interface --------------------------------------------------------------


class Server:
    """A primary or backup, whatever it runs on: its URL, what it received, and whether it
    has seen the end of everything."""

    url: str

    def requests_seen(self) -> int:
        """Requests that reached the server (connections, for raw servers)."""
        raise NotImplementedError

    async def settled(self) -> None:
        """Wait until every request it received has ended (answered or disconnected)."""

    async def all_closed(self) -> None:
        """Wait until every connection it accepted is closed."""

    def saw_disconnect(self, index: int) -> bool:
        """Whether the client went away before request ``index`` was answered."""
        raise NotImplementedError


class NoServer(Server):
    def __init__(self, url: str) -> None:
        self.url = url

    def requests_seen(self) -> int:
        return 0

    def saw_disconnect(self, index: int) -> bool:
        return True  # nothing was ever accepted: nothing to see


class RawView(Server):
    def __init__(self, server: RawServer, url: str) -> None:
        self.server, self.url = server, url

    def requests_seen(self) -> int:
        return len(self.server.connections)

    async def settled(self) -> None:
        # Every raw answer is `connection: close`: a request has ended when its connection has.
        await self.server.wait_connections(0)

    async def all_closed(self) -> None:
        await self.server.wait_connections(0)

    def saw_disconnect(self, index: int) -> bool:
        return self.server.connections[index].closed_by == "client"


class FakeView(Server):
    def __init__(self, replica: FakeReplica, url: str) -> None:
        self.replica, self.url = replica, url

    def requests_seen(self) -> int:
        return len([r for r in self.replica.requests if r.path.endswith("/chat/completions")])

    async def settled(self) -> None:
        for record in self.replica.requests:
            await record.wait_finished()

    async def all_closed(self) -> None:
        await self.replica.wait_connections(0)

    def saw_disconnect(self, index: int) -> bool:
        return self.replica.requests[index].disconnected_at is not None


def _with_scheme(url: str, scheme: str | None) -> str:
    return url if scheme is None else scheme + url[url.index(":") :]


@asynccontextmanager
async def serve(primary: Primary) -> AsyncIterator[Server]:
    if primary.refused:
        yield NoServer(f"http://127.0.0.1:{mb.refused_port()}/v1")
    elif primary.blackhole:
        with Blackhole() as hole:
            yield NoServer(hole.url)
    elif primary.script is not None:
        async with RawServer(primary.script, tls=primary.tls, name="primary") as server:
            yield RawView(server, _with_scheme(server.url, primary.scheme))
    else:
        assert primary.behaviour is not None
        async with FakeReplica(primary.behaviour, name="primary", http2=primary.http2) as rep:
            yield FakeView(rep, _with_scheme(rep.url, primary.scheme))


@asynccontextmanager
async def fake_server(
    behaviour: Behaviour, name: str, *, http2: bool = False
) -> AsyncIterator[FakeView]:
    async with FakeReplica(behaviour, name=name, http2=http2) as replica:
        yield FakeView(replica, replica.url)


# -- running a case ---------------------------------------------------------------------------


@attrs.define
class Outcome:
    report: th.Report
    error: BaseException | None
    tokens: list[str]


async def run_sources(
    sources: Sequence[th.Replica | th.sources.Source],
    policy: th.HedgePolicy,
    *,
    client: httpx.AsyncClient | None = None,
    body: dict[str, Any] | None = None,
) -> Outcome:
    """One hedged request, read to its end; the error it raised (a HedgeError) is kept."""
    stream = th.hedged_stream(body, sources, policy, client=client)
    tokens: list[str] = []
    error: BaseException | None = None
    try:
        async with stream:
            async for token in stream:
                tokens.append(token)
    except th.HedgeError as exc:
        error = exc
    return Outcome(stream.report, error, tokens)


async def run_stream(
    urls: Sequence[str], policy: th.HedgePolicy, client: httpx.AsyncClient
) -> Outcome:
    """One hedged request to replicas ``r0``, ``r1``… at ``urls``."""
    replicas = [th.Replica(url, name=f"r{i}") for i, url in enumerate(urls)]
    return await run_sources(replicas, policy, client=client, body=REQUEST)


async def run_stream_body(
    body: dict[str, Any], replicas: Sequence[th.Replica], client: httpx.AsyncClient
) -> Outcome:
    return await run_sources(replicas, th.HedgePolicy(), client=client, body=body)


class Problems:
    """Broken promises, collected so that one failure lists all of a case's (a failing leak
    check does not hide a wrong report)."""

    def __init__(self, case: str) -> None:
        self.case = case
        self.found: list[str] = []

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.found.append(message)

    async def within(self, seconds: float, what: str, *waits: Awaitable[None]) -> None:
        """Wait for each of ``waits`` in turn, all within ``seconds``; note it if they do not."""
        with trio.move_on_after(seconds) as scope:
            for wait in waits:
                await wait
        if scope.cancelled_caught:
            self.found.append(f"{what} (waited {seconds} s)")

    async def leaks(self, baseline: Baseline) -> None:
        self.found.extend(await baseline.changes())

    def raise_if_any(self) -> None:
        if self.found:
            lines = "\n".join(f"  - {p}" for p in self.found)
            raise AssertionError(f"{self.case}: {len(self.found)} broken promise(s):\n{lines}")


def check_final(report: th.Report, problems: Problems) -> None:
    """Promise 3's floor: after ``async with`` every attempt's outcome is final."""
    check = problems.check
    check(report.finished, "the report is not finished")
    for a in report.attempts:
        name = f"attempt {a.number} ({a.trigger})"
        check(
            a.outcome in (O.WON, O.CANCELLED, O.FAILED, O.TIMEOUT),
            f"{name} is still {a.outcome.value!r} after `async with` exited",
        )
        check(a.ended_at is not None, f"{name} ({a.outcome.value}) has no ended_at")
        if a.ended_at is not None and a.started_at is not None:
            check(a.ended_at >= a.started_at, f"{name} ended before it started")
        if a.outcome is O.FAILED:
            check(a.error is not None, f"{name} failed without an error")
        elif a.error is not None:  # only the winner failing after commit, or a timeout
            check(
                a.number == report.winner or a.outcome is O.TIMEOUT,
                f"{name} is {a.outcome.value!r} but carries {a.error.kind.value!r}",
            )
    check(report.backups_sent == len(report.attempts) - 1, "backups_sent != attempts - 1")
    triggers = [a.trigger for a in report.attempts]
    check(
        report.hedged == ("hedge" in triggers),
        f"hedged={report.hedged} but the triggers are {triggers} "
        f"(backups_sent={report.backups_sent})",
    )


def expect(
    out: Outcome,
    problems: Problems,
    *,
    error: type[th.HedgeError] | None,
    winner: int | None,
    attempts: Sequence[tuple[str, O]],
    kinds: Sequence[K | None],
    text: str,
) -> None:
    """The exception, the winner, each attempt's (trigger, outcome, error kind), the text."""
    report = out.report
    check = problems.check
    check(type(out.error) is (error or type(None)), f"raised {out.error!r}, expected {error}")
    check_final(report, problems)
    got = [(a.trigger, a.outcome.value) for a in report.attempts]
    want = [(trigger, outcome.value) for trigger, outcome in attempts]
    check(got == want, f"attempts (trigger, outcome) are {got}, expected {want}")
    got_kinds = [
        None if a.error is None or a.outcome is O.TIMEOUT else a.error.kind.value
        for a in report.attempts
    ]
    want_kinds = [None if k is None else k.value for k in kinds]
    check(got_kinds == want_kinds, f"error kinds are {got_kinds}, expected {want_kinds}")
    check(report.winner == winner, f"winner is {report.winner}, expected {winner}")
    check("".join(out.tokens) == text, f"the caller read {''.join(out.tokens)!r}, not {text!r}")
    check(report.text == text, f"report.text is {report.text!r}, not {text!r}")
    if out.error is not None:
        check(report.error is out.error, "report.error is not the error raised")


@pytest.mark.parametrize("alone", [False, True], ids=["with backup", "alone"])
@pytest.mark.parametrize("case", FAULTS, ids=[f.name for f in FAULTS])
async def test_fault(case: Fault, alone: bool) -> None:
    baseline = Baseline.take()
    problems = Problems(f"{case.name} ({'alone' if alone else 'with backup'})")
    check = problems.check
    primary = case.primary
    policy = th.HedgePolicy(hedge_after=NEVER)
    backup_behaviour = BACKUP
    if case.shape == NO_TOKEN:
        policy = th.HedgePolicy(
            hedge_after=HEDGE, first_token_timeout=FIRST_TOKEN_TIMEOUT if alone else None
        )
    elif case.shape == FATAL:
        # A slow backup is hedged before the fatal error lands: it must be cancelled.
        policy = th.HedgePolicy(hedge_after=HEDGE)
        backup_behaviour = Behaviour(ttft=NEVER)
    http2 = primary.http2
    client = th.transport.make_client(http1=not http2, http2=http2)
    async with serve(primary) as p, fake_server(backup_behaviour, "backup", http2=http2) as b:
        async with mb.close_cleanly(client):
            urls = [p.url] if alone else [p.url, b.url]
            out = await run_stream(urls, policy, client)
            # Promise 1: every response closed by the time `async with` exited; every request
            # each server received has ended (answered, or its disconnect seen).
            check(open_responses(client) == 0, "a response was left open after `async with`")
            await problems.within(
                SOON, "a server never saw the end of a request", p.settled(), b.settled()
            )
        # With the client closed, every connection is closed too.
        await problems.within(
            SOON, "a server connection was never closed", p.all_closed(), b.all_closed()
        )
    await problems.leaks(baseline)

    # Promise 2: no storm. The primary got one request (if it could accept one at all); the
    # backup got one only if something needed it.
    could_accept = not (primary.refused or primary.blackhole)
    expected = case.requests if case.requests is not None else int(could_accept)
    check(p.requests_seen() == expected, f"the primary saw {p.requests_seen()} requests")
    backup_needed = not alone and case.shape in (FAILOVER, FATAL, NO_TOKEN)
    check(b.requests_seen() == int(backup_needed), f"the backup saw {b.requests_seen()} requests")

    # Promise 3: the report.
    report = out.report
    first = report.attempts[0]
    kind = case.kind
    if kind is not None:
        if first.error is None:
            check(False, f"the primary attempt has no error (expected {kind.value})")
        else:
            err = first.error
            check(err.kind in (kind, *case.also), f"the primary's error is {err.kind.value}")
            kind = err.kind
            check(err.replica == "r0", f"the error names replica {err.replica!r}")
            if case.message is not None:
                check(
                    re.search(case.message, err.message) is not None,
                    f"the message {err.message!r} does not match {case.message!r}",
                )
            if case.retry_after is not None:
                check(err.retry_after == case.retry_after, f"retry_after={err.retry_after}")
    if case.shape == FAILOVER:
        if alone:
            expect(
                out,
                problems,
                error=th.AllAttemptsFailed,
                winner=None,
                attempts=[("primary", O.FAILED)],
                kinds=[kind],
                text="",
            )
            if isinstance(out.error, th.AllAttemptsFailed):
                check([e.kind for e in out.error.errors] == [kind], "errors != [the primary's]")
        else:
            expect(
                out,
                problems,
                error=None,
                winner=2,
                attempts=[("primary", O.FAILED), ("failover", O.WON)],
                kinds=[kind, None],
                text=BACKUP_TEXT,
            )
            if len(report.attempts) > 1:
                started = report.attempts[1].started_at
                check(started is not None and started < NEVER / 10, "no failover at once")
    elif case.shape == FATAL:
        if alone:
            attempts: list[tuple[str, O]] = [("primary", O.FAILED)]
        else:
            attempts = [("primary", O.FAILED), ("hedge", O.CANCELLED)]
            check(b.saw_disconnect(0), "the cancelled backup's server never saw a disconnect")
        expect(
            out,
            problems,
            error=th.FatalAttemptError,
            winner=None,
            attempts=attempts,
            kinds=[kind] + [None] * (len(attempts) - 1),
            text="",
        )
        if isinstance(out.error, th.FatalAttemptError):
            check(out.error.error is first.error, "FatalAttemptError.error is not the fatal one")
    elif case.shape == INTERRUPTED:
        expect(
            out,
            problems,
            error=th.StreamInterrupted,
            winner=1,
            attempts=[("primary", O.WON)],
            kinds=[kind],
            text=case.text,
        )
        if isinstance(out.error, th.StreamInterrupted):
            check(out.error.text == case.text, f"StreamInterrupted.text={out.error.text!r}")
            check(out.error.error.kind is kind, "StreamInterrupted.error is not the cause")
        check(not report.completed, "an interrupted stream is reported completed")
    elif case.shape == NO_TOKEN:
        if alone:
            expect(
                out,
                problems,
                error=th.AllAttemptsFailed,
                winner=None,
                attempts=[("primary", O.TIMEOUT)],
                kinds=[None],
                text="",
            )
            if isinstance(out.error, th.AllAttemptsFailed):
                check(out.error.errors[-1].kind is K.TIMEOUT, "the last error is not a timeout")
        else:
            expect(
                out,
                problems,
                error=None,
                winner=2,
                attempts=[("primary", O.CANCELLED), ("hedge", O.WON)],
                kinds=[None, None],
                text=BACKUP_TEXT,
            )
            if len(report.attempts) > 1:
                started = report.attempts[1].started_at
                check(started is not None and started >= HEDGE, "hedged before the delay")
        if expected:
            check(p.saw_disconnect(0), "the primary's server never saw the disconnect")
    else:
        assert case.shape == WINS
        expect(
            out,
            problems,
            error=None,
            winner=1,
            attempts=[("primary", O.WON)],
            kinds=[None],
            text=case.text,
        )
        check(report.completed, "a complete answer is not reported completed")
    problems.raise_if_any()


# -- HTTP/2: a server resets one stream of a shared connection --------------------------------


@pytest.mark.parametrize("cut_after", [0, 2], ids=["before the first token", "after tokens"])
async def test_h2_server_reset_of_one_stream_spares_the_others(cut_after: int) -> None:
    """Issue 8: when the server resets one stream, the library's own reset of it must not
    fall back to closing the connection three other requests share."""
    baseline = Baseline.take()
    problems = Problems("h2 reset of one stream")
    check = problems.check

    def behaviour(record: Any) -> Behaviour:
        if record.json["messages"][0]["content"] == "victim":
            return Behaviour(ttft=0.02, token_delay=0.02, tokens=6, cut_after=cut_after)
        return Behaviour(ttft=0.02, token_delay=0.03, tokens=6)  # still streaming at the reset

    results: dict[str, Outcome] = {}
    async with FakeReplica(behaviour, name="h2", http2=True) as replica:
        client = th.transport.make_client(http1=False, http2=True)
        async with mb.close_cleanly(client):
            health = await client.get(replica.base_url + "/health")
            assert health.http_version == "HTTP/2"  # the connection all requests will share

            async def one(content: str) -> None:
                body = {**REQUEST, "messages": [{"role": "user", "content": content}]}
                replicas = [th.Replica(replica.url, name="h2")]
                results[content] = await run_stream_body(body, replicas, client)

            async with trio.open_nursery() as nursery:
                for content in ("victim", "bystander 1", "bystander 2", "bystander 3"):
                    nursery.start_soon(one, content)
            check(replica.open_connections == 1, "the shared connection was closed")
            check(open_responses(client) == 0, "a response was left open")
            await problems.within(
                SOON,
                "a request never ended on the server",
                *(r.wait_finished() for r in replica.requests),
            )
        await problems.within(SOON, "a connection was never closed", replica.wait_connections(0))
    await problems.leaks(baseline)

    victim = results.pop("victim")
    if cut_after == 0:
        check(isinstance(victim.error, th.AllAttemptsFailed), f"the victim: {victim.error!r}")
    else:
        check(isinstance(victim.error, th.StreamInterrupted), f"the victim: {victim.error!r}")
        check("".join(victim.tokens) == "tok0 tok1 ", "the victim's partial text")
    for name, out in results.items():
        check(out.error is None, f"{name} was killed by another stream's reset: {out.error!r}")
        check("".join(out.tokens) == "".join(f"tok{i} " for i in range(6)), f"{name}'s text")
    problems.raise_if_any()


# -- a loser whose close is slow --------------------------------------------------------------


class SlowClose:
    """Wraps a source so that closing its attempts takes ``delay`` seconds (as a loser's close
    may: a TLS close_notify to a stuck peer, an HTTP/2 reset behind flow control), and
    records when each close finished."""

    def __init__(self, inner: th.sources.Source, delay: float) -> None:
        self._inner, self._delay = inner, delay
        self.closed_at: list[float] = []

    @property
    def name(self) -> str:
        return self._inner.name

    async def open(self, info: th.sources.AttemptInfo) -> th.sources.AttemptStream:
        return _SlowCloseStream(await self._inner.open(info), self)


class _SlowCloseStream:
    def __init__(self, inner: th.sources.AttemptStream, owner: SlowClose) -> None:
        self._inner, self._owner = inner, owner

    async def receive(self) -> Sequence[th.events.Delta] | None:
        return await self._inner.receive()

    async def aclose(self) -> None:
        await trio.sleep(self._owner._delay)
        await self._inner.aclose()
        self._owner.closed_at.append(trio.current_time())


SLOW_CLOSE = 0.6


@attrs.define
class SlowLoser:
    primary: SlowClose  # never answers; closing it takes SLOW_CLOSE s
    backup: th.sources.Source
    p: FakeView
    b: FakeView
    client: httpx.AsyncClient


@asynccontextmanager
async def slow_loser(backup: Behaviour, problems: Problems) -> AsyncIterator[SlowLoser]:
    """A primary that never answers, whose close takes SLOW_CLOSE s, and ``backup``."""
    async with fake_server(Behaviour(ttft=NEVER), "primary") as p:
        async with fake_server(backup, "backup") as b:
            client = th.transport.make_client()
            async with mb.close_cleanly(client):
                primary = th.Replica(p.url, name="primary").bind(REQUEST, client)
                backup_source = th.Replica(b.url, name="backup").bind(REQUEST, client)
                yield SlowLoser(SlowClose(primary, SLOW_CLOSE), backup_source, p, b, client)
                problems.check(open_responses(client) == 0, "a response was left open")
                await problems.within(
                    SOON, "a server never saw the end of a request", p.settled(), b.settled()
                )
            await problems.within(
                SOON, "a connection was never closed", p.all_closed(), b.all_closed()
            )


async def test_a_slow_loser_close_does_not_delay_the_first_token() -> None:
    """Issue 8: the caller gets the first token at the commit; the loser is still closed
    before ``async with`` exits."""
    baseline = Baseline.take()
    problems = Problems("a slow loser's close")
    check = problems.check
    async with slow_loser(Behaviour(ttft=0.02, token_delay=0.01, tokens=3), problems) as s:
        policy = th.HedgePolicy(hedge_after=HEDGE)
        stream = th.hedged_stream(None, [s.primary, s.backup], policy)
        async with stream:
            entered = trio.current_time()
            tokens = [t async for t in stream]
        exited = trio.current_time()
    await problems.leaks(baseline)
    report = stream.report
    check_final(report, problems)
    check(tokens == ["tok0 ", "tok1 ", "tok2 "], f"read {tokens}")
    check(report.winner == 2, f"winner {report.winner}")
    if report.ttft is not None:
        late = entered - (stream.started_at + report.ttft)
        check(late < SLOW_CLOSE / 2, f"the first token reached the caller {late:.3f} s late")
    check(bool(s.primary.closed_at) and s.primary.closed_at[0] <= exited, "loser closed late")
    check(s.p.saw_disconnect(0), "the loser's server never saw the disconnect")
    problems.raise_if_any()


async def test_first_token_timeout_during_a_loser_close_keeps_the_winner() -> None:
    """Issue 8 (winner leak): ``first_token_timeout`` expiring between the commit and the
    race's return must neither drop the committed winner unclosed nor say "no first token"."""
    baseline = Baseline.take()
    problems = Problems("first_token_timeout during a loser's close")
    check = problems.check
    async with slow_loser(Behaviour(ttft=0.02, token_delay=0.01, tokens=3), problems) as s:
        policy = th.HedgePolicy(hedge_after=HEDGE, first_token_timeout=0.2)  # inside the close
        out = await run_sources([s.primary, s.backup], policy)
    await problems.leaks(baseline)
    check_final(out.report, problems)
    if out.error is not None:
        check(
            out.report.winner is None,
            f"{out.error!r} although attempt {out.report.winner} committed",
        )
    check(out.error is None, "the first token came at the commit, before the timeout")
    check(out.tokens == ["tok0 ", "tok1 ", "tok2 "], f"read {out.tokens}")
    problems.raise_if_any()


async def test_caller_cancel_during_a_loser_close_closes_the_winner() -> None:
    """Issue 8 (winner leak): the caller's cancel scope expiring between the commit and the
    race's return must close the committed winner (its server sees the disconnect)."""
    baseline = Baseline.take()
    problems = Problems("the caller's cancel during a loser's close")
    check = problems.check
    slow_stream = Behaviour(ttft=0.02, token_delay=0.1, tokens=20)
    async with slow_loser(slow_stream, problems) as s:
        stream = th.hedged_stream(None, [s.primary, s.backup], th.HedgePolicy(hedge_after=HEDGE))
        with trio.move_on_after(0.2) as scope:  # lands while the loser closes (today)
            async with stream:
                async for _ in stream:
                    pass
        check(scope.cancelled_caught, "the cancel scope did not catch its cancellation")
        check(open_responses(s.client) == 0, "the committed winner's response was left open")
        with trio.move_on_after(SOON):
            await s.b.replica.wait_finished(0)
        check(s.b.saw_disconnect(0), "the winner's server never saw a disconnect")
    await problems.leaks(baseline)
    check_final(stream.report, problems)
    check(stream.report.winner == 2, f"winner {stream.report.winner}")
    problems.raise_if_any()


# -- a stray error from the HTTP/2 stack ------------------------------------------------------


class StrayH2Error(httpx.AsyncBaseTransport):
    """httpx's HTTP/2 transport, with the fault the fuzz meets in httpcore 1.0.9 made
    deterministic: after a request to ``port`` has reached its server, httpcore drops the
    stream (its own close: no RST_STREAM) and raises ``ValueError("semaphore released too many
    times")`` out of ``client.send`` (``test_cancel_fuzz``: ~0.2% of h2c races with hedges).
    ``_pool`` is the inner transport's, as the library finds a client's HTTP/2 connections
    there."""

    def __init__(self, port: int) -> None:
        self._inner = httpx.AsyncHTTPTransport(http1=False, http2=True)
        self._pool = self._inner._pool
        self._port = port
        self.raised = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if request.url.port == self._port and not self.raised:
            self.raised += 1
            await response.aclose()  # httpcore forgets the stream without telling the server
            raise ValueError("semaphore released too many times")
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_a_stray_error_from_the_http2_stack_fails_over_and_resets_the_stream() -> None:
    """An exception the HTTP stack should never raise is the connection's trouble, not the
    request's: that attempt fails (retryable) and the next starts at once; and the stream it
    leaves behind is reset, so its server stops (issue 8: "an httpcore protocol error on HTTP/2
    after a cancel is a connection error (retryable), not fatal")."""
    baseline = Baseline.take()
    problems = Problems("a ValueError out of httpcore's HTTP/2 code")
    check = problems.check
    async with fake_server(Behaviour(ttft=NEVER), "primary", http2=True) as p:
        async with fake_server(BACKUP, "backup", http2=True) as b:
            transport = StrayH2Error(p.replica.port)
            client = httpx.AsyncClient(transport=transport)
            async with mb.close_cleanly(client):
                out = await run_stream([p.url, b.url], th.HedgePolicy(hedge_after=NEVER), client)
                check(transport.raised == 1, "the stray error was not raised")
                await problems.within(
                    SOON, "the primary's server never saw its stream end", p.settled()
                )
                check(p.saw_disconnect(0), "the primary's server never saw a reset")
            await problems.within(
                SOON, "a connection was never closed", p.all_closed(), b.all_closed()
            )
    await problems.leaks(baseline)
    expect(
        out,
        problems,
        error=None,
        winner=2,
        attempts=[("primary", O.FAILED), ("failover", O.WON)],
        kinds=[K.CONNECTION, None],
        text=BACKUP_TEXT,
    )
    problems.raise_if_any()


async def test_an_http2_connection_a_cancel_corrupted_is_not_the_requests_fault() -> None:
    """The real fault behind the one above: cancelling the first request of a new HTTP/2
    connection while httpcore 1.0.9 sets the connection up (a loop of semaphore acquires, each
    a checkpoint) leaves its stream semaphore over-full, and the next request on that
    connection raises ``ValueError("semaphore released too many times")``. A hedging library
    cancels attempts all the time. The next request must not fail as the request's fault:
    it fails over (here to a second name for the same server) and gets its answer."""
    baseline = Baseline.take()
    found: list[str] = []
    async with fake_server(BACKUP, "h2", http2=True) as server:
        replicas = [th.Replica(server.url, name="a"), th.Replica(server.url, name="b")]
        policy = th.HedgePolicy(hedge_after=None)
        for checkpoints in range(0, 60, 2):
            client = th.transport.make_client(http1=False, http2=True)
            async with mb.close_cleanly(client):
                with trio.CancelScope() as scope:

                    async def cancel_after(n: int, scope: trio.CancelScope = scope) -> None:
                        for _ in range(n):
                            await trio.lowlevel.checkpoint()
                        scope.cancel()  # the first request, while its connection is set up

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(cancel_after, checkpoints)
                        await run_sources(replicas[:1], policy, client=client, body=REQUEST)
                        nursery.cancel_scope.cancel()
                out = await run_sources(replicas, policy, client=client, body=REQUEST)
                if out.error is not None:
                    found.append(f"cancelled after {checkpoints} checkpoints: {out.error!r}")
                elif "".join(out.tokens) != BACKUP_TEXT:
                    found.append(f"cancelled after {checkpoints} checkpoints: read {out.tokens}")
        with trio.fail_after(SOON):
            await server.settled()
            await server.all_closed()
    await baseline.assert_unchanged("corrupted HTTP/2 connection")
    assert not found, f"{len(found)} of 30 requests failed:\n" + "\n".join(found)


# -- whose fault: replica faults let the others go on; request faults end everything ----------


async def run_fleet(
    behaviours: Sequence[Behaviour], policy: th.HedgePolicy, problems: Problems
) -> tuple[Outcome, list[FakeView]]:
    """One hedged request over FakeReplicas with ``behaviours``, with the leak checks."""
    baseline = Baseline.take()
    async with AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(fake_server(behaviour, f"r{i}"))
            for i, behaviour in enumerate(behaviours)
        ]
        client = th.transport.make_client()
        async with mb.close_cleanly(client):
            out = await run_stream([s.url for s in servers], policy, client)
            problems.check(open_responses(client) == 0, "a response was left open")
            await problems.within(
                SOON, "a server never saw the end of a request", *(s.settled() for s in servers)
            )
        await problems.within(
            SOON, "a connection was never closed", *(s.all_closed() for s in servers)
        )
    await problems.leaks(baseline)
    return out, servers


@pytest.mark.parametrize(
    ("behaviour", "kind"),
    [
        (Behaviour(status=401), K.AUTH),
        (Behaviour(status=403), K.AUTH),
        (Behaviour(status=404), K.NOT_FOUND),
        (Behaviour(status=429, error_message=QUOTA), K.QUOTA_EXCEEDED),
    ],
    ids=["401", "403", "404", "quota"],
)
async def test_a_replica_fault_on_the_backup_lets_the_primary_go_on(
    behaviour: Behaviour, kind: K
) -> None:
    problems = Problems(f"a {kind.value} backup")
    slow_primary = Behaviour(ttft=0.3, tokens=2)
    out, servers = await run_fleet(
        [slow_primary, behaviour], th.HedgePolicy(hedge_after=HEDGE), problems
    )
    expect(
        out,
        problems,
        error=None,
        winner=1,
        attempts=[("primary", O.WON), ("hedge", O.FAILED)],
        kinds=[None, kind],
        text="tok0 tok1 ",
    )
    seen = [s.requests_seen() for s in servers]
    problems.check(seen == [1, 1], f"requests seen {seen}")
    problems.raise_if_any()


async def test_fatal_error_is_the_request_fault_not_an_earlier_transient_one() -> None:
    """``FatalAttemptError.error`` is the request's fault (the 400), not the 503 before it;
    the third attempt, due as a hedge later, never starts."""
    problems = Problems("a 400 after a 503")
    check = problems.check
    out, servers = await run_fleet(
        [
            Behaviour(status=503, error_delay=0.05),  # fails over to the second at 0.05
            Behaviour(status=400, error_delay=0.05),  # the request's fault, at 0.10
            Behaviour(ttft=NEVER),  # would be hedged at 0.05 + 0.2
        ],
        th.HedgePolicy(hedge_after=0.2),
        problems,
    )
    expect(
        out,
        problems,
        error=th.FatalAttemptError,
        winner=None,
        attempts=[("primary", O.FAILED), ("failover", O.FAILED)],
        kinds=[K.OVERLOADED, K.INVALID_REQUEST],
        text="",
    )
    if isinstance(out.error, th.FatalAttemptError):
        check(out.error.error is out.report.attempts[1].error, "not the fatal error")
        check(out.error.error.kind is K.INVALID_REQUEST, f"{out.error.error!r}")
    check([s.requests_seen() for s in servers] == [1, 1, 0], "requests seen")
    problems.raise_if_any()


# -- an empty answer --------------------------------------------------------------------------


EMPTY = Behaviour(ttft=0.1, tokens=0)  # role chunk, then (at 0.1 s) finish reason and [DONE]


async def test_an_empty_answer_does_not_beat_a_running_attempt() -> None:
    problems = Problems("an empty answer with a backup running")
    backup = Behaviour(ttft=0.15, tokens=2)  # hedged at 0.05: its first token at ~0.2 s
    out, _ = await run_fleet([EMPTY, backup], th.HedgePolicy(hedge_after=HEDGE), problems)
    check_final(out.report, problems)
    problems.check(out.error is None, f"raised {out.error!r}")
    problems.check(
        out.report.winner == 2,
        f"attempt {out.report.winner}'s empty answer beat an attempt that was still running",
    )
    problems.check("".join(out.tokens) == "tok0 tok1 ", f"read {out.tokens}")
    problems.raise_if_any()


@pytest.mark.parametrize(
    "backup", [None, Behaviour(status=503, error_delay=0.2)], ids=["alone", "backup fails"]
)
async def test_an_empty_answer_stands_when_nothing_else_can_answer(
    backup: Behaviour | None,
) -> None:
    problems = Problems("an empty answer, nothing else")
    if backup is None:  # alone, never hedged (a lone replica has no backup to send)
        out, _ = await run_fleet([EMPTY], th.HedgePolicy(hedge_after=None), problems)
    else:
        out, _ = await run_fleet([EMPTY, backup], th.HedgePolicy(hedge_after=HEDGE), problems)
    check_final(out.report, problems)
    problems.check(out.error is None, f"raised {out.error!r}")
    problems.check(out.report.winner == 1, f"winner {out.report.winner}")
    problems.check(out.tokens == [], f"read {out.tokens}")
    problems.check(out.report.completed, "not completed")
    problems.raise_if_any()


# -- the TLS test server itself works (so the mismatch cases fail for the right reason) -------


async def healthy(c: ServerConn) -> None:
    await c.send(mb.SSE_HEAD)
    await c.send_chunks(mb.healthy_body(["secure ", "ok"]))
    await c.send(mb.END_OF_BODY)


async def test_the_tls_test_server_serves_https() -> None:
    baseline = Baseline.take()
    async with RawServer(healthy, tls=True) as server:
        context = ssl.create_default_context(cafile=str(mb.TLS_PEM))
        async with httpx.AsyncClient(verify=context) as client:
            out = await run_stream([server.url], th.HedgePolicy(), client)
        with trio.fail_after(SOON):
            await server.wait_connections(0)
    await baseline.assert_unchanged("tls")
    assert out.error is None
    assert "".join(out.tokens) == "secure ok"


# -- brakes over real sockets: failovers are extra requests too -------------------------------


async def test_a_failing_fleet_is_not_stormed_by_failovers() -> None:
    """Issue 8: with every replica failing, the retry throttle (gRFC A6: no retries and no
    hedges at or below half its tokens) gates failovers too. The servers count the requests."""
    baseline = Baseline.take()
    failing = Behaviour(status=503)
    async with AsyncExitStack() as stack:
        fleet = [
            await stack.enter_async_context(FakeReplica(failing, name=name)) for name in "abcd"
        ]
        replicas = [th.Replica(r.url, name=r.name) for r in fleet]
        sent: list[int] = []
        async with th.Hedger(replicas, th.HedgerConfig(hedge_after=NEVER)) as hedger:
            for _ in range(12):
                with pytest.raises(th.AllAttemptsFailed) as info:
                    async with hedger.stream(REQUEST):
                        pass
                assert info.value.report is not None
                sent.append(info.value.report.attempts_sent)
        with trio.fail_after(SOON):
            for r in fleet:
                await r.wait_connections(0)
        received = sum(len(r.requests) for r in fleet)
    await baseline.assert_unchanged("failing fleet")
    assert received == sum(sent)  # the reports count what the servers saw
    # The throttle starts full (10 tokens): the first request tries all four, its first
    # failure on credit (10 -> 7, and 6 once its credit is debited, unserved); the second's
    # failover is decided at its credited first failure (6 > 5), its second failure leaves
    # 5, at half: from then on one attempt per request.
    assert sent == [4, 2] + [1] * 10, f"attempts per request: {sent} ({received} requests)"


async def test_repeated_attempts_to_one_replica_are_throttled() -> None:
    """Issue 8: ``attempts_per_replica=50`` with both replicas failing fast must not send 100
    requests: the throttle allows 6 failures (10 tokens, no retry at half; the request's first
    failure on credit)."""
    baseline = Baseline.take()
    async with FakeReplica(Behaviour(status=503), name="a") as a:
        async with FakeReplica(Behaviour(status=503), name="b") as b:
            replicas = [th.Replica(r.url, name=r.name) for r in (a, b)]
            config = th.HedgerConfig(hedge_after=NEVER, attempts_per_replica=50)
            async with th.Hedger(replicas, config) as hedger:
                with trio.fail_after(10), pytest.raises(th.AllAttemptsFailed) as info:
                    async with hedger.stream(REQUEST):
                        pass
            with trio.fail_after(SOON):
                await a.wait_connections(0)
                await b.wait_connections(0)
            received = len(a.requests) + len(b.requests)
    await baseline.assert_unchanged("attempts per replica")
    assert info.value.report is not None
    assert received == info.value.report.attempts_sent
    assert received <= 6, f"{received} requests for one hedged request"


# -- the report as JSON -----------------------------------------------------------------------


async def test_report_dict_says_what_happened() -> None:
    """Issue 8: ``Report.to_dict()`` (the CLI's ``--json``) carries ``backups_sent`` and the
    fatal error's kind."""
    problems = Problems("report.to_dict()")
    out, _ = await run_fleet(
        [Behaviour(status=400, error_delay=LATE), Behaviour(ttft=NEVER)],
        th.HedgePolicy(hedge_after=HEDGE),
        problems,
    )
    data = out.report.to_dict()
    problems.check(data["hedged"] is True, "hedged")
    problems.check(data.get("backups_sent") == 1, f"backups_sent: {data.get('backups_sent')}")
    problems.check(data["error"]["kind"] == "invalid_request", f"error: {data['error']}")
    problems.raise_if_any()
