"""The public face: a small top level, documented submodules, and the old names still working
for one release, each with a DeprecationWarning that names its new home."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

import trio_hedge

TOP_LEVEL = {
    "AllAttemptsFailed",
    "AttemptError",
    "FatalAttemptError",
    "HedgeError",
    "HedgePolicy",
    "HedgedStream",
    "Hedger",
    "HedgerConfig",
    "LearnedDelay",
    "Replica",
    "ReplicasCooling",
    "Report",
    "RequestFailed",
    "StreamInterrupted",
    "__version__",
    "hedged_stream",
    "iterator_source",
}

#: Every name that was top-level before the layout changed, and where it lives now.
MOVED = {
    **dict.fromkeys(
        ("AttemptInfo", "AttemptStream", "HeaderNames", "IteratorSource", "Source"),
        "trio_hedge.sources",
    ),
    **dict.fromkeys(("AttemptOutcome", "AttemptRecord"), "trio_hedge.report"),
    **dict.fromkeys(
        (
            "Backoff",
            "DelayStatistics",
            "HedgeBudget",
            "HedgerStatistics",
            "OutlierDetection",
            "Planner",
            "PrefillFit",
            "ReplicaStatistics",
            "RetryThrottle",
            "SizeClasses",
            "StaticPlanner",
            "empirical_quantile",
            "estimate_prompt_tokens",
            "km_quantile",
        ),
        "trio_hedge.policy",
    ),
    **dict.fromkeys(
        ("Delta", "EventKind", "FirstToken", "HedgeEvent", "ToolCallDelta"), "trio_hedge.events"
    ),
    "ErrorKind": "trio_hedge.errors",
    **dict.fromkeys(
        ("ShardedTransport", "cancel_safe_transport", "make_client"), "trio_hedge.transport"
    ),
}

#: Old public modules: (old module, name, new home).
MOVED_MODULES = [
    ("trio_hedge.chunks", "ChunkDecoder", "trio_hedge.sources.openai"),
    ("trio_hedge.chunks", "classify_http_error", "trio_hedge.sources.openai"),
    ("trio_hedge.chunks", "decode_json_body", "trio_hedge.sources.openai"),
    ("trio_hedge.chunks", "merge_tool_calls", "trio_hedge.sources.openai"),
    ("trio_hedge.chunks", "parse_retry_after", "trio_hedge.sources.openai"),
    ("trio_hedge.sse", "SSEDecoder", "trio_hedge.sources.openai"),
    ("trio_hedge.sse", "SSEEvent", "trio_hedge.sources.openai"),
    ("trio_hedge.sse", "DEFAULT_MAX_EVENT_SIZE", "trio_hedge.sources.openai"),
    ("trio_hedge.sources.openai_http", "Replica", "trio_hedge.sources.openai"),
    ("trio_hedge.sources.openai_http", "HeaderNames", "trio_hedge.sources.openai"),
    ("trio_hedge.sources.openai_http", "OpenAIChatSource", "trio_hedge.sources.openai"),
    ("trio_hedge.sources.openai_http", "shared_ssl_context", "trio_hedge.transport"),
]

#: The public modules, each with a docstring saying what it holds.
PUBLIC_MODULES = [
    "trio_hedge.errors",
    "trio_hedge.events",
    "trio_hedge.report",
    "trio_hedge.policy",
    "trio_hedge.hedger",
    "trio_hedge.sources",
    "trio_hedge.sources.openai",
    "trio_hedge.sources.iterator",
    "trio_hedge.transport",
    "trio_hedge.instrumentation",
    "trio_hedge.testing",
    "trio_hedge.aio",
]


def test_the_top_level_is_small() -> None:
    assert set(trio_hedge.__all__) == TOP_LEVEL
    public = {n for n in dir(trio_hedge) if not n.startswith("_")} | {"__version__"}
    # The names, and the public submodules as attributes; no moved name.
    assert not public & set(MOVED)
    assert public >= TOP_LEVEL


@pytest.mark.parametrize("name", sorted(MOVED))
def test_an_old_top_level_name_still_works_and_warns(name: str) -> None:
    home = MOVED[name]
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(trio_hedge, name)
    assert value is getattr(importlib.import_module(home), name)
    (warning,) = caught
    assert f"trio_hedge.{name}" in str(warning.message)
    assert f"use {home}.{name}" in str(warning.message)
    assert warning.filename == __file__  # points at the caller's line, not at trio_hedge


def test_from_import_of_an_old_name_warns() -> None:
    with pytest.warns(DeprecationWarning, match=r"use trio_hedge\.events\.Delta"):
        from trio_hedge import Delta  # noqa: F401


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        trio_hedge.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018


@pytest.mark.parametrize(("module", "name", "home"), MOVED_MODULES)
def test_an_old_module_still_works_and_warns(module: str, name: str, home: str) -> None:
    sys.modules.pop(module, None)
    with pytest.warns(DeprecationWarning, match=rf"the module {module} .* use trio_hedge\."):
        old = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} .* use {home}\.{name}"):
        value = getattr(old, name)
    assert value is getattr(importlib.import_module(home), name)
    sys.modules.pop(module, None)


def test_the_moved_names_are_the_old_top_level() -> None:
    """The 47 names the top level had before are all still reachable: 17 kept, 30 moved."""
    assert len(TOP_LEVEL) == 17
    assert len(MOVED) == 30
    assert not TOP_LEVEL & set(MOVED)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_each_public_module_says_what_it_holds(module: str) -> None:
    mod = importlib.import_module(module)
    assert mod.__doc__ and len(mod.__doc__.split()) > 10
    for name in getattr(mod, "__all__", ()):
        assert hasattr(mod, name), f"{module}.__all__ names {name}, which it lacks"


def test_the_library_uses_no_old_name() -> None:
    """Importing the library, its extras and front ends raises no DeprecationWarning of its
    own (the suite runs with warnings as errors too, so an internal use of an old name fails
    wherever it runs)."""
    code = (
        "import trio_hedge, trio_hedge.aio, trio_hedge.cli, trio_hedge.tune, "
        "trio_hedge.gateway, trio_hedge.gateway._app, trio_hedge.gateway._serve, "
        "trio_hedge.instrumentation, trio_hedge.testing, trio_hedge.sources.openai_sdk"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        import subprocess

        subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], check=True)
