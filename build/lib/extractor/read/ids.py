"""A store's rows found by image id (numpy only)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..store import SortedIds


class _IdIndex:
    """Rows of image ids, in a store made without an index of them (``store.id_index``, since 2026-12-02). The first
    few lookups compare the ids column whole (vectorised: 0.04 s at 1M rows); once they would cost more than an
    index, the ids' hashes are sorted once (0.2 s at 1M rows, 16 bytes a row; a dict of 1M ids took 2-4.5 s)."""

    SCANS = 16  # lookups by comparison before the index is built

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids
        self.scans = 0
        self.sorted: SortedIds | None = None

    def find(self, ids: Sequence[str]) -> np.ndarray:
        """The row of each of ``ids`` (its first, when an id is there twice), -1 where absent."""
        if self.sorted is None and self.scans + len(ids) <= self.SCANS:
            self.scans += len(ids)
            return np.array([next(iter(np.flatnonzero(self.ids == i)), -1) for i in ids], dtype=np.int64)
        if self.sorted is None:  # Python's hash: 4x faster than the stored index's, and kept in this process only
            hashes = _hashes(self.ids.tolist())
            order = np.argsort(hashes, kind="stable")
            self.sorted = SortedIds(hashes[order], order, _hashes, lambda rows: self.ids[rows].tolist())
        return self.sorted.find(ids)


def _hashes(ids: Sequence[str]) -> np.ndarray:
    return np.fromiter((hash(i) for i in ids), np.int64, len(ids))
