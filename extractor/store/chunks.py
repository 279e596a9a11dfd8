"""Whole chunks of several arrays written in one step, for the writer threads.

zarr's ``array[a:b] = x`` costs about 1.5 ms of Python and thread hand-offs per chunk (zarr 3.1,
measured on a 2-core machine: a 16 KB chunk compresses in 0.04 ms). A job with several small
captures writes one chunk of each per batch, so that cost, not compression, set its speed.
Here a chunk is encoded by the same numcodecs codec, with the settings zarr recorded in the
array's metadata, and the chunks of every array are put in the store together, in one round of
zarr's event loop. What lands is byte for byte what zarr writes (``tests/store/test_chunks.py``).

Arrays with codecs other than those extractor creates (bytes, then zstd, blosc, gzip or none),
chunks that do not span an array's trailing dimensions, and a partial last chunk go through zarr.

A sharded array (Zarr v3's sharding codec: one storage object per work shard, small inner chunks
for random reads, the index at the end) is written as a stream: each inner chunk is encoded and
appended to the shard's object as it fills (:class:`ShardStream`), in any order, and the index
(offsets and sizes, crc32c) is written last, when the work shard finishes. Host memory holds no
more than the chunks being encoded; on a local disk the object is written in place (its name is
its attempt's alone, and no one reads it before the attempt is committed), elsewhere it is one
streamed upload.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numcodecs
import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, ShardingCodec, ZstdCodec
from zarr.codecs.vlen_utf8 import VLenUTF8Codec

from ._zarr_internal import sync
from .dtypes import is_bfloat16

_sync: Callable[..., Any] | None = sync  # zarr's event loop (None: chunks go through zarr)

__all__ = [
    "ChunkCodec",
    "ShardStream",
    "Where",
    "array_objects",
    "physical_key",
    "read_all",
    "read_at_once",
    "read_whole",
    "vlen_utf8",
    "write_at_once",
    "write_chunks",
    "write_texts",
    "write_whole",
]

EMPTY = np.uint64(2**64 - 1)  # a shard index's offset and size of an inner chunk that is absent
_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}


def _compressor(codec: Any) -> Callable[[Any], Any] | None:
    """The numcodecs ``encode`` that zarr's ``codec`` runs (None: one this module does not know)."""
    if isinstance(codec, ZstdCodec):
        return numcodecs.Zstd(level=codec.level, checksum=codec.checksum).encode
    if isinstance(codec, BloscCodec) and codec.typesize is not None:
        return numcodecs.Blosc(cname=codec.cname.name, clevel=codec.clevel, shuffle=_SHUFFLE[codec.shuffle.name],
                               blocksize=codec.blocksize, typesize=codec.typesize).encode
    if isinstance(codec, GzipCodec):
        return numcodecs.GZip(level=codec.level).encode
    return None


def _decompressor(codec: Any) -> Callable[[Any], Any] | None:
    """The numcodecs ``decode`` undoing zarr's ``codec`` (None: one this module does not know)."""
    if isinstance(codec, ZstdCodec):
        return numcodecs.Zstd().decode
    if isinstance(codec, BloscCodec):
        return numcodecs.Blosc().decode
    if isinstance(codec, GzipCodec):
        return numcodecs.GZip().decode
    return None


_Encoding = tuple[np.dtype[Any], np.dtype[Any], list[Callable[[Any], Any]]]


def _encoding(array: zarr.Array, codecs: list[Any]) -> _Encoding | None:
    """The dtype (with its byte order), the dtype its bytes are handed on as, and the encoding steps of a chunk's
    codecs ``codecs`` (bytes, or vlen-utf8 for strings, then compressors this module knows), or None."""
    if not codecs:
        return None
    first, *rest = codecs
    compressors = [_compressor(c) for c in rest]
    if any(c is None for c in compressors):
        return None
    known = [c for c in compressors if c is not None]
    dtype = np.dtype(array.dtype)
    if isinstance(first, VLenUTF8Codec):  # strings (a shard's errors, its statistics): each one's UTF-8, then those
        return (np.dtype(object), np.dtype(object), [numcodecs.VLenUTF8().encode, *known]) if dtype.kind in "TUO" \
            else None
    if not isinstance(first, BytesCodec):
        return None
    return _numbers(dtype, first, known)


def _numbers(dtype: np.dtype[Any], first: BytesCodec, known: list[Callable[[Any], Any]]) -> _Encoding | None:
    """The encoding of numbers by the bytes codec ``first`` then the compressors ``known`` (None: not numbers)."""
    if not (dtype.kind in "biuf" or is_bfloat16(dtype)):
        return None
    little = first.endian is None or first.endian.value == "little"
    if is_bfloat16(dtype):  # its bits as uint16 (ml_dtypes' arrays export no buffer): little-endian ones only
        return (dtype, np.dtype("<u2"), known) if little else None
    if first.endian is not None:
        dtype = dtype.newbyteorder("<" if little else ">")
    return dtype, dtype, known


def _inner_codecs(array: zarr.Array, codecs: list[Any]) -> list[Any] | None:
    """A sharded array's inner chunk codecs, when its shards are the ones this module writes: the index at the
    end, little-endian with crc32c, shards spanning the trailing dimensions (else None: zarr writes it)."""
    sharding = codecs[0]
    index = list(sharding.index_codecs)
    if len(codecs) != 1 or sharding.index_location.value != "end" or len(index) != 2:
        return None
    little = isinstance(index[0], BytesCodec) and index[0].endian is not None and index[0].endian.value == "little"
    if not little or not isinstance(index[1], Crc32cCodec):
        return None
    if tuple(array.shards[1:]) != tuple(array.shape[1:]):  # type: ignore[index]
        return None
    return list(sharding.codecs)


class ChunkCodec:
    """How zarr encodes a whole chunk of one array, and where that chunk lives in its store. Of a sharded
    array: its inner chunks (``rows`` each), ``shard_rows`` to a storage object."""

    def __init__(self, array: zarr.Array, dtype: np.dtype[Any], bits: np.dtype[Any],
                 compressors: list[Callable[[Any], Any]], shard_rows: int | None = None) -> None:
        self.array, self.dtype, self.bits, self.compressors = array, dtype, bits, compressors
        self.rows = array.chunks[0]
        self.shard_rows = shard_rows
        self.trailing = (0,) * (array.ndim - 1)

    @classmethod
    def of(cls, array: zarr.Array) -> ChunkCodec | None:
        """The codec of ``array``, or None when its chunks must go through zarr."""
        meta = array.metadata
        if _sync is None or meta.zarr_format != 3 or not array.path:
            return None
        codecs, shard_rows = list(meta.codecs), None
        if codecs and isinstance(codecs[0], ShardingCodec):
            inner = _inner_codecs(array, codecs)
            if inner is None:
                return None
            codecs, shard_rows = inner, int(array.shards[0])  # type: ignore[index]
        if tuple(array.chunks[1:]) != tuple(array.shape[1:]):
            return None
        encoding = _encoding(array, codecs)
        return None if encoding is None else cls(array, *encoding, shard_rows)

    def key(self, start: int) -> str:
        """The store key of the chunk that begins at row ``start`` (of a sharded array: of its shard)."""
        step = self.shard_rows or self.rows
        return f"{self.array.path}/{self.array.metadata.encode_chunk_key((start // step, *self.trailing))}"

    def padded(self, data: np.ndarray) -> np.ndarray:
        """A last inner chunk filled to the chunk's rows with the array's fill value (as zarr stores edge chunks)."""
        if len(data) == self.rows:
            return data
        out = np.full((self.rows, *data.shape[1:]), self.array.fill_value, dtype=data.dtype)
        out[: len(data)] = data
        return out

    def encode(self, data: np.ndarray) -> Any:
        """A whole chunk's bytes, as zarr stores them."""
        out: Any = np.ascontiguousarray(data, dtype=self.dtype).view(self.bits)
        for compress in self.compressors:
            out = compress(out)
        return out

    def encode_utf8(self, data: np.ndarray, ends: np.ndarray) -> Any:
        """A whole chunk of a string array as zarr stores it, from its strings' UTF-8 one after another and where
        each ends (a last chunk: padded with empty strings, the fill value): vlen-utf8 made in bulk, then the
        compressors."""
        assert self.bits.kind == "O", "not a string array"
        out: Any = vlen_utf8(data, ends, self.rows)
        for compress in self.compressors[1:]:
            out = compress(out)
        return out


def vlen_utf8(data: np.ndarray, ends: np.ndarray, rows: int) -> np.ndarray:
    """numcodecs' VLenUTF8 of ``rows`` strings given as their UTF-8 and ends (those past ``len(ends)``: empty): their
    count, then each one's length (uint32, little-endian) and bytes."""
    n = len(ends)
    lengths = np.zeros(rows, dtype="<u4")
    lengths[:n] = np.diff(ends, prepend=0)
    starts = np.asarray(ends, dtype=np.int64) - lengths[:n]
    body = np.insert(np.asarray(data, dtype=np.uint8), np.repeat(starts, 4), lengths[:n].view(np.uint8))
    return np.concatenate([np.asarray([rows], dtype="<u4").view(np.uint8), body, lengths[n:].view(np.uint8)])


def write_chunks(start: int, chunks: Mapping[str, tuple[zarr.Array, ChunkCodec | None, np.ndarray]],
                 streams: Mapping[str, ShardStream] | None = None) -> int:
    """Write rows ``start ...`` of each array (the data begins a chunk of every one); bytes written.
    Whole chunks of arrays with a known codec go to the store in one event-loop round; an inner chunk of a
    sharded array is appended to its shard's stream (``streams``, by key); others through zarr, one by one."""
    puts: list[tuple[Any, str, Any]] = []
    for key, (array, codec, data) in chunks.items():
        if codec is not None and codec.shard_rows is not None:  # of a sharded array: its shard's stream, or zarr
            if streams is not None and key in streams:
                streams[key].add((start % codec.shard_rows) // codec.rows, codec.encode(codec.padded(data)))
            else:
                array[start : start + len(data)] = data
        elif codec is not None and start % codec.rows == 0 and len(data) == codec.rows:
            puts.append((array.store, codec.key(start), codec.encode(data)))
        else:
            array[start : start + len(data)] = data
    _put_all(puts)
    return sum(data.nbytes for _, _, data in chunks.values())


def write_at_once(writes: list[tuple[zarr.Array, Any, Any]]) -> None:
    """``array[selection] = value`` for each of ``writes``, all in one round of zarr's event loop (a shard's
    finishing writes: one after the other they were 0.5 ms each locally, a round trip each on an object store)."""
    if not writes:
        return
    if _sync is None:  # pragma: no cover - a zarr that moved it
        for array, selection, value in writes:
            array[selection] = value
        return

    async def set_all() -> None:
        await asyncio.gather(*(array.async_array.setitem(selection, value) for array, selection, value in writes))

    _sync(set_all())


def write_whole(writes: list[tuple[zarr.Array, ChunkCodec | None, int, np.ndarray]]) -> None:
    """Rows ``start ...`` of each array of ``writes`` (array, its codec, start, rows): a shard's finishing writes.
    Rows that make one whole chunk of an array with a known codec (the last chunk of an array padded, as zarr
    stores it) are encoded here and put as objects, all in one round of zarr's event loop (through zarr each
    cost a metadata walk and a thread hand-off); the others go through zarr."""
    puts: list[tuple[Any, str, Any]] = []
    through: list[tuple[zarr.Array, Any, Any]] = []
    for array, codec, start, data in writes:
        encoded = _whole(codec, start, data)
        if encoded is None:
            through.append((array, slice(start, start + len(data)), data))
        else:
            puts.append((array.store, codec.key(start), encoded))  # type: ignore[union-attr]  # it has a codec
    write_at_once(through)  # rarely any
    _put_all(puts)


def _whole(codec: ChunkCodec | None, start: int, data: np.ndarray) -> Any:
    """The encoded chunk that rows ``start ...`` (``data``) make whole, or None (zarr writes them)."""
    if codec is None or codec.shard_rows is not None or start % codec.rows:
        return None
    if len(data) != codec.rows and start + len(data) != codec.array.shape[0]:
        return None
    return codec.encode(codec.padded(data))


def write_texts(array: zarr.Array, codec: ChunkCodec | None, start: int, strings: Any, stop: int,
                seen: Callable[[np.ndarray, np.ndarray], None] | None = None) -> bool:
    """Rows ``start:stop`` of a new string array from ``strings`` (a Texts, a Joined...): each whole chunk (the last
    padded) encoded from its strings' UTF-8 made in bulk and put with the others at once; through zarr where a
    string's bytes are not plain UTF-8 (a surrogate) or the array's codecs are not those this module writes.
    ``seen(data, ends)``: given each chunk's UTF-8, in order, once every chunk's is made (the store's digest of its
    ids and paths, made from the same bytes). Whether it was (False: the strings went through zarr, and ``seen`` was
    given none of them)."""
    from ..data import utf8

    if codec is None or codec.shard_rows is not None or start % codec.rows or array.fill_value != "" or \
            ((stop - start) % codec.rows and stop != array.shape[0]) or not _vlen_checked():
        array[start:stop] = strings[start:stop]
        return False
    puts, made = [], []
    for at in range(start, stop, codec.rows):
        found = utf8(strings, at, min(at + codec.rows, stop))
        if found is None:
            array[start:stop] = strings[start:stop]
            return False
        made.append(found)
        if found[1].any():  # a chunk of empty strings (the fill value) is not stored, as zarr leaves it
            puts.append((array.store, codec.key(at), codec.encode_utf8(*found)))
    _put_all(puts)
    if seen is not None:
        for found in made:
            seen(*found)
    return True


_VLEN_SAME: list[bool] = []  # once a process: vlen_utf8 gives numcodecs' bytes (else strings go through zarr)


def _vlen_checked() -> bool:
    """Whether :func:`vlen_utf8` encodes as numcodecs does, checked once against numcodecs itself (a numcodecs
    that changed its format: the strings go through zarr, with a warning)."""
    if not _VLEN_SAME:
        items = ["", "a", "ünï", "x" * 300]
        encoded = [t.encode() for t in items]
        ours = vlen_utf8(np.frombuffer(b"".join(encoded), np.uint8), np.cumsum([len(e) for e in encoded]), 6)
        same = bytes(ours) == bytes(numcodecs.VLenUTF8().encode(np.asarray([*items, "", ""], dtype=object)))
        if not same:
            import logging

            logging.getLogger(__name__).warning("numcodecs' vlen-utf8 differs from extractor's: strings are written "
                                                "through zarr")
        _VLEN_SAME.append(same)
    return _VLEN_SAME[0]


def _put_all(puts: list[tuple[Any, str, Any]]) -> None:
    """Objects (store, key, bytes) put whole, in one round of zarr's event loop."""
    if not puts:
        return
    buffer = default_buffer_prototype().buffer

    async def put_all() -> None:
        await asyncio.gather(*(store.set(key, buffer.from_bytes(value)) for store, key, value in puts))

    assert _sync is not None  # ChunkCodec.of gives no codec without it
    _sync(put_all())


def read_at_once(reads: list[tuple[zarr.Array, Any]]) -> list[np.ndarray]:
    """``array[selection]`` for each of ``reads``, all in one round of zarr's event loop (a shard's opening
    reads)."""
    if _sync is None:  # pragma: no cover - a zarr that moved it
        return [np.asarray(array[selection]) for array, selection in reads]

    async def get_all() -> list[Any]:
        return list(await asyncio.gather(*(array.async_array.getitem(selection) for array, selection in reads)))

    return [np.asarray(v) for v in _sync(get_all())]


def read_whole(array: zarr.Array, start: int = 0, stop: int | None = None, as_read: bool = False) -> np.ndarray | None:
    """Rows ``start:stop`` of a local store's 1-D array of numbers or strings (a per-row or per-shard array: a chunk a
    work shard), each chunk's file read and decoded here: through zarr each chunk cost about 0.5 ms of CPU, so a
    resume read the done markers, row status and paths of 10M rows (10,000 objects each) in seconds. None where
    zarr reads it (a remote store, a sharded array, codecs this module does not know, bfloat16); a chunk that was
    never written is the fill value. ``as_read``: strings as Python strings (an object array), not the array's
    numpy strings."""
    found = _chunk_reader(array)
    if found is None:
        return None
    codec, decode, root = found
    n, rows = array.shape[0], codec.rows
    start, stop = max(0, start), min(n, n if stop is None else stop)
    out = np.full(max(0, stop - start), array.fill_value, dtype=codec.dtype)
    for at in range(start - start % rows, stop, rows):
        key = codec.key(at)
        where = physical_key(array.store, key)
        if where is None:  # a shard not committed: fill values
            continue
        try:
            with open(os.path.join(root, *where.split("/")), "rb") as f:
                chunk = decode(f.read())
        except FileNotFoundError:
            missing = getattr(array.store, "missing", None)
            if where != key and missing is not None:  # a committed shard's: the store made again since it was
                missing(where)  # opened is an error; else fill values
            continue
        a, b = max(at, start), min(at + rows, stop)
        out[a - start:b - start] = chunk[a - at:b - at]
    return out if as_read else out.astype(array.dtype, copy=False)


def read_all(array: zarr.Array, start: int = 0, stop: int | None = None, as_read: bool = False) -> np.ndarray:
    """Rows ``start:stop`` of ``array``: a local store's per-row or per-shard numbers or strings read a file a chunk
    (:func:`read_whole`; ``as_read``: its strings left Python strings), anything else through zarr."""
    whole = read_whole(array, start, stop, as_read)
    return np.asarray(array[start:stop]) if whole is None else whole


def _chunk_reader(array: zarr.Array) -> tuple[ChunkCodec, Callable[[bytes], np.ndarray], str] | None:
    """For :func:`read_whole`: the array's codec, a chunk file's bytes to its rows, the store's folder; None: zarr
    reads it."""
    local = array.store
    while isinstance(local, zarr.storage.WrapperStore):  # a generation's view (its keys mapped by physical_key),
        local = local._store  # the reader's snapshot store: a chunk is one whole read
    codec = ChunkCodec.of(array) if array.ndim == 1 and isinstance(local, zarr.storage.LocalStore) else None
    text = codec is not None and codec.dtype == np.dtype(object)  # UTF-8 strings
    plain = codec is not None and codec.shard_rows is None and (codec.dtype.kind in "biuf" or text)
    if codec is None or not plain or codec.bits != codec.dtype:
        return None
    steps = [_decompressor(c) for c in list(getattr(array.metadata, "codecs", ()))[1:]]  # (v3: ChunkCodec.of)
    if any(step is None for step in steps):
        return None
    dtype = codec.dtype

    def decode(data: Any) -> np.ndarray:
        for step in reversed(steps):
            data = step(data)
        return numcodecs.VLenUTF8().decode(data) if text else np.frombuffer(data, dtype=dtype)

    return codec, decode, str(local.root)  # type: ignore[attr-defined]  # a LocalStore's folder


def physical_key(store: Any, key: str) -> str | None:
    """Where ``key`` of ``store`` lies in the objects below it: a generation's view maps a shard's chunk to its
    attempt's name (:mod:`.views`; None: a shard not committed, read as fill values); other stores keep the key."""
    resolve = getattr(store, "physical_sync", None)
    return resolve(key) if resolve is not None else key


@dataclass(frozen=True)
class Where:
    """Where an object of an array lies, and whether it is there."""

    key: str  # in the store's objects (a generation's view maps a shard's chunk to its attempt's name)
    exists: bool


def array_objects(array: zarr.Array) -> Iterator[tuple[str, Where, slice]]:
    """Each object of ``array`` along its first dimension (a chunk, or a sharded array's shard): its key, where it
    lies and whether it is there, and the rows it holds; those of shards not committed (read as fill values) left
    out. Arrays whose chunks split their trailing dimensions: their first object of each row only."""
    store = array.store
    while not hasattr(store, "physical_sync") and isinstance(store, zarr.storage.WrapperStore):
        store = store._store  # down to the generation's view, whose keys name objects of the store below it
    inner = store._store if isinstance(store, zarr.storage.WrapperStore) else store
    if array.ndim == 0:
        return
    step = int((getattr(array, "shards", None) or array.chunks)[0])
    trailing = (0,) * (array.ndim - 1)
    n = int(array.shape[0])
    for i in range(-(-n // max(step, 1))):
        key = f"{array.path}/{array.metadata.encode_chunk_key((i, *trailing))}"
        where = physical_key(store, key)
        if where is None:
            continue
        assert _sync is not None
        yield key, Where(where, bool(_sync(inner.exists(where)))), slice(i * step, min((i + 1) * step, n))


class ShardStream:
    """One work shard's storage object of a sharded array, written as its inner chunks come (in any order,
    from several threads): written at reserved offsets of its file (a local store; the threads write at once),
    appended to one streamed upload (an fsspec store: ``url`` and ``storage_options`` open it), or, for other
    stores, kept and put whole at the end. The index (offset and size of each of ``n_chunks`` inner chunks,
    crc32c) is written last. The object's name is its attempt's alone (``store``: the attempt's view): no one
    reads it before the attempt is committed, and two attempts at one shard never write into one object.
    :meth:`abort` leaves nothing behind where it can (what it cannot remove is garbage of an attempt no one
    names)."""

    def __init__(self, codec: ChunkCodec, start: int, store: Any, url: str,
                 storage_options: Mapping[str, Any] | None) -> None:
        assert codec.shard_rows is not None
        self.n_chunks = codec.shard_rows // codec.rows
        self.key = codec.key(start)
        self.store = store
        where = physical_key(store, self.key)
        assert where is not None  # a writer's view maps every key it writes
        self.where = where
        self.index = np.full((self.n_chunks, 2), EMPTY, dtype="<u8")
        self.at = 0
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.file: Any = None
        self.parts: list[bytes] | None = None
        root = getattr(store, "root", None)
        if root is not None:  # a local folder: the object written in place, at reserved offsets
            self.path = os.path.join(str(root), *where.split("/"))
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        elif _object_store(store) and "://" in url:  # one upload, completed in close()
            import fsspec

            self.fs, self.object = fsspec.core.url_to_fs(f"{url.rstrip('/')}/{where}", **dict(storage_options or {}))
            self.file = self.fs.open(self.object, "wb", autocommit=False)
        else:  # a store whose files would show half written (memory://): put whole at the end
            self.parts = []

    def add(self, i: int, encoded: Any) -> None:
        """Inner chunk ``i`` of the shard, encoded."""
        data = memoryview(encoded).cast("B")
        with self.lock:
            at, fd = self.at, self.fd
            self.index[i] = (at, len(data))
            self.at += len(data)
            if fd is None:  # a stream in order, or parts to put whole
                if self.parts is not None:
                    self.parts.append(bytes(data))
                else:
                    self.file.write(data)
                return
        _write_at(fd, data, at)  # its own place in the file: outside the lock (the shard closes after its writes)

    def close(self) -> None:
        """Write the index last: the shard's object is whole."""
        import numcodecs

        tail = bytes(numcodecs.CRC32C().encode(np.ascontiguousarray(self.index).view(np.uint8)))
        with self.lock:
            if self.parts is not None:
                whole = b"".join([*self.parts, tail])

                async def put() -> None:
                    await self.store.set(self.key, default_buffer_prototype().buffer.from_bytes(whole))

                assert _sync is not None
                _sync(put())
            elif self.fd is not None:
                _write_at(self.fd, memoryview(tail), self.at)
                os.close(self.fd)
                self.fd = None
            else:
                self.file.write(tail)
                self.file.close()
                self.file.commit()  # the upload completed: the object is there, whole

    def abort(self) -> None:
        """Give the shard's object up (the shard failed, or its job stopped)."""
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
                with contextlib.suppress(OSError):
                    os.remove(self.path)
            elif self.file is not None:  # an upload not completed: thrown away (also when close() failed)
                try:
                    with contextlib.suppress(Exception):
                        self.file.discard()
                finally:
                    self.file.closed = True  # never completed by a close() at garbage collection


_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "abfs", "az", "adl"}  # an object appears only once its upload completes


def _object_store(store: Any) -> bool:
    """An fsspec store on an object store (S3, GCS, Azure): an upload shows nothing until it completes."""
    protocol = getattr(getattr(store, "fs", None), "protocol", ())
    return bool(({protocol} if isinstance(protocol, str) else set(protocol)) & _OBJECT_STORES)


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` at ``offset`` of the open file ``fd`` (a regular file may take it in parts)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
