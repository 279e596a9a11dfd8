"""Analysis of a store: linear probes and PCA (scikit-learn), the rows where a feature is highest (numpy)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import StoreError
from .reader import ActivationStore

__all__ = ["finite", "linear_probe", "pca", "principal_components", "probe_store", "top_rows"]

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


def _sklearn() -> Any:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise StoreError("probes and PCA use scikit-learn, which is not installed: pip install "
                         "'extractor[analysis]'") from None


def linear_probe(x: np.ndarray, y: np.ndarray, folds: int = 5, seed: int = 0, c: float = 1.0) -> dict[str, Any]:
    """Held-out accuracy of a linear classifier of the labels ``y`` from the features ``x``, by scikit-learn:
    features standardized on each training fold, ``LogisticRegression`` (multinomial, L2 penalty of strength
    ``1 / c``, lbfgs), ``StratifiedKFold`` (shuffled with ``seed``: every fold keeps the classes' shares).
    ``chance`` is the majority class's share: what always guessing it scores."""
    _sklearn()
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    classes, yi = np.unique(y, return_inverse=True)
    if len(classes) < 2:
        raise StoreError("a probe needs at least two classes among the labelled ok rows")
    if folds < 2:
        raise ValueError(f"a cross-validated probe needs folds >= 2, not {folds}")
    counts = np.bincount(yi)
    if counts.min() < 2:
        raise StoreError(f"class {classes[counts.argmin()]} has {counts.min()} labelled row: a stratified probe "
                         "needs at least 2 of each class (drop the class, or label more rows)")
    if folds > counts.min():
        log.warning("a %d-fold probe whose smallest class has %d rows: %d folds (each fold holds every class)",
                    folds, counts.min(), counts.min())
        folds = int(counts.min())
    model = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=1000))
    split = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    accs = cross_val_score(model, x, yi, cv=split, scoring="accuracy")
    return {"accuracy": float(np.mean(accs)), "std": float(np.std(accs)), "folds": [float(a) for a in accs],
            "chance": float(counts.max() / len(yi)), "rows": len(yi), "features": int(x.shape[1]),
            "classes": len(classes), "model": f"StandardScaler + LogisticRegression(C={c:g}, L2), "
                                               f"StratifiedKFold({folds}, shuffled, seed {seed})"}


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
    """The first ``k`` principal-component scores of the rows of ``x`` (scikit-learn's PCA)."""
    return principal_components(x, k, seed)[0]


def principal_components(x: np.ndarray, k: int = 2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The first ``k`` principal-component scores of the rows of ``x`` and each one's share of the variance
    (scikit-learn's PCA; fewer rows or features than ``k``: the missing components are 0)."""
    if len(x) < 2:
        raise StoreError(f"a PCA needs at least 2 rows, not {len(x)}")
    _sklearn()
    from sklearn.decomposition import PCA

    n = min(k, *x.shape)
    model = PCA(n_components=n, random_state=seed).fit(x)
    scores, ratio = model.transform(x), model.explained_variance_ratio_
    return np.pad(scores, ((0, 0), (0, k - n))), np.pad(ratio, (0, k - n))


def _top_axis(key: str, dims: list[str], pool: str, k: int) -> int:
    """The feature axis of a capture of ``dims`` that top rows rank by; a one-line error naming what is wrong."""
    from ..store import feature_axis

    axis = feature_axis(dims)
    if axis is None:
        raise StoreError(f"top rows of {key} need a feature axis; its dims: {', '.join(dims)}")
    if pool not in ("max", "mean"):
        raise StoreError(f"top rows of {key}: pool must be max or mean, not {pool!r}")
    if k < 1:
        raise StoreError(f"top rows of {key}: k must be >= 1, not {k}")
    return axis


def top_rows(store: ActivationStore, key: str, feature: int | np.ndarray, k: int = 16,
             pool: str = "max") -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` ok rows of capture ``key`` where a feature is highest: ``feature`` is the index of a channel (of a
    map) or feature (of a vector or a token sequence), or a direction over them (a vector, e.g. an SAE decoder
    row: the features' dot product with it), pooled over positions or tokens by ``pool`` (``max`` or ``mean``).
    Streamed a batch of whole chunks at a time (never the whole capture). Returns ``(rows, values)``, highest
    first; rows holding NaN or Inf there never come."""
    meta = store.captures.get(key)
    if meta is None:
        raise StoreError(f"{key!r} is not a capture of {store.url}; its captures: {', '.join(store.keys)}")
    axis = _top_axis(key, meta["dims"], pool, k)
    n_feat = int(meta["shape"][axis - 1])
    direction = None if isinstance(feature, int | np.integer) else np.asarray(feature, np.float64).reshape(-1)
    if (direction is None and not 0 <= int(feature) < n_feat) or (direction is not None and len(direction) != n_feat):
        given = f"not {int(feature)}" if direction is None else f"not {len(direction)} values"
        raise StoreError(f"{key} has {n_feat} features along {meta['dims'][axis - 1]}: give an index 0 to "
                         f"{n_feat - 1}, or a direction of {n_feat} values ({given})")
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
