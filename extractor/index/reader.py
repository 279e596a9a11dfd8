"""What every feature of a capture responds to: a feature index, computed in one pass over the store (or merged from
the job's shards at write time) and kept in the store under ``indexes/<name>`` (numpy and zarr).

    >>> ix = index("out.zarr", "blocks.11", dictionary="sae/")   # one pass; written into the store
    >>> ix = open_index("out.zarr")                                # read back (a viewer, a notebook)
    >>> ix.top(42)              # rows, ids, values: where latent 42 is highest (pooled over the patches)
    >>> ix.heatmap(42, 0)       # (h, w): latent 42 at each patch of its top image
    >>> ix.density, ix.dead     # share of tokens where each latent fires; latents that never fire
    >>> ix.histogram(42)        # counts, log10 edges
    >>> ix.encode_row(7)        # (T, F): which latents fire at each patch of row 7
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

from .._threads import prefetched
from ..errors import OutOfRangeError, StoreError
from ..read import ActivationStore, job_lease_timeout, open_store
from ..store import LEASE_TIMEOUT_S, OK, Lease, consolidate, get_array, owner
from .dictionary import Dictionary, DictionaryError, file_digest, load_dictionary
from .layout import INDEXES, READ_VERSIONS, IndexFeed, Layout, index_name, index_record, source_state, write_index

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["index", "open_index", "FeatureIndex", "TopRows"]

log = logging.getLogger(__name__)
READ_AHEAD = 2  # chunks read ahead of the pass (zarr decodes on the reading threads)
LANES = 2  # threads a pass adds chunks on (2 cores, SAE of 4,096 latents over 2,000 images: 1.5x the bare loop's
# time on one, 1.2x on two; raw channels of a 1,024-channel map: 5.0 s on one, 3.5 s on two)


@dataclass(frozen=True)
class TopRows:
    """The rows where a feature is highest, highest first."""

    rows: np.ndarray  # (n,) int64 store rows
    ids: np.ndarray  # (n,) their image ids
    values: np.ndarray  # (n,) float32: the feature pooled over each row's positions


def _store(store_or_path: ActivationStore | str | Path,
           storage_options: Mapping[str, Any] | None = None) -> ActivationStore:
    if isinstance(store_or_path, ActivationStore):
        return store_or_path
    return open_store(str(store_or_path), storage_options)


def _layout(store: ActivationStore, key: str) -> Layout:
    meta = store.captures.get(key)
    if meta is None:
        raise StoreError(f"{key!r} is not a capture of {store.url}; its captures: {', '.join(store.keys)}")
    try:
        return Layout.of(key, meta, store.model.get("prefix_tokens"))
    except ValueError as err:
        raise StoreError(str(err)) from None


def _dictionary(dictionary: str | Path | Dictionary | None, activation: str | None) -> Dictionary | None:
    if dictionary is None or isinstance(dictionary, Dictionary):
        return dictionary
    return load_dictionary(dictionary, activation)


def index(store_or_path: ActivationStore | str | Path, key: str, dictionary: str | Path | Dictionary | None = None,
          k: int = 16, pool: str = "max", name: str | None = None, *, threshold: float = 0.0,
          activation: str | None = None, on_progress: Callable[[int], None] | None = None,
          storage_options: Mapping[str, Any] | None = None) -> FeatureIndex:
    """Index the features of capture ``key`` (its channels or features, or the latents of ``dictionary``: a file,
    see :func:`~extractor.index.dictionary.load_dictionary`) over the store's ok rows in one pass, write it into
    the store as ``indexes/<name>`` (default: ``key``, or ``key@<dictionary stem>``) and return it.

    ``k`` top rows per feature, ranked by the feature pooled over the row's positions by ``pool`` (max or mean); a
    feature fires where it is above ``threshold``. The store's lease is taken for the pass: a store a job is writing
    is refused, naming the job. ``on_progress(rows)`` is called as rows are done; ``storage_options``: fsspec
    options of a remote store given by its URL."""
    store = _store(store_or_path, storage_options)
    layout = _layout(store, key)
    dic, k = _settings(store, key, layout, dictionary, activation, k, threshold)
    feed = IndexFeed(layout, k, pool, threshold, dic)
    name = _checked_name(name or index_name(key, dic.stem if dic is not None else None))
    lease = _lease(store)
    try:
        group = lease.open()  # every write through the lease's fence
        state = source_state(group)
        t0 = time.perf_counter()
        _pass(store, key, feed, on_progress)
        log.info("indexed %d features of %s over %d rows in %.1f s", feed.state.features, key, feed.state.rows,
                 time.perf_counter() - t0)
        record = index_record(name, key, feed, dic.record() if dic is not None else None, state, "post-hoc")
        _say_replaced(store, name)
        write_index(group, name, feed.state.finish(), record)
    finally:
        lease.release()
    try:
        consolidate(group)  # the store opens with consolidated metadata: it must list the index
    except (StoreError, OSError) as err:
        log.info("%s: metadata not consolidated (%s)", store.url, err)
    return open_index(open_store(store.url, store.storage_options), name)


def _settings(store: ActivationStore, key: str, layout: Layout, dictionary: str | Path | Dictionary | None,
              activation: str | None, k: int, threshold: float) -> tuple[Dictionary | None, int]:
    """The dictionary an index encodes with, checked against the capture, and its k (at most the ok rows: the same
    index in slots that exist); a one-line error for settings that make no index."""
    if activation is not None and dictionary is None:
        raise StoreError(f"an activation ({activation}) applies to a dictionary's latents: give the dictionary too, "
                         f"or leave the activation out to index {key}'s own features")
    dic = _dictionary(dictionary, activation)
    if dic is not None:
        dic.check_input(layout.features, f"capture {key} {list(store.captures[key]['shape'])}")
    if k < 1:
        raise ValueError(f"k must be >= 1, not {k}")
    if not (math.isfinite(threshold) and threshold >= 0):
        raise StoreError(f"threshold must be a finite number >= 0 (a feature fires above it), not {threshold}")
    rows = max(int((store.status == OK).sum()), 1)
    if k > rows:
        log.warning("k %d is more than the %d ok rows of %s: the index keeps them all (k %d)", k, rows, store.url, rows)
    return dic, min(k, rows)


def _lease(store: ActivationStore) -> Lease:
    """The store's lease, taken: refused naming the job that writes it, or saying the store is read-only."""
    # the timeout the store's job ran with; a store that records none (not written by a job) gets the default
    lease = Lease(store.url, store.storage_options, job_lease_timeout(store.attrs) or LEASE_TIMEOUT_S, owner())
    try:
        lease.acquire()
    except StoreError:
        raise
    except OSError as err:  # the index is kept in the store
        raise StoreError(f"{store.url}: the index is written into the store, which cannot be written here "
                         f"({err.strerror or err}); index a writable copy of it") from None
    return lease


def _say_replaced(store: ActivationStore, name: str) -> None:
    """Warn that index ``name``, which the store holds, is about to be replaced (the new one written beside it,
    then named in its place)."""
    if name in index_names(store):
        old: dict[str, Any] = dict(store.group[f"{INDEXES}/{name}"].attrs)
        dic = old.get("dictionary")
        log.warning("replacing index %s of %s (%s features of %s%s, k %s, pool %s, %s rows)", name, store.url,
                    old.get("features"), old.get("key"), f" through {dic['path']}" if dic else "", old.get("k"),
                    old.get("pool"), old.get("rows"))


def _checked_name(name: str) -> str:
    """``name``, when it can name an index group in the store: one path segment, not hidden."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise StoreError(f"index name {name!r}: an index is named by one word of the store (no '/', no leading "
                         "'.'), such as blocks.11 or blocks.11@my_sae")
    return name


def _pass(store: ActivationStore, key: str, feed: IndexFeed, on_progress: Callable[[int], None] | None) -> None:
    """Feed the ok rows of ``key`` to ``feed``, a chunk at a time in row order (the blocks a job's writer meets).
    The chunks are added on :data:`LANES` threads, each adding every LANES-th chunk in order to a lane of the state
    (:meth:`~extractor.index.state.IndexState.lane`: counts of its own, the top rows and examples shared),
    joined at the end: the same index (slots hold the same rows in any order; the counts' partition is fixed), in
    the time the parts take side by side (the compiled passes, numpy's loops and the encoder's matmul let go of the
    GIL). Memory: one state's slots, counts per lane, and a block of latents per lane."""
    arr = store[key]
    step = int(arr.chunks[0])
    status = store.status
    starts = [a for a in range(0, len(status), step) if (status[a : a + step] == OK).any()]
    lanes = [feed, *(feed.lane() for _ in range(LANES - 1))]
    lock = threading.Lock()

    def read(a: int) -> tuple[np.ndarray, np.ndarray]:
        ok = np.flatnonzero(status[a : a + step] == OK)
        return a + ok, np.asarray(arr[a : a + step])[ok]

    def lane(i: int) -> None:
        for rows, x in prefetched(starts[i :: len(lanes)], read, READ_AHEAD, threads=2, name="extractor-index"):
            lanes[i].add(x, rows)
            if on_progress is not None:
                with lock:
                    on_progress(len(rows))

    with ThreadPoolExecutor(len(lanes), thread_name_prefix="extractor-index-lane") as pool:
        for done in [pool.submit(lane, i) for i in range(len(lanes))]:
            done.result()
    for other in lanes[1:]:
        feed.state.join(other.state)


def index_names(store: ActivationStore) -> list[str]:
    """The names of the indexes the store holds (whole ones: attributes written)."""
    if INDEXES not in store.group:
        return []
    parent = store.group[INDEXES]
    assert isinstance(parent, zarr.Group)
    return sorted(n for n, g in parent.groups() if "index_version" in g.attrs)


def open_index(store_or_path: ActivationStore | str | Path, name: str | None = None, *,
               storage_options: Mapping[str, Any] | None = None) -> FeatureIndex:
    """An index the store holds; ``name`` may be left out when it holds one."""
    store = _store(store_or_path, storage_options)
    names = index_names(store)
    if name is None:
        if len(names) != 1:
            raise StoreError(f"{store.url} holds {len(names)} indexes ({', '.join(names) or 'none'}): name one"
                             if names else f"{store.url} holds no feature index; make one with extractor index "
                             f"{store.url} --key KEY")
        name = names[0]
    if name not in names:
        raise StoreError(f"{store.url} holds no index {name!r}; its indexes: {', '.join(names) or 'none'}")
    return FeatureIndex(store, store.group[f"{INDEXES}/{name}"])  # type: ignore[arg-type]


class FeatureIndex:
    """A feature index as the store keeps it (arrays read on first use)."""

    def __init__(self, store: ActivationStore, group: zarr.Group) -> None:
        self.store, self.group = store, group
        self.attrs: dict[str, Any] = dict(group.attrs)
        if self.attrs.get("index_version") not in READ_VERSIONS:
            raise StoreError(f"index {group.path} of {store.url} has version {self.attrs.get('index_version')}; "
                             f"this reads versions {', '.join(map(str, READ_VERSIONS))}: make it again with "
                             "extractor index")
        self._cache: dict[str, np.ndarray] = {}
        self._dictionary: Dictionary | None = None

    @property
    def arrays(self) -> zarr.Group:
        """The group holding the index's arrays (the subgroup its attributes name; version 1: its own group)."""
        at = self.attrs.get("arrays")
        return self.group[at] if at else self.group  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (f"<FeatureIndex {self.name} of {self.store.url}: {self.features} features, k {self.k}, "
                f"{self.rows} rows, {len(self.dead)} dead{', stale' if self.stale else ''}>")

    # ------------------------------------------------------------------ what it is
    @property
    def name(self) -> str:
        return str(self.attrs["name"])

    @property
    def key(self) -> str:
        return str(self.attrs["key"])

    @property
    def features(self) -> int:
        return int(self.attrs["features"])

    @property
    def k(self) -> int:
        return int(self.attrs["k"])

    @property
    def rows(self) -> int:
        return int(self.attrs["rows"])

    @property
    def grid(self) -> tuple[int, int] | None:
        grid = self.attrs.get("grid")
        return (int(grid[0]), int(grid[1])) if grid else None

    @property
    def stale(self) -> bool:
        """The store changed since the index was made (resumed, more rows done), or the dictionary file did, or
        the index was made again since it was opened (:attr:`replaced`)."""
        if source_state(self.store.group) != self.attrs["source_state"] or self.replaced:
            return True
        dic = self.attrs.get("dictionary")
        return dic is not None and Path(dic["path"]).exists() and _digest_of(dic["path"]) != dic["digest"]

    @property
    def replaced(self) -> bool:
        """An index of this name was written again since this one was opened (open it again to read that one)."""
        now = zarr.open_group(store=self.group.store, path=self.group.path, mode="r", use_consolidated=False)
        return dict(now.attrs) != self.attrs

    def _read(self, name: str, at: Any) -> np.ndarray:
        """``name``[at], or a StoreError that says so where the index was written again since it was opened
        (its arrays no longer have the shapes it was opened with)."""
        try:
            return np.asarray(get_array(self.arrays, name)[at])
        except (ValueError, KeyError, FileNotFoundError):
            if self.replaced:
                raise StoreError(f"index {self.name} of {self.store.url} was made again since it was opened: "
                                 "open it again") from None
            raise

    def _array(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = self._read(name, slice(None))
        return self._cache[name]

    @property
    def density(self) -> np.ndarray:
        """(F,) the share of tokens (positions of the rows) where each feature fires."""
        return self._array("density_tokens")

    @property
    def density_rows(self) -> np.ndarray:
        """(F,) the share of rows where each feature fires at some position."""
        return self._array("density_rows")

    @property
    def mean_active(self) -> np.ndarray:
        """(F,) each feature's mean value where it fires (NaN: never)."""
        return self._array("mean_active")

    @property
    def max_value(self) -> np.ndarray:
        return self._array("max_value")

    @property
    def dead(self) -> np.ndarray:
        """The features that never fire."""
        return self._array("dead")

    # ------------------------------------------------------------------ one feature
    def _feature(self, f: int) -> int:
        if not 0 <= int(f) < self.features:
            raise OutOfRangeError(f"feature {f} out of range: the index has {self.features} features (0 to "
                                  f"{self.features - 1})")
        return int(f)

    def top(self, f: int) -> TopRows:
        """The rows where feature ``f`` is highest (at most k; fewer when it fires in fewer rows)."""
        f = self._feature(f)
        rows, values = self._read("top_rows", f), self._read("top_values", f)
        keep = rows >= 0
        return TopRows(rows[keep], self.store.ids[rows[keep]], values[keep])

    def tokens(self, f: int) -> np.ndarray:
        """(k, T): feature ``f`` at every position of each of its top rows (NaN rows: empty ranks)."""
        return self._read("top_tokens", self._feature(f))

    def histogram(self, f: int, rows: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Counts of log10 of feature ``f``'s values where it fires, per token (``rows``: of its pooled values, per
        firing row), and the log10 bin edges (values outside count in the end bins)."""
        name = "histogram_rows" if rows else "histogram"
        return self._read(name, self._feature(f)), np.asarray(self.attrs["hist_edges"])

    def quantiles(self, f: int) -> list[TopRows]:
        """Example rows of feature ``f`` per quantile group of its firing rows (lowest first; empty groups kept)."""
        f = self._feature(f)
        rows, values = self._read("quantile_rows", f), self._read("quantile_values", f)
        return [TopRows(r[r >= 0], self.store.ids[r[r >= 0]], v[r >= 0]) for r, v in zip(rows, values, strict=True)]

    def heatmap(self, f: int, rank: int = 0) -> np.ndarray:
        """(h, w): feature ``f`` at each position of its ``rank``-th top row, on the capture's grid (prefix tokens
        left out)."""
        if self.grid is None:
            raise StoreError(f"capture {self.key}'s positions make no grid (a vector, sampled tokens, or a token "
                             "count that is not a square after the prefix): use tokens(f)")
        if not 0 <= rank < self.k:
            raise OutOfRangeError(f"rank {rank} out of range: the index keeps {self.k} rows per feature")
        values = self._read("top_tokens", (self._feature(f), rank))
        return values[int(self.attrs["prefix"]) :].reshape(self.grid)

    # ------------------------------------------------------------------ the encoder
    @property
    def dictionary(self) -> Dictionary | None:
        """The dictionary the index encodes with (read from the path it records; None: raw features)."""
        dic = self.attrs.get("dictionary")
        if dic is None:
            return None
        if self._dictionary is None:
            try:
                self._dictionary = load_dictionary(dic["path"], dic["activation"])
            except DictionaryError as err:
                raise DictionaryError(f"the index's dictionary cannot be read again: {err}") from None
            if self._dictionary.digest != dic["digest"]:
                log.warning("%s changed since index %s was made (digest %s, now %s)", dic["path"], self.name,
                            dic["digest"], self._dictionary.digest)
        return self._dictionary

    def encode_row(self, row: int) -> np.ndarray:
        """(T, F): every feature at each position of store row ``row`` (which features fire at this patch)."""
        n = len(self.store.status)
        if not 0 <= int(row) < n:
            raise OutOfRangeError(f"row {row} out of range: {self.store.url} has {n} rows (0 to {n - 1})")
        if self.store.status[int(row)] != OK:
            raise StoreError(f"row {row} ({self.store.ids[int(row)]}) of {self.store.url} is not ok (its image "
                             "failed, or was never computed): it holds no activations")
        layout = _layout(self.store, self.key)
        acts = np.asarray(layout.tokens(np.asarray(self.store[self.key][int(row) : int(row) + 1]))[0], np.float32)
        dic = self.dictionary
        return acts if dic is None else dic.encode(acts)

    # ------------------------------------------------------------------ figures
    def top_figure(self, f: int, n: int | None = None, columns: int = 4, alpha: float = 0.6) -> Figure:
        """Feature ``f``'s top images (as the job saw them) with its heatmap over each."""
        from .figures import top_figure

        return top_figure(self, f, n, columns, alpha)

    def density_figure(self) -> Figure:
        """The histogram of all features' firing densities (log10), dead features counted apart."""
        from .figures import density_figure

        return density_figure(self)


_DIGESTS: dict[tuple[Any, ...], str] = {}  # (files, their sizes and mtimes) -> digest: a file is hashed once


def _digest_of(path: str) -> str:
    """The digest of a dictionary's file(s) as load_dictionary computes it (hashed again only once they change)."""
    from .dictionary import SAELENS_CONFIG, SAELENS_WEIGHTS

    p = Path(path)
    files = [p / SAELENS_CONFIG, p / SAELENS_WEIGHTS] if p.is_dir() else [p]
    facts = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists())
    if facts not in _DIGESTS:
        _DIGESTS[facts] = file_digest(files)
    return _DIGESTS[facts]


def describe(ix: FeatureIndex) -> Iterator[str]:
    """Lines that say what an index holds (the CLI prints them)."""
    d = ix.attrs.get("dictionary")
    over = f" (dictionary {d['path']}, {d['activation']})" if d else ""
    stale = " (STALE: the store changed since; run extractor index again)" if ix.stale else ""
    yield f"index {ix.name}: {ix.features} features of {ix.key}{over}, top {ix.k} rows by {ix.attrs['pool']}, " \
          f"{ix.rows} rows{stale}"
    density = ix.density
    alive = density[density > 0]
    yield (f"dead: {len(ix.dead)} of {ix.features}; firing density (tokens) of the others: median "
           f"{float(np.median(alive)) if len(alive) else 0:.3g}, max {float(alive.max()) if len(alive) else 0:.3g}")


def summary(ix: FeatureIndex) -> Mapping[str, Any]:
    return {"name": ix.name, "key": ix.key, "features": ix.features, "k": ix.k, "rows": ix.rows,
            "dead": len(ix.dead), "stale": ix.stale}
