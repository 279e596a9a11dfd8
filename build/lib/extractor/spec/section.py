"""What every section of the job spec shares: strict, frozen pydantic models whose fields refuse a bool where a
number belongs, and the ``auto`` or at-least-a-number check."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

__all__ = ["_Section", "_auto_or_at_least"]


def _leaf_types(ann: Any) -> set[Any]:
    """The leaf types of an annotation, also inside unions and tuples: tuple[float, ...] | Literal["auto"]."""
    args, todo = set(), [ann]
    while todo:
        inner = get_args(todo.pop())
        todo += [a for a in inner if get_args(a)]
        args |= {a for a in inner if not get_args(a)}
    return args or {ann}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """``batch_size: true`` is a mistake, not 1: only fields that take a bool take one."""
        if info.field_name is None:
            return value
        args = _leaf_types(cls.model_fields[info.field_name].annotation)
        if bool in args or not args & {int, float}:
            return value  # a bool is welcome here, or pydantic refuses it anyway
        if isinstance(value, bool):
            raise ValueError(f"expected {'an integer' if int in args else 'a number'}, not {str(value).lower()}")
        if isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value):  # mean: [true, 0.4, 0.4]
            raise ValueError(f"expected numbers, not {[str(v).lower() if isinstance(v, bool) else v for v in value]}")
        return value


def _auto_or_at_least(value: int | str, low: int, note: str = "") -> int | str:
    """A setting that is ``auto`` or a number of at least ``low``."""
    if isinstance(value, int) and value < low:
        raise ValueError(f"expected auto or a number >= {low}{note}, not {value}")
    return value
