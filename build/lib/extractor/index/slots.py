"""A feature index's slots: per cell (a feature, or a feature's row bin), the k largest keys offered and their
payloads (the top rows' values at every position, the example rows' pooled values), in no order (numpy)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np

from .keys import _EMPTY

__all__: list[str] = []


class _Slots:
    """Per cell, the ``k`` largest keys offered (0: an empty slot), each with its payload, in no order. Offering
    the same keys in any order, or in parts merged later, leaves the same slots filled (keys are unique)."""

    def __init__(self, cells: int, k: int, payload: tuple[int, ...], dtype: Any) -> None:
        self.keys = np.zeros((cells, k), np.uint64)
        self.payload = np.zeros((cells, k, *payload), dtype)
        self.floor = np.zeros(cells, np.uint64)  # the smallest key held per cell: what a new one must beat
        self.lock: Any = nullcontext()  # a lock once states on several threads share the slots (IndexState.lane)

    def offer(self, cells: np.ndarray, keys: np.ndarray, payload: Callable[[np.ndarray], np.ndarray]) -> None:
        """Offer candidates (cell, key), each key above its cell's floor as read at any time before (a floor only
        rises: a key below it takes no slot); ``payload(i)`` gives the payloads of candidates ``i``, asked only for
        those that take a slot."""
        if len(keys):
            with self.lock:
                self._offer(cells, keys, payload)

    def _offer(self, cells: np.ndarray, keys: np.ndarray, payload: Callable[[np.ndarray], np.ndarray]) -> None:
        k = self.keys.shape[1]
        order = np.lexsort((~keys, cells))  # by cell, largest key first
        cells, keys = cells[order], keys[order]
        starts = np.r_[0, np.flatnonzero(np.diff(cells)) + 1]
        rank = np.arange(len(cells)) - np.repeat(starts, np.diff(np.r_[starts, len(cells)]))
        keep = rank < k
        cells, keys, rank, order = cells[keep], keys[keep], rank[keep], order[keep]
        touched, at = np.unique(cells, return_inverse=True)
        best = np.zeros((len(touched), k), np.uint64)  # candidates per touched cell, largest first
        which = np.zeros((len(touched), k), np.int64)
        best[at, rank], which[at, rank] = keys, order
        held = self.keys[touched]
        low = np.argsort(held, axis=1)  # slots, smallest key first
        # the j-th best candidate replaces the j-th smallest slot while it is larger: that keeps the k largest
        swap = best > np.take_along_axis(held, low, axis=1)
        a, j = np.nonzero(swap)
        slot = low[a, j]
        self.keys[touched[a], slot] = best[a, j]
        self.payload[touched[a], slot] = payload(which[a, j])
        self.floor[touched] = self.keys[touched].min(axis=1)

    def merge(self, other: _Slots) -> None:
        cells, slots = np.nonzero(other.keys != _EMPTY)
        keys = other.keys[cells, slots]
        fit = keys > self.floor[cells]
        cells, slots, keys = cells[fit], slots[fit], keys[fit]
        self.offer(cells, keys, lambda i: other.payload[cells[i], slots[i]])
