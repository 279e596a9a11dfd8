"""The manifest source (``data.manifest``): a CSV or JSON-lines file of rows (path or URL, id, label)."""

from __future__ import annotations

import csv
import io
import json
import os
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from ...errors import DataError
from ..files import (
    absolute,
    is_relative,
    is_url,
    leaves_root,
    local_fingerprint,
    remote_error,
)
from ..rows import Joining, Rows, Strings, duplicate, labels_of
from . import Recorded, Source, files_now

if TYPE_CHECKING:
    from ...spec import DataSpec


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
        return open(manifest, encoding="utf-8-sig", newline="")
    import fsspec

    try:
        with fsspec.open(manifest, "rb", **storage) as f:
            return io.StringIO(f.read().decode("utf-8-sig"), newline="")
    except UnicodeDecodeError:
        raise
    except Exception as err:
        raise remote_error("data.manifest", manifest, err) from err


def _json_lines(manifest: str, lines: Iterable[str]) -> Iterator[Any]:
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{manifest}:{lineno}: not valid JSON: {err.msg}") from None



class ManifestSource(Source):
    """A manifest (``data.manifest``): a CSV or JSON-lines file of rows, each a path or URL, an id, a label."""

    name = "manifest"

    def list(self, data: DataSpec) -> Rows:
        assert data.manifest is not None  # the spec validator guarantees it
        listing = self.listing(data)  # before the read: a manifest written meanwhile is read again next time
        rows = _list_manifest(data.manifest, data.root, data.storage_options, data.outside_root,
                              {str(k): v for k, v in data.columns.items()})
        return replace(rows, listing=listing)

    def listing(self, data: DataSpec, was: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """A local manifest's size, mtime and content digest, and the settings that change its rows."""
        assert data.manifest is not None
        if is_url(data.manifest) or not os.path.isfile(data.manifest):
            return None
        import xxhash

        h = xxhash.xxh3_64()
        with open(data.manifest, "rb") as f:
            st = os.fstat(f.fileno())
            while block := f.read(1 << 22):
                h.update(block)
        root = None if data.root is None else data.root if is_url(data.root) else absolute(data.root)
        return {"source": self.name, "manifest": absolute(data.manifest), "size": st.st_size,
                "mtime": st.st_mtime_ns, "digest": h.hexdigest(), "root": root, "outside_root": data.outside_root,
                "columns": dict(sorted((str(k), v) for k, v in data.columns.items()))}

    def refresh(self, data: DataSpec, recorded: Recorded) -> np.ndarray | None:
        return files_now(recorded)


SOURCE = ManifestSource()
