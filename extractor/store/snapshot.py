"""Reads of a local store that never mix two versions of one shard's object.

zarr reads an inner chunk of a sharded array in two reads of the shard's object: its index (the end of the
object), then the chunk's bytes at the offset the index gives. A writer that replaces the object in between (a
shard redone: ``on_change: redo``, a resume rewriting what a killed run left) is renamed over it whole, so each read
alone sees one version, but the pair may see two: the new object's bytes at the old index's offsets fail to
decode ("Zstd decompression error") or, worse, decode as another chunk. Here the index read opens the object and
keeps that open file (its version: a rename leaves it as it was) for the chunk reads that follow it in the same
asyncio task, which is how zarr's sharding codec makes them.
"""

from __future__ import annotations

import contextvars
import os
from typing import Any

from zarr.abc.buffer import Buffer, BufferPrototype
from zarr.abc.store import ByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.storage import LocalStore, WrapperStore

# the object whose index this task read last: its key and the open file (None: none)
_OPENED: contextvars.ContextVar[tuple[str, Any] | None] = contextvars.ContextVar("extractor_opened", default=None)


class SnapshotStore(WrapperStore[LocalStore]):
    """A local store, read-only, whose shard reads take a shard's index and chunks from one version of it."""

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        if isinstance(byte_range, SuffixByteRequest):  # an index: this version, kept for the chunk reads after it
            try:
                f = open(os.path.join(str(self._store.root), *key.split("/")), "rb")  # noqa: SIM115 - kept open
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None
            _OPENED.set((key, f))
            size = os.fstat(f.fileno()).st_size
            n = min(byte_range.suffix, size)
            return prototype.buffer.from_bytes(os.pread(f.fileno(), n, size - n))
        opened = _OPENED.get()
        if isinstance(byte_range, RangeByteRequest) and opened is not None and opened[0] == key:
            f = opened[1]
            n = byte_range.end - byte_range.start
            return prototype.buffer.from_bytes(os.pread(f.fileno(), n, byte_range.start))
        return await self._store.get(key, prototype, byte_range)


def snapshot_store(path: str) -> SnapshotStore:
    return SnapshotStore(LocalStore(path, read_only=True))
