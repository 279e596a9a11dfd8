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
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .capture import Capturer, Target, dim_names, resolve_targets
from .errors import LayerError, ShardError
from .model import build_model, resolve_device
from .sources import ImageDecoder, Shard, describe_error, iter_batches
from .spec import JobSpec
from .stats import ShardStats
from .stats import dumps as stats_dumps
from .store import FAILED, OK, ShardWriter

__all__ = ["Worker", "ShardSummary"]

log = logging.getLogger(__name__)

_AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}
WRITE_QUEUE = 2  # chunks of every capture that may wait for the writer thread: bounds memory


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
        self.decode = ImageDecoder(spec.data)
        workers = spec.data.decode_workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="decode") if workers else None
        self.writer_pool = ThreadPoolExecutor(1, thread_name_prefix="extractor-write")
        self.mean = torch.tensor(spec.data.mean, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(spec.data.std, device=self.device).view(1, 3, 1, 1)
        self.captures: dict[str, dict[str, Any]] | None = None
        self.extras: dict[str, dict[str, Any]] = {}  # per-row results of gradient jobs (target, score, ...)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.writer_pool.shutdown(wait=True)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = _AUTOCAST.get(self.spec.model.dtype)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _prepare(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B,3,H,W) on the host -> normalised float on the device."""
        if self.device.type == "cuda":
            images = images.pin_memory()  # page-locked: the copy below runs asynchronously
        x = images.to(self.device, non_blocking=True).float().div_(255.0).sub_(self.mean).div_(self.std)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _forward(
        self, cap: Capturer, images: torch.Tensor, labels: np.ndarray | None = None
    ) -> dict[str, torch.Tensor]:
        # gradient jobs need autograd; every other job runs under inference_mode
        with torch.inference_mode(not cap.gradient), self._autocast():
            lab = torch.as_tensor(labels, device=self.device) if labels is not None else None
            return cap.run(self._prepare(images), lab)

    def _forward_rows(
        self, cap: Capturer, images: torch.Tensor, labels: np.ndarray | None
    ) -> tuple[dict[str, np.ndarray], dict[int, str]]:
        """Host arrays for a batch, and the errors of images that make the forward raise.

        When the batch raises, each image is retried alone so that only the bad ones fail
        their rows. When every image raises on its own too, the cause is not an image (a
        model or device error): that is raised, and fails the shard.
        """
        try:
            return {k: v.cpu().numpy() for k, v in self._forward(cap, images, labels).items()}, {}
        except (LayerError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:  # noqa: BLE001 - decided per image below
            if len(images) == 1:
                return {}, {0: f"forward failed on this image: {describe_error(err)}"}
            log.warning("a batch of %d raised %s: %s; retrying image by image", len(images), type(err).__name__, err)
        parts: list[dict[str, np.ndarray] | None] = []
        bad: dict[int, str] = {}
        last: Exception | None = None
        for i in range(len(images)):
            try:
                one = self._forward(cap, images[i : i + 1], labels[i : i + 1] if labels is not None else None)
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
        return host, bad

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Captured tensors (on the device) for a uint8 batch: one hooked forward."""
        with Capturer(self.model, self.targets) as cap:
            return self._forward(cap, images)

    def probe(self) -> dict[str, dict[str, Any]]:
        """Run one blank image through the model: the stored shape and metadata of each capture."""
        crop = self.spec.data.crop
        with Capturer(self.model, self.targets) as cap:
            values = self._forward(cap, torch.zeros(1, 3, crop, crop, dtype=torch.uint8), np.zeros(1, np.int64))
            original = dict(cap.original_shapes)
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
        """Process every row of ``shard`` and write it; the done marker comes last."""
        if self.captures is None:
            self.probe()
        assert self.captures is not None
        t0 = time.perf_counter()
        so = storage_options if storage_options is not None else self.spec.output.storage_options
        writer = ShardWriter(url, shard.start, shard.stop, shard.index, so)
        paths = writer.locators()
        labels = writer.labels() if self.extras else None
        n = len(shard)
        chunk = self.spec.output.chunk_rows
        status = np.zeros(n, dtype=np.uint8)
        errors = [""] * n
        buffers = {
            k: np.full((chunk, *m["shape"]), np.nan, dtype=m["dtype"]) for k, m in self.captures.items()
        }
        extras = {k: np.full((n, *m["shape"]), -1 if m["dtype"] == "int64" else np.nan, dtype=m["dtype"])
                  for k, m in self.extras.items()}
        stats = {k: ShardStats(m["dims"], m["shape"]) for k, m in self.captures.items()}
        decoded = forward_failed = 0  # images that reached the model, and those that made it raise
        current = 0  # index of the chunk being filled, relative to the shard

        pending: deque[Future[None]] = deque()  # chunk writes in flight on the writer thread

        def write_chunk(c: int, full: dict[str, np.ndarray]) -> None:
            rows = min(chunk, n - c * chunk)
            for key, buf in full.items():
                writer.write(key, c * chunk, buf[:rows])

        def flush(c: int) -> None:
            """Hand chunk ``c`` to the writer thread (compression and storage happen there) and
            start a fresh buffer; wait only when WRITE_QUEUE chunks are already in flight."""
            nonlocal buffers
            full, buffers = buffers, {k: np.full_like(b, np.nan) for k, b in buffers.items()}
            pending.append(self.writer_pool.submit(write_chunk, c, full))
            while len(pending) > WRITE_QUEUE:
                pending.popleft().result()

        try:
            with Capturer(self.model, self.targets) as cap:
                for batch in iter_batches(paths, self.spec.data.batch_size, self.decode, self.pool):
                    for off, err in batch.failed.items():
                        status[off], errors[off] = FAILED, err
                    if batch.images is not None:
                        offsets = np.asarray(batch.offsets)
                        lab = labels[offsets] if labels is not None else None
                        host, bad = self._forward_rows(cap, batch.images, lab)
                        for i, err in bad.items():
                            status[offsets[i]], errors[offsets[i]] = FAILED, err
                        forward_failed += len(bad)
                        decoded += len(offsets)
                        if forward_failed == decoded and decoded >= min(n, 2):
                            raise RuntimeError(f"every image so far made the model raise; last: {bad[max(bad)]}")
                        if len(bad) < len(offsets):
                            keep = np.setdiff1d(np.arange(len(offsets)), list(bad))
                            offsets = offsets[keep]
                            host = {k: v[keep] for k, v in host.items()}
                            for key, arr in extras.items():
                                arr[offsets] = host[key]
                            for key, st in stats.items():
                                st.update(host[key], shard.start + offsets)
                            status[offsets] = OK
                            for c in np.unique(offsets // chunk):
                                while current < c:
                                    flush(current)
                                    current += 1
                                sel = (offsets // chunk) == c
                                for key, buf in buffers.items():
                                    buf[offsets[sel] - c * chunk] = host[key][sel]
                    if on_batch is not None:
                        on_batch(len(batch.offsets) + len(batch.failed))
            last = (n - 1) // chunk
            while current <= last:
                flush(current)
                current += 1
            while pending:  # every chunk durable (or its error raised) before the shard is marked done
                pending.popleft().result()
            writer.finish(status, errors, extras, stats_dumps(stats))
        except (KeyboardInterrupt, SystemExit):
            _drain(pending)
            raise
        except Exception as err:
            _drain(pending)
            raise ShardError(
                f"shard {shard.index} (rows {shard.start}-{shard.stop - 1}) failed: "
                f"{type(err).__name__}: {err}"
            ) from err
        return ShardSummary(
            shard=shard.index,
            rows=n,
            ok=int((status == OK).sum()),
            failed=int((status == FAILED).sum()),
            seconds=time.perf_counter() - t0,
            bytes=writer.bytes,
            pid=os.getpid(),
        )
