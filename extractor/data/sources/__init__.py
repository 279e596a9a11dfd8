"""The data sources as plug-ins: one module each (a folder, a manifest, tar files, Parquet or Arrow files), each a
:class:`Source`, registered by its ``data.source`` name (the names and the settings each reads are declared in
:mod:`extractor.spec.sources`). Listing (:func:`~extractor.data.listing.list_rows`), reading a row's bytes
(:func:`read_bytes`) and a resume's reuse of the rows a store recorded (:func:`reuse`) go through the registry;
nothing outside a source's module knows how it lists or reads.

Adding a source: its settings in ``spec.sources.SOURCE_SETTINGS`` (and ``DataSpec.source``'s names), one module
here whose ``SOURCE`` is a :class:`Source`, and its tests.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from stat import S_ISREG
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from ..._threads import InOrder
from ...errors import DataError
from ...spec import SOURCE_SETTINGS
from ..files import FS_BYTES, Locator, is_url, local_fingerprint, read_file, read_file_printed
from ..rows import BLOCK, LocatorArray

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...spec import DataSpec
    from ..rows import Rows
    from ..streamed import Streamed

__all__ = [
    "REGISTRY",
    "LocatorArray",
    "Recorded",
    "Sampled",
    "Source",
    "Stats",
    "files_now",
    "folder_prints",
    "forget_reads",
    "locator_names",
    "paths_now",
    "read_bytes",
    "read_printed",
    "reuse",
    "source",
    "spread",
    "stat_prints",
]


log = logging.getLogger(__name__)
REGISTRY: dict[str, str] = {name: name for name in SOURCE_SETTINGS}  # data.source -> its module here


class Recorded(Protocol):
    """The rows a store recorded, as a resume reads them back (the store makes one: ``store.StoredRows``)."""

    listing: dict[str, Any]  # what they were listed from, as the source's :meth:`Source.listing` said then

    def rows(self) -> Rows:
        """The rows left in the store: their number, digests, classes and listing (``Rows.stored``)."""
        ...

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``start:stop`` of a per-row array of the store (``ids``, ``paths``, ``labels``, ``fingerprint``...)."""
        ...


class Source(ABC):
    """A data source: lists a data spec's images as rows (ids, paths, labels, fingerprints) and reads a row's bytes.
    The hooks with defaults are for the sources that need them."""

    name: ClassVar[str]  # its data.source
    # the per-row arrays it keeps in the store beside ``paths`` where a path alone does not find a row's bytes (a
    # tar member's byte range): its rows carry them (``Rows.locators``), the store writes them, and a row's
    # locator read back from the store is ``(path, *their values)``, in this order, handed to :meth:`read`
    locators: ClassVar[tuple[LocatorArray, ...]] = ()
    # its listing stats no file (its rows' fingerprints None): each row's file is fingerprinted by the worker that
    # reads it (the store's ``read_fingerprint``), and, for the rows read before, by a resume that lists it again or
    # takes its rows from the store where data.verify: files asks (:func:`~extractor.store.provenance.changed_rows`)
    prints_on_read: ClassVar[bool] = False

    @abstractmethod
    def list(self, data: DataSpec) -> Rows:
        """Every row, in a fixed order, with its fingerprint where one is cheap (0: unknown) and, where the source
        can tell cheaply whether it changed, ``Rows.listing``: what the listing was made from (:meth:`listing`, with
        ``rows``: each part's number of rows, where it has parts)."""

    def stream(self, data: DataSpec, then: Callable[[Rows], Rows]) -> Streamed | None:
        """The rows of :meth:`list`, listed on a thread behind the job's start (:class:`~..streamed.Streamed`), where
        their number is known without listing them; None: listed whole first. ``then``: made of the whole listing at
        its end (data.classes given their names)."""
        return None

    def names_first(self, data: DataSpec) -> bool:
        """Whether :meth:`stream` reads labels that are class names (data.classes not given) before their rows, and
        streams them as if data.classes named them; else such a listing takes labels as class indices as they
        come (a name in its first part: listed whole first; later: the job stops)."""
        return False

    def empty(self, data: DataSpec) -> str:
        """Why a listing found no rows, in the error's words."""
        return f"looked for files ending in {', '.join(data.extensions)}"

    def reads(self, item: Locator) -> bool:
        """Whether a stored locator is one only this source reads (a tar member, a Parquet row)."""
        return False

    def read(self, item: Locator, storage_options: dict | None, outside_root: bool) -> bytes:
        """The bytes of a locator it :meth:`reads`."""
        assert isinstance(item, str)
        return read_file(item, storage_options)

    def forget(self) -> None:
        """Drop what reads keep of the source (a Parquet file's row groups): later reads see it as it is now."""
        return

    def listing(self, data: DataSpec, was: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """What a listing would be made from now, cheaply (the files' fingerprints, the settings that change it),
        as a JSON object; None: not known cheaply (every resume lists again). A store records it (``Rows.listing``);
        a resume whose source gives the same takes the rows from the store instead of listing them. ``was``: the
        listing the store recorded, where a resume asks (a folder stats the folders it names, no more)."""
        return None

    def relist(self, data: DataSpec, recorded: Recorded, now: dict[str, Any]) -> Rows | None:
        """The rows, when the source changed since ``recorded`` was listed (``now``: :meth:`listing` now): the parts
        that changed listed again, the others taken from the store. None: list it all."""
        return None

    def sample(self, data: DataSpec, parts: int, over: int) -> Sampled | None:
        """Where the source has more than ``over`` parts (files, tars, megabytes of a manifest): a data spec of
        ``parts`` of them spread over it, to list and scale by (``extractor plan`` of a source that takes minutes to
        list); None: the source is listed whole."""
        return None

    def places(self, recorded: Recorded, storage_options: dict[str, Any]) -> dict[str, np.ndarray] | None:
        """Where each row's bytes are now, when the source moved them since the store recorded them (a rewritten
        tar's members): its :attr:`locators` arrays as they are now, by name; None: where recorded."""
        return None


@dataclass(frozen=True)
class Sampled:
    """A part of a source to list in its place: a data spec of ``taken`` of its ``parts`` parts (``unit``)."""

    data: DataSpec
    taken: int
    parts: int
    unit: str  # what a part is, plural: "Parquet files", "tars", "MB of the manifest"
    rows: tuple[int, int] | None = None  # the part's rows and the whole's, where the source counts them cheaply

    @property
    def scale(self) -> float:
        """The whole source over the part listed (its rows, where counted)."""
        return self.rows[1] / self.rows[0] if self.rows and self.rows[0] else self.parts / self.taken

    def __str__(self) -> str:
        return f"{self.taken:,} of {self.parts:,} {self.unit}" + ("; every file's rows counted from its footer" if
                                                                   self.rows else "")


def spread(items: list[str], parts: int) -> list[str]:
    """``parts`` of ``items`` spread evenly over them, the first and the last included."""
    if len(items) <= parts:
        return list(items)
    return [items[round(k * (len(items) - 1) / (parts - 1))] for k in range(parts)] if parts > 1 else items[:1]


_LOADED: dict[str, Source] = {}


def source(name: str) -> Source:
    """The source registered as ``data.source: name``."""
    if name not in _LOADED:
        if name not in REGISTRY:
            from ...errors import DataError

            raise DataError(f"data.source {name!r} is not a data source; the sources are {', '.join(REGISTRY)}")
        module = importlib.import_module(f"{__name__}.{REGISTRY[name]}")
        _LOADED[name] = module.SOURCE
    return _LOADED[name]


def locator_names() -> frozenset[str]:
    """The names of every source's locator arrays (:attr:`Source.locators`): per-row arrays of the store."""
    return frozenset(a.name for name in REGISTRY for a in source(name).locators)


def read_bytes(item: Locator, storage_options: dict | None = None, outside_root: bool = True) -> bytes:
    """The bytes of one image: a file or URL, or a locator a source reads itself (a tar member's byte range, a
    Parquet file's row). ``outside_root`` false: a path a source's row names that leaves its folder is refused,
    not opened (the job's decoders pass ``data.outside_root``)."""
    return read_printed(item, storage_options, outside_root)[0]


def read_printed(item: Locator, storage_options: dict | None = None, outside_root: bool = True) -> tuple[bytes, int]:
    """:func:`read_bytes`, with the fingerprint of the local file it opened
    (:func:`~extractor.data.files.read_file_printed`; 0: a URL, or a locator a source reads, whose fingerprint its
    listing holds). A worker records it: a manifest's listing stats no file."""
    for name in REGISTRY:
        reader = source(name)
        if reader.reads(item):
            return reader.read(item, storage_options, outside_root), 0
    if not isinstance(item, str):
        raise ValueError(f"no data source reads {item!r}")
    return read_file_printed(item, storage_options)


def forget_reads() -> None:
    """Reads from now on see the sources as they are now: what :func:`read_bytes` keeps of them is dropped.
    Called where rows are read to be computed or checked."""
    for loaded in list(_LOADED.values()):
        loaded.forget()


def reuse(data: DataSpec, recorded: Recorded) -> Rows | None:
    """A resume's rows, from the store where the source is as it was listed: all of them when its listing is the
    same (a folder's or manifest's files then stat-ed by the resume where ``data.verify: files`` asks:
    :attr:`Source.prints_on_read`), the changed parts listed again otherwise; None: the source lists them all
    again."""
    src = source(data.source)
    now = src.listing(data, recorded.listing)
    if now is None:
        return None
    was = {k: v for k, v in recorded.listing.items() if k != "rows"}
    if was != now:
        return src.relist(data, recorded, now)
    return recorded.rows()


def files_now(recorded: Recorded, start: int = 0, stop: int | None = None) -> np.ndarray:
    """The fingerprints now of the files a store's rows ``start:stop`` name (0: a URL, or a file that cannot be
    seen), ``BLOCK`` rows at a time: a stat each, no listing (about 4 s a million files on a warm local disk,
    measured)."""
    stop = len(recorded.rows()) if stop is None else stop
    out = np.zeros(stop - start, dtype=np.uint64)
    with Stats() as stats:  # (one for every block: found slow once)
        for at in range(start, stop, BLOCK):
            block = recorded.column("paths", at, min(at + BLOCK, stop))
            out[at - start:at - start + len(block)] = paths_now(block, stats)
    return out


def paths_now(paths: Any, stats: Stats | None = None) -> np.ndarray:
    """The fingerprints now of the files ``paths`` name (a block of them; 0: a URL, or a file that cannot be seen):
    plain local paths stat-ed in bulk (:func:`stat_prints`), others one at a time."""
    block = np.asarray(paths)
    if not len(block):
        return np.zeros(0, dtype=np.uint64)
    if block.dtype == object:
        block = block.astype(np.dtypes.StringDType())
    plain = not bool(np.strings.find(block, "://").max(initial=-1) >= 0 or
                     np.strings.startswith(block, FS_BYTES).any())
    return stat_prints(block, stats) if plain else \
        np.asarray([0 if is_url(p) else local_fingerprint(p) for p in block.tolist()], dtype=np.uint64)


def stat_prints(paths: np.ndarray, stats: Stats | None = None) -> np.ndarray:
    """:func:`~extractor.data.files.local_fingerprint` of plain local paths (a million in a resume): split at
    their last ``/`` in numpy, each run of one folder's files stat-ed by name in that folder (no path joined or
    walked again per file; on threads where stats are slow, :class:`Stats`); paths whose folders interleave are
    taken in the order of their folders first. ``stats``: where they are stat-ed (its threads left running)."""
    folders, seps, names = np.strings.rpartition(paths, np.asarray("/", dtype=paths.dtype))
    changes = np.flatnonzero(folders[1:] != folders[:-1]) + 1
    order = None
    if len(changes) > len(paths) // 8:  # folders interleaved (a manifest in another order): grouped first
        order = np.argsort(folders, kind="stable")
        folders, seps, names = folders[order], seps[order], names[order]
        changes = np.flatnonzero(folders[1:] != folders[:-1]) + 1
    out = np.zeros(len(paths), dtype=np.uint64)
    taken = 0

    def take(due: list[list[int]]) -> None:
        nonlocal taken
        for prints in due:
            out[taken:taken + len(prints)] = prints
            taken += len(prints)

    with contextlib.nullcontext(stats) if stats is not None else Stats() as where:
        for a, b in itertools.pairwise([0, *changes.tolist(), len(paths)]):
            folder = str(folders[a]) or ("/" if seps[a] else ".")
            take(where.ask(folder, names[a:b].tolist()))
        take(where.rest())
    if order is not None:
        out[order] = out.copy()
    return out


STAT_THREADS = 16  # threads that stat files once stats are found slow (a network file system's)
STAT_PIECE = 1024  # files of one folder stat-ed in one go
SLOW_STAT_S = 25e-6  # a stat this slow or slower (on average, over STAT_SAMPLE files at least) waits for a server:
STAT_SAMPLE = 256  # the files after are stat-ed on threads (a stat of a warm local disk: about 3 us)


class Stats:
    """Where files are stat-ed (:meth:`ask`): in the caller's thread while stats answer at once (a local disk: 16
    threads contending for the GIL took twice the wall time and 2.5 times the CPU of one, measured); on
    :data:`STAT_THREADS` threads (the environment's ``EXTRACTOR_STAT_THREADS``; 0: never) once the files stat-ed so
    far took :data:`SLOW_STAT_S` a file: a network file system (NFS, Lustre) waits 0.1-1 ms for its server, and 10M
    files one at a time took hours (at 0.3 ms a stat, simulated: 9x faster on the threads). Their fingerprints come
    back in the order they were asked for (``with``: the threads end with it)."""

    def __init__(self, stopped: Callable[[], bool] | None = None) -> None:
        self.stopped = stopped  # asked before each piece of files: a listing streamed whose job stopped stops there
        threads = os.environ.get("EXTRACTOR_STAT_THREADS", "").strip() or str(STAT_THREADS)
        if not (threads.isascii() and threads.isdigit()):
            raise DataError(f"EXTRACTOR_STAT_THREADS={threads!r} is not a number of threads; set it to 0 (files "
                            f"stat-ed one at a time) or more (default {STAT_THREADS})")
        self.threads = int(threads)
        self.ahead: InOrder[list[int]] = InOrder(0)  # (inline until stats are found slow)
        self.timed = [0, 0.0]  # files stat-ed inline, and their seconds

    def ask(self, folder: str, names: list[str]) -> list[list[int]]:
        """Ask for :func:`folder_prints` of files ``names`` of ``folder``, :data:`STAT_PIECE` at a time; the
        fingerprints now due (of these files or of those asked for before), in the order they were asked for."""
        due = []
        for a in range(0, len(names), STAT_PIECE):
            if self.stopped is not None and self.stopped():
                raise DataError("the listing stopped: its job stopped")
            piece = names[a:a + STAT_PIECE]
            if self.ahead.depth or not self.threads:
                due += self.ahead.submit(folder_prints, folder, piece)
                continue
            started = time.perf_counter()
            due += self.ahead.submit(folder_prints, folder, piece)
            self.timed = [self.timed[0] + len(piece), self.timed[1] + time.perf_counter() - started]
            if self.timed[0] >= STAT_SAMPLE and self.timed[1] >= SLOW_STAT_S * self.timed[0]:
                log.debug("stats take %.0f us a file: %d threads stat the files from here on",
                          self.timed[1] / self.timed[0] * 1e6, self.threads)
                self.ahead = InOrder(2 * self.threads, self.threads, "extractor-stat")  # (nothing pending inline)
        return due

    def rest(self) -> list[list[int]]:
        """The fingerprints still to come, in order."""
        return list(self.ahead.rest())

    def __enter__(self) -> Stats:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ahead.__exit__(*exc)


_BY_NAME = os.stat in os.supports_dir_fd and hasattr(os, "O_DIRECTORY")


def folder_prints(folder: str, names: list[str]) -> list[int]:
    """The fingerprints of files ``names`` of one folder, each stat-ed by its name in the open folder (by its
    whole path where the folder cannot be opened: one that can be searched but not read)."""
    import xxhash

    digest, out = xxhash.xxh3_64_intdigest, []
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY) if _BY_NAME else None
    except OSError:
        fd = None
    stat = functools.partial(os.stat, dir_fd=fd) if fd is not None else os.stat
    named = names if fd is not None else [os.path.join(folder, n) for n in names]
    try:
        for name in named:
            try:
                st = stat(name)
            except OSError:
                out.append(0)
                continue
            if not S_ISREG(st.st_mode):  # (a folder, a FIFO, a device: as files.stat_fingerprint has it)
                out.append(0)
                continue
            # as files.fingerprint(size, mtime, ctime, inode) has it
            out.append(digest(b"%d|%d|%d|%d" % (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)) or 1)
    finally:
        if fd is not None:
            os.close(fd)
    return out
