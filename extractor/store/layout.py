"""The Zarr v3 store layout: its arrays and attributes, creating it, reading its rows and done markers
(a shard's writer: :mod:`.writer`; the lease: :mod:`.lease`).

Imports only numpy and zarr, so the reader can use it without torch.

Layout (format version 1), all arrays at the root, row dimension named ``row``::

    zarr.json           root attributes under "extractor" (see README "Store layout")
    ids      (N,)       str      image id (relative path or manifest id)
    paths    (N,)       str      where the image was read from (tar members: TAR_URL#MEMBER)
    <locators> (N,)     the source's own per-row arrays beside paths, where it has them (``Source.locators``:
                        a tar source's byte_offset, byte_size, int64: the image's bytes inside its tar)
    labels   (N,)       int64    class index, -1 when none
    status   (N,)       uint8    0 pending, 1 ok, 2 failed
    errors   (N,)       str      why a failed row failed ("" otherwise)
    digest   (N,)       uint64   xxh3-64 of the image's bytes as its row read them (0: not read)
    fingerprint (N,)    uint64   the source's cheap facts about those bytes (size, mtime / ETag; 0: unknown)
    shard_done (S,)     uint8    1 once shard s is durable (one object per shard)
    shard_stats (S,)    str      JSON sums of shard s's values, merged into the "stats" attribute
    stats_sums (B,)     uint8    the merged sums and the shards they hold (store.stats.Totals; driver only)
    <key>    (N, ...)   float16/float32, one array per capture, NaN where not ok
    target, target_score, <gradcam key>.range   (gradient jobs) per-row target class,
                        its logit, and each Grad-CAM map's min and max
    id_index/hashes, id_index/rows   (N,) int64   the ids' hashes sorted, and the row of each (store.id_index)

Per-row arrays are chunked by shard and each capture array by its ``chunk_rows`` (which divides
the shard size), so no two shards ever write into the same storage object.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict, cast

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype
from zarr.buffer.cpu import NDBuffer
from zarr.core.sync import sync

from ..data import LocatorArray, Rows, is_url
from ..errors import FencedError, StoreError
from .chunks import read_all, remove_partials
from .dtypes import numpy_dtype  # and zarr knows bfloat16 wherever a store opens
from .fence import (
    FencedStore,
    fenced_store,
    local_root,
)
from .id_index import write_id_index


class _Lease(Protocol):
    """The job's lease as creating a store uses it (``lease.Lease``, which imports this module)."""

    fence: Any
    token: str
    lost: bool

    def acquire(self) -> None: ...

FORMAT_VERSION = 1
PENDING, OK, FAILED = 0, 1, 2
STATUS_NAMES = {PENDING: "pending", OK: "ok", FAILED: "failed"}
ROW_ARRAYS = ("ids", "paths", "labels", "status", "errors", "digest", "fingerprint")
ATTR = "extractor"  # root attribute holding everything this package records
# the resolved preprocessing's settings that change pixels (the ``preprocess`` record holds more: its source)
PREPROCESS_FIELDS = ("resize", "crop", "interpolation", "mean", "std", "crop_offset", "runs")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _compressors(name: str, level: int | None) -> Any:
    from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

    if name == "zstd":
        return ZstdCodec(level=3 if level is None else level)
    if name == "blosc":
        return BloscCodec(cname="zstd", clevel=5 if level is None else level, shuffle="bitshuffle")
    if name == "gzip":
        return GzipCodec(level=5 if level is None else level)
    return None


def open_group(url: str, mode: str, storage_options: Mapping[str, Any] | None = None) -> zarr.Group:
    """The store's root group as the writer sees it: never through consolidated metadata."""
    kwargs: dict[str, Any] = {"mode": mode}
    if mode != "w":
        kwargs["use_consolidated"] = False
    if storage_options:
        kwargs["storage_options"] = dict(storage_options)
    return zarr.open_group(url, **kwargs)


def get_array(group: zarr.Group, name: str) -> zarr.Array:
    """The array ``name`` of the store (KeyError when missing, StoreError when it is a group)."""
    node = group[name]
    if not isinstance(node, zarr.Array):
        raise StoreError(f"{name!r} in the store at {group.store_path} is a group where an array belongs")
    return node


def root_attrs(group: zarr.Group) -> dict[str, Any]:
    """The extractor attributes of the store's root (KeyError when it has none)."""
    attrs = group.attrs[ATTR]
    if not isinstance(attrs, Mapping):
        raise StoreError(f"the '{ATTR}' attributes of the store at {group.store_path} are not a mapping")
    return dict(attrs)


class CaptureRecord(TypedDict):
    """How one capture is stored: the store's ``captures`` attribute holds one per array name,
    and each capture array holds its own under the ``extractor`` attribute. Written by the
    worker's probe, read by the reader, the runner and the CLI."""

    layer: str  # the module's name in model.named_modules()
    module_type: str
    what: str  # output, input, gradient, input_gradient, gradcam
    index: int | str | None  # which positional output or input, or a key of a dict output
    reduce: str
    dtype: str
    shape: list[int]  # per row, as stored
    original_shape: list[int]  # per row, as the model computed it
    dims: list[str]  # names of the dimensions after ``row``
    capture: int  # its position in spec.capture
    drop_prefix: NotRequired[int]  # token sequences: leading tokens left out
    target: NotRequired[int | str]  # gradient captures: predicted, label or a class index
    size: NotRequired[str]  # gradcam maps: layer or input resolution
    sample_tokens: NotRequired[int]  # patch tokens kept per row (their positions: the KEY.token_index array)
    prefix_kept: NotRequired[int]  # with sample_tokens: prefix tokens kept in front of them
    project: NotRequired[int]  # features after the seeded random projection (store.sampling.projection_matrix)
    projection: NotRequired[str]  # gaussian or sparse
    projected_from: NotRequired[int]  # the features it multiplied (the matrix is projected_from x project)
    seed: NotRequired[int]  # of sample_tokens and project
    sampled_by: NotRequired[str]  # with sample_tokens: what keys the draw, "digest" (absent: the row number)
    feature_index: NotRequired[dict[str, Any]]  # a write-time index: k, pool, threshold, dictionary, name


class ExtraRecord(TypedDict):
    """A per-row result of a gradient job (``target``, ``score``, ``*.range``), chunked by shard."""

    dtype: str
    shape: list[int]
    dims: list[str]


@dataclass(frozen=True)
class StoreArrays:
    """What a store holds besides its rows, and how its arrays are chunked and compressed."""

    captures: Mapping[str, CaptureRecord]
    extras: Mapping[str, ExtraRecord]
    shard_size: int
    chunk_rows: Mapping[str, int]  # per capture: rows per chunk, a divisor of shard_size
    compression: str = "zstd"
    compression_level: int | None = None
    reuse: bool = False  # rows may come from other stores (output.reuse): the ``reused`` array records which
    sharded: bool = False  # each work shard of a capture one storage object (Zarr v3 sharding) of its chunks
    locators: tuple[LocatorArray, ...] = ()  # the data source's per-row arrays beside paths (its Source.locators)


WRITE_ROWS = 1 << 20  # a new store's per-row arrays are written this many rows (rounded to chunks) at a time
READ_BYTES = 32 << 20  # a streaming read of a sharded array takes chunks of its shard up to about this much


def read_rows(array: zarr.Array) -> int:
    """Rows a streaming read takes at once: one chunk, or of a sharded array as many of its chunks as fit
    READ_BYTES (a run of them dividing its shard: reads stay aligned, one shard's index serves them)."""
    rows = max(int(array.chunks[0]), 1)
    shards = getattr(array, "shards", None)
    if not shards:
        return rows
    shard = int(shards[0])
    fits = [d for d in range(rows, shard + 1, rows) if shard % d == 0 and d * _row_bytes(array) <= READ_BYTES]
    return max(fits, default=rows)


def _row_bytes(array: zarr.Array) -> int:
    return max(int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize, 1)


def take_rows(array: zarr.Array, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``rows`` (any order, repeats allowed) of ``array``, into ``out`` if given (of their shape and the
    array's dtype): every chunk touched read once, a stretch of touched chunks in one call (zarr decodes its
    chunks concurrently), consecutive rows decoded straight into the result. Orthogonal indexing (``oindex``)
    of a sharded array decodes inner chunk by inner chunk: 50x slower here than these slices."""
    rows = np.asarray(rows, dtype=np.int64)
    if out is None:
        out = np.empty((len(rows), *array.shape[1:]), dtype=array.dtype)
    if not len(rows):
        return out
    order = np.argsort(rows, kind="stable")
    ranked = rows[order]
    step = max(int(array.chunks[0]), 1)
    chunk = ranked // step
    per_read = max(READ_BYTES // (step * _row_bytes(array)), 1)  # chunks of one call: about READ_BYTES at most
    # a stretch ends where a chunk is skipped, or where a call holds its share
    cuts = np.flatnonzero((np.diff(chunk) > 1) | (np.diff(chunk // per_read) != 0)) + 1
    for at, part in zip(np.split(order, cuts), np.split(ranked, cuts), strict=True):
        a, b = int(part[0]), int(part[-1]) + 1
        if b - a == len(part) and bool((np.diff(at) == 1).all()):  # rows a..b-1, asked in this order
            array.get_basic_selection(slice(a, b), out=NDBuffer.from_numpy_array(out[int(at[0]) : int(at[-1]) + 1]))
        else:
            out[at] = np.asarray(array[a:b])[part - a]
    return out


def fill_value(dtype: str) -> float:
    """What a row not (yet) computed holds in a capture or extra array: NaN, or -1 for an integer (a Grad-CAM
    job's ``target``)."""
    return -1 if numpy_dtype(dtype).kind in "iu" else np.nan


def create_store(url: str, rows: Rows, arrays: StoreArrays, attrs: Mapping[str, Any],
                 storage_options: Mapping[str, Any] | None = None, lease: _Lease | None = None,
                 fresh: bool = False, claimed: Callable[[], None] | None = None) -> zarr.Group:
    """Create the store's arrays under ``lease`` (replacing what is at ``url``); the caller checked, just before,
    that this is allowed. The lease is taken before anything is changed: in the old store (a live job's lease
    refuses), or in a ``fresh`` one (nothing was at ``url``: a local folder is made atomically, so of two jobs one
    wins). What was there is then removed under the lease, its lease kept (:func:`wipe`), and every write goes
    through the lease's fence (:class:`FencedStore`): a job that lost the store, paused anywhere in here, writes
    nothing more into it. ``claimed``: called once the lease is held, before anything is changed (it may refuse).
    Without ``lease`` (tests) nothing is fenced."""
    comp = _compressors(arrays.compression, arrays.compression_level)  # before anything is wiped
    if fresh:
        _make_folder(url)
    try:
        if lease is not None:
            lease.acquire()
        if claimed is not None:
            claimed()  # the caller's check, now that no other job can change the store
        store = fenced_store(url, storage_options, lease.fence if lease is not None else None)
        wipe(store)
        root = {"zarr_format": 3, "node_type": "group", "attributes": {ATTR: {**attrs, "status": "creating"}}}
        sync(store.set("zarr.json", default_buffer_prototype().buffer.from_bytes(json.dumps(root).encode())))
        group = zarr.open_group(store=store, mode="r+", use_consolidated=False)
    except (StoreError, FencedError):
        raise
    except Exception as err:  # FileNotFoundError (no bucket), NotADirectoryError, PermissionError, credentials...
        raise StoreError(
            f"cannot create the store at output.store {url}: {type(err).__name__}: {str(err).rstrip('.')}. Its parent "
            "folder or bucket must exist and be writable (check output.store and output.storage_options)"
        ) from err
    try:
        return _create_arrays(group, rows, arrays, attrs, comp)
    except Exception as err:  # fenced; or an array another job made meanwhile (ContainsArrayError)...
        if lease is None or not (isinstance(err, FencedError) or lease.fence.current() != lease.token):
            raise
        lease.lost = True
        raise StoreError(f"store {url} was replaced by another job while this one created it; this job stops "
                         "and writes nothing more. Look at the store with `extractor inspect`") from None


def _make_folder(url: str) -> None:
    """A new local store's folder, made with one atomic mkdir: of two jobs that both found nothing, one wins."""
    path = local_root(url)
    if path is None:
        return
    try:
        os.mkdir(path)
    except FileExistsError:
        if os.listdir(path):  # another job made it since this one looked
            raise StoreError(f"store {url} was created by another job after this one looked; run again with "
                             "--resume to finish it, or wait for that job") from None
    except OSError:
        pass  # a missing parent and the like: said when the store is created


def wipe(store: Any) -> None:
    """Remove everything in ``store`` but its lease, in one step of the lease's fence (locally, no takeover can
    come between the check and the last removal)."""
    held = store.held() if isinstance(store, FencedStore) else contextlib.nullcontext()
    with held:
        root = getattr(store, "root", None)
        if root is not None:  # a local folder: its entries removed straight away (zarr would remove them one by one)
            names = sorted(os.listdir(root) if os.path.isdir(root) else [], key=lambda n: n != "zarr.json")
            for name in names:  # its root first: a run stopped midway leaves a store "being created", not one
                if name != "lease":  # that says complete over arrays half gone
                    path = os.path.join(root, name)
                    (shutil.rmtree if os.path.isdir(path) and not os.path.islink(path) else os.remove)(path)
            return
        if isinstance(store, FencedStore) and store._s3:  # each object removed as listed (If-Match)
            sync(store.s3_wipe(keep="lease"))
            return
        inner = store._store if isinstance(store, FencedStore) else store

        async def remove_all() -> None:
            names = sorted([n async for n in inner.list_dir("")], key=lambda n: n != "zarr.json")  # the root first
            for name in names:
                if name == "zarr.json":
                    await inner.delete(name)
                elif name != "lease":
                    await inner.delete_dir(name)

        if isinstance(store, FencedStore):
            store.fence.check()  # an object store: checked just before (the README says what that leaves)
        sync(remove_all())


def _create_arrays(group: zarr.Group, rows: Rows, arrays: StoreArrays, attrs: Mapping[str, Any],
                   comp: Any) -> zarr.Group:
    """The arrays of a new store, then its attributes (status as the caller has it: no longer "creating")."""
    n = len(rows)
    shard_size, captures, extras = arrays.shard_size, arrays.captures, arrays.extras
    shard_rows = min(shard_size, max(n, 1))  # per-row arrays: one chunk per shard
    _create_row_arrays(group, shard_rows, rows, arrays.locators)
    write_id_index(group, rows.ids, attrs.get("ids_digest"))
    _create_shard_arrays(group, n_shards=-(-n // shard_size))
    if arrays.reuse:  # -1: computed here; i: copied from output.reuse[i] (the reused_from attribute)
        group.create_array("reused", shape=(n,), dtype="int16", chunks=(shard_rows,), fill_value=-1,
                           dimension_names=["row"])
    for key, extra in extras.items():  # per-row results of gradient jobs, chunked by shard
        group.create_array(
            key,
            shape=(n, *extra["shape"]),
            dtype=extra["dtype"],
            chunks=(shard_rows, *extra["shape"]),
            fill_value=fill_value(extra["dtype"]),
            dimension_names=["row", *extra["dims"]],
        )
    for key, record in captures.items():
        shape = tuple(record["shape"])
        meta = cast(dict[str, Any], record)  # as JSON: a TypedDict is a dict
        group.create_array(
            key,
            shape=(n, *shape),
            dtype=meta["dtype"],
            chunks=(arrays.chunk_rows[key] if arrays.sharded else min(arrays.chunk_rows[key], max(n, 1)), *shape),
            shards=(shard_size, *shape) if arrays.sharded else None,
            fill_value=fill_value(meta["dtype"]),
            compressors=comp,
            dimension_names=["row", *meta["dims"]],
            attributes={"extractor": dict(meta), "coordinates": "ids labels"},
        )
    group.attrs.update({ATTR: dict(attrs)})
    return group


def _create_row_arrays(group: zarr.Group, shard_rows: int, rows: Rows, locators: tuple[LocatorArray, ...]) -> None:
    """The per-row arrays (``ROW_ARRAYS``, and the source's ``locators``, their columns from ``rows``), in chunks
    of ``shard_rows``: what is known before any image is read is written now, a stretch of whole chunks at a time
    (the paths of a Joined made a stretch at a time)."""
    n = len(rows)
    step = shard_rows * max(1, WRITE_ROWS // shard_rows)

    def row_array(name: str, dtype: Any, fill: Any, data: Any = None) -> None:
        arr = group.create_array(
            name, shape=(n,), dtype=dtype, chunks=(shard_rows,), fill_value=fill, dimension_names=["row"]
        )
        for start in range(0, n if data is not None else 0, step):
            arr[start:start + step] = data[start:start + step]

    row_array("ids", str, "", rows.ids)
    row_array("paths", str, "", rows.paths)
    row_array("labels", "int64", -1, rows.labels)
    for locator in locators:  # where the source finds each image's bytes, beside its path
        if locator.name not in rows.locators:
            raise ValueError(f"the rows carry no {locator.name!r} column, which their source declares")
        row_array(locator.name, locator.dtype, locator.fill, rows.locators[locator.name])
    row_array("status", "uint8", PENDING)
    row_array("errors", str, "")
    row_array("digest", "uint64", 0)  # written with each shard's status
    row_array("fingerprint", "uint64", 0, rows.fingerprints)


def _create_shard_arrays(group: zarr.Group, n_shards: int) -> None:
    """The per-shard arrays: done markers and statistics, one storage object per shard."""
    group.create_array(
        "shard_done", shape=(n_shards,), dtype="uint8", chunks=(1,), fill_value=0, dimension_names=["shard"]
    )
    group.create_array(
        "shard_stats", shape=(n_shards,), dtype=str, chunks=(1,), fill_value="", dimension_names=["shard"]
    )


def locator_arrays(group: zarr.Group, names: Iterable[str] | None = None) -> tuple[str, ...]:
    """The per-row arrays the store's data source keeps beside ``paths`` (its ``Source.locators``) that the store
    holds (``names``: its arrays, when known), in the source's order: a row's locator is its path and their
    values."""
    from ..data import source

    held = set(group.array_keys() if names is None else names)
    return tuple(a.name for a in source(data_source(root_attrs(group))).locators if a.name in held)


def data_source(attrs: Mapping[str, Any]) -> str:
    """The ``data.source`` of the job a store's attributes record."""
    return str(((attrs.get("spec") or {}).get("data") or {}).get("source", "folder"))


def update_attrs(group: zarr.Group, **changes: Any) -> None:
    """Update the root's extractor attributes (driver only: through its fenced group), as the storage has them."""
    group = zarr.open_group(store=group.store, mode="r+", use_consolidated=False)
    attrs = root_attrs(group)
    attrs.update(changes, updated=now())
    group.attrs.update({ATTR: attrs})


def consolidate(group: zarr.Group) -> None:
    """Write consolidated metadata (one object to open the whole store: fast on object stores).

    Any later attribute update by a writer drops it again, and the next run's end rewrites it.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not part of the Zarr v3 specification" (yet)
        zarr.consolidate_metadata(group.store, path=None)


def drop_partials(group: zarr.Group) -> int:
    """Temporary shard objects that no writer finished (a job killed mid-shard), removed from a local store;
    call only while none of the store's writers runs (its job's end). How many there were."""
    root = getattr(group.store, "root", None)
    if root is None:
        return 0
    with group.store.held() if isinstance(group.store, FencedStore) else contextlib.nullcontext():
        return remove_partials(str(root))


def reset_shards(group: zarr.Group, shards: Iterable[tuple[int, int, int]]) -> None:
    """Make ``(index, start, stop)`` shards pending again, to be computed anew: not done, no statistics,
    their rows pending and unread (so that their old values are never taken for current ones)."""
    for index, start, stop in shards:
        get_array(group, "shard_done")[index] = 0
        get_array(group, "shard_stats")[index] = ""
        get_array(group, "status")[start:stop] = PENDING
        if "stats_sums" in group:  # the merged totals hold the shard's old sums: not whole any more
            get_array(group, "stats_sums")[:4] = 0
        if "digest" in group:
            get_array(group, "digest")[start:stop] = 0


def done_shards(group: zarr.Group) -> np.ndarray:
    """Boolean per shard: True once its data and row status are durable."""
    return np.asarray(read_all(get_array(group, "shard_done")), dtype=bool)


def disk_usage(url: str) -> int | None:
    """Bytes on disk of a local store (None for remote stores)."""
    if is_url(url):
        return None
    total = 0
    for dirpath, _dirs, files in os.walk(url.removeprefix("file://")):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total

