"""Analysis of a store: linear probes, PCA, and the pictures of both (numpy and PIL only)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import StoreError
from .pictures import crop_like_job, fit_text
from .reader import ActivationStore

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["linear_probe", "probe_store", "pca", "bar_chart", "scatter_plot", "image_grid", "top_rows"]

log = logging.getLogger(__name__)


def _features(store: ActivationStore, key: str, max_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = store.ok_rows()
    rows = rows[store.labels[rows] >= 0]
    if len(rows) > max_rows:
        rows = np.sort(np.random.default_rng(seed).choice(rows, max_rows, replace=False))
    x = store.numpy(key, rows=rows).reshape(len(rows), -1).astype(np.float32)
    x, rows = finite(x, rows, key)
    return x, store.labels[rows], rows


def finite(x: np.ndarray, rows: np.ndarray, key: str) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``x`` (store rows ``rows``) without NaN or Inf, which a probe or a PCA cannot
    use (a float16 capture that overflowed): left out with a warning, or an error when none is left."""
    keep = np.isfinite(x).all(axis=1)
    if keep.all():
        return x, rows
    if not keep.any():
        raise StoreError(f"every row of {key} holds NaN or Inf (see extractor inspect): nothing to analyse")
    log.warning("%s: %d of %d rows hold NaN or Inf and are left out (first: %s)", key, int((~keep).sum()), len(keep),
                ", ".join(map(str, rows[~keep][:5])))
    return x[keep], rows[keep]


def _softmax_regression(x: np.ndarray, y: np.ndarray, k: int, l2: float, iters: int) -> np.ndarray:
    """Multinomial logistic regression by full-batch Adam on standardized x; returns (d+1, k) weights."""
    n, d = x.shape
    xb = np.hstack([x, np.ones((n, 1), np.float32)])
    w = np.zeros((d + 1, k), np.float32)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    onehot = np.eye(k, dtype=np.float32)[y]
    lr, b1, b2 = 0.05, 0.9, 0.999
    for t in range(1, iters + 1):
        z = xb @ w
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        g = xb.T @ (p - onehot) / n
        g[:-1] += l2 * w[:-1]
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w -= lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + 1e-8)
    return w


def linear_probe(
    x: np.ndarray, y: np.ndarray, folds: int = 5, seed: int = 0, l2: float = 1e-3, iters: int = 300
) -> dict[str, Any]:
    """Cross-validated accuracy of a linear classifier on standardized features."""
    classes, yi = np.unique(y, return_inverse=True)
    if len(classes) < 2:
        raise StoreError("a probe needs at least two classes among the labelled ok rows")
    n = len(yi)
    if folds < 2:
        raise ValueError(f"a cross-validated probe needs folds >= 2, not {folds}")
    if folds > n:
        log.warning("a %d-fold probe of %d rows: %d folds (one row each)", folds, n, n)
        folds = n
    order = np.random.default_rng(seed).permutation(n)
    parts = np.array_split(order, folds)
    accs = []
    for f in range(folds):
        test = parts[f]
        train = np.concatenate([parts[i] for i in range(folds) if i != f])
        mu = x[train].mean(axis=0)
        sd = x[train].std(axis=0) + 1e-6
        w = _softmax_regression((x[train] - mu) / sd, yi[train], len(classes), l2, iters)
        xt = np.hstack([(x[test] - mu) / sd, np.ones((len(test), 1), np.float32)])
        accs.append(float(((xt @ w).argmax(axis=1) == yi[test]).mean()))
    counts = np.bincount(yi)
    return {"accuracy": float(np.mean(accs)), "std": float(np.std(accs)), "folds": accs,
            "chance": float(counts.max() / n), "rows": n, "features": int(x.shape[1]), "classes": len(classes)}


def probe_store(
    store: ActivationStore, keys: Sequence[str] | None = None, folds: int = 5, max_rows: int = 10000, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """A linear probe of each capture against the labels."""
    if not (store.labels >= 0).any():
        raise StoreError(f"{store.url} has no labels; a probe needs labelled rows (ImageFolder or a label column)")
    unknown = [k for k in keys or [] if k not in store.captures]
    if unknown:
        raise StoreError(f"{store.url} has no capture {', '.join(map(repr, unknown))}; "
                         f"captures: {', '.join(store.keys)}")
    out = {}
    for key in keys or store.keys:
        x, y, _ = _features(store, key, max_rows, seed)
        out[key] = linear_probe(x, y, folds=folds, seed=seed)
    return out


def pca(x: np.ndarray, k: int = 2, seed: int = 0) -> np.ndarray:
    """Top-k principal-component scores of the rows of ``x`` (randomized SVD; light on memory)."""
    xc = x - x.mean(axis=0)
    rng = np.random.default_rng(seed)
    q = xc @ rng.standard_normal((xc.shape[1], k + 8)).astype(xc.dtype)
    for _ in range(2):  # power iterations sharpen the top of the spectrum
        q, _r = np.linalg.qr(q)
        q = xc @ (xc.T @ q)
    q, _r = np.linalg.qr(q)
    _u, _s, vt = np.linalg.svd(q.T @ xc, full_matrices=False)
    scores = xc @ vt[:k].T
    # fewer than k components (one row, or fewer than k features): the missing ones are 0
    return np.pad(scores, ((0, 0), (0, k - scores.shape[1])))


_PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
            (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def bar_chart(results: dict[str, dict[str, Any]], title: str) -> Image.Image:
    """Probe accuracies as horizontal bars, with the chance level marked."""
    from PIL import Image, ImageDraw

    names = list(results)
    label_w, bar_w, row_h = max(8 * max(len(n) for n in names), 80), 400, 26
    img = Image.new("RGB", (label_w + bar_w + 80, 40 + row_h * len(names) + 20), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 10), title, fill="black")
    x0 = label_w + 10
    for i, name in enumerate(names):
        r = results[name]
        y = 40 + i * row_h
        d.text((10, y + 6), name, fill="black")
        d.rectangle([x0, y + 3, x0 + int(bar_w * r["accuracy"]), y + row_h - 5], fill=_PALETTE[0])
        cx = x0 + int(bar_w * r["chance"])
        d.line([cx, y, cx, y + row_h - 2], fill=(214, 39, 40), width=2)
        d.text((x0 + bar_w + 8, y + 6), f"{r['accuracy']:.2f}", fill="black")
    d.text((x0, 40 + row_h * len(names) + 2), "red line: chance (majority class)", fill=(214, 39, 40))
    return img


def scatter_plot(
    points: np.ndarray, labels: np.ndarray, classes: Sequence[str], title: str, size: int = 480
) -> Image.Image:
    """A 2-D scatter, one colour per label, with a legend."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size + 160, size + 40), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 8), title, fill="black")
    lo, hi = points.min(axis=0), points.max(axis=0)
    span = np.where(hi > lo, hi - lo, 1.0)
    xy = (points - lo) / span * (size - 20) + 10
    d.rectangle([5, 30, size + 5, size + 35], outline=(180, 180, 180))
    for (px, py), lab in zip(xy, labels, strict=True):
        c = _PALETTE[int(lab) % len(_PALETTE)] if lab >= 0 else (0, 0, 0)
        cx, cy = 5 + px, 30 + (size - py)
        d.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=c)
    for i, lab in enumerate(sorted({int(v) for v in labels})):
        name = classes[lab] if 0 <= lab < len(classes) else str(lab)
        c = _PALETTE[lab % len(_PALETTE)] if lab >= 0 else (0, 0, 0)
        d.rectangle([size + 20, 40 + 18 * i, size + 30, 50 + 18 * i], fill=c)
        d.text((size + 36, 38 + 18 * i), name, fill="black")
    return img


def top_rows(store: ActivationStore, key: str, feature: int | np.ndarray, k: int = 16,
             pool: str = "max") -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` ok rows of capture ``key`` where a feature is highest: ``feature`` is the index of a channel (of a
    map) or feature (of a vector or a token sequence), or a direction over them (a vector, e.g. an SAE decoder
    row: the features' dot product with it), pooled over positions or tokens by ``pool`` (``max`` or ``mean``).
    Streamed a batch of whole chunks at a time (never the whole capture). Returns ``(rows, values)``, highest
    first; rows holding NaN or Inf there never come."""
    from ..store.stats import feature_axis

    meta = store.captures.get(key)
    if meta is None:
        raise StoreError(f"{key!r} is not a capture of {store.url}; its captures: {', '.join(store.keys)}")
    axis = feature_axis(meta["dims"])
    if axis is None or pool not in ("max", "mean") or k < 1:
        raise StoreError(f"top rows of {key} need a feature axis (its dims: {', '.join(meta['dims'])}), pool max or "
                         f"mean (not {pool!r}) and k >= 1 (not {k})")
    n_feat = int(meta["shape"][axis - 1])
    direction = None if isinstance(feature, int | np.integer) else np.asarray(feature, np.float64).reshape(-1)
    if direction is None and not 0 <= int(feature) < n_feat or direction is not None and len(direction) != n_feat:
        raise StoreError(f"{key} has {n_feat} features along {meta['dims'][axis - 1]}: give an index 0 to "
                         f"{n_feat - 1}, or a direction of {n_feat} values (not {np.shape(feature)})")
    best_rows, best = np.empty(0, np.int64), np.empty(0, np.float64)
    skipped = 0
    for rows, x in store.batches(key, 4096, shuffle=False):
        x = np.asarray(x, np.float64)
        v = np.take(x, int(feature), axis=axis) if direction is None else np.tensordot(x, direction, ([axis], [0]))
        v = v.reshape(len(x), -1)
        score = v.max(axis=1) if pool == "max" else v.mean(axis=1)
        keep = np.isfinite(score)
        skipped += int((~keep).sum())
        best_rows, best = np.concatenate([best_rows, rows[keep]]), np.concatenate([best, score[keep]])
        top = np.argsort(-best, kind="stable")[:k]
        best_rows, best = best_rows[top], best[top]
    if skipped:
        log.warning("%d rows of %s hold NaN or Inf for this feature: left out of the top rows (see extractor "
                    "inspect)", skipped, key)
    return best_rows, best


def image_grid(store: ActivationStore, rows: np.ndarray, columns: int = 8,
               captions: Sequence[str] | None = None) -> Image.Image:
    """The input images of ``rows`` as the job saw them (resized and cropped), with row and label, or
    ``captions``."""
    from PIL import Image, ImageDraw

    from ..data import of_store

    ch, cw = of_store(store.attrs).size
    n_rows = -(-len(rows) // columns)
    sheet = Image.new("RGB", (columns * cw, n_rows * (ch + 16)), "white")
    d = ImageDraw.Draw(sheet)
    classes = store.classes
    for n, r in enumerate(rows):
        x, y = (n % columns) * cw, (n // columns) * (ch + 16)
        try:
            sheet.paste(crop_like_job(store.locator(int(r)), store), (x, y))
        except (OSError, ValueError) as err:
            for i, line in enumerate(("unreadable", type(err).__name__)):
                d.text((x + 2, y + 2 + 12 * i), fit_text(d, line, cw - 4), fill="red")
        lab = int(store.labels[r])
        caption = captions[n] if captions is not None else f"{r}: {classes[lab] if 0 <= lab < len(classes) else lab}"
        d.text((x + 2, y + ch + 2), fit_text(d, caption, cw - 4), fill="black")
    return sheet
