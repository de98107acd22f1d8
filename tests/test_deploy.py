"""The Grafana dashboard and the Prometheus alert rules shipped in ``deploy/`` (issue 31,
item 2): every query names metrics a running gateway exposes, with labels it gives them; the
rules parse and fire when they should (``promtool``, Debian's ``prometheus`` package, when it
is installed: ``.ci/run`` installs it); the dashboard's queries parse too."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from trio_hedge.sources.probes import LoadProbe
from trio_hedge.testing import Behaviour, FakeReplica, fake_replicas, vllm_metrics_page

from .gateway_support import CHAT, HEDGER, Gateway, config_for

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "trio-hedge.json"
ALERTS = ROOT / "deploy" / "prometheus" / "trio-hedge-alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "trio-hedge-alerts.test.yml"
PROMTOOL = shutil.which("promtool")
NEEDS_PROMTOOL = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (apt-get install prometheus; .ci/run does): "
    "the names are still checked by test_every_query_names_what_the_gateway_exposes",
)

#: What Grafana puts in a query before Prometheus sees it.
GRAFANA = {"$__rate_interval": "5m", "$instance": ".*"}
#: PromQL words that are not metric names.
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
KEYWORDS |= {"group_left", "group_right"}
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?")


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [
        target["expr"]
        for panel in board["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"])
            assert match, variable["definition"]
            queries.append(f"count by ({match[2]}) ({match[1]})")
    out = []
    for query in queries:
        for old, new in GRAFANA.items():
            query = query.replace(old, new)
        assert "$" not in query, query
        out.append(query)
    return out


def alert_queries() -> dict[str, str]:
    """Each alert's ``expr`` (a small reader of the rules file's layout: no YAML library)."""
    text = ALERTS.read_text()
    found: dict[str, str] = {}
    for block in text.split("- alert: ")[1:]:
        name = block.split("\n", 1)[0].strip()
        expr = block.split("expr:", 1)[1]
        if expr.lstrip().startswith(">-"):  # a folded block, up to the "for:" line
            lines = expr.split("\n")[1:]
            end = next(i for i, x in enumerate(lines) if x.strip().startswith("for:"))
            expr = " ".join(x.strip() for x in lines[:end])
        else:
            expr = expr.split("\n", 1)[0]
        found[name] = expr.strip()
    return found


def selectors(query: str) -> list[tuple[str, set[str]]]:
    """Every ``metric{label…}`` of a PromQL query: its name and the label names it matches
    on. Strings, ranges, ``by (…)``/``on (…)`` clauses and function calls are not metrics."""
    query = re.sub(r'"(?:[^"\\]|\\.)*"', '""', query)
    query = re.sub(r"\[[^\]]*\]", "", query)
    query = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", query)
    out = []
    for match in _SELECTOR.finditer(query):
        name, matchers = match[1], match[2]
        rest = query[match.end(1) :].lstrip()
        if name in KEYWORDS or rest.startswith("("):
            continue  # a keyword or a function
        if match.start() and query[match.start() - 1].isdigit():
            continue  # the exponent or unit of a number
        labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers or ""))
        out.append((name, labels))
    return out


def exposed(text: str) -> dict[str, set[str]]:
    """The series names a ``/metrics`` page exposes (from its ``# TYPE`` lines, so a
    family with no sample yet counts), each with the label names its samples carry."""
    names: dict[str, set[str]] = {}
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "gauge": ("",),
        "summary": ("", "_count", "_sum", "_created"),
    }
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            if kind == "counter":  # the TYPE line names it with its _total already
                family = family.removesuffix("_total")
            for suffix in suffixes.get(kind, ("",)):
                names.setdefault(family + suffix, set())
        elif line and not line.startswith("#"):
            name = line.split("{")[0].split()[0]
            labels = re.findall(r'(\w+)="', line.split("{", 1)[1]) if "{" in line else []
            names.setdefault(name, set()).update(labels)
    return names


async def _a_busy_gateways_metrics() -> str:
    """``/metrics`` of a gateway that has done what the dashboard shows: hedged requests,
    a backup that won, a refusal, a probed replica (a vLLM page), every route."""
    hedger = attrs.evolve(HEDGER, hedge_after=0.05)
    async with fake_replicas(
        Behaviour(ttft=0.3, tokens=2), Behaviour(tokens=2), names=["slow", "fast"]
    ) as (slow, fast):
        slow.pages["/metrics"] = vllm_metrics_page(waiting=1, running=2)
        config = config_for([slow, fast], hedger=hedger, keys=("sk-gateway-key-0123456789",))
        probe = LoadProbe("vllm", interval=0.05)
        replicas = [attrs.evolve(config.replicas[0], probe=probe), config.replicas[1]]
        async with Gateway(attrs.evolve(config, replicas=replicas)) as gw:
            auth = {"authorization": "Bearer sk-gateway-key-0123456789"}
            async with httpx.AsyncClient(timeout=10, headers=auth) as http:
                for _ in range(3):
                    answer = await http.post(f"{gw.url}/chat/completions", json=CHAT)
                    assert answer.status_code == 200
                async with httpx.AsyncClient(timeout=10) as anonymous:  # a refusal: auth
                    assert (await anonymous.get(f"{gw.url}/models")).status_code == 401
                index = 0
                while (await slow.wait_finished(index)).path != "/metrics":
                    index += 1  # until the probe has read the engine once
                return (await http.get(f"{gw.base_url}/metrics")).text


async def test_every_query_names_what_the_gateway_exposes() -> None:
    """Every dashboard and alert query's metrics are on a running gateway's ``/metrics``,
    and every label a query matches on is one their samples carry."""
    with trio.fail_after(20):
        metrics = exposed(await _a_busy_gateways_metrics())
    queries = {f"dashboard: {q}": q for q in dashboard_queries()}
    queries.update({f"alert {name}": q for name, q in alert_queries().items()})
    assert len(queries) >= 25
    used: set[str] = set()
    for where, query in queries.items():
        found = selectors(query)
        assert found, where
        carried = {"instance", "job"}  # the labels Prometheus adds at the scrape
        for name, labels in found:
            assert name in metrics, f"{where}: {name} is not exposed"
            if metrics[name]:  # it has samples: their labels
                assert labels <= metrics[name] | carried, (where, name, labels)
            carried |= metrics[name]
            used.add(name)
        if all(metrics[name] for name, _ in found):  # every label known: the grouping too
            for clause in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", query):
                grouped = {x.strip() for x in clause.split(",") if x.strip()}
                assert grouped <= carried, (where, grouped - carried)
    # What the issue asks the dashboard to show is there.
    for shown in (
        "trio_hedge_gateway_ttft_seconds_bucket",
        "trio_hedge_requests_total",
        "trio_hedge_gateway_hedge_budget_used",
        "trio_hedge_backups_won_total",
        "trio_hedge_attempts_total",
        "trio_hedge_gateway_replica_state",
        "trio_hedge_gateway_probe_waiting",
        "trio_hedge_gateway_refused_total",
    ):
        assert shown in used, shown


def test_the_three_alerts_that_page() -> None:
    alerts = alert_queries()
    assert set(alerts) == {
        "TrioHedgeNoEligibleReplica",
        "TrioHedgeHedgeBudgetExhausted",
        "TrioHedgeErrorRatio",
    }
    assert ALERTS.read_text().count("severity: page") == 3


def test_the_parser_finds_metrics_and_only_metrics() -> None:
    query = (
        'histogram_quantile(0.99, sum by (le, group) (rate(a_bucket{x="1 or b", y=~"c"}[5m])))'
        " / on (group) group_left sum without (z) (b_total) > bool 1e3 unless c offset 5m"
    )
    assert selectors(query) == [("a_bucket", {"x", "y"}), ("b_total", set()), ("c", set())]


@NEEDS_PROMTOOL
def test_promtool_checks_the_rules_and_their_unit_tests(tmp_path: Path) -> None:
    """``promtool check rules`` on the alert rules, ``promtool test rules`` on their unit
    tests (each alert fires when it should, not before its ``for``), and every dashboard
    query parsed by Prometheus's own parser (as recording rules)."""
    assert PROMTOOL is not None
    subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], check=True, capture_output=True)
    done = subprocess.run(
        [PROMTOOL, "test", "rules", ALERT_TESTS.name],
        cwd=ALERT_TESTS.parent,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for n, query in enumerate(dashboard_queries()):
        rules += [f"      - record: dashboard:query{n}", f"        expr: {json.dumps(query)}"]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text("\n".join(rules) + "\n")
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


async def test_the_probe_families_are_exposed_without_a_probe() -> None:
    """A gateway with no probed replica still names the probe families (``# TYPE``), so the
    dashboard's probe panels query metrics that exist (empty), not unknown names."""
    async with FakeReplica(Behaviour(tokens=2), name="a") as a, Gateway(config_for([a])) as gw:
        async with httpx.AsyncClient(timeout=10) as http:
            metrics = exposed((await http.get(f"{gw.base_url}/metrics")).text)
    assert "trio_hedge_gateway_probe_waiting" in metrics
    assert "trio_hedge_gateway_hedge_budget_used" in metrics
