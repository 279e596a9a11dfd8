"""A store's rows found by image id (numpy only)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class _IdIndex:
    """Rows of image ids. The first few lookups compare the ids column whole (vectorised: 0.04 s at 1M rows); once
    they would cost more than an index, the ids' hashes are sorted once (1 s at 1M rows, 16 bytes a row; a dict of
    1M ids took 2-4.5 s) and each id found by a binary search, the few that share a hash compared as strings."""

    SCANS = 16  # lookups by comparison before the index is built

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids
        self.scans = 0
        self.order: np.ndarray | None = None  # rows by hash
        self.hashes: np.ndarray | None = None  # sorted

    def find(self, ids: Sequence[str]) -> np.ndarray:
        """The row of each of ``ids`` (its first, when an id is there twice), -1 where absent."""
        if self.order is None and self.scans + len(ids) <= self.SCANS:
            self.scans += len(ids)
            return np.array([next(iter(np.flatnonzero(self.ids == i)), -1) for i in ids], dtype=np.int64)
        if self.order is None:
            hashes = np.fromiter((hash(i) for i in self.ids.tolist()), np.int64, len(self.ids))
            self.order = np.argsort(hashes, kind="stable")
            self.hashes = hashes[self.order]
        assert self.hashes is not None
        out = np.full(len(ids), -1, dtype=np.int64)
        for n, i in enumerate(ids):
            at = int(np.searchsorted(self.hashes, hash(i)))
            while at < len(self.hashes) and self.hashes[at] == hash(i):
                row = int(self.order[at])
                if str(self.ids[row]) == i:
                    out[n] = row
                    break
                at += 1
        return out

