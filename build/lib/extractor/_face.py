"""A package's face: the names others may import from it, each loaded from its module on first use.

A face is listed once, as the imports of its ``__init__``'s ``if TYPE_CHECKING:`` block (what type checkers
and readers see); :func:`face` reads the same lines for the package's ``__all__`` and ``__getattr__``.
Importing a face imports nothing else (so the read side never pulls in torch, Ray or the spec's pydantic
through a package it passes), and a name that is not on the face is an error that says so.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def listed(init: str | Path) -> dict[str, tuple[str, str]]:
    """The names a package's ``__init__.py`` lists in its ``if TYPE_CHECKING:`` imports -> their module (relative
    to the package, dotted: ``sources.tar``) and their name there (``import x as y`` lists ``y``)."""
    out: dict[str, tuple[str, str]] = {}
    for node in ast.parse(Path(init).read_text(encoding="utf-8")).body:
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            continue
        for imp in node.body:
            if isinstance(imp, ast.ImportFrom) and imp.level == 1 and imp.module:
                out.update({a.asname or a.name: (imp.module, a.name) for a in imp.names})
    return out


def face(package: str, init: str) -> tuple[list[str], Callable[[str], Any]]:
    """The ``__all__`` and the module ``__getattr__`` of ``package``, whose ``__init__.py`` is ``init``: the names
    its ``if TYPE_CHECKING:`` block imports, each loaded from its module when first asked for."""
    names = listed(init)

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r} (its face: {', '.join(names)})")
        return getattr(importlib.import_module(f"{package}.{where[0]}"), where[1])

    return list(names), __getattr__
