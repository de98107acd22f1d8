"""The API reference (docs/reference/, built by mkdocstrings) documents every public name.

Each page lists objects as ``::: dotted.path`` lines. A name in the ``__all__`` of
``trio_hedge`` or of any public submodule (no ``_`` in its dotted name) counts as documented
when some line resolves to the same object, wherever it is documented, so a name exported
from two places needs one entry. For attrs classes, every field must have its own entry in the
docstring's ``Attributes:`` section: that is what mkdocstrings renders as the field's row
(``a, b: ...`` renders as one row named "a, b"). For enums, every member needs a docstring
after its assignment (griffe does not read Sphinx's ``#:`` comments). Docstrings are Markdown:
no Sphinx roles or reST ``::`` blocks (they render as literal text), and every autorefs link
names an object the reference documents.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import pkgutil
import re
import textwrap
import warnings
from pathlib import Path
from types import ModuleType

import attrs
import pytest

import trio_hedge

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference"
IDENTIFIER = re.compile(r"^::: ([\w.]+)\s*$", re.MULTILINE)


def _public_modules() -> list[ModuleType]:
    """``trio_hedge`` and its public submodules, without the deprecated shims of old paths
    (each a module whose docstring starts "Deprecated:", importing it warns): their names are
    documented at their new homes."""
    modules = [trio_hedge]
    for info in pkgutil.walk_packages(trio_hedge.__path__, "trio_hedge."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(info.name)
        if not (module.__doc__ or "").startswith("Deprecated:"):
            modules.append(module)
    return modules


def _resolve(identifier: str) -> object:
    """The object a ``:::`` identifier names: the longest importable module prefix, then
    attributes (as mkdocstrings resolves it)."""
    parts = identifier.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise LookupError(identifier)


def _identifiers() -> list[str]:
    return [
        identifier
        for page in sorted(REFERENCE.glob("*.md"))
        for identifier in IDENTIFIER.findall(page.read_text(encoding="utf-8"))
    ]


def _is_value(obj: object) -> bool:
    """Constants (``__version__``, sizes): identity says nothing, so the name must match."""
    return not (inspect.isclass(obj) or callable(obj) or inspect.ismodule(obj))


def test_every_reference_identifier_resolves() -> None:
    identifiers = _identifiers()
    assert identifiers, f"no ::: lines under {REFERENCE}"
    for identifier in identifiers:
        try:
            _resolve(identifier)
        except (LookupError, AttributeError) as error:
            pytest.fail(f"docs/reference names {identifier}, which does not exist: {error!r}")


def test_every_public_name_is_in_the_reference() -> None:
    documented = [(identifier, _resolve(identifier)) for identifier in _identifiers()]
    missing = []
    for module in _public_modules():
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if not any(
                found is obj and (not _is_value(obj) or identifier.rsplit(".", 1)[-1] == name)
                for identifier, found in documented
            ):
                missing.append(f"{module.__name__}.{name}")
    where = "docs/reference/*.md"
    assert not missing, f"public names with no `::: path` line in {where}: {', '.join(missing)}"


def _attributes_section(doc: str) -> set[str]:
    """The names the Google-style ``Attributes:`` section gives an entry each."""
    lines = inspect.cleandoc(doc).splitlines()
    names: set[str] = set()
    inside = False
    for line in lines:
        if line.strip() == "Attributes:":
            inside = True
        elif inside and line and not line.startswith(" "):
            inside = False  # the next section (Raises:, Example:, ...) or prose
        elif inside and (entry := re.match(r"^    (\w+)(?: \([^)]*\))?:", line)):
            names.add(entry.group(1))
    return names


def test_every_attrs_field_has_its_own_attributes_entry() -> None:
    incomplete = []
    for identifier in _identifiers():
        cls = _resolve(identifier)
        if not (inspect.isclass(cls) and attrs.has(cls)):
            continue
        # Fields inherited from an attrs base are documented on the base's entry.
        bases = [base for base in cls.__mro__[1:] if attrs.has(base)]
        inherited = {field.name for base in bases for field in attrs.fields(base)}
        fields = {f.name for f in attrs.fields(cls) if not f.name.startswith("_")} - inherited
        missing = fields - _attributes_section(cls.__doc__ or "")
        if missing:
            incomplete.append(f"{identifier}: {', '.join(sorted(missing))}")
    assert not incomplete, f"fields without their own `Attributes:` entry: {'; '.join(incomplete)}"


def _members_with_docstrings(cls: type) -> set[str]:
    """Class-level assignments followed by a string (griffe's attribute docstrings)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    documented = set()
    for statement, following in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(statement, ast.Assign)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            documented.update(t.id for t in statement.targets if isinstance(t, ast.Name))
    return documented


def test_every_enum_member_has_a_docstring() -> None:
    undocumented = []
    for identifier in _identifiers():
        cls = _resolve(identifier)
        if inspect.isclass(cls) and issubclass(cls, enum.Enum):
            missing = set(cls.__members__) - _members_with_docstrings(cls)
            if missing:
                undocumented.append(f"{identifier}: {', '.join(sorted(missing))}")
    assert not undocumented, f"enum members without a docstring: {'; '.join(undocumented)}"


PACKAGE = Path(trio_hedge.__file__).resolve().parent
# Sphinx roles render as literal text (":class:`Delta`") under mkdocstrings; docstrings link
# with autorefs instead: [`Delta`][trio_hedge.events.Delta], or plain `code` for names the
# reference does not document.
SPHINX_ROLE = re.compile(r":(?:class|func|meth|data|mod|attr|exc|obj):`")
# A reST literal block ("Example::", then a blank line and an indented block) shows its "::";
# docstrings use a fenced block (```python) instead.
REST_LITERAL = re.compile(r"::\n[ \t]*\n")
AUTOREF = re.compile(r"\[[^\[\]]+\]\[([A-Za-z_][\w.]*)\]")  # [text][dotted.path]


def _docstrings() -> list[tuple[str, int, str]]:
    """(file, line, text) of every string statement in trio_hedge/: the docstrings of modules,
    classes and functions, and the attribute docstrings griffe reads after an assignment.
    Private modules too: their objects are documented under public names."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                found.append((relative, node.lineno, node.value.value))
    return found


def test_no_sphinx_markup_in_docstrings() -> None:
    docstrings = _docstrings()
    assert docstrings
    left = [
        f"{file}:{line}: {problem}"
        for file, line, text in docstrings
        for pattern, problem in [
            (SPHINX_ROLE, "a Sphinx role (write [`Name`][trio_hedge.path] or `Name`)"),
            (REST_LITERAL, "a reST '::' literal block (write a ```python fenced block)"),
        ]
        if pattern.search(text)
    ]
    assert not left, "\n".join(left)


def _documented_paths() -> set[str]:
    """Every ``:::`` identifier, and the public members of the classes among them (what
    mkdocstrings renders with an anchor autorefs can link to)."""
    paths = set()
    for identifier in _identifiers():
        paths.add(identifier)
        obj = _resolve(identifier)
        if inspect.isclass(obj):
            paths.update(f"{identifier}.{name}" for name in dir(obj) if not name.startswith("_"))
    return paths


def test_docstring_links_name_documented_objects() -> None:
    """A link to a name the reference lacks fails ``mkdocs build --strict``, but only on a page
    that renders it: this also covers docstrings no page shows (private helpers, help())."""
    documented = _documented_paths()
    broken = [
        f"{file}:{line}: [{target}]"
        for file, line, text in _docstrings()
        for target in AUTOREF.findall(text)
        if target not in documented
    ]
    assert not broken, f"links to names with no entry in {REFERENCE}: " + "; ".join(broken)
