"""A finished feature index as the store keeps it: the group ``indexes/<name>`` (:func:`write_index`), its
attributes (:class:`IndexRecord`, :func:`index_record`) and what it covers of the store (:func:`source_state`; the
docs/reference/store.md). The reader's view of a stored index is :class:`~.reader.FeatureIndex` (numpy and zarr).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict

import numpy as np
import zarr

from ..spec import redact
from ..store import OK, Generation, done_shards, get_array, now, root_attrs
from .bins import HIST_EDGES
from .feed import IndexFeed
from .state import EXAMPLES, QUANTILES, IndexArrays

__all__ = [
    "INDEXES",
    "INDEX_VERSION",
    "READ_VERSIONS",
    "IndexRecord",
    "index_name",
    "index_record",
    "pointer",
    "source_state",
    "write_atlas",
    "write_index",
]

INDEX_VERSION = 2  # 2: the arrays in a subgroup the attributes name (``arrays``): an index replaced whole or not at all
READ_VERSIONS = (1, 2)  # 1: the arrays in the index's group itself
INDEXES = "indexes"  # the store's group of indexes: indexes/<name>


class IndexRecord(TypedDict):
    """The attributes of ``indexes/<name>`` (the docs/reference/store.md)."""

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
    include_prefix: bool  # the prefix tokens were asked for (else left out, where known)
    tokens: str | None  # of a token capture: "patches", "all" (prefix included), "unknown" (no prefix known)
    left_out: int  # leading positions of each stored row left out (the prefix tokens)
    normalize: dict[str, Any] | None  # {asked: ["norm"], over: "patches" | "every token", scale, shifted}
    arrays: NotRequired[str]  # the subgroup of indexes/<name> holding its arrays (set by write_index)


def pointer(generation: Generation, name: str) -> tuple[str | None, str | None]:
    """Index ``name``'s attributes as read now: the version a later :func:`write_index` swaps from, and the subgroup
    they name (None: none yet). Its group is made where absent (without attributes: an index not listed)."""
    objects = generation.objects
    for key in (f"{INDEXES}/zarr.json", f"{INDEXES}/{name}/zarr.json"):
        objects.create(generation.key(key), _EMPTY_GROUP)  # already there: nothing done
    data, version = objects.read(generation.key(f"{INDEXES}/{name}/zarr.json"))
    named = (json.loads(data).get("attributes") or {}).get("arrays") if data else None
    return version, named


def write_index(generation: Generation, name: str, arrays: IndexArrays, record: Mapping[str, Any],
                at_version: tuple[str | None, str | None]) -> bool:
    """Write ``indexes/<name>`` into the store's generation, replacing one of that name whole: its arrays into a new
    subgroup, then its attributes, which name that subgroup: one swap from ``at_version`` (what :func:`pointer`
    read before the index was made), so a reader finds the old index or the new one, and of two processes that
    write one index at once one lands (False for the other: nothing of it is named). The arrays of the index
    replaced stay until the next write (a reader that opened it still reads it whole, and is told it was replaced);
    older ones, and what writes that failed midway left, go."""
    objects = generation.objects
    version, replaced = at_version
    at = f"v{uuid.uuid4().hex[:12]}"
    node = zarr.open_group(store=objects.zarr_store(generation.name, read_only=False), path=f"{INDEXES}/{name}/{at}",
                           mode="w")
    _write_arrays(node, arrays.__dict__, arrays.top_tokens[0].size * 4)
    meta = {"zarr_format": 3, "node_type": "group", "attributes": {**dict(record), "arrays": at}}
    if not objects.swap(generation.key(f"{INDEXES}/{name}/zarr.json"), version, json.dumps(meta).encode()):
        objects.remove(generation.key(f"{INDEXES}/{name}/{at}"))
        return False
    for gone in objects.list(generation.key(f"{INDEXES}/{name}")):  # version 1's arrays, older versions, failures
        if gone not in ("zarr.json", at, replaced):
            objects.remove(generation.key(f"{INDEXES}/{name}/{gone}"))
    return True


_EMPTY_GROUP = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def _write_arrays(node: zarr.Group, arrays: Mapping[str, np.ndarray], feature_bytes: int,
                  unchunked: tuple[str, ...] = ("dead",)) -> None:
    """An index's arrays (first dimension ``feature``, but ``unchunked`` ones: one chunk, their own dimension),
    chunked by feature: about 4 MB a chunk of the largest (``feature_bytes`` a feature)."""
    per = max(1, (1 << 22) // max(1, feature_bytes))  # features per chunk: <= 4 MB
    for field, value in arrays.items():
        value = np.ascontiguousarray(value)
        whole = field in unchunked or not value.ndim
        chunks = value.shape if whole else (min(per, max(len(value), 1)), *value.shape[1:])
        if not value.size:
            chunks = (1,) * value.ndim
        dims = [field] if whole else ["feature", *(f"{field}.{i}" for i in range(1, value.ndim))]
        array = node.create_array(field, shape=value.shape, chunks=chunks, dtype=value.dtype, dimension_names=dims,
                                  fill_value=-1 if value.dtype.kind == "i" else 0)
        array[...] = value


def write_atlas(generation: Generation, name: str, arrays: Mapping[str, np.ndarray], record: Mapping[str, Any],
                at_version: tuple[str | None, str | None], attrs: Mapping[str, Any]) -> bool:
    """Add an atlas (its ``arrays``, described by ``record``) to index ``name``, whose attributes ``attrs`` were
    read at ``at_version`` (:func:`pointer`): the arrays into a new subgroup of the index's arrays, then the
    attributes with ``atlas`` naming it, in one swap. False (nothing named, the arrays removed) where the index was
    written again meanwhile. An atlas it replaces stays until the next is named (a reader that opened it reads it
    whole); older ones go."""
    objects = generation.objects
    version, named = at_version
    if named is None or named != attrs.get("arrays"):
        return False
    at = f"atlas-{uuid.uuid4().hex[:12]}"
    where = f"{INDEXES}/{name}/{named}/{at}"
    node = zarr.open_group(store=objects.zarr_store(generation.name, read_only=False), path=where, mode="w")
    _write_arrays(node, arrays, max(int(np.prod(a.shape[1:])) * a.itemsize for a in arrays.values()), ("rows",))
    old = (attrs.get("atlas") or {}).get("arrays")
    meta = {"zarr_format": 3, "node_type": "group", "attributes": {**dict(attrs), "atlas": {**record, "arrays": at}}}
    if not objects.swap(generation.key(f"{INDEXES}/{name}/zarr.json"), version, json.dumps(meta).encode()):
        objects.remove(generation.key(where))
        return False
    for gone in objects.list(generation.key(f"{INDEXES}/{name}/{named}")):
        if gone.startswith("atlas-") and gone not in (at, old):
            objects.remove(generation.key(f"{INDEXES}/{name}/{named}/{gone}"))
    return True


def source_state(group: zarr.Group) -> dict[str, Any]:
    """What an index covers of the store: its generation, its committed shards and ok rows. A store whose state
    differs since (made again, more shards committed) makes the index stale."""
    attrs = root_attrs(group)
    status = np.asarray(get_array(group, "status")[:])
    return {"generation": attrs.get("generation"), "created": attrs.get("created"),
            "done_shards": int(done_shards(group).sum()), "ok_rows": int((status == OK).sum())}


def index_name(key: str, dictionary_stem: str | None) -> str:
    return key if dictionary_stem is None else f"{key}@{dictionary_stem}"


def index_record(name: str, key: str, feed: IndexFeed, dictionary: Mapping[str, Any] | None,
                 state: Mapping[str, Any], written: str, include_prefix: bool = False,
                 normalize: Mapping[str, Any] | None = None) -> IndexRecord:
    s, layout = feed.state, feed.layout
    return IndexRecord(
        index_version=INDEX_VERSION, name=name, key=key, features=s.features, k=s.k, pool=s.pool,
        dictionary=redact(dict(dictionary)) if dictionary is not None else None, rows=s.rows, source_state=dict(state),
        positions=s.positions, grid=list(layout.grid) if layout.grid else None, prefix=layout.prefix,
        threshold=s.threshold, hist_edges=[round(float(e), 6) for e in HIST_EDGES], quantiles=QUANTILES,
        examples=EXAMPLES, written=written, created=now(), include_prefix=include_prefix, tokens=layout.covers,
        left_out=layout.skip, normalize=dict(normalize) if normalize else None)
