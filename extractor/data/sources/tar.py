"""WebDataset-style tar shards: brace patterns, planning rows from tar headers.

A sample is the group of members sharing a key (the member path up to the first dot of its
file name); its image is the member with an image extension, its label the content of a
``.cls`` member (an integer or a class name) or the ``label`` field of a ``.json`` member.
Planning reads only headers (and the small label members), in parallel over tars, so rows
are known and deterministic before any image is decoded; each row records its image's
byte offset and size so workers read just those bytes.

A row's stored path is ``TAR_URL#MEMBER``. Both parts may contain ``#`` (a folder
``run#1``, a member ``a#1.jpg``), so the tar URL is the part before the first ``#`` at
which an existing file ends (:func:`tar_url_of`); listing refuses a tar whose path would
make that ambiguous. Local tar paths are stored absolute.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import io
import json
import logging
import mmap
import os
import tarfile
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._threads import prefetched
from ...errors import CountError, DataError
from ..files import (
    display_name,
    is_url,
    local_fingerprint,
    matched_urls,
    part_fingerprints,
    plain_utf8,
    remote_error,
    remote_fingerprint,
)
from ..rows import (
    ClassCodes,
    Distinct,
    Joined,
    LocatorArray,
    Rows,
    Strings,
    Texts,
    duplicate,
    labels_of,
    labels_of_codes,
    strings,
)
from ..spill import Column
from ..streamed import Lister, Streamed
from . import Locator, Recorded, Sampled, Source, spread
from ._tar_fast import fast_samples
from ._tar_headers import _headers, _members, _read_at, _Unusual
from ._tar_processes import listing_processes, scanned

if TYPE_CHECKING:
    from ...spec import DataSpec

__all__ = ["SOURCE", "Samples", "list_tars", "scan_tar", "stream_tars", "tar_listing", "tar_url_of"]

log = logging.getLogger(__name__)

OFFSET, SIZE = "byte_offset", "byte_size"  # the store's arrays of a row's byte range in its tar (the locators)

def _key_and_ext(name: str) -> tuple[str, str]:
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    return (name, "") if dot < 0 else (name[:dot], name[dot:].lower())


@dataclass
class Samples:
    """A tar's samples with an image, in the order of their first member, as columns: key, image member, its
    data offset and size, raw label (None: none)."""

    keys: list[str] | Texts = field(default_factory=list)  # (a Texts from the bulk reader: ASCII, no str made)
    members: list[str] = field(default_factory=list)
    offsets: list[int] | np.ndarray = field(default_factory=list)  # (arrays from the bulk reader)
    sizes: list[int] | np.ndarray = field(default_factory=list)
    # each sample's raw label (None: none); or, where ``label_codes`` is given (the bulk reader's), the distinct
    # ones and each sample's code into them
    labels: list[Any] = field(default_factory=list)
    label_codes: np.ndarray | None = None
    # what follows each key in its member's name, where the reader found it in bulk: the distinct ones (.jpg) and
    # each sample's code into them (None: taken from the names)
    end_names: list[str] = field(default_factory=list)
    end_codes: np.ndarray | None = None
    left_out: int = 0  # samples (keys) with no image member of data.extensions: not rows
    left_out_key: str | None = None  # the first of them

    def __len__(self) -> int:
        return len(self.keys)

    def each_label(self) -> list[Any]:
        """Each sample's raw label."""
        return self.labels if self.label_codes is None else [self.labels[c] for c in self.label_codes.tolist()]

    def add_labels(self, to: Distinct) -> None:
        """Each sample's raw label added to ``to`` (in bulk where the reader found them so)."""
        if self.label_codes is None:
            to.add(self.labels)
        else:
            to.add_coded(self.labels, self.label_codes)


def scan_tar(url: str, extensions: Sequence[str], storage_options: dict[str, Any]) -> Samples:
    """The samples of one tar that have an image (key, member, offset, size, raw label)."""
    fobj, fd = _open_tar(url, storage_options)
    exts = tuple(e.lower() for e in extensions)
    try:
        # a local tar of plain headers read in bulk; else the plain header reader, else tarfile
        fast = None if fd is None else fast_samples(fobj, fd, exts, url, _read_label, _NO_LABEL)
        samples, keys = _samples(_listed(fobj, url), fobj, exts, url) if fast is None else (Samples(**fast[0]),
                                                                                            fast[1])
    except tarfile.TarError as err:
        raise DataError(f"tar shard {url} is not a readable tar file ({type(err).__name__}: {err})") from None
    except DataError:
        raise
    except Exception as err:
        raise remote_error("tar shard", url, err) from err
    finally:
        fobj.close()
        if fd is not None:
            os.close(fd)
    if not samples:
        names = ", ".join(keys[:5]) or "no members"
        raise DataError(f"tar shard {url} holds no image members (keys: {names}); check data.extensions")
    # a name's bytes that are not UTF-8 shown as \xNN (the store holds UTF-8; the member is read by its byte range);
    # the bulk reader's names are ASCII
    if not isinstance(samples.keys, Texts) and not plain_utf8("".join(samples.keys)):
        samples.keys = [display_name(k) for k in samples.keys]
        samples.members = [display_name(m) for m in samples.members]
    return samples


def _listed(fobj: Any, url: str) -> list[tuple[str, int, int]]:
    """``(name, data offset, size)`` of each regular file, by the plain header reader, else by tarfile."""
    try:
        return list(_headers(fobj, url))
    except _Unusual:  # a sparse or vendor member: tarfile reads what the plain header reader does not
        fobj.seek(0)
        with tarfile.open(fileobj=fobj, mode="r:") as tar:
            return [(m.name, m.offset_data, m.size) for m in _members(tar, url) if m.isfile()]


def _samples(members: Sequence[tuple[str, int, int]], fobj: Any, exts: tuple[str, ...],
             url: str) -> tuple[Samples, list[str]]:
    """The tar's samples with an image, in the order of their first member (the labels read from the small
    ``.cls`` and ``.json`` members), and every key seen. Columns, not a dict a sample: planning a million
    samples spent a fifth of its time making and reading them."""
    found: dict[str, list[Any]] = {}  # key -> [member, offset, size, label]
    for name, offset, size in members:
        key, ext = _key_and_ext(name)
        rec = found.get(key)
        if rec is None:
            rec = found[key] = [None, 0, 0, _NO_LABEL]
        if ext.endswith(exts):
            if rec[0] is not None:
                raise DataError(f"tar shard {url}: sample {key!r} has two images, {rec[0]} and {name}: a key names one "
                                "sample and its one image; give each image its own key, or set data.extensions to "
                                "the one to read")
            rec[0], rec[1], rec[2] = name, offset, size
        elif ext in (".cls", ".json") and size < 1 << 20:
            rec[3] = _read_label(_read_at(fobj, offset, size), ext, rec[3])
    out, keys, offsets, sizes = Samples(), [], [], []
    for key, (member, offset, size, label) in found.items():
        if member is None:
            out.left_out += 1
            out.left_out_key = out.left_out_key or key
        else:
            keys.append(key)
            out.members.append(member)
            offsets.append(offset)
            sizes.append(size)
            out.labels.append(None if label is _NO_LABEL else label)
    out.keys, out.offsets, out.sizes = keys, offsets, sizes
    return out, list(found)


_NO_LABEL = object()  # no .cls or .json label read yet (None: a .json label that is null)


def _open_tar(url: str, storage_options: dict[str, Any]) -> tuple[Any, int | None]:
    """The tar's file object, local (mapped) or remote, and a local one's open file (headers far apart are read
    from it by ``pread``; else None); a missing or unreadable one is a DataError."""
    try:
        if is_url(url):
            import fsspec

            return fsspec.open(url, "rb", **storage_options).open(), None
        with open(url.removeprefix("file://"), "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return io.BytesIO(b""), None  # (an empty file cannot be mapped)
            fd = os.dup(f.fileno())
            try:
                return mmap.mmap(fd, 0, access=mmap.ACCESS_READ), fd  # (near headers read with no system call each)
            except BaseException:
                os.close(fd)
                raise
    except FileNotFoundError:
        raise DataError(f"tar shard {url} does not exist") from None
    except Exception as err:
        raise remote_error("tar shard", url, err) from err


def _read_label(raw: bytes, ext: str, label: Any) -> Any:
    """A sample's label from its ``.cls`` member (the text), or its ``.json`` member's ``label``
    field when no label was found before (``label``: the one found before, or _NO_LABEL). A ``.json`` whose bytes
    hold neither ``"label"`` nor an escape (``\\u``: a key written otherwise) is not parsed: img2dataset's metadata,
    one a sample, parsed took half of a tar's listing (9.7 us a sample)."""
    if ext != ".cls" and (label is not _NO_LABEL or (b'"label"' not in raw and b"\\u" not in raw)):
        return label
    text = raw.decode("utf-8", "replace").strip()
    if ext == ".cls":
        return text
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        meta = {}
    if isinstance(meta, dict) and "label" in meta and label is _NO_LABEL:
        return meta["label"]
    return label


_IS_FILE: dict[tuple[str, str], bool] = {}  # (URL, storage options) -> is a file: remote answers, per process


def _is_file(url: str, storage_options: dict[str, Any]) -> bool:
    if not is_url(url):
        return os.path.isfile(url.removeprefix("file://"))
    key = (url, repr(sorted(storage_options.items())))
    if key not in _IS_FILE:
        import fsspec

        fs, p = fsspec.core.url_to_fs(url, **storage_options)
        try:
            _IS_FILE[key] = bool(fs.isfile(p))
        except FileNotFoundError:  # a missing bucket; other errors (credentials, network) are the row's error
            _IS_FILE[key] = False
    return _IS_FILE[key]


def tar_url_of(path: str, storage_options: dict[str, Any] | None = None) -> str:
    """The tar URL of a stored row path ``TAR_URL#MEMBER``.

    With one ``#`` that is where the URL ends. With several (``#`` in a folder name or a
    member name), it is the first ``#`` before which an existing file ends: listing refused
    tars with a file at an earlier ``#`` (:func:`check_unambiguous`), so this is the tar.
    Raises FileNotFoundError, naming the whole path, when no prefix is a file.
    """
    if path.count("#") <= 1:
        return path.split("#", 1)[0]
    for i, c in enumerate(path):
        if c == "#" and _is_file(path[:i], storage_options or {}):
            return path[:i]
    raise FileNotFoundError(f"no tar shard found for {path} (no part of it before a '#' is a file)")


def check_unambiguous(url: str, storage_options: dict[str, Any]) -> None:
    """Refuse a tar whose path has a file at one of its own ``#``: its rows could not be read back."""
    for i, c in enumerate(url):
        if c == "#" and _is_file(url[:i], storage_options):
            raise DataError(
                f"tar shard {url}: {url[:i]} is a file too, so rows stored as TAR#MEMBER would read it "
                "instead; rename the folder or the file so that no part of the tar's path before a '#' is a file"
            )


def member_fingerprints(tar_print: int, offsets: Sequence[int] | np.ndarray,
                        sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Each member's fingerprint, from its tar's, its offset and its size (:func:`~..files.part_fingerprints`: a
    tar's million members at once; 0: the tar's is unknown)."""
    return part_fingerprints(tar_print, np.asarray(offsets, np.int64), np.asarray(sizes, np.int64))


def tar_urls(patterns: str | Sequence[str] | None, storage: dict[str, Any] | None = None) -> list[str]:
    """The tars that ``data.tars`` names, in order: brace patterns expanded, globs matched (sorted)."""
    urls = matched_urls(patterns, dict(storage or {}), "data.tars")
    if not urls:
        raise DataError(f"data.tars {patterns!r} names no tar shards; check the paths and patterns (brace ranges "
                        "such as shard-{000000..000099}.tar, or globs such as shards/*.tar)")
    return urls


def tar_listing(patterns: str | Sequence[str] | None, extensions: Sequence[str],
                storage: dict[str, Any]) -> dict[str, Any]:
    """What a listing of the tars is made from: the tars, their fingerprints (size and mtime or ETag; 0 unknown),
    the extensions; a listing recorded with a store is good as long as this is the same."""
    urls = tar_urls(patterns, storage)
    with ThreadPoolExecutor(min(16, len(urls))) as pool:
        prints = list(pool.map(lambda u: _tar_fingerprint(u, storage), urls))
    return {"tars": urls, "fingerprints": prints, "extensions": list(extensions)}


def list_tars(patterns: str | Sequence[str] | None, extensions: Sequence[str], storage: dict[str, Any]) -> Rows:
    """Rows of every sample of every tar, in pattern order then member order."""
    listing = tar_listing(patterns, extensions, storage)  # recorded with the store: a resume may reuse the rows
    urls, tar_prints = listing["tars"], listing["fingerprints"]
    _unambiguous(urls, storage)
    columns = _Columns(urls)
    # each tar's records taken as it comes, then let go (all of them held at once: 700 bytes a row)
    labels, left_out = Distinct(), _LeftOut()
    with contextlib.closing(_scans(urls, extensions, storage)) as each:  # (its workers ended, whatever stops it)
        for t, (found, tar_print) in enumerate(zip(each, tar_prints, strict=True)):
            columns.add(t, found, tar_print)
            found.add_labels(labels)
            left_out.add(found, urls[t])
    left_out.warn(extensions)
    codes, classes = labels_of_codes(*labels.result(),
                                     lambda n: f"tar shard {columns.tar_of(n)}, sample {columns.ids[n]!r}")
    return columns.rows(codes, classes, listing)


def _unambiguous(urls: list[str], storage: dict[str, Any]) -> None:
    for url in urls:
        if "#" in url:
            check_unambiguous(url, storage)


def _scans(urls: Sequence[str], extensions: Sequence[str], storage: dict[str, Any]) -> Generator[Samples, None, None]:
    """Each tar's samples, in order: many tars on worker processes, one a core (parsing holds the GIL); else remote
    tars on 16 threads (their reads wait on the network), local ones on one (threads contending for the GIL took
    twice the time of one)."""
    processes = listing_processes(len(urls))
    threads = min(16, len(urls)) if any(is_url(u) for u in urls) else 1
    return scanned(urls, extensions, storage, processes) if processes else \
        prefetched(urls, lambda u: scan_tar(u, extensions, storage), threads + 1, threads)


class _LeftOut:
    """The samples of the tars listed that have no member of data.extensions: not rows, counted and warned of."""

    def __init__(self) -> None:
        self.n, self.first = 0, ""

    def add(self, found: Samples, url: str) -> None:
        if found.left_out and not self.n:
            self.first = f"{found.left_out_key!r} in {url}"
        self.n += found.left_out

    def warn(self, extensions: Sequence[str]) -> None:
        if self.n:  # (a member of another extension than data.extensions names: not an image to the job)
            log.warning("%d samples of data.tars have no member whose extension is one of data.extensions (%s), and "
                        "are left out (the first: %s); add their image's extension to data.extensions to read them",
                        self.n, ", ".join(extensions), self.first)


STATS = "_stats.json"  # img2dataset's record beside each tar it writes (NAME.tar: NAME_stats.json)


def _stats_count(url: str, storage: dict[str, Any]) -> int | None:
    """The samples with an image of a tar as the stats file img2dataset writes beside it counts them
    (``successes``); None: no such file, or not such a record."""
    if not url.endswith(".tar"):
        return None
    stats = url[:-len(".tar")] + STATS
    try:
        if is_url(stats):
            import fsspec

            with fsspec.open(stats, "rb", **storage) as f:
                raw = f.read(1 << 20)
        else:
            with open(stats.removeprefix("file://"), "rb") as f:
                raw = f.read(1 << 20)
        n = json.loads(raw).get("successes")
    except Exception:  # noqa: BLE001 - none there, or not img2dataset's: the tars are listed whole
        return None
    return n if type(n) is int and n >= 0 else None


def stream_tars(patterns: str | Sequence[str] | None, extensions: Sequence[str], storage: dict[str, Any],
                classes: Sequence[str] | None, then: Callable[[Rows], Rows]) -> Streamed | None:
    """The rows of :func:`list_tars`, listed on a thread (:class:`~..streamed.Streamed`) once they are counted: where
    every tar has img2dataset's stats file beside it (``NAME_stats.json``: its samples with an image), and its
    first tar, listed now, holds as many as its file says and labels that can be coded as they are read
    (:class:`~..rows.ClassCodes`: none, class indices, or names of data.classes, ``classes``). None otherwise. A tar
    listed later that holds another number of samples than its file says stops the listing, naming it. ``then``:
    made of the whole listing."""
    if not ClassCodes.usable(classes):
        return None
    urls = tar_urls(patterns, storage)
    with ThreadPoolExecutor(min(16, len(urls))) as pool:
        counts = list(pool.map(lambda u: _stats_count(u, storage), urls))
    if None in counts or not sum(c or 0 for c in counts):
        if any(c is not None for c in counts):
            log.info("data.tars listed whole first: %s has no img2dataset stats file (NAME%s) that counts its "
                     "samples", urls[counts.index(None)], STATS)
        return None
    _unambiguous(urls, storage)
    listing = tar_listing(patterns, extensions, storage)  # (before the tars are read, as list_tars makes it)
    if listing["tars"] != urls:  # (a tar came or went since: its count was not read)
        return None
    columns = _Columns(urls, coded=True, classes=None if classes is None else list(classes))
    first = scan_tar(urls[0], extensions, storage)  # (what it refuses, refused before a store is made)
    try:
        labels = columns.coded(first)
    except DataError as err:  # (labels that are names, data.classes not given)
        log.info("data.tars listed whole first: %s", err)
        return None
    if len(first) != counts[0]:
        log.info("data.tars listed whole first: %s holds %d samples with an image of data.extensions, its %s counts "
                 "%d", urls[0], len(first), STATS, counts[0])
        return None
    left_out = _LeftOut()

    def lister() -> Lister:
        listed, found, coded = 0, first, labels
        with contextlib.closing(_scans(urls[1:], extensions, storage)) as rest:
            for t, tar_print in enumerate(listing["fingerprints"]):
                if t:
                    found = next(rest)
                    coded = columns.coded(found)
                if len(found) != counts[t]:
                    raise CountError(f"tar shard {urls[t]} holds {len(found)} samples with an image of "
                                     f"data.extensions ({', '.join(extensions)}), but its {STATS} counts "
                                     f"{counts[t]}; fix or remove the stats files (the tars are then listed whole "
                                     "first), or data.extensions")
                left_out.add(found, urls[t])
                listed += len(found)
                yield listed, functools.partial(columns.add, t, found, tar_print, coded)
        left_out.warn(extensions)
        return then(columns.rows(columns.labels.array(), [], listing))

    streamed = Streamed(sum(c or 0 for c in counts), list(classes or []), lister(), columns.prefix,
                        fingerprinted=True)
    streamed.locator_names = (OFFSET, SIZE)
    return streamed


class _Columns:
    """The tars' rows as they are scanned, in compact columns: each sample's id; its image member's name held as
    the id and the member's extension (a code into the few there are); its tar (a code into the URLs), data
    offset, size and fingerprint; each tar's first row; where ``coded`` (a listing streamed), its label as a class
    index (:meth:`coded`). 10M rows: about 70 bytes a row."""

    def __init__(self, urls: list[str], coded: bool = False, classes: list[str] | None = None) -> None:
        self.urls = urls
        self.ids = Strings()
        self.ends: dict[str, int] = {}  # the members' extensions (what follows the id), each one's code
        self.end, self.which = Column("q"), Column("q")  # (on the disk past a megabyte, as every column here)
        self.offsets, self.sizes, self.prints = Column("q"), Column("q"), Column("Q")
        self.starts: list[int] = []  # each tar's first row
        self.codes = ClassCodes(classes, self.where) if coded else None
        self.labels = Column("q")  # (coded only)
        self.coding: Samples | None = None  # the tar whose labels are being coded, not added yet

    def add(self, t: int, found: Samples, tar_print: int, labels: np.ndarray | None = None) -> None:
        self.starts.append(len(self.offsets))
        if isinstance(found.keys, Texts):
            self.ids.extend_utf8(found.keys.data.data, found.keys.ends)
        else:
            self.ids.extend(found.keys)
        ends = self.ends
        if found.end_codes is not None:  # a few distinct ends, each sample's code: made the job's codes at once
            codes = np.asarray([ends.setdefault(e, len(ends)) for e in found.end_names], np.int64)
            self.end.extend(codes[found.end_codes])
        else:
            self.end.extend([ends.setdefault(m[len(k):], len(ends)) for k, m in zip(found.keys, found.members,
                                                                                    strict=True)])
        self.which.extend(np.full(len(found), t, dtype=np.int64))
        self.offsets.extend(found.offsets)
        self.sizes.extend(found.sizes)
        self.prints.extend(member_fingerprints(tar_print, found.offsets, found.sizes))
        if labels is not None:
            self.labels.extend(labels)

    def coded(self, found: Samples) -> np.ndarray:
        """The class index of each of the next tar's samples (:class:`~..rows.ClassCodes`), before it is added."""
        assert self.codes is not None
        labels = Distinct()
        found.add_labels(labels)
        codes, values, firsts = labels.result()
        self.coding = found
        start = len(self.offsets)
        return self.codes.table(values, [start + f for f in firsts])[codes] if len(values) else \
            np.full(len(found), -1, dtype=np.int64)

    def where(self, n: int) -> str:
        """Row ``n``, named by its tar and sample (its tar being coded, not added yet, where past those added)."""
        if n >= len(self.offsets) and self.coding is not None:
            return f"tar shard {self.urls[len(self.starts)]}, sample {self.coding.keys[n - len(self.offsets)]!r}"
        return f"tar shard {self.tar_of(n)}, sample {self.ids[n]!r}"

    def tar_of(self, n: int) -> str:
        return self.urls[bisect.bisect_right(self.starts, n) - 1]

    def prefix(self) -> Rows:
        """The rows added so far (none copied: maps of the builders' files), the listing going on."""
        keys = self.ids.snapshot()
        return Rows(ids=keys, paths=self._paths(keys, self.which.snapshot(), self.end.snapshot()),
                    labels=self.labels.snapshot(), fingerprints=self.prints.snapshot(),
                    locators={OFFSET: self.offsets.snapshot(), SIZE: self.sizes.snapshot()})

    def _paths(self, keys: Texts, which: np.ndarray, end: np.ndarray) -> Joined:
        return Joined([f"{url}#" for url in self.urls], keys, which, list(self.ends), end)

    def rows(self, codes: np.ndarray, classes: list[str], listing: dict[str, Any]) -> Rows:
        """The rows, the columns handed over: their keys checked to be unique, each tar's count of rows recorded in
        ``listing`` (a resume lists one alone)."""
        keys = self.ids.array()
        twice = duplicate(keys)
        if twice is not None:
            raise DataError(f"sample key {keys[twice[0]]!r} appears in {self.tar_of(twice[0])} and "
                            f"{self.tar_of(twice[1])}; keys must be unique")
        listing["rows"] = np.diff([*self.starts, len(keys)]).tolist()
        return Rows(ids=keys, paths=self._paths(keys, self.which.array(), self.end.array()), labels=codes,
                    classes=classes, locators={OFFSET: self.offsets.array(), SIZE: self.sizes.array()},
                    fingerprints=self.prints.array(), listing=listing)


def _tar_fingerprint(url: str, storage: dict[str, Any]) -> int:
    """The tar's own fingerprint (a member's is it with the member's offset and size); 0 when unknown."""
    if not is_url(url):
        return local_fingerprint(url)
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url, **storage)
        return remote_fingerprint(fs.info(path))
    except Exception:  # noqa: BLE001 - read fine a moment ago: unknown, not an error
        return 0


def read_member(item: tuple[str, int, int], storage_options: dict[str, Any] | None = None) -> bytes:
    """The bytes of a tar member: ``(TAR_URL#MEMBER, offset, size)``."""
    path, offset, size = item
    url = tar_url_of(path, storage_options or {})
    if is_url(url):
        import fsspec

        fs, p = fsspec.core.url_to_fs(url, **(storage_options or {}))
        return fs.cat_file(p, start=offset, end=offset + size)
    with open(url.removeprefix("file://"), "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise OSError(f"{url} ends before the member's {size} bytes at offset {offset}: truncated tar")
    return data


class TarSource(Source):
    """WebDataset tar shards (``data.tars``): rows from their headers; a row's bytes read as a byte range."""

    name = "tar"
    locators = (LocatorArray(OFFSET, "int64", -1), LocatorArray(SIZE, "int64", -1))

    def list(self, data: DataSpec) -> Rows:
        return list_tars(data.tars, data.extensions, data.storage_options)

    def stream(self, data: DataSpec, then: Callable[[Rows], Rows]) -> Streamed | None:
        return stream_tars(data.tars, data.extensions, data.storage_options, data.classes, then)

    def reads(self, item: Locator) -> bool:
        return isinstance(item, tuple)

    def read(self, item: Locator, storage_options: dict | None, outside_root: bool) -> bytes:
        assert isinstance(item, tuple)
        return read_member(item, storage_options)

    def sample(self, data: DataSpec, parts: int, over: int) -> Sampled | None:
        urls = tar_urls(data.tars, data.storage_options)
        picked = spread(urls, parts)
        return None if len(urls) <= over else Sampled(data.model_copy(update={"tars": picked}), len(picked),
                                                      len(urls), "tars")

    def listing(self, data: DataSpec, was: dict[str, Any] | None = None) -> dict[str, Any] | None:
        now = tar_listing(data.tars, data.extensions, data.storage_options)
        return None if 0 in now["fingerprints"] else now  # a tar of unknown fingerprint: listed again

    def relist(self, data: DataSpec, recorded: Recorded, now: dict[str, Any]) -> Rows | None:
        """The tars whose fingerprint changed scanned again, the others' rows taken from the store; None (all
        listed again) when the tars or extensions differ, or labels are class names (a new name renumbers them)."""
        was = recorded.listing
        counts = was.get("rows")
        if counts is None or was.get("tars") != now["tars"] or was.get("extensions") != now["extensions"] or \
                data.classes is not None or recorded.rows().classes:
            return None
        storage, starts = data.storage_options, np.cumsum([0, *counts]).tolist()
        parts: list[dict[str, Any]] = []
        for t, url in enumerate(now["tars"]):
            a, b = starts[t], starts[t + 1]
            if was["fingerprints"][t] == now["fingerprints"][t]:
                parts.append({k: recorded.column(c, a, b) for k, c in _COLUMNS.items()})
                continue
            found = scan_tar(url, data.extensions, storage)
            codes, classes = labels_of(found.each_label())
            if classes:
                return None
            parts.append({"ids": strings(found.keys), "paths": strings(f"{url}#{m}" for m in found.members),
                          "labels": codes, "offsets": found.offsets, "sizes": found.sizes,
                          "fingerprints": member_fingerprints(now["fingerprints"][t], found.offsets, found.sizes)})
        # each column in its own dtype: the stored fingerprints (uint64) beside a tar's listed again (int64 where
        # none is past 2^63) were promoted to float64, every fingerprint rounded: every row seen as moved
        columns = {k: np.concatenate([np.asarray(p[k], dtype=_DTYPES.get(k)) for p in parts]) for k in _COLUMNS}
        if duplicate(columns["ids"]) is not None:
            return None  # a full listing names the duplicate
        listing = {**now, "rows": [len(p["ids"]) for p in parts]}
        return Rows(ids=columns["ids"], paths=columns["paths"], labels=columns["labels"],
                    locators={OFFSET: columns["offsets"], SIZE: columns["sizes"]},
                    fingerprints=columns["fingerprints"], listing=listing)

    def places(self, recorded: Recorded, storage_options: dict[str, Any]) -> dict[str, np.ndarray] | None:
        """Each row's member offset and size where its tar holds it now, when a tar was rewritten since the store
        was listed (its members may have moved; a member gone: offset -1)."""
        was = recorded.listing
        if not was or "tars" not in was:
            return None
        now = tar_listing(was["tars"], was["extensions"], storage_options)
        moved = {u for u, a, b in zip(was["tars"], was["fingerprints"], now["fingerprints"], strict=True)
                 if a != b or b == 0}
        if not moved:
            return None
        offsets, sizes = recorded.column(OFFSET).copy(), recorded.column(SIZE).copy()
        paths = recorded.column("paths")
        for url in sorted(moved):
            try:
                found = scan_tar(url, was["extensions"], storage_options)
                where = {m: (o, n) for m, o, n in zip(found.members, found.offsets, found.sizes, strict=True)}
            except Exception:  # noqa: BLE001 - a tar gone or unreadable now: its rows are unreadable
                where = {}
            for r in np.flatnonzero(np.strings.startswith(paths, f"{url}#")):
                offsets[r], sizes[r] = where.get(str(paths[r])[len(url) + 1:], (-1, 0))
        return {OFFSET: offsets, SIZE: sizes}


_COLUMNS = {"ids": "ids", "paths": "paths", "labels": "labels", "offsets": OFFSET, "sizes": SIZE,
            "fingerprints": "fingerprint"}  # a row's columns and the store's arrays that hold them
_DTYPES = {"labels": np.int64, "offsets": np.int64, "sizes": np.int64, "fingerprints": np.uint64}

SOURCE = TarSource()
