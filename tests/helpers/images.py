"""Real image files written for tests: JPEG and PNG of random content in an ImageFolder tree."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def make_images(
    root: Path, per_class: int = 6, classes: tuple[str, ...] = ("cats", "dogs"), size: int = 80
) -> list[Path]:
    """Real JPEG and PNG files of random content in an ImageFolder tree."""
    from PIL import Image

    out = []
    rng = np.random.default_rng(1)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = size + int(rng.integers(0, 40)), size + int(rng.integers(0, 40))
            arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            arr = (arr // 32 * 32).astype(np.uint8)  # blocky: compresses, stays non-trivial
            img = Image.fromarray(arr)
            p = root / c / f"{c}{i:02d}.{'jpg' if i % 2 == 0 else 'png'}"
            img.save(p)
            out.append(p)
    return out
