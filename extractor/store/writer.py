"""A shard's writer: its rows of each capture array in whole chunks, then status, errors and its done marker,
fenced by the lease of its job (numpy and zarr only)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import zarr
from zarr.core.array_spec import ArrayConfigParams

from .chunks import ChunkCodec, ShardStream, read_at_once, write_chunks, write_whole
from .fence import (
    fenced_group,
    is_s3,
)
from .layout import get_array, locator_arrays
from .lease import job_fence


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
        """What the decoder reads for each row (its path, or where the source keeps locator arrays beside it
        (``data.Source.locators``), the path and their values: a tar member's (TAR_URL#MEMBER, offset, size)) and,
        with ``labels``, the rows' labels: the shard's rows of those arrays read in one round."""
        locators = list(self.opened.locators)
        names = ["paths", *locators, *(["labels"] if labels else [])]
        got = dict(zip(names, read_at_once([(self.opened.array(n), slice(self.start, self.stop)) for n in names]),
                       strict=True))
        paths = got["paths"].tolist()
        found = np.asarray(got["labels"], dtype=np.int64) if labels else None
        if not locators:
            return paths, found
        return list(zip(paths, *(got[n].tolist() for n in locators), strict=True)), found

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
        rows, one = self.start, self.index  # where the per-row arrays' rows begin; the per-shard arrays' row
        writes = [(key, rows, v) for key, v in (extras or {}).items()]
        if digests is not None and self.opened.has("digest"):  # stores made before digests have none
            writes.append(("digest", rows, digests))
        if reused is not None and self.opened.has("reused"):
            writes.append(("reused", rows, reused))
        writes += [(f"index_parts/{key}", one, np.asarray(part)[None]) for key, part in (index_parts or {}).items()]
        writes += [("status", rows, status), ("errors", rows, np.asarray(errors, dtype=object)),
                   ("shard_stats", one, np.asarray([stats], dtype=object))]
        # all of them, then the marker last: a crash before it never looks complete
        write_whole([self.opened.coded(*w) for w in writes], self.opened.coded("shard_done", one, np.ones(1, np.uint8)))


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
        self.locators = locator_arrays(self.group, self.names)  # the source's arrays beside paths, in its order
        self.arrays: dict[str, zarr.Array] = {}
        self.codecs: dict[str, ChunkCodec | None] = {}  # how whole chunks of those arrays are encoded
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

    def coded(self, name: str, start: int, data: np.ndarray) -> tuple[zarr.Array, ChunkCodec | None, int, np.ndarray]:
        """The array ``name`` and its chunk codec (each found once), with rows ``start ...`` to write to it."""
        array = self.array(name)
        with self.lock:
            if name not in self.codecs:
                self.codecs[name] = ChunkCodec.of(array)
            return array, self.codecs[name], start, data

