"""Whole chunks of several arrays written in one step, for the writer threads.

zarr's ``array[a:b] = x`` costs about 1.5 ms of Python and thread hand-offs per chunk (zarr 3.1,
measured on a 2-core machine: a 16 KB chunk compresses in 0.04 ms). A job with several small
captures writes one chunk of each per batch, so that cost, not compression, set its speed.
Here a chunk is encoded by the same numcodecs codec, with the settings zarr recorded in the
array's metadata, and the chunks of every array are put in the store together, in one round of
zarr's event loop. What lands is byte for byte what zarr writes (``tests/test_chunks.py``).

Arrays with codecs other than those extractor creates (bytes, then zstd, blosc, gzip or none),
chunks that do not span an array's trailing dimensions, and a partial last chunk go through zarr.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import numcodecs
import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype
from zarr.codecs import BloscCodec, BytesCodec, GzipCodec, ZstdCodec

_sync: Callable[..., Any] | None
try:  # zarr's event loop (not a public name: pinned below 3.2 in pyproject.toml); without it, chunks go through zarr
    from zarr.core.sync import sync as _sync
except ImportError:  # pragma: no cover - a zarr that moved it
    _sync = None

__all__ = ["ChunkCodec", "write_chunks"]

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


class ChunkCodec:
    """How zarr encodes a whole chunk of one array, and where that chunk lives in its store."""

    def __init__(self, array: zarr.Array, dtype: np.dtype[Any], compressors: list[Callable[[Any], Any]]) -> None:
        self.array, self.dtype, self.compressors = array, dtype, compressors
        self.rows = array.chunks[0]
        self.trailing = (0,) * (array.ndim - 1)

    @classmethod
    def of(cls, array: zarr.Array) -> ChunkCodec | None:
        """The codec of ``array``, or None when its chunks must go through zarr."""
        meta = array.metadata
        if _sync is None:
            return None
        if meta.zarr_format != 3 or not array.path or tuple(array.chunks[1:]) != tuple(array.shape[1:]):
            return None
        first, *rest = meta.codecs
        if not isinstance(first, BytesCodec):
            return None
        compressors = [_compressor(c) for c in rest]
        if any(c is None for c in compressors):
            return None
        dtype = np.dtype(array.dtype)
        if dtype.kind not in "biuf":  # numbers only: other data types have their own serialisation
            return None
        if first.endian is not None:
            dtype = dtype.newbyteorder("<" if first.endian.value == "little" else ">")
        return cls(array, dtype, [c for c in compressors if c is not None])

    def key(self, start: int) -> str:
        """The store key of the chunk that begins at row ``start``."""
        return f"{self.array.path}/{self.array.metadata.encode_chunk_key((start // self.rows, *self.trailing))}"

    def encode(self, data: np.ndarray) -> Any:
        """A whole chunk's bytes, as zarr stores them."""
        out: Any = np.ascontiguousarray(data, dtype=self.dtype)
        for compress in self.compressors:
            out = compress(out)
        return out


def write_chunks(start: int, chunks: Mapping[str, tuple[zarr.Array, ChunkCodec | None, np.ndarray]]) -> int:
    """Write rows ``start ...`` of each array (the data begins a chunk of every one); bytes written.
    Whole chunks of arrays with a known codec go to the store in one event-loop round; others
    through zarr, one by one."""
    puts: list[tuple[Any, str, Any]] = []
    for array, codec, data in chunks.values():
        if codec is not None and start % codec.rows == 0 and len(data) == codec.rows:
            puts.append((array.store, codec.key(start), codec.encode(data)))
        else:
            array[start : start + len(data)] = data
    if puts:
        buffer = default_buffer_prototype().buffer

        async def put_all() -> None:
            await asyncio.gather(*(store.set(key, buffer.from_bytes(value)) for store, key, value in puts))

        assert _sync is not None  # ChunkCodec.of gives no codec without it
        _sync(put_all())
    return sum(data.nbytes for _, _, data in chunks.values())
