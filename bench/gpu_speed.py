"""The device check of issue 55 (`python bench/gpu_check.py`, `make bench BENCH_ARGS=--gpu`): on one GPU, images/s
from JPEG files of three jobs, each against the bare bfloat16 loop in the same run, in at most 8 minutes.

Jobs (torchvision models, random weights): a pooled ResNet-50 capture (avgpool, layer3 mean-pooled), a pooled
ViT-B/16 capture (the encoder's tokens mean-pooled), and ViT-L/14 (torchvision's VisionTransformer at ViT-L/14's
size) with 32 sampled tokens (and the CLS token) of each of its 24 blocks in float16. For each: the bare bfloat16
forward on pre-decoded images in page-locked memory (the ceiling), the bare loop from the JPEG files (a DataLoader
decoding with Pillow on every CPU), and extractor from the same files with decoding on the CPU threads and with nvJPEG
(``data.decode_device: cuda``), its images/s, ratio to the bare forward, and GB/s written. Then the decode paths:
nvJPEG's pixels against Pillow's on fixed files, and NVIDIA DALI's decode against nvJPEG's where DALI imports.

On a machine without CUDA the same runs small (tiny models and images, the CPU: seconds), so a test keeps it working.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

BUDGET_S = 480  # the whole check, JPEG files included: a case that would start past it is left out, said so


@dataclass(frozen=True)
class Case:
    name: str
    model: dict[str, Any]  # the spec's model section
    capture: list[dict[str, Any]]
    images: int
    batch: int
    size: tuple[int, int]  # resize (shorter side), crop
    kwargs: dict[str, Any] = field(default_factory=dict)  # of the factory, for the bare loop's model


def vit(image_size: int = 224, patch: int = 14, layers: int = 24, heads: int = 16, width: int = 1024,
        mlp: int = 4096) -> torch.nn.Module:
    """torchvision's VisionTransformer of any size (model.factory ``gpu_speed:vit``): ViT-L/14 by default."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=image_size, patch_size=patch, num_layers=layers, num_heads=heads,
                             hidden_dim=width, mlp_dim=mlp)


POOLED_RESNET = [{"layer": "avgpool", "reduce": "flatten"}, {"layer": "layer3", "reduce": "mean"}]
POOLED_VIT = [{"layer": "encoder", "reduce": "mean", "key": "pooled"}]


def cases(small: bool) -> list[Case]:
    """The three jobs: at full size on a GPU, or tiny (the same captures and code) on a CPU."""
    if small:
        tiny = {"image_size": 32, "patch": 8, "layers": 4, "heads": 2, "width": 32, "mlp": 64}
        return [
            Case("ResNet pooled (resnet18, 32 px)", {"name": "resnet18"}, POOLED_RESNET, 8, 4, (36, 32)),
            Case("ViT pooled (4 blocks, 32 px)", {"factory": "gpu_speed:vit", "factory_kwargs": tiny}, POOLED_VIT,
                 8, 4, (36, 32), tiny),
            Case("ViT, 4 sampled tokens of 4 blocks", {"factory": "gpu_speed:vit", "factory_kwargs": tiny},
                 [{"layer": "encoder.layers.encoder_layer_*", "sample_tokens": 4, "dtype": "float16"}], 8, 4,
                 (36, 32), tiny),
        ]
    return [
        Case("ResNet-50 pooled", {"name": "resnet50"}, POOLED_RESNET, 8192, 256, (256, 224)),
        Case("ViT-B/16 pooled", {"name": "vit_b_16"}, POOLED_VIT, 8192, 256, (256, 224)),
        Case("ViT-L/14, 32 sampled tokens of 24 blocks", {"factory": "gpu_speed:vit"},
             [{"layer": "encoder.layers.encoder_layer_*", "sample_tokens": 32, "dtype": "float16"}], 2048, 256,
             (256, 224)),
    ]


def _model(case: Case, device: str) -> torch.nn.Module:
    """The case's model as its job builds it (random weights, seeded 0), for the bare loops."""
    import torchvision

    torch.manual_seed(0)
    model = vit(**case.kwargs) if "factory" in case.model else \
        torchvision.models.get_model(case.model["name"], weights=None)
    return model.eval().to(device, memory_format=torch.channels_last)


def _normalised(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor([0.485, 0.456, 0.406], device=x.device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=x.device).view(1, 3, 1, 1)
    return x.float().div_(255).sub_(mean).div_(std).contiguous(memory_format=torch.channels_last)


def _timed(fn: Callable[[], int], device: str) -> float:
    """Images per second of ``fn`` (which returns how many it did), the device's queue drained at both ends."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    n = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t)


def bare_forward(case: Case, pixels: torch.Tensor, device: str) -> float:
    """The bare bfloat16 loop on pre-decoded images: upload, normalise, forward; outputs discarded."""
    model = _model(case, device)

    def loop(n: int) -> int:
        with torch.inference_mode(), torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            for a in range(0, n, case.batch):
                model(_normalised(pixels[a % len(pixels):][: case.batch].to(device, non_blocking=True)))
        return n

    loop(case.batch * 2)  # warm-up: kernels chosen
    return _timed(lambda: loop(case.images), device)


def bare_jpeg(case: Case, root: Path, device: str) -> float:
    """The bare bfloat16 loop from the JPEG files: a DataLoader decoding with Pillow on every CPU (processes)."""
    import torchvision
    from torch.utils.data import DataLoader
    from torchvision import transforms

    tf = transforms.Compose([transforms.Resize(case.size[0]), transforms.CenterCrop(case.size[1]),
                             transforms.PILToTensor()])
    data = torchvision.datasets.ImageFolder(str(root), transform=tf)
    data = torch.utils.data.Subset(data, range(min(case.images, len(data))))
    workers = 0 if not device.startswith("cuda") else os.cpu_count() or 1
    loader = DataLoader(data, batch_size=case.batch, num_workers=workers, pin_memory=device.startswith("cuda"))
    model = _model(case, device)

    def loop() -> int:
        n = 0
        with torch.inference_mode(), torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            for x, _ in loader:
                model(_normalised(x.to(device, non_blocking=True)))
                n += len(x)
        return n

    return _timed(loop, device)


def extractor_jpeg(case: Case, root: Path, work: Path, device: str, decode: str) -> dict[str, Any]:
    """extractor's job over the JPEG files, decoded on the CPU threads or by nvJPEG: images/s from its first
    shard's start to its end, and GB/s written."""
    from extractor.driver.runner import run
    from extractor.spec.load import parse_spec

    name = case.name.split(",")[0].replace("/", "").replace(" ", "-")
    store, manifest = work / f"{name}-{decode}.zarr", work / f"manifest-{case.images}.csv"
    files = sorted(root.rglob("*.jpg"))[: case.images]
    manifest.write_text("path\n" + "".join(f"{f}\n" for f in files))
    spec = parse_spec({
        "model": {"name": None, **case.model, "weights": None, "device": device, "dtype": "bfloat16"},
        "data": {"source": "manifest", "manifest": str(manifest), "outside_root": True, "batch_size": case.batch,
                 "shard_size": case.batch * 8, "decode_device": decode, "resize": case.size[0], "crop": case.size[1],
                 "preprocess": "imagenet"},
        "capture": case.capture,
        "output": {"store": str(store), "if_exists": "overwrite"},
        "cluster": {"backend": "local"},
    })
    first: list[float] = []
    summary = run(spec, on_event=lambda name, info: first.append(time.perf_counter())
                  if name == "shard_started" and not first else None)
    seconds = time.perf_counter() - first[0]
    written = sum(s.bytes for s in summary.per_shard)
    return {"images_per_s": summary.ok / seconds, "gb_per_s": written / seconds / 1e9, "ok": summary.ok,
            "failed": summary.failed}


def decoded(files: list[Path], size: tuple[int, int]) -> torch.Tensor:
    """The files decoded by Pillow as extractor's CPU path decodes them: (n, 3, crop, crop) uint8."""
    from extractor.data.decode import ImageDecoder
    from extractor.spec.data_spec import DataSpec

    decoder = ImageDecoder(DataSpec(root="unused", resize=size[0], crop=size[1], preprocess="imagenet"))
    return torch.stack([decoder(str(f)) for f in files])


def pixel_difference(files: list[Path], size: tuple[int, int], device: str) -> dict[str, Any]:
    """extractor's device decode (nvJPEG on CUDA; torchvision's CPU decoder elsewhere) against Pillow's pixels."""
    from extractor.data.decode import JpegDecoder
    from extractor.spec.data_spec import DataSpec

    jpeg = JpegDecoder(DataSpec(root="unused", resize=size[0], crop=size[1], preprocess="imagenet"),
                       torch.device(device))
    got, failed = jpeg.collate([jpeg.read(str(f)) for f in files])
    diff = (got.cpu().int() - decoded(files, size).int()).abs().float()
    return {"images": len(files), "failed": len(failed), "mean": diff.mean().item(),
            "p99": diff.flatten().kthvalue(max(1, int(0.99 * diff.numel()))).values.item(), "max": diff.max().item()}


def dali(files: list[Path], size: tuple[int, int], batch: int) -> dict[str, Any] | str:
    """NVIDIA DALI's decode (mixed: nvJPEG), resize and crop of the files: images/s, and its pixels against Pillow's
    on the first batch; or why there is none."""
    try:
        from nvidia.dali import fn, pipeline_def, types  # type: ignore[import-not-found]
    except ImportError:
        return "not importable"

    @pipeline_def(batch_size=batch, num_threads=os.cpu_count() or 1, device_id=0)
    def pipe() -> Any:
        data, _ = fn.readers.file(files=[str(f) for f in files], random_shuffle=False)
        images = fn.decoders.image(data, device="mixed", output_type=types.RGB)
        images = fn.resize(images, resize_shorter=size[0], antialias=True)
        return fn.crop_mirror_normalize(images, crop=(size[1], size[1]), dtype=types.UINT8, output_layout="CHW")

    p = pipe()
    p.build()
    first = torch.stack([torch.as_tensor(np.asarray(t.as_cpu())) for t in p.run()[0]])
    n, t = len(first), time.perf_counter()
    while n < len(files):
        p.run()
        n += batch
    ips = n / (time.perf_counter() - t + 1e-9)
    diff = (first.int() - decoded(files[: len(first)], size).int()).abs().float()
    return {"images_per_s": ips, "mean_diff": diff.mean().item(), "max_diff": diff.max().item()}


def _run_case(case: Case, root: Path, work: Path, device: str) -> dict[str, Any]:
    """One case: the bare loops and extractor's jobs."""
    files = sorted(root.rglob("*.jpg"))[: min(case.images, 512)]
    pixels = decoded(files, case.size)
    if device.startswith("cuda"):
        pixels = pixels.pin_memory()
    row: dict[str, Any] = {"bare_forward": bare_forward(case, pixels, device),
                           "bare_jpeg": bare_jpeg(case, root, device)}
    for decode in ("cpu", "cuda") if device.startswith("cuda") else ("cpu",):
        row[f"extractor_{decode}"] = extractor_jpeg(case, root, work, device, decode)
    return row


def _line(case: Case, row: dict[str, Any]) -> str:
    base = row["bare_forward"]
    cells = [f"{case.name:42s} {base:9.0f} {row['bare_jpeg']:9.0f}"]
    for decode in ("cpu", "cuda"):
        r = row.get(f"extractor_{decode}")
        cells.append(f"{r['images_per_s']:8.0f} {r['images_per_s'] / base:5.2f} {r['gb_per_s']:6.2f}" if r else
                     f"{'-':>8s} {'-':>5s} {'-':>6s}")
    return " ".join(cells)


def main(work: Path, device: str | None = None, small: bool | None = None,
         budget_s: float = BUDGET_S) -> dict[str, Any]:
    """Run the check, print its table, return its figures. ``device``: cuda where there is one; ``small``: the
    small version (default: where there is no CUDA)."""
    from gpu_check import make_jpegs

    logging.getLogger("extractor.model.build").setLevel(logging.ERROR)
    start = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    small = (not device.startswith("cuda")) if small is None else small
    chosen = cases(small)
    root = make_jpegs(work / f"jpegs-{max(c.images for c in chosen)}", max(c.images for c in chosen))
    where = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    print(f"\ndevice check ({'small, ' if small else ''}{where}, {os.cpu_count()} CPUs, torch {torch.__version__}): "
          f"JPEG files of 500x375 to 640x480 made in {time.perf_counter() - start:.0f} s; bfloat16; images/s")
    print(f"{'job':42s} {'bare fwd':>9s} {'bare JPEG':>9s} {'CPU dec':>8s} {'ratio':>5s} {'GB/s':>6s} "
          f"{'nvJPEG':>8s} {'ratio':>5s} {'GB/s':>6s}")
    results: dict[str, Any] = {"device": where, "small": small, "cases": {}}
    for case in chosen:
        if time.perf_counter() - start > budget_s:
            print(f"{case.name:42s} left out: the check's {budget_s:.0f} s are spent")
            continue
        row = results["cases"][case.name] = _run_case(case, root, work, device)
        print(_line(case, row), flush=True)
    files, size = sorted(root.rglob("*.jpg"))[:64], chosen[0].size
    results["pixels"] = pixel_difference(files, size, device)
    what = "nvJPEG (torchvision.io.decode_jpeg on cuda)" if device.startswith("cuda") else \
        "torchvision.io.decode_jpeg on the CPU (no CUDA)"
    p = results["pixels"]
    print(f"decode paths: 'CPU dec' Pillow on {os.cpu_count()} threads; 'nvJPEG' {what}; its pixels against Pillow's "
          f"on {p['images']} fixed files: mean {p['mean']:.3f}, p99 {p['p99']:.0f}, max {p['max']:.0f} levels")
    results["dali"] = dali(sorted(root.rglob("*.jpg")), size, chosen[0].batch) if device.startswith("cuda") \
        else "not run (no CUDA)"
    print(f"DALI: {results['dali']}")
    print("ratio = extractor's images/s over the bare bfloat16 forward on pre-decoded images ('bare fwd'); 'bare JPEG'"
          " = a DataLoader decoding with Pillow in processes. Targets (issue 55): >= 7,000 images/s for the pooled "
          f"ResNet-50 and ViT-B/16 jobs, >= 0.9 for ViT-L. {time.perf_counter() - start:.0f} s in all.")
    return results
