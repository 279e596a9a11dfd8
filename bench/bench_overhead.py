"""`make bench BENCH_ARGS=--overhead`: extractor's host time per batch, without decoding and
nearly without compute (issue 20).

A near-free model (one strided conv, then cheap ReLUs to capture), pre-decoded uint8 images in
memory (gpu_check's ``predecoded`` path: the worker's batches come from a tensor), batch 256.
The bare loop normalises and forwards the same batches (the faster of NCHW and channels_last;
extractor runs in that memory format too).
extractor runs whole jobs (hooks, reductions, copies, chunk filing, writes on its writer
threads, statistics); its time per batch is that of a job of 40 batches minus one of 20, over
20, so what a job does once cancels out. Printed: ms per batch of each, and extractor's extra
time per batch with 1, 4 and 16 pooled captures.
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gpu_check import SliceStream  # beside this file
from torch import nn

from extractor.compute.worker import Worker
from extractor.driver.runner import LocalBackend, run
from extractor.spec.load import parse_spec

BATCH = 256
BATCHES = 40
SIZE = 32  # pixels per side of the pre-decoded images
SHARDING = True  # the store's output.sharding (--unsharded: false)


class Stack(nn.Module):
    """One strided conv (the only real compute), then 16 ReLUs whose outputs are captured."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 8, stride=8)
        self.acts = nn.Sequential(*[nn.ReLU() for _ in range(16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.acts(self.conv(x))


@dataclass(frozen=True)
class Spent:
    """Seconds of wall time and of this process's CPU (all its threads): the CPU figure holds on a loaded machine."""

    wall: float
    cpu: float

    @classmethod
    def since(cls, start: Spent) -> Spent:
        return cls(time.perf_counter() - start.wall, time.process_time() - start.cpu)

    @classmethod
    def now(cls) -> Spent:
        return cls(time.perf_counter(), time.process_time())

    def __sub__(self, other: Spent) -> Spent:
        return Spent(self.wall - other.wall, self.cpu - other.cpu)

    def per(self, n: float) -> Spent:
        return Spent(self.wall / n, self.cpu / n)


def _median(runs: list[Spent]) -> Spent:
    return Spent(statistics.median(r.wall for r in runs), statistics.median(r.cpu for r in runs))


def bare(model: nn.Module, pixels: torch.Tensor, channels_last: bool, device: str = "cpu") -> Spent:
    """Time of the bare loop: normalise each batch and forward it, outputs discarded."""
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = copy.deepcopy(model).to(device, memory_format=fmt)
    t0 = Spent.now()
    with torch.inference_mode():
        for a in range(0, len(pixels), BATCH):
            x = pixels[a:a + BATCH].to(device, non_blocking=True)
            model(x.float().div_(255.0).sub_(mean).div_(std).contiguous(memory_format=fmt))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return Spent.since(t0)


def extractor(model: nn.Module, pixels: torch.Tensor, captures: int, work: Path, channels_last: bool,
              device: str = "cpu") -> Spent:
    """Time of the job, from its first shard's start to its end (start-up excluded)."""
    manifest = work / "manifest.csv"
    manifest.write_text("path\n" + "".join(f"/predecoded/{i}.jpg\n" for i in range(len(pixels))))
    spec = parse_spec({
        "model": {"name": f"python:{__name__}.Stack", "device": device, "channels_last": channels_last},
        "data": {"source": "manifest", "manifest": str(manifest), "outside_root": True, "batch_size": BATCH,
                 "shard_size": BATCH * 10,
                 "resize": None, "crop": SIZE, "preprocess": "imagenet"},
        "capture": [{"layer": f"acts.{i}", "reduce": "mean"} for i in range(captures)],
        "output": {"store": str(work / "s.zarr"), "if_exists": "overwrite", "sharding": SHARDING},
        "cluster": {"backend": "local"},
    })
    first: list[Spent] = []
    worker = Worker(spec, model=model, batches=lambda: SliceStream(pixels, BATCH))
    try:
        summary = run(spec, backend=LocalBackend(spec, worker),
                      on_event=lambda name, info: first.append(Spent.now())
                      if name == "shard_started" and not first else None)
        spent = Spent.since(first[0])
    finally:
        worker.close()
    assert summary.ok == len(pixels), summary
    return spent


def marginal(model: nn.Module, pixels: torch.Tensor, captures: int, work: Path, channels_last: bool,
             device: str = "cpu") -> Spent:
    """Time per batch in a running job: a job of all the batches minus one of half of them, so
    what a job does once (its last writes, done markers, metadata) cancels out."""
    half = len(pixels) // 2
    return (extractor(model, pixels, captures, work, channels_last, device)
            - extractor(model, pixels[:half], captures, work, channels_last, device)).per(BATCHES - half // BATCH)


def jpegs(folder: Path, n: int, side: int = 224) -> Path:
    """``n`` JPEG files of smooth gradients, ``side`` pixels square (the model's input as it is: no resize)."""
    from PIL import Image

    folder = folder / f"{n}x{side}"
    if not folder.exists():
        folder.mkdir(parents=True)
        ramp = np.linspace(0, 1, side)
        for i in range(n):
            tint = np.random.default_rng(i).uniform(0, 255, 3)
            pixels = (np.add.outer(ramp, ramp)[..., None] / 2 * tint).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:05d}.jpg")
    return folder


def main_thread(images: int, work: Path, batch: int = BATCH, captures: int = 4) -> tuple[float, float]:
    """Microseconds of the main thread's CPU per image outside the forward (time.thread_time), and the job's
    images/s (its pipeline's wall time): a job over JPEG files
    of 224x224 decoded on the CPU threads, batch ``batch``, the near-free model with ``captures`` pooled captures.
    The forward (``Worker._forward``: normalisation and the model) is measured apart and taken out; what is left is
    the stream's batches, their rows' bookkeeping, the copies to the host and into chunk buffers, the read-back."""
    from extractor.compute import pipeline as pipeline_mod

    spec = parse_spec({
        "model": {"name": f"python:{__name__}.Stack", "device": "cpu"},
        "data": {"root": str(jpegs(work / "jpegs", images)), "batch_size": batch, "shard_size": batch * 4,
                 "resize": None, "crop": 224, "preprocess": "imagenet"},
        "capture": [{"layer": f"acts.{i}", "reduce": "mean"} for i in range(captures)],
        "output": {"store": str(work / "jpegs.zarr"), "if_exists": "overwrite"},
        "cluster": {"backend": "local"},
    })
    spent = {"pipeline": 0.0, "forward": 0.0, "wall": 0.0}
    inside: list[bool] = []  # the pipeline runs: forwards before it (the probe's) are not its
    real_run, real_forward = pipeline_mod.Pipeline.run, Worker._forward

    def run_timed(self, *args, **kwargs):
        inside.append(True)
        t, wall = time.thread_time(), time.perf_counter()
        try:
            return real_run(self, *args, **kwargs)
        finally:
            spent["pipeline"] += time.thread_time() - t
            spent["wall"] += time.perf_counter() - wall
            inside.pop()

    def forward_timed(self, *args, **kwargs):
        t = time.thread_time()
        try:
            return real_forward(self, *args, **kwargs)
        finally:
            if inside:
                spent["forward"] += time.thread_time() - t

    pipeline_mod.Pipeline.run, Worker._forward = run_timed, forward_timed
    try:
        worker = Worker(spec, model=Stack().eval())
        try:
            summary = run(spec, backend=LocalBackend(spec, worker))
        finally:
            worker.close()
    finally:
        pipeline_mod.Pipeline.run, Worker._forward = real_run, real_forward
    assert summary.ok == images, f"{summary.ok} of {images} rows ok"
    return (spent["pipeline"] - spent["forward"]) / images * 1e6, images / spent["wall"]


def machine_settings(work: Path, images: int = BATCH * 8) -> dict[int, dict[str, float]]:
    """The settings made from the machine (extractor._machine) at a 2-core and a 16-core setting (EXTRACTOR_CPUS),
    and the JPEG job of :func:`main_thread` under each. What a setting cannot simulate: the cores themselves (16
    decode and 8 writer threads on this machine's cores share them: images/s shows what the extra threads cost
    here, not what they gain on 16 cores), nor a node's memory (this machine's is used)."""
    import os

    from extractor._machine import CPUS_VARIABLE, Machine
    from extractor.compute.worker import decode_threads

    print(f"\nsettings from the machine at a 2- and a 16-core setting ({CPUS_VARIABLE}; this machine: "
          f"{len(os.sched_getaffinity(0))} cores, {Machine.here().memory / 2**30:.0f} GiB); the JPEG job above")
    print(f"{'CPUs':>4s} {'decode thr':>10s} {'writer thr':>10s} {'queue@24MiB':>11s} {'decode ahead':>12s} "
          f"{'index lanes':>11s} {'main us/img':>11s} {'images/s':>9s}")
    table: dict[int, dict[str, float]] = {}
    was = os.environ.get(CPUS_VARIABLE)
    try:
        for cpus in (2, 16):
            os.environ[CPUS_VARIABLE] = str(cpus)
            m, threads = Machine.here(), decode_threads("auto")
            ahead = m.decode_ahead(BATCH, threads, BATCH * 3 * 224 * 224)
            us, ips = main_thread(images, work)
            table[cpus] = {"decode_threads": threads, "write_threads": m.write_threads,
                           "write_queue": m.write_queue(24 << 20), "decode_ahead": ahead,
                           "index_lanes": m.index_lanes(64 << 20), "main_us": us, "images_per_s": ips}
            print(f"{cpus:4d} {threads:10d} {m.write_threads:10d} {m.write_queue(24 << 20):11d} {ahead:12d} "
                  f"{m.index_lanes(64 << 20):11d} {us:11.1f} {ips:9.0f}")
    finally:
        if was is None:
            os.environ.pop(CPUS_VARIABLE, None)
        else:
            os.environ[CPUS_VARIABLE] = was
    print("A setting cannot simulate the cores: at 16 the threads share this machine's, so images/s shows their cost "
          "here, not their gain on a 16-core node; the memory is this machine's.")
    return table


def main(repeats: int = 3, device: str = "cpu") -> dict[int, dict[str, float]]:
    """Print the table (and return it: captures -> ms per batch); ``device``: cuda in gpu_check."""
    torch.manual_seed(0)
    model = Stack().eval()
    pixels = torch.randint(0, 256, (BATCH * BATCHES, 3, SIZE, SIZE), dtype=torch.uint8)
    if device.startswith("cuda"):
        pixels = pixels.pin_memory()
    print(f"\nhost overhead: a near-free model (1 strided conv + ReLUs) on {device}, {len(pixels)} pre-decoded "
          f"{SIZE}x{SIZE} images in memory, batch {BATCH}, {torch.get_num_threads()} threads; median of {repeats}")
    table: dict[int, dict[str, float]] = {}
    print(f"{'captures':>8s} {'bare ms/batch':>14s} {'extractor ms/batch':>19s} {'extra ms/batch':>15s} "
          f"{'extra CPU ms/batch':>19s}")
    with tempfile.TemporaryDirectory(prefix="overhead") as tmp:
        for captures in (1, 4, 16):
            runs = {fmt: _median([bare(model, pixels, fmt, device) for _ in range(repeats)]) for fmt in (False, True)}
            cl = min(runs, key=lambda fmt: runs[fmt].wall)
            b = runs[cl].per(BATCHES / 1e3)
            e = _median([marginal(model, pixels, captures, Path(tmp), cl, device) for _ in range(repeats)]).per(1e-3)
            table[captures] = {"bare_ms": b.wall, "extractor_ms": e.wall, "extra_ms": e.wall - b.wall,
                               "extra_cpu_ms": e.cpu - b.cpu}
            print(f"{captures:8d} {b.wall:14.2f} {e.wall:19.2f} {e.wall - b.wall:15.2f} {e.cpu - b.cpu:19.2f}")
        main_thread_us = main_thread(BATCH * 8, Path(tmp))[0] if device == "cpu" else None
        if device == "cpu":
            machine_settings(Path(tmp))
    print("extra = extractor's ms per batch minus the bare loop's: hooks, reductions, copies to the host, chunk "
          "filing, writes and statistics (on writer threads), bookkeeping; in wall time and in this process's CPU "
          "time (all threads: the figure that holds on a loaded machine). Targets (issues 20, 55): <= 1 ms per batch "
          "with 4 pooled captures, <= 0.1 ms per added capture.")
    if main_thread_us is not None:
        print(f"main thread per image, batch {BATCH}, JPEG files decoded on the CPU threads: {main_thread_us:.1f} us "
              "of CPU outside the forward (target, issue 55: <= 30)")
    return table


if __name__ == "__main__":
    SHARDING = "--unsharded" not in sys.argv  # python tests/bench_overhead.py --unsharded: each chunk its own object
    main()
