"""Pictures of a store: Grad-CAM overlays on the input images (PIL and numpy only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from ..errors import StoreError
from ..store import OK, take_rows
from .pictures import crop_like_job, fit_text
from .reader import ActivationStore

if TYPE_CHECKING:
    import zarr
    from PIL import Image

__all__ = ["gradcam_grid"]

# a perceptually ordered blue-green-yellow-red ramp (control points of "turbo", simplified)
_RAMP = np.array([
    [48, 18, 59], [70, 107, 227], [40, 188, 235], [50, 241, 151],
    [164, 252, 60], [239, 207, 58], [251, 128, 34], [205, 44, 5], [122, 4, 3],
], dtype=np.float64)


def colormap(v: np.ndarray) -> np.ndarray:
    """Values in [0, 1] -> uint8 RGB."""
    x = np.clip(v, 0, 1) * (len(_RAMP) - 1)
    lo = np.floor(x).astype(int).clip(0, len(_RAMP) - 2)
    t = (x - lo)[..., None]
    return (_RAMP[lo] * (1 - t) + _RAMP[lo + 1] * t).astype(np.uint8)


def _rows_of(store: ActivationStore, name: str, idx: np.ndarray) -> np.ndarray:
    """Rows ``idx`` of the store's per-row array ``name`` (an extra of a gradient job)."""
    return take_rows(cast("zarr.Array", store.group[name]), idx)


def gradcam_grid(
    store: ActivationStore, key: str | None = None, rows: slice | None = None, columns: int = 4, alpha: float = 0.5
) -> Image.Image:
    """A grid of the input images of ``rows`` with their Grad-CAM map over them and the target class."""
    from PIL import Image, ImageDraw

    cams = [k for k, m in store.captures.items() if m["what"] == "gradcam"]
    if key is None:
        if not cams:
            raise StoreError(f"{store.url} has no gradcam capture; add one with what: gradcam")
        key = cams[0]
    if key not in cams:
        raise StoreError(f"{key!r} is not a gradcam capture of {store.url}; gradcam captures: {cams or 'none'}")
    idx = np.arange(len(store))[rows if rows is not None else slice(0, 16)]
    idx = idx[store.status[idx] == OK]
    if not idx.size:
        raise StoreError("no ok rows in the selection")
    from ..data import of_store

    ch, cw = of_store(store.attrs).size
    maps = store.numpy(key, rows=idx)
    ranges = _rows_of(store, f"{key}.range", idx)
    targets = _rows_of(store, "target", idx)
    scores = _rows_of(store, "target_score", idx)
    classes = store.classes if store.captures[key].get("target") == "label" else []  # else model classes
    label_h = 16
    n_rows = -(-len(idx) // columns)
    sheet = Image.new("RGB", (columns * cw, n_rows * (ch + label_h)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for n, (row, cam, (lo, hi), t, sc) in enumerate(zip(idx, maps, ranges, targets, scores, strict=True)):
        img = crop_like_job(store.locator(int(row)), store)
        norm = (cam - lo) / (hi - lo) if hi > lo else np.zeros_like(cam)
        heat = Image.fromarray(colormap(norm)).resize((cw, ch), Image.Resampling.BILINEAR)
        blended = Image.blend(img, heat, alpha)
        x, y = (n % columns) * cw, (n // columns) * (ch + label_h)
        sheet.paste(blended, (x, y))
        name = classes[t] if 0 <= t < len(classes) else f"class {t}"
        draw.text((x + 2, y + ch + 2), fit_text(draw, f"{row}: {name} ({sc:.2f})", cw - 4), fill=(0, 0, 0))
    return sheet
