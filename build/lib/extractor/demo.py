"""Built-in sample images and the demo job (what ``make demo`` runs).

The images are drawn, not downloaded: four classes of shapes (circle, square, triangle,
stripes) with class-tinted colours, half JPEG and half PNG, the same bytes on every run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["CLASSES", "DEMO_JOB", "NEXT", "write_sample_images"]

CLASSES = ("circle", "square", "triangle", "stripes")

# Kept identical to jobs/demo.yaml (a test checks it); `extractor demo` rewrites the paths.
DEMO_JOB = """\
# The demo job: resnet18 on the built-in sample images (extractor demo writes them).
# Random weights (weights: null) so that it runs offline; use IMAGENET1K_V1 for trained features.
model:
  name: resnet18
  weights: null
  device: auto
data:
  source: folder
  root: demo/images
  resize: 256
  crop: 224
  shard_size: 64
  batch_size: 32
  decode_workers: 2
capture:
  - {layer: layer3, what: output, reduce: none, dtype: float16}
  - {layer: "layer4.*.conv2", reduce: mean}
  - {layer: avgpool, reduce: flatten, key: embedding}
  - {layer: fc, key: logits}
output:
  store: demo/demo.zarr
  chunk_rows: 32
  compression: zstd
cluster:
  backend: local
"""


# What to try on the demo's store next, as (what it shows, the command's arguments; STORE stands for the store):
# the commands the demo does not run itself. `extractor demo` prints them, pasteable, as its last lines.
NEXT = (
    ("what every channel of layer3 responds to (its top images, densities)", ("index", "STORE", "--key", "layer3")),
    ("browse the store and that index in the browser", ("view", "STORE")),
)


def _draw(cls: int, rng: np.random.Generator, size: int):  # -> PIL.Image.Image
    from PIL import Image, ImageDraw, ImageFilter

    tint = np.array([(90, 0, 0), (0, 90, 0), (0, 0, 90), (70, 70, 0)][cls], dtype=np.float64)
    bg = tuple(int(v) for v in rng.integers(0, 80, 3) + tint * 0.5)
    fg = tuple(int(v) for v in np.clip(rng.integers(110, 170, 3) + tint, 0, 255))
    img = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(img)
    r = int(rng.integers(size // 6, size // 3))
    cx, cy = (int(v) for v in rng.integers(r, size - r, 2))
    if CLASSES[cls] == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif CLASSES[cls] == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif CLASSES[cls] == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    else:
        width = int(rng.integers(6, 16))
        for x in range(0, size, 2 * width):
            d.rectangle([x, 0, x + width - 1, size], fill=fg)
    noise = rng.normal(0, 12, (size, size, 3))
    arr = np.clip(np.asarray(img, dtype=np.float64) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(arr).filter(ImageFilter.GaussianBlur(0.6))


def write_sample_images(root: str | Path, per_class: int = 64, size: int = 256, seed: int = 0) -> list[Path]:
    """Write ``per_class`` images of each class under ``root/<class>/``; returns their paths."""
    root = Path(root)
    out = []
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            rng = np.random.default_rng([seed, c, i])
            img = _draw(c, rng, size)
            path = root / name / f"{name}_{i:04d}.{'jpg' if i % 2 == 0 else 'png'}"
            if path.suffix == ".jpg":
                img.save(path, quality=90)
            else:
                img.save(path)
            out.append(path)
    return out
