"""The per-value part of a feature index's block (:meth:`.index_state.IndexState.update`) in one compiled pass, where
numba is installed (the ``index`` extra): each value is read once, as stored (float16 or float32, any strides), and
the sums, histogram and per-row peaks are made as it passes. Without numba, ``update`` makes the same numbers in numpy
passes over the block (:func:`dense` is None); both are held equal by ``tests/store/test_feature_index.py``.

Measured (a 1,024-channel 2x2 float16 map, 2 quiet cores): the compiled pass about 3 ns a value, numpy's passes 20;
a zarr read of the values 2.5.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["dense"]


def _compiled(features_last: bool, half: bool, means: bool) -> Any:
    """The kernel for one layout (features the inner axis, or positions), stored type and pooling, each a constant
    the compiler folds (passed as arguments, the pass took 1.8x as long); compiled when first asked for and cached
    beside this module (numba's cache keys a closure by its values). Every step is branch-free where the data
    decides: a value firing or not is a coin toss in a dense map, and a mispredicted branch per value cost 3x."""
    import numba

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def kernel(bits: Any, values: Any, threshold: Any, f32: Any, bin16: Any, table: Any, low: Any, edges: Any,
               dump: int, ambiguous: int, sums: Any, hist: Any, peak: Any, row_sums: Any) -> None:
        n, a, b = bits.shape  # (n, T, F) where features_last, else (n, F, T): read in memory order
        bins, spills, zero = dump, len(hist) - 8, np.float32(0)

        def value(r: int, i: int, j: int) -> Any:
            return f32[bits[r, i, j]] if half else values[r, i, j]

        def cell(f: int, u: Any, v: Any) -> Any:  # the value's histogram cell where it fires, else a spill slot
            if half:
                at = np.intp(bin16[u])
            else:
                at = np.intp(table[u >> 16])
                if at == ambiguous:  # an edge cuts the value's bucket (about 1 in 100): one comparison
                    lo = np.intp(low[u >> 16])
                    at = lo + np.intp(lo < bins - 1 and v >= edges[lo + 1])
            spill = spills + (f & 7)  # one of 8 slots in a cache line: not a chain of increments of one counter
            return spill + (f * bins + at - spill) * np.intp(v > threshold)

        for r in range(n):
            nan = False  # a NaN in the row: its peaks again, with numpy's rule (rare: a float16 overflow)
            for i in range(a):
                for j in range(b):
                    f = j if features_last else i
                    v = value(r, i, j)
                    p = peak[r, f]
                    peak[r, f] = v if v > p else p
                    nan |= v != v
                    if means:
                        row_sums[r, f] += v
                    sums[f] += v if v > threshold else zero
                    hist[cell(f, bits[r, i, j], v)] += 1
            for i in range(a if nan else 0):
                for j in range(b):
                    if value(r, i, j) != value(r, i, j):
                        peak[r, j if features_last else i] = np.nan

    return kernel


def _numba() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


_KERNELS: dict[tuple[bool, bool, bool], Any] | None = {} if _numba() else None  # (features_last, half, means)


def available() -> bool:
    return _KERNELS is not None


def dense(stored: np.ndarray, threshold: float, means: bool, tables: tuple[np.ndarray, ...], dump: int,
          ambiguous: int, bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
    """For ``stored`` (n, T, F) float16 or float32, any strides: per feature the sum of its values above
    ``threshold`` (F,) float64 and the (F, bins) histogram of their bins; per row and feature the peak over the
    positions (n, F) float32 (NaN where one is NaN, as numpy's max: a feature fires in a row where its peak is above
    the threshold), and (``means``) the float64 sum of its values over the positions (n, F), else None. None without
    numba (or of another type).
    ``tables``: the float16 values as float32, their bins, and the float32 bin tables (``_BIN_TABLE``,
    ``_BIN_LOW``, ``_EDGES32``)."""
    if _KERNELS is None or stored.dtype not in (np.float16, np.float32):
        return None
    n, t, f = stored.shape
    half = stored.dtype == np.float16
    bits = stored.view(np.uint16 if half else np.uint32)
    # read in memory order: features inner where they are the inner axis, else positions (a map's channels first)
    features_last = bits.strides[2] <= bits.strides[1]
    arranged = bits if features_last else bits.transpose(0, 2, 1)
    values = (stored if features_last else stored.transpose(0, 2, 1)) if not half else np.zeros((1, 1, 1), np.float32)
    sums = np.zeros(f, np.float64)
    hist = np.zeros(f * bins + 8, np.int64)  # (F, bins), then 8 slots that count what does not fire
    peak = np.full((n, f), -np.inf, np.float32)
    row_sums = np.zeros((n, f) if means else (1, 1), np.float64)
    f32, bin16, table, low, edges = tables
    kernel = _KERNELS.get((features_last, half, means))
    if kernel is None:
        kernel = _KERNELS[features_last, half, means] = _compiled(features_last, half, means)
    kernel(arranged, values, np.float32(threshold), f32, bin16, table, low, edges, dump, ambiguous, sums, hist, peak,
           row_sums)
    return sums, hist[: f * bins].reshape(f, bins), peak, row_sums if means else None
