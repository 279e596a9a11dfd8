"""Listing a data spec's images as rows: a folder (local or remote), a manifest, tar shards or Parquet files, each
listed by its module in :mod:`.sources`; nothing is decoded here."""

from __future__ import annotations

from pathlib import Path

from ..errors import DataError
from ..spec import DataSpec
from .files import is_url
from .rows import Rows, named
from .sources.folder import _list_folder, _list_remote_folder
from .sources.manifest import _list_manifest
from .sources.tar import list_tars

__all__ = ["list_rows", "PLACE"]

PLACE = {"folder": "root", "manifest": "manifest", "tar": "tars", "parquet": "parquet"}  # where a source's images are


def list_rows(data: DataSpec) -> Rows:
    """List the images of a data spec, or raise :class:`DataError` before any work starts."""
    storage = data.storage_options
    if data.source == "folder":
        assert data.root is not None  # the spec validator guarantees it
        rows = _list_remote_folder(data.root, data.extensions, storage) if is_url(data.root) else \
            _list_folder(Path(data.root), data.extensions)
        where = data.root
    elif data.source == "manifest":
        assert data.manifest is not None
        rows = _list_manifest(data.manifest, data.root, storage, data.outside_root,
                              {str(k): v for k, v in data.columns.items()})
        where = data.manifest
    elif data.source == "parquet":
        from .sources.parquet import hub_files, list_parquet

        files = data.parquet if data.dataset is None else hub_files(data.dataset, data.split, data.config)
        rows = list_parquet(files, {str(k): v for k, v in data.columns.items()}, storage)
        where = str(data.dataset or data.parquet)
    else:
        rows = list_tars(data.tars, data.extensions, storage)
        where = str(data.tars)
    if not len(rows):
        looked = "its files hold no rows" if data.source == "parquet" else \
            f"looked for files ending in {', '.join(data.extensions)}"
        raise DataError(f"no images found in {where} ({looked}); check data.{PLACE[data.source]}")
    return rows if data.classes is None else named(rows, list(data.classes), where)

