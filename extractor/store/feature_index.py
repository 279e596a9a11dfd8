"""A feature index, streamed: what every feature of a capture (its channels, or a dictionary's latents) responds
to, accumulated a block of rows at a time in memory bounded by features x k (never by rows), mergeable across
shards in any order and partition with the same result (numpy and zarr only).

Per feature: the top-k rows by the feature pooled over the row's positions (max or mean), with its value at each
position (a heatmap); how many tokens and rows it fires in (value above ``threshold``); the sum of its values where
it fires; its largest value; a histogram of log10 of its values where it fires (per token) and of its pooled values
(per firing row); and for each of those row bins a few example rows (the ones with the smallest hash of row and
feature: a sample that does not depend on the order rows come in), from which the quantile groups are drawn.

Ties never depend on the order either: a row ranks by its pooled value, then by the lower row number (one uint64
key holds both, :func:`top_keys`). The stored layout of a finished index (``indexes/<name>``) is written and read
here (:func:`write_index`, :class:`IndexRecord`); the reader's view of it is ``extractor.read.FeatureIndex``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

import numpy as np
import zarr

__all__ = ["INDEX_VERSION", "HIST_EDGES", "QUANTILES", "IndexState", "IndexRecord", "IndexArrays", "write_index",
           "top_keys", "INDEXES"]

INDEX_VERSION = 1
INDEXES = "indexes"  # the store's group of indexes: indexes/<name>
HIST_LO, HIST_STEP, HIST_BINS = -4.0, 0.1, 80  # log10 bins: 1e-4 to 1e4, a tenth of a decade each
HIST_EDGES = HIST_LO + HIST_STEP * np.arange(HIST_BINS + 1)  # values outside count in the first or last bin
_LINEAR_EDGES = 10.0**HIST_EDGES  # what a value is compared with: a bin holds 10**edge[b] <= v < 10**edge[b + 1]
QUANTILES = 10  # groups of example rows, by the feature's pooled value among the rows where it fires
EXAMPLES = 4  # example rows kept per (feature, row bin), and shown per quantile group
BLOCK_VALUES = 1 << 20  # activations (rows x positions x features) taken at once: 4 MB of float32 (measured: 2x
# faster than 64 MB blocks, whose temporaries are fresh pages each time)
ENCODE_VALUES = 1 << 24  # latents a dictionary encodes at once: 64 MB (measured over ViT-B tokens: 0.95x the bare
# loop's time, against 1.97x with 4 MB blocks: a matmul of one row's tokens and the calls around it)
_EMPTY = np.uint64(0)  # the key of an empty slot: below every real key
_ROW_MASK = np.uint64(0xFFFFFFFF)
_MAGIC = 0x58494631  # "1FIX": a part of an index, version 1


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


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: uint64 -> uint64, every bit of the input spread over the output."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def sample_keys(rows: np.ndarray, features: np.ndarray) -> np.ndarray:
    """The key by which example rows are kept, per (row, feature) pair: larger for a smaller hash of the pair, then
    the lower row; the kept ones of a bin are those of the largest keys (a uniform sample of the bin's rows, whatever
    order they came in)."""
    with np.errstate(over="ignore"):
        h = _mix(rows.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + features.astype(np.uint64))
    return ~((h >> np.uint64(32) << np.uint64(32)) | rows.astype(np.uint64))


def _growing(n: int, seen: int, first: int = 32) -> np.ndarray:
    """Ends of the parts a block of ``n`` rows is offered in, after ``seen`` rows: parts as large as all the rows
    before them (from ``first``), so that early rows fill the slots before the many later ones are compared."""
    ends, at = [], 0
    while at < n:
        at = min(n, at + max(first, seen + at))
        ends.append(at)
    return np.asarray(ends)


@dataclass(frozen=True)
class _Firing:
    """The entries of a flat (rows x features) array above the threshold: where, which feature, value, log10 bin."""

    at: np.ndarray  # flat positions, ascending
    feature: np.ndarray
    values: np.ndarray
    bins: np.ndarray

    @classmethod
    def of(cls, flat: np.ndarray, fire: np.ndarray, features: int) -> _Firing:
        at = np.flatnonzero(fire)
        values = flat[at]
        return cls(at, at % features, values, _bins(values))


class _Slots:
    """Per cell, the ``k`` largest keys offered (0: an empty slot), each with its payload, in no order. Offering
    the same keys in any order, or in parts merged later, leaves the same slots filled (keys are unique)."""

    def __init__(self, cells: int, k: int, payload: tuple[int, ...], dtype: Any) -> None:
        self.keys = np.zeros((cells, k), np.uint64)
        self.payload = np.zeros((cells, k, *payload), dtype)
        self.floor = np.zeros(cells, np.uint64)  # the smallest key held per cell: what a new one must beat

    def offer(self, cells: np.ndarray, keys: np.ndarray, payload: Callable[[np.ndarray], np.ndarray]) -> None:
        """Offer candidates (cell, key), each key above its cell's floor; ``payload(i)`` gives the payloads of
        candidates ``i``, asked only for those that take a slot."""
        if not len(keys):
            return
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


class IndexState:
    """What a stream of rows has shown of each of ``features`` features over ``positions`` positions per row:
    bounded by features x (k x positions + bins x examples), never by rows. ``update`` adds a block, ``merge``
    another state (another shard's), in any order; ``finish`` gives the index."""

    def __init__(self, features: int, positions: int, k: int = 16, pool: str = "max", threshold: float = 0.0) -> None:
        if pool not in ("max", "mean"):
            raise ValueError(f"pool must be max or mean, not {pool!r}")
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0 (the histogram is of log10 of the values above it), "
                             f"not {threshold}")
        self.features, self.positions, self.k, self.pool = features, positions, k, pool
        self.threshold = float(threshold)
        self.top = _Slots(features, k, (positions,), np.float32)  # keys: top_keys; payload: the row's values
        self.examples = _Slots(features * HIST_BINS, EXAMPLES, (), np.float32)  # keys: sample_keys; pooled value
        self.fire_tokens = np.zeros(features, np.int64)
        self.fire_rows = np.zeros(features, np.int64)
        self.sum_active = np.zeros(features, np.float64)
        self.max_value = np.full(features, -np.inf, np.float32)
        self.histogram = np.zeros((features, HIST_BINS), np.int64)
        self.histogram_rows = np.zeros((features, HIST_BINS), np.int64)
        self.rows = 0

    def block_rows(self, values: int = BLOCK_VALUES) -> int:
        """Rows whose activations make a block of about ``values`` values."""
        return max(1, values // max(1, self.positions * self.features))

    def update(self, acts: np.ndarray, rows: np.ndarray) -> None:
        """Add ``acts`` (n, T, F) float32: the features at each position of the store rows ``rows`` (n,)."""
        n, t, f = acts.shape
        if (t, f) != (self.positions, self.features):
            raise ValueError(f"a block of {t} positions x {f} features; the index has {self.positions} x "
                             f"{self.features}")
        if not n:
            return
        self.rows += n
        tokens = _Firing.of(acts.reshape(-1), acts.reshape(-1) > self.threshold, f)  # NaN never fires
        self.fire_tokens += np.bincount(tokens.feature, minlength=f)
        self.sum_active += np.bincount(tokens.feature, weights=tokens.values, minlength=f)
        self.histogram += np.bincount(tokens.feature * HIST_BINS + tokens.bins,
                                      minlength=f * HIST_BINS).reshape(f, HIST_BINS)
        peak = acts[:, 0] if t == 1 else acts.max(axis=1)  # (n, F)
        self.max_value = np.fmax(self.max_value, np.fmax.reduce(peak, axis=0))  # NaN (a float16 overflow) left out
        if t == 1:
            fired = tokens  # one position: the row's pooled value is the token's
        elif self.pool == "max":
            fired = _Firing.of(peak.reshape(-1), peak.reshape(-1) > self.threshold, f)
        else:
            pooled = acts.mean(axis=1)
            fires = (acts > self.threshold).any(axis=1) & ~np.isnan(pooled)
            fired = _Firing.of(pooled.reshape(-1), fires.reshape(-1), f)
        self.fire_rows += np.bincount(fired.feature, minlength=f)
        cells = fired.feature * HIST_BINS + fired.bins
        self.histogram_rows += np.bincount(cells, minlength=f * HIST_BINS).reshape(f, HIST_BINS)
        row = fired.at // f  # of the block
        sample = sample_keys(rows[row], fired.feature)
        # a few rows first, then more: once the slots hold rows, few candidates beat their floors
        a, ends = 0, np.searchsorted(row, _growing(n, self.rows - n), side="left")
        for b in ends:
            part = slice(a, b)
            self._offer_top(acts, rows, row[part], fired.feature[part], fired.values[part])
            self._offer_examples(cells[part], sample[part], fired.values[part])
            a = b

    def _offer_top(self, acts: np.ndarray, rows: np.ndarray, row: np.ndarray, feature: np.ndarray,
                   values: np.ndarray) -> None:
        """Offer the (row, feature) pairs of pooled ``values`` that beat their feature's k-th row."""
        keys = top_keys(values, rows[row])
        fit = keys > self.top.floor[feature]
        row, feature, keys = row[fit], feature[fit], keys[fit]
        self.top.offer(feature, keys, lambda i: acts[row[i], :, feature[i]])

    def _offer_examples(self, cells: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        fit = keys > self.examples.floor[cells]
        cells, keys, values = cells[fit], keys[fit], values[fit]
        self.examples.offer(cells, keys, lambda i: values[i])

    def merge(self, other: IndexState) -> None:
        """Add another state of the same features (another shard's rows)."""
        if (other.features, other.positions, other.k, other.pool) != (self.features, self.positions, self.k,
                                                                      self.pool):
            raise ValueError("merging indexes of other features, positions, k or pool")
        self.rows += other.rows
        self.fire_tokens += other.fire_tokens
        self.fire_rows += other.fire_rows
        self.sum_active += other.sum_active
        self.max_value = np.fmax(self.max_value, other.max_value)
        self.histogram += other.histogram
        self.histogram_rows += other.histogram_rows
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


def _bin_table() -> np.ndarray:
    """The bin of the smallest float32 of each value of its top 16 bits (sign, exponent, 7 bits of mantissa): such a
    range spans less than 1% of a value, a bin 26%, so one comparison with the next edge finishes the bin."""
    lowest = (np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)).view(np.float32)
    with np.errstate(invalid="ignore"):
        at = np.searchsorted(_LINEAR_EDGES, lowest.astype(np.float64), side="right") - 1
    at[np.isnan(lowest) | (lowest <= 0)] = 0  # negative numbers, -0.0, NaN (never fire): the first bin
    return np.clip(at, 0, HIST_BINS - 1).astype(np.uint8)


def _float32_edges() -> np.ndarray:
    """The smallest float32 at or above each edge: ``v >= it`` in float32 is ``v >= edge`` in float64."""
    e = _LINEAR_EDGES.astype(np.float32)
    below = e.astype(np.float64) < _LINEAR_EDGES
    e[below] = np.nextafter(e[below], np.float32(np.inf))
    return e


_BIN_TABLE = _bin_table()
_EDGES32 = _float32_edges()


def _bins(values: np.ndarray) -> np.ndarray:
    """The bin of each float32 value among the edges 10**HIST_EDGES (below and above them: the first and last bin),
    as ``np.histogram`` puts it (measured: 8x faster than float32 log10 and a correction on each side)."""
    values = np.ascontiguousarray(values, np.float32)
    at = np.take(_BIN_TABLE, (values.view(np.uint32) >> np.uint32(16)).astype(np.intp)).astype(np.intp)
    at += (values >= np.take(_EDGES32, at + 1)) & (at < HIST_BINS - 1)
    return at


class IndexRecord(TypedDict):
    """The attributes of ``indexes/<name>`` (the README's store layout)."""

    index_version: int
    name: str
    key: str  # the capture
    features: int
    k: int
    pool: str
    dictionary: dict[str, Any] | None  # {path, digest "sha256:...", activation, d_in, d_sae}
    rows: int  # ok rows covered
    source_state: dict[str, Any]  # what the staleness check compares (source_state())
    positions: int  # T per row
    grid: list[int] | None  # [h, w] of the positions after the prefix, or None
    prefix: int  # leading positions not in the grid (CLS, registers)
    threshold: float
    hist_edges: list[float]  # log10 bin edges of histogram and histogram_rows
    quantiles: int
    examples: int  # rows per quantile group
    written: str  # "write-time" (merged from the job's shards) or "post-hoc"
    created: str


def write_index(group: zarr.Group, name: str, arrays: IndexArrays, record: Mapping[str, Any]) -> None:
    """Write ``indexes/<name>`` into the store whose root is ``group`` (opened for writing: through the job's or
    the index's lease), replacing one of that name: its arrays, then its attributes (an index without them is
    half-written and not read)."""
    parent = group.require_group(INDEXES)
    if name in parent:
        del parent[name]
    node = parent.create_group(name)
    f = arrays.top_rows.shape[0]
    per = max(1, min(f, (1 << 22) // max(1, arrays.top_tokens[0].size * 4)))  # features per chunk: <= 4 MB
    for field, value in arrays.__dict__.items():
        value = np.ascontiguousarray(value)
        chunks = (per, *value.shape[1:]) if value.ndim and field != "dead" else value.shape
        if not value.size:
            chunks = (1,) * value.ndim
        dims = ["feature", *(f"{field}.{i}" for i in range(1, value.ndim))] if field != "dead" else ["dead"]
        array = node.create_array(field, shape=value.shape, chunks=chunks, dtype=value.dtype, dimension_names=dims,
                                  fill_value=-1 if value.dtype.kind == "i" else 0)
        array[...] = value
    node.attrs.update(dict(record))


# ---------------------------------------------------------------------- a capture's rows as positions x features
@dataclass(frozen=True)
class Layout:
    """How the rows of a capture are read as (positions, features): a map's channels at its y x x positions, a token
    sequence's features at its tokens, a vector's features at one position."""

    kind: str  # map (channel, y, x), map_last (y, x, channel), tokens (token, feature), vector (feature)
    features: int  # per position, as stored
    positions: int
    grid: tuple[int, int] | None  # the positions after ``prefix`` as a (h, w) grid, when they make one
    prefix: int  # leading positions not in the grid (a ViT's CLS and registers)

    @classmethod
    def of(cls, key: str, record: Mapping[str, Any], prefix_tokens: int | None) -> Layout:
        """The layout of capture ``key`` (its CaptureRecord); ``prefix_tokens``: the model's, as the store says."""
        names = [d.rsplit(".", 1)[-1] for d in record["dims"]]
        shape = [int(v) for v in record["shape"]]
        if names == ["channel", "y", "x"]:
            return cls("map", shape[0], shape[1] * shape[2], (shape[1], shape[2]), 0)
        if names == ["y", "x", "channel"]:
            return cls("map_last", shape[2], shape[0] * shape[1], (shape[0], shape[1]), 0)
        if names == ["feature"] or names == ["channel"]:
            return cls("vector", shape[0], 1, None, 0)
        if names == ["token", "feature"]:
            if record.get("sample_tokens"):  # sampled positions differ per row: no grid
                return cls("tokens", shape[1], shape[0], None, int(record.get("prefix_kept") or 0))
            prefix = 0 if record.get("drop_prefix") else int(prefix_tokens or 0)
            side = int(round(max(shape[0] - prefix, 0) ** 0.5))
            grid = (side, side) if side and side * side == shape[0] - prefix else None
            return cls("tokens", shape[1], shape[0], grid, prefix)
        raise ValueError(f"{key} is stored as ({', '.join(names)}): an index needs channels of a map, a token "
                         "sequence's features or a vector's features")

    def tokens(self, x: np.ndarray) -> np.ndarray:
        """Rows ``x`` (n, *shape) as (n, positions, features) float32."""
        n = len(x)
        x = np.asarray(x)
        if x.dtype != np.float32:
            x = x.astype(np.float32)
        if self.kind == "map":
            return np.ascontiguousarray(x.reshape(n, self.features, self.positions).transpose(0, 2, 1))
        return x.reshape(n, self.positions, self.features)


class Encoder(Protocol):
    """What turns a position's stored features into the index's features: a dictionary's ``encode``."""

    @property
    def d_sae(self) -> int: ...

    def encode(self, x: np.ndarray) -> np.ndarray: ...


class IndexFeed:
    """One index being computed over a stream of a capture's rows: its layout, its encoder (None: the capture's own
    features), its state. Rows are added as the store's chunks hold them, and cut into blocks from the chunk's
    start: a write-time index (fed by the writer threads) and a post-hoc one meet the same blocks."""

    def __init__(self, layout: Layout, k: int, pool: str, threshold: float, encoder: Encoder | None = None) -> None:
        self.layout, self.encoder = layout, encoder
        features = encoder.d_sae if encoder is not None else layout.features
        self.state = IndexState(features, layout.positions, k, pool, threshold)

    def add(self, x: np.ndarray, rows: np.ndarray) -> None:
        """Add rows ``x`` (n, *shape) of the capture, store rows ``rows`` (ok rows only)."""
        step = self.state.block_rows(BLOCK_VALUES if self.encoder is None else ENCODE_VALUES)
        for a in range(0, len(x), step):
            acts = self.layout.tokens(x[a : a + step])
            if self.encoder is not None:
                n, t, d = acts.shape
                acts = self.encoder.encode(acts.reshape(n * t, d)).reshape(n, t, -1)
            self.state.update(acts, rows[a : a + step])


# ---------------------------------------------------------------------- the store's record of an index
def source_state(group: zarr.Group) -> dict[str, Any]:
    """What an index covers of the store: its creation, last resume, done shards and ok rows. A store whose state
    differs since (resumed, more shards done) makes the index stale."""
    from .layout import OK, done_shards, get_array, root_attrs

    group = zarr.open_group(store=group.store, mode="r", use_consolidated=False)  # as the storage has it now
    attrs = root_attrs(group)
    status = np.asarray(get_array(group, "status")[:])
    return {"created": attrs.get("created"), "resumed": attrs.get("resumed"),
            "done_shards": int(done_shards(group).sum()), "ok_rows": int((status == OK).sum())}


def index_name(key: str, dictionary_stem: str | None) -> str:
    return key if dictionary_stem is None else f"{key}@{dictionary_stem}"


def index_record(name: str, key: str, feed: IndexFeed, dictionary: Mapping[str, Any] | None,
                 state: Mapping[str, Any], written: str) -> IndexRecord:
    from .layout import now

    s = feed.state
    return IndexRecord(
        index_version=INDEX_VERSION, name=name, key=key, features=s.features, k=s.k, pool=s.pool,
        dictionary=dict(dictionary) if dictionary is not None else None, rows=s.rows, source_state=dict(state),
        positions=s.positions, grid=list(feed.layout.grid) if feed.layout.grid else None, prefix=feed.layout.prefix,
        threshold=s.threshold, hist_edges=[round(float(e), 6) for e in HIST_EDGES], quantiles=QUANTILES,
        examples=EXAMPLES, written=written, created=now())


# ---------------------------------------------------------------------- a job's parts: one per shard, merged at the end
PARTS = "index_parts"  # group of the store: one (shards, bytes) uint8 array per indexed capture


def part_array(group: zarr.Group, key: str) -> zarr.Array:
    from .layout import get_array

    return get_array(group, f"{PARTS}/{key}")


def ensure_parts(group: zarr.Group, feeds: Mapping[str, IndexFeed], n_shards: int) -> None:
    """The arrays that keep each shard's part of each write-time index (made where missing or of another size;
    a shard's part is one chunk: its own object). Nothing for a job without one."""
    if not feeds:
        return
    parent = group.require_group(PARTS)
    for key, feed in feeds.items():
        size = feed.state.nbytes()
        existing = parent.get(key)
        if isinstance(existing, zarr.Array) and existing.shape == (n_shards, size):
            continue
        parent.create_array(key, shape=(n_shards, size), chunks=(1, size), dtype="uint8", fill_value=0,
                            dimension_names=["shard", "index_byte"], overwrite=True)


def merged_parts(group: zarr.Group, key: str, feed: IndexFeed) -> tuple[int, int]:
    """Merge into ``feed`` the part of every done shard, read one at a time (memory: two states); returns (merged,
    missing): done shards whose part is not there (made before the index was asked for) are missing."""
    from .layout import done_shards

    done = np.flatnonzero(done_shards(group))
    parts = part_array(group, key)
    one = IndexState(feed.state.features, feed.state.positions, feed.state.k, feed.state.pool, feed.state.threshold)
    missing = 0
    for s in done.tolist():
        if one.load(np.asarray(parts[s])):
            feed.state.merge(one)
        else:
            missing += 1
    return len(done) - missing, missing


def feed_of(key: str, record: Mapping[str, Any], prefix_tokens: int | None = None) -> IndexFeed:
    """The feed of the write-time index a capture's record asks for (its ``feature_index``)."""
    from .dictionary import cached_dictionary

    settings = record["feature_index"]
    layout = Layout.of(key, record, prefix_tokens)
    dic = settings.get("dictionary")
    encoder = cached_dictionary(dic["path"], dic["activation"], dic["digest"]) if dic else None
    return IndexFeed(layout, int(settings["k"]), str(settings["pool"]), float(settings["threshold"]), encoder)


def indexed(captures: Mapping[str, Mapping[str, Any]]) -> dict[str, IndexFeed]:
    """A fresh feed per capture whose record asks for a write-time index."""
    return {key: feed_of(key, m) for key, m in captures.items() if m.get("feature_index")}


def finish_indexes(group: zarr.Group) -> list[str]:
    """At a job's end, under its lease: each write-time index merged from the parts of the done shards and written
    (``indexes/<name>``); the names written. One whose parts are missing (shards done before it was asked for) is
    left out, with a warning."""
    import logging

    from .layout import root_attrs

    attrs = root_attrs(group)
    written = []
    for key, m in attrs["captures"].items():
        if not m.get("feature_index"):
            continue
        feed = feed_of(key, m, (attrs.get("model") or {}).get("prefix_tokens"))
        merged, missing = merged_parts(group, key, feed)
        settings = m["feature_index"]
        name = settings["name"]
        if missing:
            logging.getLogger(__name__).warning("index %s not written: %d done shards have no part of it (computed "
                                                "before it was asked for); run extractor index", name, missing)
            continue
        record = index_record(name, key, feed, settings.get("dictionary"), source_state(group), "write-time")
        write_index(group, name, feed.state.finish(), record)
        written.append(name)
    return written


def with_indexes(capture_specs: Any, captures: Mapping[str, Any], prefix_tokens: int | None) -> dict[str, Any]:
    """The capture records, each whose spec asks for a write-time index (``capture[i].feature_index``) with its
    settings (``feature_index``: k, pool, threshold, the dictionary's record, name), checked before the store is
    touched: a capture that has no features to index, or a dictionary that does not fit it, is an error here."""
    from ..errors import SpecError
    from .dictionary import load_dictionary

    out = {}
    for key, record in captures.items():
        want = capture_specs[record["capture"]].feature_index
        if want is None:
            out[key] = record
            continue
        try:
            layout = Layout.of(key, record, prefix_tokens)
        except ValueError as err:
            raise SpecError(f"capture[{record['capture']}].feature_index: {err}") from None
        dic = load_dictionary(want.dictionary, want.activation) if want.dictionary else None
        if dic is not None:
            dic.check_input(layout.features, f"capture[{record['capture']}] {key} {list(record['shape'])}")
        settings = {"k": want.k, "pool": want.pool, "threshold": want.threshold,
                    "dictionary": dic.record() if dic is not None else None,
                    "name": want.name or index_name(key, dic.stem if dic is not None else None)}
        out[key] = {**record, "feature_index": settings}
    return out
