"""A job's write-time feature indexes (``capture[i].feature_index``): their settings checked against the captures
before the store is touched (:func:`with_indexes`), a feed per shard (:func:`indexed`), each shard's part kept in the
store (``index_parts/<key>``, one row a shard, made with the store), merged at its end and written
(:func:`finish_indexes`). The
job's store session meets them through :class:`JobIndexes`, which the driver hands it (numpy and zarr).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import zarr

from ..errors import SpecError
from ..store import Fresh, Generation, done_shards, get_array, root_attrs
from .dictionary import cached_dictionary, load_dictionary
from .feed import IndexFeed, Layout
from .layout import index_name, index_record, pointer, source_state, write_index
from .state import IndexState

__all__ = ["JobIndexes", "finish_indexes", "indexed", "with_indexes"]

log = logging.getLogger(__name__)
PARTS = "index_parts"  # group of the store: one (shards, bytes) uint8 array per indexed capture


def part_array(group: zarr.Group, key: str) -> zarr.Array:
    return get_array(group, f"{PARTS}/{key}")


def merged_parts(group: zarr.Group, key: str, feed: IndexFeed, held: np.ndarray | None = None) -> tuple[int, int]:
    """Merge into ``feed`` the part of every done shard (but those ``held``: merged already), read one at a time
    (memory: two states); returns (merged, missing): done shards whose part is not there (made before the index
    was asked for) are missing."""
    done = done_shards(group)
    done = np.flatnonzero(done & ~held if held is not None else done)
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
    """The feed of the write-time index a capture's record asks for (its ``feature_index``; its patches as the
    record says, :func:`~extractor.store.patch_span`; ``prefix_tokens``: the model's, for an older record; settings
    made before ``include_prefix`` was recorded: every token)."""
    settings = record["feature_index"]
    layout = Layout.of(key, record, prefix_tokens, settings.get("include_prefix", True))
    dic = settings.get("dictionary")
    encoder = cached_dictionary(dic["path"], dic["activation"], dic["digest"]) if dic else None
    return IndexFeed(layout, int(settings["k"]), str(settings["pool"]), float(settings["threshold"]), encoder)


def indexed(captures: Mapping[str, Mapping[str, Any]]) -> dict[str, IndexFeed]:
    """A fresh feed per capture whose record asks for a write-time index."""
    return {key: feed_of(key, m) for key, m in captures.items() if m.get("feature_index")}


def finish_indexes(group: zarr.Group, generation: Generation, merged: Mapping[str, IndexState] | None = None,
                   held: Mapping[str, np.ndarray] | None = None) -> list[str]:
    """At a store's end (every shard committed): each write-time index merged from the parts of the committed shards
    (``group``: the generation read as committed; ``merged``: each index's parts of the shards ``held`` merged
    already, as they were committed) and written (``indexes/<name>``); the names written. One whose parts are
    missing (shards committed before it was asked for) is left out, with a warning; one another process wrote first
    (it finished the store too) is that process's."""
    attrs = root_attrs(group)
    written = []
    for key, m in attrs["captures"].items():
        if not m.get("feature_index"):
            continue
        feed = feed_of(key, m, (attrs.get("model") or {}).get("prefix_tokens"))
        if merged and key in merged and held and key in held:
            feed.state.merge(merged[key])
        _merged, missing = merged_parts(group, key, feed, (held or {}).get(key))
        settings = m["feature_index"]
        name = settings["name"]
        if missing:
            log.warning("index %s not written: %d done shards have no part of it (computed before it was asked "
                        "for); run extractor index", name, missing)
            continue
        record = index_record(name, key, feed, settings.get("dictionary"), source_state(group), "write-time",
                              bool(settings.get("include_prefix", True)))
        version = pointer(generation, name)
        if version[1] is None and write_index(generation, name, feed.state.finish(), record, version):
            written.append(name)
    return written


def with_indexes(capture_specs: Any, captures: Mapping[str, Any], prefix_tokens: int | None) -> dict[str, Any]:
    """The capture records, each whose spec asks for a write-time index (``capture[i].feature_index``) with its
    settings (``feature_index``: k, pool, threshold, the dictionary's record, name), checked before the store is
    touched: a capture that has no features to index, or a dictionary that does not fit it, is an error here."""
    out = {}
    for key, record in captures.items():
        want = capture_specs[record["capture"]].feature_index
        if want is None:
            out[key] = record
            continue
        try:
            layout = Layout.of(key, record, prefix_tokens, want.include_prefix)
        except ValueError as err:
            raise SpecError(f"capture[{record['capture']}].feature_index: {err}") from None
        dic = load_dictionary(want.dictionary, want.activation) if want.dictionary else None
        if dic is not None:
            dic.check_input(layout.features, f"capture[{record['capture']}] {key} {list(record['shape'])}")
        settings = {"k": want.k, "pool": want.pool, "threshold": want.threshold,
                    "dictionary": dic.record() if dic is not None else None,
                    "name": want.name or index_name(key, dic.stem if dic is not None else None),
                    "include_prefix": want.include_prefix}
        out[key] = {**record, "feature_index": settings}
    return out


class JobIndexes:
    """A job's write-time indexes as its store session meets them (``StoreSession(spec, index)``: the driver hands
    this in, the store does not import the index): the bytes of a shard's part of each (its arrays are made with
    the store), and the indexes merged from the committed shards' parts and written before the final record."""

    def parts(self, captures: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
        return {key: feed.state.nbytes() for key, feed in indexed(captures).items()}

    def fresh(self, captures: Mapping[str, Mapping[str, Any]], prefix_tokens: int | None) -> Fresh | None:
        """An empty part of each indexed capture's index, by its key (None: a key not indexed; None: none is)."""
        settings = {key: (s.features, s.positions, s.k, s.pool, s.threshold)
                    for key, m in captures.items() if m.get("feature_index")
                    for s in (feed_of(key, m, prefix_tokens).state,)}
        if not settings:
            return None

        def fresh(key: str) -> IndexState | None:
            made = settings.get(key)
            return None if made is None else IndexState(*made[:4], threshold=made[4])

        return fresh

    def finish(self, group: zarr.Group, generation: Generation, merged: Mapping[str, Any] | None = None,
               held: Mapping[str, np.ndarray] | None = None) -> list[str]:
        return finish_indexes(group, generation, merged, held)
