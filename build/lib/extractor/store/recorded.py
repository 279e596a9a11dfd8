"""The rows a store recorded, read back: for a resume whose source is as it was listed (:class:`StoredRows`,
:func:`stored_rows`), and to read their images again where the source holds them now (:func:`source_digests`,
:func:`current_places`). numpy and zarr; the data sources asked when needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import zarr

from ..data import Rows, strings
from .chunks import read_all
from .layout import data_source, get_array, locator_arrays, root_attrs, take_rows


def source_digests(group: zarr.Group, rows: np.ndarray, storage_options: Mapping[str, Any] | None = None,
                   threads: int = 16, places: Mapping[str, np.ndarray] | None = None) -> list[int]:
    """The content digests of the images of store rows ``rows`` as their source holds them now, read again
    from the stored places (0: gone or unreadable), on ``threads`` threads. ``places``: the source's locator
    arrays (``Source.locators``) of those rows where a listing now finds them (a source may move its images'
    bytes: :func:`current_places`); None: as the store records them."""
    from concurrent.futures import ThreadPoolExecutor

    from ..data import content_digest, forget_reads, read_bytes

    forget_reads()  # the sources as they are now, not as an earlier read in this process kept them
    paths = take_rows(get_array(group, "paths"), rows).tolist()
    names = locator_arrays(group)
    columns = [np.asarray(places[n] if places is not None else take_rows(get_array(group, n), rows)).tolist()
               for n in names]
    items: list[Any] = list(zip(paths, *columns, strict=True)) if columns else paths  # (path, *locators)
    storage = dict(storage_options or {})

    def digest(item: Any) -> int:
        try:
            return content_digest(read_bytes(item, storage))
        except Exception:  # noqa: BLE001 - gone or unreadable: not the image the row read
            return 0

    with ThreadPoolExecutor(max(1, threads)) as pool:
        return list(pool.map(digest, items))


def current_places(group: zarr.Group, storage_options: Mapping[str, Any] | None = None) -> \
        dict[str, np.ndarray] | None:
    """Where the source holds each row's bytes now, when it moved them since the store was listed (a rewritten
    tar's members): its locator arrays as they are now (``Source.places``); None: where the store records them."""
    from ..data import source

    attrs = root_attrs(group)
    if not attrs.get("listing"):
        return None
    return source(data_source(attrs)).places(StoredRows(group), dict(storage_options or {}))


class StoredRows:
    """The rows a store records, as a resume reads them back (``data.Recorded``): its listing record, the rows
    left in it, a block of a per-row array."""

    def __init__(self, group: zarr.Group, labels: bool = False) -> None:
        self.group, self.labels = group, labels
        self.listing: dict[str, Any] = root_attrs(group).get("listing") or {}
        self._rows: Rows | None = None

    def rows(self) -> Rows:
        if self._rows is None:
            self._rows = stored_rows(self.group, labels=self.labels)
        return self._rows

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return read_all(get_array(self.group, name), start, stop)


def stored_rows(group: zarr.Group, labels: bool = False) -> Rows:
    """The rows as the store records them, for a resume whose source is as it was listed: left in the store (the
    workers read their shards' rows from it), their number, classes, listing and digests taken from its
    attributes; ``labels``: the labels read too (a gradient of the label's logit checks them)."""
    attrs = root_attrs(group)
    none = strings([])
    return Rows(ids=none, paths=none, labels=np.asarray(get_array(group, "labels")[:]) if labels else
                np.zeros(0, np.int64),
                classes=list(attrs.get("classes") or []), listing=attrs.get("listing"),
                stored={k: attrs[k] for k in ("n_rows", "ids_digest", "paths_digest")})
