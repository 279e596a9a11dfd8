"""`make bench BENCH_ARGS=--decode`: JPEG decoding, images per second on one CPU core (issue 20).

Each decoder turns the same JPEG files into the model's input (shorter side 256, centre crop
224): decode, resize, crop, as uint8. One thread (Pillow and libjpeg-turbo decode a file on one
thread anyway; torch is set to one), so the figure times the cores of a node is its decode
budget. Sizes: ImageNet-like 500x375, COCO/LAION-like 1024x768 and 2048x1536.

The photos are synthetic but photo-like: 1/f noise (the power spectrum of natural images) over
smooth shapes, saved at quality 90; the table prints their bytes per pixel (real photos at that
quality: about 0.3 to 0.6). Draft mode (``data.jpeg_draft``) changes pixels: the table gives its
mean and largest difference from the full decode, in levels of 255.

Decoders: extractor's Pillow path (``data.decode_device: cpu``), the same with ``jpeg_draft``,
torchvision's ``decode_jpeg`` on the CPU with extractor's tensor resize, and, when installed,
simplejpeg (libjpeg-turbo; full size and its own DCT downscale, then Pillow's resize).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from extractor.data.decode import ImageDecoder
from extractor.spec.data_spec import DataSpec

SIZES = ((500, 375), (1024, 768), (2048, 1536))
SPEC = {"root": "unused", "resize": 256, "crop": 224}  # the model's input, as DataSpec settings
FILES = 8  # distinct files per size, decoded in turn


def photo_like(w: int, h: int, seed: int) -> bytes:
    """A JPEG (quality 90) of 1/f noise over a few smooth shapes."""
    rng = np.random.default_rng(seed)
    fy, fx = np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    out = np.empty((h, w, 3))
    for c in range(3):
        spectrum = (rng.standard_normal(f.shape) + 1j * rng.standard_normal(f.shape)) / f
        plane = np.fft.irfft2(spectrum, s=(h, w))
        out[..., c] = (plane - plane.mean()) / plane.std()
    y, x = np.mgrid[0:h, 0:w]
    for _ in range(6):  # shapes with edges: what an object in a photo adds
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0.05, 0.3) * min(w, h)
        out[(y - cy) ** 2 + (x - cx) ** 2 < r * r] += rng.uniform(-1.5, 1.5, 3)
    arr = np.clip(128 + 40 * out, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _torchvision() -> Callable[[bytes], Any]:
    from torchvision.io import ImageReadMode, decode_jpeg

    pre = ImageDecoder(DataSpec(**SPEC)).preprocess

    def decode(data: bytes) -> Any:
        return pre.geometry(decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB))
    return decode


def _simplejpeg(scaled: bool) -> Callable[[bytes], Any] | None:
    try:
        import simplejpeg  # type: ignore[import-not-found]
    except ImportError:
        return None
    pre = ImageDecoder(DataSpec(**SPEC)).preprocess

    def decode(data: bytes) -> Any:
        if scaled:
            w, h = simplejpeg.decode_jpeg_header(data)[:2]
            mw, mh = pre.draft_size(w, h) or (w, h)
            arr = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=mw, min_height=mh)
        else:
            arr = simplejpeg.decode_jpeg(data, colorspace="RGB")
        return pre.apply(Image.fromarray(arr))
    return decode


def decoders() -> dict[str, Callable[[bytes], Any] | None]:
    return {
        "Pillow (extractor, cpu)": ImageDecoder(DataSpec(**SPEC)).from_bytes,
        "Pillow + jpeg_draft": ImageDecoder(DataSpec(**SPEC, jpeg_draft=True)).from_bytes,
        "torchvision decode_jpeg (cpu)": _torchvision(),
        "simplejpeg": _simplejpeg(scaled=False),
        "simplejpeg, DCT-scaled": _simplejpeg(scaled=True),
    }


def rate(decode: Callable[[bytes], Any], files: list[bytes], seconds: float = 1.5) -> float:
    """Images per second on this thread, over at least ``seconds``."""
    decode(files[0])
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or n < len(files):
        decode(files[n % len(files)])
        n += 1
    return n / elapsed


def main() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        table = decoders()
        print("\nJPEG decode to the model's input (shorter side 256, crop 224), images/s on one core")
        print(f"{'decoder':32s}" + "".join(f"{f'{w}x{h}':>12s}" for w, h in SIZES))
        files = {size: [photo_like(*size, seed=i) for i in range(FILES)] for size in SIZES}
        full = table["Pillow (extractor, cpu)"]
        assert full is not None
        for name, decode in table.items():
            if decode is None:
                print(f"{name:32s}{'not installed':>36s}")
                continue
            print(f"{name:32s}" + "".join(f"{rate(decode, files[s]):12.0f}" for s in SIZES))
        print(f"{'bytes per pixel':32s}" + "".join(
            f"{np.mean([len(b) for b in files[s]]) / (s[0] * s[1]):12.2f}" for s in SIZES))
        drafted = table["Pillow + jpeg_draft"]
        assert drafted is not None
        for stat in ("mean", "max"):
            cells = []
            for s in SIZES:
                d = [(drafted(b).float() - full(b).float()).abs() for b in files[s]]
                cells.append(np.mean([x.mean() for x in d]) if stat == "mean" else max(float(x.max()) for x in d))
            print(f"{f'jpeg_draft: {stat} |difference|':32s}" + "".join(f"{c:12.2f}" for c in cells))
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
