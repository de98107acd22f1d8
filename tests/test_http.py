"""The OpenAI-compatible HTTP source end to end: exact virtual time over httpx.MockTransport,
and real loopback sockets for what only real I/O shows (disconnects, leaks)."""

from __future__ import annotations

import logging
import random
import uuid

import attrs
import httpx
import pytest
import trio
import trio.testing

import trio_hedge as th
from trio_hedge import HedgePolicy
from trio_hedge.errors import ErrorKind
from trio_hedge.report import AttemptOutcome as O
from trio_hedge.testing import Behaviour, FakeReplica, MockReplicas, fake_replicas

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SECRET = "sk-test-very-secret-0123456789"


def _replicas(mock: MockReplicas, *names: str, **kw: object) -> list[th.Replica]:
    return [th.Replica(mock.url(n), name=n, api_key=SECRET, **kw) for n in names]  # type: ignore[arg-type]


# -- virtual time: the race over HTTP, exact ---------------------------------------------------


@attrs.frozen
class HttpCase:
    name: str
    primary: Behaviour
    backup: Behaviour
    winner: int | None
    starts: tuple[float, ...]
    outcomes: tuple[O, ...]
    ttft: float | None
    error: type[BaseException] | None = None
    kinds: tuple[ErrorKind, ...] = ()


SLOW = Behaviour(ttft=5.0, token_delay=0.1, tokens=3)
FAST = Behaviour(ttft=0.5, token_delay=0.1, tokens=3)

HTTP_CASES = [
    HttpCase("backup wins", SLOW, FAST, 2, (0.0, 1.0), (O.CANCELLED, O.WON), 1.5),
    HttpCase("primary wins", FAST, SLOW, 1, (0.0,), (O.WON,), 0.5),
    HttpCase(
        "500 fails over at once",
        Behaviour(status=500, error_delay=0.1),
        FAST,
        2,
        (0.0, 0.1),
        (O.FAILED, O.WON),
        0.6,
        kinds=(ErrorKind.SERVER_ERROR,),
    ),
    HttpCase(
        "503 fails over at once",
        Behaviour(status=503, error_delay=0.2),
        FAST,
        2,
        (0.0, 0.2),
        (O.FAILED, O.WON),
        0.7,
        kinds=(ErrorKind.OVERLOADED,),
    ),
    HttpCase(
        "408 fails over at once",
        Behaviour(status=408, error_delay=0.2),
        FAST,
        2,
        (0.0, 0.2),
        (O.FAILED, O.WON),
        0.7,
        kinds=(ErrorKind.TIMEOUT,),
    ),
    HttpCase(
        "429 fails over at once",
        Behaviour(status=429, retry_after=3),
        FAST,
        2,
        (0.0, 0.0),
        (O.FAILED, O.WON),
        0.5,
        kinds=(ErrorKind.RATE_LIMIT,),
    ),
    HttpCase(
        "cut before the first token fails over",
        Behaviour(ttft=0.3, cut_after=0),
        FAST,
        2,
        (0.0, 0.3),
        (O.FAILED, O.WON),
        0.8,
        kinds=(ErrorKind.STREAM_TRUNCATED,),
    ),  # the role chunk was data: truncated
    *[
        HttpCase(
            f"{status} is fatal",
            Behaviour(status=status, error_delay=0.1),
            FAST,
            None,
            (0.0,),
            (O.FAILED,),
            None,
            th.FatalAttemptError,
            (kind,),
        )
        for status, kind in [
            (400, ErrorKind.INVALID_REQUEST),
            (413, ErrorKind.INVALID_REQUEST),
            (422, ErrorKind.INVALID_REQUEST),
        ]
    ],
    *[
        HttpCase(
            f"{status} is the replica's fault: fail over at once",
            Behaviour(status=status, error_delay=0.1),
            FAST,
            2,
            (0.0, 0.1),
            (O.FAILED, O.WON),
            0.6,
            kinds=(kind,),
        )
        for status, kind in [
            (401, ErrorKind.AUTH),
            (403, ErrorKind.AUTH),
            (404, ErrorKind.NOT_FOUND),
        ]
    ],
    HttpCase(
        "both fail",
        Behaviour(status=500, error_delay=0.1),
        Behaviour(status=502, error_delay=0.1),
        None,
        (0.0, 0.1),
        (O.FAILED, O.FAILED),
        None,
        th.AllAttemptsFailed,
        (ErrorKind.SERVER_ERROR, ErrorKind.SERVER_ERROR),
    ),
]


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.name for c in HTTP_CASES])
async def test_http_race(case: HttpCase, autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas({"primary": case.primary, "backup": case.backup})
    t0 = trio.current_time()
    async with httpx.AsyncClient(transport=mock.transport) as client:
        stream = th.hedged_stream(REQUEST, _replicas(mock, "primary", "backup"), client=client)
        if case.error is None:
            async with stream:
                text = "".join([t async for t in stream])
            assert text == "tok0 tok1 tok2 "
            report = stream.report
            assert report.total == pytest.approx(case.ttft + 0.2)  # type: ignore[operator]
        else:
            with pytest.raises(case.error) as info:
                async with stream:
                    pass
            assert [e.kind for e in info.value.errors] == list(case.kinds)  # type: ignore[attr-defined]
            report = stream.report
    assert [a.started_at for a in report.attempts] == list(case.starts)
    assert tuple(a.outcome for a in report.attempts) == case.outcomes
    assert report.ttft == case.ttft
    assert tuple(a.error.kind for a in report.attempts if a.error) == case.kinds
    # Every request the replicas saw ended: completed, or seen disconnecting at its loss.
    for name, records in mock.requests.items():
        for record in records:
            assert record.finished_at is not None, (name, record)
            if record.disconnected_at is not None:
                assert record.disconnected_at - t0 in (case.ttft, *case.starts[1:])
    if case.winner == 2:
        loser = mock.requests["primary"][0]
        if case.primary.status == 200 and case.primary.cut_after is None:
            assert loser.disconnected_at is not None
            assert loser.disconnected_at - t0 == case.ttft  # at the commit, to the tick


async def test_retry_after_is_on_the_error(autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas({"primary": Behaviour(status=429, retry_after=2.5)})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        with pytest.raises(th.AllAttemptsFailed) as info:
            async with th.hedged_stream(REQUEST, _replicas(mock, "primary"), client=client):
                pass
    (error,) = info.value.errors
    assert error.kind is ErrorKind.RATE_LIMIT
    assert error.retry_after == 2.5
    assert error.status_code == 429
    assert error.replica == "primary"


async def test_headers_body_and_overrides(autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas({"primary": SLOW, "backup": FAST})
    replicas = [
        th.Replica(mock.url("primary"), name="primary", api_key=SECRET),
        th.Replica(
            mock.url("backup"),
            name="backup",
            overrides={"model": "small"},
            headers={"X-Extra": "1"},
        ),
    ]
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.hedged_stream(REQUEST, replicas, client=client) as stream:
            [t async for t in stream]
    p, b = mock.requests["primary"][0], mock.requests["backup"][0]
    assert uuid.UUID(p.headers["x-request-id"]).version == 4  # servers that demand a UUID accept it
    assert p.headers["x-request-id"] == b.headers["x-request-id"] == stream.request_id
    assert (p.headers["x-hedge-attempt"], b.headers["x-hedge-attempt"]) == ("1", "2")
    assert p.headers["authorization"] == f"Bearer {SECRET}"
    assert "authorization" not in b.headers
    assert b.headers["x-extra"] == "1"
    assert p.json == {**REQUEST, "stream": True}
    assert b.json == {**REQUEST, "model": "small", "stream": True}


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (th.sources.HeaderNames(request_id="X-Correlation-ID", attempt=None), {"x-correlation-id"}),
        (th.sources.HeaderNames(request_id=None, attempt="X-Try"), {"x-try"}),
        (th.sources.HeaderNames(request_id=None, attempt=None), set()),
    ],
)
async def test_header_names_configurable(
    names: th.sources.HeaderNames, expected: set[str], autojump_clock: trio.testing.MockClock
) -> None:
    mock = MockReplicas({"primary": FAST})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.hedged_stream(
            REQUEST, _replicas(mock, "primary"), client=client, headers=names
        ) as stream:
            [t async for t in stream]
    sent = set(mock.requests["primary"][0].headers)
    assert sent & {"x-request-id", "x-hedge-attempt", "x-correlation-id", "x-try"} == expected


async def test_secrets_never_leak(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    mock = MockReplicas({"primary": Behaviour(status=400), "backup": FAST})
    replicas = [
        th.Replica(
            mock.url("primary"), name="primary", api_key=SECRET, headers={"api-key": SECRET}
        ),
        th.Replica(mock.url("backup"), name="backup", api_key=SECRET),
    ]
    async with httpx.AsyncClient(transport=mock.transport) as client:
        stream = th.hedged_stream(REQUEST, replicas, client=client)
        with pytest.raises(th.FatalAttemptError) as info:
            async with stream:
                pass
    seen = [
        repr(replicas),
        str(replicas),
        repr(stream.report),
        str(stream.report.to_dict()),
        str(info.value),
        repr(info.value),
        repr(info.value.errors),
        str(info.value.__cause__),
        caplog.text,
        repr(mock.requests["primary"][0]),
    ]
    for text in seen:
        assert SECRET not in text


async def test_a_key_echoed_by_the_server_is_masked(autojump_clock: trio.testing.MockClock) -> None:
    echo = f"Incorrect API key provided: {SECRET}. You can find your API key at ..."
    mock = MockReplicas(
        {
            "primary": Behaviour(status=401, error_message=echo),
            "backup": Behaviour(inband_error_after=0, inband_error_status=401, error_message=echo),
        }
    )
    for name in ("primary", "backup"):
        async with httpx.AsyncClient(transport=mock.transport) as client:
            stream = th.hedged_stream(REQUEST, _replicas(mock, name), client=client)
            with pytest.raises(th.AllAttemptsFailed) as info:
                async with stream:
                    pass
        (error,) = info.value.errors
        assert error.kind is ErrorKind.AUTH
        assert error.message == "Incorrect API key provided: ***. You can find your API key at ..."
        for text in (str(info.value), repr(error), str(error.args), str(stream.report.to_dict())):
            assert SECRET not in text


async def test_owned_client_is_closed_and_callers_client_is_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas({"primary": FAST})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.hedged_stream(REQUEST, _replicas(mock, "primary"), client=client) as s:
            [t async for t in s]
        assert not client.is_closed
    stream = th.hedged_stream(REQUEST, [th.Replica("http://127.0.0.1:9/v1")])
    owned = stream._owned_client
    assert owned is not None
    with pytest.raises(th.AllAttemptsFailed):
        async with stream:
            pass
    assert owned.is_closed


async def test_cut_after_commit_keeps_partial_text(autojump_clock: trio.testing.MockClock) -> None:
    mock = MockReplicas({"primary": Behaviour(ttft=0.5, token_delay=0.1, tokens=5, cut_after=2)})
    got: list[str] = []
    async with httpx.AsyncClient(transport=mock.transport) as client:
        with pytest.raises(th.StreamInterrupted) as info:
            async with th.hedged_stream(REQUEST, _replicas(mock, "primary"), client=client) as s:
                async for token in s:
                    got.append(token)
    assert got == ["tok0 ", "tok1 "]
    assert info.value.text == "tok0 tok1 "
    assert info.value.error.kind is ErrorKind.STREAM_TRUNCATED
    assert info.value.report is not None and info.value.report.text == "tok0 tok1 "


async def test_keepalives_and_role_chunks_are_not_a_first_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The primary sends headers, a role-only chunk and keep-alive comments at once, but its
    # first token only at 5 s: the backup must still be sent at 1 s and win.
    primary = Behaviour(ttft=5.0, tokens=3)
    mock = MockReplicas({"primary": primary, "backup": FAST})
    async with httpx.AsyncClient(transport=mock.transport) as client:
        async with th.hedged_stream(
            REQUEST, _replicas(mock, "primary", "backup"), client=client
        ) as s:
            [t async for t in s]
    assert s.report.winner == 2
    assert s.report.ttft == 1.5


async def test_stall_timeout_over_http_with_keepalives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mock = MockReplicas(
        {"primary": Behaviour(ttft=0.5, tokens=5, stall_after=2, keepalive_interval=0.5)}
    )
    t0 = trio.current_time()
    async with httpx.AsyncClient(transport=mock.transport) as client:
        with pytest.raises(th.StreamInterrupted) as info:
            async with th.hedged_stream(
                REQUEST,
                _replicas(mock, "primary"),
                client=client,
                policy=HedgePolicy(stall_timeout=2.0),
            ) as s:
                [t async for t in s]
    assert info.value.error.kind is ErrorKind.STALL
    assert info.value.text == "tok0 tok1 "
    assert trio.current_time() - t0 == 0.5 + 2.0  # keep-alives every 0.5 s did not reset it
    assert mock.requests["primary"][0].disconnected_at == t0 + 2.5


class _TokenThenErrorThenSilence(httpx.AsyncByteStream):
    """One read carrying a token and an in-band error, then a connection left open."""

    def __init__(self) -> None:
        self.closed = False
        self._sent = False

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        yield (
            b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
            b'data: {"error":{"message":"model crashed","type":"server_error"}}\n\n'
        )
        await trio.sleep_forever()

    async def aclose(self) -> None:
        self.closed = True


async def test_in_band_error_behind_a_token_is_raised_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = _TokenThenErrorThenSilence()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

    t0 = trio.current_time()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(th.StreamInterrupted) as info:
            async with th.hedged_stream(
                REQUEST, [th.Replica("http://x.test/v1")], client=client
            ) as s:
                [t async for t in s]
    assert info.value.text == "tok"
    assert info.value.error.kind is ErrorKind.SERVER_ERROR
    assert trio.current_time() == t0  # not after a read that never comes
    assert body.closed


# -- real sockets ------------------------------------------------------------------------------


async def test_loser_server_sees_disconnect_within_50ms_of_commit() -> None:
    async with fake_replicas(
        Behaviour(ttft=3.0, tokens=3), Behaviour(ttft=0.05, token_delay=0.01, tokens=3)
    ) as (primary, backup):
        replicas = [th.Replica(primary.url, name="p"), th.Replica(backup.url, name="b")]
        async with httpx.AsyncClient() as client:
            stream = th.hedged_stream(
                REQUEST, replicas, HedgePolicy(hedge_after=0.05), client=client
            )
            async with stream:
                assert "".join([t async for t in stream]) == "tok0 tok1 tok2 "
            with trio.fail_after(1):
                record = await primary.wait_disconnected(0)
        origin = stream.started_at
        assert stream.report.winner == 2
        assert record.disconnected_at is not None and stream.report.ttft is not None
        lag = record.disconnected_at - (origin + stream.report.ttft)
        assert 0 <= lag < 0.050, f"loser's server saw the disconnect {lag * 1000:.1f} ms late"
        assert record.tokens_sent == 0


def _tasks_below(task: trio.lowlevel.Task) -> int:
    return sum(1 + _tasks_below(t) for n in task.child_nurseries for t in n.child_tasks)


async def test_200_mixed_races_leave_nothing_open() -> None:
    rng = random.Random(7)

    def behaviour(record: object) -> Behaviour:
        roll = rng.random()
        if roll < 0.15:
            return Behaviour(status=503)
        if roll < 0.25:
            return Behaviour(ttft=0.02, tokens=4, cut_after=1)
        return Behaviour(ttft=rng.choice([0.0, 0.005, 0.03]), token_delay=0.001, tokens=4)

    outcomes: dict[str, int] = {}
    root = trio.lowlevel.current_root_task()
    tasks_before = _tasks_below(root)
    async with (
        FakeReplica(behaviour, name="a") as a,
        FakeReplica(behaviour, name="b") as b,
        FakeReplica(behaviour, name="c") as c,
    ):
        replicas = [th.Replica(r.url, name=r.name) for r in (a, b, c)]
        async with httpx.AsyncClient() as client:
            for i in range(200):
                order = rng.sample(replicas, 3)
                policy = HedgePolicy(hedge_after=0.01)
                stream = th.hedged_stream(REQUEST, order, policy, client=client)
                mode = i % 4  # 0: read all, 1: break, 2: cancel mid-race/stream, 3: read all
                try:
                    with trio.move_on_after(0.012 if mode == 2 else 10):
                        async with stream:
                            async for _ in stream:
                                if mode == 1:
                                    break
                    key = "cancelled" if stream.report.winner is None and mode == 2 else "ok"
                except th.HedgeError as exc:
                    key = type(exc).__name__
                outcomes[key] = outcomes.get(key, 0) + 1
            pool = client._transport._pool  # type: ignore[attr-defined]
            assert all(not conn.is_available() or conn.is_idle() for conn in pool.connections)
        # Every request the replicas saw has ended, and no server-side connection is open.
        for replica in (a, b, c):
            for record in replica.requests:
                with trio.fail_after(1):
                    await record.wait_finished()
        assert (a.open_connections, b.open_connections, c.open_connections) == (0, 0, 0)
    assert _tasks_below(root) == tasks_before
    assert sum(outcomes.values()) == 200
    assert outcomes.get("ok", 0) > 100
    assert len(outcomes) >= 2, outcomes


def test_sources_validate_their_input() -> None:
    with pytest.raises(ValueError, match="http"):
        th.Replica("ftp://x")
    with pytest.raises(ValueError, match="credentials"):
        th.Replica("http://user:pw@x/v1")
    with pytest.raises(TypeError):
        th.Replica(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapping"):
        th.hedged_stream("hi", [th.Replica("http://x/v1")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="header"):
        th.sources.HeaderNames(request_id="bad:name")
    assert SECRET not in repr(th.Replica("http://x/v1", api_key=SECRET, headers={"k": SECRET}))


# -- every error class over real sockets: next attempt at once, or fatal -----------------------

QUOTA = "You exceeded your current quota, please check your plan and billing details."
CONTEXT = "This model's maximum context length is 8192 tokens. Please reduce the length."

SOCKET_ERRORS = [
    # (name, primary behaviour, expected kind, fatal?)
    ("429 rate limit", Behaviour(status=429, retry_after=1), ErrorKind.RATE_LIMIT, False),
    ("429 quota", Behaviour(status=429, error_message=QUOTA), ErrorKind.QUOTA_EXCEEDED, False),
    ("500", Behaviour(status=500), ErrorKind.SERVER_ERROR, False),
    ("502", Behaviour(status=502), ErrorKind.SERVER_ERROR, False),
    ("503", Behaviour(status=503), ErrorKind.OVERLOADED, False),
    ("529", Behaviour(status=529), ErrorKind.OVERLOADED, False),
    ("408", Behaviour(status=408), ErrorKind.TIMEOUT, False),
    ("400", Behaviour(status=400), ErrorKind.INVALID_REQUEST, True),
    (
        "400 context length",
        Behaviour(status=400, error_message=CONTEXT),
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        True,
    ),
    ("401", Behaviour(status=401), ErrorKind.AUTH, False),
    ("403", Behaviour(status=403), ErrorKind.AUTH, False),
    ("404", Behaviour(status=404), ErrorKind.NOT_FOUND, False),
    ("413", Behaviour(status=413), ErrorKind.INVALID_REQUEST, True),
    ("422", Behaviour(status=422), ErrorKind.INVALID_REQUEST, True),
    (
        "in-band server error before the first token",
        Behaviour(inband_error_after=0),
        ErrorKind.SERVER_ERROR,
        False,
    ),
    (
        "in-band rate limit before the first token",
        Behaviour(inband_error_after=0, inband_error_status=429),
        ErrorKind.RATE_LIMIT,
        False,
    ),
    (
        "in-band context length before the first token",
        Behaviour(inband_error_after=0, inband_error_status=400, error_message=CONTEXT),
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        True,
    ),
    ("cut before the first token", Behaviour(cut_after=0), ErrorKind.STREAM_TRUNCATED, False),
    (
        "a role chunk, then the end",
        Behaviour(tokens=0, send_done=False, usage=False, finish_reason=""),
        ErrorKind.STREAM_TRUNCATED,
        False,
    ),
]


@pytest.mark.parametrize(
    ("name", "primary", "kind", "fatal"), SOCKET_ERRORS, ids=[c[0] for c in SOCKET_ERRORS]
)
async def test_error_classes_over_real_sockets(
    name: str, primary: Behaviour, kind: ErrorKind, fatal: bool
) -> None:
    backup = Behaviour(ttft=0.01, tokens=2)
    async with fake_replicas(primary, backup) as (p, b):
        replicas = [th.Replica(p.url, name="p"), th.Replica(b.url, name="b")]
        async with httpx.AsyncClient() as client:
            # A long hedge delay: any backup that starts does so because of the failure.
            stream = th.hedged_stream(REQUEST, replicas, HedgePolicy(hedge_after=30), client=client)
            if fatal:
                with pytest.raises(th.FatalAttemptError) as info:
                    async with stream:
                        pass
                assert info.value.error.kind is kind
                assert len(b.requests) == 0  # a backup would fail the same way: none was sent
            else:
                async with stream:
                    assert "".join([t async for t in stream]) == "tok0 tok1 "
                first, second = stream.report.attempts
                assert second.trigger == "failover"
                assert first.error is not None
                assert first.error.kind is kind
                assert second.started_at is not None and second.started_at < 5  # not at 30 s


@pytest.mark.parametrize("encoding", [None, "gzip", "identity"])
async def test_compressed_plain_and_preread_bodies(
    encoding: str | None, autojump_clock: trio.testing.MockClock
) -> None:
    import gzip

    body = (
        b'data: {"choices":[{"index":0,"delta":{"content":"caf\xc3\xa9 "}}]}\n\n'
        b'data: {"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\n'
        b"data: [DONE]\n\n"
    )
    headers = {"content-type": "text/event-stream"}
    if encoding is not None:
        headers["content-encoding"] = encoding
    wire = gzip.compress(body) if encoding == "gzip" else body

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=headers, content=wire)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        async with th.hedged_stream(
            REQUEST, [th.Replica("http://x.test/v1")], client=client
        ) as stream:
            tokens = [t async for t in stream]
    assert tokens == ["café ", "ok"]
    assert stream.report.completed
