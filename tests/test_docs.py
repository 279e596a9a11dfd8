"""docs/ARCHITECTURE.md stays true: every code name it writes in backticks resolves to something in the code.

A name resolves through a module of the package (``runner.run``), a sub-package's face (``store.create_store``),
a name defined anywhere in the package (``Worker.forward_rows``, ``_Schedule``; instance attributes set in a
class's methods and dataclass fields count), a job spec setting (``data.decode_workers``), or a library
(``torch.AcceleratorError``); a file name (``compute/worker.py``) must exist; a constant or environment variable
in capitals must appear in the package's source. Plain words in backticks (``status``, ``complete``) and
expressions (``IN_FLIGHT = 2``) are not names and are not checked.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "extractor"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
LIBRARIES = ("torch", "ray", "zarr", "PIL", "sys", "logging", "huggingface_hub", "numpy", "timm", "transformers")


def _module_names() -> dict[str, list[str]]:
    """Each module's short name -> its dotted names (``shard`` -> ``extractor.compute.shard``), sub-packages too."""
    out: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.setdefault(parts[-1], []).append(".".join(parts))
    return out


def _defined() -> dict[str, list[tuple[str, str | None]]]:
    """Every name the package defines -> (its module, its class or None): module-level names, class
    attributes, and instance attributes a class's methods assign (``self.x = ...``)."""
    out: dict[str, list[tuple[str, str | None]]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        for node in tree.body:
            for name in _names_of(node):
                out.setdefault(name, []).append((module, None))
            if isinstance(node, ast.ClassDef):
                for sub in ast.walk(node):
                    for name in _names_of(sub) if sub is not node else []:
                        out.setdefault(name, []).append((module, node.name))
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        out.setdefault(sub.attr, []).append((module, node.name))
    return out


def _names_of(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


MODULES, DEFINED = _module_names(), _defined()
SOURCE = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))


def _attr(obj: Any, name: str) -> Any:
    """``getattr``, also for names a class only declares (dataclass fields, pydantic fields, instance attributes
    its methods assign)."""
    try:
        return getattr(obj, name)
    except AttributeError:
        pass
    if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__"):  # a package's module not imported yet (in
        try:  # this test process: which ones are depends on the tests it ran before)
            return importlib.import_module(f"{obj.__name__}.{name}")
        except ImportError:
            pass
    if isinstance(obj, type):
        fields = getattr(obj, "model_fields", None) or getattr(obj, "__dataclass_fields__", None) or {}
        if name in fields:
            return _field_type(fields[name])
        assigned = any(owner == obj.__name__ for _, owner in DEFINED.get(name, []))
        if assigned or name in getattr(obj, "__annotations__", {}):
            return object()  # an instance attribute: exists, nothing below it is checked
    raise AttributeError(name)


def _field_type(field: Any) -> Any:
    """A spec field's section model (``data`` -> DataSpec), else the field itself."""
    annotation = getattr(field, "annotation", None)
    for t in [annotation, *typing.get_args(annotation)]:
        if isinstance(t, type) and hasattr(t, "model_fields"):
            return t
    return field


def _walk(obj: Any, rest: list[str]) -> bool:
    try:
        for name in rest:
            obj = _attr(obj, name)
    except AttributeError:
        return False
    return True


def _heads(head: str) -> list[Any]:
    """What the first part of a dotted name can be."""
    out: list[Any] = [importlib.import_module(m) for m in MODULES.get(head, [])]
    for module, owner in DEFINED.get(head, []):
        if owner is None:
            out.append(getattr(importlib.import_module(module), head))
    if head in ("model", "data", "capture", "output", "cluster", "submit"):
        from extractor.spec import JobSpec

        out.append(_field_type(JobSpec.model_fields[head]))
    if head in LIBRARIES:
        out.append(importlib.import_module(head))
    if hasattr(builtins, head):
        out.append(getattr(builtins, head))
    return out


def resolves(token: str) -> bool:
    if token.endswith(".py"):
        return any(p.relative_to(PACKAGE).as_posix().endswith(token) for p in PACKAGE.rglob("*.py"))
    head, *rest = token.split(".")
    if not rest and re.fullmatch(r"[A-Z][A-Z0-9_]+", head):  # a constant or an environment variable
        return re.search(rf"\b{head}\b", SOURCE) is not None
    if not rest and head in DEFINED:  # a method or attribute named alone: defined somewhere
        return True
    return any(_walk(obj, rest) for obj in _heads(head))


def _code_names(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # pictures, not names
    out = []
    for raw in re.findall(r"`([^`]+)`", text):
        token = raw.removesuffix("()")
        if not NAME.match(token):
            continue  # an expression, a setting with its value, a path with dashes
        if "." in token or token.startswith("_") or token[0].isupper():
            out.append(token)
    return sorted(set(out))


NAMES = _code_names(DOC.read_text())


def test_the_architecture_names_enough_code_to_be_checked():
    assert len(NAMES) > 100  # the extraction itself works: the document is mostly names


@pytest.mark.parametrize("token", NAMES)
def test_every_code_name_in_the_architecture_resolves(token: str):
    assert resolves(token), f"docs/ARCHITECTURE.md names `{token}`, which is not in the code (renamed or removed?)"


def test_a_name_that_is_not_in_the_code_does_not_resolve():
    assert not resolves("runner._open_store") and not resolves("shardio.ShardOutput") and not resolves("Worker.nope")
    assert not resolves("data.no_such_setting") and not resolves("NO_SUCH_CONSTANT") and not resolves("nope.py")


def _where_to_change_what() -> list[str]:
    """The rows of ARCHITECTURE's "Where to change what" table (not its header)."""
    section = DOC.read_text().split("## Where to change what", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| to add")]
    assert rows, "docs/ARCHITECTURE.md has no 'Where to change what' table"
    return rows


@pytest.mark.parametrize("row", _where_to_change_what(), ids=lambda row: row.split("|")[1].strip())
def test_each_row_of_where_to_change_what_names_modules_that_exist(row: str):
    """A row says where to change the code: each folder or file it names exists (``model/sources/``,
    ``tests/test_zoo.py``), each module's name resolves (``sources.build``), and it names at least one."""
    tokens = re.findall(r"`([^`]+)`", row)
    paths = [t for t in tokens if "/" in t]
    named = [t for t in tokens if NAME.match(t) and t.split(".")[0] in MODULES]
    assert paths or named, f"the row {row.split('|')[1].strip()!r} names no module"
    for path in paths:
        assert (ROOT / path).exists() or (PACKAGE / path).exists(), f"{row.split('|')[1].strip()!r}: no {path}"
    for name in named:
        assert resolves(name), f"{row.split('|')[1].strip()!r}: {name} is not in the code"
