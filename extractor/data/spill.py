"""Per-row columns that grow past memory onto the local disk (issue 57): a job's listing of 400M rows is tens of
gigabytes of ids, paths, labels and fingerprints, and the driver holds them from the listing until the store has
them. A builder here keeps up to :data:`SPILL_BYTES` in memory; past that, its bytes go to an unnamed temporary file
(gone when the process ends or lets the column go), read back as a read-only memory map: pages the system may drop
and read again, not the driver's memory. A listing that stays small never touches the disk.

Hashes sorted without holding them (:func:`by_hash`): a duplicate id and the store's index of its ids, from
(hash, row) pairs split by their hash's top bits into buckets on disk, each sorted alone.

Where the files go: ``EXTRACTOR_SPILL_DIR``, else the system's temporary folder (``TMPDIR``)."""

from __future__ import annotations

import os
import tempfile
from array import array
from collections.abc import Iterable, Iterator
from typing import IO, Any

import numpy as np

__all__ = ["SPILL_BYTES", "Bytes", "Column", "by_hash", "on_disk"]

SPILL_BYTES = 1 << 20  # what a builder keeps in memory before it writes to its file
BUCKET_ROWS = 1 << 20  # (hash, row) pairs sorted at once by by_hash: about 50 MB with its sort's copies
BUCKET_BITS = 8  # at most 256 buckets (open files) however many rows


def _file() -> IO[bytes]:
    """An unnamed file in the spill folder (removed from the folder at once: freed when closed and unmapped)."""
    try:
        return tempfile.TemporaryFile(buffering=0, dir=os.environ.get("EXTRACTOR_SPILL_DIR") or None)
    except OSError as err:
        raise _refused(err) from None


def _write(f: IO[bytes], data: Any) -> None:
    """All of ``data``'s bytes to the unbuffered ``f`` (a write may take fewer: the rest is written after)."""
    view = memoryview(data).cast("B")
    try:
        while view:
            view = view[f.write(view) or 0:]
    except OSError as err:
        raise _refused(err) from None


def _refused(err: OSError) -> Exception:
    """The listing's spill refused by the disk (a missing folder, no room), in one line naming where and what to do."""
    from ..errors import DataError

    where = os.environ.get("EXTRACTOR_SPILL_DIR") or tempfile.gettempdir()
    return DataError(f"the driver's listing cannot go to {where} ({err.strerror or err}); set EXTRACTOR_SPILL_DIR to "
                     "a folder on a local disk with room (about 60 bytes a row)")


def _mapped(f: IO[bytes] | None, dtype: Any, n: int, held: bytes | bytearray | array) -> np.ndarray:
    """``n`` values of ``dtype``: those written to ``f`` (None: none) then ``held``, as one array (a read-only map
    of the file, ``held`` written to it first; or ``held`` itself where nothing was written)."""
    dtype = np.dtype(dtype)
    if f is None:
        return np.frombuffer(held, dtype=dtype) if len(held) else np.zeros(0, dtype)
    _write(f, held)
    return np.memmap(f, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)


def _spilled(f: IO[bytes] | None, dtype: Any, n: int) -> np.ndarray:
    """The ``n`` values of ``dtype`` written to ``f`` so far, mapped read-only (the file may grow after)."""
    return np.memmap(f, dtype=dtype, mode="r", shape=(n,)) if f is not None and n else np.zeros(0, dtype)


def on_disk(*arrays: Any) -> int:
    """The bytes of ``arrays`` (numpy arrays, or None) whose values lie in a file mapped read-only (a spilled
    column, or a view of one), each file counted once."""
    seen: dict[int, int] = {}
    for given in arrays:
        base = given
        while base is not None and not isinstance(base, np.memmap):
            base = getattr(base, "base", None)
        if base is not None:
            seen[id(base)] = max(seen.get(id(base), 0), int(base.nbytes))
    return sum(seen.values())


class Column:
    """Numbers appended one by one or in blocks, with an ``array`` typecode (``"q"``, ``"i"``, ``"Q"``...): in
    memory up to :data:`SPILL_BYTES`, then on the disk; :meth:`array` gives all of them as one numpy array."""

    def __init__(self, typecode: str, spill_bytes: int | None = None) -> None:
        self.held = array(typecode)
        self.dtype = np.dtype(typecode)
        self.file: IO[bytes] | None = None
        self.written = 0  # values in the file
        self.limit = max(1, (SPILL_BYTES if spill_bytes is None else spill_bytes) // self.dtype.itemsize)

    def __len__(self) -> int:
        return self.written + len(self.held)

    def __getitem__(self, n: int) -> Any:
        n = n + len(self) if n < 0 else n
        if n >= self.written:
            return self.held[n - self.written]
        assert self.file is not None
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self.file.fileno(), size, n * size), dtype=self.dtype)[0].item()

    def append(self, value: Any) -> None:
        self.held.append(value)
        if len(self.held) >= self.limit:
            self._spill()

    def extend(self, values: Iterable[Any] | np.ndarray) -> None:
        if isinstance(values, np.ndarray):
            self.held.frombytes(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        else:
            self.held.extend(values)
        if len(self.held) >= self.limit:
            self._spill()

    def _spill(self) -> None:
        if self.file is None:
            self.file = _file()
        _write(self.file, self.held)
        self.written += len(self.held)
        self.held = array(self.held.typecode)

    def snapshot(self) -> np.ndarray:
        """The values appended so far, as one read-only array (a map of the file, written first), the builder going
        on (a listing read while it goes on: :class:`~.streamed.Streamed`)."""
        if len(self):
            self._spill()
        return _spilled(self.file, self.dtype, self.written)

    def array(self) -> np.ndarray:
        """Every value, as one array (the builder is done with: it gathers anew from empty)."""
        out = _mapped(self.file, self.dtype, len(self), self.held)
        self.held, self.file, self.written = array(self.held.typecode), None, 0
        return out


class Bytes:
    """Bytes appended (strings' UTF-8, one after another): in memory up to :data:`SPILL_BYTES`, then on the disk."""

    def __init__(self) -> None:
        self.held = bytearray()
        self.file: IO[bytes] | None = None
        self.written = 0

    def __len__(self) -> int:
        return self.written + len(self.held)

    def __iadd__(self, more: bytes | bytearray) -> Bytes:
        self.held += more
        if len(self.held) >= SPILL_BYTES:
            self._spill()
        return self

    def _spill(self) -> None:
        if self.file is None:
            self.file = _file()
        _write(self.file, self.held)
        self.written += len(self.held)
        self.held = bytearray()

    def snapshot(self) -> np.ndarray:
        """The bytes appended so far, as one read-only uint8 array, the builder going on (:meth:`Column.snapshot`)."""
        if len(self):
            self._spill()
        return _spilled(self.file, np.uint8, self.written)

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``start:stop`` of those appended so far."""
        if start >= self.written:
            return bytes(self.held[start - self.written:stop - self.written])
        assert self.file is not None
        spilled = os.pread(self.file.fileno(), min(stop, self.written) - start, start)
        return spilled + bytes(self.held[:max(0, stop - self.written)])

    def array(self) -> np.ndarray:
        """Every byte, as one uint8 array (the builder gathers anew from empty)."""
        out = _mapped(self.file, np.uint8, len(self), self.held)
        self.held, self.file, self.written = bytearray(), None, 0
        return out


def _bucket_of(hashes: np.ndarray, bits: int) -> np.ndarray:
    """Each int64 hash's bucket: its top ``bits`` bits, in the hashes' signed order."""
    return ((hashes.view(np.uint64) ^ np.uint64(1 << 63)) >> np.uint64(64 - bits)).astype(np.int64)


def by_hash(blocks: Iterable[np.ndarray], n: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The int64 hashes of ``n`` rows (given a block at a time, in row order) sorted, with each one's row (rows that
    share a hash in row order): a bucket at a time, buckets in order, so that what they give one after the other is
    one sorted array. ``n`` up to :data:`BUCKET_ROWS` is sorted in memory; more is split on the disk first by each
    hash's top bits into at most 2 ** :data:`BUCKET_BITS` files of (hash, row) pairs (hashes spread evenly: a bucket
    holds about ``BUCKET_ROWS``, more past 256 buckets: at 400M rows, 1.6M a bucket)."""
    bits = min(int(np.ceil(np.log2(max(n, 1) / BUCKET_ROWS))), BUCKET_BITS) if n > BUCKET_ROWS else 0
    if not bits:
        hashes = np.concatenate([np.asarray(b, dtype=np.int64) for b in blocks]) if n else np.zeros(0, np.int64)
        order = np.argsort(hashes, kind="stable")
        yield hashes[order], order.astype(np.int64)
        return
    buckets = [Column("q", 1 << 16) for _ in range(1 << bits)]  # (hash, row) pairs, one after the other
    at = 0
    for block in blocks:
        block = np.asarray(block, dtype=np.int64)
        which = _bucket_of(block, bits)
        order = np.argsort(which, kind="stable")
        cuts = np.searchsorted(which[order], np.arange((1 << bits) + 1))
        pairs = np.stack([block[order], at + order], axis=1)
        for b in np.flatnonzero(np.diff(cuts)).tolist():
            buckets[b].extend(pairs[cuts[b]:cuts[b + 1]].ravel())
        at += len(block)
    for bucket in buckets:
        pairs = np.array(bucket.array()).reshape(-1, 2)
        order = np.argsort(pairs[:, 0], kind="stable")
        yield pairs[order, 0], pairs[order, 1]
