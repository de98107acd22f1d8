"""Every Python snippet of the README and docs/ either runs as pasted or says what it needs.

A ``python`` code block runs as pasted (a fresh interpreter, an empty directory, exit status
0) unless the line before it marks it (an HTML comment: invisible on GitHub and in the site):

* ``<!-- snippet: pytest -->``: a test file; it passes under ``pytest`` (pytest-trio's
  ``trio_mode``, as docs/testing.md sets up);
* ``<!-- snippet: continues WHAT -->`` or ``<!-- snippet: needs WHAT -->``: a fragment of a
  program (the page says what it continues) or code that needs your servers; it must still
  compile (top-level ``await`` / ``async with`` allowed, as in a notebook).

Runnable snippets talk only to loopback fake replicas (``trio_hedge.testing``) and each takes
well under a second or two, so the whole file costs seconds in CI."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_MARK = re.compile(r"<!-- snippet: (pytest|continues|needs)\b(.*?)-->")


def _snippets() -> list[tuple[str, str, str, str]]:
    """(id, mark, why, code) for every ``python`` block; mark is "" for a runnable one."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for number, block in enumerate(_BLOCK.finditer(text)):
            before = text[: block.start()].rstrip().rsplit("\n", 1)[-1]
            mark = _MARK.fullmatch(before.strip())
            name = f"{page.relative_to(ROOT)}#{number}"
            found.append((name, mark[1] if mark else "", mark[2].strip() if mark else "", block[1]))
    return found


SNIPPETS = _snippets()


def _of(*marks: str) -> list[object]:
    return [pytest.param(name, code, id=name) for name, m, _, code in SNIPPETS if m in marks]


# One interpreter imports what the snippets share (not trio_asyncio: its import changes
# asyncio's loop policy), then forks a fresh child per snippet: a process of its own, as pasted,
# without paying the imports each time.
_DRIVER = r"""
import json, os, sys, tempfile, traceback
import httpx, trio, trio_hedge, trio_hedge.testing
results = {}
for name, code in json.load(sys.stdin):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.chdir(tempfile.mkdtemp())
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            os._exit(exc.code if isinstance(exc.code, int) else 1)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as output:
        text = output.read()
    _, status = os.waitpid(pid, 0)
    results[name] = [os.waitstatus_to_exitcode(status), text]
print(json.dumps(results))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}


@pytest.fixture(scope="module")
def ran() -> dict[str, tuple[int, str]]:
    """Every runnable snippet, run once: its exit status and output, by name."""
    runnable = [(name, code) for name, mark, _, code in SNIPPETS if mark == ""]
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(runnable),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return {name: (code, text) for name, (code, text) in json.loads(done.stdout).items()}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the driver forks a child per snippet")
@pytest.mark.parametrize(("name", "code"), _of(""))
def test_a_runnable_snippet_runs_as_pasted(
    name: str, code: str, ran: dict[str, tuple[int, str]]
) -> None:
    status, output = ran[name]
    assert status == 0, f"{name} failed:\n{output}"


def test_the_test_snippets_pass(tmp_path: Path) -> None:
    files = []
    for name, mark, _, code in SNIPPETS:
        if mark == "pytest":
            files.append(f"test_{len(files)}.py")
            (tmp_path / files[-1]).write_text(f"# {name}\n{code}")
    assert files
    pytest_argv = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "trio_mode=true"]
    done = subprocess.run(
        [sys.executable, *pytest_argv, *files],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(files)} passed" in done.stdout  # one test per snippet, none skipped


@pytest.mark.parametrize(("name", "code"), _of("continues", "needs"))
def test_a_fragment_compiles(name: str, code: str) -> None:
    compile(code, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)


def test_every_mark_says_what_the_snippet_continues_or_needs() -> None:
    for name, mark, why, _ in SNIPPETS:
        assert mark == "pytest" or mark == "" or why, f"{name}: say what it {mark}"
    assert len(SNIPPETS) >= 25  # the parser found the pages' blocks
