"""What a newcomer finds first (issue 31, item 6): the headline result in the README, with
its picture; a results summary at the top of docs/benchmarks.md whose picture the benchmark
draws itself (``benchmarks/tail.py --plot``); and choosing ``hedge_after`` as a section of its
own in docs/policy.md, linked from the README."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()
POLICY = (ROOT / "docs" / "policy.md").read_text()
PICTURE = ROOT / "docs" / "img" / "tail-ttft-cdf.png"


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _measured() -> tuple[str, str, str]:
    """The tail benchmark's own figures, as docs/benchmarks.md quotes its output: P99 TTFT
    without hedging, with the Hedger, and the Hedger's extra requests."""
    line = next(
        x for x in BENCHMARKS.splitlines() if x.startswith("PASS trio_hedge.Hedger (learned): P99")
    )
    match = re.search(r"\((\d+\.\d+) / (\d+\.\d+) s = [\d.]+x, ([\d.]+)% extra\)", line)
    assert match, line
    return match[1], match[2], match[3]


def test_the_readme_gives_the_result_and_links_the_picture() -> None:
    """Near the top of the README: the headline (the benchmark's own figures), a link to the
    picture, which is in the repository, and to the benchmarks."""
    top = "\n".join(README.splitlines()[:25])
    plain, hedged, extra = _measured()
    assert f"P99 TTFT **{float(plain):.3g} s → {hedged} s for {extra}% extra requests**" in top
    assert "](docs/img/tail-ttft-cdf.png)" in top
    assert "](docs/benchmarks.md)" in top
    assert _png_size(PICTURE.read_bytes())[0] >= 1000


def test_docs_benchmarks_starts_with_the_results() -> None:
    """docs/benchmarks.md's first section is the summary: the picture and the figures the
    README quotes, before any method."""
    first = BENCHMARKS.split("\n## ")[1]
    assert first.startswith("Results at a glance")
    assert "![" in first and "(img/tail-ttft-cdf.png)" in first
    plain, hedged, extra = _measured()
    for figure in (plain, hedged, f"{extra}%"):
        assert figure in first, figure
    assert "benchmarks/tail.py --plot docs/img/tail-ttft-cdf.png" in first


def test_choosing_hedge_after_is_a_section_linked_from_the_readme() -> None:
    assert "\n## Choosing hedge_after\n" in POLICY
    section = POLICY.split("\n## Choosing hedge_after\n")[1].split("\n## ")[0]
    for said in (
        "LearnedDelay()",
        "A fixed delay without logs",
        "X-Hedge-After",
        "trio-hedge tune",
    ):
        assert said in section, said
    assert "](docs/policy.md#choosing-hedge_after)" in README


def test_the_benchmark_draws_the_picture(tmp_path: Path) -> None:
    """``benchmarks/tail.py --plot PNG`` draws the summary picture (a small run here)."""
    out = tmp_path / "cdf.png"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tail.py"), "--requests", "200",
         "--out", str(tmp_path), "--plot", str(out)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    assert _png_size(out.read_bytes()) == _png_size(PICTURE.read_bytes())
