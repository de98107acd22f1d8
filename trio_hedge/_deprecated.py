"""Old import paths kept working for one release, each with a ``DeprecationWarning`` that
names the new home (the layout changed after 0.1.0; see CHANGELOG "Deprecated")."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_attributes", "warn_moved_module"]


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release: use {new}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def moved_attributes(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names that moved: ``moved`` maps each old name to the
    module that holds it now. A name not in ``moved`` raises ``AttributeError`` as usual;
    moved names stay out of ``dir()`` and ``__all__``."""

    def __getattr__(name: str) -> Any:
        home = moved.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", f"{home}.{name}", stacklevel=2)
        return getattr(importlib.import_module(home), name)

    return __getattr__


def warn_moved_module(old: str, new: str) -> None:
    """Warn, at its import, that module ``old`` is now ``new``."""
    _warn(f"the module {old}", new, stacklevel=3)
