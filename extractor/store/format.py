"""The Zarr v3 store layout: creating it, writing a shard's rows, done markers, the lease.

Imports only numpy and zarr, so the reader can use it without torch.

Layout (format version 1), all arrays at the root, row dimension named ``row``::

    zarr.json           root attributes under "extractor" (see README "Store layout")
    ids      (N,)       str      image id (relative path or manifest id)
    paths    (N,)       str      where the image was read from (tar members: TAR_URL#MEMBER)
    byte_offset, byte_size (N,) int64  tar sources only: the image's bytes inside its tar
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

Per-row arrays are chunked by shard and each capture array by its ``chunk_rows`` (which divides
the shard size), so no two shards ever write into the same storage object.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict, cast

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype
from zarr.buffer.cpu import NDBuffer
from zarr.core.array_spec import ArrayConfigParams
from zarr.core.sync import sync

from ..data import Rows, is_url
from ..data.rows import strings
from ..errors import FencedError, StoreError
from .chunks import ChunkCodec, ShardStream, read_at_once, remove_partials, write_at_once, write_chunks
from .dtypes import numpy_dtype  # and zarr knows bfloat16 wherever a store opens
from .fence import (
    Fence,
    FencedStore,
    LockFile,
    conditional_writes,
    fenced,
    fenced_group,
    fenced_store,
    is_s3,
    local_root,
    read_record,
    refused,
    write_record,
)

log = logging.getLogger(__name__)

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


class LeaseRecord(TypedDict, total=False):
    """The attributes of the ``lease`` group: the job that holds the store (see :class:`Lease`)."""

    token: str
    heartbeat: float  # time.time() of its last renewal
    timeout_s: float  # its job's output.lease_timeout_s: silent this long, the lease is stale
    released: str  # when the job let go of the store
    host: str
    pid: int
    user: str
    started: str
    command: str


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


def read_lease(group: zarr.Group) -> LeaseRecord:
    """The store's lease (``{}`` when no job ever held it)."""
    try:
        return cast(LeaseRecord, dict(group["lease"].attrs))  # written only by Lease._write
    except KeyError:
        return {}


def half_created(url: str) -> str:
    """What to say of a store whose creation failed midway (status "creating", its lease let go or stale)."""
    return (f"store {url} was left half-created by a run that failed while creating it: it holds no data; "
            "run the job again with --resume (or --overwrite)")


def being_created(url: str, group: zarr.Group, timeout_s: float) -> str:
    """What to say of a store with status "creating": half-created, or being created by a live job now."""
    held = read_lease(group)
    if held and not held.get("released") and _fresh(held, timeout_s):
        return (f"store {url} is being created by another extractor job now: pid {held.get('pid')} on "
                f"{held.get('host')} (user {held.get('user')}, started {held.get('started')}); open it once that job "
                "has created it")
    return half_created(url)


def read_attrs(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The store's extractor attributes, or None when nothing is at ``url``."""
    if not is_url(url):
        path = url.removeprefix("file://")
        if not os.path.exists(path):
            return None
        if not os.path.exists(os.path.join(path, "zarr.json")):
            if os.path.isdir(path) and not os.listdir(path):
                return None
            if read_record(path) or os.listdir(path) == ["lease"]:  # a job holds it and (re)creates its root, or did
                return {"status": "creating"}
            what = "a folder" if os.path.isdir(path) else "a file"
            raise StoreError(
                f"{url} exists and is {what}, not a Zarr store; choose another output.store "
                f"(extractor never deletes {what} it did not create)"
            )
    try:
        group = open_group(url, "r", storage_options)
    except FileNotFoundError:
        return {"status": "creating"} if _LeaseObject(url, storage_options).read()[0] else None
    except Exception as err:
        raise StoreError(f"cannot open {url} as a Zarr group: {type(err).__name__}: {err}; check output.store and "
                         "output.storage_options (endpoint_url, credentials) and that the storage answers") from err
    attrs = dict(group.attrs).get(ATTR)
    if not isinstance(attrs, dict):
        raise StoreError(
            f"{url} is a Zarr store not written by extractor; choose another output.store "
            "(extractor never deletes stores it did not create)"
        )
    return attrs


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
                 storage_options: Mapping[str, Any] | None = None, lease: Lease | None = None,
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
    _create_row_arrays(group, shard_rows, rows)
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


def _create_row_arrays(group: zarr.Group, shard_rows: int, rows: Rows) -> None:
    """The per-row arrays (``ROW_ARRAYS``, and where tar sources have them ``byte_offset`` and
    ``byte_size``), in chunks of ``shard_rows``: what is known before any image is read is written now, a
    stretch of whole chunks at a time (the paths of a Joined made a stretch at a time)."""
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
    if rows.offsets is not None and rows.sizes is not None:  # tar sources: where each image's bytes are
        row_array("byte_offset", "int64", -1, rows.offsets)
        row_array("byte_size", "int64", -1, rows.sizes)
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


def source_digests(group: zarr.Group, rows: np.ndarray, storage_options: Mapping[str, Any] | None = None,
                   threads: int = 16, places: tuple[np.ndarray, np.ndarray] | None = None) -> list[int]:
    """The content digests of the images of store rows ``rows`` as their source holds them now, read again
    from the stored places (0: gone or unreadable), on ``threads`` threads. ``places``: a tar source's member
    offsets and sizes of those rows where a listing now finds them (a rewritten tar moves its members)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..data import content_digest, forget_reads, read_bytes

    forget_reads()  # the sources as they are now, not as an earlier read in this process kept them
    paths = take_rows(get_array(group, "paths"), rows)
    tar = "byte_offset" in group
    offsets = take_rows(get_array(group, "byte_offset"), rows) if tar and places is None else None
    sizes = take_rows(get_array(group, "byte_size"), rows) if tar and places is None else None
    if tar and places is not None:
        offsets, sizes = places
    storage = dict(storage_options or {})

    def digest(i: int) -> int:
        item: Any = str(paths[i]) if offsets is None or sizes is None else \
            (str(paths[i]), int(offsets[i]), int(sizes[i]))
        try:
            return content_digest(read_bytes(item, storage))
        except Exception:  # noqa: BLE001 - gone or unreadable: not the image the row read
            return 0

    with ThreadPoolExecutor(max(1, threads)) as pool:
        return list(pool.map(digest, range(len(rows))))


def current_places(group: zarr.Group, storage_options: Mapping[str, Any] | None = None) -> \
        tuple[np.ndarray, np.ndarray] | None:
    """A tar source's member offsets and sizes of every row where its tars hold them now, when a tar was
    rewritten since the store was listed (its size and mtime or ETag differ: its members may have moved; a
    member gone: offset -1); None when every tar is as listed, or the store records no listing."""
    from ..data import scan_tar, tar_listing

    recorded = root_attrs(group).get("listing")
    if "byte_offset" not in group or not recorded:
        return None
    storage = dict(storage_options or {})
    now_ = tar_listing(recorded["tars"], recorded["extensions"], storage)
    moved = {u for u, was, is_ in zip(recorded["tars"], recorded["fingerprints"], now_["fingerprints"], strict=True)
             if was != is_ or is_ == 0}
    if not moved:
        return None
    offsets = np.asarray(get_array(group, "byte_offset")[:]).copy()
    sizes = np.asarray(get_array(group, "byte_size")[:]).copy()
    paths = np.asarray(get_array(group, "paths")[:])
    for url in sorted(moved):
        try:
            found = scan_tar(url, recorded["extensions"], storage)
            where = {m: (o, n) for m, o, n in zip(found.members, found.offsets, found.sizes, strict=True)}
        except Exception:  # noqa: BLE001 - a tar gone or unreadable now: its rows are unreadable
            where = {}
        for r in np.flatnonzero(np.strings.startswith(paths, f"{url}#")):
            offsets[r], sizes[r] = where.get(str(paths[r])[len(url) + 1:], (-1, 0))
    return offsets, sizes


def stored_rows(group: zarr.Group, labels: bool = False) -> Rows:
    """The rows as the store records them, for a resume whose source is as it was listed: left in the store (the
    workers read their shards' rows from it), their number, classes, listing and digests taken from its
    attributes; ``labels``: the labels read too (a gradient of the label's logit checks them)."""
    attrs = root_attrs(group)
    none = strings([])
    return Rows(ids=none, paths=none, labels=np.asarray(get_array(group, "labels")[:]) if labels else
                np.zeros(0, np.int64),
                classes=list(attrs.get("classes") or []), listing=attrs.get("listing"),
                stored={k: attrs[k] for k in ("n_rows", "ids_digest", "paths_digest")})


def done_shards(group: zarr.Group) -> np.ndarray:
    """Boolean per shard: True once its data and row status are durable."""
    return np.asarray(get_array(group, "shard_done")[:], dtype=bool)


def lease_token(group: zarr.Group) -> str | None:
    """The token of the job that holds the store now (None: no lease)."""
    return read_lease(group).get("token")


class ShardWriter:
    """Writes the rows of one shard; ``finish`` writes status, errors, then the done marker.

    With ``fence`` (the lease token of the job), the writer checks that its job still holds the
    store before the shard is opened, before each chunk it writes and before its done marker, and raises
    :class:`FencedError` otherwise: a job paused past its lease never writes into the store of
    the job that took it over."""

    def __init__(self, url: str, start: int, stop: int, index: int, storage_options: Mapping[str, Any] | None = None,
                 fence: str | None = None):
        self.url, self.fence, self.storage_options = url, fence, storage_options
        self.opened = _Opened.of(url, storage_options, fence)
        self.group = self.opened.group
        self.check_fence()
        self.start, self.stop, self.index = start, stop, index
        self.bytes = 0
        # opened once (each open reads the array's metadata), with how its whole chunks are encoded
        self._arrays: dict[str, tuple[zarr.Array, ChunkCodec | None]] = {}
        self._streams: dict[str, ShardStream] = {}  # sharded arrays: this shard's object of each, being written
        self._lock = threading.Lock()  # write() is called from several writer threads

    def opening(self, labels: bool = False) -> tuple[list[Any], np.ndarray | None]:
        """What the decoder reads for each row (a path, or (tar URL#member, offset, size)) and, with ``labels``,
        the rows' labels: the shard's rows of those arrays read in one round."""
        tar = self.opened.has("byte_offset")
        names = ["paths", *(["byte_offset", "byte_size"] if tar else []), *(["labels"] if labels else [])]
        got = dict(zip(names, read_at_once([(self.opened.array(n), slice(self.start, self.stop)) for n in names]),
                       strict=True))
        paths = got["paths"].tolist()
        found = np.asarray(got["labels"], dtype=np.int64) if labels else None
        if not tar:
            return paths, found
        return [(p, o, n) for p, o, n in zip(paths, got["byte_offset"].tolist(), got["byte_size"].tolist(),
                                             strict=True)], found

    def check_fence(self) -> None:
        """Raise :class:`FencedError` when the job that writes is no longer the one holding the store (early: every
        write is fenced by the store itself, :class:`FencedStore`)."""
        if self.opened.fence is not None:
            self.opened.fence.check()

    def _open(self, key: str) -> tuple[zarr.Array, ChunkCodec | None]:
        """The capture array ``key`` and its chunk codec, opened once (callers hold ``_lock``)."""
        if key not in self._arrays:
            array = self.opened.array(key)
            self._arrays[key] = array, ChunkCodec.of(array)
        return self._arrays[key]

    def chunk_rows(self, keys: Iterable[str]) -> dict[str, int]:
        """Rows per chunk of each capture array of ``keys``, as the store has them."""
        with self._lock:
            return {key: int(self._open(key)[0].chunks[0]) for key in keys}

    def write(self, offset: int, chunks: Mapping[str, np.ndarray]) -> None:
        """Write rows ``start+offset ...`` of each capture in ``chunks`` (one whole chunk of each),
        while this job holds the store (a small metadata read before each chunk: a job paused
        mid-shard must not write into the store of the job that took it over)."""
        self.check_fence()
        with self._lock:
            opened = {key: (*self._open(key), data) for key, data in chunks.items()}
            for key, (_, codec, _) in opened.items():
                if codec is not None and codec.shard_rows is not None and key not in self._streams:
                    self._streams[key] = ShardStream(codec, self.start, self.url, self.storage_options,
                                                     uuid.uuid4().hex[:12])
        written = write_chunks(self.start + offset, opened, self._streams)
        with self._lock:
            self.bytes += written

    def abandon(self) -> None:
        """The shard will not finish here: its sharded objects being written are given up."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.abort()

    def finish(
        self,
        status: np.ndarray,
        errors: Sequence[str],
        extras: Mapping[str, np.ndarray] | None = None,
        stats: str = "",
        digests: np.ndarray | None = None,
        reused: np.ndarray | None = None,
        index_parts: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """``index_parts``: this shard's part of each write-time feature index (store.feature_index)."""
        self.check_fence()  # the marker says "done": only while this job holds the store
        with self._lock:
            keys = list(self._streams)
        for key in keys:  # each sharded array's object of this shard made whole: its index, last
            self._streams[key].close()
            with self._lock:
                del self._streams[key]  # closed: what a failure leaves open, abandon() gives up
        array, rows = self.opened.array, slice(self.start, self.stop)
        writes: list[tuple[zarr.Array, Any, Any]] = [(array(key), rows, v) for key, v in (extras or {}).items()]
        if digests is not None and self.opened.has("digest"):  # stores made before digests have none
            writes.append((array("digest"), rows, digests))
        if reused is not None and self.opened.has("reused"):
            writes.append((array("reused"), rows, reused))
        writes += [(array(f"index_parts/{key}"), self.index, part) for key, part in (index_parts or {}).items()]
        writes += [(array("status"), rows, status),
                   (array("errors"), rows, np.asarray(errors, dtype=np.dtypes.StringDType())),
                   (array("shard_stats"), self.index, stats)]
        write_at_once(writes)  # all of them, then the marker
        array("shard_done")[self.index] = 1  # last: a crash before this never looks complete


class _Opened:
    """A job's store as this process opened it for writing: its root group and arrays, each opened once (an
    opening reads metadata from the storage: 0.5-1 ms each locally, a round trip on an object store). Kept for
    the shards of one job (its lease token) that the process writes; the lease itself is read fresh at every
    fence check."""

    last: _Opened | None = None  # the job whose shards this process writes now

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, fence: str | None) -> None:
        self.key = (url, fence)
        self.fence = job_fence(url, storage_options, fence) if fence is not None else None
        self.group = fenced_group(url, storage_options, self.fence)
        self.names = set(self.group.array_keys())
        self.arrays: dict[str, zarr.Array] = {}
        self.lock = threading.Lock()
        # on an object store every chunk of a shard is written, also one of fill values only (zarr would skip or
        # remove it): a stale writer's object at that key is then always met, and replaced
        self.config: ArrayConfigParams | None = {"write_empty_chunks": True} if is_s3(url) and fence else None

    @classmethod
    def of(cls, url: str, storage_options: Mapping[str, Any] | None, fence: str | None) -> _Opened:
        """The store opened for the job with lease token ``fence`` (opened anew without one)."""
        last = cls.last
        if fence is not None and last is not None and last.key == (url, fence):
            return last
        opened = cls(url, storage_options, fence)
        if fence is not None:
            cls.last = opened
        return opened

    def has(self, name: str) -> bool:
        return name in self.names

    def array(self, name: str) -> zarr.Array:
        with self.lock:
            if name not in self.arrays:
                array = get_array(self.group, name)
                self.arrays[name] = array.with_config(self.config) if self.config else array
            return self.arrays[name]


def job_fence(url: str, storage_options: Mapping[str, Any] | None, token: str) -> Fence:
    """The fence of the job whose lease token is ``token`` on the store at ``url``."""
    lease = _LeaseObject(url, storage_options)
    return Fence(url, storage_options, token, lambda: lease.read()[0].get("token"))


def lease_timeout(held: LeaseRecord, default: float) -> float:
    """How long the lease ``held`` lives without a renewal: its own job's ``output.lease_timeout_s`` (which
    sets how often that job renews it), or ``default`` for leases that did not record it."""
    return float(held.get("timeout_s", default))


def _fresh(held: LeaseRecord, timeout_s: float) -> bool:
    """A lease renewed within its timeout (``timeout_s`` when it has none of its own) whose job, when it
    ran on this machine, is still alive."""
    import time

    if time.time() - float(held.get("heartbeat", 0)) > lease_timeout(held, timeout_s):
        return False
    # its job ran on this machine and its process is gone: no need to wait for the timeout
    return not (held.get("host") == socket.gethostname() and not _alive(int(held.get("pid", 0))))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Raced(Exception):
    """A conditional write of the lease found it changed since it was read: another job wrote it."""


class _LeaseObject:
    """Where a store's lease record lives (the ``lease`` group's ``zarr.json``) and how it is written.

    Locally it is a file read and replaced whole, under the store's lock file (:class:`LockFile`: exclusive to
    change its holder, shared to renew it). On S3 (``s3://``) it is a compare-and-swap: created with
    ``If-None-Match: *``, replaced with ``If-Match`` on the ETag it was read at (S3 conditional writes, since
    2024-11), so that of two jobs that write it at once exactly one wins and the other is told (:class:`_Raced`).
    Elsewhere (``memory://``, other object stores) it is written as zarr writes attributes, after a read just
    before."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        self.url, self.storage_options = url, storage_options
        self.root = local_root(url)
        self.fs: Any = None
        self.path = ""
        if self.root is None:
            import fsspec

            self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
            self.path = f"{root.rstrip('/')}/lease/zarr.json"

    @property
    def conditional(self) -> bool:
        return is_s3(self.url)

    def read(self) -> tuple[LeaseRecord, str | None]:
        """The record (``{}`` when no job ever held the store) and the version it was read at (its ETag;
        None when absent, or where writes are not conditional). The version is read first: a record
        newer than it makes the write fail, never the other way round."""
        if self.root is not None:
            return cast(LeaseRecord, read_record(self.root)), None
        try:
            self.fs.invalidate_cache(self.path)
            version = str(self.fs.info(self.path)["ETag"]) if self.conditional else None
            meta = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return {}, None
        return cast(LeaseRecord, meta.get("attributes") or {}), version

    def write(self, record: LeaseRecord, version: str | None) -> str | None:
        """Write ``record``; where writes are conditional, only if the object is still at ``version``
        (absent when None), raising :class:`_Raced` otherwise. Returns the new version."""
        if self.root is not None:
            write_record(self.root, record)
            return None
        data = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": record}).encode()
        if not self.conditional:  # another object store: written whole
            self.fs.pipe_file(self.path, data)
            self.fs.invalidate_cache(self.path)
            return None
        try:
            if version is None:
                out = self.fs.pipe_file(self.path, data, mode="create")
            else:
                out = self.fs.pipe_file(self.path, data, IfMatch=version)
        except Exception as err:  # noqa: BLE001 - a refused condition is told apart; the rest goes up
            if refused(err):
                raise _Raced from None
            raise
        self.fs.invalidate_cache(self.path)
        tag = out.get("ETag") if isinstance(out, dict) else None
        return str(tag) if tag else str(self.fs.info(self.path)["ETag"])


class Lease:
    """A claim on a store by one running job: owner, host, pid and a heartbeat.

    Kept in the attributes of the child group ``lease``. A second job refuses to run on a
    store whose lease is fresh; a lease whose heartbeat is older than its timeout is stale (its
    job died) and can be taken over. A thread renews it every ``timeout_s / 4``. Every write of it
    happens only while it is still this job's: locally under the store's lock file (a takeover holds it
    exclusively), on S3 conditional on the version this job last saw (:class:`_LeaseObject`). Its
    :attr:`fence` is what each of the job's writes goes through (:class:`FencedStore`).
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, timeout_s: float, info: dict[str, Any]):
        self.url, self.storage_options, self.timeout_s = url, storage_options, timeout_s
        self.token = uuid.uuid4().hex
        self.info = dict(info)
        self.object = _LeaseObject(url, storage_options)
        self.fence = job_fence(url, storage_options, self.token)
        self.version: str | None = None  # of the lease object as this job last wrote it (conditional writes)
        self._stop: Any = None  # set while the heartbeat thread renews the lease
        self._beat: threading.Thread | None = None
        self.held = False  # written once: from then on it renews only while still its own
        self.lost = False  # another job took the store over
        self.conditional: bool | None = None  # an object store honours create-only writes (None: not asked)

    @staticmethod
    def check(url: str, storage_options: Mapping[str, Any] | None, timeout_s: float, token: str = "") -> None:
        """Raise StoreError when another job holds a fresh lease on ``url``."""
        _refuse_held(url, _LeaseObject(url, storage_options).read()[0], timeout_s, token)

    def _record(self, **extra: Any) -> LeaseRecord:
        import time

        return cast(LeaseRecord, {**self.info, "token": self.token, "heartbeat": time.time(),
                                  "timeout_s": self.timeout_s, **extra})

    def _write(self, **extra: Any) -> None:
        """Renew (or release) the lease, unless another job holds it now: then this job is fenced
        off (``lost``) and writes nothing, not even its lease."""
        if self.object.conditional:
            if self.conditional is False and self.fence.current() != self.token:  # a storage that would let the
                self.lost = True  # write through: read first (the README says what is left)
                raise fenced(self.url, self.fence.current())
            try:
                self.version = self.object.write(self._record(**extra), self.version)
            except _Raced:
                self.lost = True
                raise fenced(self.url, self.fence.current()) from None
            return
        try:
            with self.fence.held():  # locally: under the lock, so no takeover comes between check and write
                self.object.write(self._record(**extra), None)
        except FencedError:
            self.lost = True
            raise

    def acquire(self) -> None:
        """Take the store (a new one, or one whose lease is released or stale), or raise StoreError naming the job
        that holds it; then renew it in the background."""
        if self.object.root is not None:
            _refuse_held(self.url, self.object.read()[0], self.timeout_s, self.token)  # a live job: at once
            with LockFile.of(self.object.root).exclusive(max(self.timeout_s, 1.0), self._busy):
                _refuse_held(self.url, self.object.read()[0], self.timeout_s, self.token)
                self.object.write(self._record(), None)
        else:
            self._acquire_remote()
        self.held = True
        stop = self._stop = threading.Event()

        def beat() -> None:  # its own reference to the event: release() lets go of it
            while not stop.wait(self.timeout_s / 4):
                try:
                    self._write()
                except FencedError:
                    return  # taken over: the shard writers see it too, and stop
                except Exception:  # noqa: BLE001 - a missed heartbeat is retried at the next one
                    pass

        self._beat = threading.Thread(target=beat, name="extractor-lease", daemon=True)
        self._beat.start()

    def _acquire_remote(self) -> None:
        """:meth:`acquire` on an object store: a conditional write of the lease where the storage has them."""
        import time

        if self.object.conditional and self.conditional is None:
            self.conditional = conditional_writes(self.object.fs, self.object.path.removesuffix("/lease/zarr.json"))
            if not self.conditional:
                log.warning("the storage of %s does not honour conditional writes (a create-only write replaced the "
                            "object it should have refused): a job paused past its lease could still write into it "
                            "after another job took it over; run one job at a time on this store", self.url)
        held, version = self.object.read()
        _refuse_held(self.url, held, self.timeout_s, self.token)
        try:
            self.version = self.object.write(self._record(), version)
        except _Raced:  # another job wrote the lease between this job's read and its write: it won
            _refuse_held(self.url, self.object.read()[0], self.timeout_s, self.token)
            raise StoreError(f"store {self.url} was taken by another extractor job at the same moment; run again "
                             "once it is done") from None
        if not self.conditional:  # a race not excluded by the write: seen by reading again
            time.sleep(0.05)
            self.check(self.url, self.storage_options, self.timeout_s, self.token)

    def _busy(self) -> str:
        """What to say when the store's lock stays held by a writer of the job whose lease is stale."""
        held = self.object.read()[0]
        try:
            _refuse_held(self.url, held, self.timeout_s, self.token)  # renewed meanwhile: a live job, busy writing
        except StoreError as err:
            return str(err)
        return (f"store {self.url} is locked by a writer that stopped mid-write: the job that held it (pid "
                f"{held.get('pid')} on {held.get('host')}, user {held.get('user')}) is paused or stuck; resume it "
                f"(kill -CONT {held.get('pid')}) or end it, then run again")

    def open(self) -> zarr.Group:
        """The store's root group for this job's writes: each of them through the lease's fence."""
        return fenced_group(self.url, self.storage_options, self.fence)

    def verify(self) -> None:
        """Raise :class:`FencedError` when another job holds the store now."""
        try:
            self.fence.check()
        except FencedError:
            self.lost = True
            raise

    def release(self) -> None:
        """Stop renewing and mark the lease released, after a renewal in flight (a slow storage) has
        landed, so that no heartbeat lands after the release."""
        if self._stop is None:
            return
        self._stop.set()
        self._stop = None
        if self._beat is not None:
            self._beat.join(timeout=max(self.timeout_s, 1.0))
            self._beat = None
        try:
            self._write(released=now())
        except Exception:  # noqa: BLE001 - an unreleased lease expires by itself; another job's is not ours
            pass


def _refuse_held(url: str, held: LeaseRecord, timeout_s: float, token: str = "") -> None:
    """Raise StoreError when ``held`` is another job's fresh lease on ``url``."""
    import time

    if not held or held.get("released") or held.get("token") == token or not _fresh(held, timeout_s):
        return
    age = time.time() - float(held.get("heartbeat", 0))
    timeout_s = lease_timeout(held, timeout_s)
    raise StoreError(
        f"store {url} is in use by another extractor job: pid {held.get('pid')} on {held.get('host')} "
        f"(user {held.get('user')}, started {held.get('started')}, last heartbeat {age:.0f} s ago). "
        f"Wait for it to finish; if it died, its lease expires {timeout_s - age:.0f} s from now "
        "(output.lease_timeout_s) and the store can then be resumed"
    )


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
