"""Listing a data spec's images as rows: by the source ``data.source`` names (:mod:`.sources`); nothing is
decoded here."""

from __future__ import annotations

from ..errors import DataError
from ..spec import SOURCE_SETTINGS, DataSpec
from .rows import Rows, named
from .sources import source

__all__ = ["list_rows"]


def list_rows(data: DataSpec) -> Rows:
    """List the images of a data spec, or raise :class:`DataError` before any work starts."""
    src = source(data.source)
    rows = src.list(data)
    places = SOURCE_SETTINGS[data.source].places
    where = str(next((getattr(data, p) for p in places if getattr(data, p)), None))
    if not len(rows):
        raise DataError(f"no images found in {where} ({src.empty(data)}); check data.{places[0]}")
    return rows if data.classes is None else named(rows, list(data.classes), where)
