"""One worker: builds the model once, then processes shards start to end.

The same class runs in-process (local backend) and inside a Ray actor. A shard's rows are
decoded on a thread pool, forwarded through the hooked model, reduced on the device,
copied to the host, gathered into whole chunks and written to the store; the shard's
status and done marker are written last. This module holds the model's side (build, the
hooked forward; its probe and layouts: :mod:`.probe`); :mod:`.pipeline` runs the shards
through it and :mod:`.shard` gathers their results.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .._machine import Machine
from ..data import BatchStream, ImageDecoder, JpegDecoder, Preprocess, Shard, Slots, forget_reads, from_dict
from ..errors import DeviceError, LayerError, ModelError, ShardError
from ..faults import describe_error, device_errors, device_fault, not_an_image
from ..model import (
    Capturer,
    Target,
    build_with_processor,
    claim_of,
    model_call,
    model_prefix,
    resolve_device,
    resolve_targets,
    settle_preprocess,
    token_facts,
)
from ..spec import JobSpec
from ..store import (
    FORMAT_VERSION,
    CaptureRecord,
    ExtraRecord,
    ReuseIndex,
    Ticket,
)
from .pipeline import Pipeline, ShardQueue
from .probe import Probing, host_array
from .shard import Forwarded, ShardSummary

__all__ = ["PROBE_FORWARDS", "Worker", "decode_threads", "host_array"]

log = logging.getLogger(__name__)

_AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_DECODE_THREADS = 32  # decode_workers: auto on a large machine
# forwards of one image a worker makes before its first shard: the token facts, the probe's blank (again when a
# layout decided at the probe reduces otherwise), two for determinism and one under rounding noise (tests count
# the model's calls)
PROBE_FORWARDS = 5


def decode_threads(setting: int | str, cpus: int | None = None) -> int:
    """The decode threads of ``data.decode_workers``: ``auto`` is one per CPU of the worker (``cpus``, or
    :meth:`Machine.here`'s), at most MAX_DECODE_THREADS (Pillow decodes and resizes without the GIL; the window of
    rows decoded ahead, not the thread count, bounds memory)."""
    if setting != "auto":
        return int(setting)
    return max(1, min(Machine.here(cpus).cpus, MAX_DECODE_THREADS))


def _preprocess(spec: JobSpec, defaults: dict[str, Any] | str, processor: Any) -> tuple[Preprocess, Any]:
    """The job's preprocessing record and transform stage: the model library's (``defaults``, or why none is
    known: then the spec must give every setting; taken where the probe shows it equal to ``processor``, the
    library's own) under the spec's, or ``processor`` itself (``data.preprocess: library``)."""
    return settle_preprocess(spec.data, from_dict(defaults) if isinstance(defaults, dict) else defaults, processor)


def _layers_hint(spec: JobSpec) -> str:
    """The command that lists this job's model's layers."""
    if (spec.model.name or "").startswith("python:"):  # a module made in Python (extractor.run(..., model=...))
        return "[name for name, _ in model.named_modules()]"
    if spec.model.factory:
        return f"extractor layers --factory {spec.model.factory}"
    return f"extractor layers {spec.model.name} --input-size N (or extractor layers JOB.yaml)"


def _stitched(parts: list[dict[str, np.ndarray] | None]) -> dict[str, np.ndarray]:
    """One batch's values from its images' (one row each), zeros for the images that raised (None)."""
    done = [p for p in parts if p is not None]
    return {k: np.concatenate([p[k] if p is not None else np.zeros_like(done[0][k]) for p in parts])
            for k in done[0]}


class _CallersModule:
    """A caller's module (``extractor.run(..., model=...)``) as it was given: the mode of each of
    its modules, and each parameter's ``requires_grad`` and strides (the job makes them
    channels_last); :meth:`restore` puts them back. Not its device: it stays on the job's."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.modes = [(m, m.training) for m in module.modules()]
        self.params = [(p, p.requires_grad, p.stride()) for p in module.parameters()]

    def restore(self) -> None:
        for m, training in self.modes:
            m.training = training
        for p, flag, stride in self.params:
            p.requires_grad_(flag)
            if p.stride() != stride:
                p.data = torch.empty_strided(p.shape, stride, dtype=p.dtype, device=p.device).copy_(p.data)


class Worker(Probing):
    """Holds the model and its hooks' targets for the life of a job."""

    def __init__(self, spec: JobSpec, cpus: int | None = None, model: torch.nn.Module | None = None,
                 batches: Callable[[], Any] | None = None) -> None:
        """``cpus``: how many CPUs this worker may use (a Ray actor's share of its node), for
        ``data.decode_workers: auto``; default, those this process may run on. ``model``: a module
        made in Python (``extractor.run(..., model=...)``), used instead of building one; its
        modules' modes and its parameters' ``requires_grad`` and memory format are given back by
        :meth:`close`, or at once when the worker cannot be made. ``batches``: makes
        the batch source of each ``run_shards`` call, an object with ``add(locators)`` and
        ``next() -> Batch | None`` as :class:`~extractor.batching.BatchStream` (default: the
        images decoded from the store's paths; benchmarks: pre-decoded tensors)."""
        self._batches = batches
        self.spec = spec
        self._callers = _CallersModule(model) if model is not None else None
        try:
            self._build(spec, cpus, model)
        except BaseException:
            if self._callers is not None:
                self._callers.restore()
            raise

    def _build(self, spec: JobSpec, cpus: int | None, model: torch.nn.Module | None) -> None:
        """The rest of ``__init__``: model, hooks, decoders, thread pools."""
        self.device = resolve_device(spec.model.device)
        model, self.model_info, processor = build_with_processor(spec.model, model)
        # the record and the transform stage: extractor's own (a Preprocess), or the library's processor
        self.preprocess, transform = _preprocess(spec, self.model_info["preprocess_defaults"], processor)
        model.requires_grad_(False)  # extraction never trains: gradients flow only from captured layers on
        self.channels_last = spec.model.channels_last
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model.to(self.device)
        entry = model_call(self.model, spec.model)
        # which positions of each layer's tokens are patches: decided per captured layer by the probe, from these
        self.token_facts = token_facts(self.model, self.preprocess.size, entry, self.device)
        self.token_claim = claim_of(model, spec.model.prefix_tokens if isinstance(spec.model.prefix_tokens, int)
                                    else None)
        self.model_info["prefix_tokens"] = model_prefix(self.token_facts, self.token_claim)
        self.targets: list[Target] = resolve_targets(model, spec.capture, _layers_hint(spec))
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels once
        self.decode = ImageDecoder(spec.data, self.preprocess, transform)
        self.jpeg: JpegDecoder | None = None
        if spec.data.decode_device == "cuda":
            if self.device.type != "cuda":
                raise ModelError(
                    f"data.decode_device: cuda needs the model on a CUDA GPU, but it runs on {self.device}; "
                    "set data.decode_device: cpu"
                )
            self.jpeg = JpegDecoder(spec.data, self.device, self.preprocess)
        self.machine = Machine.here(cpus)  # the writer threads and queue, the decode read-ahead
        self.decode_threads = workers = decode_threads(spec.data.decode_workers, cpus)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="decode") if workers else None
        self.writer_pool = ThreadPoolExecutor(self.machine.write_threads, thread_name_prefix="extractor-write")
        # opens the next shard's store arrays and reads its row list while the current shard computes
        self.prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="extractor-prepare")
        self.spare: dict[str, deque[np.ndarray]] = {}  # chunk buffers whose write is done, per capture
        self.mean = torch.tensor(self.preprocess.mean, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(self.preprocess.std, device=self.device).view(1, 3, 1, 1)
        # the hooks stay registered for the worker's life; a compiled model traces them into its graph
        self.capturer = Capturer(self.model, self.targets, entry=entry).__enter__()
        self.compiled = spec.model.compile
        if self.compiled:
            self.capturer.forward = torch.compile(entry)
        self.warm = not self.compiled  # compiled, and its graph built (warm_up)
        self._pinned: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        self._slot = 0
        self.captures: dict[str, CaptureRecord] | None = None
        self.extras: dict[str, ExtraRecord] = {}  # per-row results: target, score, KEY.range, KEY.token_index
        self.needs_labels = bool(self.capturer.gradient)  # a gradient job reads its rows' labels (target: label)
        self.samples = bool(self.capturer.samples)  # sample_tokens: draws keyed by the images' content digests
        self._reuse: ReuseIndex | None = None  # output.reuse's rows, loaded at the first shard

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.writer_pool.shutdown(wait=True)
        self.prepare_pool.shutdown(wait=True)
        self.capturer.close()
        if self._callers is not None:
            self._callers.restore()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = _AUTOCAST.get(self.spec.model.dtype)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _prepare(self, images: torch.Tensor) -> torch.Tensor:
        """(B,3,H,W) on the host (or already on the device) -> normalised float on the device: uint8 levels
        (extractor's transform) normalised here; float pixels (the library's processor) as they came."""
        if self.device.type == "cuda" and images.device.type == "cpu" and not images.is_pinned():
            images = images.pin_memory()  # page-locked: the copy below runs asynchronously
        x = images.to(self.device, non_blocking=True).float()
        if images.dtype == torch.uint8:
            x = x.div_(255.0).sub_(self.mean).div_(self.std)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _forward(
        self, images: torch.Tensor, labels: np.ndarray | None = None, eager: bool = False,
        draws: np.ndarray | None = None,
    ) -> dict[str, torch.Tensor]:
        """Captured tensors (on the device) for a uint8 batch: one hooked forward. ``draws``: the images' draw keys
        (``sample_tokens`` draws per image; default 0 for every image; sent only when a capture samples)."""
        n = len(images)
        draws = draws if self.capturer.samples else None
        pad = self.compiled and not eager and n < self.spec.data.batch_size
        if pad:  # one static batch shape: the compiled graph is not rebuilt for a shard's last batch
            fill = self.spec.data.batch_size - n
            images = torch.cat([images, images.new_zeros((fill, *images.shape[1:]))])
            if draws is not None:
                draws = np.concatenate([draws, np.zeros(fill, np.int64)])
            if labels is not None:
                labels = np.concatenate([labels, np.zeros(fill, labels.dtype)])
        # gradient jobs need autograd; every other job runs under inference_mode
        with torch.inference_mode(not self.capturer.gradient), self._autocast():
            lab = torch.as_tensor(labels, device=self.device) if labels is not None else None
            at = torch.as_tensor(draws, dtype=torch.int64).to(self.device) if draws is not None else None
            out = self.capturer.run(self._prepare(images), lab, eager=eager, draws=at)
        return {k: v[:n] for k, v in out.items()} if pad else out

    def _to_host(self, values: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], Any]:
        """Start copying a batch's captures to the host. On CUDA the copies land in reusable
        page-locked buffers (two sets, used in turn) and run asynchronously: the returned
        event says when the arrays may be read. Elsewhere the arrays are ready at once."""
        if self.device.type != "cuda":
            return {k: host_array(v.cpu()) for k, v in values.items()}, None
        self._slot ^= 1
        bufs = self._pinned[self._slot]
        host = {}
        for k, v in values.items():
            buf = bufs.get(k)
            if buf is None or buf.shape[0] < len(v) or buf.shape[1:] != v.shape[1:] or buf.dtype != v.dtype:
                buf = bufs[k] = torch.empty((max(len(v), self.spec.data.batch_size), *v.shape[1:]),
                                            dtype=v.dtype, pin_memory=True)
            buf[: len(v)].copy_(v, non_blocking=True)
            host[k] = host_array(buf[: len(v)])
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return host, event

    def forward_rows(self, images: torch.Tensor, labels: np.ndarray | None,
                     draws: np.ndarray | None = None) -> Forwarded:
        """Forward a batch and start its copy to the host; the errors of images that make it raise.

        When the batch raises, each image is retried alone (eagerly, synchronously) so that
        only the bad ones fail their rows. When every image raises on its own too, the cause
        is not an image (a model or device error): that is raised, and fails the shard.
        """
        try:
            values = self._forward(images, labels, draws=draws)
            host, event = self._to_host(values)
            return Forwarded(host, {}, event, device=values)  # the device's tensors: for write-time indexes
        except not_an_image():
            raise
        except Exception as err:  # noqa: BLE001 - decided per image below
            if len(images) == 1:
                return Forwarded({}, {0: f"forward failed on this image: {describe_error(err)}"}, None)
            log.warning("a batch of %d raised %s: %s; retrying image by image", len(images), type(err).__name__, err)
        return self._forward_one_by_one(images, labels, draws)

    def _forward_one_by_one(self, images: torch.Tensor, labels: np.ndarray | None,
                            draws: np.ndarray | None) -> Forwarded:
        """Each image of a batch that raised, alone: its rows, zeros where it raised (the row fails)."""
        parts: list[dict[str, np.ndarray] | None] = []
        bad: dict[int, str] = {}
        last: Exception | None = None
        for i in range(len(images)):
            try:
                one = self._forward(images[i : i + 1], labels[i : i + 1] if labels is not None else None, eager=True,
                                    draws=draws[i : i + 1] if draws is not None else None)
                parts.append({k: host_array(v.cpu()) for k, v in one.items()})
            except not_an_image():
                raise
            except Exception as err:  # noqa: BLE001 - this image fails its row
                bad[i] = f"forward failed on this image: {describe_error(err)}"
                parts.append(None)
                last = err
        if len(bad) == len(images):
            assert last is not None
            raise last
        return Forwarded(_stitched(parts), bad, None)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Captured tensors (on the device) for a uint8 batch: one hooked forward."""
        return self._forward(images)

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

    def run_shard(
        self,
        shard: Shard,
        url: str,
        storage_options: dict[str, Any] | None = None,
        on_batch: Callable[[int], None] | None = None,
        ticket: Ticket | None = None,
    ) -> ShardSummary:
        """Process every row of ``shard`` and write it; returns once it is committed."""
        computed: list[Future[ShardSummary]] = []
        self.run_shards([shard], url, storage_options, on_batch, lambda _shard, future: computed.append(future),
                        ticket=ticket)
        return computed[0].result()

    def run_shards(
        self,
        shards: Sequence[Shard] | ShardQueue,
        url: str,
        storage_options: dict[str, Any] | None = None,
        on_batch: Callable[[int], None] | None = None,
        on_computed: Callable[[Shard, Future[ShardSummary]], None] | None = None,
        on_started: Callable[[Shard], None] | None = None,
        ticket: Ticket | None = None,
    ) -> None:
        """Forward every row of ``shards``, one after another, in one pipeline that does not
        drain between shards. ``ticket``: the job's generation and claimant; each shard is claimed for it as it
        opens (one that another claimant holds or committed is left: its summary says so), and a shard whose
        claim was taken over meanwhile stops the pipeline (:class:`FencedError`).

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
        self.probe()
        self.warm_up()
        storage = storage_options if storage_options is not None else self.spec.output.storage_options
        if not isinstance(shards, ShardQueue):
            shards = ShardQueue(shards)
            shards.close()  # a fixed list: nothing more will come
        try:
            Pipeline(self, shards, url, storage, on_batch, on_computed, on_started, ticket).run()
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
        reuse = self._reuse_index().lookup if self.spec.output.reuse else None
        forget_reads()  # what an earlier call read may be of files changed since
        threads = max(self.decode_threads, 1)
        h, w = self.preprocess.size
        ahead = self.machine.decode_ahead(bs, threads, bs * 3 * h * w)
        common: dict[str, Any] = {"read": self.decode.read_printed, "reuse": reuse, "prefetch_batches": ahead,
                                  "pieces": 2 * threads}
        if self.jpeg is not None:
            return BatchStream(bs, self.jpeg.prepare, self.pool, collate=self.jpeg.collate, **common)
        if isinstance(self.decode.transform, Preprocess):  # uint8 images of the model's input size: into slots
            slots = Slots(bs, (3, h, w), torch.uint8, pin=self.device.type == "cuda")
            return BatchStream(bs, self.decode.from_bytes, self.pool, slots=slots, **common)
        return BatchStream(bs, self.decode.from_bytes, self.pool,
                           collate=_stack_pinned if self.device.type == "cuda" else None, **common)

    def _reuse_index(self) -> ReuseIndex:
        """The rows of the stores of ``output.reuse`` by content digest (read once, at the first shard)."""
        if self._reuse is None:
            keys = [*(self.captures or {}), *self.extras]
            # what the driver's check_sources compared, as a store records it: a source replaced since is left out
            want = json.loads(json.dumps({"format_version": FORMAT_VERSION, "spec": self.spec.public_dict(),
                                          **self.probe().to_dict()}))
            self._reuse = ReuseIndex(self.spec.output.reuse, self.spec.output.storage_options, keys, want=want)
            log.info("output.reuse: %d rows of %d stores to take by content", len(self._reuse),
                     len(self.spec.output.reuse))
        return self._reuse


def _stack_pinned(items: list[torch.Tensor]) -> tuple[torch.Tensor, dict[int, str]]:
    """Stack a batch straight into page-locked memory (one copy, not two): its upload runs asynchronously."""
    out = torch.empty((len(items), *items[0].shape), dtype=items[0].dtype, pin_memory=True)
    return torch.stack(items, out=out), {}
