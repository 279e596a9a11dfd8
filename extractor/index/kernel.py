"""The per-value part of a feature index's block (:meth:`.state.IndexState.update`) in one compiled pass, where
numba is installed (the ``index`` extra): each value is read once, as stored (float16 or float32, any strides), and
the sums, histogram and per-row peaks are made as it passes. Without numba, ``update`` makes the same numbers in numpy
passes over the block (:func:`dense` is None), the reference; ``tests/index/test_kernels.py`` holds both equal. The
pair hash's constant is :mod:`.keys`'s.

Measured (a 1,024-channel 2x2 float16 map, 2 quiet cores): the compiled pass about 3 ns a value, numpy's passes 20;
a zarr read of the values 2.5.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .keys import PAIR_MUL

__all__ = ["dense"]


def _compiled(features_last: bool, half: bool, means: bool) -> Any:
    """The kernel for one layout (features the inner axis, or positions), stored type and pooling, each a constant
    the compiler folds (passed as arguments, the pass took 1.8x as long); compiled when first asked for and cached
    beside this module (numba's cache keys a closure by its values). Every step is branch-free where the data
    decides: a value firing or not is a coin toss in a dense map, and a mispredicted branch per value cost 3x."""
    import numba

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def kernel(bits: Any, values: Any, threshold: Any, f32: Any, bin16: Any, table: Any, low: Any, edges: Any,
               bins: int, ambiguous: int, sums: Any, hist: Any, peak: Any, row_sums: Any) -> None:
        n, a, b = bits.shape  # (n, T, F) where features_last, else (n, F, T): read in memory order
        spills, zero = len(hist) - 8, np.float32(0)

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


def _compiled_examples() -> Any:
    """The per-row kernel: each (row, feature) of a part of a block, its pooled value's bin counted where it fires,
    and offered as an example where its hash can beat what its bin keeps. Branch-free but for the offer, which
    once the slots hold rows is rare (a branch that goes one way)."""
    import numba

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def kernel(pooled: Any, bits: Any, fires: Any, row_mix: Any, feature_mix: Any, ceiling: Any, table: Any, low: Any,
               edges: Any, bins: int, ambiguous: int, counts: Any, at: Any, bins_out: Any, hashes: Any) -> int:
        n, f = pooled.shape
        spills, m = len(counts) - 8, 0
        for r in range(n):
            for j in range(f):
                v, u = pooled[r, j], bits[r, j]
                b: Any = np.intp(table[u >> 16])
                if b == ambiguous:  # an edge or 0 cuts the value's bucket: one comparison
                    lo = np.intp(low[u >> 16])
                    b = lo + np.intp(lo < bins - 1 and v >= edges[lo + 1]) if v > 0 else bins
                b = b if b != bins else 0  # what fires at or below 0 (a mean) counts in the first bin
                fire = fires[r, j]
                spill = spills + (j & 7)
                counts[spill + (j * bins + b - spill) * np.intp(fire)] += 1
                x = np.uint64(row_mix[r] ^ feature_mix[j]) * np.uint64(PAIR_MUL) & np.uint64(0xFFFFFFFF)
                x ^= x >> np.uint64(16)
                if (x <= ceiling[j, b]) & fire:  # one branch, nearly always not taken (``and`` made two)
                    at[m], bins_out[m], hashes[m] = r * f + j, b, x
                    m += 1
        return m

    return kernel


def examples(pooled: np.ndarray, fires: np.ndarray, row_mix: np.ndarray, feature_mix: np.ndarray,
             ceiling: np.ndarray, counts: np.ndarray, tables: tuple[np.ndarray, ...], bins: int,
             ambiguous: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """For a part of a block, ``pooled`` (n, F) float32 and where it ``fires`` (n, F): adds each firing pair's bin
    to ``counts`` (F x bins + 8 spill slots, int64), and returns the pairs that may take an example slot: flat
    indices (r x F + feature), bins and hashes (``sample_hashes``: the row and feature mixes given, combined here)
    where the hash is at most the bin's ``ceiling`` (F, bins) uint32. None without numba."""
    kernels = _kernels()
    if kernels is None:
        return None
    kernel = kernels.get("examples")
    if kernel is None:
        kernel = kernels["examples"] = _compiled_examples()
    n, f = pooled.shape
    pooled = np.ascontiguousarray(pooled, np.float32)
    at, found, hashes = np.empty(n * f, np.int64), np.empty(n * f, np.intp), np.empty(n * f, np.uint32)
    _, _, table, low, edges = tables
    m = kernel(pooled, pooled.view(np.uint32), np.ascontiguousarray(fires), row_mix, feature_mix, ceiling, table,
               low, edges, bins, ambiguous, counts, at, found, hashes)
    return at[:m], found[:m], hashes[:m]


def _numba() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


_UNKNOWN: Any = object()
# the kernels compiled, by (features_last, half, means) or "examples"; None without numba; unknown until first asked
# (numba's import is 0.3 s of every process that imports the index's modules: each Ray worker and `extractor run`)
_KERNELS: Any = _UNKNOWN


def _kernels() -> dict[Any, Any] | None:
    global _KERNELS
    if _KERNELS is _UNKNOWN:
        _KERNELS = {} if _numba() else None
    return _KERNELS


def available() -> bool:
    return _kernels() is not None


def dense(stored: np.ndarray, threshold: float, means: bool, tables: tuple[np.ndarray, ...], bins: int,
          ambiguous: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
    """For ``stored`` (n, T, F) float16 or float32, any strides: per feature the sum of its values above
    ``threshold`` (F,) float64 and the (F, bins) histogram of their bins; per row and feature the peak over the
    positions (n, F) float32 (NaN where one is NaN, as numpy's max: a feature fires in a row where its peak is above
    the threshold), and (``means``) the float64 sum of its values over the positions (n, F), else None. None without
    numba (or of another type).
    ``tables``: the float16 values as float32, their bins, and the float32 bin tables (``_BIN_TABLE``,
    ``_BIN_LOW``, ``_EDGES32``), which give ``bins`` (one past the last) where a value never fires; ``ambiguous``
    where an edge cuts a float32 bucket."""
    kernels = _kernels()
    if kernels is None or stored.dtype not in (np.float16, np.float32):
        return None
    n, _t, f = stored.shape
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
    kernel = kernels.get((features_last, half, means))
    if kernel is None:
        kernel = kernels[features_last, half, means] = _compiled(features_last, half, means)
    kernel(arranged, values, np.float32(threshold), f32, bin16, table, low, edges, bins, ambiguous, sums, hist, peak,
           row_sums)
    return sums, hist[: f * bins].reshape(f, bins), peak, row_sums if means else None
