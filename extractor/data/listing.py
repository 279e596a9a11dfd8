"""Listing a data spec's images as rows: a folder (local or remote), a manifest, or tar shards
(:mod:`extractor.tarsource`); nothing is decoded here."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..errors import DataError
from ..spec import DataSpec
from .files import (
    absolute,
    display_name,
    is_relative,
    is_url,
    leaves_root,
    local_fingerprint,
    remote_error,
    remote_fingerprint,
    storable_path,
)
from .rows import Joined, Joining, Rows, Strings, distinct, duplicate, labels_of, strings
from .tars import list_tars

__all__ = ["list_rows", "PLACE"]

PLACE = {"folder": "root", "manifest": "manifest", "tar": "tars", "parquet": "parquet"}  # where a source's images are

log = logging.getLogger(__name__)


def list_rows(data: DataSpec) -> Rows:
    """List the images of a data spec, or raise :class:`DataError` before any work starts."""
    storage = data.storage_options
    if data.source == "folder":
        assert data.root is not None  # the spec validator guarantees it
        rows = _list_remote_folder(data.root, data.extensions, storage) if is_url(data.root) else \
            _list_folder(Path(data.root), data.extensions)
        where = data.root
    elif data.source == "manifest":
        assert data.manifest is not None
        rows = _list_manifest(data.manifest, data.root, storage, data.outside_root,
                              {str(k): v for k, v in data.columns.items()})
        where = data.manifest
    elif data.source == "parquet":
        from .parquet import hub_files, list_parquet

        files = data.parquet if data.dataset is None else hub_files(data.dataset, data.split, data.config)
        rows = list_parquet(files, {str(k): v for k, v in data.columns.items()}, storage)
        where = str(data.dataset or data.parquet)
    else:
        rows = list_tars(data.tars, data.extensions, storage)
        where = str(data.tars)
    if not len(rows):
        looked = "its files hold no rows" if data.source == "parquet" else \
            f"looked for files ending in {', '.join(data.extensions)}"
        raise DataError(f"no images found in {where} ({looked}); check data.{PLACE[data.source]}")
    return rows if data.classes is None else named(rows, list(data.classes), where)


def named(rows: Rows, classes: list[str], where: str) -> Rows:
    """``rows`` with the class names ``data.classes``: integer labels checked to be among them, labels that were
    names (or folders) given their index in them."""
    labels = rows.labels
    if rows.classes:  # names: their index in the given list
        index = {c: i for i, c in enumerate(classes)}
        unknown = sorted(set(rows.classes) - set(index))
        if unknown:
            raise DataError(f"{where}: labels {', '.join(map(repr, unknown[:10]))} are not in data.classes "
                            f"({len(classes)} names); add them, or remove data.classes to take the labels' own names")
        to = np.asarray([index[c] for c in rows.classes], dtype=np.int64)
        labels = np.where(labels >= 0, to[np.maximum(labels, 0)], -1)
    else:
        beyond = np.flatnonzero(labels >= len(classes))
        if len(beyond):
            first = int(beyond[0])
            raise DataError(f"{where}: row {rows.ids[first]!r} has label {labels[first]}, but data.classes names "
                            f"{len(classes)} classes (labels 0 to {len(classes) - 1})")
    return replace(rows, labels=labels, classes=classes)


def _list_remote_folder(root: str, extensions: Sequence[str], storage: dict) -> Rows:
    import fsspec

    exts = tuple(e.lower() for e in extensions)
    try:
        fs, base = fsspec.core.url_to_fs(root, **storage)
        infos = fs.find(base, detail=True)  # sizes and ETags come with the listing: the rows' fingerprints
        found = sorted(p for p in infos if p.lower().endswith(exts))
    except Exception as err:  # noqa: BLE001 - every backend raises its own errors
        raise remote_error("data.root", root, err) from err
    base = base.rstrip("/")
    kept = [p for p in found if not any(part.startswith(".") for part in p[len(base) + 1:].split("/"))]  # hidden
    ids = strings(p[len(base) + 1:] for p in kept)
    labels, classes = _folder_labels(ids)
    return Rows(ids=ids, paths=Joined(strings([f"{root.rstrip('/')}/"]), ids), labels=labels, classes=classes,
                fingerprints=np.fromiter((remote_fingerprint(infos[p]) for p in kept), np.uint64, len(kept)))


def _folder_labels(rel: Iterable[str]) -> tuple[np.ndarray, list[str]]:
    """ImageFolder labels: an image's class is its top-level folder. Images directly in the
    root have no class (-1); when others do, a warning names them."""
    codes, tops, firsts = distinct(r.split("/", 1)[0] if "/" in r else "" for r in rel)
    if tops == [""] or not tops:
        return np.full(len(codes), -1, dtype=np.int64), []
    if "" in tops:
        loose = tops.index("")
        log.warning("%d images lie directly in data.root (first: %s), outside the class folders; they get "
                    "no label (-1). Move them into a class folder, or list them in a manifest",
                    int((codes == loose).sum()), rel[firsts[loose]])  # type: ignore[index]
    classes = sorted(str(t) for t in tops if t)
    index = {c: i for i, c in enumerate(classes)}
    return np.asarray([index.get(str(t), -1) for t in tops], dtype=np.int64)[codes], classes


def _list_folder(root: Path, extensions: Sequence[str]) -> Rows:
    if not root.exists():
        raise DataError(f"data.root {root} does not exist; set data.root to a folder of images")
    if not root.is_dir():
        raise DataError(f"data.root {root} is not a folder; for a file list use data.source: manifest")
    exts = tuple(e.lower() for e in extensions)
    top = absolute(str(root))
    ids = Strings()
    paths = Joining([os.path.join(top, "")], ids)  # a relative path is its id: held once
    prints = array("Q")
    seen_dirs: set[str] = set()

    def onerror(err: OSError) -> None:
        log.warning("cannot list %s: %s", err.filename, err.strerror)

    def walk() -> None:
        for dirpath, dirnames, filenames in os.walk(root, onerror=onerror, followlinks=True):
            real = os.path.realpath(dirpath)
            if real in seen_dirs:  # a symlink loop, or a second link to a folder already walked
                log.warning("skipping %s: it leads back to %s, already listed", dirpath, real)
                dirnames[:] = []
                continue
            seen_dirs.add(real)
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .ipynb_checkpoints, .git: not classes
            base = Path(dirpath).relative_to(root)
            for name in sorted(filenames):
                if name.lower().endswith(exts) and not name.startswith("."):
                    rel = (base / name).as_posix()
                    full = os.path.join(top, rel)
                    ids.append(display_name(rel))
                    paths.whole(storable_path(full))  # undecodable names: hex, whole
                    prints.append(local_fingerprint(full))

    walk()
    listed = ids.array()
    labels, classes = _folder_labels(listed)
    return Rows(ids=listed, paths=paths.joined(listed), labels=labels, classes=classes,
                fingerprints=np.frombuffer(prints, dtype=np.uint64) if prints else None)


def _list_manifest(manifest: str, root: str | None, storage: dict, outside_root: bool = False,
                   columns: dict[str, str] | None = None) -> Rows:
    base = root if root is not None else (manifest.rsplit("/", 1)[0] if "/" in manifest else ".")
    names = _Columns(manifest, columns or {})
    head = base.rstrip("/") + "/"
    ids = Strings()
    paths = Joining([head if is_url(head) else os.path.join(absolute(head), "")], ids)  # as absolute() makes them
    prints = array("Q")

    def labels() -> Iterator[Any]:
        for n, rec in enumerate(_manifest_records(manifest, storage)):
            p = names.image_of(rec, n)
            if not outside_root and leaves_root(p):
                raise DataError(f"{manifest} row {n + 1}: path {p!r} lies outside data.root ({base}); a manifest "
                                "names images under its root, by relative paths that stay inside it. If its paths are "
                                "absolute, URLs or lead elsewhere by design, set data.outside_root: true")
            full = absolute(f"{head}{p}" if is_relative(p) else p)
            ids.append(str(rec[names.id]) if rec.get(names.id) not in (None, "") else p)
            paths.whole(full)
            # local files: fingerprinted now; URLs: unknown (one request each), checked by inspect --verify
            prints.append(0 if is_url(full) else local_fingerprint(full))
            yield rec.get(names.label)

    codes, classes = labels_of(labels(), lambda n: f"{manifest} row {n + 1}")
    names.check_seen()
    listed = ids.array()
    twice = duplicate(listed)
    if twice is not None:
        raise DataError(f"{manifest}: id {listed[twice[0]]!r} appears in rows {twice[0] + 1} and {twice[1] + 1}; "
                        "ids must be unique")
    return Rows(ids=listed, paths=paths.joined(listed), labels=codes, classes=classes,
                fingerprints=np.frombuffer(prints, dtype=np.uint64) if prints else None)


class _Columns:
    """A manifest's column names (``data.columns`` over the defaults path, id, label), and which of the label
    and id columns the user named were seen in a row."""

    def __init__(self, manifest: str, columns: dict[str, str]) -> None:
        named = {"image": "path", "id": "id", "label": "label", **columns}
        self.manifest, self.image, self.id, self.label = manifest, named["image"], named["id"], named["label"]
        self.mapped = {v: k for k, v in columns.items() if k != "image"}  # label and id columns named by the user
        self.seen: set[str] = set()

    def image_of(self, rec: Any, n: int) -> str:
        """The image path of record ``rec`` (row ``n``); a row without one is refused naming the columns."""
        if not isinstance(rec, dict) or not rec.get(self.image):
            there = f" ({', '.join(map(repr, list(rec)[:8]))} there)" if isinstance(rec, dict) else ""
            raise DataError(f"{self.manifest} row {n + 1}: missing {self.image!r}{there}; the columns are "
                            f"{self.image}, optional {self.id} and {self.label} (data.columns maps other names: "
                            "{image: file_name})")
        if self.mapped:
            self.seen.update(k for k in self.mapped if k in rec)
        return str(rec[self.image])

    def check_seen(self) -> None:
        """Refuse a label or id column named in data.columns that no row has."""
        for what in sorted(set(self.mapped) - self.seen):
            raise DataError(f"data.columns.{self.mapped[what]}: {what!r} is not a column of {self.manifest}; fix "
                            "the name, or remove it from data.columns")


def _manifest_records(manifest: str, storage: dict) -> Iterator[Any]:
    """The rows of a CSV or JSONL manifest (local or a URL), parsed one at a time from the file (the whole text
    and a list of every row's record held at once were 300 bytes a row at the peak of planning)."""
    suffix = Path(manifest.split("?", 1)[0]).suffix.lower()
    if suffix not in (".csv", ".jsonl", ".ndjson"):
        raise DataError(f"data.manifest {manifest}: expected a .csv or .jsonl file")
    try:
        with _manifest_lines(manifest, storage) as lines:
            yield from csv.DictReader(lines) if suffix == ".csv" else _json_lines(manifest, lines)
    except UnicodeDecodeError as err:
        raise DataError(f"data.manifest {manifest} is not UTF-8 text: {err}") from None


def _manifest_lines(manifest: str, storage: dict) -> TextIO:
    """The manifest as text lines (a spreadsheet's byte-order mark is not a column name): a local file read as
    it is parsed, a remote one read whole."""
    if not is_url(manifest):
        if not Path(manifest).exists():
            raise DataError(f"data.manifest {manifest} does not exist")
        return open(manifest, encoding="utf-8-sig", newline="")  # noqa: SIM115 - the caller closes it
    import fsspec

    try:
        with fsspec.open(manifest, "rb", **storage) as f:
            return io.StringIO(f.read().decode("utf-8-sig"), newline="")
    except UnicodeDecodeError:
        raise
    except Exception as err:  # noqa: BLE001
        raise remote_error("data.manifest", manifest, err) from err


def _json_lines(manifest: str, lines: Iterable[str]) -> Iterator[Any]:
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{manifest}:{lineno}: not valid JSON: {err.msg}") from None
