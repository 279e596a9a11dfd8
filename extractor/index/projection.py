"""A 2-D map of an index's features (issue 59): one point per feature, near points for features alike. Made by UMAP
where ``umap-learn`` is installed (the ``atlas`` extra; seeded: the same seed, the same map), else by PCA (numpy:
the two first principal components, from the eigenvectors of the smaller of the covariance and the Gram matrix,
each signed so that its largest coordinate is positive: the same input, the same map). What was used is recorded
with the map.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

__all__ = ["METHODS", "feature_map"]

log = logging.getLogger(__name__)
METHODS = ("auto", "umap", "pca")


def _umap() -> Any:
    try:
        import umap
    except ImportError:
        return None
    return umap


def feature_map(vectors: np.ndarray, seed: int = 0, method: str = "auto") -> tuple[np.ndarray, dict[str, Any]]:
    """(F, 2) float32 coordinates of the rows of ``vectors`` (F, D: a feature each), and what made them
    (``method``: umap or pca, ``seed``). ``method``: ``auto`` (UMAP where installed, else PCA), ``umap`` (refused
    where it is not installed), ``pca``."""
    if method not in METHODS:
        raise ValueError(f"map method must be one of {', '.join(METHODS)}, not {method!r}")
    x = np.nan_to_num(np.asarray(vectors, np.float64))
    umap = _umap() if method != "pca" else None
    if method == "umap" and umap is None:
        raise ImportError("the map's method umap needs umap-learn: pip install 'extractor[atlas]', or use pca")
    if umap is not None and len(x) > 3:
        n = min(15, len(x) - 1)
        coords = umap.UMAP(n_components=2, n_neighbors=n, random_state=seed, metric="cosine").fit_transform(x)
        return np.asarray(coords, np.float32), {"method": "umap", "seed": seed, "n_neighbors": n}
    return _pca(x), {"method": "pca", "seed": seed}


def _pca(x: np.ndarray) -> np.ndarray:
    """The coordinates of ``x``'s rows on its two first principal components (zero where it has fewer)."""
    out = np.zeros((len(x), 2), np.float32)
    if len(x) < 2 or not x.size:
        return out
    centred = x - x.mean(axis=0)
    if centred.shape[1] <= len(centred):  # the features' covariance (D, D): its two first eigenvectors
        values, vectors = np.linalg.eigh(centred.T @ centred)
        coords = centred @ vectors[:, ::-1][:, :2]
    else:  # fewer features than dimensions: the Gram matrix (F, F), u * s of the SVD
        values, vectors = np.linalg.eigh(centred @ centred.T)
        coords = vectors[:, ::-1][:, :2] * np.sqrt(np.maximum(values[::-1][:2], 0))
    for j in range(coords.shape[1]):
        if coords[np.argmax(np.abs(coords[:, j])), j] < 0:
            coords[:, j] = -coords[:, j]
    out[:, : coords.shape[1]] = coords
    return out
