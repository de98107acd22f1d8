"""The layout holds: trio_hedge's import graph has no cycle, and the race engine imports no
HTTP library and nothing of the sources or the policy (docs/layout.md).

The graph is read from the source with :mod:`ast`, not from ``sys.modules``, so it shows what
each module asks for, whatever happens to be imported already. Every import counts, wherever
it is written: module level, ``if TYPE_CHECKING:`` blocks (a type-only cycle is still a cycle
in the design: the two modules cannot be understood apart) and imports inside functions
(lazy imports still say which way the dependency runs). Importing ``a.b.c`` also imports the
package ``a.b`` (its ``__init__`` first): that edge counts too, unless the importer is inside
``a.b`` (then ``a.b`` is being imported already) or it is the top-level ``trio_hedge``, which
only re-exports and is always imported first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import trio_hedge

PACKAGE = "trio_hedge"
ROOT = Path(trio_hedge.__file__).parent

#: The race engine: it races :class:`~trio_hedge.sources.Source` s through a
#: :class:`~trio_hedge.policy.Planner` and records a report; it knows no HTTP.
ENGINE = (
    "trio_hedge._race",
    "trio_hedge._stream",
    "trio_hedge._recovery",
    "trio_hedge._verify",
    "trio_hedge._plan",
    "trio_hedge._source",
    "trio_hedge._attempt_error",
    "trio_hedge.report",
    "trio_hedge.errors",
    "trio_hedge.events",
)
#: What the engine may not reach, directly or through the modules it imports.
HTTP_LIBRARIES = ("httpx", "httpcore", "h11", "h2")
OUTSIDE_THE_ENGINE = ("trio_hedge.sources", "trio_hedge.policy", "trio_hedge.transport")


def _modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: modules it imports}``: trio_hedge's own modules, and the top-level name of
    every other package (``httpx``)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                targets.add(base)
                # ``from . import report``: the submodule, when it is one.
                targets.update(
                    f"{base}.{alias.name}"
                    for alias in node.names
                    if f"{base}.{alias.name}" in modules
                )
        edges: set[str] = set()
        for target in targets:
            if target.split(".")[0] != PACKAGE:
                edges.add(target.split(".")[0])
                continue
            parts = target.split(".")
            # The module itself, and every package above it but the top-level one and the
            # importer's own packages (being imported already when the importer runs).
            for end in range(2, len(parts) + 1):
                candidate = ".".join(parts[:end])
                if candidate in modules and not (
                    end < len(parts) and name.startswith(candidate + ".")
                ):
                    edges.add(candidate)
            if target == PACKAGE:
                edges.add(PACKAGE)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue  # another package
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """What ``start`` imports, directly or through the modules it imports (the top-level
    package, a re-export facade, is not followed)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                if nxt != PACKAGE:
                    todo.append(nxt)
    return seen


def test_the_import_graph_has_no_cycle() -> None:
    assert find_cycles(import_graph()) == []


def test_the_graph_sees_type_checking_and_relative_imports() -> None:
    """The reader finds the edges the other tests rely on (a reader that found none would
    pass them all)."""
    graph = import_graph()
    assert "trio_hedge.report" in graph["trio_hedge.errors"]  # under TYPE_CHECKING
    assert "trio_hedge._race" in graph["trio_hedge._stream"]
    assert "httpx" in graph["trio_hedge.sources.openai._http"]
    assert "trio_hedge.sources" in graph["trio_hedge._oneshot"]  # the package of .sources.openai
    assert "trio_hedge.gateway._app" in graph["trio_hedge.gateway"]  # inside a function
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_knows_no_http_no_source_and_no_policy() -> None:
    graph = import_graph()
    for module in ENGINE:
        assert module in graph, f"{module} is gone: update ENGINE and docs/layout.md"
        reach = reachable(graph, module)
        assert not reach & set(HTTP_LIBRARIES), (module, sorted(reach & set(HTTP_LIBRARIES)))
        outside = sorted(m for m in reach for prefix in OUTSIDE_THE_ENGINE if m.startswith(prefix))
        assert not outside, (module, outside)


def test_data_flows_one_way() -> None:
    """Nothing below reaches back up: sources never import the policy, the Hedger or the
    front ends; the policy never imports the race or the Hedger; nothing in the library but
    its front ends imports the gateway or the CLI."""
    graph = import_graph()
    upward = {
        "trio_hedge.sources": ("trio_hedge.policy", "trio_hedge.hedger", "trio_hedge._oneshot"),
        "trio_hedge.policy": ("trio_hedge._race", "trio_hedge._stream", "trio_hedge.hedger"),
        "trio_hedge.transport": ("trio_hedge.sources", "trio_hedge.policy", "trio_hedge._race"),
    }
    front_ends = ("trio_hedge.gateway", "trio_hedge.cli", "trio_hedge.aio", "trio_hedge.tune")
    entry_points = ("trio_hedge.__main__", "trio_hedge.cli")  # `python -m`, `trio-hedge serve`
    for module, imports in graph.items():
        for prefix, forbidden in upward.items():
            if module.startswith(prefix):
                bad = sorted(m for m in imports for f in forbidden if m.startswith(f))
                assert not bad, (module, bad)
        if not module.startswith(front_ends + entry_points):
            bad = sorted(m for m in imports if m.startswith(front_ends))
            assert not bad, (module, bad)


#: The policy's modules, bottom up: each imports policy modules of lower layers only. The
#: estimators, prompt sizing and the brakes are leaves; the prefill model uses the
#: estimators; the delay learner uses both; the judge reads a request's evidence with the
#: attribution; the configs hold the parts; the fleet holds the state, its one writer applies
#: the judge's verdicts to it, routing and the recovery's limits read it, the timing reads it
#: and asks routing, and the planners use it all (docs/layout.md).
POLICY_LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "_quantiles",
        "_sizing",
        "_budget",
        "_throttle",
        "_backoff",
        "_health",
        "_blame",
        "_load",
        "_evidence",
        "_recovering",
    ),
    ("_prefill", "_judge"),
    ("_delay",),
    ("_config", "_stats"),
    ("_static", "_fleet"),
    ("_writer", "_routing", "_recovery_limits"),
    ("_timing",),
    ("_planner",),
)


def layering_violations(
    graph: dict[str, set[str]], package: str, layers: tuple[tuple[str, ...], ...]
) -> list[str]:
    """``importer -> imported`` for every import within ``package`` that is not strictly
    downward, and every module of ``package`` the layers do not place."""
    level = {f"{package}.{name}": i for i, names in enumerate(layers) for name in names}
    problems = [
        f"{m} is not placed" for m in graph if m.startswith(package + ".") and m not in level
    ]
    for module, rank in level.items():
        problems.extend(
            f"{module} -> {target}"
            for target in sorted(graph.get(module, ()))
            if target in level and level[target] >= rank
        )
    return problems


def test_the_policy_flows_one_way() -> None:
    graph = import_graph()
    for names in POLICY_LAYERS:
        for name in names:
            assert f"trio_hedge.policy.{name}" in graph, f"{name} is gone: update POLICY_LAYERS"
    assert layering_violations(graph, "trio_hedge.policy", POLICY_LAYERS) == []
    # The check sees a back edge and an unplaced module.
    fake = {"p.a": set(), "p.b": {"p.a"}, "p.c": {"p.b"}}
    assert layering_violations(fake, "p", (("a",), ("b",), ("c",))) == []
    fake["p.a"] = {"p.c"}
    assert layering_violations(fake, "p", (("a",), ("b",), ("c",))) == ["p.a -> p.c"]
    assert layering_violations(fake, "p", (("a", "b"), ("c",))) == ["p.a -> p.c", "p.b -> p.a"]
    assert layering_violations({"p.x": set()}, "p", ()) == ["p.x is not placed"]
