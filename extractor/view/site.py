"""What each page of the viewer shows, as plain data (JSON-able dicts): the same for the local app and the exported
site. Reads the store lazily: a page reads the rows and features it shows, never a whole capture."""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from ..errors import StoreError
from ..index import FeatureIndex, coverage, index_names, open_index
from ..read import ActivationStore, NearestRows
from ..store import OK, STATUS_NAMES, get_array
from . import svg
from .atlas import map_page, nearest_rows, neighbour_lists, similar_key, similar_rows
from .common import NotFound, page_path
from .common import number as _number
from .common import numbers as _numbers
from .common import strongest as _strongest
from .common import strongest_each as _strongest_each
from .thumbs import Thumbnails

__all__ = ["NotFound", "Site", "page_path"]

PATCH_FEATURES = 10  # features listed for a clicked patch
TOP_FEATURES = 12  # an image's top features, per index
SEARCH_HITS = 50
CAM_CELLS = 56  # a Grad-CAM map is shown at most this many cells a side (block means)
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")  # an index name that is its URL name too


class Site:
    """The pages of one store: its indexes found once, thumbnails made on demand and cached."""

    def __init__(self, store: ActivationStore, thumbs: Thumbnails | None = None) -> None:
        self.store = store
        self.thumbs = thumbs or Thumbnails(store)
        self.indexes: dict[str, FeatureIndex] = {}  # URL name -> index
        for n, name in enumerate(index_names(store)):
            self.indexes[name if _SAFE.match(name) else f"index-{n}"] = open_index(store, name)
        self.cams = [k for k, m in store.captures.items() if m["what"] == "gradcam"]
        self._stale: dict[str, bool] = {}  # per index, found on first use (it reads the store's status)
        self.nearest: dict[str, NearestRows] = {}  # per capture, its rows pooled: read on the first image page
        self.live = False  # "run this image" is offered (the local app, where the model can be built)

    # ------------------------------------------------------------------ lookups (404 for anything not held)
    def index(self, slug: str) -> FeatureIndex:
        if slug not in self.indexes:
            raise NotFound(f"this store holds no index {slug!r}; its indexes: {', '.join(self.indexes) or 'none'}")
        return self.indexes[slug]

    def feature(self, slug: str, f: int) -> FeatureIndex:
        index = self.index(slug)
        if not 0 <= f < index.features:
            raise NotFound(f"index {slug!r} has features 0 to {index.features - 1}, not {f}")
        return index

    def row(self, row: int) -> int:
        if not 0 <= row < len(self.store):
            raise NotFound(f"this store has rows 0 to {len(self.store) - 1}, not {row}")
        return row

    # ------------------------------------------------------------------ pieces
    def _label(self, row: int) -> str:
        lab = int(self.store.labels[row])
        classes = self.store.classes
        return classes[lab] if 0 <= lab < len(classes) else ("no label" if lab < 0 else f"class {lab}")

    def _picture(self, row: int, value: float | None = None) -> dict[str, Any]:
        """A thumbnail's record: the row, its id and label, where its picture is, or why it has none."""
        return {"row": row, "id": str(self.store.ids[row]), "label": self._label(row), "value": value,
                "gone": self.thumbs.problem(row), "thumb": page_path("thumb", row), "page": page_path("image", row)}

    def _pictures(self, rows: Sequence[int], values: Sequence[float | None]) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(4, thread_name_prefix="extractor-thumbs") as pool:  # decoding releases the GIL
            return list(pool.map(self._picture, rows, values))

    def _is_stale(self, slug: str) -> bool:
        if slug not in self._stale:
            self._stale[slug] = bool(self.indexes[slug].stale)
        return self._stale[slug]

    def _status(self, row: int) -> int:
        """Row ``row``'s status (0 pending, 1 ok, 2 failed), read alone (not the store's whole column)."""
        return int(np.asarray(get_array(self.store.group, "status")[row]))

    def _index_record(self, slug: str, index: FeatureIndex) -> dict[str, Any]:
        dictionary = index.attrs.get("dictionary")
        return {"slug": slug, "name": index.name, "key": index.key, "features": index.features, "k": index.k,
                "pool": index.attrs.get("pool"), "rows": index.attrs.get("rows"), "stale": self._is_stale(slug),
                "dead": len(index.dead), "grid": index.grid, "prefix": _prefix(index), "covers": coverage(index),
                "dictionary": None if not dictionary else {"path": dictionary.get("path"),
                                                           "activation": dictionary.get("activation"),
                                                           "d_sae": dictionary.get("d_sae")},
                "created": index.attrs.get("created"), "page": page_path("features", slug),
                "map": page_path("map", slug) if index.atlas is not None else None}

    # ------------------------------------------------------------------ pages
    def store_page(self) -> dict[str, Any]:
        s = self.store
        status = s.status
        counts = {name: int((status == v).sum()) for v, name in STATUS_NAMES.items()}
        data = s.spec.get("data", {})
        stats = s.stats
        captures = []
        for key, meta in s.captures.items():
            st = stats.get(key) or {}
            captures.append({"key": key, "layer": meta["layer"], "what": meta["what"], "reduce": meta["reduce"],
                             "dtype": meta["dtype"], "shape": list(meta["shape"]),
                             "dims": [d.rsplit(".", 1)[-1] for d in meta["dims"]],
                             "stats": _capture_stats(st) if st else None})
        failed = np.flatnonzero(status == 2)[:10]
        return {
            "title": f"store {s.url}",
            "store": s.url, "status": s.attrs.get("status"), "created": s.attrs.get("created"),
            "updated": s.attrs.get("updated"), "rows": len(s), "row_status": counts,
            "model": {"name": s.model.get("name"), "source": s.model.get("source"), "class": s.model.get("class"),
                      "weights": s.model.get("weights"), "parameters": s.model.get("parameters")},
            "data": {"source": data.get("source"), "root": data.get("root"), "classes": s.classes},
            "captures": captures,
            "failed": [{"row": int(r), "id": str(s.ids[r]), "error": str(s.errors[r]),
                        "page": page_path("image", int(r))} for r in failed],
            "indexes": [self._index_record(slug, ix) for slug, ix in self.indexes.items()],
            "cams": self.cams,
            "run": page_path("run") if self.live else None,
        }

    def features_page(self, slug: str) -> dict[str, Any]:
        index = self.index(slug)
        density = index.density
        alive = density[density > 0]
        log_density = np.log10(alive) if len(alive) else np.zeros(0)
        lo = float(np.floor(log_density.min())) if len(alive) else -6.0
        counts, edges = np.histogram(log_density, bins=40, range=(lo, 0.0))
        return {
            "title": f"{index.name}: features",
            "index": self._index_record(slug, index),
            "table": {"density": _numbers(density), "density_rows": _numbers(index.density_rows),
                      "mean_active": _numbers(index.mean_active), "max_value": _numbers(index.max_value)},
            "density_svg": svg.histogram(counts, edges, "log10 firing density (share of tokens)",
                                         f"{len(alive)} features that fire; {len(density) - len(alive)} never do"),
            "dead": [int(f) for f in index.dead],
            "text": self.live,  # search by text: the local app only
        }

    def feature_page(self, slug: str, f: int) -> dict[str, Any]:
        index = self.feature(slug, f)
        best = index.top(f)
        top = self._pictures([int(r) for r in best.rows], _numbers(best.values))
        if index.grid is not None and len(best.rows):
            tokens = index.tokens(f)[: len(best.rows), _patches(index)]
            scale = max(float(np.nanmax(tokens)), 0.0) if tokens.size else 0.0
            for n, pic in enumerate(top):
                pic["heat"] = {"grid": list(index.grid), "values": _numbers(tokens[n]), "scale": _number(scale)}
        counts, edges = index.histogram(f)
        groups = []
        for q, group in enumerate(index.quantiles(f)):
            if len(group.rows):
                groups.append({"group": q, "low": _number(np.nanmin(group.values)),
                               "high": _number(np.nanmax(group.values)),
                               "pictures": self._pictures([int(r) for r in group.rows], _numbers(group.values))})
        return {
            "title": f"{index.name}: feature {f}",
            "index": self._index_record(slug, index), "feature": f,
            "previous": page_path("feature", slug, f - 1) if f > 0 else None,
            "next": page_path("feature", slug, f + 1) if f + 1 < index.features else None,
            "density": _number(index.density[f]), "density_rows": _number(index.density_rows[f]),
            "mean_active": _number(index.mean_active[f]), "max_value": _number(index.max_value[f]),
            "dead": bool(np.isin(f, index.dead)),
            "top": top,
            "histogram_svg": svg.histogram(counts, edges, "log10 activation", f"{int(counts.sum())} activations"),
            "quantiles": groups[::-1],  # the highest group first
            "neighbours": neighbour_lists(index, slug, f),
        }

    def patch_features(self, slug: str, row: int, token: int, n: int = PATCH_FEATURES) -> dict[str, Any]:
        """The features firing most at patch ``token`` (of the grid: prefix tokens not counted) of ``row``."""
        index = self.index(slug)
        self.row(row)
        if index.grid is None or not 0 <= token < index.grid[0] * index.grid[1]:
            raise NotFound(f"index {slug!r} has no patch {token}")
        if self.store.status[row] != OK:
            raise NotFound(f"row {row} is {STATUS_NAMES[int(self.store.status[row])]}: it holds no activations")
        values = index.encode_row(row)[_prefix(index) + token]
        return {"row": row, "patch": token, "features": _strongest(values, n, slug)}

    def image_page(self, row: int, patches: bool = False) -> dict[str, Any]:
        """The page of ``row``; with ``patches`` every patch's strongest features too (the exported site cannot
        compute them on demand)."""
        s = self.store
        self.row(row)
        status = self._status(row)
        ok = status == OK
        pic = self._picture(row)
        indexes = [self._image_features(slug, row if ok else None, patches) for slug in self.indexes]
        return {
            "title": f"image {s.ids[row]}",
            "picture": pic,
            "path": str(s.paths[row]), "status": STATUS_NAMES[status],
            "error": str(np.asarray(get_array(s.group, "errors")[row])) if status != OK else "",
            "label": self._label(row), "label_index": int(s.labels[row]),
            "previous": page_path("image", row - 1) if row > 0 else None,
            "next": page_path("image", row + 1) if row + 1 < len(s) else None,
            "indexes": indexes,
            "explorer": ok and any(ix.grid is not None for ix in self.indexes.values()) and not pic["gone"],
            "cams": [self._cam(key, row) for key in self.cams] if ok else [],
            "similar": self._similar(row) if ok else None,
            "run": page_path("run") if self.live else None,
        }

    def _similar(self, row: int) -> dict[str, Any] | None:
        """The images nearest ``row`` by the pooled vector of the store's first capture (None: it has none; or why
        not, when it cannot be searched)."""
        key = similar_key(self.store)
        if key is None:
            return None
        try:
            return similar_rows(nearest_rows(self.nearest, self.store, key), self._pictures, row=row)
        except StoreError as err:
            return {"key": key, "missing": str(err), "pictures": []}

    def map_page(self, slug: str) -> dict[str, Any]:
        index = self.index(slug)
        return map_page(index, self._index_record(slug, index))

    def _image_features(self, slug: str, row: int | None, patches: bool) -> dict[str, Any]:
        """An index's section of an image page: the row's top features (and where each fires), with ``patches``
        every patch's strongest; only the index's name for a row that is not ok (None)."""
        index = self.indexes[slug]
        rec: dict[str, Any] = {"slug": slug, "name": index.name, "key": index.key, "grid": index.grid}
        if row is None:
            return rec
        values = index.encode_row(row)  # (T, F)
        rec["top"] = _strongest(np.nanmax(values, axis=0), TOP_FEATURES, slug)
        if index.grid is not None:
            grid = values[_patches(index)]  # (h * w, F)
            for top in rec["top"]:  # where on the image each of its top features fires
                top["values"] = _numbers(np.maximum(grid[:, top["feature"]], 0))
            if patches:  # per patch [[feature, value], ...]: compact, the page makes the links
                rec["patches"] = [[list(t) for t in each] for each in _strongest_each(grid, PATCH_FEATURES)]
        return rec

    def _cam(self, key: str, row: int) -> dict[str, Any]:
        cam = np.asarray(self.store[key][row], dtype=np.float32)
        cam = _block_means(cam, CAM_CELLS)
        target = int(np.asarray(self.store["target"][row])) if "target" in self.store else -1
        score = float(np.asarray(self.store["target_score"][row])) if "target_score" in self.store else None
        classes = self.store.classes if self.store.captures[key].get("target") == "label" else []
        name = classes[target] if 0 <= target < len(classes) else f"class {target}"
        return {"key": key, "target": name, "score": _number(score) if score is not None else None,
                "heat": {"grid": list(cam.shape), "values": _numbers(np.maximum(cam, 0)),
                         "scale": _number(max(float(np.nanmax(cam)), 0.0))}}

    def search(self, query: str) -> dict[str, Any]:
        """Rows whose image id or file name holds ``query`` (a whole id first; case-insensitive)."""
        q = query.strip()
        hits: list[int] = []
        if q:
            ids, low = self.store.ids, q.lower()
            exact = np.flatnonzero(ids == q)
            found = np.flatnonzero((np.strings.find(np.strings.lower(ids), low) >= 0)
                                   | (np.strings.find(np.strings.lower(self._names), low) >= 0))
            hits = list(dict.fromkeys([*exact.tolist(), *found.tolist()]))
            if q.isascii() and q.isdigit() and int(q) < len(self.store):  # a row number ('²' is a digit too)
                hits = list(dict.fromkeys([int(q), *hits]))  # a row number
        return {"title": f"search {q}" if q else "search", "query": q, "count": len(hits),
                "hits": [{"row": r, "id": str(self.store.ids[r]), "label": self._label(r),
                          "page": page_path("image", r)} for r in hits[:SEARCH_HITS]]}

    @cached_property
    def _names(self) -> np.ndarray:
        """Each row's file name (a tar member's or Parquet row's: the part after the last '/')."""
        return np.array([_file_name(str(p)) for p in self.store.paths], dtype=np.dtypes.StringDType())

    def search_list(self, rows: Sequence[int]) -> list[list[Any]]:
        """``[row, id, file name]`` of ``rows``: what the exported site's search page looks in."""
        return [[int(r), str(self.store.ids[r]), str(self._names[r])] for r in rows]


def _prefix(index: FeatureIndex) -> int:
    """Leading positions of the index's capture not on its patch grid (a ViT's CLS and registers)."""
    return int(index.attrs.get("prefix") or 0)


def _patches(index: FeatureIndex) -> slice:
    """The positions of the index's capture on its patch grid (those after it, YOLOS's detection tokens, left out)."""
    assert index.grid is not None  # asked only of an index with a grid
    first = _prefix(index)
    return slice(first, first + index.grid[0] * index.grid[1])


def _file_name(path: str) -> str:
    return PurePosixPath(path.rsplit("#", 1)[-1] if "#" in path else path).name


def _block_means(x: np.ndarray, cells: int) -> np.ndarray:
    """A 2-D map cut to at most ``cells`` a side by means over blocks (its edges beyond whole blocks left out)."""
    x = np.squeeze(x)
    if x.ndim != 2:
        x = x.reshape(x.shape[-2], x.shape[-1]) if x.ndim > 2 and np.prod(x.shape[:-2]) == 1 else x.reshape(1, -1)
    step = max(1, -(-max(x.shape) // cells))
    h, w = x.shape[0] // step, x.shape[1] // step
    return x[: h * step, : w * step].reshape(h, step, w, step).mean(axis=(1, 3))


def _capture_stats(st: dict[str, Any]) -> dict[str, Any]:
    """A capture's statistics in a line: rows, the mean of its features' means and stds, its range, NaN/Inf."""
    def mean(name: str) -> float | None:
        v = np.asarray(st.get(name, []), dtype=np.float64)
        return _number(np.nanmean(v)) if v.size and np.isfinite(v).any() else None

    def extreme(name: str, fn: Any) -> float | None:
        v = np.asarray(st.get(name, []), dtype=np.float64)
        return _number(fn(v)) if v.size and np.isfinite(v).any() else None

    return {"rows": st.get("rows"), "mean": mean("mean"), "std": mean("std"), "min": extreme("min", np.nanmin),
            "max": extreme("max", np.nanmax), "nan": int(np.sum(st.get("nan", 0))),
            "inf": int(np.sum(st.get("inf", 0))), "mean_l2": _number(st["mean_l2"]) if "mean_l2" in st else None}
