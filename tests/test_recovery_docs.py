"""docs/recovery.md and docs/agent-apis.md say the same thing about recovery, and what they say
is what the code does (issue 28: agent-apis.md said Messages and Responses winners that break
after the commit end with their typed error, "Not yet" recovered, when they were replayed).

Both pages carry one block (between ``<!-- recovery-by-api … -->`` markers) that must be the
same text; its table's rows are checked against the replica classes (which ``continuation``
each may declare, and the Responses ``store`` rule), and the numbers the recovery page gives
against the policy's defaults.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

import trio_hedge as th
from trio_hedge._recovery import ANCHOR_INSTRUCTION
from trio_hedge.policy import RecoveryPolicy, ThroughputFloor
from trio_hedge.sources.anthropic import AnthropicReplica
from trio_hedge.sources.openai_responses import ResponsesReplica

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"<!-- recovery-by-api[^>]*-->\n(.*?)<!-- /recovery-by-api -->", re.DOTALL)
CLASSES = {"Replica": th.Replica, "AnthropicReplica": AnthropicReplica}
CLASSES["ResponsesReplica"] = ResponsesReplica
DECLARATIONS = ("vllm", "llama.cpp", "anchor")


def _block(name: str) -> str:
    found = BLOCK.findall((DOCS / name).read_text())
    assert len(found) == 1, f"{name}: one recovery-by-api block"
    return str(found[0])


def test_both_pages_say_the_same() -> None:
    assert _block("recovery.md") == _block("agent-apis.md")


def _rows() -> list[list[str]]:
    lines = [line for line in _block("recovery.md").splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_the_table_is_what_the_replicas_accept() -> None:
    rows = _rows()
    assert [row[1] for row in rows] == [f"`{name}`" for name in CLASSES]
    for _api, kind, declared, broken in rows:
        cls = CLASSES[kind.strip("`")]
        allowed = set(re.findall(r'"([^"]+)"', declared))
        for value in DECLARATIONS:
            if value in allowed:
                cls("http://a.test/v1", continuation=value)  # type: ignore[arg-type]
            else:
                with pytest.raises(ValueError, match="continuation"):
                    cls("http://a.test/v1", continuation=value)  # type: ignore[arg-type]
        assert broken.startswith("recovered on another replica")  # never "not yet"


def test_a_stored_responses_request_is_replayed_only() -> None:
    # The table's Responses row: anchor "with `store: false`".
    (row,) = [r for r in _rows() if r[1] == "`ResponsesReplica`"]
    assert "store: false" in row[3]
    replica = ResponsesReplica("http://a.test/v1", continuation="anchor")
    client = httpx.AsyncClient()
    stored = replica.bind({"model": "m", "input": "hi"}, client)
    unstored = replica.bind({"model": "m", "input": "hi", "store": False}, client)
    assert (stored.continues, unstored.continues) == (None, "anchor")


def test_the_agent_page_no_longer_says_not_yet() -> None:
    text = (DOCS / "agent-apis.md").read_text()
    assert "Not yet" not in text and "ends the stream with its typed error" not in text


def test_the_recovery_page_gives_the_policys_numbers() -> None:
    text = (DOCS / "recovery.md").read_text()
    policy, floor = RecoveryPolicy(), ThroughputFloor()
    assert f"`{policy.first_token_ratio:g} ×`" in text
    assert f"`min_first_token` = {policy.min_first_token:g} s" in text
    assert f"`max_first_token` = {policy.max_first_token:g} s" in text
    assert f"`window` seconds (default {floor.window:g})" in text
    assert f"(default {floor.ratio:g})" in text
    # The instruction the page quotes is the one sent.
    quoted = re.search(r"> Your previous reply(.*?)\n\n", text, re.DOTALL)
    assert quoted is not None
    said = " ".join(line.lstrip("> ") for line in ("> Your previous reply" + quoted[1]).split("\n"))
    assert said.replace("*anchor*", "{anchor}") == ANCHOR_INSTRUCTION
