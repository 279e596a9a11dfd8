"""The stored rows nearest an image by a capture's pooled vector (issue 59, search by image): each ok row's capture
pooled to one vector (a token sequence: the mean of its patch tokens, its prefix tokens left out where the store
knows them; a map: the mean over its positions; a vector: itself), kept unit length in memory, and ranked by
cosine against a row's or any vector pooled the same way (numpy and zarr).

    >>> near = NearestRows(store, "blocks.11")
    >>> rows, scores = near.nearest_to_row(7, 8)     # the 8 rows most like row 7 (itself left out)
    >>> rows, scores = near.nearest(near.pool(x), 8)  # like capture values x (1, *shape) computed elsewhere
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import StoreError
from ..store import OK, patch_span

if TYPE_CHECKING:
    from .reader import ActivationStore

__all__ = ["MAX_BYTES", "NearestRows"]

MAX_BYTES = 512 << 20  # pooled vectors held in memory at most (float32): 170,000 rows of 768 features


class NearestRows:
    """Every ok row's pooled ``key``, read once (a chunk of rows at a time), unit length."""

    def __init__(self, store: ActivationStore, key: str, max_bytes: int = MAX_BYTES) -> None:
        meta = store.captures.get(key)
        if meta is None:
            raise StoreError(f"{key!r} is not a capture of {store.url}; its captures: {', '.join(store.keys)}")
        self.key, self.shape = key, [int(v) for v in meta["shape"]]
        self.names = [d.rsplit(".", 1)[-1] for d in meta["dims"]]
        tokens = self.names == ["token", "feature"]
        span = patch_span(meta, store.model.get("prefix_tokens")) if tokens else None
        self.span = span if span is not None else (0, self.shape[0])  # the patches pooled (not known: every token)
        self.width = self._width()
        self.rows = np.flatnonzero(store.status == OK)
        if len(self.rows) * self.width * 4 > max_bytes:
            raise StoreError(f"the pooled {key} of {len(self.rows):,} rows takes {len(self.rows) * self.width * 4:,} "
                             f"bytes, more than the {max_bytes:,} kept in memory to search by image")
        self.vectors = self._read(store)

    def _width(self) -> int:
        names, shape = self.names, self.shape
        if names in (["feature"], ["channel"]) or (names[-1:] == ["feature"] and len(names) == 2):
            return shape[-1]
        if names[:1] == ["channel"]:
            return shape[0]
        if names[-1:] == ["channel"]:
            return shape[-1]
        raise StoreError(f"{self.key} is stored as ({', '.join(names)}): nearest rows need a vector, a token "
                         "sequence or a map to pool")

    @property
    def said(self) -> str:
        """How a row is pooled, in words."""
        if self.names == ["token", "feature"]:
            n = self.shape[0] - self.span[1]
            left = f" (its {n} token{'s' if n != 1 else ''} besides the patches left out)" if n else ""
            return f"the mean of {self.key}'s {self.span[1]} tokens{left}"
        if len(self.names) == 1:
            return f"{self.key}'s vector"
        return f"the mean of {self.key} over its positions"

    def pool(self, x: np.ndarray) -> np.ndarray:
        """(n, width) float32: capture rows ``x`` (n, *shape) pooled."""
        x = np.asarray(x, np.float32)
        n = len(x)
        if self.names == ["token", "feature"]:
            return x[:, self.span[0] : sum(self.span)].mean(axis=1)
        if len(self.names) == 1:
            return x.reshape(n, -1)
        if self.names[0] == "channel":
            return x.reshape(n, self.width, -1).mean(axis=2)
        return x.reshape(n, -1, self.width).mean(axis=1)

    def _read(self, store: ActivationStore) -> np.ndarray:
        arr = store[self.key]
        step = max(int(arr.chunks[0]), 1)
        out = np.zeros((len(self.rows), self.width), np.float32)
        status, at = store.status, 0
        for a in range(0, len(status), step):
            ok = np.flatnonzero(status[a : a + step] == OK)
            if len(ok):
                out[at : at + len(ok)] = self.pool(np.asarray(arr[a : a + step])[ok])
                at += len(ok)
        return _unit(out)

    def nearest(self, vector: np.ndarray, n: int, leave_out: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The ``n`` ok rows whose pooled vector has the highest cosine with ``vector`` (width,), highest first
        (ties: the lower row), but row ``leave_out``; and those cosines."""
        v = _unit(np.asarray(vector, np.float32).reshape(1, -1))[0]
        scores = self.vectors @ v
        if leave_out is not None:
            scores = np.where(self.rows == leave_out, -np.inf, scores)
        take = min(n, int(np.isfinite(scores).sum()))
        order = np.lexsort((self.rows, -scores))[:take]
        return self.rows[order], scores[order]

    def nearest_to_row(self, row: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``n`` ok rows nearest ok row ``row``, itself left out."""
        at = np.searchsorted(self.rows, row)
        if at >= len(self.rows) or self.rows[at] != row:
            raise StoreError(f"row {row} is not ok: it has no {self.key}")
        return self.nearest(self.vectors[at], n, leave_out=row)


def _unit(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1)
