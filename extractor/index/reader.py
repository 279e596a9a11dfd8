"""A feature index as the store keeps it, read back (numpy and zarr): what every feature of a capture responds to,
made in one pass over the store (:func:`~.post_hoc.index`) or merged from the job's shards at write time
(:mod:`.write_time`), kept under ``indexes/<name>``.

    >>> ix = open_index("out.zarr")                                # read back (a viewer, a notebook)
    >>> ix.top(42)              # rows, ids, values: where latent 42 is highest (pooled over the patches)
    >>> ix.heatmap(42, 0)       # (h, w): latent 42 at each patch of its top image
    >>> ix.density, ix.dead     # share of tokens where each latent fires; latents that never fire
    >>> ix.histogram(42)        # counts, log10 edges
    >>> ix.encode_row(7)        # (T, F): which latents fire at each patch of row 7
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

from ..errors import OutOfRangeError, StoreError
from ..read import ActivationStore, open_store
from ..store import OK, get_array, patch_span
from .dictionary import SAELENS_CONFIG, SAELENS_WEIGHTS, Dictionary, DictionaryError, file_digest, load_dictionary
from .feed import IndexFeed, Layout
from .layout import INDEXES, READ_VERSIONS, source_state

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["FeatureIndex", "Neighbours", "TopRows", "coverage", "describe", "index_names", "open_index", "summary"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopRows:
    """The rows where a feature is highest, highest first."""

    rows: np.ndarray  # (n,) int64 store rows
    ids: np.ndarray  # (n,) their image ids
    values: np.ndarray  # (n,) float32: the feature pooled over each row's positions


@dataclass(frozen=True)
class Neighbours:
    """A feature's nearest others by one measure of the index's atlas, the nearest first."""

    features: np.ndarray  # (n,) int64
    scores: np.ndarray  # (n,) float32: decoder cosine, Jaccard index of co-occurrence, or correlation
    counts: np.ndarray | None = None  # (n,) int64, co-occurrence only: the tokens where both fire


def _store(store_or_path: ActivationStore | str | Path,
           storage_options: Mapping[str, Any] | None = None) -> ActivationStore:
    if isinstance(store_or_path, ActivationStore):
        return store_or_path
    return open_store(str(store_or_path), storage_options)


def _layout(store: ActivationStore, key: str, include_prefix: bool = False) -> Layout:
    """Capture ``key``'s layout as an index reads it: its patches, or with ``include_prefix`` every token."""
    meta = store.captures.get(key)
    if meta is None:
        raise StoreError(f"{key!r} is not a capture of {store.url}; its captures: {', '.join(store.keys)}")
    try:
        return Layout.of(key, meta, store.model.get("prefix_tokens"), include_prefix)
    except ValueError as err:
        raise StoreError(str(err)) from None


def _indexes(store: ActivationStore) -> zarr.Group | None:
    """The store's group of indexes as the storage has it now (not from the metadata consolidated when the store was
    made, which lists none: indexes are written later), or None."""
    try:
        return zarr.open_group(store=store.group.store, path=INDEXES, mode="r", use_consolidated=False)
    except (FileNotFoundError, KeyError, zarr.errors.GroupNotFoundError):
        return None


def index_names(store: ActivationStore) -> list[str]:
    """The names of the indexes the store holds (whole ones: attributes written)."""
    parent = _indexes(store)
    if parent is None:
        return []
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
    parent = _indexes(store)
    assert parent is not None  # it lists the name
    return FeatureIndex(store, parent[name])  # type: ignore[arg-type]


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
        """(h, w): feature ``f`` at each position of its ``rank``-th top row, on the capture's grid (the tokens
        before and after the patches left out)."""
        if self.grid is None:
            raise StoreError(f"capture {self.key}'s positions make no grid (a vector, sampled tokens, or a token "
                             "count that is not a square after the prefix): use tokens(f)")
        if not 0 <= rank < self.k:
            raise OutOfRangeError(f"rank {rank} out of range: the index keeps {self.k} rows per feature")
        values = self._read("top_tokens", (self._feature(f), rank))
        first = int(self.attrs["prefix"])
        return values[first : first + self.grid[0] * self.grid[1]].reshape(self.grid)

    # ------------------------------------------------------------------ the atlas
    @property
    def atlas(self) -> dict[str, Any] | None:
        """What the index's atlas holds (its ``measures``, ``neighbours`` per feature, ``rows`` sampled, ``map``:
        method, seed, source), or None: it has none (``extractor index --atlas`` adds one)."""
        atlas = self.attrs.get("atlas")
        return dict(atlas) if atlas else None

    def _atlas_array(self, name: str) -> zarr.Array:
        atlas = self.atlas
        if atlas is None:
            raise StoreError(f"index {self.name} of {self.store.url} has no atlas: add one with extractor index "
                             f"{self.store.url} --name {self.name} --atlas")
        return get_array(self.arrays[atlas["arrays"]], name)  # type: ignore[arg-type]

    def neighbours(self, f: int) -> dict[str, Neighbours]:
        """Feature ``f``'s nearest features by each measure of the atlas (``decoder`` where the dictionary has a
        decoder, ``cooccurrence``, ``correlation``), the nearest first."""
        f = self._feature(f)
        out = {}
        for measure in self._atlas_measures():
            features = np.asarray(self._atlas_array(f"{measure}.features")[f])
            keep = features >= 0
            counts = np.asarray(self._atlas_array(f"{measure}.counts")[f])[keep] if measure == "cooccurrence" else None
            out[measure] = Neighbours(features[keep], np.asarray(self._atlas_array(f"{measure}.scores")[f])[keep],
                                      counts)
        return out

    def _atlas_measures(self) -> list[str]:
        atlas = self.atlas
        if atlas is None:
            self._atlas_array("map")  # the error
        return list(atlas["measures"]) if atlas else []

    @property
    def map(self) -> np.ndarray:
        """(F, 2) float32: each feature's place on the atlas's map."""
        if "map" not in self._cache:
            self._cache["map"] = np.asarray(self._atlas_array("map")[:])
        return self._cache["map"]

    @property
    def atlas_rows(self) -> np.ndarray:
        """The store rows the atlas was made of, in the order the pass took them (the first ``cooccurrence_rows``
        counted co-occurrence)."""
        return np.asarray(self._atlas_array("rows")[:])

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

    @property
    def covers(self) -> str | None:
        """Which of a token capture's positions the index covers: ``patches`` (its prefix tokens, CLS and
        registers, left out: the default), ``all`` (included, as asked; or an index made before the choice),
        ``unknown`` (every token: the store records no prefix tokens); None for a map or a vector."""
        return self.layout.covers

    @property
    def layout(self) -> Layout:
        """How the index reads its capture's rows (the positions it covers: :attr:`positions`)."""
        return _layout(self.store, self.key, bool(self.attrs.get("include_prefix", True)))

    def normalization(self) -> tuple[np.ndarray | None, float | None]:
        """What the index subtracts from each position's features and divides them by before encoding (its
        ``normalize``: the store's statistics, as a normalised token stream of its positions reads them)."""
        asked = self.attrs.get("normalize")
        if not asked:
            return None, None
        return self.store.normalization(self.key, asked["asked"], self.layout.skip)

    def encode_row(self, row: int) -> np.ndarray:
        """(T, F): every feature at each position the index covers of store row ``row`` (which features fire at
        this patch), normalised as the index was."""
        n = len(self.store.status)
        if not 0 <= int(row) < n:
            raise OutOfRangeError(f"row {row} out of range: {self.store.url} has {n} rows (0 to {n - 1})")
        if self.store.status[int(row)] != OK:
            raise StoreError(f"row {row} ({self.store.ids[int(row)]}) of {self.store.url} is not ok (its image "
                             "failed, or was never computed): it holds no activations")
        return self.encode(np.asarray(self.store[self.key][int(row) : int(row) + 1]))[0]

    def encode(self, x: np.ndarray) -> np.ndarray:
        """(n, T, F) float32: every feature at each position the index covers of capture rows ``x`` (n, *shape),
        as stored (or as the model computes them: ``extractor.live``), normalised and encoded as the index was."""
        feed = IndexFeed(self.layout, 1, "max", 0.0, None, self.normalization())
        acts = feed.normalized(feed.layout.tokens(np.asarray(x)))
        dic = self.dictionary
        if dic is None:
            return np.asarray(acts, np.float32)
        n, t, d = acts.shape
        return np.asarray(dic.encode(np.ascontiguousarray(acts, np.float32).reshape(n * t, d)), np.float32) \
            .reshape(n, t, -1)

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
    p = Path(path)
    files = [p / SAELENS_CONFIG, p / SAELENS_WEIGHTS] if p.is_dir() else [p]
    facts = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists())
    if facts not in _DIGESTS:
        _DIGESTS[facts] = file_digest(files)
    return _DIGESTS[facts]


def coverage(ix: FeatureIndex) -> str | None:
    """What an index's counts are over, in words (None for a map or a vector: all its positions): the patches
    alone, or every token, and how each token was scaled."""
    layout, record = ix.layout, ix.store.captures[ix.key]
    span = patch_span(record, ix.store.model.get("prefix_tokens"))
    n = int(record["shape"][0]) - span[1] if span else 0  # stored tokens besides the patches
    tokens = f"{n} token{'s' if n != 1 else ''} besides the patches"
    said = {"patches": f"patch tokens only (the {tokens} left out)" if n else "patch tokens (stored without others)",
            "all": f"every token, the {tokens} included",
            "unknown": "every token (the store does not record which are patches)"}.get(layout.covers or "")
    scaled = ix.attrs.get("normalize")
    if said and scaled:
        said += f"; normalised ({', '.join(scaled['asked'])}) by the store's statistics of the {scaled['over']}"
    return said


def describe(ix: FeatureIndex) -> Iterator[str]:
    """Lines that say what an index holds (the CLI prints them)."""
    d = ix.attrs.get("dictionary")
    over = f" (dictionary {d['path']}, {d['activation']})" if d else ""
    stale = " (STALE: the store changed since; run extractor index again)" if ix.stale else ""
    covers = coverage(ix)
    yield f"index {ix.name}: {ix.features} features of {ix.key}{over}, top {ix.k} rows by {ix.attrs['pool']}, " \
          f"{ix.rows} rows{stale}" + (f"; over {covers}" if covers else "")
    density = ix.density
    alive = density[density > 0]
    yield (f"dead: {len(ix.dead)} of {ix.features}; firing density (tokens) of the others: median "
           f"{float(np.median(alive)) if len(alive) else 0:.3g}, max {float(alive.max()) if len(alive) else 0:.3g}")


def summary(ix: FeatureIndex) -> Mapping[str, Any]:
    return {"name": ix.name, "key": ix.key, "features": ix.features, "k": ix.k, "rows": ix.rows,
            "dead": len(ix.dead), "stale": ix.stale}
