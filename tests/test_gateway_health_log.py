"""The health log (issue 31, item 1): each change of a replica's state, a load probe's and
the shared store's is logged once, at INFO or WARNING, with the metrics' names; never a
line per request. The differ is a pure function of two snapshots (a scenario table); a real
gateway over loopback replicas shows the lines an operator gets, with a second caller's
requests going on unchanged."""

from __future__ import annotations

import json
import logging
import signal
import sys
from typing import Any

import attrs
import httpx
import pytest
import trio

import trio_hedge as th
from trio_hedge.events import EventKind, HedgeEvent
from trio_hedge.gateway import _health_log
from trio_hedge.gateway._health_log import (
    HealthLine,
    HealthView,
    ProbeView,
    Verdict,
    announce,
    diff,
)
from trio_hedge.policy import HealthVerdict
from trio_hedge.sources.probes import LoadProbe
from trio_hedge.testing import Behaviour, FakeReplica

from .gateway_support import CHAT, HEDGER, Gateway, config_for
from .test_gateway_serve import _start

WARNING, INFO = logging.WARNING, logging.INFO
K = ("chat", "default", "a", "m", "cooling")
E = ("chat", "default", "a", None, "ejected")
EM = ("chat", "default", "a", "m", "ejected")


def view(t: float, verdicts: Any = None, probes: Any = None, store: Any = None) -> HealthView:
    return HealthView(t, 1_000_000.0 + t, verdicts or {}, probes or {}, store)


def said(lines: list[HealthLine]) -> list[tuple[int, str, dict[str, object]]]:
    return [(line.level, line.summary, dict(line.fields)) for line in lines]


# -- the differ: a pure function of two snapshots ---------------------------------------------

SCENARIOS = [
    pytest.param(
        view(0),
        view(1, {K: Verdict("rate_limited", 3.5)}),
        [
            (INFO, "replica cooling", {"replica": "a", "state": "cooling", "model": "m"}),
        ],
        id="a cooldown begins: INFO, with its reason and Retry-After",
    ),
    pytest.param(
        view(0),
        view(1, {E: Verdict("server_error", 11)}),
        [(WARNING, "replica ejected (every model)", {"state": "ejected", "model": None})],
        id="an ejection for every model: WARNING",
    ),
    pytest.param(
        view(0),
        view(1, {EM: Verdict("auth", 11)}),
        [(WARNING, "replica ejected", {"state": "ejected", "model": "m", "reason": "auth"})],
        id="an ejection for one model names it",
    ),
    pytest.param(
        view(1, {K: Verdict("rate_limited", 3)}),
        view(2, {K: Verdict("rate_limited", 9)}),
        [],
        id="a cooldown pushed further is the same verdict: nothing",
    ),
    pytest.param(
        view(1, {EM: Verdict("auth", 11)}),
        view(12),
        [(INFO, "replica back in service", {"state": "healthy", "was": "ejected"})],
        id="an ejection expires: back in service",
    ),
    pytest.param(
        view(1, {EM: Verdict("auth", 5), K: Verdict("rate_limited", 9)}),
        view(6, {K: Verdict("rate_limited", 9)}),
        [(INFO, "replica ejection over, still cooling", {"state": "cooling", "was": "ejected"})],
        id="one verdict over, another still holds for the model",
    ),
    pytest.param(
        view(1, {K: Verdict("rate_limited", 2)}),
        view(3, {K: Verdict("overloaded", 5)}),
        [(INFO, "replica cooling", {"reason": "overloaded"})],
        id="a cooldown over and a new one between two snapshots: the new one",
    ),
    pytest.param(
        view(0),
        view(1, probes={"a": ProbeView("failing", "HTTP 404 from GET /metrics", 3)}),
        [
            (
                WARNING,
                "probe failing",
                {"status": "failing", "was": "waiting", "error": "HTTP 404 from GET /metrics"},
            )
        ],
        id="a probe that never answered: failing, with why",
    ),
    pytest.param(
        view(0, probes={"a": ProbeView("failing", "ConnectError", 3)}),
        view(1, probes={"a": ProbeView("failing", "ConnectError", 7)}),
        [],
        id="a probe still failing: nothing",
    ),
    pytest.param(
        view(0, probes={"a": ProbeView("failing", "ConnectError", 7)}),
        view(1, probes={"a": ProbeView("fresh", None, 7, 0.1)}),
        [(INFO, "probe answering again", {"status": "fresh", "was": "failing"})],
        id="a failing probe answers again",
    ),
    pytest.param(
        view(0, probes={"a": ProbeView("fresh")}),
        view(1, probes={"a": ProbeView("stale", None, 0, 1.5)}),
        [(WARNING, "probe stale", {"status": "stale", "age": 1.5})],
        id="a probe's reading goes stale",
    ),
    pytest.param(
        view(0),
        view(1, probes={"a": ProbeView("fresh", None, 0, 0.1)}),
        [(INFO, "probe answering", {"status": "fresh", "was": "waiting"})],
        id="a probe's first reading",
    ),
    pytest.param(
        view(0, store="ok"),
        view(1, store="degraded"),
        [(WARNING, "shared store degraded", {"event": "store_status", "status": "degraded"})],
        id="the shared store degraded",
    ),
    pytest.param(
        view(0, store="degraded"),
        view(1, store="ok"),
        [(INFO, "shared store ok again", {"status": "ok", "was": "degraded"})],
        id="the shared store ok again",
    ),
    pytest.param(view(0), view(1, store="local"), [], id="an in-process store: nothing"),
    pytest.param(view(0), view(1, store="ok"), [], id="a store that starts ok: nothing"),
]


@pytest.mark.parametrize(("before", "after", "expected"), SCENARIOS)
def test_the_differ_says_each_change_once(
    before: HealthView, after: HealthView, expected: list[Any]
) -> None:
    lines = said(diff(before, after))
    assert [(level, summary) for level, summary, _ in lines] == [(e[0], e[1]) for e in expected]
    for (_, _, fields), (_, _, wanted) in zip(lines, expected, strict=True):
        assert {k: fields.get(k) for k in wanted} == wanted
    assert diff(after, after) == []  # the same snapshot again: nothing


def test_a_cooldown_line_says_retry_after_and_until() -> None:
    (line,) = diff(view(0), view(1, {K: Verdict("rate_limited", 3.5)}))
    assert line.fields["retry_after"] == 2.5
    assert line.fields["until"] == "1970-01-12T13:46:43.500Z"  # wall 1,000,003.5
    assert line.text() == (
        "replica cooling: replica=a state=cooling model=m reason=rate_limited retry_after=2.5 "
        "until=1970-01-12T13:46:43.500Z api=chat group=default"
    )


def _event(kind: EventKind, t: float, until: float, model: str | None = "m") -> HedgeEvent:
    return HedgeEvent(kind, t, "r1", "m", "a", reason="rate_limited", until=until, model=model)


def test_an_event_is_announced_at_once_and_never_again() -> None:
    """The event's line comes at once; the next comparison, which finds the verdict in the
    statistics, does not repeat it; a second request's 429 for the same cooldown (a longer
    one) says nothing; its end is seen by the comparison; a cooldown after that is new."""
    logged = view(0)
    line, logged = announce(logged, "chat", "default", _event(EventKind.REPLICA_COOLING, 1, 3), 5)
    assert line is not None and line.summary == "replica cooling"
    assert line.fields["retry_after"] == 2.0
    again, logged = announce(
        logged, "chat", "default", _event(EventKind.REPLICA_COOLING, 1.5, 4), 5.5
    )
    assert again is None
    assert diff(logged, view(2, {K: Verdict("rate_limited", 4)})) == []
    ended = diff(view(2, {K: Verdict("rate_limited", 4)}), view(5))
    assert [x.summary for x in ended] == ["replica back in service"]
    new, _ = announce(view(5), "chat", "default", _event(EventKind.REPLICA_COOLING, 6, 8), 9)
    assert new is not None
    whole, _ = announce(
        view(5), "chat", "default", _event(EventKind.REPLICA_EJECTED, 6, 16, None), 9
    )
    assert whole is not None and whole.summary == "replica ejected (every model)"


def test_the_view_reads_every_hedgers_statistics() -> None:
    """``HealthView.of``: each verdict of each replica, per API and group, ends at the
    snapshot's time plus its seconds; each probe once (every Hedger reads one poller)."""
    replica = th.policy.ReplicaStatistics(
        "a", "ejected", 0, 0, 0, 0, 0.0, 10.0, 1, 0,
        probe="failing", probe_error="ConnectError", probe_failures=4,
        verdicts=(HealthVerdict("ejected", None, 10.0, "connection"),),
    )  # fmt: skip
    fields = {f.name: None for f in attrs.fields(th.policy.HedgerStatistics)}
    stats = attrs.evolve(
        th.policy.HedgerStatistics(**fields),  # type: ignore[arg-type]
        time=100.0,
        replicas=(replica,),
    )
    got = HealthView.of({"chat": {"g": stats}, "anthropic": {"g": stats}}, wall=5.0)
    assert got.verdicts == {
        ("chat", "g", "a", None, "ejected"): Verdict("connection", 110.0),
        ("anthropic", "g", "a", None, "ejected"): Verdict("connection", 110.0),
    }
    assert got.probes == {"a": ProbeView("failing", "ConnectError", 4, None)}


# -- a real gateway ---------------------------------------------------------------------------


@pytest.fixture
def fast_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compare every 50 ms (the gateway's default: every second)."""
    monkeypatch.setattr(_health_log, "HEALTH_EVERY", 0.05)


def _health(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "trio_hedge.gateway.health"]


async def _wait_for(caplog: pytest.LogCaptureFixture, summary: str) -> logging.LogRecord:
    while True:
        for record in _health(caplog):
            if getattr(record, "trio_hedge_summary", None) == summary:
                return record
        await trio.sleep(0.01)


@pytest.mark.usefixtures("fast_log")
async def test_a_burst_of_pushback_is_one_line_and_its_end_one_more(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """20 requests at once to a replica that answers 429 with ``Retry-After: 0.5``: one
    "replica cooling" line (INFO, reason, Retry-After, model), not 20; while a second caller's
    requests for another model are served by the same replica meanwhile; then one "back in
    service" line when the cooldown ends."""
    caplog.set_level(logging.INFO)
    busy = Behaviour(status=429, retry_after=0.5, error_delay=0.05)
    async with FakeReplica(busy, name="a") as a, FakeReplica(Behaviour(tokens=2), name="b") as b:
        hedger = attrs.evolve(HEDGER, hedge_after=None)
        async with Gateway(config_for([a, b], hedger=hedger)) as gw:
            async with httpx.AsyncClient(timeout=10) as http:

                async def one(model: str) -> int:
                    body = {**CHAT, "model": model}
                    response = await http.post(f"{gw.url}/chat/completions", json=body)
                    return response.status_code

                with trio.fail_after(10):
                    async with trio.open_nursery() as n:
                        for _ in range(20):
                            n.start_soon(one, "m")
                    a.behaviour = Behaviour(tokens=2)
                    other = await one("other")  # the second caller: another model, served
                    record = await _wait_for(caplog, "replica back in service")
    cooling = [r for r in _health(caplog) if r.trio_hedge_summary == "replica cooling"]  # type: ignore[attr-defined]
    assert len(cooling) == 1, [r.getMessage() for r in _health(caplog)]
    fields = cooling[0].trio_hedge  # type: ignore[attr-defined]
    assert cooling[0].levelno == logging.INFO
    assert fields["replica"] == "a" and fields["model"] == "m"
    assert fields["reason"] == "rate_limit" and fields["retry_after"] == pytest.approx(0.5, abs=0.1)
    assert (fields["api"], fields["group"]) == ("chat", "default")
    assert record.trio_hedge == {  # type: ignore[attr-defined]
        "event": "replica_state", "replica": "a", "state": "healthy", "was": "cooling",
        "model": "m", "api": "chat", "group": "default",
    }  # fmt: skip
    assert other == 200
    ends = [r for r in _health(caplog) if r.trio_hedge_summary == "replica back in service"]  # type: ignore[attr-defined]
    assert len(ends) == 1


@pytest.mark.usefixtures("fast_log")
async def test_a_probe_that_always_fails_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The issue's case: ``probe = "vllm"`` on a server without ``/metrics`` (404 on every
    poll). 20 failed polls give one WARNING naming why, not 20, and requests are served."""
    caplog.set_level(logging.INFO)
    probe = LoadProbe("vllm", interval=0.02, max_age=0.5)
    async with FakeReplica(Behaviour(tokens=2), name="a") as a:
        config = config_for([a])
        config = attrs.evolve(config, replicas=[attrs.evolve(config.replicas[0], probe=probe)])
        async with Gateway(config) as gw, httpx.AsyncClient(timeout=10) as http:
            with trio.fail_after(10):
                polls = index = 0
                while polls < 20:  # 0.4 s: the log compares every 50 ms meanwhile
                    polls += (await a.wait_finished(index)).path == "/metrics"
                    index += 1
                response = await http.post(f"{gw.url}/chat/completions", json=CHAT)
    assert response.status_code == 200
    lines = _health(caplog)
    assert [(r.levelno, r.trio_hedge_summary) for r in lines] == [  # type: ignore[attr-defined]
        (logging.WARNING, "probe failing")
    ]
    assert lines[0].trio_hedge["error"] == "HTTP 404 from GET /metrics"  # type: ignore[attr-defined]
    assert lines[0].getMessage().startswith("probe failing: replica=a status=failing")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
async def test_the_issues_dead_replica_is_in_the_log_as_json() -> None:
    """The issue's case as a process: ``serve --replica <refused> --replica <ok> --pick
    in_order --log-format json``, 6 requests: every stderr line is a JSON object, and one of
    them says the refused replica is ejected (WARNING, reason ``connection``)."""
    with trio.socket.socket() as closed:  # a port nothing listens on
        await closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
    async with FakeReplica(Behaviour(tokens=2), name="ok") as ok, trio.open_nursery() as n:
        args = ["serve", "--replica", dead, "--replica", ok.url, "--pick", "in_order"]
        gw = await _start(n, *args, "--port", "0", "--log-format", "json")
        with trio.fail_after(20):
            line = await gw.line_with("listening on ")
            url = json.loads(line)["message"].split("listening on ")[1].split()[0]
            async with httpx.AsyncClient(timeout=10) as http:
                for _ in range(6):
                    response = await http.post(f"{url}/v1/chat/completions", json=CHAT)
                    assert response.status_code == 200
            await gw.line_with('"replica_state"')
            gw.process.send_signal(signal.SIGTERM)
            assert await gw.process.wait() == 0
            lines = await gw.rest()
    records = [json.loads(x) for x in lines]  # every line is JSON
    ejected = [r for r in records if r.get("event") == "replica_state"]
    assert len(ejected) == 1
    assert ejected[0]["level"] == "warning" and ejected[0]["message"].startswith("replica ejected")
    assert ejected[0]["reason"] == "connection" and ejected[0]["replica"] == dead[7:-3]
    assert len([r for r in records if "request_id" in r]) == 6  # the access log, as it was
