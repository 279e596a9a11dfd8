"""A feature index's streamed state: what every feature of a capture (its channels, or a dictionary's latents) responds
to, accumulated a block of rows at a time in memory bounded by features x k (never by rows), mergeable across
shards in any order and partition with the same result (numpy only).

Per feature: the top-k rows by the feature pooled over the row's positions (max or mean), with its value at each
position (a heatmap); how many tokens and rows it fires in (value above ``threshold``); the sum of its values where
it fires; its largest value; a histogram of log10 of its values where it fires (per token) and of its pooled values
(per firing row); and for each of those row bins a few example rows (the ones with the smallest hash of row and
feature: a sample that does not depend on the order rows come in), from which the quantile groups are drawn.

Ties never depend on the order either: a row ranks by its pooled value, then by the lower row number (one uint64
key holds both, :func:`top_keys`). How a capture's rows feed it and where a finished index is stored:
:mod:`.layout`.
"""

from __future__ import annotations

import sys
import threading
import zlib
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import kernel

__all__ = ["HIST_EDGES", "HIST_BINS", "QUANTILES", "EXAMPLES", "IndexState", "IndexArrays", "BlockPart", "top_keys",
           "key_rows", "key_values", "sample_keys", "sample_hashes", "bin_tables"]

HIST_LO, HIST_STEP, HIST_BINS = -4.0, 0.1, 80  # log10 bins: 1e-4 to 1e4, a tenth of a decade each
HIST_EDGES = HIST_LO + HIST_STEP * np.arange(HIST_BINS + 1)  # values outside count in the first or last bin
_LINEAR_EDGES = 10.0**HIST_EDGES  # what a value is compared with: a bin holds 10**edge[b] <= v < 10**edge[b + 1]
QUANTILES = 10  # groups of example rows, by the feature's pooled value among the rows where it fires
EXAMPLES = 4  # example rows kept per (feature, row bin), and shown per quantile group
_EMPTY = np.uint64(0)  # the key of an empty slot: below every real key
_ROW_MASK = np.uint64(0xFFFFFFFF)
_MAGIC = 0x58494632  # "2FIX": a part of an index, version 2 (sample keys of sample_hashes)


def _ordered(values: np.ndarray) -> np.ndarray:
    """float32 -> uint32 whose order is the values' order (IEEE bits, negatives flipped)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    return np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))


def _unordered(u: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_ordered`."""
    u = u.astype(np.uint32)
    bits = np.where(u & np.uint32(0x80000000), u & np.uint32(0x7FFFFFFF), ~u)
    return bits.view(np.float32)


def top_keys(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """One uint64 per (row, feature): higher value first, then the lower row (rows < 2**32 - 1)."""
    high = _ordered(values).astype(np.uint64) << np.uint64(32)
    return high | (_ROW_MASK - rows.astype(np.uint64).reshape(-1, *([1] * (values.ndim - 1))))


def key_rows(keys: np.ndarray) -> np.ndarray:
    """Row numbers of top keys (-1 for empty slots)."""
    return np.where(keys == _EMPTY, -1, (_ROW_MASK - (keys & _ROW_MASK)).astype(np.int64))


def key_values(keys: np.ndarray) -> np.ndarray:
    """Pooled values of top keys (NaN for empty slots)."""
    return np.where(keys == _EMPTY, np.float32(np.nan), _unordered(keys >> np.uint64(32)))


def _fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's finaliser: uint32 -> uint32, every bit of the input spread over the output."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x85EBCA6B)
        x ^= x >> np.uint32(13)
        x *= np.uint32(0xC2B2AE35)
        return x ^ (x >> np.uint32(16))


def sample_hashes(rows: np.ndarray, features: np.ndarray) -> np.ndarray:
    """A 32-bit hash of each pair of ``rows`` (n,) and ``features`` (F,): (n, F) uint32, computed densely (each row
    and each feature mixed once, then each pair by a multiply and a shift: a bijection of the two mixed values'
    xor, so no two rows of a feature collide)."""
    a, b = _row_mix(rows), _feature_mix(features)
    with np.errstate(over="ignore"):
        x = a[:, None] ^ b[None, :]
        x *= np.uint32(0xC2B2AE3D)
        x ^= x >> np.uint32(16)
    return x


def _row_mix(rows: np.ndarray) -> np.ndarray:
    """Each row mixed (uint32), as :func:`sample_hashes` combines it with a feature's."""
    return _fmix32((np.asarray(rows, np.int64) & 0xFFFFFFFF).astype(np.uint32) * np.uint32(0x9E3779B1))


def _feature_mix(features: np.ndarray) -> np.ndarray:
    return _fmix32(np.asarray(features, np.int64).astype(np.uint32) * np.uint32(0x85EBCA77) + np.uint32(0x165667B1))


def sample_keys(hashes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The key by which example rows are kept, per (row, feature) pair of hash ``hashes`` (:func:`sample_hashes`):
    larger for a smaller hash, then the lower row; the kept ones of a bin are those of the largest keys (a uniform
    sample of the bin's rows, whatever order they came in)."""
    return ~((hashes.astype(np.uint64) << np.uint64(32)) | rows.astype(np.uint64))


def _growing(n: int, seen: int, first: int = 32) -> np.ndarray:
    """Ends of the parts a block of ``n`` rows is offered in, after ``seen`` rows: parts as large as all the rows
    before them (from ``first``), so that early rows fill the slots before the many later ones are compared."""
    ends, at = [], 0
    while at < n:
        at = min(n, at + max(first, seen + at))
        ends.append(at)
    return np.asarray(ends)


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


@dataclass(frozen=True)
class BlockPart:
    """What a block of rows adds to an index, computed where the block is (``extractor.index.device``: in
    torch, on the device) and small: its counts and sums, and only the candidates that may take a slot (per
    feature, the block's k best rows; per row bin, its EXAMPLES best), so the host merges it in
    :meth:`IndexState.add_part` to the state ``update`` makes of the same rows."""

    rows: int
    fire_tokens: np.ndarray  # (F,) int64
    fire_rows: np.ndarray  # (F,) int64
    sum_active: np.ndarray  # (F,) float64
    max_value: np.ndarray  # (F,) float32, -inf where no row without NaN
    histogram: np.ndarray  # (F, HIST_BINS) int64
    histogram_rows: np.ndarray  # (F, HIST_BINS) int64
    top_features: np.ndarray  # (m,) int64: candidates for the top rows ...
    top_keys: np.ndarray  # (m,) uint64: ... their keys (top_keys)
    top_tokens: np.ndarray  # (m, T) float32: ... and values at every position
    example_cells: np.ndarray  # (e,) int64: candidates for the examples, feature x HIST_BINS + bin ...
    example_keys: np.ndarray  # (e,) uint64: ... their keys (sample_keys)
    example_values: np.ndarray  # (e,) float32: ... and pooled values


@dataclass(frozen=True)
class IndexArrays:
    """A finished index: the arrays of ``indexes/<name>`` (see the README's store layout)."""

    top_rows: np.ndarray  # (F, k) int64, -1 where the feature fired in fewer rows
    top_values: np.ndarray  # (F, k) float32, the pooled value, descending
    top_tokens: np.ndarray  # (F, k, T) float32: the feature at each position of those rows
    density_tokens: np.ndarray  # (F,) float64: share of tokens (positions) where it fires
    density_rows: np.ndarray  # (F,) float64: share of rows where it fires at some position
    mean_active: np.ndarray  # (F,) float64: its mean value where it fires (NaN: never)
    max_value: np.ndarray  # (F,) float32: its largest value (NaN: no rows)
    histogram: np.ndarray  # (F, B) int64: log10 of its values where it fires, per token, bins HIST_EDGES
    histogram_rows: np.ndarray  # (F, B) int64: log10 of its pooled values, per row where it fires
    quantile_rows: np.ndarray  # (F, Q, m) int64: example rows per quantile group of the firing rows, -1 empty
    quantile_values: np.ndarray  # (F, Q, m) float32: their pooled values (NaN empty)
    dead: np.ndarray  # (D,) int64: the features that never fire


class _Examples:
    """A block's firing (row, feature) pairs offered to the example slots a part of rows at a time, and their row
    histogram: compiled where numba is (:func:`.kernel.examples`: each pair's bin, count and hash made as it
    passes), else in numpy passes over the block (the same candidates and counts)."""

    def __init__(self, state: IndexState, rows: np.ndarray, pooled: np.ndarray, fires: np.ndarray) -> None:
        self.state, self.rows, self.pooled, self.fires = state, rows, pooled, fires
        f = pooled.shape[1]
        self.compiled = kernel.available()
        if self.compiled:
            self.tally = np.zeros(f * HIST_BINS + 8, np.int64)  # (F, bins), then 8 spill slots of what does not fire
            self.row_mix, self.feature_mix = _row_mix(rows), _feature_mix(np.arange(f))
        else:
            exact = state.threshold == 0 and (state.pool == "max" or state.positions == 1)
            self.bins = _fired_bins(pooled, fires, exact)
            self.cells = self.bins + _offsets(f)  # (n, F): feature x (bins + 1) + bin
            self.hashes = sample_hashes(rows, np.arange(f))

    def counts(self) -> np.ndarray:
        """(F, HIST_BINS) firing rows per bin of the pooled values."""
        f = self.pooled.shape[1]
        return self.tally[: f * HIST_BINS].reshape(f, HIST_BINS) if self.compiled else _counts(self.cells, f)

    def offer(self, part: slice) -> None:
        """Offer the firing pairs of rows ``part`` whose hash can beat their row bin's kept examples."""
        f = self.pooled.shape[1]
        floor = self.state.examples.floor
        ceiling = np.zeros((f, HIST_BINS + 1), np.uint32)  # the largest hash a pair may have; the dump bin: 0
        ceiling[:, :HIST_BINS] = (~floor >> np.uint64(32)).astype(np.uint32).reshape(f, HIST_BINS)
        if self.compiled:
            found = kernel.examples(self.pooled[part], self.fires[part], self.row_mix[part], self.feature_mix,
                                          ceiling, self.tally, _KERNEL_TABLES, HIST_BINS, _AMBIGUOUS)
            assert found is not None
            at, bins, hashes = found
            at += part.start * f
            row, feature = np.divmod(at, f)
            slot = feature * HIST_BINS + bins
        else:
            cells = self.cells[part]
            at = np.flatnonzero(self.hashes[part] <= ceiling.reshape(-1)[cells])
            at = at[self.bins[part].reshape(-1)[at] != _DUMP]  # a hash of 0 in the dump bin
            hashes = self.hashes[part].reshape(-1)[at]
            row, feature = np.divmod(at + part.start * f, f)
            slot = cells.reshape(-1)[at] - feature  # feature x bins + bin: the examples' cell
        keys = sample_keys(hashes, self.rows[row])
        fit = keys > floor[slot]
        values = self.pooled[row[fit], feature[fit]]
        self.state.examples.offer(slot[fit], keys[fit], lambda i: values[i])


class IndexState:
    """What a stream of rows has shown of each of ``features`` features over ``positions`` positions per row:
    bounded by features x (k x positions + bins x examples), never by rows. ``update`` adds a block, ``merge``
    another state (another shard's), in any order; ``finish`` gives the index."""

    def __init__(self, features: int, positions: int, k: int = 16, pool: str = "max", threshold: float = 0.0, *,
                 slots: tuple[_Slots, _Slots] | None = None) -> None:
        if pool not in ("max", "mean"):
            raise ValueError(f"pool must be max or mean, not {pool!r}")
        if not (threshold >= 0 and np.isfinite(threshold)):
            raise ValueError(f"threshold must be a finite number >= 0 (the histogram is of log10 of the values above "
                             f"it), not {threshold}")
        self.features, self.positions, self.k, self.pool = features, positions, k, pool
        self.threshold = float(threshold)
        # top: keys top_keys, payload the row's values; examples: keys sample_keys, payload the pooled value.
        # ``slots``: another state's, shared (:meth:`lane`)
        self.top, self.examples = slots or (_Slots(features, k, (positions,), np.float32),
                                            _Slots(features * HIST_BINS, EXAMPLES, (), np.float32))
        self.fire_tokens = np.zeros(features, np.int64)
        self.fire_rows = np.zeros(features, np.int64)
        self.sum_active = np.zeros(features, np.float64)
        self.max_value = np.full(features, -np.inf, np.float32)
        self.histogram = np.zeros((features, HIST_BINS), np.int64)
        self.histogram_rows = np.zeros((features, HIST_BINS), np.int64)
        self.rows = 0

    def block_rows(self, values: int) -> int:
        """Rows whose activations make a block of about ``values`` values."""
        return max(1, values // max(1, self.positions * self.features))

    def update(self, acts: np.ndarray, rows: np.ndarray) -> None:
        """Add ``acts`` (n, T, F) float32 or float16: the features at each position of the store rows ``rows`` (n,).
        Every step is a dense pass over the block (no list of firing entries): sums are reductions, the histograms
        one ``bincount`` of feature x (bins + 1) + bin (a float16 block binned by a table of all its values, whose
        firing counts are the histogram's), the top rows and examples offered only where they can beat what the
        slots hold. Memory: a few copies of the block, whatever the rows before it."""
        n, t, f = acts.shape
        if (t, f) != (self.positions, self.features):
            raise ValueError(f"a block of {t} positions x {f} features; the index has {self.positions} x "
                             f"{self.features}")
        if not n:
            return
        self.rows += n
        values, pooled, fires, peak = self._add_values(acts)
        self.max_value = np.fmax(self.max_value, np.fmax.reduce(peak, axis=0))  # NaN (a float16 overflow) left out
        examples = _Examples(self, rows, pooled, fires)
        # a few rows first, then more: once the slots hold rows, few candidates beat their floors
        a = 0
        for b in _growing(n, self.rows - n).tolist():
            part = slice(a, b)
            self._offer_top(values[part], rows[part], pooled[part], fires[part])
            examples.offer(part)
            a = b
        counts = examples.counts()
        self.histogram_rows += counts
        self.fire_rows += counts.sum(axis=1)  # a firing row has a bin

    def _add_values(self, acts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Add the per-token sums and histogram of block ``acts`` (n, T, F); returns the block as the top rows take
        their values from it, each row's pooled value and whether the feature fires in it (n, F), and its peak over
        the positions (n, F). Compiled where numba is (:mod:`.kernel`: each value read once, as stored);
        numpy's passes over a float32 copy (the same numbers) without it, and where few values fire (measured on an
        SAE's latents, 2% firing: numpy 5.3 ns a value, the compiled pass 11)."""
        n, t, f = acts.shape
        means = self.pool == "mean" and t > 1
        seen = (self.rows - n) * t * f  # values before this block: where few of them fired (an SAE's latents),
        sparse = seen and int(self.fire_tokens.sum()) * 8 < seen  # numpy's passes over those that fire are faster
        done = None if sparse else kernel.dense(acts, self.threshold, means, _KERNEL_TABLES, HIST_BINS,
                                                      _AMBIGUOUS)
        if done is None:
            values = np.ascontiguousarray(acts, np.float32)  # compared and summed as float32; binned as stored
            fire = self._add_tokens(acts, values.reshape(n * t, f))
            peak = values[:, 0] if t == 1 else values.max(axis=1)
            return values, *self._pooled(values, fire.reshape(n, t, f), peak), peak
        sums, histogram, peak, row_sums = done
        self.sum_active += sums
        self.histogram += histogram
        self.fire_tokens += histogram.sum(axis=1)
        if row_sums is None:
            return acts, peak, peak > self.threshold, peak
        pooled = (row_sums / t).astype(np.float32)  # as _pooled: the float64 sum over positions, divided once
        return acts, pooled, (peak > self.threshold) & ~np.isnan(pooled), peak  # fires at a position: its peak

    def _add_tokens(self, stored: np.ndarray, flat: np.ndarray) -> np.ndarray:
        """Add the per-token sums and histogram of a block's values, as given to :meth:`update` (``stored``: (n, T,
        F) float16 or float32, any strides) and as float32 (``flat``: (n x T, F)); returns where they fire. The
        firing counts are the histogram's: a value above the threshold (>= 0) has a bin, and no other one."""
        fire = flat > self.threshold  # NaN never fires
        if np.count_nonzero(fire) * 8 < fire.size:  # few fire (an SAE's latents): only those are summed and binned
            sums, histogram = _sparse_tokens(flat, fire)
        else:
            fired = np.fmax(flat, 0) if self.threshold == 0 else np.where(fire, flat, 0)  # fmax: NaN -> 0
            sums = fired.sum(axis=0, dtype=np.float64)
            histogram = _histogram(stored, None if self.threshold == 0 else fire.reshape(stored.shape))
        self.sum_active += sums
        self.histogram += histogram
        self.fire_tokens += histogram.sum(axis=1)
        return fire

    def add_part(self, part: BlockPart) -> None:
        """Add a block's part (:class:`BlockPart`): the same state ``update`` makes of the block's rows."""
        self._add_sums(part)
        fit = part.top_keys > self.top.floor[part.top_features]
        features, keys, tokens = part.top_features[fit], part.top_keys[fit], part.top_tokens[fit]
        self.top.offer(features, keys, lambda i: tokens[i])
        fit = part.example_keys > self.examples.floor[part.example_cells]
        cells, keys, values = part.example_cells[fit], part.example_keys[fit], part.example_values[fit]
        self.examples.offer(cells, keys, lambda i: values[i])

    def _add_sums(self, other: BlockPart | IndexState) -> None:
        """Add another block's or state's counts, sums, maxima and histograms (what adds without slots)."""
        self.rows += other.rows
        self.fire_tokens += other.fire_tokens
        self.fire_rows += other.fire_rows
        self.sum_active += other.sum_active
        self.max_value = np.fmax(self.max_value, other.max_value)
        self.histogram += other.histogram
        self.histogram_rows += other.histogram_rows

    def _pooled(self, acts: np.ndarray, fire: np.ndarray, peak: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's pooled value per feature (n, F), and whether the feature fires in the row."""
        if acts.shape[1] == 1:  # one position: the row's pooled value is the token's
            return peak, fire[:, 0]
        if self.pool == "max":
            return peak, peak > self.threshold
        pooled = (acts.sum(axis=1, dtype=np.float64) / acts.shape[1]).astype(np.float32)  # any order: one rounding
        return pooled, fire.any(axis=1) & ~np.isnan(pooled)

    def _offer_top(self, acts: np.ndarray, rows: np.ndarray, pooled: np.ndarray, fires: np.ndarray) -> None:
        """Offer the (row, feature) pairs that can beat their feature's k-th row: those at or above its value (and,
        when the slots are still filling, among the block's k best of the feature)."""
        n, f = pooled.shape
        floor = key_values(self.top.floor)
        beat = fires & (pooled >= np.where(np.isnan(floor), -np.inf, floor))  # an empty slot: anything beats it
        if n > self.k and np.count_nonzero(beat) > 2 * self.k * f:
            kth = np.partition(np.where(fires, pooled, -np.inf), n - self.k, axis=0)[n - self.k]
            beat &= pooled >= kth  # ties at the k-th value all kept: the lower row decides among them below
        row, feature = np.divmod(np.flatnonzero(beat), f)
        keys = top_keys(pooled[row, feature], rows[row])
        fit = keys > self.top.floor[feature]
        row, feature, keys = row[fit], feature[fit], keys[fit]
        self.top.offer(feature, keys, lambda i: acts[row[i], :, feature[i]])

    def lane(self) -> IndexState:
        """A state for another thread to add rows to beside this one: counts, sums and histograms of its own, this
        state's slots, each offer to them under their lock (slots hold the same keys whatever order they are offered
        in); :meth:`join` adds its counts back. Memory: the slots once, however many lanes."""
        for slots in (self.top, self.examples):
            if isinstance(slots.lock, nullcontext):
                slots.lock = threading.Lock()
        return IndexState(self.features, self.positions, self.k, self.pool, self.threshold,
                          slots=(self.top, self.examples))

    def join(self, lane: IndexState) -> None:
        """Add the counts of ``lane``, a :meth:`lane` of this state, once its rows are all added."""
        if lane.top is not self.top:
            raise ValueError("joining a state that is not a lane of this one: merge it")
        self._add_sums(lane)

    def merge(self, other: IndexState) -> None:
        """Add another state of the same features (another shard's rows)."""
        if (other.features, other.positions, other.k, other.pool) != (self.features, self.positions, self.k,
                                                                      self.pool):
            raise ValueError("merging indexes of other features, positions, k or pool")
        self._add_sums(other)
        self.top.merge(other.top)
        self.examples.merge(other.examples)

    def finish(self) -> IndexArrays:
        """The index of the rows seen."""
        order = np.argsort(~self.top.keys, axis=1, kind="stable")  # largest key first: value desc, row asc
        keys = np.take_along_axis(self.top.keys, order, axis=1)
        tokens = np.take_along_axis(self.top.payload, order[..., None], axis=1)
        tokens[keys == _EMPTY] = np.nan
        tokens_seen = max(self.rows * self.positions, 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_active = np.where(self.fire_tokens > 0, self.sum_active / self.fire_tokens, np.nan)
        q_rows, q_values = self._quantiles()
        return IndexArrays(
            top_rows=key_rows(keys), top_values=key_values(keys).astype(np.float32), top_tokens=tokens,
            density_tokens=self.fire_tokens / tokens_seen, density_rows=self.fire_rows / max(self.rows, 1),
            mean_active=mean_active,
            max_value=np.where(np.isneginf(self.max_value), np.float32(np.nan), self.max_value).astype(np.float32),
            histogram=self.histogram.copy(), histogram_rows=self.histogram_rows.copy(),
            quantile_rows=q_rows, quantile_values=q_values,
            dead=np.flatnonzero(self.fire_tokens == 0).astype(np.int64),
        )

    def _quantiles(self) -> tuple[np.ndarray, np.ndarray]:
        """Per feature, its firing rows cut into QUANTILES groups of about equal count by pooled value (at the
        resolution of the row bins), and up to EXAMPLES rows of each: those of the smallest hash among the
        group's bins' examples (a uniform sample of the group)."""
        f, b, m = self.features, HIST_BINS, EXAMPLES
        counts = self.histogram_rows.astype(np.float64)
        total = np.maximum(counts.sum(axis=1, keepdims=True), 1)
        middle = (np.cumsum(counts, axis=1) - counts / 2) / total  # each bin's middle, as a share of the rows
        group = np.minimum((middle * QUANTILES).astype(np.int64), QUANTILES - 1)  # (F, B)
        keys = self.examples.keys.reshape(f, b * m)
        values = self.examples.payload.reshape(f, b * m)
        groups = np.repeat(group, m, axis=1)
        groups[keys == _EMPTY] = QUANTILES  # empty slots: after every group
        order = np.lexsort((~keys, groups), axis=-1)  # by group, then the largest key (smallest hash)
        g = np.take_along_axis(groups, order, axis=1)
        first = np.zeros_like(g)
        first[:, 1:] = np.where(np.diff(g, axis=1) != 0, np.arange(1, b * m), 0)
        rank = np.arange(b * m) - np.maximum.accumulate(first, axis=1)
        keep = (g < QUANTILES) & (rank < m)
        fi, pos = np.nonzero(keep)
        rows = np.full((f, QUANTILES, m), -1, np.int64)
        vals = np.full((f, QUANTILES, m), np.nan, np.float32)
        src = order[fi, pos]
        rows[fi, g[fi, pos], rank[fi, pos]] = (~keys[fi, src] & _ROW_MASK).astype(np.int64)
        vals[fi, g[fi, pos], rank[fi, pos]] = values[fi, src]
        return rows, vals

    # ------------------------------------------------------------------ a shard's part, as the store keeps it
    def _parts(self) -> list[np.ndarray]:
        """The state's arrays, in the order of its bytes (their shapes follow from the index's settings)."""
        return [np.array([self.rows], np.int64), self.top.keys, self.top.payload, self.examples.keys,
                self.examples.payload, self.fire_tokens, self.fire_rows, self.sum_active, self.max_value,
                self.histogram, self.histogram_rows]

    def nbytes(self) -> int:
        """Bytes of :meth:`to_bytes`: the same for every state of these settings."""
        return 8 + sum(a.nbytes for a in self._parts())

    def to_bytes(self) -> np.ndarray:
        """The state as uint8 of a fixed length: a magic number and a CRC-32 of the rest, then its arrays' bytes
        (little-endian). All zeros (a part never written) is no state."""
        body = b"".join(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes() for a in self._parts())
        head = _MAGIC.to_bytes(4, "little") + zlib.crc32(body).to_bytes(4, "little")
        return np.frombuffer(head + body, np.uint8)

    def load(self, blob: np.ndarray) -> bool:
        """Take the state written by :meth:`to_bytes` of a state of these settings; False (nothing taken) when
        ``blob`` is not one (never written, or cut short)."""
        raw = np.ascontiguousarray(blob, np.uint8).tobytes()
        if len(raw) != self.nbytes() or int.from_bytes(raw[:4], "little") != _MAGIC:
            return False
        if zlib.crc32(raw[8:]) != int.from_bytes(raw[4:8], "little"):
            return False
        at, out = 8, []  # type: tuple[int, list[Any]]
        for a in self._parts():
            n = a.nbytes
            out.append(np.frombuffer(raw[at : at + n], a.dtype.newbyteorder("<")).astype(a.dtype).reshape(a.shape))
            at += n
        (rows,), self.top.keys, self.top.payload, self.examples.keys, self.examples.payload = out[:5]
        self.rows = int(rows)
        (self.fire_tokens, self.fire_rows, self.sum_active, self.max_value, self.histogram,
         self.histogram_rows) = out[5:]
        for slots in (self.top, self.examples):
            slots.floor = slots.keys.min(axis=1)
        return True


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
