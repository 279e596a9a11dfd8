""""Run this image" and search by text in the viewer's local app (issue 59; never in an export): the store's model,
built once on first use (:mod:`extractor.live`: checked to be the store's own, or refused saying why), runs one image
the user gives, kept in memory only (the last few, by a random id) and never written anywhere; its features beside
the stored rows where each is highest, the stored images nearest it, the model's top classes, and those classes
with one feature switched off. A phrase finds features through the model's text tower.

The one request that is not a GET takes the image's bytes (at most ``MAX_IMAGE_BYTES``) with the header
``X-Extractor-Run`` (a page elsewhere cannot send it without the browser asking first, which this app never allows)
and answers an id; all that is shown of it is then read by GET, like every other page.
"""

from __future__ import annotations

import base64
import io
import secrets
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from .atlas import nearest_rows, similar_key, similar_rows
from .common import NotFound, page_path
from .common import numbers as _numbers
from .common import strongest as _strongest

if TYPE_CHECKING:
    from ..live import Live, Ran, TextSearch
    from .site import Site

__all__ = ["CLASSES", "FEATURES", "HEADER", "KEPT", "Runs"]

HEADER = "X-Extractor-Run"  # a request that sends an image carries it: a cross-site form cannot
KEPT = 4  # images run kept in memory (their pixels and captures), the latest
CLASSES = 5  # top classes shown
STORED = 4  # stored rows shown beside each of the image's top features
FEATURES = 8  # top features shown per index


class Runs:
    """The viewer's live side: the model (built on first use), the images run (the last :data:`KEPT`), the text
    search (built on first use). Each failure to build is said on every use, not retried."""

    def __init__(self, site: Site, device: str = "auto") -> None:
        self.site, self.device = site, device
        self._live: Live | str | None = None  # the model, or why it cannot be had
        self._text: TextSearch | str | None = None
        self._runs: OrderedDict[str, Ran] = OrderedDict()
        self._lock = threading.Lock()

    def live(self) -> Live:
        from ..live import Live, LiveError

        with self._lock:
            if self._live is None:
                try:
                    self._live = Live(self.site.store, self.device)
                except LiveError as err:
                    self._live = str(err)
        if isinstance(self._live, str):
            raise LiveError(self._live)
        return self._live

    def close(self) -> None:
        if self._live is not None and not isinstance(self._live, str):
            self._live.close()

    # ------------------------------------------------------------------ an image
    def add(self, data: bytes) -> str:
        """Run image ``data``; its id (the oldest run forgotten beyond :data:`KEPT`)."""
        ran = self.live().run(data)
        key = secrets.token_hex(8)
        with self._lock:
            self._runs[key] = ran
            while len(self._runs) > KEPT:
                self._runs.popitem(last=False)
        return key

    def ran(self, key: str) -> Ran:
        with self._lock:
            found = self._runs.get(key)
        if found is None:
            raise NotFound(f"no image run {key!r} is kept (the last {KEPT} are): run it again")
        return found

    def page(self, key: str) -> dict[str, Any]:
        """What run ``key`` shows: the image as the model took it, each index's top features of it (where each fires
        on it, and the stored rows where it is highest), the stored images nearest it, the model's top classes."""
        ran = self.ran(key)
        site = self.site
        out: dict[str, Any] = {"id": key, "picture": _png(ran.pixels), "indexes": [],
                               "classes": self._classes(ran.output)}
        for slug, ix in site.indexes.items():
            values = ix.encode(ran.values[ix.key])[0]  # (T, F)
            rec: dict[str, Any] = {"slug": slug, "name": ix.name, "key": ix.key, "grid": ix.grid,
                                   "top": _strongest(np.nanmax(values, axis=0), FEATURES, slug)}
            for top in rec["top"]:
                best = ix.top(top["feature"])
                top["stored"] = site._pictures([int(r) for r in best.rows[:STORED]], _numbers(best.values[:STORED]))
                if ix.grid is not None:
                    top["values"] = _numbers(np.maximum(values[int(ix.attrs.get("prefix") or 0):, top["feature"]], 0))
            out["indexes"].append(rec)
        out["nearest"] = self._nearest(ran)
        return out

    def _nearest(self, ran: Ran) -> dict[str, Any] | None:
        """The stored images nearest the image run, by the capture the image pages use."""
        key = similar_key(self.site.store)
        if key is None:
            return None
        near = nearest_rows(self.site.nearest, self.site.store, key)
        return similar_rows(near, self.site._pictures, vector=near.pool(ran.values[key])[0])

    def switched_off(self, key: str, slug: str, f: int) -> dict[str, Any]:
        """Run ``key``'s top classes with feature ``f`` of index ``slug`` switched off, beside those without."""
        ran = self.ran(key)
        ix = self.site.feature(slug, f)
        after = self.live().switched_off(ran, ix, f)
        return {"id": key, "slug": slug, "feature": f, "page": page_path("feature", slug, f),
                "before": self._classes(ran.output), "after": self._classes(after, ran.output)}

    def _classes(self, scores: np.ndarray | None, before: np.ndarray | None = None) -> list[dict[str, Any]] | None:
        """The top classes of output ``scores`` (softmax), each with its probability before (``before``'s)."""
        if scores is None:
            return None
        p = _softmax(scores)
        was = _softmax(before) if before is not None else None
        names = self._names()
        top = np.lexsort((np.arange(len(p)), -p))[:CLASSES]
        return [{"class": int(c), "name": names.get(int(c), f"class {int(c)}"), "p": float(p[c]),
                 "before": float(was[c]) if was is not None else None} for c in top]

    def _names(self) -> dict[int, str]:
        """The model's class names where it carries them (a Hugging Face config's id2label)."""
        config = getattr(self.live().worker.model, "config", None)
        labels = getattr(config, "id2label", None) or {}
        return {int(k): str(v) for k, v in dict(labels).items()}

    # ------------------------------------------------------------------ a phrase
    def text(self, slug: str, query: str, n: int = 20) -> dict[str, Any]:
        """The features of index ``slug`` whose score for ``query`` is highest."""
        from ..live import LiveError, TextSearch

        ix = self.site.index(slug)
        q = query.strip()
        if not q:
            return {"query": q, "features": []}
        with self._lock:
            if self._text is None:
                try:
                    self._text = TextSearch(self.site.store)
                except LiveError as err:
                    self._text = str(err)
        if isinstance(self._text, str):
            raise LiveError(self._text)
        found = self._text.features(ix, q, n)
        return {"query": q, "how": found.how, "joint": self._text.joint,
                "features": [{"feature": int(f), "score": s, "page": page_path("feature", slug, int(f))}
                             for f, s in zip(found.features.tolist(), _numbers(found.scores), strict=True)]}


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.asarray(x, np.float64)
    z = np.exp(z - z.max())
    return z / z.sum()


def _png(pixels: Any) -> str | None:
    """The image as the model took it (uint8 levels), as a PNG data URL; None for a processor's float pixels."""
    if str(getattr(pixels, "dtype", "")) != "torch.uint8":
        return None
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy()).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
