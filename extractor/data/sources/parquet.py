"""Parquet files as a data source: the Hugging Face ``datasets`` layout (``data/train-00000-of-00042.parquet``, an
``image`` column of ``{bytes, path}`` structs, a ``label`` column whose class names sit in the schema's
``huggingface`` metadata), and any Parquet file of encoded images beside labels and ids.

Planning reads each file's footer (row groups and their sizes) and its small label and id columns only, on
threads. A row is stored as ``FILE#COLUMN/ROW`` (its row in the file); a worker reads the row group a row lies in
once, and only its image column (:class:`RowGroups`), by ranged reads: never a whole file per shard.
"""

from __future__ import annotations

import bisect
import functools
import glob
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._threads import prefetched
from ...errors import CountError, DataError
from ..files import (
    is_url,
    leaves_root,
    local_fingerprint,
    matched_urls,
    part_fingerprints,
    read_file,
    remote_error,
    remote_fingerprint,
)
from ..rows import STRINGS, Distinct, Joined, Rows, Strings, Texts, duplicate, labels_of_codes, named
from ..spill import Column
from ..streamed import Lister, Streamed
from . import Locator, Sampled, Source, spread

if TYPE_CHECKING:
    from ...spec import DataSpec

__all__ = ["SOURCE", "file_columns", "hub_files", "is_parquet_row", "list_parquet", "parquet_bytes", "row_groups"]

log = logging.getLogger(__name__)

ROW = re.compile(r"^(?P<url>.+\.(?:parquet|arrow))#(?P<column>[^/#]+)/(?P<row>\d+)$", re.IGNORECASE)
KEEP_GROUPS = 4  # row groups a process keeps decoded (its image column), the most recently used


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("data.source: parquet reads with pyarrow, which is not installed: pip install "
                        "'extractor[parquet]' (or pip install pyarrow)") from None
    return pq


def is_parquet_row(item: object) -> bool:
    """A stored path that names a Parquet (or Arrow) file's row: ``FILE.parquet#COLUMN/ROW``."""
    return isinstance(item, str) and "#" in item and ROW.match(item) is not None


def parquet_urls(patterns: str | Sequence[str] | None, storage: dict[str, Any]) -> list[str]:
    """The files ``data.parquet`` names, in order: brace patterns expanded, globs matched (sorted)."""
    urls = matched_urls(patterns, storage, "data.parquet")
    if not urls:
        raise DataError(f"data.parquet {patterns!r} names no Parquet files; check the paths and patterns")
    return urls


@dataclass(frozen=True)
class _Columns:
    image: str
    label: str
    id: str
    named: frozenset[str]  # the ones data.columns named: a file without them is refused


@dataclass
class _File:
    """What planning takes from one Parquet file: its rows, their raw labels and ids, its class names."""

    rows: int
    labels: Any  # an Arrow array, or None: no label column
    ids: Any  # an Arrow array, or None: no id column
    names: list[str] | None  # the label column's ClassLabel names in the Hugging Face metadata
    print: int  # the file's fingerprint (0: unknown)
    by_path: int = 0  # rows whose image is not in the file but a file its path names (a footer's count)


def _open(url: str, storage: dict[str, Any]) -> Any:
    """A file object for pyarrow: a local path as it is; a remote file opened for ranged reads (no read-ahead:
    a row group's column chunk is one request)."""
    if not is_url(url):
        return url.removeprefix("file://")
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **storage)
    return fs.open(path, "rb", cache_type="none")


def _arrow(url: str) -> Any:
    """The record batches of an Arrow file as ``datasets`` writes them (its cache, ``save_to_disk``): the IPC
    stream format, memory-mapped (local files only: the stream has no footer to read a part of it by)."""
    _pyarrow()
    import pyarrow as pa

    if is_url(url):
        raise DataError(f"{url}: Arrow files are read from a local disk (their format has no index for ranged "
                        "reads); convert them to Parquet (Dataset.to_parquet) to read them from object storage")
    return pa.ipc.open_stream(pa.memory_map(url.removeprefix("file://")))


def file_columns(path: str) -> list[str]:
    """The column names of a local Parquet or Arrow file, from its schema alone."""
    pq = _pyarrow()
    return list(_arrow(path).schema.names if _is_arrow(path) else pq.read_schema(path).names)


def _is_arrow(url: str) -> bool:
    return url.lower().endswith(".arrow")


def _scan(url: str, cols: _Columns, storage: dict[str, Any]) -> _File:
    """The footer and the label and id columns of one file (the image column is not read)."""
    pq = _pyarrow()
    import pyarrow as pa

    try:
        handle = _open(url, storage)
        f = _arrow(url).read_all() if _is_arrow(url) else pq.ParquetFile(handle)
        schema = f.schema if _is_arrow(url) else f.schema_arrow
        _check_columns(url, schema.names, cols)
        _check_image_type(url, schema.field(cols.image), cols.image)
        read = [c for c in (cols.label, cols.id) if c in schema.names]
        table = (f.select(read) if _is_arrow(url) else f.read(columns=read)) if read else None
        n_rows = f.num_rows if _is_arrow(url) else f.metadata.num_rows
        by_path = _by_path(f, schema.field(cols.image).type, cols.image, n_rows)
        print_ = _file_fingerprint(url, storage, handle)
    except DataError:
        raise
    except (pa.ArrowException, OSError, ValueError) as err:
        raise _unreadable(url, err) from None

    def column(name: str) -> Any:
        return table.column(name).combine_chunks() if table is not None and name in read else None

    return _File(rows=n_rows, names=_class_names(schema, cols.label), print=print_,
                 labels=column(cols.label), ids=column(cols.id), by_path=by_path)


def _by_path(f: Any, kind: Any, image: str, n_rows: int) -> int:
    """Rows of a file (a ParquetFile, or an Arrow file's table) whose image is a file its path names, not bytes in
    it: every row of a path column; of a struct of bytes and path, the rows without bytes, as the footer's
    statistics count them (an Arrow table: its own count; a footer without statistics: none known)."""
    import pyarrow as pa

    t = pa.types
    if t.is_string(kind) or t.is_large_string(kind) or t.is_string_view(kind):
        return n_rows
    if not t.is_struct(kind):
        return 0
    if kind.get_field_index("bytes") < 0:  # a struct of a path alone
        return n_rows
    if not hasattr(f, "metadata"):  # an Arrow file's table, read whole
        import pyarrow.compute as pc

        return int(pc.struct_field(f.column(image).combine_chunks(), "bytes").null_count)
    md, leaf, found = f.metadata, f"{image}.bytes", 0
    for g in range(md.num_row_groups):
        group = md.row_group(g)
        for c in range(group.num_columns):
            column = group.column(c)
            if column.path_in_schema == leaf and column.statistics is not None and column.statistics.has_null_count:
                found += int(column.statistics.null_count)
    return found


def _check_columns(url: str, names: list[str], cols: _Columns) -> None:
    """Refuse a file without the image column, or without a column data.columns named."""
    if cols.image not in names:
        raise DataError(f"{url} has no image column {cols.image!r} (its columns: "
                        f"{', '.join(names[:12])}); name it with data.columns: {{image: COLUMN}}")
    for what in sorted(cols.named - {cols.image}):
        if what not in names:
            raise DataError(f"data.columns: {what!r} is not a column of {url} (its columns: "
                            f"{', '.join(names[:12])}); fix the name, or remove it from data.columns")


def _holds_images(kind: Any) -> bool:
    """An Arrow type an image column may have: encoded bytes, a path, or a struct of ``bytes`` and ``path``."""
    import pyarrow as pa

    t = pa.types
    if t.is_binary(kind) or t.is_large_binary(kind) or t.is_fixed_size_binary(kind) or t.is_binary_view(kind):
        return True
    if t.is_string(kind) or t.is_large_string(kind) or t.is_string_view(kind):
        return True
    return t.is_struct(kind) and bool({kind.field(i).name for i in range(kind.num_fields)} & {"bytes", "path"})


def _check_image_type(url: str, field: Any, name: str) -> None:
    """Refuse, at planning, an image column that cannot hold images (integers, floats, lists...)."""
    if not _holds_images(field.type):
        raise DataError(f"{url}: image column {name!r} holds {field.type}, not images (bytes, a path, or a struct of "
                        "bytes and path); name the image column with data.columns: {image: COLUMN}")


def _unreadable(url: str, err: BaseException) -> DataError:
    import pyarrow as pa

    if isinstance(err, FileNotFoundError):
        return DataError(f"Parquet file {url} does not exist; check data.parquet")
    if is_url(url) and not isinstance(err, pa.ArrowException):
        return remote_error("Parquet file", url, err)
    return DataError(f"{url} is not a readable Parquet file ({type(err).__name__}: {err})")


def _class_names(schema: Any, label: str) -> list[str] | None:
    """The ClassLabel names of column ``label`` in the schema's Hugging Face metadata, when it has them."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return None
    try:
        feature = json.loads(meta)["info"]["features"][label]
    except (KeyError, TypeError, ValueError):
        return None
    names = feature.get("names") if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" else None
    return [str(n) for n in names] if names else None


def _row_ids(urls: list[str]) -> list[str]:
    """Each file's part of the ids made from file and row: its path under the files' common folder, without
    ``.parquet`` (``data/train-00000-of-00004``)."""
    plain = [u.split("://", 1)[-1] for u in urls]
    common = os.path.commonpath([os.path.dirname(p) for p in plain]) if len(plain) > 1 else os.path.dirname(plain[0])
    return [re.sub(r"\.(parquet|arrow)$", "", os.path.relpath(p, common) if common else p, flags=re.IGNORECASE)
            for p in plain]


def hub_files(name: str, split: str, config: str | None) -> list[str]:
    """The Parquet files of split ``split`` (and configuration ``config``) of the Hugging Face data set ``name``
    in the local Hugging Face cache (fetched only when ``EXTRACTOR_ALLOW_DOWNLOAD=1``)."""
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise DataError("data.dataset reads the Hugging Face cache with huggingface_hub, which is not installed: "
                        "pip install huggingface_hub") from None
    fetch = f"hf download {name} --repo-type dataset"
    try:
        root = snapshot_download(name, repo_type="dataset", allow_patterns=["*.parquet", "**/*.parquet"],
                                 local_files_only=os.environ.get("EXTRACTOR_ALLOW_DOWNLOAD") != "1")
    except Exception as err:  # noqa: BLE001 - not cached (LocalEntryNotFoundError), unknown, unreachable
        raise DataError(f"data.dataset {name!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}): "
                        f"{fetch} fetches it (or set EXTRACTOR_ALLOW_DOWNLOAD=1 to let extractor fetch it) "
                        f"[{type(err).__name__}]") from None
    found = sorted(glob.glob(os.path.join(root, "**", "*.parquet"), recursive=True))

    def chosen(path: str) -> bool:
        *folders, file = os.path.relpath(path, root).split(os.sep)
        in_split = split in folders or file.startswith(f"{split}-") or file == f"{split}.parquet"
        return in_split and (config is None or config in folders)

    files = [p for p in found if chosen(p)]  # the snapshot's links (their blobs have no .parquet name)
    tops = sorted({os.path.relpath(p, root).split(os.sep)[0] for p in files if os.sep in os.path.relpath(p, root)})
    if config is None and len(tops) > 1:
        raise DataError(f"data.dataset {name!r}: split {split!r} has files in {len(tops)} folders ({', '.join(tops)}), "
                        "each a configuration of the data set: name one with data.config")
    if not files:
        there = sorted({os.path.relpath(p, root) for p in found})[:8]
        raise DataError(f"data.dataset {name!r}: no Parquet files of split {split!r}"
                        f"{f' and config {config!r}' if config else ''} in its cached snapshot {root} (there: "
                        f"{', '.join(there) or 'no Parquet files'}); set data.split and data.config, or {fetch}")
    return files


def _row_prints(file_print: int, rows: int) -> np.ndarray:
    """Each row's fingerprint, from its file's and its row number (:func:`~..files.part_fingerprints`; 0: the
    file's is unknown)."""
    return part_fingerprints(file_print, np.arange(rows, dtype=np.int64))


def _row_ids_of(ids: Strings, stem: str, f: _File) -> None:
    """Append a file's row ids to ``ids``: its id column's (as text), or ``STEM/ROW`` where it has none (or a row's is
    empty). A string column's are taken from its buffers, the rest made one by one."""
    import pyarrow as pa
    import pyarrow.compute as pc

    made = pc.binary_join_element_wise(f"{stem}/", pc.cast(pa.array(np.arange(f.rows)), pa.string()), "")
    if f.ids is None:
        ids.extend_arrow(made)
    elif pa.types.is_string(f.ids.type) or pa.types.is_large_string(f.ids.type):
        given = pc.fill_null(f.ids, "")
        ids.extend_arrow(pc.if_else(pc.greater(pc.binary_length(given), 0), given.cast(made.type), made))
    else:
        ids.extend([str(g) if g not in (None, "") else f"{stem}/{r}" for r, g in enumerate(f.ids.to_pylist())])


class _Ids:
    """The rows' ids as the files come: ``STEM/ROW`` held as a Joined of the files' stems and the rows' numbers (no
    string made a row: half a 100M-row listing's CPU) until a file has an id column; from then on every id as
    text, those of the files before it made then."""

    def __init__(self, stems: list[str]) -> None:
        self.stems = stems
        self.texts: Strings | None = None
        self.files: list[_File] = []  # (while no file had an id column: for their row counts)

    def add(self, t: int, f: _File) -> None:
        if self.texts is None and f.ids is not None:
            self.texts = Strings()
            for stem, before in zip(self.stems, self.files, strict=False):
                _row_ids_of(self.texts, stem, before)
            self.files = []
        if self.texts is None:
            self.files.append(_File(rows=f.rows, names=None, print=0, labels=None, ids=None))
        else:
            _row_ids_of(self.texts, self.stems[t], f)



def _columns(columns: dict[str, str]) -> _Columns:
    return _Columns(image=columns.get("image", "image"), label=columns.get("label", "label"),
                    id=columns.get("id", "id"), named=frozenset(columns.values()))


class _Listing:
    """The rows of Parquet files as their files come, one after another (:meth:`add`): each row's file and row there,
    id, label and fingerprint, on the disk past a megabyte each. :meth:`rows`: all of them (their ids checked, their
    labels coded); :meth:`prefix`: those listed so far, the listing going on (a listing streamed: ``coded``, where
    every label is a class index as it is, :func:`stream_parquet`)."""

    def __init__(self, urls: list[str], columns: dict[str, str], coded: bool = False) -> None:
        self.urls, self.columns, self.cols = urls, columns, _columns(columns)
        self.stems = _row_ids(urls)
        self.heads = np.asarray([f"{u}#{self.cols.image}/" for u in urls], dtype=STRINGS)  # a row's path: its
        self.ids = _Ids(self.stems)  # file's head and its row there; its id (made): its file's stem and its row
        self.id_heads = np.asarray([f"{stem}/" for stem in self.stems], dtype=STRINGS)
        self.prints, self.files, self.in_file = Column("Q"), Column("i"), Column("q")  # each row's
        self.labels: Column | Distinct = Column("q") if coded else Distinct()
        self.file_prints: list[int] = []
        self.names: set[tuple[str, ...]] = set()
        self.starts: list[int] = []
        self.by_path = 0
        self.beyond_first = False  # a row of a file past the first (else each row's file is not kept: 0)

    def where(self, n: int) -> str:
        t = bisect.bisect_right(self.starts, n) - 1
        return f"{self.urls[t]} row {n - self.starts[t]}"

    def add(self, t: int, f: _File) -> None:
        """File ``t``'s rows, as its scan found them."""
        self.starts.append(len(self.in_file))
        self.files.extend(np.full(f.rows, t, dtype=np.int32))
        self.in_file.extend(np.arange(f.rows, dtype=np.int64))
        self.beyond_first |= t > 0 and f.rows > 0
        self.file_prints.append(f.print)
        self.by_path += f.by_path
        if f.names:
            self.names.add(tuple(f.names))
        self.ids.add(t, f)
        self.prints.extend(_row_prints(f.print, f.rows))
        if isinstance(self.labels, Column):  # class indices as they are, -1 where none
            self.labels.extend(np.full(f.rows, -1, np.int64) if f.labels is None else self._coded(t, f.labels))
        elif f.labels is not None:
            self.labels.add_arrow(f.labels)
        else:
            self.labels.add([None] * f.rows)

    def _coded(self, t: int, labels: Any) -> np.ndarray:
        import pyarrow as pa

        try:
            return labels.cast(pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False)
        except pa.ArrowException as err:  # (its footer said integers: the file changed since)
            raise DataError(f"{self.urls[t]}: its labels are not class indices ({labels.type}: {err}); it changed "
                            "while it was listed: run again") from None

    def _keys(self, numbers: np.ndarray, which: np.ndarray | None, files: int, whole: bool) -> Texts | Joined:
        """The ids of the rows listed: those of the files' id columns (``whole``: all of them, the builder done), else
        made from the first ``files`` files' names and the rows' numbers."""
        texts = self.ids.texts
        if texts is not None:
            return texts.array() if whole else texts.snapshot()
        return Joined(self.id_heads[:files], numbers, which)

    def prefix(self) -> Rows:
        """The rows listed so far (none copied: maps of the builders' files), the listing going on."""
        assert isinstance(self.labels, Column), "coded labels only: others are coded once all are listed"
        numbers, which = self.in_file.snapshot(), self.files.snapshot() if self.beyond_first else None
        files = len(self.starts)
        return Rows(ids=self._keys(numbers, which, files, whole=False), paths=Joined(self.heads[:files], numbers,
                                                                                     which),
                    labels=self.labels.snapshot(), fingerprints=self.prints.snapshot())

    def rows(self) -> Rows:
        """Every row listed: their labels coded, their ids checked to be unique, the listing's record made."""
        if self.by_path:  # their fingerprint is the Parquet file's: an image file rewritten in place is not seen
            log.warning("%d rows of data.parquet name their image by a path (no bytes in the Parquet file): a resume "
                        "sees the Parquet files change, not those image files; `extractor inspect --verify` reads "
                        "them again", self.by_path)
        if isinstance(self.labels, Column):
            codes, classes = self.labels.array(), list[str]()
        else:
            codes, classes = labels_of_codes(*self.labels.result(), self.where)
        numbers, which = self.in_file.array(), self.files.array()
        of_file = which if self.beyond_first else None  # (one file: none)
        keys = self._keys(numbers, of_file, len(self.urls), whole=True)
        # ids made as STEM/ROW from distinct stems are distinct (the last "/" parts them): no sort of 100M hashes
        twice = duplicate(keys) if self.ids.texts is not None or len(set(self.stems)) < len(self.stems) else None
        if twice is not None:
            raise DataError(f"id {keys[twice[0]]!r} appears twice: {self.where(twice[0])} and "
                            f"{self.where(twice[1])}; ids must be unique (data.columns.id names the id column)")
        rows = Rows(ids=keys, paths=Joined(self.heads, numbers, of_file), labels=codes, classes=classes,
                    fingerprints=self.prints.array() if len(self.prints) else None,
                    listing=_listing(self.urls, self.file_prints, self.columns))
        if len(self.names) > 1:
            raise DataError(_names_differ(len(self.names)))
        if self.names and classes:  # (a ClassLabel column holds indices: these files say one thing and hold another)
            raise DataError(f"data.parquet: the label column {self.cols.label!r} holds names or numbers that are not "
                            f"class indices ({', '.join(map(repr, classes[:5]))}), but the files' Hugging Face "
                            "metadata names its classes; make the labels the classes' indices (0, 1...), or name "
                            "another column with data.columns: {label: COLUMN}")
        if self.names:
            return named(rows, list(next(iter(self.names))), "data.parquet", "their Hugging Face metadata")
        return rows


def _names_differ(lists: int) -> str:
    return (f"the Parquet files of data.parquet name their classes differently ({lists} lists in their Hugging Face "
            "metadata); list them once in data.classes")


def _scans(urls: list[str], scan: Any) -> Any:
    """``scan(url)`` of each file, in order, 16 ahead on 16 threads (a remote file's reads wait on the network)."""
    return prefetched(urls, scan, 16, min(16, len(urls)))


def list_parquet(patterns: str | Sequence[str] | None, columns: dict[str, str], storage: dict[str, Any]) -> Rows:
    """Rows of every row of every Parquet file, in pattern order then row order (``patterns``: a list of files
    as :func:`hub_files` gives them, or patterns)."""
    listing = _Listing(parquet_urls(patterns, storage), columns)
    for t, f in enumerate(_scans(listing.urls, lambda u: _scan(u, listing.cols, storage))):
        listing.add(t, f)
    return listing.rows()


@dataclass(frozen=True)
class _Footer:
    """What a Parquet file's footer tells before its rows are listed."""

    rows: int
    coded: bool  # its labels are class indices as they are (an integer column, or none)
    names: list[str] | None  # its label column's ClassLabel names


def _footer(url: str, cols: _Columns, storage: dict[str, Any]) -> _Footer:
    """A Parquet file's footer: its rows, whether its labels are integers, its class names; its columns checked."""
    pq = _pyarrow()
    import pyarrow as pa

    try:
        schema = (f := pq.ParquetFile(_open(url, storage))).schema_arrow
    except (pa.ArrowException, OSError, ValueError) as err:
        raise _unreadable(url, err) from None
    _check_columns(url, schema.names, cols)
    _check_image_type(url, schema.field(cols.image), cols.image)
    label = schema.field(cols.label).type if cols.label in schema.names else None
    coded = label is None or (pa.types.is_integer(label) and not pa.types.is_uint64(label))
    return _Footer(f.metadata.num_rows, coded, _class_names(schema, cols.label))


def stream_parquet(patterns: str | Sequence[str] | None, columns: dict[str, str], storage: dict[str, Any],
                   classes: Sequence[str] | None, then: Callable[[Rows], Rows]) -> Streamed | None:
    """The rows of :func:`list_parquet`, listed on a thread (:class:`~..streamed.Streamed`) once every file's footer
    is read: their number and class names known from them. None where they cannot be: an Arrow file (no footer),
    labels that are not class indices (their classes are known once every label is read), ClassLabel names that
    data.classes (``classes``) renumbers, no rows. ``then``: what the whole listing is made at its end (data.classes
    given their names)."""
    urls = parquet_urls(patterns, storage)
    cols = _columns(columns)
    if any(_is_arrow(u) for u in urls):
        return None
    footers: list[_Footer] = []
    for f in _scans(urls, lambda u: _footer(u, cols, storage)):
        if not f.coded or (f.names and classes is not None):  # (the footers left are not read)
            return None
        footers.append(f)
    names = {tuple(f.names) for f in footers if f.names}
    n = sum(f.rows for f in footers)
    if not n:
        return None
    if len(names) > 1:
        raise DataError(_names_differ(len(names)))

    listing = _Listing(urls, columns, coded=True)

    def lister() -> Lister:
        listed = 0
        for t, f in enumerate(_scans(urls, lambda u: _scan(u, cols, storage))):
            if (f.rows, f.names) != (footers[t].rows, footers[t].names):  # (what the store was made with)
                raise CountError(f"{urls[t]} changed while it was listed ({footers[t].rows} rows and class names "
                                f"{footers[t].names} in its footer, then {f.rows} and {f.names}); run again")
            listed += f.rows
            yield listed, functools.partial(listing.add, t, f)
        return then(listing.rows())

    return Streamed(n, list(classes) if classes is not None else list(next(iter(names))) if names else [], lister(),
                    listing.prefix, fingerprinted=True)


class RowGroups:
    """The image columns of the row groups this process read last (``KEEP_GROUPS`` of them), each read once
    however many threads ask for its rows at the same moment; ``reads`` counts the row groups read."""

    def __init__(self, keep: int = KEEP_GROUPS) -> None:
        self.keep = keep
        self.lock = threading.Lock()
        self.groups: OrderedDict[tuple[str, str, int], Future[list[Any]]] = OrderedDict()
        # each file's row group starts, and its footer (Parquet) or its record batches (Arrow, memory-mapped)
        self.footers: dict[str, tuple[list[int], Any]] = {}
        self.reads = 0

    def clear(self) -> None:
        """Forget every row group and footer (files may have changed since)."""
        with self.lock:
            self.groups.clear()
            self.footers.clear()

    def value(self, url: str, column: str, row: int, storage: dict[str, Any]) -> Any:
        """Row ``row``'s value of ``column`` in file ``url``."""
        starts, index = self._footer(url, storage)
        group = bisect.bisect_right(starts, row) - 1
        if group < 0 or row >= starts[-1]:
            raise IndexError(f"{url} has {starts[-1]} rows, not row {row}: the file changed since it was listed")
        key = (url, column, group)
        with self.lock:
            future = self.groups.get(key)
            mine = future is None
            if future is None:
                future = self.groups[key] = Future()
                while len(self.groups) > self.keep:
                    self.groups.popitem(last=False)
            else:
                self.groups.move_to_end(key)
        if mine:
            try:
                future.set_result(self._read(url, column, group, index, storage))
            except BaseException as err:  # noqa: BLE001 - given to every thread waiting for this row group
                with self.lock:
                    self.groups.pop(key, None)
                future.set_exception(err)
        return future.result()[row - starts[group]]

    def _footer(self, url: str, storage: dict[str, Any]) -> tuple[list[int], Any]:
        """A file's row group starts and what finds its row groups: a Parquet file's footer, read once; an Arrow
        file's record batches (memory-mapped: nothing read but their headers)."""
        found = self.footers.get(url)
        if found is None:
            if _is_arrow(url):
                index: Any = list(_arrow(url))
                counts = [b.num_rows for b in index]
            else:
                index = _pyarrow().ParquetFile(_open(url, storage)).metadata
                counts = [index.row_group(g).num_rows for g in range(index.num_row_groups)]
            found = self.footers[url] = ([0, *np.cumsum(counts).tolist()], index)
        return found

    def _read(self, url: str, column: str, group: int, index: Any, storage: dict[str, Any]) -> list[Any]:
        try:
            if _is_arrow(url):
                table = index[group].select([column])
            else:
                parquet = _pyarrow().ParquetFile(_open(url, storage), metadata=index)
                table = parquet.read_row_group(group, columns=[column])
        except Exception as err:  # noqa: BLE001 - a file spoilt or cut since it was listed: its rows fail
            raise OSError(f"row group {group} of {url} cannot be read ({type(err).__name__}: {err})") from None
        with self.lock:
            self.reads += 1
        return table.column(column).to_pylist()


row_groups = RowGroups()  # one per process: a worker's decode threads share it


def parquet_bytes(item: str, storage: dict[str, Any] | None = None, outside_root: bool = True) -> bytes:
    """The encoded image of a stored Parquet row ``FILE#COLUMN/ROW``: its bytes, or the file its path names
    (a relative path: in the Parquet file's folder). ``outside_root`` false: a path that leaves that folder is
    refused, as a manifest's row is (:func:`~extractor.data.files.leaves_root`)."""
    m = ROW.match(item)
    assert m is not None
    url, column, row = m["url"], m["column"], int(m["row"])
    value = row_groups.value(url, column, row, dict(storage or {}))
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    else:
        data, path = (value, None) if isinstance(value, bytes | bytearray) else (None, value)
    if data:
        return bytes(data)
    if not path:
        raise ValueError(f"row {row} of {url} holds no image in column {column!r} (no bytes and no path)")
    base = url.rsplit("/", 1)[0]
    if not outside_root and leaves_root(path):
        raise DataError(f"image path leaves the Parquet file's folder (refused, as a manifest's; data.outside_root: "
                        f"true allows it): {path!r}")
    return read_file(path if not _relative(path) else f"{base.rstrip('/')}/{path}", storage)


def _relative(path: str) -> bool:
    return not is_url(path) and not os.path.isabs(path)


def _file_fingerprint(url: str, storage: dict[str, Any], handle: Any = None) -> int:
    """A Parquet or Arrow file's fingerprint (its size and mtime or ETag; 0: unknown)."""
    if not is_url(url):
        return local_fingerprint(url)
    try:
        if handle is not None:
            return remote_fingerprint(handle.fs.info(handle.path))
        import fsspec

        fs, path = fsspec.core.url_to_fs(url, **storage)
        return remote_fingerprint(fs.info(path))
    except Exception:  # noqa: BLE001 - unknown, not an error: the file is listed again
        return 0


def _counted(urls: list[str], picked: list[str]) -> tuple[int, int] | None:
    """The rows of the files ``picked`` and of all ``urls``, from their footers, where every file is a local Parquet
    file (a footer read: about 0.6 ms); None elsewhere (a remote file's footer is a request: the rows are scaled)."""
    if any(is_url(u) or _is_arrow(u) for u in urls):
        return None
    pq = _pyarrow()
    try:
        with ThreadPoolExecutor(min(16, len(urls))) as pool:
            counts = dict(zip(urls, pool.map(lambda u: pq.ParquetFile(u).metadata.num_rows, urls), strict=True))
    except Exception:  # noqa: BLE001 - a file the listing of the part, or the run, reports
        return None
    return sum(counts[u] for u in picked), sum(counts.values())


def _listing(urls: list[str], prints: list[int], columns: dict[str, str]) -> dict[str, Any] | None:
    """What a listing of the files was made from (a resume takes the rows from the store while it is the same);
    None when a file's fingerprint is unknown."""
    if 0 in prints:
        return None
    return {"source": "parquet", "files": urls, "fingerprints": prints, "columns": dict(sorted(columns.items()))}


class ParquetSource(Source):
    """Parquet or Arrow files (``data.parquet``, or ``data.dataset``'s in the local Hugging Face cache): a row
    stored as ``FILE#COLUMN/ROW``, its image read from the row group it lies in."""

    name = "parquet"

    @staticmethod
    def _files(data: DataSpec) -> str | Sequence[str] | None:
        return data.parquet if data.dataset is None else hub_files(data.dataset, data.split, data.config)

    def list(self, data: DataSpec) -> Rows:
        return list_parquet(self._files(data), {str(k): v for k, v in data.columns.items()}, data.storage_options)

    def stream(self, data: DataSpec, then: Callable[[Rows], Rows]) -> Streamed | None:
        return stream_parquet(self._files(data), {str(k): v for k, v in data.columns.items()}, data.storage_options,
                              data.classes, then)

    def empty(self, data: DataSpec) -> str:
        return "its files hold no rows"

    def reads(self, item: Locator) -> bool:
        return is_parquet_row(item)

    def read(self, item: Locator, storage_options: dict | None, outside_root: bool) -> bytes:
        assert isinstance(item, str)
        return parquet_bytes(item, storage_options, outside_root)

    def forget(self) -> None:
        row_groups.clear()

    def sample(self, data: DataSpec, parts: int, over: int) -> Sampled | None:
        urls = parquet_urls(self._files(data), data.storage_options)
        if len(urls) <= over:
            return None
        picked = spread(urls, parts)
        return Sampled(data.model_copy(update={"parquet": picked, "dataset": None}), len(picked), len(urls),
                       "Parquet files", _counted(urls, picked))

    def listing(self, data: DataSpec, was: dict[str, Any] | None = None) -> dict[str, Any] | None:
        storage = data.storage_options
        urls = parquet_urls(self._files(data), storage)
        with ThreadPoolExecutor(min(16, len(urls))) as pool:
            prints = list(pool.map(lambda u: _file_fingerprint(u, storage), urls))
        return _listing(urls, prints, {str(k): v for k, v in data.columns.items()})


SOURCE = ParquetSource()
