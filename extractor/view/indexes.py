"""The feature indexes a store holds (group ``indexes/<name>``), read as the viewer needs them.

A stand-in of ``extractor.read.open_index`` (the feature index's reader) with the same names, reading the agreed
format: arrays read lazily, a feature's rows at a time, never a whole ``(F, k, T)`` array.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

import numpy as np
import zarr

from ..errors import StoreError
from ..read import ActivationStore

__all__ = ["FeatureIndex", "index_names", "open_index"]

GROUP = "indexes"


def index_names(store: ActivationStore) -> list[str]:
    """The names of the indexes ``store`` holds, sorted."""
    if GROUP not in store.group:
        return []
    node = store.group[GROUP]
    if not isinstance(node, zarr.Group):
        return []
    return sorted(name for name, sub in node.members() if isinstance(sub, zarr.Group))


def open_index(store: ActivationStore, name: str | None = None) -> FeatureIndex:
    """The index ``name`` of ``store`` (the only one when ``name`` is None)."""
    names = index_names(store)
    if name is None:
        if len(names) != 1:
            raise StoreError(f"{store.url} holds {len(names)} indexes ({', '.join(names) or 'none'}): name one")
        name = names[0]
    if name not in names:
        raise KeyError(f"no index {name!r} in {store.url}; its indexes: {', '.join(names) or 'none'}")
    group = store.group[f"{GROUP}/{name}"]
    assert isinstance(group, zarr.Group)
    return FeatureIndex(store, name, group)


class FeatureIndex:
    """One index: per feature its top-k rows with their token values, firing density, histogram and quantile
    groups (the agreed layout: README "Feature index")."""

    def __init__(self, store: ActivationStore, name: str, group: zarr.Group) -> None:
        self.store, self.name, self.group = store, name, group
        self.attrs: dict[str, Any] = dict(group.attrs)

    def _array(self, name: str) -> zarr.Array:
        node = self.group[name]
        assert isinstance(node, zarr.Array)
        return node

    def _whole(self, name: str) -> np.ndarray:
        return np.asarray(self._array(name)[:])

    @property
    def key(self) -> str:
        return str(self.attrs["key"])

    @property
    def features(self) -> int:
        return int(self.attrs["features"])

    @property
    def k(self) -> int:
        return int(self.attrs["k"])

    @property
    def grid(self) -> tuple[int, int] | None:
        grid = self.attrs.get("grid")
        return (int(grid[0]), int(grid[1])) if grid else None

    @property
    def prefix(self) -> int:
        return int(self.attrs.get("prefix") or 0)

    @property
    def dictionary(self) -> Mapping[str, Any] | None:
        return self.attrs.get("dictionary")

    @property
    def stale(self) -> bool:
        """The store has rows the index did not see (it grew or was resumed since)."""
        return int(self.attrs.get("rows", -1)) != len(self.store)

    @cached_property
    def density(self) -> np.ndarray:
        return self._whole("density_tokens")

    @cached_property
    def density_rows(self) -> np.ndarray:
        return self._whole("density_rows")

    @cached_property
    def mean_active(self) -> np.ndarray:
        return self._whole("mean_active")

    @cached_property
    def max_value(self) -> np.ndarray:
        return self._whole("max_value")

    @cached_property
    def dead(self) -> np.ndarray:
        return self._whole("dead")

    def top(self, f: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Feature ``f``'s top rows (best first, empty places left out), their image ids and values."""
        rows = np.asarray(self._array("top_rows")[f])
        values = np.asarray(self._array("top_values")[f])
        kept = rows >= 0
        rows, values = rows[kept], values[kept]
        ids = self.store.ids[rows] if len(rows) else np.array([], dtype=object)
        return rows, ids, values

    def tokens(self, f: int) -> np.ndarray:
        """``(k, T)``: feature ``f``'s value at every token of each of its top rows."""
        return np.asarray(self._array("top_tokens")[f])

    def heatmap(self, f: int, rank: int) -> np.ndarray:
        """Feature ``f``'s values over the patch grid of its ``rank``-th top row (prefix tokens left out)."""
        if self.grid is None:
            raise StoreError(f"index {self.name!r} of {self.key!r} has no patch grid")
        return np.asarray(self._array("top_tokens")[f, rank])[self.prefix:].reshape(self.grid)

    def histogram(self, f: int) -> tuple[np.ndarray, np.ndarray]:
        """Feature ``f``'s histogram of log10 activation: counts and the bins' edges."""
        return np.asarray(self._array("histogram")[f]), np.asarray(self.attrs["hist_edges"], dtype=np.float64)

    def quantile_groups(self, f: int) -> tuple[np.ndarray, np.ndarray]:
        """``(Q, m)`` example rows of feature ``f`` by quantile group, and their values (-1 rows: empty)."""
        return np.asarray(self._array("quantile_rows")[f]), np.asarray(self._array("quantile_values")[f])

    def encode_row(self, row: int) -> np.ndarray:
        """``(T, F)``: every feature's value at every token (or position) of ``row``, from the stored capture
        (and the dictionary's encoder, which this stand-in does not read)."""
        if self.dictionary:
            raise StoreError(f"index {self.name!r} encodes with a dictionary: needs extractor.read.open_index")
        x = np.asarray(self.store[self.key][row], dtype=np.float32)
        dims = [d.rsplit(".", 1)[-1] for d in self.store.captures[self.key]["dims"]]
        if x.ndim == 3 and dims[0] == "channel":  # (C, H, W) -> (H*W, C)
            return x.reshape(x.shape[0], -1).T
        if x.ndim == 3:  # channels last (H, W, C)
            return x.reshape(-1, x.shape[-1])
        return x.reshape(-1, x.shape[-1])
