"""A ``datasets.Dataset`` given in Python (``extractor.run(..., dataset=ds)``): the job's data section that reads
its files as the Parquet source reads them (its Arrow cache, or what ``save_to_disk`` wrote)."""

from __future__ import annotations

from typing import Any

from ...errors import SpecError
from ...spec import SOURCE_ONLY
from .parquet import file_columns

__all__ = ["with_dataset"]


def with_dataset(raw: dict[str, Any], dataset: Any) -> dict[str, Any]:
    """The job whose data section reads the files of the ``datasets.Dataset`` ``dataset`` (its Arrow cache or
    what ``save_to_disk`` wrote): its Image column, and its ClassLabel column as the labels."""
    section = dict(raw.get("data") or {})
    named = [k for k in ("source", *SOURCE_ONLY) if section.get(k)]
    if named:
        raise SpecError(f"dataset= was given, and the job names its data too ({', '.join(f'data.{k}' for k in named)}"
                        "); remove them from the job, or do not pass dataset=")
    section.update(source="parquet", parquet=_dataset_files(dataset),
                   columns=_dataset_columns(dataset, dict(section.get("columns") or {})))
    return {**raw, "data": section}


def _dataset_files(dataset: Any) -> list[str]:
    """The files that hold ``dataset``'s rows, in order; a data set in memory or a selection of rows refused."""
    if not hasattr(dataset, "features"):
        raise SpecError(f"dataset= takes a datasets.Dataset, not {type(dataset).__name__}")
    files = [f["filename"] for f in getattr(dataset, "cache_files", None) or []]
    if not files:
        raise SpecError("dataset= is held in memory only, and workers read a data set's files: save it first "
                        "(ds.save_to_disk(DIR), then ds = datasets.load_from_disk(DIR); or ds.to_parquet(FILE) and "
                        "data.parquet: FILE)")
    if getattr(dataset, "_indices", None) is not None:
        raise SpecError("dataset= is a selection of its files' rows (select, shuffle, filter and train_test_split "
                        "keep an indices mapping): pass ds.flatten_indices(), which writes its rows in order")
    for f in files:
        held = file_columns(f)
        if sorted(held) != sorted(dataset.column_names):
            raise SpecError(f"dataset= has the columns {', '.join(dataset.column_names)}, but its file {f} holds "
                            f"{', '.join(held)}: a rename or removal made in memory is not in the files the job "
                            "reads. Save it (ds.save_to_disk(DIR); ds = datasets.load_from_disk(DIR)) and pass that")
    return files


def _dataset_columns(dataset: Any, given: dict[str, str]) -> dict[str, str]:
    """``data.columns`` for ``dataset``: its one Image column and its one ClassLabel column, unless ``given``."""
    kinds = {k: type(f).__name__ for k, f in dataset.features.items()}
    images = [k for k, kind in kinds.items() if kind == "Image"]
    if "image" not in given and len(images) != 1:
        raise SpecError(f"dataset= has {len(images)} Image columns ({', '.join(images) or 'none'}); name the one to "
                        "read with data.columns: {image: COLUMN}")
    labels = [k for k, kind in kinds.items() if kind == "ClassLabel"]
    found = {"image": images[0]} if len(images) == 1 else {}
    return {**found, **({"label": labels[0]} if len(labels) == 1 else {}), **given}
