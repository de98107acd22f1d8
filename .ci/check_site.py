"""After `mkdocs build`: every field of every attrs class in the API reference has its own
rendered entry (a row of its `Attributes` table), every enum member its own heading, and no
`::: identifier` line was left unrendered. tests/test_reference_docs.py checks the sources;
this checks what mkdocstrings made of them.

Usage: python .ci/check_site.py SITE_DIR
"""

from __future__ import annotations

import enum
import inspect
import sys
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_reference_docs import REFERENCE, _identifiers, _resolve


def main(site: Path) -> int:
    html = "\n".join(
        page.read_text(encoding="utf-8") for page in (site / "reference").rglob("*.html")
    )
    problems = []
    if "::: " in html:
        problems.append("a `::: identifier` line was rendered as text")
    for identifier in _identifiers():
        cls = _resolve(identifier)
        if inspect.isclass(cls) and issubclass(cls, enum.Enum):
            for member in cls.__members__:
                if f'id="{identifier}.{member}"' not in html:
                    problems.append(f"{identifier}.{member} has no entry of its own")
        if not (inspect.isclass(cls) and attrs.has(cls)):
            continue
        bases = [base for base in cls.__mro__[1:] if attrs.has(base)]
        inherited = {field.name for base in bases for field in attrs.fields(base)}
        for field in attrs.fields(cls):
            name = f"{identifier}.{field.name}"
            if field.name.startswith("_") or field.name in inherited:
                continue
            if f'title="{name}"' not in html and f'id="{name}"' not in html:
                problems.append(f"{name} has no entry of its own in {REFERENCE.name}/")
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
