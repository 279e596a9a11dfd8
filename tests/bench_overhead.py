"""`make bench BENCH_ARGS=--overhead`: extractor's host time per batch, without decoding and
nearly without compute (issue 20).

A near-free model (one strided conv, then cheap ReLUs to capture), pre-decoded uint8 images in
memory (gpu_check's ``predecoded`` path: the worker's batches come from a tensor), batch 256.
The bare loop normalises and forwards the same batches; extractor runs the whole job (hooks,
reductions, copies, chunk filing, writes on its writer threads, statistics). Printed: ms per
batch of each, and extractor's extra time per batch with 1, 4 and 16 pooled captures.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from gpu_check import SliceStream
from torch import nn

from extractor.runner import LocalBackend, run
from extractor.spec import parse_spec
from extractor.worker import Worker

BATCH = 256
BATCHES = 40
SIZE = 32  # pixels per side of the pre-decoded images


class Stack(nn.Module):
    """One strided conv (the only real compute), then 16 ReLUs whose outputs are captured."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 8, stride=8)
        self.acts = nn.Sequential(*[nn.ReLU() for _ in range(16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.acts(self.conv(x))


def bare(model: nn.Module, pixels: torch.Tensor) -> float:
    """Seconds for the bare loop: normalise each batch and forward it, outputs discarded."""
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for a in range(0, len(pixels), BATCH):
            model(pixels[a:a + BATCH].float().div_(255.0).sub_(mean).div_(std))
    return time.perf_counter() - t0


def extractor(model: nn.Module, pixels: torch.Tensor, captures: int, work: Path) -> float:
    """Seconds for the job, from its first shard's start to its end (start-up excluded)."""
    manifest = work / "manifest.csv"
    manifest.write_text("path\n" + "".join(f"/predecoded/{i}.jpg\n" for i in range(len(pixels))))
    spec = parse_spec({
        "model": {"name": f"python:{__name__}.Stack", "device": "cpu"},
        "data": {"source": "manifest", "manifest": str(manifest), "batch_size": BATCH, "shard_size": BATCH * 10,
                 "resize": None, "crop": SIZE, "preprocess": "imagenet"},
        "capture": [{"layer": f"acts.{i}", "reduce": "mean"} for i in range(captures)],
        "output": {"store": str(work / "s.zarr"), "if_exists": "overwrite"},
        "cluster": {"backend": "local"},
    })
    first: list[float] = []
    worker = Worker(spec, model=model, batches=lambda: SliceStream(pixels, BATCH))
    summary = run(spec, backend=LocalBackend(spec, worker),
                  on_event=lambda name, info: first.append(time.perf_counter())
                  if name == "shard_started" and not first else None)
    assert summary.ok == len(pixels), summary
    return time.perf_counter() - first[0]


def main(repeats: int = 3) -> None:
    torch.manual_seed(0)
    model = Stack().eval()
    pixels = torch.randint(0, 256, (BATCH * BATCHES, 3, SIZE, SIZE), dtype=torch.uint8)
    print(f"\nhost overhead: a near-free model (1 strided conv + ReLUs), {len(pixels)} pre-decoded {SIZE}x{SIZE} "
          f"images in memory, batch {BATCH}, {torch.get_num_threads()} threads; median of {repeats}")
    print(f"{'captures':>8s} {'bare ms/batch':>14s} {'extractor ms/batch':>19s} {'extra ms/batch':>15s}")
    with tempfile.TemporaryDirectory(prefix="overhead") as tmp:
        for captures in (1, 4, 16):
            b = statistics.median(bare(model, pixels) for _ in range(repeats)) / BATCHES * 1e3
            e = statistics.median(extractor(model, pixels, captures, Path(tmp)) for _ in range(repeats))
            e = e / BATCHES * 1e3
            print(f"{captures:8d} {b:14.2f} {e:19.2f} {e - b:15.2f}")
    print("extra = extractor's ms per batch minus the bare loop's: hooks, reductions, copies to the host, chunk "
          "filing, writes and statistics (on writer threads), bookkeeping. Targets (issue 20): <= 1 ms per batch "
          "with 4 pooled captures, <= 0.1 ms per added capture.")


if __name__ == "__main__":
    main()
