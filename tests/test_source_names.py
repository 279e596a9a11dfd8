"""No data source's own names outside its module: an identifier (a name, attribute, function, argument, keyword or
import; not a comment or a message) that says tar, Parquet, member or row group, or names a source's locator array,
appears only in ``data/sources/`` and in the spec's declarations (``spec/``). The rest of the package reaches a
source through its contract (``data.sources.Source``)."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "extractor"
WORDS = {"tar", "tars", "parquet", "member", "members", "rowgroup", "rowgroups"}  # row_group, RowGroup: joined
ALLOWED = (("data", "sources"), ("spec",))  # the sources' own modules, and the spec that declares their settings


def _locator_names() -> set[str]:
    from extractor.data import locator_names

    return set(locator_names())


def _words(name: str) -> set[str]:
    """An identifier's words, lower case (``snake_case`` and ``CamelCase`` split), and each two joined."""
    parts = [p.lower() for p in re.split(r"_+|(?<=[a-z0-9])(?=[A-Z])", name.strip("_")) if p]
    return set(parts) | {a + b for a, b in itertools.pairwise(parts)}


def _identifiers(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    if isinstance(node, ast.alias):
        return [node.asname or node.name.rsplit(".", 1)[-1]]
    if isinstance(node, ast.ImportFrom) and node.module:
        return node.module.split(".")
    return []


def source_names(source: str, locators: set[str]) -> list[str]:
    """``line: name`` of every source-specific identifier in a module's text (a string that is exactly a locator
    array's name counts: it names the array)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = _identifiers(node)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in locators:
            names = [node.value]
        for name in names:
            if name.startswith("__") and name.endswith("__"):  # Python's own (an Enum's __members__)
                continue
            if name in locators or _words(name) & WORDS:
                found.append(f"{getattr(node, 'lineno', '?')}: {name}")
    return found


def _outside_the_sources() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if not any(p.relative_to(PACKAGE).parts[:len(a)] == a for a in ALLOWED)]


@pytest.mark.parametrize("path", _outside_the_sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_source_specific_name_outside_the_sources(path: Path):
    found = source_names(path.read_text(), _locator_names())
    assert not found, (f"{path.relative_to(PACKAGE)} names a data source's own things: {', '.join(found)}; reach "
                       "the source through data.sources.Source (its locators, places, listing hooks)")


def test_the_finder_finds_them_in_names_not_in_words():
    planted = ("def list_tars(x):  # a tar member, in a comment\n"
               "    rows.locators['byte_offset'] = x.row_groups\n"
               "    return RowGroup, 'a tar member, in a message'\n")
    assert sorted(source_names(planted, {"byte_offset"})) == ["1: list_tars", "2: byte_offset", "2: row_groups",
                                                              "3: RowGroup"]
    assert source_names("start = offsets.size; x.__members__\n", {"byte_offset"}) == []
    assert {"byte_offset", "byte_size"} <= _locator_names()  # the tar source declares them
