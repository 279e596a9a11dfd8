"""The worker's pipeline over a queue of shards: one stream of decoded batches, the next shard
opened ahead (:class:`NextShard`), each batch read back after the next one is sent
(:class:`ReadBack`), and a failure charged to the shard at fault (:func:`~extractor.faults.blame`).
See docs/ARCHITECTURE.md for its threads and queues."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from .._machine import Machine
from ..data import Batch, Shard
from ..errors import ShardError, ShardTaken
from ..faults import blame
from ..index import serves
from ..spec import JobSpec
from ..store import CaptureRecord, ExtraRecord, Ticket, draw_keys
from .shard import Forwarded, ShardInput, ShardOutput, ShardSummary, failed_shard, taken

__all__ = ["CallbackError", "Forwarder", "Pipeline", "ShardQueue"]


class Forwarder(Protocol):
    """What the pipeline needs of its worker (:class:`extractor.worker.Worker`)."""

    spec: JobSpec
    captures: dict[str, CaptureRecord] | None
    extras: dict[str, ExtraRecord]
    needs_labels: bool  # a gradient job (target: label reads each row's label)
    samples: bool  # a sample_tokens job (its draws are keyed by the images' content digests)
    prepare_pool: ThreadPoolExecutor  # opens the next shard
    writer_pool: ThreadPoolExecutor  # compresses and stores chunks
    machine: Machine  # how many chunks may wait for the writer threads
    spare: dict[str, deque[np.ndarray]]  # chunk buffers whose write is done
    model_info: dict[str, Any]  # the model's record (its prefix tokens: the statistics keep theirs apart)

    def batches(self) -> Any: ...

    def forward_rows(self, images: torch.Tensor, labels: np.ndarray | None, draws: np.ndarray | None = None,
                     ) -> Forwarded: ...


class Ready(Protocol):
    """Which shards may be begun (a new store's rows are written behind its making: a shard once its rows are in)."""

    def ready(self, shard: int) -> bool: ...

    def wait(self, shard: int) -> None: ...


class ShardQueue:
    """Shards for a running pipeline: ``put`` from any thread, ``close`` once no more will come (``closed``: a
    fixed list). ``Worker.run_shards`` on a queue that stays open keeps its pipeline across calls (a Ray
    actor fed by the driver). ``ready``: a shard is given once it says so; where it raises, the queue ends (the
    shards begun finish) and its :attr:`error` is the caller's to raise."""

    def __init__(self, shards: Iterable[Shard] = (), ready: Ready | None = None, closed: bool = False) -> None:
        self.items: deque[Shard] = deque(shards)
        self.cond = threading.Condition()
        self.closed = closed
        self.ready = ready
        self.error: Exception | None = None

    def put(self, shard: Shard, first: bool = False) -> None:
        with self.cond:
            if first:
                self.items.appendleft(shard)
            else:
                self.items.append(shard)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def drop(self, indices: Iterable[int]) -> list[Shard]:
        """Take the shards of ``indices`` out of the queue (another process's: not to be opened here)."""
        gone = set(indices)
        with self.cond:
            out = [s for s in self.items if s.index in gone]
            self.items = deque(s for s in self.items if s.index not in gone)
        return out

    def get(self, block: bool) -> Shard | None:
        """The next shard; None when there is none now (``block=False``) or ever (closed)."""
        while True:
            with self.cond:
                while block and not self.items and not self.closed:
                    self.cond.wait()
                first = self.items[0] if self.items else None
                if first is None or self.ready is None or self._ready(first.index, False):
                    return self.items.popleft() if first is not None else None
            if not block:
                return None
            self._ready(first.index, True)  # (not holding the queue: others may put or drop meanwhile)

    def _ready(self, shard: int, wait: bool) -> bool:
        assert self.ready is not None
        try:
            if wait:
                self.ready.wait(shard)
                return True
            return self.ready.ready(shard)
        except Exception as err:  # noqa: BLE001 - the caller's to raise, once the shards begun are finished
            with self.cond:
                self.error, self.closed = err, True
                self.items.clear()
            return False


class NextShard:
    """The look-ahead: the shard after the current one, taken from the queue and opened on the
    prepare thread (its store arrays and row list read) while the current one computes; its
    rows join the batch stream as soon as it is open, so its first images decode meanwhile."""

    def __init__(self, worker: Forwarder, shards: ShardQueue, stream: Any, url: str,
                 storage_options: dict[str, Any] | None, ticket: Ticket | None) -> None:
        self.worker, self.shards, self.stream = worker, shards, stream
        self.url, self.storage, self.ticket = url, storage_options, ticket
        self.shard: Shard | None = None
        self.opening: Future[ShardInput] | None = None
        self.queued = False  # its rows are in the stream

    def fetch(self, block: bool) -> None:
        """Take the next shard from the queue (waiting for one when ``block``) and start opening it."""
        if self.shard is None and (shard := self.shards.get(block)) is not None:
            self.shard, self.queued = shard, False
            self.opening = self.worker.prepare_pool.submit(ShardInput.open, shard, self.url, self.storage,
                                                           self.worker.needs_labels, list(self.worker.captures or ()),
                                                           self.ticket)

    def feed(self) -> None:
        """Once it is open, add its rows to the stream."""
        if self.opening is not None and not self.queued and self.opening.done() and self.opening.exception() is None:
            self.stream.add(self.opening.result().paths)
            self.queued = True

    def take(self) -> tuple[Shard, ShardInput]:
        """It becomes the current shard: its input (raising its opening error), its rows in the stream."""
        assert self.shard is not None and self.opening is not None
        shard, opening, queued = self.shard, self.opening, self.queued
        self.shard = self.opening = None
        given = opening.result()
        if not queued:
            self.stream.add(given.paths)
        return shard, given


class ReadBack:
    """The one-batch read-back lag: the batch last sent to the device is read into its shard's
    output only after the next batch is sent, also across a shard boundary, so the device
    never waits for the host. At most two batches are in flight at once: the worker's two
    sets of page-locked host buffers, used in turn, are never overwritten before read."""

    def __init__(self) -> None:
        self.pending: tuple[ShardOutput, np.ndarray, Forwarded] | None = None  # sent, not read back

    def holds(self, out: ShardOutput) -> bool:
        """The batch in flight is ``out``'s."""
        return self.pending is not None and self.pending[0] is out

    def push(self, out: ShardOutput, offsets: np.ndarray, forwarded: Forwarded) -> ShardOutput | None:
        """A batch was just sent: read back the one before it. Returns the shard output that read
        its last batch then (the shard before ``out``), closed: the caller finishes it."""
        done = self.settle(keep=out)
        self.pending = out, offsets, forwarded
        return done

    def settle(self, keep: ShardOutput | None) -> ShardOutput | None:
        """Read back the batch in flight. Its shard's output, when it is not ``keep``, is closed
        (its last chunks handed to the writers) and returned for the caller to finish."""
        if self.pending is None:
            return None
        (out, offsets, forwarded), self.pending = self.pending, None
        try:
            out.add(offsets, forwarded)
            if forwarded.release is not None:  # its values are in chunk buffers, its copy to the device done
                forwarded.release()
            if out is not keep:
                out.close()
        except BaseException as err:
            out.abandon()
            if not isinstance(err, Exception):
                raise
            raise failed_shard(out.shard, err) from err
        return None if out is keep else out


class Pipeline:
    """One call of ``Worker.run_shards``: the shards' batches come from one stream, the next
    shard opens ahead (:class:`NextShard`), and each batch is read back after the next one is
    sent (:class:`ReadBack`), whichever shard either belongs to. When no shard is queued as a
    shard's rows run out, the pipeline drains, so that shard is finished before waiting for more."""

    def __init__(self, worker: Forwarder, shards: ShardQueue, url: str, storage_options: dict[str, Any] | None,
                 on_batch: Callable[[int], None] | None,
                 on_computed: Callable[[Shard, Future[ShardSummary]], None] | None,
                 on_started: Callable[[Shard], None] | None, ticket: Ticket | None = None) -> None:
        self.worker, self.shards = worker, shards
        self.on_batch, self.on_computed, self.on_started = on_batch, on_computed, on_started
        self.stream = worker.batches()
        self.next = NextShard(worker, shards, self.stream, url, storage_options, ticket)
        self.read_back = ReadBack()
        self.put_back: Shard | None = None  # a started shard that another one's failure interrupted
        self.shard_began = time.perf_counter()  # when the current shard began (the previous one's rows ran out)

    def run(self) -> None:
        """Every shard of the queue until it is closed and empty. On a failure, the shards not at
        fault go back to the front of the queue: the one opened ahead, and the current one when
        the shard before it failed as its last batch was read back."""
        try:
            self.next.fetch(block=True)
            while self.next.shard is not None:
                self._shard()
            self._finish(self.read_back.settle(keep=None))  # the last shard's last batch
        except CallbackError as err:
            raise err.error from None
        finally:
            for shard in (self.next.shard, self.put_back):
                if shard is not None:
                    self.shards.put(shard, first=True)

    def _shard(self) -> None:
        """One shard: open it; for each batch, forward it and read back the one before; finish it."""
        shard, out = self.next.shard, None
        assert shard is not None
        try:
            shard, given = self.next.take()  # raises the store's error for this shard
            w = self.worker
            assert w.captures is not None  # probed before any shard runs
            out = ShardOutput(given, self.shard_began, w.captures, w.extras, w.writer_pool, w.spare, w.machine,
                              w.model_info)
            self._call(self.on_started, shard)
            while (batch := self._next_batch(out)) is not None:
                self._forward(batch, given, out)
            self._end(out)
        except ShardTaken as err:  # another claimant's (its opening found it so): nothing to compute here
            self._taken(shard, err)
        except BaseException as err:  # noqa: BLE001 - raised again by _stop, as the failure of the shard at fault
            self._stop(shard, out, err)

    def _taken(self, shard: Shard, err: ShardTaken) -> None:
        """A shard another claimant holds or committed: said as computed with nothing in it, and so are the queued
        shards its block's read found another's (:attr:`ShardTaken.others`); on to the next."""
        for each in [shard, *self.shards.drop(err.others)]:
            done: Future[ShardSummary] = Future()
            done.set_result(taken(each, ShardTaken(each.index, err.verdict)))
            self._call(self.on_computed, each, done)
        self.next.fetch(block=True)

    def _next_batch(self, out: ShardOutput) -> Batch | None:
        """The shard's next decoded batch (None at its end); meanwhile the next shard opens."""
        self.next.fetch(block=False)
        self.next.feed()
        w = time.perf_counter()
        batch = self.stream.next()
        out.wait_decode += time.perf_counter() - w
        return batch

    def _draws(self, batch: Batch) -> np.ndarray | None:
        """For sample_tokens: each computed image's key of its draw, the content digest of its bytes (so an image
        keeps its tokens whatever its row, and rows reused from another store, matched by digest, are drawn
        alike)."""
        if not self.worker.samples:
            return None
        return draw_keys([batch.digests[o] for o in batch.offsets])

    def _forward(self, batch: Batch, given: ShardInput, out: ShardOutput) -> None:
        """Record the batch's decode failures, send its images to the device, read back the batch before."""
        for off, err in batch.failed.items():
            out.fail(off, err)
        out.read(batch.digests, batch.prints)
        if batch.images is not None:
            offsets = np.asarray(batch.offsets)
            labels = given.labels[offsets] if given.labels is not None else None
            forwarded = self.worker.forward_rows(batch.images, labels, self._draws(batch))
            out.count(len(offsets), forwarded)
            # the indexed captures' tensors stay on the device until the batch is read back (ShardOutput._index)
            forwarded.device = {k: v for k, v in forwarded.device.items() if k in out.indexes and serves(v)}
            forwarded.reused = batch.reused  # filed with the batch's computed rows, in row order
            forwarded.release = batch.release  # its images' buffer: the stream's again once it is read back
            self._finish(self.read_back.push(out, offsets, forwarded))  # maybe the shard before's last batch
        elif batch.reused:  # every row of the batch taken from other stores
            self._finish(self.read_back.push(out, np.empty(0, np.int64), Forwarded({}, {}, None, batch.reused)))
        self._call(self.on_batch, len(batch.offsets) + len(batch.failed) + len(batch.reused))

    def _end(self, out: ShardOutput) -> None:
        """The shard's rows ran out: finish it now when nothing of it is in flight or no shard
        follows (its last batch read back), else when the next shard's first batch is sent."""
        self.shard_began = time.perf_counter()
        out.seconds = self.shard_began - out.started
        self.next.fetch(block=False)
        if not self.read_back.holds(out):  # this shard sent nothing to the device
            self._finish(self.read_back.settle(keep=None))
            out.close()
            self._finish(out)
        elif self.next.shard is None:  # nothing queued after it: finish it now rather than wait for more
            self._finish(self.read_back.settle(keep=None))
        if self.next.shard is None:
            self.next.fetch(block=True)  # wait for more (none, once the queue is closed)

    def _stop(self, shard: Shard, out: ShardOutput | None, err: BaseException) -> None:
        """Stop on ``err``: what the shard before computed is still written, and the error is
        raised as the failure of the shard at fault (see :func:`~extractor.faults.blame`)."""
        if out is not None:
            out.abandon()
        if not (out is not None and self.read_back.holds(out)):
            try:
                self._finish(self.read_back.settle(keep=None))
            except ShardError:
                self.put_back = shard  # the shard before failed as it was read back: this one is not at fault
                raise
        verdict = blame(err, shard.index, passes=(CallbackError,))
        if verdict == "another":
            self.put_back = shard
        if verdict != "this":
            raise err
        raise failed_shard(shard, err) from err

    def _finish(self, out: ShardOutput | None) -> None:
        """After ``out.close()``: its commit is made behind its last chunks."""
        if out is not None:
            self._call(self.on_computed, out.shard, out.hand_off())

    def _call(self, fn: Callable[..., None] | None, *args: Any) -> None:
        """A caller's callback: its errors go up as they are, never as a shard's failure."""
        if fn is not None:
            try:
                fn(*args)
            except Exception as err:
                raise CallbackError(err) from err


class CallbackError(Exception):
    """Carries an error raised by a caller's callback through ``run_shards`` unchanged."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


