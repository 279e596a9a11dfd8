"""A shard on the host: what it reads before its first batch (:class:`ShardInput`), each forwarded
batch (:class:`Forwarded`), and its results gathered into whole chunks for the writer threads,
which compress, store and count them (:class:`ShardOutput`); its summary (:class:`ShardSummary`)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from .._machine import Machine
from ..data import Reused, Shard
from ..errors import FencedError, ShardError, ShardTaken
from ..faults import shard_failed
from ..index import index_on_device, indexed
from ..store import (
    FAILED,
    OK,
    CaptureRecord,
    ExtraRecord,
    ShardStats,
    ShardWriter,
    Ticket,
    fill_value,
    numpy_dtype,
    patch_span,
)
from ..store import dumps as stats_dumps

__all__ = ["Forwarded", "ShardInput", "ShardOutput", "ShardSummary", "drain", "failed_shard", "taken"]


def drain(pending: deque[Future[None]]) -> None:
    """Wait for writes in flight, ignoring their errors (the shard is failing anyway)."""
    while pending:
        with contextlib.suppress(Exception):
            pending.popleft().result()


def failed_shard(shard: Shard, err: BaseException) -> ShardError:
    """The ShardError of ``shard`` that ``err`` failed."""
    return shard_failed(shard.index, shard.start, shard.stop, err)


@dataclass(frozen=True)
class ShardSummary:
    shard: int
    rows: int
    ok: int
    failed: int
    seconds: float
    bytes: int
    pid: int
    # where the worker's main thread waited (seconds): for the next decoded batch, for the
    # device to finish a batch, for the writer threads (a full queue, then the shard's last
    # chunks and its done marker)
    wait_decode: float = 0.0
    wait_device: float = 0.0
    wait_write: float = 0.0
    reused: int = 0  # rows copied from another store (output.reuse), not computed
    taken: str = ""  # not computed here: "done" (committed by another claimant), "taken" (a live one computes it)
    skip: tuple[int, ...] = ()  # with taken: other shards the same read found another's (the driver drops them)
    stats: str = ""  # the shard's statistics record, as committed (the driver merges it without reading the store)
    attempt: int = 0  # the attempt its commit named (what the statistics merged are of)
    # its parts of the write-time indexes, as committed (the driver merges them as it merges the statistics)
    parts: dict[str, np.ndarray] | None = None

    def to_dict(self) -> dict[str, Any]:
        """As JSON gives it (without its statistics record and index parts: the store keeps them)."""
        return {k: v for k, v in asdict(self.kept()).items() if k not in ("stats", "attempt", "parts")}

    def kept(self) -> ShardSummary:
        """What a driver keeps of it for the run's summary once its statistics record and index parts are merged:
        all but those (up to 800 KB and 14 MB a shard: at 390,000 shards, terabytes)."""
        return replace(self, stats="", parts=None)


def taken(shard: Shard, err: ShardTaken) -> ShardSummary:
    """What a shard another claimant holds or committed leaves: nothing computed here."""
    return ShardSummary(shard=shard.index, rows=0, ok=0, failed=0, seconds=0.0, bytes=0, pid=os.getpid(),
                        taken=err.verdict, skip=err.others)


@dataclass
class ShardInput:
    """What a shard needs before its first batch, read on the prepare thread: its writer
    (store arrays opened), its rows' locators and, for gradient jobs, its labels."""

    shard: Shard
    writer: ShardWriter
    paths: list[Any]
    labels: np.ndarray | None
    chunk_rows: dict[str, int]  # per capture, as the store is chunked

    @classmethod
    def open(cls, shard: Shard, url: str, storage_options: dict[str, Any] | None, labels: bool,
             captures: Iterable[str], ticket: Ticket | None = None) -> ShardInput:
        """The shard claimed for ``ticket``'s claimant (:class:`ShardTaken` where another claimant holds it), opened."""
        writer = ShardWriter(url, shard.start, shard.stop, shard.index, storage_options, ticket)
        paths, found = writer.opening(labels)
        return cls(shard, writer, paths, found, writer.chunk_rows(captures))


@dataclass
class Forwarded:
    """A forwarded batch: host arrays (readable once ``event`` has completed) and per-image errors; the captures'
    tensors as the device holds them, for the write-time indexes (the pipeline keeps only the indexed ones)."""

    host: dict[str, np.ndarray]
    bad: dict[int, str]  # batch position -> error
    event: Any  # torch.cuda.Event, or None when ``host`` is ready
    reused: dict[int, Reused] = field(default_factory=dict)  # shard row offset -> its values from another store
    device: dict[str, Any] = field(default_factory=dict)  # capture -> its tensor (n, *shape) on the device
    release: Callable[[], None] | None = None  # gives the batch's images back to its stream once read back


class _Chunks:
    """The captures whose arrays share one chunk size, and the chunk of theirs being filled."""

    def __init__(self, rows: int, buffers: dict[str, np.ndarray]) -> None:
        self.rows, self.keys = rows, list(buffers)
        self.current = 0  # index of the chunk being filled, relative to the shard
        self.buffers = buffers  # its buffer per capture


class ShardOutput:
    """One shard's results on the host: row status, chunk buffers handed to the writer threads
    (compression, storage and statistics happen there), per-row extras, timings. Captures whose
    arrays have other chunk sizes (``chunk_rows: auto`` gives small rows bigger chunks) fill
    their chunks separately."""

    def __init__(self, given: ShardInput, started: float, captures: dict[str, CaptureRecord],
                 extras: dict[str, ExtraRecord], pool: ThreadPoolExecutor,
                 spare: dict[str, deque[np.ndarray]], machine: Machine, model: Mapping[str, Any] | None = None) -> None:
        """``pool``: the writer threads; ``spare``: chunk buffers whose write is done, per capture
        (shared by the shards of a worker); ``machine``: how many chunks may wait for the writers; ``model``: the
        model's record (an older store's prefix-token count: :func:`~extractor.store.patch_span`)."""
        self.shard, self.writer, self.pool = given.shard, given.writer, pool
        self.started, self.seconds = started, 0.0
        n = self.n = len(self.shard)
        self.status = np.zeros(n, dtype=np.uint8)
        self.errors = [""] * n
        self.digests = np.zeros(n, dtype=np.uint64)  # content digest of each row's bytes as read (0: not read)
        self.prints = np.zeros(n, dtype=np.uint64)  # fingerprint of each row's file as read (0: none, not a file)
        self.reused = np.full(n, -1, dtype=np.int16)  # the store each row was copied from (-1: computed here)
        self.spare = spare
        self.shapes = {k: (given.chunk_rows[k], *m["shape"]) for k, m in captures.items()}
        self.dtypes = {k: numpy_dtype(m["dtype"]) for k, m in captures.items()}
        self.chunks = [_Chunks(rows, {k: self._buffer(k) for k in captures if given.chunk_rows[k] == rows})
                       for rows in sorted({given.chunk_rows[k] for k in captures})]
        self.extras = {k: np.full((n, *m["shape"]), fill_value(m["dtype"]), dtype=m["dtype"])
                       for k, m in extras.items()}
        prefix = (model or {}).get("prefix_tokens")
        self.stats = {k: ShardStats(m["dims"], m["shape"], patch_span(m, prefix)) for k, m in captures.items()}
        self.indexes = indexed(captures)  # write-time feature indexes (capture.feature_index): this shard's part
        # rows the indexes take on the host (the writer threads, from the chunks): rows copied from other stores, and
        # those of a batch retried image by image (no batch tensor on the device); every other row's block is made on
        # the device as its batch is read back (_index)
        self.on_host = np.zeros(n, dtype=bool)
        self.locks = {k: threading.Lock() for k in self.stats}  # a capture's statistics: one writer at a time
        self.pending: deque[Future[None]] = deque()  # chunk writes in flight, one per chunk (its captures)
        chunk_bytes = sum(int(np.prod(self.shapes[k])) * self.dtypes[k].itemsize for k in captures)
        self.queue = machine.write_queue(chunk_bytes)  # chunks that may wait for the writers: bounds memory
        self.decoded = self.forward_failed = 0  # images that reached the model, and those that made it raise
        self.handed_off = False  # complete() is queued on the writer threads: they own the shard from then on
        self.wait_decode = self.wait_device = self.wait_write = 0.0

    def _buffer(self, key: str) -> np.ndarray:
        """A chunk buffer: one whose write has finished (recycled: no allocation, no page faults), or a new one.
        Rows that are not OK are set to NaN when the chunk is written, so a recycled buffer's old rows never land."""
        try:
            return self.spare.setdefault(key, deque()).pop()
        except IndexError:
            return np.empty(self.shapes[key], self.dtypes[key])

    def count(self, images: int, done: Forwarded) -> None:
        """Fail the shard when every image so far made the model raise: the cause is not the images."""
        self.forward_failed += len(done.bad)
        self.decoded += images
        if self.forward_failed == self.decoded and self.decoded >= min(self.n, 2):
            raise RuntimeError(f"every image so far made the model raise; last: {done.bad[max(done.bad)]}")

    def read(self, digests: dict[int, int], prints: dict[int, int]) -> None:
        """The content digests of rows whose bytes were read, and the fingerprints of the files they were read from
        (offset -> digest, offset -> fingerprint)."""
        for offset, digest in digests.items():
            self.digests[offset] = digest
        for offset, printed in prints.items():
            self.prints[offset] = printed

    def fail(self, offset: int, err: str) -> None:
        self.status[offset], self.errors[offset] = FAILED, err

    def add(self, offsets: np.ndarray, done: Forwarded) -> None:
        """Record a forwarded batch whose rows are ``offsets`` (within the shard, ascending)."""
        if done.event is not None:
            t = time.perf_counter()
            done.event.synchronize()
            self.wait_device += time.perf_counter() - t
        for i, err in done.bad.items():
            self.fail(int(offsets[i]), err)
        host, device = done.host, done.device
        if done.bad:  # the batch was retried image by image: its values are on the host only
            keep = np.setdiff1d(np.arange(len(offsets)), list(done.bad))
            offsets = offsets[keep]
            host, device = {k: v[keep] for k, v in host.items()}, {}
        self._index(offsets, device)
        if done.reused:
            offsets, host = self._with_reused(offsets, host, done.reused)
        if not len(offsets):
            return
        for key, arr in self.extras.items():
            arr[offsets] = host[key]
        self.status[offsets] = OK
        for group in self.chunks:
            self._file(group, offsets, host)

    def _index(self, offsets: np.ndarray, device: dict[str, Any]) -> None:
        """Add the computed rows ``offsets`` to the write-time indexes: their blocks made on the device from the
        batch's tensors (:func:`~extractor.index.device.index_on_device`), merged here. Without the tensors, the writer
        threads add the rows from their chunks (on the host)."""
        if not self.indexes or not len(offsets):
            return
        if any(key not in device for key in self.indexes):
            self.on_host[offsets] = True
            return
        for key, feed in self.indexes.items():
            index_on_device(feed, device[key], self.shard.start + offsets, self.locks[key])

    def _with_reused(self, offsets: np.ndarray, host: dict[str, np.ndarray],
                     reused: dict[int, Reused]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The batch's computed rows with its rows copied from other stores, in row order (chunks fill in order)."""
        taken = np.asarray(sorted(reused), dtype=np.int64)
        self.reused[taken] = [reused[int(o)].source for o in taken]
        self.on_host[taken] = True  # values from another store: indexed from the chunks
        keys = host.keys() if len(offsets) else reused[int(taken[0])].values.keys()
        extra = {k: np.stack([reused[int(o)].values[k] for o in taken]) for k in keys}
        order = np.argsort(np.concatenate([offsets, taken]), kind="stable")
        merged = {k: np.concatenate([host[k], extra[k].astype(host[k].dtype)])[order] if len(offsets)
                  else extra[k] for k in keys}
        return np.concatenate([offsets, taken])[order], merged

    def _file(self, group: _Chunks, offsets: np.ndarray, host: dict[str, np.ndarray]) -> None:
        """Copy the rows ``offsets`` of ``group``'s captures into their chunk buffers, handing each
        chunk that is complete to the writers."""
        chunk = group.rows
        if offsets[-1] - offsets[0] == len(offsets) - 1:  # consecutive rows (the usual case): copy slices
            pos, row = 0, int(offsets[0])
            while pos < len(offsets):
                c = row // chunk
                while group.current < c:
                    self._flush(group)
                n = min(len(offsets) - pos, (c + 1) * chunk - row)
                for key, buf in group.buffers.items():
                    buf[row - c * chunk : row - c * chunk + n] = host[key][pos : pos + n]
                pos, row = pos + n, row + n
            return
        for c in np.unique(offsets // chunk):
            while group.current < c:
                self._flush(group)
            sel = (offsets // chunk) == c
            for key, buf in group.buffers.items():
                buf[offsets[sel] - c * chunk] = host[key][sel]

    def _write(self, start: int, bufs: dict[str, np.ndarray], ok: np.ndarray) -> None:
        """On a writer thread: compress and store the chunk at shard row ``start`` of some captures,
        add it to the statistics, give the buffers back. (Stores opened by URL copy what they are
        given, so a buffer is free once written; zarr's in-memory MemoryStore object would keep it.)"""
        rows = np.flatnonzero(ok)
        if len(rows) < len(ok):
            for buf in bufs.values():
                buf[np.flatnonzero(~ok)] = np.nan  # failed rows, and what a recycled buffer held there
        self.writer.write(start, {key: buf[: len(ok)] for key, buf in bufs.items()})
        on_host = rows[self.on_host[start + rows]]  # rows the device did not index (_index)
        for key, buf in bufs.items():
            if len(rows):
                with self.locks[key]:
                    self.stats[key].update(buf[rows], self.shard.start + start + rows)
                    if key in self.indexes and len(on_host):
                        self.indexes[key].add(buf[on_host], self.shard.start + start + on_host)
            self.spare[key].append(buf)

    def _wait(self, future: Future[None]) -> None:
        t = time.perf_counter()
        future.result()
        self.wait_write += time.perf_counter() - t

    def _flush(self, group: _Chunks) -> None:
        """Hand ``group``'s current chunk to the writer threads and take fresh buffers; wait only
        when ``queue`` chunks are already in flight."""
        c, rows = group.current, group.rows
        more = c < (self.n - 1) // rows  # a chunk after this one: it needs buffers
        full, group.buffers = group.buffers, {k: self._buffer(k) for k in group.keys} if more else {}
        ok = self.status[c * rows : min((c + 1) * rows, self.n)] == OK
        self.pending.append(self.pool.submit(self._write, c * rows, full, ok))
        group.current += 1
        while len(self.pending) > self.queue:
            self._wait(self.pending.popleft())

    def close(self) -> None:
        """Hand the remaining chunks to the writer threads."""
        for group in self.chunks:
            while group.current <= (self.n - 1) // group.rows:
                self._flush(group)

    def hand_off(self) -> Future[ShardSummary]:
        """Queue ``complete`` behind this shard's chunk writes (the writer threads take tasks in order)."""
        self.handed_off = True
        return self.pool.submit(self.complete)

    def complete(self) -> ShardSummary:
        """On a writer thread: wait until every chunk is durable, then mark the shard done."""
        try:
            while self.pending:  # every chunk durable (or its error raised) before the shard is marked done
                self.pending.popleft().result()
            parts = {key: feed.state.to_bytes() for key, feed in self.indexes.items()}
            stats = stats_dumps(self.stats)
            self.writer.finish(self.status, self.errors, self.extras, stats, self.digests, self.reused, parts,
                               self.prints)
        except ShardTaken as err:  # joined: taken over while this process was stopped; the other claimant's now
            self.writer.abandon()
            return taken(self.shard, err)
        except BaseException as err:
            drain(self.pending)
            self.writer.abandon()
            if isinstance(err, Exception) and not isinstance(err, FencedError):
                raise failed_shard(self.shard, err) from err
            raise
        return ShardSummary(
            shard=self.shard.index,
            rows=self.n,
            ok=int((self.status == OK).sum()),
            failed=int((self.status == FAILED).sum()),
            seconds=self.seconds,
            bytes=self.writer.bytes,
            pid=os.getpid(),
            wait_decode=self.wait_decode,
            wait_device=self.wait_device,
            wait_write=self.wait_write,
            reused=int((self.reused >= 0).sum()),
            stats=stats,
            attempt=self.writer.attempt,
            parts=parts or None,
        )

    def abandon(self) -> None:
        """Wait for this shard's writes in flight, ignoring their errors; no done marker. A no-op
        once the shard is handed off: ``complete`` owns it then."""
        if not self.handed_off:
            drain(self.pending)
            self.writer.abandon()
