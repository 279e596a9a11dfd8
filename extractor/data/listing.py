"""Listing a data spec's images as rows: by the source ``data.source`` names (:mod:`.sources`); nothing is
decoded here."""

from __future__ import annotations

from ..errors import DataError
from ..spec import SOURCE_SETTINGS, DataSpec
from .rows import Rows, named
from .sources import Sampled, source
from .streamed import Streamed

__all__ = ["SAMPLE_OVER", "SAMPLE_PARTS", "list_rows", "sample_of", "stream_rows"]

SAMPLE_PARTS = 16  # the parts of a large source ``extractor plan`` lists (Parquet files, tars, megabytes of a manifest)
SAMPLE_OVER = 64  # ... where it has more than this many


def list_rows(data: DataSpec) -> Rows:
    """List the images of a data spec, or raise :class:`DataError` before any work starts."""
    return _whole(data, source(data.source).list(data))


def _whole(data: DataSpec, rows: Rows) -> Rows:
    """A listing checked (not empty) and given data.classes' names."""
    places = SOURCE_SETTINGS[data.source].places
    where = str(next((getattr(data, p) for p in places if getattr(data, p)), None))
    if not len(rows):
        raise DataError(f"no images found in {where} ({source(data.source).empty(data)}); check data.{places[0]}")
    return rows if data.classes is None else named(rows, list(data.classes), where)


def stream_rows(data: DataSpec) -> Streamed | None:
    """The images of a data spec listed on a thread behind the job's start, where the source counts them without
    listing them (:meth:`~.sources.Source.stream`); None: :func:`list_rows` lists them first. What stops the listing
    (an unreadable file, a duplicate id, a label beyond data.classes) is raised to whoever reads the rows after."""
    return source(data.source).stream(data, lambda rows: _whole(data, rows))


def sample_of(data: DataSpec, parts: int = SAMPLE_PARTS, over: int = SAMPLE_OVER) -> Sampled | None:
    """A part of a large source to list in its place (:meth:`~.sources.Source.sample`), where it has more than
    ``over`` parts; None: list it whole (a small one, or a source that cannot be sampled: a folder)."""
    return source(data.source).sample(data, parts, over)
