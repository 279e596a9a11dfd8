"""Opening a store for analysis: lazy arrays, ids, labels, status. Needs only numpy and zarr.

    >>> s = open_store("out.zarr")
    >>> s.captures            # key -> layer, what, reduce, dtype, shape, dims
    >>> s["layer3"][:8]       # a lazy zarr array: numpy slicing reads only what it needs
    >>> s.numpy("avgpool")    # ok rows only, as one numpy array
    >>> for rows, x in s.batches("avgpool", 1024): ...
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import zarr

from .errors import StoreError
from .store import ATTR, OK, STATUS_NAMES, disk_usage, done_shards

__all__ = ["open_store", "ActivationStore"]


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> ActivationStore:
    """Open a store written by extractor, read-only and lazily."""
    kwargs: dict[str, Any] = {"mode": "r"}
    if storage_options:
        kwargs["storage_options"] = dict(storage_options)
    try:
        group = zarr.open_group(url, **kwargs)
    except FileNotFoundError:
        raise StoreError(f"no store at {url}") from None
    except Exception as err:
        raise StoreError(f"cannot open {url} as a Zarr store: {err}") from err
    if ATTR not in group.attrs:
        raise StoreError(f"{url} is a Zarr group but not an extractor store (no '{ATTR}' attributes)")
    return ActivationStore(group, url)


Rows = slice | Sequence[int] | np.ndarray | None


class ActivationStore:
    """A read-only view of an extractor store."""

    def __init__(self, group: zarr.Group, url: str) -> None:
        self.group = group
        self.url = url
        self.attrs: dict[str, Any] = dict(group.attrs[ATTR])
        self._cache: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ metadata
    @property
    def spec(self) -> dict[str, Any]:
        return self.attrs["spec"]

    @property
    def model(self) -> dict[str, Any]:
        return self.attrs["model"]

    @property
    def captures(self) -> dict[str, dict[str, Any]]:
        return self.attrs["captures"]

    @property
    def keys(self) -> list[str]:
        return list(self.captures)

    @property
    def classes(self) -> list[str]:
        return list(self.attrs.get("classes") or [])

    def __len__(self) -> int:
        return int(self.attrs["n_rows"])

    def __contains__(self, key: object) -> bool:
        return key in self.captures

    def __repr__(self) -> str:
        return f"<ActivationStore {self.url}: {len(self)} rows, captures {self.keys}>"

    # ------------------------------------------------------------------ per-row arrays
    def _row_array(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = np.asarray(self.group[name][:])
        return self._cache[name]

    @property
    def ids(self) -> np.ndarray:
        return self._row_array("ids")

    @property
    def paths(self) -> np.ndarray:
        return self._row_array("paths")

    @property
    def labels(self) -> np.ndarray:
        return self._row_array("labels")

    @property
    def status(self) -> np.ndarray:
        """0 pending, 1 ok, 2 failed (read fresh each time: a running job updates it)."""
        return np.asarray(self.group["status"][:])

    @property
    def errors(self) -> np.ndarray:
        return np.asarray(self.group["errors"][:])

    @property
    def done_shards(self) -> np.ndarray:
        return done_shards(self.group)

    def ok_rows(self) -> np.ndarray:
        return np.flatnonzero(self.status == OK)

    # ------------------------------------------------------------------ captures
    def __getitem__(self, key: str) -> zarr.Array:
        """The lazy array of a capture (numpy slicing reads only the chunks it touches)."""
        if key not in self.captures:
            raise KeyError(f"{key!r} is not a capture of {self.url}; captures: {', '.join(self.keys)}")
        return self.group[key]  # type: ignore[return-value]

    def _select_rows(self, rows: Rows, only_ok: bool) -> np.ndarray:
        n = len(self)
        if rows is None:
            idx = np.arange(n)
        elif isinstance(rows, slice):
            idx = np.arange(n)[rows]
        else:
            idx = np.asarray(rows)
            if idx.dtype == bool:
                idx = np.flatnonzero(idx)
            idx = idx.astype(np.int64)
            if idx.size and (idx.min() < -n or idx.max() >= n):
                raise IndexError(f"row index out of range for a store of {n} rows")
            idx = np.where(idx < 0, idx + n, idx)
        if only_ok:
            idx = idx[self.status[idx] == OK]
        return idx

    def numpy(self, key: str, rows: Rows = None, only_ok: bool = True) -> np.ndarray:
        """Rows of a capture as one numpy array (only rows with status ok by default)."""
        arr = self[key]
        idx = self._select_rows(rows, only_ok)
        if idx.size == 0:
            return np.empty((0, *arr.shape[1:]), dtype=arr.dtype)
        if np.all(np.diff(idx) == 1):
            return np.asarray(arr[int(idx[0]) : int(idx[-1]) + 1])
        return np.asarray(arr.oindex[idx])

    def batches(
        self, keys: str | Sequence[str], batch_size: int = 1024, rows: Rows = None, only_ok: bool = True
    ) -> Iterator[tuple[np.ndarray, Any]]:
        """Yield ``(row_indices, data)`` in row order, reading chunk by chunk.

        ``data`` is an array for one key, a dict of arrays for several.
        """
        names = [keys] if isinstance(keys, str) else list(keys)
        arrays = {k: self[k] for k in names}
        idx = self._select_rows(rows, only_ok)
        step = max(int(arrays[names[0]].chunks[0]), 1)
        pending_rows: list[np.ndarray] = []
        pending: dict[str, list[np.ndarray]] = {k: [] for k in names}
        count = 0
        for lo in range(0, len(self), step):
            sel = idx[(idx >= lo) & (idx < lo + step)]
            if not sel.size:
                continue
            a, b = int(sel[0]), int(sel[-1]) + 1
            for k, arr in arrays.items():
                block = np.asarray(arr[a:b])
                pending[k].append(block[sel - a])
            pending_rows.append(sel)
            count += sel.size
            while count >= batch_size:
                yield self._take(pending_rows, pending, batch_size, isinstance(keys, str))
                count -= batch_size
        if count:
            yield self._take(pending_rows, pending, count, isinstance(keys, str))

    @staticmethod
    def _take(
        pending_rows: list[np.ndarray], pending: dict[str, list[np.ndarray]], n: int, single: bool
    ) -> tuple[np.ndarray, Any]:
        rows_all = np.concatenate(pending_rows)
        out_rows, rest_rows = rows_all[:n], rows_all[n:]
        pending_rows[:] = [rest_rows] if rest_rows.size else []
        data = {}
        for k, parts in pending.items():
            allk = np.concatenate(parts)
            data[k] = allk[:n]
            parts[:] = [allk[n:]] if len(allk) > n else []
        return out_rows, (next(iter(data.values())) if single else data)

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict[str, Any]:
        """What ``extractor inspect`` shows: captures, row counts, shards, bytes."""
        status = self.status
        counts = {STATUS_NAMES[v]: int((status == v).sum()) for v in STATUS_NAMES}
        captures = {}
        for key, meta in self.captures.items():
            arr = self[key]
            captures[key] = {
                "layer": meta["layer"],
                "what": meta["what"],
                "reduce": meta["reduce"],
                "dtype": str(arr.dtype),
                "shape": list(arr.shape),
                "chunks": list(arr.chunks),
                "dims": ["row", *meta["dims"]],
                "bytes_stored": int(arr.nbytes_stored()),
            }
        return {
            "store": self.url,
            "format_version": self.attrs.get("format_version"),
            "status": self.attrs.get("status"),
            "created": self.attrs.get("created"),
            "updated": self.attrs.get("updated"),
            "model": self.model,
            "rows": len(self),
            "row_status": counts,
            "shards": {"total": int(self.attrs["n_shards"]), "done": int(self.done_shards.sum())},
            "classes": self.classes,
            "captures": captures,
            "bytes_on_disk": disk_usage(self.url),
        }
