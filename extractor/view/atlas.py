"""The atlas's pages of the viewer (issue 59), as plain data like :mod:`.site`'s: an index's map of all its features
(drawn by the page's script as a zoomable scatter, coloured by density, each point a link to its feature page) and a
feature's neighbours by each measure; the images nearest a row by a capture's pooled vector."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..read import NearestRows
from ..store import OK

if TYPE_CHECKING:
    from ..index import FeatureIndex
    from .site import Site

__all__ = ["map_page", "neighbour_lists", "similar_key", "similar_rows", "MEASURE_NAMES", "SIMILAR"]

SIMILAR = 8  # images listed as nearest a row
MEASURE_NAMES = {"decoder": "decoder cosine", "cooccurrence": "co-occurrence (Jaccard of tokens)",
                 "correlation": "correlation over rows"}


def map_page(site: Site, slug: str) -> dict[str, Any]:
    """The map of index ``slug``: each feature's place, its density (of tokens, the colour) and whether it is dead
    (no atlas: why, and how to add one)."""
    from .site import _numbers, page_path

    index = site.index(slug)
    page: dict[str, Any] = {"title": f"{index.name}: map", "index": site._index_record(slug, index)}
    atlas = index.atlas
    if atlas is None:
        page["missing"] = f"extractor index {site.store.url} --name {index.name} --atlas"
        return page
    coords = index.map.astype(np.float64)
    page["map"] = {"x": _numbers(coords[:, 0], 5), "y": _numbers(coords[:, 1], 5), "density": _numbers(index.density),
                   "method": atlas["map"]["method"], "seed": atlas["map"]["seed"], "source": atlas["map"]["source"],
                   "rows": atlas["rows"], "feature": page_path("feature", slug, "F")}
    return page


def neighbour_lists(index: FeatureIndex, slug: str, f: int) -> list[dict[str, Any]]:
    """Feature ``f``'s neighbours by each measure of the index's atlas, with their pages ([] without one)."""
    from .site import _numbers, page_path

    if index.atlas is None:
        return []
    out = []
    for measure, found in index.neighbours(f).items():
        scores = _numbers(found.scores)
        counts = found.counts.tolist() if found.counts is not None else [None] * len(scores)
        out.append({"measure": measure, "name": MEASURE_NAMES.get(measure, measure),
                    "features": [{"feature": int(g), "score": s, "count": c, "page": page_path("feature", slug, int(g))}
                                 for g, s, c in zip(found.features.tolist(), scores, counts, strict=True)]})
    return out


def similar_rows(site: Site, key: str, row: int, n: int = SIMILAR) -> dict[str, Any]:
    """The ``n`` ok rows whose pooled ``key`` is nearest row ``row``'s (cosine), itself left out; the pooling
    said."""
    from .site import _numbers

    nearest = _nearest(site, key)
    rows, scores = nearest.nearest_to_row(row, n)
    return {"key": key, "pooled": nearest.said, "pictures": site._pictures(rows.tolist(), _numbers(scores))}


def _nearest(site: Site, key: str) -> NearestRows:
    """The store's pooled vectors of ``key``, read once per viewer (``site.nearest``)."""
    found = site.nearest.get(key)
    if found is None:
        found = site.nearest[key] = NearestRows(site.store, key)
    return found


def similar_key(site: Site) -> str | None:
    """The capture the image pages find nearest rows by: the first that is not a Grad-CAM map, of ok rows."""
    if not (site.store.status == OK).any():
        return None
    return next((k for k, m in site.store.captures.items() if m["what"] != "gradcam"), None)
