"""The viewer as a static site: the app's pages, their JSON and the thumbnails written to a folder, with relative
links, so that it opens from disk (``file://``), from any web server or in a notebook. Nothing is computed on
demand there: an image page holds the strongest features of each of its patches, the search page its rows."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

from ..errors import ExtractorError
from ..read import ActivationStore, open_store
from .render import STATIC, render
from .site import Site, page_path
from .thumbs import SourceGone

__all__ = ["export_site"]

log = logging.getLogger(__name__)

MARK = ".extractor-view"  # marks a folder as an export: only such a folder (or an empty one) is written over
IMAGES = 1000  # image pages besides the rows the feature pages show: the first rows of the store


def export_site(store: ActivationStore | str, out: str | Path, features: int | None = None, images: int = IMAGES,
                progress: Callable[[str], None] | None = None, api: bool = False) -> dict[str, int]:
    """Write the viewer's pages of ``store`` to the folder ``out``: the store page, each index's features page and
    its first ``features`` feature pages (None: all), the image page of every row those show and of the first
    ``images`` rows, their thumbnails, the search page; with ``api`` each page's data as JSON too (``api/...json``,
    as the app serves it: for scripts; the pages hold their own). Returns what it wrote: pages, thumbnails, gone
    sources, and the bytes of each kind (``page_bytes``, ``api_bytes``, ``thumb_bytes``)."""
    site = Site(open_store(store) if isinstance(store, str) else store)
    writer = _Writer(_folder(Path(out)), site, api)
    for name in STATIC:
        writer.file(f"static/{name}", (files("extractor.view") / "static" / name).read_bytes())
    store_page = site.store_page()
    writer.page("store.html", page_path("store"), store_page, "api/store.json")
    rows: set[int] = set(range(min(images, len(site.store))))
    rows.update(int(r["row"]) for r in store_page["failed"])
    for slug in site.indexes:
        rows |= _index_pages(writer, slug, features)
        if progress:
            progress(f"index {site.indexes[slug].name}: its pages written")
    _image_pages(writer, sorted(rows), progress)
    search = site.search("")
    search["rows"] = site.search_list(sorted(rows))
    writer.page("search.html", page_path("search"), search, None)
    writer.file(MARK, b"an extractor view export: extractor view STORE --export writes over this folder\n")
    return {"pages": writer.pages, "thumbnails": writer.thumbs, "gone": writer.gone, **writer.bytes}


def _index_pages(writer: _Writer, slug: str, features: int | None) -> set[int]:
    """Write an index's features page and its first ``features`` feature pages (None: all); the rows they show."""
    site, rows = writer.site, set[int]()
    writer.page("features.html", page_path("features", slug), site.features_page(slug), f"api/index/{slug}.json")
    count = site.indexes[slug].features
    last = count if features is None else min(features, count)
    atlas = site.map_page(slug)
    if atlas["map"]:
        atlas["map"]["written"] = last  # the points of features whose page is written link to it
    writer.page("map.html", page_path("map", slug), atlas, f"api/index/{slug}/map.json")
    for f in range(last):
        data = site.feature_page(slug, f)
        if f + 1 == last:
            data["next"] = None  # no page beyond the last written
        for measure in data["neighbours"]:  # links only to pages written
            for near in measure["features"]:
                near["page"] = near["page"] if near["feature"] < last else None
        rows.update(p["row"] for p in data["top"])
        rows.update(p["row"] for g in data["quantiles"] for p in g["pictures"])
        writer.page("feature.html", page_path("feature", slug, f), data, f"api/index/{slug}/{f}.json")
    return rows


def _image_pages(writer: _Writer, rows: list[int], progress: Callable[[str], None] | None) -> None:
    """Write the image pages of ``rows`` (ascending; each with every patch's strongest features) and thumbnails."""
    kept = set(rows)
    for n, row in enumerate(rows):
        data = writer.site.image_page(row, patches=True)
        data["previous"] = data["previous"] if row - 1 in kept else None  # links only to pages written
        data["next"] = data["next"] if row + 1 in kept else None
        for pic in (data["similar"] or {}).get("pictures", []):
            pic["page"] = pic["page"] if pic["row"] in kept else None
            writer.thumb(pic["row"])
        writer.page("image.html", page_path("image", row), data, f"api/image/{row}.json")
        writer.thumb(row)
        if progress and (n + 1) % 200 == 0:
            progress(f"{n + 1} of {len(rows)} image pages")


def _folder(root: Path) -> Path:
    """``root``, made; refused when it holds files and is not an export already (nothing else is written over)."""
    if root.exists() and not root.is_dir():
        raise ExtractorError(f"cannot export to {root}: it is a file, not a folder")
    if root.is_dir() and any(root.iterdir()) and not (root / MARK).exists():
        raise ExtractorError(f"cannot export to {root}: the folder holds files and is no export of the viewer; "
                             "give an empty or new folder")
    root.mkdir(parents=True, exist_ok=True)
    return root


class _Writer:
    """Writes the pages, their JSON and the thumbnails under one folder, counting them."""

    def __init__(self, root: Path, site: Site, api: bool) -> None:
        self.root, self.site, self.api = root, site, api
        self.pages = self.thumbs = self.gone = 0
        self.bytes = {"page_bytes": 0, "api_bytes": 0, "thumb_bytes": 0}  # written, by kind
        self.written: set[int] = set()  # rows whose thumbnail is written (or gone)

    def file(self, path: str, data: bytes, kind: str | None = None) -> None:
        target = self.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        if kind is not None:
            self.bytes[kind] += len(data)

    def page(self, template: str, path: str, data: dict[str, Any], api: str | None) -> None:
        self.file(path, render(template, path, data, "export").encode(), "page_bytes")
        if api is not None and self.api:
            self.file(api, json.dumps(data, separators=(",", ":")).encode(), "api_bytes")
        self.pages += 1

    def thumb(self, row: int) -> None:
        if row in self.written:
            return
        self.written.add(row)
        try:
            self.file(page_path("thumb", row), self.site.thumbs.get(row), "thumb_bytes")
            self.thumbs += 1
        except SourceGone:
            self.gone += 1


