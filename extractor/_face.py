"""A package's face: the names others may import from it, each loaded from its module on first use.

Importing a face imports nothing else (so the read side never pulls in torch, Ray or the spec's
pydantic through a package it passes), and a name that is not on the face is an error that says so.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def face(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` that serves ``names`` (name -> its module in the package)."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r} (its face: {', '.join(names)})")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
