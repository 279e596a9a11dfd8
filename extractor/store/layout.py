"""The Zarr v3 store layout of one generation (:mod:`.generation`): its arrays and attributes, making them, reading
rows (a shard's writer: :mod:`.writer`).

Imports only numpy and zarr, so the reader can use it without torch.

Layout (format version 2; docs/reference/store.md), all arrays at the generation's root, row dimension ``row``::

    zarr.json           the job's record under "extractor", and every array's metadata (consolidated)
    ids      (N,)       str      image id (relative path or manifest id)
    paths    (N,)       str      where the image was read from (tar members: TAR_URL#MEMBER)
    labels   (N,)       int64    class index, -1 when none
    <locators> (N,)     the source's own per-row arrays beside paths, where it has them (``Source.locators``:
                        a tar source's byte_offset, byte_size, int64: the image's bytes inside its tar)  [rows]
    fingerprint (N,)    uint64   the source's cheap facts about those bytes (size, mtime / ETag; 0: unknown)  [rows]
    read_fingerprint (N,) uint64 a local file's facts (size, mtime, ctime, inode) as its row's worker opened it;
                        where ``fingerprint`` is 0 (a folder's or manifest's listing stats no file), the row's  [data]
    status   (N,)       uint8    0 pending, 1 ok, 2 failed  [data]
    errors   (N,)       str      why a failed row failed ("" otherwise)  [data]
    digest   (N,)       uint64   xxh3-64 of the image's bytes as its row read them (0: not read)  [data]
    shard_stats (S,)    str      JSON sums of shard s's values, merged into the "stats" attribute  [data]
    <key>    (N, ...)   float16/float32, one array per capture, NaN where not ok  [data]
    target, target_score, <gradcam key>.range   (gradient jobs) per-row target class,
                        its logit, and each Grad-CAM map's min and max  [data]
    index_parts/<key> (S, B) uint8   a write-time feature index's part of each shard  [data]
    id_index/hashes, id_index/rows   (N,) int64   the ids' hashes sorted, and the row of each (store.id_index)

Arrays marked ``[data]`` or ``[rows]`` are written shard by shard, each shard's chunks under the attempt its ledger
entry names (:mod:`.views`); the others once, when the generation is made. Per-row arrays are chunked by shard and
each capture array by its ``chunk_rows`` (which divides the shard size), so no two shards ever share an object.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict, cast

import numpy as np
import zarr
from zarr.buffer.cpu import NDBuffer

from .._text import now as now  # re-exported: the store's face lists it
from ..data import BLOCK, LocatorArray, Rows, Streamed, is_url, utf8
from ..errors import DataError, FencedError, StoreError
from ._zarr_internal import ArrayConfigParams
from .chunks import ChunkCodec, write_texts, write_whole
from .dtypes import numpy_dtype  # and zarr knows bfloat16 wherever a store opens
from .generation import TXN, read_head
from .id_index import create_id_index, write_id_index
from .ledger import Ledger, blocks_for, new_id
from .objects import Objects
from .tokens import TokenRecord
from .views import ROOT, GenerationStore, Slot, write_view

FORMAT_VERSION = 2
PENDING, OK, FAILED = 0, 1, 2
STATUS_NAMES = {PENDING: "pending", OK: "ok", FAILED: "failed"}
READ_PRINT = "read_fingerprint"  # each row's file's fingerprint as its worker read it (a local file's; 0: none)
ROW_ARRAYS = ("ids", "paths", "labels", "status", "errors", "digest", "fingerprint", READ_PRINT)
ATTR = "extractor"  # root attribute holding everything this package records
INDEX_PARTS = "index_parts"  # write-time feature indexes: each shard's part, per capture
# every chunk of a shard is written, also one of fill values only: a committed shard's chunk that is missing is a
# damaged store (inspect --verify names it), never a chunk left out on purpose
WRITE_CONFIG: ArrayConfigParams = {"write_empty_chunks": True}
# the resolved preprocessing's settings that change pixels (the ``preprocess`` record holds more: its source)
PREPROCESS_FIELDS = ("resize", "crop", "interpolation", "mean", "std", "crop_offset", "runs")


# output.shuffle: auto, for lz4, by the values' bytes: the shuffle measured best on extractor's activations
# (bench/bench_codecs.py; docs/reference/store.md "Compression"): float32 1.16-1.18x by bytes (1.00 unshuffled),
# float16 1.07x by bits (1.01 by bytes), bfloat16 1.31x by bits for less CPU than 1.30x by bytes
_Shuffle = Literal["noshuffle", "shuffle", "bitshuffle"]  # blosc's names
_LZ4_SHUFFLE: dict[int, _Shuffle] = {4: "shuffle", 2: "bitshuffle"}
_SHUFFLES: dict[str, _Shuffle] = {"byte": "shuffle", "bit": "bitshuffle", "none": "noshuffle"}


def _compressors(name: str, level: int | None, shuffle: str = "auto", itemsize: int = 4) -> Any:
    """The zarr codec of ``output.compression`` ``name`` at ``level`` (None: its default), for values of ``itemsize``
    bytes (the shuffle of ``auto``)."""
    from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

    how: _Shuffle = _SHUFFLES[shuffle] if shuffle != "auto" else \
        _LZ4_SHUFFLE.get(itemsize, "shuffle") if name == "lz4" else "bitshuffle"  # blosc's, as before
    if name == "lz4":
        return BloscCodec(cname="lz4", clevel=5 if level is None else level, shuffle=how)
    if name == "zstd":
        return ZstdCodec(level=3 if level is None else level)
    if name == "blosc":
        return BloscCodec(cname="zstd", clevel=5 if level is None else level, shuffle=how)
    if name == "gzip":
        return GzipCodec(level=5 if level is None else level)
    return None


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
    drop_prefix: NotRequired[int]  # stored patch tokens only: the count of tokens before them left out
    tokens: NotRequired[TokenRecord | None]  # a token sequence's layout (None: not known); absent in older stores
    target: NotRequired[int | str]  # gradient captures: predicted, label or a class index
    size: NotRequired[str]  # gradcam maps: layer or input resolution
    sample_tokens: NotRequired[int]  # patch tokens kept per row (their positions: the KEY.token_index array)
    prefix_kept: NotRequired[int]  # with sample_tokens: the tokens before the patches kept in front of them
    suffix_kept: NotRequired[int]  # with sample_tokens: the tokens after the patches kept after them
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
    compression: str = "lz4"  # output.compression
    compression_level: int | None = None
    shuffle: str = "auto"  # output.shuffle
    reuse: bool = False  # rows may come from other stores (output.reuse): the ``reused`` array records which
    sharded: bool = False  # each work shard of a capture one storage object (Zarr v3 sharding) of its chunks
    locators: tuple[LocatorArray, ...] = ()  # the data source's per-row arrays beside paths (its Source.locators)
    index_parts: Mapping[str, int] = field(default_factory=dict)  # write-time feature indexes: capture -> bytes of
    # a shard's part


WRITE_ROWS = 1 << 17  # a new store's per-row arrays are written this many rows (rounded to chunks) at a time
ONCE_ROWS = 1 << 16  # rows a chunk of the per-row arrays written once, when the store is made (ONCE_ARRAYS), hold
# at most (whole shards): a chunk a shard was 6-9 us of the driver's CPU a row at 10M rows, zarr's cost a chunk
ONCE_ARRAYS = ("ids", "paths", "labels")


def once_rows(shard_rows: int, n_rows: int) -> int:
    """Rows a chunk of :data:`ONCE_ARRAYS` (no shard writes them: their chunks need not be a shard's)."""
    return min(shard_rows * max(1, ONCE_ROWS // shard_rows), max(n_rows, 1))


class NamesDigest:
    """The store's digest of its ids or of its paths (``ids_digest``, ``paths_digest``: what a resume compares), made
    as they come, in order: each one's UTF-8 and a NUL, hashed (SHA-256, its first 16 hex digits)."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()

    def add(self, data: np.ndarray, ends: np.ndarray) -> None:
        """Strings given as their UTF-8 bytes ``data`` and each one's end in it."""
        self.hash.update(np.insert(data, ends, 0).tobytes())  # a NUL after each

    def add_strings(self, strings: Any) -> None:
        """Strings as Python strings (a surrogate: its byte as surrogateescape gives it)."""
        self.hash.update(("\0".join(strings) + "\0").encode("utf-8", "surrogateescape") if len(strings) else b"")

    def hexdigest(self) -> str:
        return self.hash.hexdigest()[:16]

    def add_names(self, names: Any, start: int, stop: int) -> None:
        """Strings ``start:stop`` of ``names`` (an array of strings or a Joined), a block at a time."""
        for at in range(start, stop, BLOCK):
            found = utf8(names, at, min(at + BLOCK, stop))
            if found is None:
                self.add_strings(names[at:min(at + BLOCK, stop)].tolist())
            else:
                self.add(*found)

    @classmethod
    def of(cls, names: Any) -> str:
        """The digest of ``names`` (an array of strings or a Joined), hashed a block at a time."""
        digest = cls()
        digest.add_names(names, 0, len(names))
        return digest.hexdigest()
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


def slots(arrays: StoreArrays, n_rows: int, locators: Iterable[str]) -> dict[str, Slot]:
    """The arrays whose chunks belong to shards, and the ledger's slot that names each one's attempt: what a shard
    computes (``data``) or its rows' source facts (``rows``); the others (ids, paths, labels, the id index) are
    written once, when the generation is made."""
    size = arrays.shard_size
    rows = min(size, max(n_rows, 1))  # per-row arrays: a chunk a shard (of a store smaller than one: its rows)
    per_row, per_shard = Slot("data", rows, size), Slot("data", 1, 1)
    out = dict.fromkeys(("status", "errors", "digest", READ_PRINT), per_row)
    out["shard_stats"] = per_shard
    out.update({name: Slot("rows", rows, size) for name in ("fingerprint", *locators)})
    out.update(dict.fromkeys(arrays.extras, per_row))
    if arrays.reuse:
        out["reused"] = per_row
    for key in arrays.captures:  # sharded: a work shard's chunks are one object; else chunks of chunk_rows
        out[key] = Slot("data", size if arrays.sharded else min(arrays.chunk_rows[key], max(n_rows, 1)), size)
    for key in arrays.index_parts:
        out[f"{INDEX_PARTS}/{key}"] = per_shard
    return out


def create_generation(objects: Objects, name: str, rows: Rows | Streamed, arrays: StoreArrays, attrs: Mapping[str, Any],
                      committed: bool = False) -> GenerationStore:
    """Write generation ``name`` of the store under ``objects`` whole (:func:`start_generation`, then its rows
    written here: :meth:`RowsBehind.write`). Returns the view that wrote it (its attempts: ``rows``, and ``data``
    where ``committed``)."""
    behind = start_generation(objects, name, rows, arrays, attrs, committed)
    behind.write()
    return behind.store


def start_generation(objects: Objects, name: str, rows: Rows | Streamed, arrays: StoreArrays, attrs: Mapping[str, Any],
                     committed: bool = False) -> RowsBehind:
    """Make generation ``name`` of the store under ``objects`` (its head names it already: no one reads it until
    its root is written) but for its rows: its arrays, its ledger (every shard pending; ``committed``: every shard
    held by one attempt, committed at once, for a store written without a job), then its root with the job's record
    (``rows_written`` false) and every array's metadata in one object. Its per-row arrays, id index and digests are
    written by the :class:`RowsBehind` returned, in row order, while the first shards run (issue 57); until then the
    generation is not made (:meth:`.generation.Generation.made`): a driver stopped before leaves it half-made."""
    n_shards = -(-len(rows) // arrays.shard_size)
    attrs = {**attrs, "format_version": FORMAT_VERSION, "n_rows": len(rows), "n_shards": n_shards,
             "shard_size": arrays.shard_size, "ledger_blocks": blocks_for(n_shards), "rows_written": False}
    locators = [locator.name for locator in arrays.locators]
    attempts = {"rows": new_id(), **({"data": new_id()} if committed else {})}
    store = write_view(objects.zarr_store(name, read_only=False), attempts,
                       slots=slots(arrays, len(rows), locators), url=objects.url, hold_root=True)
    with _storage_errors(objects.url), zarr.config.set({"array.write_empty_chunks": True}):
        group = zarr.open_group(store=store, mode="a", use_consolidated=False)
        columns = _create_arrays(group, rows, arrays, attrs)
        Ledger(objects, f"{name}/{TXN}/ledger", n_shards, int(attrs["ledger_blocks"]), name).create(
            attempts["rows"], attempts.get("data", 0))
        _consolidate(store)
        store.release_root()  # the generation is made, but for its rows
    return RowsBehind(objects, name, store, group, rows, columns, arrays.shard_size, attrs.get("ids_digest"))


def rewrite_rows(objects: Objects, name: str, rows: Rows, attempt: int,
                 locators: tuple[LocatorArray, ...]) -> RowsBehind:
    """Generation ``name``, left half-made (its rows not all written: its maker stopped, and wrote nothing since),
    its rows written again from ``rows`` (their listing now, checked against the rows its committed shards
    computed) behind its shards: every per-row array, the id index and the record's digests, as
    :func:`start_generation` would, the ``rows`` slot's under ``attempt`` (the ledger's for every shard, named when
    the generation was made)."""
    store = write_view(objects.zarr_store(name, read_only=False), {"rows": attempt}, url=objects.url)
    with _storage_errors(objects.url):
        group = zarr.open_group(store=store, mode="r+", use_consolidated=False)  # (its slots learnt from the root)
        attrs = root_attrs(group)
        unmade = [key for key in ("ids", "paths") if attrs.get(f"{key}_digest", "") is None]
        shard_rows, once = (int(get_array(group, key).chunks[0]) for key in ("status", "ids"))
        columns = _create_row_arrays(group, shard_rows, rows, locators, unmade, once=once)
    return RowsBehind(objects, name, store, group, rows, columns, int(attrs["shard_size"]), attrs.get("ids_digest"))


@contextlib.contextmanager
def _storage_errors(url: str) -> Iterator[None]:
    try:
        yield
    except (OSError, ValueError):  # a storage error (the head's swap showed the place writable: a disk full...), or
        raise  # rows that lack what their source declares
    except Exception as err:  # what an object store's client raises otherwise (credentials, a bucket gone)
        raise StoreError(f"cannot create the store at output.store {url}: {type(err).__name__}: "
                         f"{str(err).rstrip('.')}; check output.store and output.storage_options") from err


def _consolidate(store: GenerationStore) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # consolidated metadata "not part of the Zarr v3 specification" (yet)
        zarr.consolidate_metadata(store, path=None)


class RowsBehind:
    """A new generation's rows written behind its making (:func:`start_generation`): its per-row arrays a stretch of
    whole chunks at a time in row order, each shard handed out once its rows are in the store (:meth:`ready`,
    :meth:`wait`: the driver's queue of shards and Ray's schedule ask); then its id index, and its root's record
    with the ids' and paths' digests and ``rows_written`` (the generation made). :meth:`write` runs in a thread
    of the driver; an error there is raised to whoever asks after, as a :class:`StoreError` naming it."""

    def __init__(self, objects: Objects, name: str, store: GenerationStore, group: zarr.Group, rows: Rows | Streamed,
                 columns: _RowArrays, shard_size: int, ids_digest: str | None) -> None:
        self.objects, self.name, self.store, self.group = objects, name, store, group
        self.rows: Rows | Streamed | None = rows  # let go once written
        self.columns, self.shard_size, self.ids_digest, self.n = columns, shard_size, ids_digest, len(rows)
        self.written = 0  # rows whose arrays are in the store
        self.made = False
        self.error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()

    @property
    def listing(self) -> bool:
        """Whether its rows are still being listed (a listing streamed: :class:`~extractor.data.Streamed`)."""
        rows = self.rows
        return isinstance(rows, Streamed) and not rows.done

    @property
    def stretches(self) -> int:
        """The stretches of rows :meth:`write` writes one after another."""
        return max(1, -(-self.n // self.columns.step))

    def write(self) -> None:
        """Write every row, then the id index and the root's record (raises what stopped it)."""
        n, rows = self.n, self.rows
        assert rows is not None, "written once"
        try:
            with _storage_errors(self.objects.url), zarr.config.set({"array.write_empty_chunks": True}):
                for start in range(0, n, self.columns.step):
                    self._go_on()
                    stop = min(start + self.columns.step, n)
                    self.columns.write(start, stop, rows.upto(stop))  # (a listing streamed: once they are listed)
                    self._advance(stop)
                whole = rows.whole()  # (streamed: its ids checked at its end, its record made)
                digests = self.columns.digests()
                write_id_index(self.group, whole.ids, digests.get("ids_digest", self.ids_digest), self._go_on)
                _consolidate(self.store)  # the id index's record beside the others' metadata
                self._go_on()
                listed = {"listing": whole.listing} if isinstance(rows, Streamed) and whole.listing else {}
                self._record({**digests, **listed, "rows_written": True})
        except BaseException as err:
            self.stop()  # (a listing streamed stops too: no one takes its rows now)
            with self._cond:
                self.error = err
                self._cond.notify_all()
            raise
        finally:
            self.rows, self.columns.columns = None, []  # the listing (spilled to the local disk) let go
        with self._cond:
            self.made = True
            self._cond.notify_all()

    def _go_on(self) -> None:
        """Raise where the job stopped writing (:meth:`stop`), or the store was made again by another job (a driver
        paused past its lease: its generation is another's garbage now)."""
        if self._stop:
            raise StoreError(f"the rows of {self.objects.url} were not all written: its job stopped")
        head = read_head(self.objects)
        if head is None or head.generation != self.name:  # (this job's claim is lost: said as the claimant says it)
            raise FencedError(f"{self.objects.url} was made again by another job while this one wrote its rows; "
                              "this job stops. Look at the store with `extractor inspect`")

    def _advance(self, rows: int) -> None:
        with self._cond:
            self.written = rows
            self._cond.notify_all()

    def _record(self, more: Mapping[str, Any]) -> None:
        """The root's record with ``more`` (one write: its metadata and consolidated metadata as they are)."""
        key = f"{self.name}/{ROOT}"
        while True:  # (a swap: a write of the root between the read and the write is read again, never lost)
            data, version = self.objects.read(key)
            if data is None:
                raise StoreError(f"{self.objects.url}: the root of generation {self.name} is gone (made again)")
            root = json.loads(data)
            root.setdefault("attributes", {}).setdefault(ATTR, {}).update(more)
            if self.objects.swap(key, version, json.dumps(root).encode()):
                return

    def ready(self, shard: int) -> bool:
        """Whether ``shard``'s rows are in the store (raises the writer's error)."""
        with self._cond:
            self._raise()
            return self._ready(shard)

    def wait(self, shard: int) -> None:
        """Until ``shard``'s rows are in the store (raises the writer's error)."""
        with self._cond:
            while not self._ready(shard):
                self._cond.wait()
            self._raise()

    def _ready(self, shard: int) -> bool:
        return self.error is not None or self.made or self.written >= min((shard + 1) * self.shard_size, self.n)

    def _raise(self) -> None:
        if isinstance(self.error, (FencedError, DataError)):  # (DataError: its listing's, streamed: a duplicate id)
            raise self.error
        if self.error is not None:
            err = self.error
            raise StoreError(f"the rows of store {self.objects.url} could not be written: {type(err).__name__}: "
                             f"{str(err).rstrip('.')}") from err

    def stop(self) -> None:
        """Stop writing after the stretch being written (the generation stays half-made), and the listing streamed."""
        with self._cond:
            self._stop = True
            rows = self.rows
        if isinstance(rows, Streamed):
            rows.stop()


def _create_arrays(group: zarr.Group, rows: Rows | Streamed, arrays: StoreArrays,
                   attrs: Mapping[str, Any]) -> _RowArrays:
    """The arrays of a new generation and its attributes; its per-row arrays to write (:class:`_RowArrays`)."""
    n = len(rows)
    shard_size, captures, extras = arrays.shard_size, arrays.captures, arrays.extras
    n_shards = -(-n // shard_size)
    shard_rows = min(shard_size, max(n, 1))  # per-row arrays: one chunk per shard
    unmade = [name for name in ("ids", "paths") if f"{name}_digest" in attrs and attrs[f"{name}_digest"] is None]
    columns = _create_row_arrays(group, shard_rows, rows, arrays.locators, unmade)
    create_id_index(group, n)
    group.create_array("shard_stats", shape=(n_shards,), dtype=str, chunks=(1,), fill_value="",
                       dimension_names=["shard"])
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
            compressors=_compressors(arrays.compression, arrays.compression_level, arrays.shuffle,
                                     numpy_dtype(meta["dtype"]).itemsize),
            dimension_names=["row", *meta["dims"]],
            attributes={"extractor": dict(meta), "coordinates": "ids labels"},
        )
    for key, size in arrays.index_parts.items():  # a write-time index's part of each shard, merged at the end
        group.create_array(f"{INDEX_PARTS}/{key}", shape=(n_shards, size), dtype="uint8", chunks=(1, size),
                           fill_value=0, dimension_names=["shard", "part_byte"])
    group.attrs.update({ATTR: dict(attrs)})
    return columns


def _create_row_arrays(group: zarr.Group, shard_rows: int, rows: Rows | Streamed, locators: tuple[LocatorArray, ...],
                       digests: Iterable[str] = (), once: int | None = None) -> _RowArrays:
    """The per-row arrays (``ROW_ARRAYS``, and the source's ``locators``, their columns from ``rows``) made, in
    chunks of ``shard_rows`` (those written once, :data:`ONCE_ARRAYS`: of whole shards up to :data:`ONCE_ROWS`);
    what is known of them before any image is read to write (:class:`_RowArrays`), with the record's digests of
    the string arrays ``digests`` (``ids``, ``paths``). ``once``: the arrays are there already (made with
    :data:`ONCE_ARRAYS` in chunks of ``once`` rows), to write again."""
    made = _RowArrays(group, shard_rows, len(rows), digests, once)
    made.add("ids", str, "", lambda r: r.ids)
    made.add("paths", str, "", lambda r: r.paths)
    made.add("labels", "int64", -1, lambda r: r.labels)
    for locator in locators:  # where the source finds each image's bytes, beside its path
        if locator.name not in rows.locator_names:
            raise ValueError(f"the rows carry no {locator.name!r} column, which their source declares")
        made.add(locator.name, locator.dtype, locator.fill, functools.partial(_locator, name=locator.name))
    made.add("status", "uint8", PENDING)
    made.add("errors", str, "")
    made.add("digest", "uint64", 0)  # written with each shard's status
    made.add(READ_PRINT, "uint64", 0)  # (written with each shard's status too)
    made.add("fingerprint", "uint64", 0, _fingerprints)
    return made


def _locator(rows: Rows, name: str) -> np.ndarray:
    return rows.locators[name]


def _fingerprints(rows: Rows) -> Any:
    """The rows' fingerprints as listed; 0 (unknown) where the listing stats no file (a folder's, a manifest's:
    their workers fingerprint the files they read)."""
    return rows.fingerprints if rows.fingerprints is not None else np.broadcast_to(np.uint64(0), (len(rows),))


class _RowArrays:
    """A new generation's per-row arrays, made, and the columns known before any image is read, written a stretch
    of whole chunks at a time (:meth:`write`; the paths of a Joined made a stretch at a time); the digests of
    those named (:meth:`digests`) made from the UTF-8 written (the bytes made once, not once more for them)."""

    def __init__(self, group: zarr.Group, shard_rows: int, n: int, digests: Iterable[str],
                 once: int | None = None) -> None:
        self.group, self.shard_rows, self.n, self.named = group, shard_rows, n, set(digests)
        self.made = once is not None  # the arrays are there: written again
        self.once = once if once is not None else once_rows(shard_rows, n)
        self.step = self.once * max(1, WRITE_ROWS // self.once)  # whole chunks of every array (shard_rows | once)
        self.columns: list[tuple[str, zarr.Array, ChunkCodec | None, Callable[[Rows], Any]]] = []
        self.hashes: dict[str, NamesDigest] = {}

    def add(self, name: str, dtype: Any, fill: Any, data: Callable[[Rows], Any] | None = None) -> None:
        """Array ``name`` made; ``data``: its column of the rows, written here, every chunk of it (one of fill values
        too: each object the store was made with is there, so that a missing one is a damaged store)."""
        chunk = self.once if name in ONCE_ARRAYS else self.shard_rows
        arr = get_array(self.group, name) if self.made else \
            self.group.create_array(name, shape=(self.n,), dtype=dtype, chunks=(chunk,), fill_value=fill,
                                    dimension_names=["row"])
        if self.made and (arr.shape, int(arr.chunks[0])) != ((self.n,), chunk):
            raise StoreError(f"the store's {name!r} array is {arr.shape[0]} rows in chunks of {arr.chunks[0]}, not "
                             f"{self.n} in chunks of {chunk}: its rows cannot be written again; --overwrite")
        if data is not None:
            self.columns.append((name, arr, ChunkCodec.of(arr), data))
        if name in self.named:
            self.hashes[name] = NamesDigest()

    def write(self, start: int, stop: int, rows: Rows) -> None:
        """Rows ``start:stop`` (whole chunks of every array, but the last) of every column, from ``rows`` (those listed
        so far, at least ``stop`` of them)."""
        for name, arr, codec, column in self.columns:
            data, chunk = column(rows), int(arr.chunks[0])
            if arr.dtype.kind in "TUO":  # strings: each chunk encoded from their UTF-8, made in bulk
                digest = self.hashes.get(name)
                if not write_texts(arr, codec, start, data, stop, digest.add if digest is not None else None) \
                        and digest is not None:  # (through zarr: it saw none of them)
                    digest.add_names(data, start, stop)
            else:  # whole chunks encoded here and put at once (through zarr: 0.6 ms a chunk), one of the fill value
                # alone too (zarr leaves it out: labels of a source without any, a rows slot's URLs' fingerprints)
                blocks = ((a, np.asarray(data[a:min(a + chunk, stop)])) for a in range(start, stop, chunk))
                write_whole([(arr, codec, a, block) for a, block in blocks])

    def digests(self) -> dict[str, str]:
        """The record's digests of the columns named (once every row is written)."""
        return {f"{name}_digest": digest.hexdigest() for name, digest in self.hashes.items()}


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


def disk_usage(url: str) -> int | None:
    """Bytes on disk of a local store (None for remote stores)."""
    if is_url(url):
        return None
    total = 0
    for dirpath, _dirs, files in os.walk(url.removeprefix("file://")):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, f))
    return total

