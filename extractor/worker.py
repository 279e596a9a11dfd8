"""One worker: builds the model once, then processes shards start to end.

The same class runs in-process (local backend) and inside a Ray actor. A shard's rows are
decoded on a thread pool, forwarded through the hooked model, reduced on the device,
copied to the host, gathered into whole chunks and written to the store; the shard's
status and done marker are written last.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .capture import Capturer, Target, dim_names, resolve_targets
from .errors import LayerError, ModelError, ShardError
from .model import build_model, resolve_device
from .sources import Batch, ImageDecoder, JpegDecoder, Shard, describe_error, iter_batches
from .spec import JobSpec
from .stats import ShardStats
from .stats import dumps as stats_dumps
from .store import FAILED, OK, ShardWriter

__all__ = ["Worker", "ShardSummary"]

log = logging.getLogger(__name__)

_AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}
WRITE_QUEUE = 4  # chunks (of every capture) that may wait for the writer threads: bounds memory
WRITE_THREADS = 4  # chunks compressed and stored at once (zstd and zarr release the GIL)


def _drain(pending: deque[Future[None]]) -> None:
    """Wait for writes in flight, ignoring their errors (the shard is failing anyway)."""
    while pending:
        try:
            pending.popleft().result()
        except Exception:  # noqa: BLE001
            pass


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Worker:
    """Holds the model and its hooks' targets for the life of a job."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.device = resolve_device(spec.model.device)
        model, self.model_info = build_model(spec.model)
        self.targets: list[Target] = resolve_targets(model, spec.capture)
        model.requires_grad_(False)  # extraction never trains: gradients flow only from captured layers on
        self.channels_last = spec.model.channels_last
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.to(self.device)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels once
        self.decode = ImageDecoder(spec.data)
        self.jpeg: JpegDecoder | None = None
        if spec.data.decode_device == "cuda":
            if self.device.type != "cuda":
                raise ModelError(
                    f"data.decode_device: cuda needs the model on a CUDA GPU, but it runs on {self.device}; "
                    "set data.decode_device: cpu"
                )
            self.jpeg = JpegDecoder(spec.data, self.device)
        workers = spec.data.decode_workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="decode") if workers else None
        self.writer_pool = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="extractor-write")
        self.mean = torch.tensor(spec.data.mean, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(spec.data.std, device=self.device).view(1, 3, 1, 1)
        # the hooks stay registered for the worker's life; a compiled model traces them into its graph
        self.cap = Capturer(self.model, self.targets).__enter__()
        self.compiled = spec.model.compile
        if self.compiled:
            self.cap.forward = torch.compile(self.model)
        self._pinned: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        self._slot = 0
        self.captures: dict[str, dict[str, Any]] | None = None
        self.extras: dict[str, dict[str, Any]] = {}  # per-row results of gradient jobs (target, score, ...)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.writer_pool.shutdown(wait=True)
        self.cap.close()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = _AUTOCAST.get(self.spec.model.dtype)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _prepare(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B,3,H,W) on the host (or already on the device) -> normalised float on the device."""
        if self.device.type == "cuda" and images.device.type == "cpu" and not images.is_pinned():
            images = images.pin_memory()  # page-locked: the copy below runs asynchronously
        x = images.to(self.device, non_blocking=True).float().div_(255.0).sub_(self.mean).div_(self.std)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _forward(
        self, images: torch.Tensor, labels: np.ndarray | None = None, eager: bool = False
    ) -> dict[str, torch.Tensor]:
        """Captured tensors (on the device) for a uint8 batch: one hooked forward."""
        n = len(images)
        pad = self.compiled and not eager and n < self.spec.data.batch_size
        if pad:  # one static batch shape: the compiled graph is not rebuilt for a shard's last batch
            fill = self.spec.data.batch_size - n
            images = torch.cat([images, images.new_zeros((fill, *images.shape[1:]))])
            if labels is not None:
                labels = np.concatenate([labels, np.zeros(fill, labels.dtype)])
        # gradient jobs need autograd; every other job runs under inference_mode
        with torch.inference_mode(not self.cap.gradient), self._autocast():
            lab = torch.as_tensor(labels, device=self.device) if labels is not None else None
            out = self.cap.run(self._prepare(images), lab, eager=eager)
        return {k: v[:n] for k, v in out.items()} if pad else out

    def _to_host(self, values: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], Any]:
        """Start copying a batch's captures to the host. On CUDA the copies land in reusable
        page-locked buffers (two sets, used in turn) and run asynchronously: the returned
        event says when the arrays may be read. Elsewhere the arrays are ready at once."""
        if self.device.type != "cuda":
            return {k: v.cpu().numpy() for k, v in values.items()}, None
        self._slot ^= 1
        bufs = self._pinned[self._slot]
        host = {}
        for k, v in values.items():
            buf = bufs.get(k)
            if buf is None or buf.shape[0] < len(v) or buf.shape[1:] != v.shape[1:] or buf.dtype != v.dtype:
                buf = bufs[k] = torch.empty((max(len(v), self.spec.data.batch_size), *v.shape[1:]),
                                            dtype=v.dtype, pin_memory=True)
            buf[: len(v)].copy_(v, non_blocking=True)
            host[k] = buf[: len(v)].numpy()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return host, event

    def _forward_rows(self, images: torch.Tensor, labels: np.ndarray | None) -> _Done:
        """Forward a batch and start its copy to the host; the errors of images that make it raise.

        When the batch raises, each image is retried alone (eagerly, synchronously) so that
        only the bad ones fail their rows. When every image raises on its own too, the cause
        is not an image (a model or device error): that is raised, and fails the shard.
        """
        try:
            host, event = self._to_host(self._forward(images, labels))
            return _Done(host, {}, event)
        except (LayerError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:  # noqa: BLE001 - decided per image below
            if len(images) == 1:
                return _Done({}, {0: f"forward failed on this image: {describe_error(err)}"}, None)
            log.warning("a batch of %d raised %s: %s; retrying image by image", len(images), type(err).__name__, err)
        parts: list[dict[str, np.ndarray] | None] = []
        bad: dict[int, str] = {}
        last: Exception | None = None
        for i in range(len(images)):
            try:
                one = self._forward(images[i : i + 1], labels[i : i + 1] if labels is not None else None, eager=True)
                parts.append({k: v.cpu().numpy() for k, v in one.items()})
            except (LayerError, KeyboardInterrupt, SystemExit):
                raise
            except Exception as err:  # noqa: BLE001 - this image fails its row
                bad[i] = f"forward failed on this image: {describe_error(err)}"
                parts.append(None)
                last = err
        if len(bad) == len(images):
            assert last is not None
            raise last
        keys = next(p for p in parts if p is not None).keys()
        template = {k: next(p[k] for p in parts if p is not None) for k in keys}
        host = {k: np.concatenate([p[k] if p is not None else np.zeros_like(template[k]) for p in parts])
                for k in keys}
        return _Done(host, bad, None)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Captured tensors (on the device) for a uint8 batch: one hooked forward."""
        return self._forward(images)

    def probe(self) -> dict[str, dict[str, Any]]:
        """Run one blank image through the model: the stored shape and metadata of each capture."""
        crop = self.spec.data.crop
        blank = torch.zeros(1, 3, crop, crop, dtype=torch.uint8)
        values = self._forward(blank, np.zeros(1, np.int64), eager=True)
        original = dict(self.cap.original_shapes)
        if self.compiled:  # compile now, on a full blank batch: a failure is the model's, not an image's
            try:
                self._forward(blank, np.zeros(1, np.int64))
            except (LayerError, KeyboardInterrupt):
                raise
            except Exception as err:
                raise ModelError(
                    f"model.compile: torch.compile failed on this model: {describe_error(err)}; "
                    "set model.compile: false"
                ) from err
        modules = dict(self.model.named_modules())
        self.captures = {
            t.key: {
                "layer": t.layer,
                "module_type": type(modules[t.layer]).__name__,
                "what": t.what,
                "index": t.index,
                "reduce": t.reduce,
                "dtype": t.dtype,
                "shape": list(values[t.key].shape[1:]),
                "original_shape": list(original[t.key]),
                "dims": dim_names(t.key, original[t.key], t.reduce, t.what),
                "capture": t.capture,
                **({"target": t.target} if t.gradient else {}),
                **({"size": t.size} if t.what == "gradcam" else {}),
            }
            for t in self.targets
        }
        self.extras = {
            key: {
                "dtype": "int64" if key == "target" else "float32",
                "shape": list(v.shape[1:]),
                "dims": [f"{key}.minmax"] if key.endswith(".range") else [],
            }
            for key, v in values.items()
            if key not in self.captures
        }
        return self.captures

    def layout(self) -> dict[str, Any]:
        """What the driver needs to create the store: captures, per-row extras, the model."""
        if self.captures is None:
            self.probe()
        return {"captures": self.captures, "extras": self.extras, "model": self.model_info}

    def run_shard(
        self,
        shard: Shard,
        url: str,
        storage_options: dict[str, Any] | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> ShardSummary:
        """Process every row of ``shard`` and write it; returns once the done marker is written."""
        return self.start_shard(shard, url, storage_options, on_batch).result()

    def start_shard(
        self,
        shard: Shard,
        url: str,
        storage_options: dict[str, Any] | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> Future[ShardSummary]:
        """Forward every row of ``shard``; returns when the last batch is on the host, with a
        future that completes once the writer threads have stored the shard's last chunks and
        its done marker. Meanwhile the next shard can start: the device does not wait for storage.

        Batch i+1 is sent to the device before batch i's results are read on the host, so
        on a GPU the forward pass and the copies back overlap the host's bookkeeping.
        """
        if self.captures is None:
            self.probe()
        assert self.captures is not None
        t0 = time.perf_counter()
        so = storage_options if storage_options is not None else self.spec.output.storage_options
        writer = ShardWriter(url, shard.start, shard.stop, shard.index, so)
        paths = writer.locators()
        labels = writer.labels() if self.extras else None
        out = _ShardOutput(self, shard, writer)
        decoded = forward_failed = 0  # images that reached the model, and those that made it raise
        wait_decode = 0.0

        def failed(err: BaseException) -> ShardError:
            return ShardError(
                f"shard {shard.index} (rows {shard.start}-{shard.stop - 1}) failed: {type(err).__name__}: {err}"
            )

        try:
            previous: tuple[np.ndarray, _Done] | None = None
            batches = self._batches(paths)
            while True:
                t = time.perf_counter()
                batch = next(batches, None)
                wait_decode += time.perf_counter() - t
                if batch is None:
                    break
                for off, err in batch.failed.items():
                    out.fail(off, err)
                if batch.images is not None:
                    offsets = np.asarray(batch.offsets)
                    done = self._forward_rows(batch.images, labels[offsets] if labels is not None else None)
                    forward_failed += len(done.bad)
                    decoded += len(offsets)
                    if forward_failed == decoded and decoded >= min(len(shard), 2):
                        raise RuntimeError(f"every image so far made the model raise; last: {done.bad[max(done.bad)]}")
                    if previous is not None:
                        out.add(*previous)
                    previous = offsets, done
                if on_batch is not None:
                    on_batch(len(batch.offsets) + len(batch.failed))
            if previous is not None:
                out.add(*previous)
            out.close()
        except (KeyboardInterrupt, SystemExit):
            out.abandon()
            raise
        except Exception as err:
            out.abandon()
            raise failed(err) from err
        computed = time.perf_counter() - t0

        def complete() -> ShardSummary:
            try:
                out.complete()
            except Exception as err:
                raise failed(err) from err
            return ShardSummary(
                shard=shard.index,
                rows=len(shard),
                ok=int((out.status == OK).sum()),
                failed=int((out.status == FAILED).sum()),
                seconds=computed,
                bytes=writer.bytes,
                pid=os.getpid(),
                wait_decode=wait_decode,
                wait_device=out.wait_device,
                wait_write=out.wait_write,
            )

        # on the writer pool, behind this shard's chunk writes (FIFO: they are all started before it)
        return self.writer_pool.submit(complete)

    def _batches(self, paths: list[Any]) -> Iterator[Batch]:
        """Decoded batches of a shard's rows (decoded ``decode_workers`` ahead)."""
        if self.jpeg is not None:
            return iter_batches(paths, self.spec.data.batch_size, self.jpeg.read, self.pool, collate=self.jpeg.collate)
        return iter_batches(paths, self.spec.data.batch_size, self.decode, self.pool)


@dataclass
class _Done:
    """A forwarded batch: host arrays (readable once ``event`` has completed) and per-image errors."""

    host: dict[str, np.ndarray]
    bad: dict[int, str]  # batch position -> error
    event: Any  # torch.cuda.Event, or None when ``host`` is ready


class _ShardOutput:
    """One shard's results on the host: row status, chunk buffers handed to the writer thread
    (compression, storage and statistics happen there), per-row extras."""

    def __init__(self, worker: Worker, shard: Shard, writer: ShardWriter) -> None:
        assert worker.captures is not None
        self.shard, self.writer, self.pool = shard, writer, worker.writer_pool
        n = self.n = len(shard)
        self.chunk = worker.spec.output.chunk_rows
        self.status = np.zeros(n, dtype=np.uint8)
        self.errors = [""] * n
        self.buffers = {k: np.full((self.chunk, *m["shape"]), np.nan, dtype=m["dtype"])
                        for k, m in worker.captures.items()}
        self.extras = {k: np.full((n, *m["shape"]), -1 if m["dtype"] == "int64" else np.nan, dtype=m["dtype"])
                       for k, m in worker.extras.items()}
        self.stats = {k: ShardStats(m["dims"], m["shape"]) for k, m in worker.captures.items()}
        self.locks = {k: threading.Lock() for k in self.stats}  # a capture's statistics: one writer at a time
        self.current = 0  # index of the chunk being filled, relative to the shard
        self.pending: deque[list[Future[None]]] = deque()  # per chunk, its captures' writes in flight
        self.wait_device = self.wait_write = 0.0

    def fail(self, offset: int, err: str) -> None:
        self.status[offset], self.errors[offset] = FAILED, err

    def add(self, offsets: np.ndarray, done: _Done) -> None:
        """Record a forwarded batch whose rows are ``offsets`` (within the shard)."""
        if done.event is not None:
            t = time.perf_counter()
            done.event.synchronize()
            self.wait_device += time.perf_counter() - t
        for i, err in done.bad.items():
            self.fail(int(offsets[i]), err)
        host = done.host
        if done.bad:
            keep = np.setdiff1d(np.arange(len(offsets)), list(done.bad))
            offsets = offsets[keep]
            host = {k: v[keep] for k, v in host.items()}
        if not len(offsets):
            return
        for key, arr in self.extras.items():
            arr[offsets] = host[key]
        self.status[offsets] = OK
        chunk = self.chunk
        for c in np.unique(offsets // chunk):
            while self.current < c:
                self._flush()
            sel = (offsets // chunk) == c
            for key, buf in self.buffers.items():
                buf[offsets[sel] - c * chunk] = host[key][sel]

    def _write(self, key: str, c: int, buf: np.ndarray, ok: np.ndarray) -> None:
        """On a writer thread: compress and store one chunk of one capture, add it to the statistics."""
        start = c * self.chunk
        self.writer.write(key, start, buf[: len(ok)])
        rows = np.flatnonzero(ok)
        if len(rows):
            with self.locks[key]:
                self.stats[key].update(buf[rows], self.shard.start + start + rows)

    def _wait(self, futures: list[Future[None]]) -> None:
        t = time.perf_counter()
        for f in futures:
            f.result()
        self.wait_write += time.perf_counter() - t

    def _flush(self) -> None:
        """Hand the current chunk to the writer threads and start a fresh buffer; wait only when
        WRITE_QUEUE chunks are already in flight."""
        c = self.current
        full, self.buffers = self.buffers, {k: np.full_like(b, np.nan) for k, b in self.buffers.items()}
        ok = self.status[c * self.chunk : min((c + 1) * self.chunk, self.n)] == OK
        self.pending.append([self.pool.submit(self._write, k, c, buf, ok) for k, buf in full.items()])
        self.current += 1
        while len(self.pending) > WRITE_QUEUE:
            self._wait(self.pending.popleft())

    def close(self) -> None:
        """Hand the remaining chunks to the writer threads."""
        while self.current <= (self.n - 1) // self.chunk:
            self._flush()

    def complete(self) -> None:
        """Wait until every chunk is durable, then mark the shard done (on a writer thread)."""
        try:
            while self.pending:  # every chunk durable (or its error raised) before the shard is marked done
                for f in self.pending.popleft():
                    f.result()
            self.writer.finish(self.status, self.errors, self.extras, stats_dumps(self.stats))
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        _drain(deque(f for chunk in self.pending for f in chunk))
