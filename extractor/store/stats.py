"""Statistics of captured values, streamed per shard and merged across shards (numpy only).

Per capture: count, mean and standard deviation per feature (the channel of a map, the
feature of a token sequence, each element of a vector), global min and max, NaN and Inf
counts, rows holding any NaN/Inf, and the mean L2 norm of a row. Non-finite values are
counted, not folded into the moments.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["ShardStats", "merge", "feature_axis"]


def feature_axis(dims: Sequence[str]) -> int | None:
    """Axis (in a batch-first array) whose entries get their own mean/std; None: one global."""
    names = [d.rsplit(".", 1)[-1] for d in dims]
    if names and names[0] == "channel":
        return 1
    if names and names[-1] == "feature":
        return len(names)
    return None


class ShardStats:
    """Running sums for one capture over one shard's ok rows."""

    def __init__(self, dims: Sequence[str], shape: Sequence[int]) -> None:
        self.axis = feature_axis(dims)
        n_feat = int(shape[self.axis - 1]) if self.axis is not None else 1
        self.count = np.zeros(n_feat, np.int64)
        self.sum = np.zeros(n_feat, np.float64)
        self.sumsq = np.zeros(n_feat, np.float64)
        self.min, self.max = np.inf, -np.inf
        self.nan = self.inf = 0
        self.rows = 0
        self.nonfinite_rows: list[int] = []  # the first 20 store rows holding NaN or Inf
        self.nonfinite_count = 0
        self.l2_sum, self.l2_rows = 0.0, 0

    def update(self, x: np.ndarray, rows: np.ndarray) -> None:
        """Add a batch ``x`` (B, *shape) whose store rows are ``rows``."""
        if not len(x):
            return
        if x.dtype.kind == "f" and x.dtype.itemsize < 4:
            x = x.astype(np.float32)
        self.rows += len(x)
        if self.axis is None:
            axes: tuple[int, ...] = tuple(range(x.ndim))
        else:
            axes = tuple(a for a in range(x.ndim) if a != self.axis)
        flat = x.reshape(len(x), -1)
        finite_rows = np.isfinite(flat).all(axis=1)
        if not finite_rows.all():  # rare: count the NaN/Inf, then zero them out of the moments
            x, count = self._count_nonfinite(x, rows, finite_rows, axes)
            good = x[finite_rows]
        else:
            count = np.full(self.count.shape, x.size // self.count.size, np.int64)
            good = x
            if x.size:
                self.min = min(self.min, float(x.min()))
                self.max = max(self.max, float(x.max()))
        # accumulate in float64 without float64 copies of the batch, unless squares would overflow float32
        big = x.size and max(abs(self.min), abs(self.max)) > 1e18
        sq = np.square(x, dtype=np.float64) if big or x.dtype.itemsize > 4 else np.square(x)
        self.count += count
        self.sum += x.sum(axis=axes, dtype=np.float64).reshape(-1)
        self.sumsq += sq.sum(axis=axes, dtype=np.float64).reshape(-1)
        if len(good):
            sq_good = sq[finite_rows] if len(good) < len(x) else sq
            self.l2_sum += float(np.sqrt(sq_good.reshape(len(good), -1).sum(axis=1, dtype=np.float64)).sum())
            self.l2_rows += len(good)

    def _count_nonfinite(self, x: np.ndarray, rows: np.ndarray, finite_rows: np.ndarray,
                         axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Count a batch's NaN and Inf (and the rows holding them); the batch with them zeroed, and the count of
        finite values per feature. The minimum and maximum are of the finite values."""
        finite = np.isfinite(x)
        bad_rows = ~finite_rows
        self.nonfinite_count += int(bad_rows.sum())
        isnan = np.isnan(x)
        self.nan += int(isnan.sum())
        self.inf += int((~finite & ~isnan).sum())
        self.nonfinite_rows = sorted(self.nonfinite_rows + [int(r) for r in rows[bad_rows]])[:20]
        count = finite.sum(axis=axes).reshape(-1).astype(np.int64)
        x = np.where(finite, x, 0)
        if finite.any():
            self.min = min(self.min, float(np.where(finite, x, np.inf).min()))
            self.max = max(self.max, float(np.where(finite, x, -np.inf).max()))
        return x, count

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count.tolist(), "sum": self.sum.tolist(), "sumsq": self.sumsq.tolist(),
            "min": self.min if np.isfinite(self.min) else None, "max": self.max if np.isfinite(self.max) else None,
            "nan": self.nan, "inf": self.inf, "rows": self.rows, "nonfinite_rows": self.nonfinite_rows,
            "nonfinite_row_count": self.nonfinite_count,
            "l2_sum": self.l2_sum, "l2_rows": self.l2_rows,
        }


def dumps(stats: dict[str, ShardStats]) -> str:
    return json.dumps({key: st.to_dict() for key, st in stats.items()})


def merge_shards(group: Any) -> dict[str, Any]:
    """The store's statistics: every done shard's, merged (shards not done hold "" and add nothing)."""
    return merge(str(s) for s in group["shard_stats"][:])


def merge(shards: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Merge per-shard JSON (as written by the workers) into the per-capture summary."""
    acc: dict[str, dict[str, Any]] = {}
    for text in shards:
        if not text:
            continue
        for key, d in json.loads(text).items():
            a = acc.setdefault(key, {"count": 0, "sum": 0.0, "sumsq": 0.0, "min": None, "max": None, "nan": 0,
                                     "inf": 0, "rows": 0, "nonfinite_rows": [], "nonfinite_row_count": 0,
                                     "l2_sum": 0.0, "l2_rows": 0})
            a["count"] = a["count"] + np.asarray(d["count"], np.int64)
            a["sum"] = a["sum"] + np.asarray(d["sum"])
            a["sumsq"] = a["sumsq"] + np.asarray(d["sumsq"])
            for k, f in (("min", min), ("max", max)):
                if d[k] is not None:
                    a[k] = d[k] if a[k] is None else f(a[k], d[k])
            for k in ("nan", "inf", "rows", "nonfinite_row_count", "l2_sum", "l2_rows"):
                a[k] += d[k]
            a["nonfinite_rows"] = sorted(a["nonfinite_rows"] + d["nonfinite_rows"])[:20]
    out = {}
    for key, a in acc.items():
        count = np.maximum(a["count"], 1)
        mean = a["sum"] / count
        var = np.maximum(a["sumsq"] / count - mean**2, 0.0)
        out[key] = {
            "rows": a["rows"],
            "mean": [float(v) for v in np.atleast_1d(mean)],
            "std": [float(v) for v in np.atleast_1d(np.sqrt(var))],
            "min": a["min"],
            "max": a["max"],
            "nan": a["nan"],
            "inf": a["inf"],
            "nonfinite_rows": a["nonfinite_row_count"],
            "first_nonfinite_rows": a["nonfinite_rows"],
            "mean_l2": a["l2_sum"] / a["l2_rows"] if a["l2_rows"] else None,
        }
    return out
