"""A feature index's streamed state: what every feature of a capture (its channels, or a dictionary's latents) responds
to, accumulated a block of rows at a time in memory bounded by features x k (never by rows), mergeable across
shards in any order and partition with the same result (numpy only: the reference that the compiled pass,
:mod:`.kernel`, and the device's, :mod:`.device`, are held to).

Per feature: the top-k rows by the feature pooled over the row's positions (max or mean), with its value at each
position (a heatmap); how many tokens and rows it fires in (value above ``threshold``); the sum of its values where
it fires; its largest value; a histogram of log10 of its values where it fires (per token) and of its pooled values
(per firing row); and for each of those row bins a few example rows (the ones with the smallest hash of row and
feature: a sample that does not depend on the order rows come in), from which the quantile groups are drawn.

Ties never depend on the order either: a row ranks by its pooled value, then by the lower row number (one uint64
key holds both, :func:`~.keys.top_keys`); the bins are :mod:`.bins`', the slots :mod:`.slots`'. How a capture's
rows feed it: :mod:`.feed`; where a finished index is stored: :mod:`.layout`.
"""

from __future__ import annotations

import threading
import zlib
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from . import kernel
from .bins import (
    _AMBIGUOUS,
    _DUMP,
    _KERNEL_TABLES,
    HIST_BINS,
    _counts,
    _fired_bins,
    _histogram,
    _offsets,
    _sparse_tokens,
)
from .keys import _EMPTY, _ROW_MASK, _feature_mix, _row_mix, key_rows, key_values, sample_hashes, sample_keys, top_keys
from .slots import _Slots

__all__ = ["EXAMPLES", "QUANTILES", "BlockPart", "IndexArrays", "IndexState"]

QUANTILES = 10  # groups of example rows, by the feature's pooled value among the rows where it fires
EXAMPLES = 4  # example rows kept per (feature, row bin), and shown per quantile group
_MAGIC = 0x58494632  # "2FIX": a part of an index, version 2 (sample keys of sample_hashes)


def _growing(n: int, seen: int, first: int = 32) -> np.ndarray:
    """Ends of the parts a block of ``n`` rows is offered in, after ``seen`` rows: parts as large as all the rows
    before them (from ``first``), so that early rows fill the slots before the many later ones are compared."""
    ends, at = [], 0
    while at < n:
        at = min(n, at + max(first, seen + at))
        ends.append(at)
    return np.asarray(ends)


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
    """A finished index: the arrays of ``indexes/<name>`` (see docs/reference/store.md)."""

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
        at, out = 8, []  # type: tuple[int, list[np.ndarray]]
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
