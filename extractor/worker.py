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
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .batching import Batch, BatchStream
from .capture import ROOT, Capturer, Target, decide_layout, dim_names, resolve_targets
from .decode import ImageDecoder, JpegDecoder
from .errors import DeviceError, ExtractorError, FencedError, LayerError, ModelError, ShardError
from .faults import blame, describe_error, device_errors, device_fault, not_an_image, shard_failed
from .model import build_model, model_call, resolve_device
from .preprocess import Preprocess, from_dict
from .preprocess import resolve as resolve_preprocess
from .rows import Shard
from .spec import JobSpec
from .stats import ShardStats
from .stats import dumps as stats_dumps
from .store import FAILED, OK, CaptureRecord, ExtraRecord, ShardWriter

__all__ = ["Worker", "ShardSummary", "ShardQueue"]

log = logging.getLogger(__name__)

_AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}
WRITE_QUEUE = 4  # chunks (of every capture) that may wait for the writer threads: bounds memory
_INTERRUPTS: tuple[type[BaseException], ...] = (KeyboardInterrupt, *device_errors())  # never the model's fault
# errors the probe raises as they are; any other is the model's, on a blank image
_PROBE_PASSES: tuple[type[BaseException], ...] = (ExtractorError, torch.OutOfMemoryError, *_INTERRUPTS)
MAX_DECODE_THREADS = 32  # decode_workers: auto on a large machine
WRITE_THREADS = 4  # chunks compressed and stored at once (zstd and zarr release the GIL)


def decode_threads(setting: int | str, cpus: int | None = None) -> int:
    """The decode threads of ``data.decode_workers``: ``auto`` is one per CPU of the worker, at most
    MAX_DECODE_THREADS (Pillow decodes and resizes without the GIL; the window of rows decoded
    ahead, not the thread count, bounds memory)."""
    if setting != "auto":
        return int(setting)
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MAX_DECODE_THREADS))


def _preprocess(spec: JobSpec, defaults: dict[str, Any] | str) -> Preprocess:
    """The job's preprocessing: the model library's (``defaults``, or why none is known) under the spec's."""
    p = resolve_preprocess(spec.data, from_dict(defaults) if isinstance(defaults, dict) else defaults)
    auto = [f for f in ("resize", "crop", "interpolation", "mean", "std") if getattr(spec.data, f) == "auto"]
    if "has no preprocessing config" in p.source and auto and spec.data.preprocess == "auto":
        log.warning("%s: set data.%s, or data.preprocess: imagenet", p.source.split(", with")[0], ", data.".join(auto))
    return p


def _layers_hint(spec: JobSpec) -> str:
    """The command that lists this job's model's layers."""
    if spec.model.factory:
        return f"extractor layers --factory {spec.model.factory}"
    return f"extractor layers {spec.model.name} --input-size N (or extractor layers JOB.yaml)"


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

    def __init__(self, spec: JobSpec, cpus: int | None = None, model: torch.nn.Module | None = None,
                 batches: Callable[[], Any] | None = None) -> None:
        """``cpus``: how many CPUs this worker may use (a Ray actor's share of its node), for
        ``data.decode_workers: auto``; default, those this process may run on. ``model``: a module
        made in Python (``extractor.run(..., model=...)``), used instead of building one; its
        mode and parameters' ``requires_grad`` are given back by :meth:`close`. ``batches``: makes
        the batch source of each ``run_shards`` call, an object with ``add(locators)`` and
        ``next() -> Batch | None`` as :class:`~extractor.batching.BatchStream` (default: the
        images decoded from the store's paths; benchmarks: pre-decoded tensors)."""
        self._batches = batches
        self.spec = spec
        self.device = resolve_device(spec.model.device)
        # a caller's module is given back in its mode, with its requires_grad flags (close)
        self._given = (model, model.training, [(p, p.requires_grad) for p in model.parameters()]) \
            if model is not None else None
        model, self.model_info = build_model(spec.model, model)
        self.preprocess = _preprocess(spec, self.model_info["preprocess_defaults"])
        self.targets: list[Target] = resolve_targets(model, spec.capture, _layers_hint(spec),
                                                     self.model_info["prefix_tokens"])
        model.requires_grad_(False)  # extraction never trains: gradients flow only from captured layers on
        self.channels_last = spec.model.channels_last
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.to(self.device)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels once
        self.decode = ImageDecoder(spec.data, self.preprocess)
        self.jpeg: JpegDecoder | None = None
        if spec.data.decode_device == "cuda":
            if self.device.type != "cuda":
                raise ModelError(
                    f"data.decode_device: cuda needs the model on a CUDA GPU, but it runs on {self.device}; "
                    "set data.decode_device: cpu"
                )
            self.jpeg = JpegDecoder(spec.data, self.device, self.preprocess)
        workers = decode_threads(spec.data.decode_workers, cpus)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="decode") if workers else None
        self.writer_pool = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="extractor-write")
        # opens the next shard's store arrays and reads its row list while the current shard computes
        self.prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="extractor-prepare")
        self.spare: dict[str, deque[np.ndarray]] = {}  # chunk buffers whose write is done, per capture
        self.mean = torch.tensor(self.preprocess.mean, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(self.preprocess.std, device=self.device).view(1, 3, 1, 1)
        # the hooks stay registered for the worker's life; a compiled model traces them into its graph
        entry = model_call(self.model, spec.model)
        self.cap = Capturer(self.model, self.targets, entry=entry).__enter__()
        self.compiled = spec.model.compile
        if self.compiled:
            self.cap.forward = torch.compile(entry)
        self.warm = not self.compiled  # compiled, and its graph built (warm_up)
        self._pinned: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        self._slot = 0
        self.captures: dict[str, CaptureRecord] | None = None
        self.extras: dict[str, ExtraRecord] = {}  # per-row results of gradient jobs (target, score, ...)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.writer_pool.shutdown(wait=True)
        self.prepare_pool.shutdown(wait=True)
        self.cap.close()
        if self._given is not None:  # a caller's module: as it was given, but for its device
            module, training, flags = self._given
            module.train(training)
            for p, flag in flags:
                p.requires_grad_(flag)

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

    def _forward_rows(self, images: torch.Tensor, labels: np.ndarray | None) -> _Forwarded:
        """Forward a batch and start its copy to the host; the errors of images that make it raise.

        When the batch raises, each image is retried alone (eagerly, synchronously) so that
        only the bad ones fail their rows. When every image raises on its own too, the cause
        is not an image (a model or device error): that is raised, and fails the shard.
        """
        try:
            host, event = self._to_host(self._forward(images, labels))
            return _Forwarded(host, {}, event)
        except not_an_image():
            raise
        except Exception as err:  # noqa: BLE001 - decided per image below
            if len(images) == 1:
                return _Forwarded({}, {0: f"forward failed on this image: {describe_error(err)}"}, None)
            log.warning("a batch of %d raised %s: %s; retrying image by image", len(images), type(err).__name__, err)
        parts: list[dict[str, np.ndarray] | None] = []
        bad: dict[int, str] = {}
        last: Exception | None = None
        for i in range(len(images)):
            try:
                one = self._forward(images[i : i + 1], labels[i : i + 1] if labels is not None else None, eager=True)
                parts.append({k: v.cpu().numpy() for k, v in one.items()})
            except not_an_image():
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
        return _Forwarded(host, bad, None)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Captured tensors (on the device) for a uint8 batch: one hooked forward."""
        return self._forward(images)

    def _blank(self, size: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """One blank image at the model's input size (or ``size``) through the hooked model, eagerly."""
        h, w = size or self.preprocess.size
        return self._forward(torch.zeros(1, 3, h, w, dtype=torch.uint8), np.zeros(1, np.int64), eager=True)

    def probe(self) -> dict[str, CaptureRecord]:
        """Run one blank image through the model: the stored shape and metadata of each capture.
        4-D outputs left at ``layout: auto`` are decided here (see :func:`decide_layout`)."""
        h, w = self.preprocess.size
        d = self.spec.data
        size_from = "data.crop" if d.crop not in ("auto", None) else "data.resize" if d.crop is None and \
            d.resize != "auto" else f"the input size from {self.preprocess.source}"
        try:
            values = self._blank()
            if self._decide_layouts():
                values = self._blank()  # again, reduced as decided
        except _PROBE_PASSES:
            raise
        except Exception as err:
            raise ModelError(
                f"the model failed on a blank {h}x{w} image ({size_from}), before any image was read: "
                f"{describe_error(err)}. If it expects another input size, set data.crop (and "
                "data.resize) to it; if it takes its input another way, see model.call, model.input and "
                "model.forward_kwargs"
            ) from err
        self.targets = self.cap.targets
        original = dict(self.cap.original_shapes)
        if self.cap.logits is not None:  # a gradient job: labels (target: label) must be among them
            self.model_info = {**self.model_info, "logits": self.cap.logits}
        modules = dict(self.model.named_modules())
        self.captures = {t.key: _record(t, modules[t.layer], values[t.key].shape[1:], original[t.key])
                         for t in self.targets}
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

    def _decide_layouts(self) -> bool:
        """Decide ``layout: auto`` for the 4-D outputs whose layout matters (reduced, stored whole,
        Grad-CAM) from facts; refuse when none decides. True when the blank must run again: a
        decided layout reduces otherwise than the provisional ``nchw`` did."""
        modules = dict(self.model.named_modules())
        shapes = dict(self.cap.original_shapes)
        for t in self.targets:  # a layout given in the spec that the facts contradict: said, then obeyed
            if t.layout != "auto" and len(shapes.get(t.key, ())) == 3:
                fact = decide_layout(modules[t.layer] if t.layer else None, shapes[t.key], None, None)
                if fact is not None and fact != t.layout:
                    log.warning("capture[%d] %s: layout %s is given, but layer %r (%s) gives %s outputs; its outputs "
                                "are %s (see the README's capture section)", t.capture, t.key, t.layout,
                                t.layer or ROOT, type(modules[t.layer]).__name__, fact, fact)
        auto = [t for t in self.targets if t.layout == "auto" and len(shapes.get(t.key, ())) == 3]
        # flattened, a 4-D output's layout changes nothing: nchw, so that no batch looks at it again
        layouts: dict[str, str] = {t.key: "nchw" for t in auto if t.reduce == "flatten" and t.what != "gradcam"}
        undecided = [t for t in auto if t.key not in layouts]
        if not auto:
            return False
        other: dict[str, tuple[int, ...]] | None = None
        for t in undecided:
            module = modules[t.layer] if t.layer else None
            layout = decide_layout(module, shapes[t.key], self.cap.auto_4d.get(t.key), None)
            if layout is None:
                if other is None:
                    other = self._shapes_at_another_size()
                layout = decide_layout(None, shapes[t.key], None, other.get(t.key))
            if layout is None:
                raise LayerError(
                    f"capture[{t.capture}] {t.key}: layer {t.layer or ROOT!r} ({type(modules[t.layer]).__name__}) "
                    "gives "
                    f"{'x'.join(map(str, shapes[t.key]))} outputs whose layout extractor cannot tell (not a module "
                    "type it knows, and the model does not run at another input size to see which dims grow); set "
                    f"capture[{t.capture}].layout: nchw (channel, y, x), nhwc (y, x, channel) or attention "
                    "(head, query, key)"
                )
            log.info("capture[%d] %s: layout %s", t.capture, t.key, layout)
            layouts[t.key] = layout
        self.cap.set_layouts(layouts)
        self.targets = self.cap.targets
        return any(layout != "nchw" and (t.reduce in ("mean", "max") or t.what == "gradcam")
                   for t in self.targets if (layout := layouts.get(t.key)) is not None)

    def _shapes_at_another_size(self) -> dict[str, tuple[int, ...]]:
        """The captures' shapes for a blank image 32 pixels larger each way ({} when the model refuses it)."""
        h, w = self.preprocess.size
        shapes = self.cap.original_shapes  # the input size's: what the store records
        try:
            self._blank((h + 32, w + 32))
            return dict(self.cap.original_shapes)
        except _INTERRUPTS:
            raise
        except Exception:  # noqa: BLE001 - a model with a fixed input size: this fact is not to be had
            return {}
        finally:
            self.cap.original_shapes = shapes

    def warm_up(self) -> None:
        """Compile the model now (once), on a full blank batch, so that a failure is the model's,
        not an image's. A no-op for an eager model. The runner calls it before creating a store,
        and only when there is something to compute: a resume of a finished store compiles nothing."""
        if self.warm:
            return
        h, w = self.preprocess.size
        try:
            self._forward(torch.zeros(1, 3, h, w, dtype=torch.uint8), np.zeros(1, np.int64))
        except (LayerError, KeyboardInterrupt):
            raise
        except torch.OutOfMemoryError as err:
            raise ModelError(
                f"out of memory on the {self.device} while compiling the model on a full batch of "
                f"{self.spec.data.batch_size} (data.batch_size): lower data.batch_size"
            ) from err
        except device_errors() as err:
            raise DeviceError(f"the {self.device} device failed while compiling the model: {describe_error(err)}") \
                from err
        except Exception as err:
            raise ModelError(
                f"model.compile: torch.compile failed on this model: {describe_error(err)}; set model.compile: false"
            ) from err
        self.warm = True

    def layout(self) -> dict[str, Any]:
        """What the driver needs to create the store: captures, per-row extras, the model."""
        if self.captures is None:
            self.probe()
        return {"captures": self.captures, "extras": self.extras, "model": self.model_info,
                "preprocess": self.preprocess.to_dict()}

    def run_shard(
        self,
        shard: Shard,
        url: str,
        storage_options: dict[str, Any] | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> ShardSummary:
        """Process every row of ``shard`` and write it; returns once the done marker is written."""
        computed: list[Future[ShardSummary]] = []
        self.run_shards([shard], url, storage_options, on_batch, lambda _shard, future: computed.append(future))
        return computed[0].result()

    def run_shards(
        self,
        shards: Sequence[Shard] | ShardQueue,
        url: str,
        storage_options: dict[str, Any] | None = None,
        on_batch: Callable[[int], None] | None = None,
        on_computed: Callable[[Shard, Future[ShardSummary]], None] | None = None,
        on_started: Callable[[Shard], None] | None = None,
        fence: str | None = None,
    ) -> None:
        """Forward every row of ``shards``, one after another, in one pipeline that does not
        drain between shards. ``fence``: the job's lease token; a shard writes nothing once another
        job holds the store (:class:`FencedError`, which stops the pipeline).

        ``on_started(shard)`` is called as a shard's first batch is read, ``on_computed(shard,
        future)`` in shard order once a shard's last batch is on the host; the future completes
        once the writer threads have stored its last chunks and its done marker (or raises the
        ShardError that stopped them). Meanwhile the next shard computes: the device never
        waits for storage. A failing shard raises its ShardError here, after ``on_computed``
        for every shard before it. ``shards`` may be a :class:`ShardQueue` that others fill:
        this returns once it is closed and empty.

        Batch i+1 is sent to the device before batch i's results are read on the host, also
        across a shard boundary; the next shard's store arrays and row list are read on a
        helper thread, and its first images decoded, while the current shard computes.
        """
        if self.captures is None:
            self.probe()
        self.warm_up()
        so = storage_options if storage_options is not None else self.spec.output.storage_options
        if not isinstance(shards, ShardQueue):
            shards = ShardQueue(shards)
            shards.close()  # a fixed list: nothing more will come
        try:
            _Pipeline(self, shards, url, so, on_batch, on_computed, on_started, fence).run()
        except Exception as err:
            fault = device_fault(err)
            if fault is None:
                raise
            where = f" while shard {err.shard} was running" if isinstance(err, ShardError) else ""
            raise DeviceError(
                f"the {self.device} device failed{where}: {describe_error(fault)}. Its context in this process "
                "cannot be trusted again, so the worker stops; finished shards are kept. On Ray the worker is "
                "replaced and its shards redone; locally, run the same command with --resume. (A CUDA error can "
                "surface one batch after the operation that caused it; if it recurs at the same rows, set "
                "CUDA_LAUNCH_BLOCKING=1 to find it.)"
            ) from fault

    def batches(self) -> Any:
        """Where a ``run_shards`` call's batches come from: the ``batches`` given, or the shards'
        images decoded ``decode_workers`` ahead, across shards."""
        if self._batches is not None:
            return self._batches()
        bs = self.spec.data.batch_size
        if self.jpeg is not None:
            return BatchStream(bs, self.jpeg.read, self.pool, collate=self.jpeg.collate)
        return BatchStream(bs, self.decode, self.pool, collate=_stack_pinned if self.device.type == "cuda" else None)


class ShardQueue:
    """Shards for a running pipeline: ``put`` from any thread, ``close`` once no more will come.
    ``Worker.run_shards`` on a queue that stays open keeps its pipeline across calls (a Ray
    actor fed by the driver)."""

    def __init__(self, shards: Iterable[Shard] = ()) -> None:
        self.items: deque[Shard] = deque(shards)
        self.cond = threading.Condition()
        self.closed = False

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

    def get(self, block: bool) -> Shard | None:
        """The next shard; None when there is none now (``block=False``) or ever (closed)."""
        with self.cond:
            while block and not self.items and not self.closed:
                self.cond.wait()
            return self.items.popleft() if self.items else None


class _NextShard:
    """The look-ahead: the shard after the current one, taken from the queue and opened on the
    prepare thread (its store arrays and row list read) while the current one computes; its
    rows join the batch stream as soon as it is open, so its first images decode meanwhile."""

    def __init__(self, worker: Worker, shards: ShardQueue, stream: Any, url: str,
                 storage_options: dict[str, Any] | None, fence: str | None) -> None:
        self.worker, self.shards, self.stream = worker, shards, stream
        self.url, self.so, self.fence = url, storage_options, fence
        self.shard: Shard | None = None
        self.opening: Future[_ShardInput] | None = None
        self.queued = False  # its rows are in the stream

    def fetch(self, block: bool) -> None:
        """Take the next shard from the queue (waiting for one when ``block``) and start opening it."""
        if self.shard is None and (shard := self.shards.get(block)) is not None:
            self.shard, self.queued = shard, False
            self.opening = self.worker.prepare_pool.submit(_ShardInput.open, shard, self.url, self.so,
                                                           bool(self.worker.extras), self.fence)

    def feed(self) -> None:
        """Once it is open, add its rows to the stream."""
        if self.opening is not None and not self.queued and self.opening.done() and self.opening.exception() is None:
            self.stream.add(self.opening.result().paths)
            self.queued = True

    def take(self) -> tuple[Shard, _ShardInput]:
        """It becomes the current shard: its input (raising its opening error), its rows in the stream."""
        assert self.shard is not None and self.opening is not None
        shard, opening, queued = self.shard, self.opening, self.queued
        self.shard = self.opening = None
        given = opening.result()
        if not queued:
            self.stream.add(given.paths)
        return shard, given


class _ReadBack:
    """The one-batch read-back lag: the batch last sent to the device is read into its shard's
    output only after the next batch is sent, also across a shard boundary, so the device
    never waits for the host. At most two batches are in flight at once: the worker's two
    sets of page-locked host buffers, used in turn, are never overwritten before read."""

    def __init__(self) -> None:
        self.pending: tuple[_ShardOutput, np.ndarray, _Forwarded] | None = None  # sent, not read back

    def holds(self, out: _ShardOutput) -> bool:
        """The batch in flight is ``out``'s."""
        return self.pending is not None and self.pending[0] is out

    def push(self, out: _ShardOutput, offsets: np.ndarray, forwarded: _Forwarded) -> _ShardOutput | None:
        """A batch was just sent: read back the one before it. Returns the shard output that read
        its last batch then (the shard before ``out``), closed: the caller finishes it."""
        done = self.settle(keep=out)
        self.pending = out, offsets, forwarded
        return done

    def settle(self, keep: _ShardOutput | None) -> _ShardOutput | None:
        """Read back the batch in flight. Its shard's output, when it is not ``keep``, is closed
        (its last chunks handed to the writers) and returned for the caller to finish."""
        if self.pending is None:
            return None
        (out, offsets, forwarded), self.pending = self.pending, None
        try:
            out.add(offsets, forwarded)
            if out is not keep:
                out.close()
        except BaseException as err:
            out.abandon()
            if not isinstance(err, Exception):
                raise
            raise _failed(out.shard, err) from err
        return None if out is keep else out


class _Pipeline:
    """One call of ``Worker.run_shards``: the shards' batches come from one stream, the next
    shard opens ahead (:class:`_NextShard`), and each batch is read back after the next one is
    sent (:class:`_ReadBack`), whichever shard either belongs to. When no shard is queued as a
    shard's rows run out, the pipeline drains, so that shard is finished before waiting for more."""

    def __init__(self, worker: Worker, shards: ShardQueue, url: str, storage_options: dict[str, Any] | None,
                 on_batch: Callable[[int], None] | None,
                 on_computed: Callable[[Shard, Future[ShardSummary]], None] | None,
                 on_started: Callable[[Shard], None] | None, fence: str | None = None) -> None:
        self.worker, self.shards = worker, shards
        self.on_batch, self.on_computed, self.on_started = on_batch, on_computed, on_started
        self.stream = worker.batches()
        self.next = _NextShard(worker, shards, self.stream, url, storage_options, fence)
        self.read_back = _ReadBack()
        self.put_back: Shard | None = None  # a started shard that another one's failure interrupted
        self.t = time.perf_counter()  # when the current shard began (the previous one's rows ran out)

    def run(self) -> None:
        """Every shard of the queue until it is closed and empty. On a failure, the shards not at
        fault go back to the front of the queue: the one opened ahead, and the current one when
        the shard before it failed as its last batch was read back."""
        try:
            self.next.fetch(block=True)
            while self.next.shard is not None:
                self._shard()
            self._finish(self.read_back.settle(keep=None))  # the last shard's last batch
        except _CallbackError as err:
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
            out = _ShardOutput(self.worker, given, started=self.t)
            self._call(self.on_started, shard)
            while (batch := self._next_batch(out)) is not None:
                self._forward(batch, given, out)
            self._end(out)
        except BaseException as err:  # noqa: BLE001 - raised again by _stop, as the failure of the shard at fault
            self._stop(shard, out, err)

    def _next_batch(self, out: _ShardOutput) -> Batch | None:
        """The shard's next decoded batch (None at its end); meanwhile the next shard opens."""
        self.next.fetch(block=False)
        self.next.feed()
        w = time.perf_counter()
        batch = self.stream.next()
        out.wait_decode += time.perf_counter() - w
        return batch

    def _forward(self, batch: Batch, given: _ShardInput, out: _ShardOutput) -> None:
        """Record the batch's decode failures, send its images to the device, read back the batch before."""
        for off, err in batch.failed.items():
            out.fail(off, err)
        if batch.images is not None:
            offsets = np.asarray(batch.offsets)
            labels = given.labels[offsets] if given.labels is not None else None
            forwarded = self.worker._forward_rows(batch.images, labels)
            out.count(len(offsets), forwarded)
            self._finish(self.read_back.push(out, offsets, forwarded))  # maybe the shard before's last batch
        self._call(self.on_batch, len(batch.offsets) + len(batch.failed))

    def _end(self, out: _ShardOutput) -> None:
        """The shard's rows ran out: finish it now when nothing of it is in flight or no shard
        follows (its last batch read back), else when the next shard's first batch is sent."""
        self.t = time.perf_counter()
        out.seconds = self.t - out.started
        self.next.fetch(block=False)
        if not self.read_back.holds(out):  # this shard sent nothing to the device
            self._finish(self.read_back.settle(keep=None))
            out.close()
            self._finish(out)
        elif self.next.shard is None:  # nothing queued after it: finish it now rather than wait for more
            self._finish(self.read_back.settle(keep=None))
        if self.next.shard is None:
            self.next.fetch(block=True)  # wait for more (none, once the queue is closed)

    def _stop(self, shard: Shard, out: _ShardOutput | None, err: BaseException) -> None:
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
        verdict = blame(err, shard.index, passes=(_CallbackError,))
        if verdict == "another":
            self.put_back = shard
        if verdict != "this":
            raise err
        raise _failed(shard, err) from err

    def _finish(self, out: _ShardOutput | None) -> None:
        """After ``out.close()``: its done marker is written behind its last chunks."""
        if out is not None:
            self._call(self.on_computed, out.shard, out.hand_off())

    def _call(self, fn: Callable[..., None] | None, *args: Any) -> None:
        """A caller's callback: its errors go up as they are, never as a shard's failure."""
        if fn is not None:
            try:
                fn(*args)
            except Exception as err:
                raise _CallbackError(err) from err


def _stack_pinned(items: list[torch.Tensor]) -> tuple[torch.Tensor, dict[int, str]]:
    """Stack a batch straight into page-locked memory (one copy, not two): its upload runs asynchronously."""
    out = torch.empty((len(items), *items[0].shape), dtype=items[0].dtype, pin_memory=True)
    return torch.stack(items, out=out), {}


class _CallbackError(Exception):
    """Carries an error raised by a caller's callback through ``run_shards`` unchanged."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _record(t: Target, module: torch.nn.Module, shape: Sequence[int], original: Sequence[int]) -> CaptureRecord:
    """How capture ``t`` is stored: ``shape`` per row as stored, ``original`` as the model computed it."""
    record: CaptureRecord = {
        "layer": t.layer,
        "module_type": type(module).__name__,
        "what": t.what,
        "index": t.index,
        "reduce": t.reduce,
        "dtype": t.dtype,
        "shape": list(shape),
        "original_shape": list(original),
        "dims": dim_names(t.key, tuple(original), t.reduce, t.what, t.layout),
        "capture": t.capture,
    }
    if t.drop_prefix:
        record["drop_prefix"] = t.drop_prefix
    if t.gradient and t.target is not None:
        record["target"] = t.target
    if t.what == "gradcam":
        record["size"] = t.size
    return record


def _failed(shard: Shard, err: BaseException) -> ShardError:
    return shard_failed(shard.index, shard.start, shard.stop, err)


@dataclass
class _ShardInput:
    """What a shard needs before its first batch, read on the prepare thread: its writer
    (store arrays opened), its rows' locators and, for gradient jobs, its labels."""

    shard: Shard
    writer: ShardWriter
    paths: list[Any]
    labels: np.ndarray | None

    @classmethod
    def open(cls, shard: Shard, url: str, storage_options: dict[str, Any] | None, labels: bool,
             fence: str | None = None) -> _ShardInput:
        writer = ShardWriter(url, shard.start, shard.stop, shard.index, storage_options, fence)
        return cls(shard, writer, writer.locators(), writer.labels() if labels else None)


@dataclass
class _Forwarded:
    """A forwarded batch: host arrays (readable once ``event`` has completed) and per-image errors."""

    host: dict[str, np.ndarray]
    bad: dict[int, str]  # batch position -> error
    event: Any  # torch.cuda.Event, or None when ``host`` is ready


class _ShardOutput:
    """One shard's results on the host: row status, chunk buffers handed to the writer threads
    (compression, storage and statistics happen there), per-row extras, timings."""

    def __init__(self, worker: Worker, given: _ShardInput, started: float) -> None:
        assert worker.captures is not None
        self.shard, self.writer, self.pool = given.shard, given.writer, worker.writer_pool
        self.started, self.seconds = started, 0.0
        n = self.n = len(self.shard)
        self.chunk = worker.spec.output.chunk_rows
        self.status = np.zeros(n, dtype=np.uint8)
        self.errors = [""] * n
        self.spare = worker.spare
        self.shapes = {k: (self.chunk, *m["shape"]) for k, m in worker.captures.items()}
        self.dtypes = {k: np.dtype(m["dtype"]) for k, m in worker.captures.items()}
        self.buffers = {k: self._buffer(k) for k in self.shapes}
        self.extras = {k: np.full((n, *m["shape"]), -1 if m["dtype"] == "int64" else np.nan, dtype=m["dtype"])
                       for k, m in worker.extras.items()}
        self.stats = {k: ShardStats(m["dims"], m["shape"]) for k, m in worker.captures.items()}
        self.locks = {k: threading.Lock() for k in self.stats}  # a capture's statistics: one writer at a time
        self.current = 0  # index of the chunk being filled, relative to the shard
        self.pending: deque[list[Future[None]]] = deque()  # per chunk, its captures' writes in flight
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

    def count(self, images: int, done: _Forwarded) -> None:
        """Fail the shard when every image so far made the model raise: the cause is not the images."""
        self.forward_failed += len(done.bad)
        self.decoded += images
        if self.forward_failed == self.decoded and self.decoded >= min(self.n, 2):
            raise RuntimeError(f"every image so far made the model raise; last: {done.bad[max(done.bad)]}")

    def fail(self, offset: int, err: str) -> None:
        self.status[offset], self.errors[offset] = FAILED, err

    def add(self, offsets: np.ndarray, done: _Forwarded) -> None:
        """Record a forwarded batch whose rows are ``offsets`` (within the shard, ascending)."""
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
        if offsets[-1] - offsets[0] == len(offsets) - 1:  # consecutive rows (the usual case): copy slices
            pos, row = 0, int(offsets[0])
            while pos < len(offsets):
                c = row // chunk
                while self.current < c:
                    self._flush()
                n = min(len(offsets) - pos, (c + 1) * chunk - row)
                for key, buf in self.buffers.items():
                    buf[row - c * chunk : row - c * chunk + n] = host[key][pos : pos + n]
                pos, row = pos + n, row + n
            return
        for c in np.unique(offsets // chunk):
            while self.current < c:
                self._flush()
            sel = (offsets // chunk) == c
            for key, buf in self.buffers.items():
                buf[offsets[sel] - c * chunk] = host[key][sel]

    def _write(self, key: str, c: int, buf: np.ndarray, ok: np.ndarray) -> None:
        """On a writer thread: compress and store one chunk of one capture, add it to the statistics,
        give the buffer back. (Stores opened by URL copy what they are given, so a buffer is
        free once written; zarr's in-memory MemoryStore object would keep it.)"""
        start = c * self.chunk
        rows = np.flatnonzero(ok)
        if len(rows) < len(ok):
            buf[np.flatnonzero(~ok)] = np.nan  # failed rows, and what a recycled buffer held there
        self.writer.write(key, start, buf[: len(ok)])
        if len(rows):
            with self.locks[key]:
                self.stats[key].update(buf[rows], self.shard.start + start + rows)
        self.spare[key].append(buf)

    def _wait(self, futures: list[Future[None]]) -> None:
        t = time.perf_counter()
        for f in futures:
            f.result()
        self.wait_write += time.perf_counter() - t

    def _flush(self) -> None:
        """Hand the current chunk to the writer threads and take fresh buffers; wait only when
        WRITE_QUEUE chunks are already in flight."""
        c = self.current
        more = c < (self.n - 1) // self.chunk  # a chunk after this one: it needs buffers
        full, self.buffers = self.buffers, {k: self._buffer(k) for k in self.buffers} if more else {}
        ok = self.status[c * self.chunk : min((c + 1) * self.chunk, self.n)] == OK
        self.pending.append([self.pool.submit(self._write, k, c, buf, ok) for k, buf in full.items()])
        self.current += 1
        while len(self.pending) > WRITE_QUEUE:
            self._wait(self.pending.popleft())

    def close(self) -> None:
        """Hand the remaining chunks to the writer threads."""
        while self.current <= (self.n - 1) // self.chunk:
            self._flush()

    def hand_off(self) -> Future[ShardSummary]:
        """Queue ``complete`` behind this shard's chunk writes (the writer threads take tasks in order)."""
        self.handed_off = True
        return self.pool.submit(self.complete)

    def complete(self) -> ShardSummary:
        """On a writer thread: wait until every chunk is durable, then mark the shard done."""
        try:
            while self.pending:  # every chunk durable (or its error raised) before the shard is marked done
                for f in self.pending.popleft():
                    f.result()
            self.writer.finish(self.status, self.errors, self.extras, stats_dumps(self.stats))
        except BaseException as err:
            _drain(deque(f for chunk in self.pending for f in chunk))
            if isinstance(err, Exception) and not isinstance(err, FencedError):
                raise _failed(self.shard, err) from err
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
        )

    def abandon(self) -> None:
        """Wait for this shard's writes in flight, ignoring their errors; no done marker. A no-op
        once the shard is handed off: ``complete`` owns it then."""
        if not self.handed_off:
            _drain(deque(f for chunk in self.pending for f in chunk))
