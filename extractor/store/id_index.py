"""The store's index of its image ids (group ``id_index``): their hashes sorted and the row of each, so that a row is
found by id from 16 bytes of integers a row, not by decoding every id (issue 39: at 1M rows the first ``row(id)``
read and decoded 1M strings, 0.25 s on a quiet machine, 0.65 s on a loaded one). Written with the ids when the store
is created: its ids never change after (a resume must list the same ones). Numpy and zarr only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypedDict, cast

import numpy as np
import zarr

from ..data import BLOCK, by_hash, text_hashes, texts_part
from .chunks import read_all

__all__ = ["ID_INDEX", "SortedIds", "create_id_index", "id_index_objects", "read_id_index", "write_id_index"]

ID_INDEX = "id_index"
HASH = "utf8-poly64"  # data.rows.text_hashes: the same in every process
CHUNK = 1 << 18  # index entries an object: 2 MB of each array


def id_index_objects(n_rows: int) -> int:
    """The storage objects of a store's id index of ``n_rows`` (``extractor plan`` counts them)."""
    return 2 * -(-n_rows // CHUNK)


class IdIndexRecord(TypedDict):
    """The attributes of ``id_index``, written after its arrays: what it covers, checked before it is used."""

    hash: str  # how an id was hashed (HASH)
    n_rows: int  # the store's rows
    ids_digest: str | None  # the store's ids_digest attribute when the index was written


def hash_ids(ids: Sequence[str] | Any) -> np.ndarray:
    """The hash the index sorts by (:func:`~extractor.data.rows.text_hashes`; tests replace it to force collisions)."""
    return text_hashes(ids)


def create_id_index(group: zarr.Group, n: int) -> None:
    """Make ``id_index`` in the new store whose root is ``group``, for ``n`` ids: its arrays, empty, and no record
    (:func:`write_id_index` writes them; its record says it is whole)."""
    node = group.create_group(ID_INDEX)
    chunk = max(1, min(n, CHUNK))
    for name in ("hashes", "rows"):
        node.create_array(name, shape=(n,), dtype=np.int64, chunks=(chunk,), fill_value=0, dimension_names=["by_hash"])


def write_id_index(group: zarr.Group, ids: Any, ids_digest: str | None,
                   go_on: Callable[[], None] | None = None) -> None:
    """Write ``id_index`` (:func:`create_id_index`) of the new store whose root is ``group`` (through its job's
    fence): ``hashes`` (int64, sorted) and ``rows`` (the row of each; rows sharing a hash in row order), then its
    record. The hashes are sorted by :func:`~extractor.data.spill.by_hash` (on the disk in buckets past 4M ids: 400M
    ids are 6.4 GB of pairs) and written a whole chunk at a time. ``go_on``: called between buckets, raises to stop
    (a job stopped: minutes of sorting at 400M ids)."""
    n = len(ids)
    node = cast(zarr.Group, group[ID_INDEX])
    arrays = [cast(zarr.Array, node[name]) for name in ("hashes", "rows")]
    chunk = int(arrays[0].chunks[0])
    buffers = np.empty((2, chunk), dtype=np.int64)  # a chunk of (hashes, rows) gathered, then written whole
    at = held = 0
    for pair in by_hash(_hash_blocks(ids), n):
        if go_on is not None:
            go_on()
        taken = 0
        while taken < len(pair[0]):
            size = min(chunk - held, len(pair[0]) - taken)
            for k in (0, 1):
                buffers[k, held:held + size] = pair[k][taken:taken + size]
            held, taken = held + size, taken + size
            if held == chunk or at + held == n:
                for k, array in enumerate(arrays):
                    array[at:at + held] = buffers[k, :held]
                at, held = at + held, 0
    record: IdIndexRecord = {"hash": HASH, "n_rows": n, "ids_digest": ids_digest}
    node.attrs.update(cast(dict[str, Any], record))  # as JSON: a TypedDict is a dict


def _hash_blocks(ids: Any) -> Any:
    """:func:`hash_ids` of ``ids`` a block at a time (a Texts' blocks, and a Joined's made in bulk, as Texts: hashed
    from their bytes)."""
    for start in range(0, len(ids), BLOCK):
        yield hash_ids(texts_part(ids, start, start + BLOCK))


class SortedIds:
    """Rows of image ids by their hashes sorted: a binary search per id, then the id's text compared with the stored
    one at each row its hash names (rows whose ids share a hash, one after the other)."""

    def __init__(self, hashes: np.ndarray, rows: np.ndarray, hash_of: Callable[[Sequence[str]], np.ndarray],
                 texts_at: Callable[[np.ndarray], Sequence[str]]) -> None:
        self.hashes = hashes  # sorted
        self.rows = rows  # the row of each hash; rows sharing one in row order
        self.hash_of = hash_of
        self.texts_at = texts_at  # the stored ids of rows

    def find(self, ids: Sequence[str]) -> np.ndarray:
        """The row of each of ``ids`` (its first, when an id is there twice), -1 where absent."""
        asked = self.hash_of(ids)
        first = np.searchsorted(self.hashes, asked, "left")
        many = np.searchsorted(self.hashes, asked, "right") - first  # rows whose hash is the id's
        owner = np.repeat(np.arange(len(ids)), many)  # each candidate's asked id
        at = np.arange(len(owner)) - np.repeat(np.cumsum(many) - many, many) + first[owner]
        rows = self.rows[at]
        texts = np.asarray(self.texts_at(rows), dtype=object)  # every candidate's stored id, read at once
        hits = np.flatnonzero(texts == np.asarray(ids, dtype=object)[owner])
        asked_found, firsts = np.unique(owner[hits], return_index=True)  # rows sharing a hash in row order: the first
        out = np.full(len(ids), -1, dtype=np.int64)
        out[asked_found] = rows[hits[firsts]]
        return out


def read_id_index(group: zarr.Group, n_rows: int, ids_digest: str | None,
                  texts_at: Callable[[np.ndarray], Sequence[str]]) -> SortedIds | None:
    """The store's id index, read, where it covers the ``n_rows`` ids the store holds now (its hash, row count and
    ``ids_digest`` as recorded); None: a store made before it, one half written, or one that changed since."""
    node = group.get(ID_INDEX)
    expected: IdIndexRecord = {"hash": HASH, "n_rows": n_rows, "ids_digest": ids_digest}
    if not isinstance(node, zarr.Group) or {k: node.attrs.get(k) for k in expected} != expected:
        return None
    arrays = [node.get(name) for name in ("hashes", "rows")]
    if not all(isinstance(a, zarr.Array) and a.shape == (n_rows,) for a in arrays):
        return None
    hashes, rows = (read_all(cast(zarr.Array, a)) for a in arrays)
    return SortedIds(hashes, rows, lambda ids: hash_ids(ids), texts_at)
