"""A feature index of a capture: how its rows read as positions x features (:class:`Layout`), a stream of them fed to
an :class:`~.state.IndexState` (:class:`IndexFeed`), the stored layout of a finished index (``indexes/<name>``:
:func:`write_index`, :class:`IndexRecord`) and a job's parts of a write-time index, one per shard, merged at its end
(numpy and zarr only). The reader's view of a stored index is ``extractor.index.FeatureIndex``.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict

import numpy as np
import zarr

from .state import EXAMPLES, HIST_EDGES, QUANTILES, IndexArrays, IndexState

__all__ = ["INDEX_VERSION", "READ_VERSIONS", "INDEXES", "IndexRecord", "write_index", "Layout", "IndexFeed",
           "source_state", "index_name", "index_record", "ensure_parts", "finish_indexes", "indexed", "with_indexes"]

INDEX_VERSION = 2  # 2: the arrays in a subgroup the attributes name (``arrays``): an index replaced whole or not at all
READ_VERSIONS = (1, 2)  # 1: the arrays in the index's group itself
INDEXES = "indexes"  # the store's group of indexes: indexes/<name>
BLOCK_VALUES = 1 << 20  # activations (rows x positions x features) taken at once: 4 MB of float32 (measured: 2x
# faster than 64 MB blocks, whose temporaries are fresh pages each time)
ENCODE_VALUES = 1 << 24  # latents a dictionary encodes at once: 64 MB (measured over ViT-B tokens: 0.95x the bare
# loop's time, against 1.97x with 4 MB blocks: a matmul of one row's tokens and the calls around it)


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
    arrays: NotRequired[str]  # the subgroup of indexes/<name> holding its arrays (set by write_index)


def write_index(group: zarr.Group, name: str, arrays: IndexArrays, record: Mapping[str, Any]) -> None:
    """Write ``indexes/<name>`` into the store whose root is ``group`` (opened for writing: through the job's or
    the index's lease), replacing one of that name whole: its arrays into a new subgroup, then its attributes,
    which name that subgroup (one object: a reader finds the old index or the new one). The arrays of the index
    replaced stay until the next write (a reader that opened it still reads it whole, and is told it was replaced);
    older ones, and what writes that failed midway left, go. A write that fails midway leaves the index it was
    replacing (an index without attributes is not listed)."""
    node = group.require_group(INDEXES).require_group(name)
    replaced = node.attrs.get("arrays")
    old = [m for m in node.keys() if m != replaced]  # version 1's arrays, older versions, failed writes
    at = f"v{uuid.uuid4().hex[:12]}"
    _write_arrays(node.create_group(at), arrays)
    node.attrs.put({**record, "arrays": at})
    for gone in old:
        del node[gone]


def _write_arrays(node: zarr.Group, arrays: IndexArrays) -> None:
    """An index's arrays, chunked by feature (about 4 MB a chunk)."""
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

    def tokens(self, x: Any) -> Any:
        """Rows ``x`` (n, *shape) as (n, positions, features): a numpy array (float16: a view of ``x``, which the
        index converts once and bins by a table of its values; anything else a contiguous float32 copy), or a float32
        torch tensor on its device (the write-time index's blocks: ``extractor.index.device``)."""
        n = len(x)
        if not hasattr(x, "swapaxes"):
            x = np.asarray(x)
        if self.kind == "map":
            x = x.reshape(n, self.features, self.positions).swapaxes(1, 2)
        else:
            x = x.reshape(n, self.positions, self.features)
        if isinstance(x, np.ndarray):
            return x if x.dtype == np.float16 else np.ascontiguousarray(x, np.float32)
        return x.float()


class Encoder(Protocol):
    """What turns a position's stored features into the index's features: a dictionary's ``encode``."""

    @property
    def d_sae(self) -> int: ...

    def encode(self, x: Any) -> Any: ...  # (n, d_in) numpy or torch -> (n, d_sae) float32 of the same kind


class IndexFeed:
    """One index being computed over a stream of a capture's rows: its layout, its encoder (None: the capture's own
    features), its state. A post-hoc pass adds the store's chunks (``add``); a job's write-time index adds each
    computed batch's blocks made on the device (``extractor.index.device``, from :meth:`blocks`) and the
    chunks of rows it did not compute. The state does not depend on how rows are cut into blocks."""

    def __init__(self, layout: Layout, k: int, pool: str, threshold: float, encoder: Encoder | None = None) -> None:
        self.layout, self.encoder = layout, encoder
        features = encoder.d_sae if encoder is not None else layout.features
        self.state = IndexState(features, layout.positions, k, pool, threshold)

    def lane(self) -> IndexFeed:
        """A feed for another thread beside this one: the same layout and encoder, a :meth:`IndexState.lane` of its
        state (counts of its own, the slots shared); its state is joined to this one's once done."""
        feed = copy.copy(self)
        feed.state = self.state.lane()
        return feed

    def blocks(self, x: Any, rows: np.ndarray) -> Iterator[tuple[Any, np.ndarray]]:
        """Rows ``x`` (n, *shape) of the capture (numpy, or a torch tensor on its device) of store rows ``rows``, cut
        into blocks from the first: each as (n', positions, features) float32 of the index's features (encoded by
        the dictionary) of the same kind, with its rows."""
        step = self.state.block_rows(BLOCK_VALUES if self.encoder is None else ENCODE_VALUES)
        for a in range(0, len(x), step):
            acts = self.layout.tokens(x[a : a + step])
            if self.encoder is not None:
                n, t, d = acts.shape
                acts = self.encoder.encode(acts.reshape(n * t, d)).reshape(n, t, -1)
            yield acts, rows[a : a + step]

    def add(self, x: np.ndarray, rows: np.ndarray) -> None:
        """Add rows ``x`` (n, *shape) of the capture, store rows ``rows`` (ok rows only), on the host."""
        for acts, block_rows in self.blocks(x, rows):
            self.state.update(acts, block_rows)


# ---------------------------------------------------------------------- the store's record of an index
def source_state(group: zarr.Group) -> dict[str, Any]:
    """What an index covers of the store: its creation, last resume, done shards and ok rows. A store whose state
    differs since (resumed, more shards done) makes the index stale."""
    from ..store import OK, done_shards, get_array, root_attrs

    group = zarr.open_group(store=group.store, mode="r", use_consolidated=False)  # as the storage has it now
    attrs = root_attrs(group)
    status = np.asarray(get_array(group, "status")[:])
    return {"created": attrs.get("created"), "resumed": attrs.get("resumed"),
            "done_shards": int(done_shards(group).sum()), "ok_rows": int((status == OK).sum())}


def index_name(key: str, dictionary_stem: str | None) -> str:
    return key if dictionary_stem is None else f"{key}@{dictionary_stem}"


def index_record(name: str, key: str, feed: IndexFeed, dictionary: Mapping[str, Any] | None,
                 state: Mapping[str, Any], written: str) -> IndexRecord:
    from ..store import now

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
    from ..store import get_array

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
    from ..store import done_shards

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

    from ..store import root_attrs

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
