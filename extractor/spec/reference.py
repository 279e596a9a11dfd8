"""The job spec's reference, generated from its schema: every field of every section with its type, default and
the docstring it is declared with (the docs site's "Every field" page; written once, in the schema)."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .schema import JobSpec

__all__ = ["reference_markdown"]


def reference_markdown() -> str:
    """Markdown: a table per section (``model``, ``data``, ``capture[i]``, ...), nested sections after their parent."""
    out: list[str] = []
    for name, field in JobSpec.model_fields.items():
        _section(out, name, _model_of(field.annotation), field.description)
    return "\n".join(out)


def _section(out: list[str], path: str, model: type[BaseModel] | None, about: str | None) -> None:
    if model is None:
        return
    out += [f"## `{path}`", ""]
    if about:
        out += [_one_line(about), ""]
    out += ["| field | type | default | what it is |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        inner = _model_of(field.annotation)
        if inner is not None:
            nested.append((f"{path}.{name}", inner, field.description))
        about = _one_line(field.description or "")
        out.append(f"| `{name}` | {_type(field.annotation)} | {_default(field)} | {about} |")
    out.append("")
    for sub in nested:
        _section(out, *sub)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section model ``annotation`` holds (itself, a tuple or list of it, or it or None), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _type(annotation: Any) -> str:
    """A type as a user writes it in YAML: ``int | auto``, ``list of str``, ``one of a, b``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args if a is not type(None)) + (" \\| null" if type(None) in args else "")
    if origin in (tuple, list):
        return f"list of {_type(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section (below)"
    return getattr(annotation, "__name__", str(annotation)).replace("NoneType", "null")


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(its defaults)"
    if value in ((), [], {}):
        return "empty"
    return f"`{'null' if value is None else str(value).lower() if isinstance(value, bool) else value}`"


def _one_line(text: str) -> str:
    """A docstring as one table cell: lines joined, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")
