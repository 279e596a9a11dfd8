"""GPU checks and benchmarks in one script, for a lent GPU (CI has none; see README, "GPU").

    python bench/gpu_check.py                     # issue 55's device check (gpu_speed), at most 8 minutes
    python bench/gpu_check.py --stages correct,decode,predecoded --out DIR [--images 20000] [--jpegs 6000]

Needs torch, torchvision, numpy, pillow, zarr and pydantic; no Ray (the ``local`` backend). Without CUDA the
device check runs its small version on the CPU (``tests/test_gpu_check.py`` runs it).
Stages, each reported even when another fails:

0. speed (the default): :mod:`gpu_speed`, images/s from JPEG files of a pooled ResNet-50 and ViT-B/16 and of
   ViT-L/14's sampled tokens against the bare bfloat16 loop; GB/s written; the decode paths and their pixels.

1. correct: a resnet50 job on the GPU (float32 and bfloat16; batches of 64, so the
   double-buffered pinned copies are exercised) against a direct forward of the same
   pixels with ``create_feature_extractor``, row by row; Grad-CAM against ``autograd.grad``.
2. decode: nvJPEG (``data.decode_device: cuda``) against Pillow, pixels and features.
3. predecoded: resnet50, 224, bfloat16, channels_last, N pre-decoded images in pinned host
   memory: the bare forward loop against extractor (median of 3, alternating), and the GPU
   memory peak of extractor at N/10 and N images. ``compiled`` (not run by default): the
   same at the smallest batch size with ``model.compile``.
4. jpeg: end-to-end jobs over JPEG files, decoded by Pillow on CPU threads or by nvJPEG.
4b. overhead: ``bench_overhead`` (a near-free model, 1, 4 and 16 pooled captures) on the GPU:
   extractor's host time per batch over the bare loop's.
5. compile: ``model.compile`` against eager on the GPU (resnet18).
6. fault (not run by default): a real device-side assert in a child process must stop the job
   with a DeviceError and keep the shard before it.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import statistics
import sys
import time
import traceback
from collections import deque
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # toy_models, for the fault stage

from extractor.compute import worker as worker_mod  # noqa: E402
from extractor.data.decode import ImageDecoder, JpegDecoder  # noqa: E402
from extractor.data.stream import Batch  # noqa: E402
from extractor.driver.runner import LocalBackend, run  # noqa: E402
from extractor.read.reader import open_store  # noqa: E402
from extractor.spec.load import parse_spec  # noqa: E402

RESULTS: dict[str, Any] = {}
POOLED = [{"layer": "avgpool", "reduce": "flatten"}, {"layer": "layer3", "reduce": "mean"}]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- data


def _bases() -> list[np.ndarray]:
    """Real photographs bundled with scikit-image when it is there; else drawn pictures."""
    out = []
    try:
        from skimage import data as sk

        for name in ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field",
                     "motorcycle_left", "retina", "cat", "colorwheel"):
            try:
                img = getattr(sk, name)()
                if img.ndim == 3 and img.shape[2] >= 3:
                    out.append(np.ascontiguousarray(img[..., :3]))
            except Exception:  # noqa: BLE001 - not bundled (needs a download): skip it
                pass
    except ImportError:
        pass
    if not out:
        from extractor.demo import _draw

        out = [np.asarray(_draw(c, np.random.default_rng(c), 512)) for c in range(4)]
    return out


def _write_photo(job: tuple[int, str]) -> None:
    from PIL import Image

    i, path = job
    bases = _write_photo.bases  # type: ignore[attr-defined]
    rng = np.random.default_rng(i)
    base = bases[i % len(bases)]
    h, w = base.shape[:2]
    ch, cw = int(h * rng.uniform(0.5, 1.0)), int(w * rng.uniform(0.5, 1.0))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    img = Image.fromarray(base[y:y + ch, x:x + cw])
    size = [(500, 375), (375, 500), (500, 333), (640, 480)][i % 4]
    img = img.resize(size, Image.BILINEAR)
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    img.save(path, quality=90)


def make_jpegs(folder: Path, n: int) -> Path:
    """``n`` JPEG files of ImageNet-like sizes (crops of real photographs), in two classes."""
    if folder.exists() and len(list(folder.rglob("*.jpg"))) == n:
        return folder
    for c in ("a", "b"):
        (folder / c).mkdir(parents=True, exist_ok=True)
    _write_photo.bases = _bases()  # type: ignore[attr-defined]
    jobs = [(i, str(folder / ("a" if i % 2 else "b") / f"{i:06d}.jpg")) for i in range(n)]
    if n <= 64:  # a few (the small device check, in a test process): no processes forked
        for one in jobs:
            _write_photo(one)
        return folder
    with Pool(min(16, os.cpu_count() or 1)) as pool:
        pool.map(_write_photo, jobs, chunksize=64)
    return folder


def job(root: Path, store: Path, device: str, **sections: Any) -> Any:
    raw: dict[str, Any] = {
        "model": {"name": "resnet50", "weights": None, "device": device},
        "data": {"root": str(root), "batch_size": 64, "shard_size": 512, "decode_workers": 8},
        "capture": POOLED,
        "output": {"store": str(store), "chunk_rows": 128, "if_exists": "overwrite"},
        "cluster": {"backend": "local"},
    }
    for k, v in sections.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) else v
    return parse_spec(raw)


def rel_err_rows(a: np.ndarray, b: np.ndarray) -> float:
    """Largest per-row relative error ||a - b|| / ||b||: a misplaced row shows up as ~1."""
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    return float((np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-12)).max())


# --------------------------------------------------------------------------- 1. correct


def _reference(model_name: str, layers: dict[str, str], pixels: torch.Tensor, device: str,
               dtype: torch.dtype | None) -> dict[str, np.ndarray]:
    import torchvision
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    model = torchvision.models.get_model(model_name, weights=None).eval()
    model = model.to(device, memory_format=torch.channels_last)
    fx = create_feature_extractor(model, layers)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)
    out: dict[str, list[np.ndarray]] = {}
    with torch.inference_mode(), torch.autocast("cuda" if device.startswith("cuda") else "cpu",
                                                dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        for a in range(0, len(pixels), 64):
            x = pixels[a:a + 64].to(device).float().div(255).sub(mean).div(std)
            for k, v in fx(x.contiguous(memory_format=torch.channels_last)).items():
                out.setdefault(k, []).append(v.float().cpu().numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def stage_correct(args: argparse.Namespace, photos: Path) -> None:
    work = Path(args.work)
    n = args.check_images
    sub = work / "check-photos"
    if not sub.exists():
        for c in ("a", "b"):
            (sub / c).mkdir(parents=True, exist_ok=True)
        files = sorted(photos.rglob("*.jpg"))[:n]
        for f in files:
            (sub / f.parent.name / f.name).symlink_to(f)
    capture = [{"layer": "avgpool", "reduce": "flatten"}, {"layer": "layer3", "reduce": "mean"},
               {"layer": "layer4", "reduce": "none", "dtype": "float16"}]
    for dtype, tol in (("float32", 5e-3), ("bfloat16", 5e-2)):
        spec = job(sub, work / f"correct-{dtype}.zarr", args.device, model={"dtype": dtype}, capture=capture,
                   data={"shard_size": 256})
        summary = run(spec)
        s = open_store(str(work / f"correct-{dtype}.zarr"))
        pixels = torch.stack([ImageDecoder(spec.data)(str(p)) for p in s.paths])
        ref = _reference("resnet50", {"avgpool": "avgpool", "layer3": "layer3", "layer4": "layer4"}, pixels,
                         args.device, torch.bfloat16 if dtype == "bfloat16" else None)
        errs = {
            "avgpool": rel_err_rows(s.numpy("avgpool"), ref["avgpool"].reshape(len(pixels), -1)),
            "layer3": rel_err_rows(s.numpy("layer3"), ref["layer3"].mean(axis=(2, 3))),
            "layer4": rel_err_rows(s.numpy("layer4").astype(np.float32), ref["layer4"]),
        }
        ok = summary.ok == n and all(e < tol for e in errs.values())
        RESULTS[f"correct_{dtype}"] = {"rows": summary.ok, "max_row_rel_err": errs, "tol": tol, "pass": ok}
        log(f"correct {dtype}: {summary.ok} rows, max per-row relative error {errs} (tol {tol}) "
            f"{'PASS' if ok else 'FAIL'}")

    # Grad-CAM on the GPU against autograd.grad of the predicted logit
    spec = job(sub, work / "cam.zarr", args.device, capture=[{"layer": "layer4", "what": "gradcam", "key": "cam"}],
               data={"shard_size": 256})
    run(spec)
    s = open_store(str(work / "cam.zarr"))
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval().to(args.device, memory_format=torch.channels_last)
    model.requires_grad_(False)
    feats: dict[str, torch.Tensor] = {}
    model.layer4.register_forward_hook(lambda m, i, o: feats.__setitem__("f", o))
    mean = torch.tensor([0.485, 0.456, 0.406], device=args.device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=args.device).view(1, 3, 1, 1)
    pixels = torch.stack([ImageDecoder(spec.data)(str(p)) for p in s.paths[:64]])
    x = pixels.to(args.device).float().div(255).sub(mean).div(std).contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    logits = model(x)
    score = logits.gather(1, logits.argmax(1, keepdim=True)).sum()
    (g,) = torch.autograd.grad(score, feats["f"])
    cam = torch.relu((g.mean(dim=(2, 3), keepdim=True) * feats["f"]).sum(1)).detach().cpu().numpy()
    err = rel_err_rows(s.numpy("cam")[:64], cam)
    RESULTS["correct_gradcam"] = {"max_row_rel_err": err, "pass": err < 5e-3}
    log(f"correct gradcam: max per-row relative error {err:.2e} {'PASS' if err < 5e-3 else 'FAIL'}")


# --------------------------------------------------------------------------- 2. decode


def stage_decode(args: argparse.Namespace, photos: Path) -> None:
    work = Path(args.work)
    files = [str(p) for p in sorted(photos.rglob("*.jpg"))[:256]]
    spec = job(photos, work / "x.zarr", args.device)
    pil = ImageDecoder(spec.data)
    gpu = JpegDecoder(spec.data, torch.device(args.device))
    got = gpu.collate([gpu.read(f) for f in files])
    assert not got[1], got[1]
    ref = torch.stack([pil(f) for f in files])
    diff = (got[0].cpu().int() - ref.int()).abs().float()
    RESULTS["decode_pixels"] = {"images": len(files), "mean_abs_diff": diff.mean().item(),
                                "p99_abs_diff": diff.flatten().kthvalue(int(0.99 * diff.numel())).values.item(),
                                "max_abs_diff": diff.max().item()}
    log(f"decode nvJPEG vs Pillow, {len(files)} images: {RESULTS['decode_pixels']}")


# --------------------------------------------------------------------------- 3. predecoded


class SliceStream:
    """Batches sliced from a pinned uint8 tensor of pre-decoded images (the rows' file names are
    their indices), shard after shard, as the worker's ``BatchStream`` gives them."""

    def __init__(self, pixels: torch.Tensor, batch_size: int) -> None:
        self.pixels, self.batch_size = pixels, batch_size
        self.shards: deque[tuple[int, int]] = deque()
        self.row = 0

    def add(self, paths: list[Any]) -> None:
        self.shards.append((int(Path(paths[0]).stem), len(paths)))

    def next(self) -> Batch | None:
        if not self.shards:
            return None
        first, n = self.shards[0]
        if self.row == n:
            self.shards.popleft()
            self.row = 0
            return None
        a, b = self.row, min(self.row + self.batch_size, n)
        self.row = b
        return Batch(list(range(a, b)), self.pixels[first + a:first + b], {})


def bare_loop(pixels: torch.Tensor, batch: int, device: str) -> float:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval().to(device, memory_format=torch.channels_last)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)

    def once(n: int) -> None:
        with torch.inference_mode(), torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            for a in range(0, n, batch):
                x = pixels[a:a + batch].to(device, non_blocking=True).float().div_(255).sub_(mean).div_(std)
                model(x.contiguous(memory_format=torch.channels_last))

    once(batch * 3)  # warm-up: cuDNN picks its kernels
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    once(len(pixels))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return len(pixels) / (time.perf_counter() - t0)


def extractor_predecoded(pixels: torch.Tensor, n: int, batch: int, device: str, work: Path,
                         compile_: bool = False, model: dict[str, Any] | None = None,
                         capture: list[dict[str, Any]] | None = None) -> dict[str, float]:
    manifest = work / f"manifest-{n}.csv"
    if not manifest.exists():
        with open(manifest, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["path", "label"])
            w.writerows([[f"/predecoded/{i}.jpg", i % 2] for i in range(n)])
    spec = parse_spec({
        "model": {"name": "resnet50", "weights": None, "device": device, "dtype": "bfloat16",
                  "compile": compile_, **(model or {})},
        "data": {"source": "manifest", "manifest": str(manifest), "outside_root": True, "batch_size": batch,
                 "shard_size": 2048, "resize": None, "crop": 224},
        "capture": capture or POOLED,
        "output": {"store": str(work / "predecoded.zarr"), "chunk_rows": 256, "if_exists": "overwrite"},
        "cluster": {"backend": "local"},
    })
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    first: list[float] = []
    summary = run(spec, on_event=lambda name, info: first.append(time.perf_counter())
                  if name == "shard_started" and not first else None,
                  backend=LocalBackend(spec, worker_mod.Worker(  # batches from a pinned tensor, not files
                      spec, batches=lambda: SliceStream(pixels, spec.data.batch_size))))
    seconds = time.perf_counter() - first[0]
    assert summary.ok == n, summary
    if summary.nonfinite:
        bad = _nonfinite(work / "predecoded.zarr", "avgpool")
        log(f"  NONFINITE in the predecoded store: {summary.nonfinite} {bad}")
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else float("nan")
    waits = {k: round(sum(getattr(s, k) for s in summary.per_shard), 3)
             for k in ("seconds", "wait_decode", "wait_device", "wait_write")}
    return {"images_per_s": n / seconds, "gpu_peak_mib": peak, "run_seconds": seconds, **waits}


def stage_predecoded(args: argparse.Namespace) -> None:
    work = Path(args.work)
    n = args.images
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (512, 3, 224, 224), dtype=torch.uint8, generator=g)
    pixels = torch.empty((n, 3, 224, 224), dtype=torch.uint8, pin_memory=args.device.startswith("cuda"))
    for a in range(0, n, 512):
        pixels[a:a + 512] = base[: min(512, n - a)]
    log(f"predecoded: {n} images in {'pinned ' if pixels.is_pinned() else ''}host memory")
    for batch in args.batches:
        bare, ext = [], []
        for rep in range(args.repeats):
            bare.append(bare_loop(pixels, batch, args.device))
            r = extractor_predecoded(pixels, n, batch, args.device, work)
            ext.append(r["images_per_s"])
            log(f"  batch {batch} run {rep + 1}: bare {bare[-1]:.0f} img/s, extractor {ext[-1]:.0f} img/s {r}")
        b, e = statistics.median(bare), statistics.median(ext)
        RESULTS[f"predecoded_b{batch}"] = {"bare_images_per_s": b, "extractor_images_per_s": e, "ratio": e / b,
                                           "runs_bare": bare, "runs_extractor": ext}
        log(f"predecoded batch {batch}: bare {b:.0f} img/s, extractor {e:.0f} img/s, ratio {e / b:.3f}")
    batch = args.batches[0]
    small = extractor_predecoded(pixels[: n // 10], n // 10, batch, args.device, work)
    big = extractor_predecoded(pixels, n, batch, args.device, work)
    RESULTS["gpu_memory"] = {f"peak_mib_{n // 10}": small["gpu_peak_mib"], f"peak_mib_{n}": big["gpu_peak_mib"],
                             "ratio": big["gpu_peak_mib"] / small["gpu_peak_mib"]}
    log(f"GPU memory peak: {n // 10} images {small['gpu_peak_mib']:.0f} MiB, {n} images "
        f"{big['gpu_peak_mib']:.0f} MiB")


def stage_compiled(args: argparse.Namespace) -> None:
    """Pre-decoded images at the smallest batch size (host-bound in eager mode), with model.compile:
    one run each (the compile happens in the probe, before the timed part)."""
    work = Path(args.work)
    n = args.images
    batch = min(args.batches)
    pixels = torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    if args.device.startswith("cuda"):
        pixels = pixels.pin_memory()
    bare = bare_loop(pixels, batch, args.device)
    eager = extractor_predecoded(pixels, n, batch, args.device, work)
    compiled = extractor_predecoded(pixels, n, batch, args.device, work, compile_=True)
    RESULTS[f"compiled_b{batch}"] = {"bare_images_per_s": bare, "eager": eager, "compiled": compiled,
                                     "ratio_eager": eager["images_per_s"] / bare,
                                     "ratio_compiled": compiled["images_per_s"] / bare}
    log(f"compiled batch {batch}: bare {bare:.0f} img/s, extractor eager {eager['images_per_s']:.0f} "
        f"({eager['images_per_s'] / bare:.3f}), compiled {compiled['images_per_s']:.0f} "
        f"({compiled['images_per_s'] / bare:.3f})")


# --------------------------------------------------------------------------- 4. jpeg


def stage_jpeg(args: argparse.Namespace, photos: Path) -> None:
    work = Path(args.work)
    batch = args.batches[0]
    results: dict[str, list[float]] = {"cpu": [], "cuda": []}
    for rep in range(args.repeats):
        for where in ("cpu", "cuda"):
            spec = job(photos, work / f"jpeg-{where}.zarr", args.device, model={"dtype": "bfloat16"},
                       data={"decode_device": where, "decode_workers": os.cpu_count(), "batch_size": batch,
                             "shard_size": 2048})
            first: list[float] = []
            summary = run(spec, on_event=lambda name, info, first=first: first.append(time.perf_counter())
                          if name == "shard_started" and not first else None)
            ips = summary.ok / (time.perf_counter() - first[0])
            results[where].append(ips)
            bad = _nonfinite(work / f"jpeg-{where}.zarr", "avgpool")
            log(f"  jpeg run {rep + 1} decode on {where}: {ips:.0f} img/s ({summary.ok} ok, {summary.failed} failed)"
                + (f" NONFINITE stats {summary.nonfinite} store {bad}" if summary.nonfinite or bad["nonfinite_rows"]
                   else ""))
    a = open_store(str(work / "jpeg-cpu.zarr")).numpy("avgpool")
    b = open_store(str(work / "jpeg-cuda.zarr")).numpy("avgpool")
    cpu, gpu = statistics.median(results["cpu"]), statistics.median(results["cuda"])
    RESULTS["jpeg_end_to_end"] = {"images": len(a), "cpu_decode_images_per_s": cpu,
                                  "gpu_decode_images_per_s": gpu, "gpu_over_cpu": gpu / cpu,
                                  "cpu_threads": os.cpu_count(), "avgpool_max_row_rel_diff": rel_err_rows(b, a),
                                  "runs": results}
    log(f"jpeg end to end: decode on CPU ({os.cpu_count()} threads) {cpu:.0f} img/s, nvJPEG {gpu:.0f} img/s; "
        f"avgpool max per-row relative difference {RESULTS['jpeg_end_to_end']['avgpool_max_row_rel_diff']:.3f}")


def _nonfinite(url: Path, key: str) -> dict[str, Any]:
    a = open_store(str(url)).numpy(key)
    flat = a.reshape(len(a), -1)
    bad = np.flatnonzero(~np.isfinite(flat).all(axis=1))
    whole = int((~np.isfinite(flat[bad])).all(axis=1).sum()) if len(bad) else 0
    return {"rows": len(a), "nonfinite_rows": len(bad), "all_nan_rows": whole, "first": bad[:12].tolist(),
            "chunks": sorted({int(r) // 128 for r in bad})[:12]}


def stage_nan(args: argparse.Namespace, photos: Path) -> None:
    """Rows holding NaN/Inf in the stores of the end-to-end job, by decoder and writer threads."""
    work = Path(args.work)
    from unittest import mock

    from extractor._machine import Machine

    default = Machine.here().write_threads
    for where in ("cuda", "cpu"):
        for threads in (default, 1):
            with mock.patch.object(Machine, "write_threads", property(lambda self, n=threads: n)):
                summary = run(job(photos, work / f"nan-{where}-{threads}.zarr", args.device,
                                  model={"dtype": "bfloat16"},
                                  data={"decode_device": where, "decode_workers": os.cpu_count(), "batch_size": 256,
                                        "shard_size": 2048}))
            url = work / f"nan-{where}-{threads}.zarr"
            r = {k: _nonfinite(url, k) for k in ("avgpool", "layer3")}
            RESULTS[f"nan_{where}_{threads}"] = {"stats_nonfinite": summary.nonfinite, **r}
            log(f"nan check decode {where}, {threads} writer threads: stats say {summary.nonfinite}; store {r}")


# --------------------------------------------------------------------------- 5. compile


def stage_compile(args: argparse.Namespace, photos: Path) -> None:
    work = Path(args.work)
    sub = work / "check-photos"
    out = {}
    for compile_ in (False, True):
        spec = job(sub, work / f"compile-{compile_}.zarr", args.device,
                   model={"name": "resnet18", "compile": compile_},
                   capture=[{"layer": "layer2", "reduce": "none", "dtype": "float16"},
                            {"layer": "layer4.1.bn1", "reduce": "mean"}],  # the forward stops there
                   data={"shard_size": 256, "batch_size": 64})
        t0 = time.perf_counter()
        run(spec)
        s = open_store(str(work / f"compile-{compile_}.zarr"))
        out[compile_] = ({k: s.numpy(k) for k in s.captures}, time.perf_counter() - t0)
    errs = {k: rel_err_rows(out[True][0][k], out[False][0][k]) for k in out[False][0]}
    ok = all(e < 5e-3 for e in errs.values())
    RESULTS["compile"] = {"max_row_rel_err": errs, "eager_s": out[False][1], "compiled_s": out[True][1], "pass": ok}
    log(f"compile: max per-row relative error {errs}, eager job {out[False][1]:.1f} s, compiled job "
        f"{out[True][1]:.1f} s (compile included) {'PASS' if ok else 'FAIL'}")


FAULT_CHILD = """
import json, sys
sys.path[:0] = [{tests!r}, {repo!r}]
from extractor.driver.runner import run
from extractor.spec.load import parse_spec  # noqa: E402
from extractor.read.reader import open_store  # noqa: E402
try:
    run(parse_spec({raw!r}))
    out = {{"raised": None}}
except BaseException as err:
    out = {{"raised": type(err).__name__, "message": str(err)[:600]}}
s = open_store({store!r})
out["done_shards"] = s.done_shards.tolist()
out["status"] = s.attrs["status"]
print(json.dumps(out))
"""


def stage_fault(args: argparse.Namespace, photos: Path) -> None:
    """A real CUDA fault (a device-side assert from an out-of-bounds index in shard 1's first
    batch), in a child process since it ruins the CUDA context: the job must stop with a
    DeviceError, shard 0 done, no row blamed."""
    import subprocess

    work = Path(args.work)
    store = work / "fault.zarr"
    after = worker_mod.PROBE_FORWARDS + 4  # the probe's forwards, then shard 0's 4 batches
    raw = {"model": {"name": None, "factory": "toy_models:cuda_fault", "factory_kwargs": {"after": after},
                     "device": args.device},
           "data": {"root": str(photos), "batch_size": 64, "shard_size": 256, "decode_workers": 8,
                    "preprocess": "imagenet"},
           "capture": [{"layer": "conv", "reduce": "mean"}],
           "output": {"store": str(store), "chunk_rows": 64, "if_exists": "overwrite"},
           "cluster": {"backend": "local"}}
    code = FAULT_CHILD.format(tests=str(REPO / "tests"), repo=str(REPO), raw=raw, store=str(store))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    try:
        out = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        out = {"stdout": done.stdout[-2000:], "stderr": done.stderr[-2000:], "rc": done.returncode}
    ok = out.get("raised") == "DeviceError" and out.get("done_shards", [False])[0] and out.get("status") == "failed"
    RESULTS["fault"] = {**out, "pass": bool(ok)}
    log(f"fault: {out} {'PASS' if ok else 'FAIL'}")


# --------------------------------------------------------------------------- main


def stage_overhead(args: argparse.Namespace) -> None:
    """The host overhead per batch on the GPU: bench_overhead's table with the model on the device."""
    import bench_overhead

    RESULTS["overhead"] = bench_overhead.main(device=args.device)


def stage_speed(args: argparse.Namespace) -> None:
    """Issue 55's device check (gpu_speed): images/s from JPEG files against the bare bfloat16 loop."""
    import gpu_speed

    RESULTS["speed"] = gpu_speed.main(Path(args.work), args.device, small=args.small or None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / ".bench" / "gpu"))
    p.add_argument("--work", default="/tmp/extractor-gpu")
    p.add_argument("--device", default="cuda")
    p.add_argument("--images", type=int, default=20000, help="pre-decoded images")
    p.add_argument("--jpegs", type=int, default=6000, help="JPEG files for the end-to-end jobs")
    p.add_argument("--check-images", type=int, default=512)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[256, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stages", default="speed", help="speed (the default: issue 55's device check), correct, "
                   "decode, predecoded, overhead, jpeg, compile, nan, compiled, fault")
    p.add_argument("--small", action="store_true", help="the speed stage's small version (the default without CUDA)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        args.device = "cpu"
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("extractor.model.build").setLevel(logging.ERROR)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    import torchvision

    RESULTS["env"] = {"torch": torch.__version__, "torchvision": torchvision.__version__,
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                      "cpus": os.cpu_count()}
    log(f"env {RESULTS['env']}")
    if args.stages == "speed":  # the device check makes its own files
        stage_speed(args)
        (out / "gpu_results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
        return
    t0 = time.perf_counter()
    photos = make_jpegs(work / "photos", args.jpegs)
    log(f"{args.jpegs} JPEG files in {time.perf_counter() - t0:.1f} s")
    stages = {"speed": lambda: stage_speed(args), "correct": lambda: stage_correct(args, photos),
              "decode": lambda: stage_decode(args, photos),
              "predecoded": lambda: stage_predecoded(args), "jpeg": lambda: stage_jpeg(args, photos),
              "compile": lambda: stage_compile(args, photos), "nan": lambda: stage_nan(args, photos),
              "compiled": lambda: stage_compiled(args), "fault": lambda: stage_fault(args, photos),
              "overhead": lambda: stage_overhead(args)}
    for name in args.stages.split(","):
        if name in ("decode", "jpeg", "nan") and not args.device.startswith("cuda"):
            log(f"{name}: skipped (needs CUDA)")
            continue
        t = time.perf_counter()
        try:
            stages[name]()
        except Exception:  # noqa: BLE001 - report it and go on with the other stages
            RESULTS[f"{name}_error"] = traceback.format_exc()[-3000:]
            log(f"{name} FAILED:\n{RESULTS[f'{name}_error']}")
        log(f"stage {name}: {time.perf_counter() - t:.1f} s")
        (out / "gpu_results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print(json.dumps({k: v for k, v in RESULTS.items() if not k.endswith("_error")}, indent=1, default=str))


if __name__ == "__main__":
    main()
