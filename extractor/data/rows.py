"""The data set as rows, and its shards: row order, labels, the unit of work.

Row order is deterministic: a folder is walked in sorted order, a manifest is read in file
order, tars in pattern order, so the same spec always gives the same row for the same image.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

__all__ = ["Rows", "Shard", "plan", "labels_of"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rows:
    """The data set as the store records it: one entry per row, in row order."""

    ids: list[str]
    paths: list[str]
    labels: list[int]
    classes: list[str] = field(default_factory=list)
    offsets: list[int] | None = None  # tar sources: where each image's bytes start in its tar
    sizes: list[int] | None = None  # and how many there are
    fingerprints: list[int] | None = None  # per row, where the source tells cheaply (0: unknown); see files.fingerprint
    listing: dict[str, Any] | None = None  # what a tar listing was made from: tars, their fingerprints, extensions

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Shard:
    """A contiguous range of rows ``[start, stop)``: the unit of work, retry and resume."""

    index: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def plan(n_rows: int, shard_size: int) -> list[Shard]:
    """Split ``n_rows`` rows into shards of ``shard_size`` rows (the last may be shorter)."""
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    return [
        Shard(i, start, min(start + shard_size, n_rows))
        for i, start in enumerate(range(0, n_rows, shard_size))
    ]


_NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")  # no "+": "+1"/"-1" stay two class names, as before


def _label_number(value: object) -> Decimal | None:
    """A label read as a number: a JSON int or float, or text such as ``3``, ``3.0``, ``1e1``
    (what pandas writes for an integer column with gaps); None for a class name."""
    if isinstance(value, bool):  # JSON true/false: names, as before
        return None
    if isinstance(value, int | float):
        return Decimal(value)  # exact; NaN and infinities included, refused by the caller
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return Decimal(value.strip())
    return None


def _whole(d: Decimal) -> bool:
    """A label's number (a Decimal) is a class index: finite, whole, an int64."""
    return bool(d.is_finite() and d == d.to_integral_value() and -(2**63) <= d < 2**63)


def labels_of(raw: list[object], where: Callable[[int], str] = lambda n: f"row {n + 1}") -> tuple[list[int], list[str]]:
    """Integer labels as given, or class names mapped to sorted indices; -1 where missing.

    Numbers are class indices when every present value is a whole number: ``3``, ``3.0`` and
    JSON ``3.0`` are all label 3. Otherwise every value is a class name (``"3"`` beside
    ``"cat"``); when all of them looked like numbers (``2.5``), with a warning naming
    ``where(row)`` of the first that is not whole.
    """
    present = [(n, v) for n, v in enumerate(raw) if v not in (None, "")]
    if not present:
        return [-1] * len(raw), []
    numbers = {n: d for n, v in present if (d := _label_number(v)) is not None}
    if len(numbers) == len(present):
        odd = [n for n, d in numbers.items() if not _whole(d)]
        if not odd:
            ints = [-1] * len(raw)
            for n, d in numbers.items():
                ints[n] = int(d)
            return ints, []
        log.warning("%s: label %r is not a whole number, so every label is taken as a class name (class indices "
                    "are whole numbers: 3, or 3.0 as spreadsheets write it)", where(odd[0]), raw[odd[0]])
    classes = sorted({str(v) for _, v in present})
    index = {c: i for i, c in enumerate(classes)}
    return [index[str(v)] if v not in (None, "") else -1 for v in raw], classes
