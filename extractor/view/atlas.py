"""The atlas's pages of the viewer (issue 59), as plain data like :mod:`.site`'s: an index's map of all its features
(drawn by the page's script as a zoomable scatter, coloured by density, each point a link to its feature page) and a
feature's neighbours by each measure; the images nearest a row by a capture's pooled vector."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..index import FeatureIndex
from ..read import ActivationStore, NearestRows
from ..store import OK
from .common import numbers, page_path

__all__ = ["MEASURE_NAMES", "SIMILAR", "map_page", "nearest_rows", "neighbour_lists", "similar_key", "similar_rows"]

SIMILAR = 8  # images listed as nearest a row
MEASURE_NAMES = {"decoder": "decoder cosine", "cooccurrence": "co-occurrence (Jaccard of tokens)",
                 "correlation": "correlation over rows"}


def map_page(index: FeatureIndex, record: dict[str, Any]) -> dict[str, Any]:
    """The map of ``index`` (its page's ``record``): each feature's place, its density (of tokens, the colour) and
    the page its point links to (no atlas: the command that adds one)."""
    page: dict[str, Any] = {"title": f"{index.name}: map", "index": record, "map": None}
    atlas = index.atlas
    if atlas is None:
        page["missing"] = f"extractor index {index.store.url} --name {index.name} --atlas"
        return page
    coords = index.map.astype(np.float64)
    page["map"] = {"x": numbers(coords[:, 0], 5), "y": numbers(coords[:, 1], 5), "density": numbers(index.density),
                   "method": atlas["map"]["method"], "seed": atlas["map"]["seed"], "source": atlas["map"]["source"],
                   "rows": atlas["rows"], "feature": page_path("feature", record["slug"], "F")}
    return page


def neighbour_lists(index: FeatureIndex, slug: str, f: int) -> list[dict[str, Any]]:
    """Feature ``f``'s neighbours by each measure of the index's atlas, with their pages ([] without one)."""
    if index.atlas is None:
        return []
    out = []
    for measure, found in index.neighbours(f).items():
        scores = numbers(found.scores)
        counts = found.counts.tolist() if found.counts is not None else [None] * len(scores)
        out.append({"measure": measure, "name": MEASURE_NAMES.get(measure, measure),
                    "features": [{"feature": int(g), "score": s, "count": c, "page": page_path("feature", slug, int(g))}
                                 for g, s, c in zip(found.features.tolist(), scores, counts, strict=True)]})
    return out


def similar_key(store: ActivationStore) -> str | None:
    """The capture the image pages find nearest rows by: the first that is not a Grad-CAM map (None: none, or no
    ok row)."""
    if not (store.status == OK).any():
        return None
    return next((k for k, m in store.captures.items() if m["what"] != "gradcam"), None)


def nearest_rows(cache: dict[str, NearestRows], store: ActivationStore, key: str) -> NearestRows:
    """The store's pooled vectors of ``key``, read once (kept in ``cache``)."""
    found = cache.get(key)
    if found is None:
        found = cache[key] = NearestRows(store, key)
    return found


def similar_rows(nearest: NearestRows, pictures: Callable[[list[int], list[float | None]], list[dict[str, Any]]],
                 row: int | None = None, vector: np.ndarray | None = None, n: int = SIMILAR) -> dict[str, Any]:
    """The ``n`` ok rows whose pooled vector is nearest ``row``'s (itself left out), or ``vector``'s (pooled
    already), as ``pictures`` shows rows, the pooling said."""
    if row is not None:
        rows, scores = nearest.nearest_to_row(row, n)
    elif vector is not None:
        rows, scores = nearest.nearest(vector, n)
    else:
        raise ValueError("similar_rows needs a row or a vector")
    return {"key": nearest.key, "pooled": nearest.said, "pictures": pictures(rows.tolist(), numbers(scores))}
