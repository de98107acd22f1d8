"""Where the docs or the help text contradicted the code (issue 31, item 5): each test reads
the doc or help text it fixes, and checks the code does what it says."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from trio_hedge.gateway import Group
from trio_hedge.gateway._agent import APIS
from trio_hedge.gateway._app import _ROUTES
from trio_hedge.testing import Behaviour, FakeReplica

from .gateway_support import CHAT, Gateway, config_for

ROOT = Path(__file__).resolve().parent.parent
GATEWAY_DOC = (ROOT / "docs" / "gateway.md").read_text()
README = (ROOT / "README.md").read_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


# -- the Anthropic SDK's base_url ------------------------------------------------------------


async def test_the_anthropic_base_url_is_said_and_v1_twice_gets_the_hint() -> None:
    """docs/gateway.md says the Anthropic SDKs take the address without ``/v1``, and that a
    doubled ``/v1/v1/messages`` gets a hint: the official SDK, given the doc's base URL,
    is answered; given ``…/v1`` (the OpenAI habit) it gets a 404 whose message says what to
    change (on c6222d8: "no route /v1/v1/messages", and nothing said so)."""
    anthropic = pytest.importorskip("anthropic")
    doc = _flat(GATEWAY_DOC)
    assert "The Anthropic SDKs add `/v1` themselves" in doc
    assert 'anthropic.Anthropic(base_url="http://127.0.0.1:8080", api_key="unused")' in doc
    assert "A doubled `/v1/v1/messages` is answered 404 with this hint" in doc
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    async with FakeReplica(Behaviour(tokens=2), name="a") as a, Gateway(config_for([a])) as gw:

        async def ask(base_url: str) -> Any:
            async with anthropic.AsyncAnthropic(
                base_url=base_url, api_key="sk-test", max_retries=0
            ) as client:
                try:
                    return await client.messages.create(**body)
                except anthropic.NotFoundError as exc:
                    return exc

        with trio.fail_after(10):
            right = await trio.to_thread.run_sync(lambda: asyncio.run(ask(gw.base_url)))
            doubled = await trio.to_thread.run_sync(lambda: asyncio.run(ask(gw.url)))
    assert right.content[0].text == "tok0 tok1 "
    assert isinstance(doubled, anthropic.NotFoundError)
    assert "did you mean /v1/messages?" in str(doubled)
    assert "base_url='http://HOST:PORT', without /v1" in str(doubled)


# -- serve --help ------------------------------------------------------------------------------


def test_serve_help_names_every_route() -> None:
    """``trio-hedge serve --help`` names every route the gateway serves (on c6222d8 only
    ``/v1/chat/completions`` of the three POST routes), and where the Anthropic SDKs' base
    URL ends."""
    done = subprocess.run(
        [sys.executable, "-m", "trio_hedge", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    text = _flat(done.stdout)
    routes = {*_ROUTES, *(path for _, path in APIS.values())}
    assert len(routes) == 7
    for route in routes:
        assert re.search(rf"{re.escape(route)}\b", text), route
    assert "base_url http://HOST:PORT, without /v1" in text
    assert "a second signal stops at once" in text


# -- /v1/models ---------------------------------------------------------------------------------


async def test_v1_models_lists_only_what_the_gateway_serves() -> None:
    """docs/gateway.md: ``/v1/models`` lists the models a group takes and races on a replica
    that listed it. Groups by pattern (``llama-*`` on one replica, ``gpt-*`` on the other):
    a model a replica lists that no group of it takes is not listed (on c6222d8 it was, and a
    request for it got 404 "not served by this gateway"); every listed model is served."""
    said = (
        "A model a replica lists but no group of it takes would be refused (404): it is not listed"
    )
    assert said in _flat(GATEWAY_DOC)
    async with (
        FakeReplica(Behaviour(tokens=2), name="a", model="llama-3") as a,
        FakeReplica(Behaviour(tokens=2), name="b", model="mistral-7b") as b,
        FakeReplica(Behaviour(tokens=2), name="c", model="gpt-4o") as c,
    ):
        config = config_for([a, b, c])
        groups = [
            Group("llama", ["a", "b"], models=["llama-*"]),
            Group("gpt", ["c"], models=["gpt-*", "gpt-4o-mini"]),
        ]
        async with Gateway(attrs.evolve(config, groups=groups)) as gw:
            async with httpx.AsyncClient(timeout=10) as http:
                listed = [m["id"] for m in (await http.get(f"{gw.url}/models")).json()["data"]]
                answers = {
                    model: (
                        await http.post(f"{gw.url}/chat/completions", json={**CHAT, "model": model})
                    ).status_code
                    for model in [*listed, "mistral-7b"]
                }
    assert listed == ["llama-3", "gpt-4o", "gpt-4o-mini"]
    assert answers == {"llama-3": 200, "gpt-4o": 200, "gpt-4o-mini": 200, "mistral-7b": 404}


# -- a request with no model --------------------------------------------------------------------


async def test_a_request_without_a_model_is_told_to_name_one() -> None:
    """docs/gateway.md: a request without ``model`` that no group takes gets 400
    ``missing_model`` saying to name one (on c6222d8: 404 "The model None is not served by
    this gateway")."""
    assert "400 `missing_model`, saying to name one" in _flat(GATEWAY_DOC)
    async with FakeReplica(Behaviour(tokens=2), name="a") as a:
        config = attrs.evolve(config_for([a]), groups=[Group("g", ["a"], models=["m"])])
        async with Gateway(config) as gw, httpx.AsyncClient(timeout=10) as http:
            body = {"messages": CHAT["messages"]}
            answer = await http.post(f"{gw.url}/chat/completions", json=body)
            other = await http.post(f"{gw.url}/chat/completions", json=CHAT)
    error = answer.json()["error"]
    assert answer.status_code == 400
    assert (error["code"], error["param"]) == ("missing_model", "model")
    assert error["message"].startswith('the request has no "model": name one')
    assert "None" not in error["message"]
    assert other.status_code == 200  # a second caller, unchanged


# -- asyncio from the wrong side -----------------------------------------------------------------

_PROGRAM = """
{imports}
import trio_hedge
from trio_hedge.aio import aio_hedged_stream

replicas = [trio_hedge.Replica({url!r})]
request = {{"model": "m", "messages": [{{"role": "user", "content": "hi"}}]}}


async def main():
    async with aio_hedged_stream(request, replicas) as stream:
        print("".join([token async for token in stream]))

{run}
"""


def _program(url: str, imports: str, run: str) -> subprocess.CompletedProcess[str]:
    code = _PROGRAM.format(imports=imports, url=url, run=run)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )


async def test_asyncio_from_either_side_does_what_docs_asyncio_says() -> None:
    """docs/asyncio.md's three cases, each as a program of its own: ``asyncio.run(main())``
    with ``import trio_asyncio`` works (c6222d8's docs said it raises); without the import it
    raises with the fix; ``aio_hedged_stream`` under ``trio.run`` raises pointing to
    ``hedged_stream`` (on c6222d8: "RuntimeError: no running event loop", from inside
    trio-asyncio)."""
    pytest.importorskip("trio_asyncio")
    doc = _flat((ROOT / "docs" / "asyncio.md").read_text())
    assert "`asyncio.run(main())` in a program that imports `trio_asyncio`" in doc
    assert "works too" in doc
    assert "`asyncio.run(main())` without that import: a stock asyncio loop" in doc
    assert "pointing to `trio_hedge.hedged_stream` and `trio_hedge.Hedger`" in doc
    async with FakeReplica(Behaviour(tokens=3), name="a") as a:
        cases = [
            ("import asyncio\nimport trio_asyncio", "asyncio.run(main())"),
            ("import asyncio", "asyncio.run(main())"),
            ("import trio", "trio.run(main)"),
        ]
        runs = [
            await trio.to_thread.run_sync(lambda i=i, r=r: _program(a.url, i, r)) for i, r in cases
        ]
    with_import, stock, from_trio = runs
    assert with_import.returncode == 0, with_import.stderr
    assert with_import.stdout == "tok0 tok1 tok2 \n"
    assert stock.returncode == 1
    assert (
        "needs a trio-asyncio event loop: run your program with trio_asyncio.run(" in stock.stderr
    )
    assert from_trio.returncode == 1
    last = from_trio.stderr.strip().splitlines()[-1]
    assert last == (
        "RuntimeError: trio_hedge.aio is the asyncio API, called here from Trio code: use "
        "trio_hedge.hedged_stream(...) (or trio_hedge.Hedger and hedger.stream(...)) directly, "
        "with the same arguments"
    )


# -- the README's test section --------------------------------------------------------------------


def _skip_groups() -> set[str]:
    """Test files that skip for want of something outside the ``dev`` extra: shared
    material, a program (HAProxy, curl, Chromium, promtool, llmock). Platform and Python
    version skips, and the extra's own packages (importorskip), are not groups."""
    found = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        text = path.read_text()
        for match in re.finditer(r"skipif\(|pytest\.skip\(", text):
            context = text[match.start() : match.start() + 300]
            if not any(w in context for w in ("win32", "platform", "version_info", "fork")):
                found.add(f"tests/{path.name}")
    return found


def test_the_readme_names_every_skip_group_and_what_a_good_run_looks_like() -> None:
    """The README's test section names every group of tests that can skip, and says what a
    good run prints and how long it takes (on c6222d8 it named two groups of four, and
    neither)."""
    section = README.split("Install and run the tests:")[1].split("\n## ")[0]
    groups = _skip_groups()
    assert len(groups) >= 7, groups
    for group in groups:
        assert group in section, group
    assert re.search(r"`\d+ passed in [\d.]+s", section), section
    assert "N skipped" in section
    assert re.search(r"about \d+ minutes", section), section
