"""A feature index's histogram bins: log10 of a value, a tenth of a decade each from 1e-4 to 1e4 (numpy: the
reference). A float32 is binned by a table of its top 16 bits and, where an edge cuts its bucket, one comparison; a
float16 by a table of all its values; the compiled pass (:mod:`.kernel`) reads the same tables, the device's
(:mod:`.device`) searches the same float32 edges. Values <= 0 and NaN have no bin (``_DUMP``): they never fire.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["HIST_BINS", "HIST_EDGES", "HIST_LO", "HIST_STEP", "bin_tables"]

HIST_LO, HIST_STEP, HIST_BINS = -4.0, 0.1, 80  # log10 bins: 1e-4 to 1e4, a tenth of a decade each
HIST_EDGES = HIST_LO + HIST_STEP * np.arange(HIST_BINS + 1)  # values outside count in the first or last bin
_LINEAR_EDGES = 10.0**HIST_EDGES  # what a value is compared with: a bin holds 10**edge[b] <= v < 10**edge[b + 1]
_DUMP = HIST_BINS  # the bin of a value not counted (it does not fire): after the last, left out of the counts
_AMBIGUOUS = 255  # in _BIN_TABLE: the bucket holds an edge, its values fall in _BIN_LOW or the next bin
_HIGH = 1 if sys.byteorder == "little" else 0  # the uint16 half of a float32 holding its top bits


def _bin_tables() -> tuple[np.ndarray, np.ndarray]:
    """Per value of a float32's top 16 bits (sign, exponent, 7 bits of mantissa: a bucket spanning less than 1% of
    a value, a bin 26%): the bin of all its values (_DUMP for values <= 0 and NaN, which never fire at threshold
    0), or _AMBIGUOUS where an edge or 0 cuts it; and the bin of its smallest positive value, which one comparison
    with the next edge finishes."""
    top = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    ends = []
    for bits in (top, top | np.uint32(0xFFFF)):  # each bucket's smallest and largest magnitude
        v = bits.view(np.float32)
        with np.errstate(invalid="ignore"):
            at = np.clip(np.searchsorted(_LINEAR_EDGES, v.astype(np.float64), side="right") - 1, 0, HIST_BINS - 1)
            at[np.isnan(v) | (v <= 0)] = _DUMP
        ends.append(at.astype(np.uint8))
    low, high = ends
    smallest_positive = np.where(low == _DUMP, np.minimum(high, HIST_BINS - 1), low)  # +0's bucket: its denormals
    return np.where(low == high, low, np.uint8(_AMBIGUOUS)), smallest_positive


def _float32_edges() -> np.ndarray:
    """The smallest float32 at or above each edge: ``v >= it`` in float32 is ``v >= edge`` in float64."""
    e = _LINEAR_EDGES.astype(np.float32)
    below = e.astype(np.float64) < _LINEAR_EDGES
    e[below] = np.nextafter(e[below], np.float32(np.inf))
    return e


_BIN_TABLE, _BIN_LOW = _bin_tables()
_BIN_CODES = _BIN_TABLE.astype(np.intp)  # the same as intp: what a histogram's codes are made of, without a cast
_EDGES32 = _float32_edges()


def bin_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tables :func:`_bins` reads (top 16 bits -> bin or _AMBIGUOUS; -> the bucket's lowest positive bin; the
    float32 edges), for another implementation of the same bins (the device's)."""
    return _BIN_TABLE, _BIN_LOW, _EDGES32


def _bins(values: np.ndarray) -> np.ndarray:
    """The bin (intp) of each float32 or float16 value among the edges 10**HIST_EDGES (below and above them: the
    first and last bin), as ``np.histogram`` puts it, and _DUMP for values <= 0 and NaN. float32: a table of the top
    16 bits, and a comparison only for the few values whose bucket an edge cuts (measured: 5x faster than a
    comparison each); float16: a table of all its values (:data:`_BIN16`, made by the float32 rule)."""
    values = np.asarray(values)
    if values.dtype == np.float16:
        return _BIN16[values.view(np.uint16)]
    values = np.ascontiguousarray(values, np.float32)
    if not values.ndim:
        values = values.reshape(1)
    at = _BIN_CODES[values.view(np.uint16)[..., _HIGH::2]]
    flat = at.reshape(-1)
    fix = np.flatnonzero(flat == _AMBIGUOUS)
    if len(fix):
        v = values.reshape(-1)[fix]
        low = _BIN_LOW[(v.view(np.uint32) >> np.uint32(16)).astype(np.intp)].astype(np.intp)
        up = (v >= _EDGES32[low + 1]) & (low < HIST_BINS - 1)
        flat[fix] = np.where(v > 0, low + up, _DUMP)
    return at


_BIN16 = _bins(np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32))  # exact: float16 -> float32
_KERNEL_TABLES = (np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32), _BIN16.astype(np.uint8),
                  _BIN_TABLE, _BIN_LOW, _EDGES32)  # what kernel reads: float16 values and bins, float32 bins


def _fired_bins(values: np.ndarray, fire: np.ndarray, exact: bool) -> np.ndarray:
    """The bins of ``values`` where ``fire``, _DUMP elsewhere; ``exact``: ``fire`` is ``values > 0`` (no pass
    needed), else a value that fires at or below 0 (a mean over positions) is in the first bin."""
    bins = _bins(values)
    if exact:
        return bins
    bins[bins == _DUMP] = 0
    return np.where(fire, bins, _DUMP)


def _offsets(f: int) -> np.ndarray:
    """Each feature's first cell: feature x (bins + 1), intp."""
    return np.arange(f, dtype=np.intp) * (HIST_BINS + 1)


def _histogram(values: np.ndarray, fire: np.ndarray | None) -> np.ndarray:
    """(F, HIST_BINS) counts of the bins of ``values`` (n, T, F) float32 or float16 where ``fire`` (None: where above
    0): one ``bincount`` of feature x (bins + 1) + bin, made in place, in the order the values lie in memory (a map's
    channels come first: each feature's offset repeated over its positions, not added along a stride)."""
    n, t, f = values.shape
    offsets = np.tile(_offsets(f), t)  # (T x F): the offset of each value of a row
    if not values.flags.c_contiguous and values.transpose(0, 2, 1).flags.c_contiguous:
        values, offsets = values.transpose(0, 2, 1), np.repeat(_offsets(f), t)  # (F x T)
        fire = None if fire is None else fire.transpose(0, 2, 1)
    codes = _bins(values).reshape(n, -1)
    if fire is not None:
        codes[~fire.reshape(n, -1)] = _DUMP
    codes += offsets
    return _counts(codes, f)


def _sparse_tokens(flat: np.ndarray, fire: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per feature the sum (F,) float64 and (F, HIST_BINS) bin counts of ``flat`` (N, F) where ``fire`` (values
    above a threshold >= 0), the firing entries listed first: for blocks where few fire (a dense pass would bin
    every value)."""
    f = flat.shape[1]
    at = np.flatnonzero(fire)
    feature = at % f
    values = flat.reshape(-1)[at]
    sums = np.bincount(feature, weights=values, minlength=f)
    counts = np.bincount(feature * HIST_BINS + _bins(values), minlength=f * HIST_BINS).reshape(f, HIST_BINS)
    return sums, counts


def _counts(cells: np.ndarray, f: int) -> np.ndarray:
    """(F, HIST_BINS) counts of cells feature x (bins + 1) + bin (intp; the _DUMP column left out) of ``f`` features."""
    counts = np.bincount(cells.reshape(-1), minlength=f * (HIST_BINS + 1))
    return counts.reshape(f, HIST_BINS + 1)[:, :HIST_BINS]
