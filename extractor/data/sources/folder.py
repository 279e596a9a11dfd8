"""The folder source (``data.root``): images under a local or remote folder, walked in sorted order, labelled
by their class folders. A local folder's listing records each folder walked with its mtime, ctime and number of
rows: a resume stats those folders (thousands at a million images) and lists again only those whose times moved (a
file added, removed or renamed in them; the ctime also when the mtime was put back by hand). No image file is stat-ed
by the listing: each row's worker fingerprints the file it opens, and a resume stats the files of the rows read
(``data.verify: files``, the default: a file rewritten in place moves no folder's times)."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CountError, DataError
from ..files import (
    absolute,
    display_name,
    is_url,
    local_path,
    plain_utf8,
    remote_error,
    remote_fingerprint,
    storable_path,
)
from ..rows import STRINGS, Joined, Joining, Rows, Strings, Texts, duplicate, named, strings
from ..spill import Column
from ..streamed import Lister, Streamed
from . import Recorded, Source

if TYPE_CHECKING:
    from ...spec import DataSpec

log = logging.getLogger(__name__)


def _list_remote_folder(root: str, extensions: Sequence[str], storage: dict) -> Rows:
    import fsspec

    exts = tuple(e.lower() for e in extensions)
    try:
        fs, base = fsspec.core.url_to_fs(root, **storage)
        infos = fs.find(base, detail=True)  # sizes and ETags come with the listing: the rows' fingerprints
        found = sorted(p for p in infos if p.lower().endswith(exts))
    except Exception as err:
        raise remote_error("data.root", root, err) from err
    base = base.rstrip("/")
    kept = [p for p in found if not any(part.startswith(".") for part in p[len(base) + 1:].split("/"))]  # hidden
    ids = strings(p[len(base) + 1:] for p in kept)
    tops = [_top(r) for r in ids]
    labels, classes = _folder_labels(tops, [1] * len(tops), lambda: str(ids[tops.index("")]))
    return Rows(ids=ids, paths=Joined(strings([f"{root.rstrip('/')}/"]), ids), labels=labels, classes=classes,
                fingerprints=np.fromiter((remote_fingerprint(infos[p]) for p in kept), np.uint64, len(kept)))


def _folder_labels(tops: Sequence[str], counts: Sequence[int], first: Callable[[], str]) -> tuple[np.ndarray,
                                                                                                  list[str]]:
    """ImageFolder labels of runs of rows, ``counts[i]`` rows in top-level folder ``tops[i]``: an image's class is
    its top-level folder. Images directly in the root (top ``""``) have no class (-1); when others do, a warning
    names the first of them (``first()``)."""
    n = np.asarray(counts, dtype=np.int64)
    present = {t for t, c in zip(tops, counts, strict=True) if c}
    classes = sorted(t for t in present if t)
    if "" in present and classes:
        log.warning("%d images lie directly in data.root (first: %s), outside the class folders; they get "
                    "no label (-1). Move them into a class folder, or list them in a manifest",
                    int(n[[t == "" for t in tops]].sum()), first())
    index = {c: i for i, c in enumerate(classes)}
    labels = Column("q")  # a folder's run of its class at a time (on the disk past a megabyte)
    for top, size in zip(tops, counts, strict=True):
        labels.extend(np.full(size, index.get(top, -1), dtype=np.int64))
    return labels.array(), classes


def _top_of(rel: str) -> str:
    """The top-level folder of a folder's relative path as a listing records it (the root's: "")."""
    return display_name(_real(rel)).split("/", 1)[0] if rel else ""


def _nothing() -> None:
    pass


_NOTHING: Callable[[], None] = _nothing  # (a folder skipped: no rows to take)


def _top(rel: str) -> str:
    """The top-level folder of an image's relative path ("": it lies in the root)."""
    return rel.split("/", 1)[0] if "/" in rel else ""


_UNSETTLED_NS = 2 * 10**9  # a folder modified this shortly before it was listed may change again within one tick
# of its mtime after the listing: recorded as unsettled, listed again by the next resume
_MAX_FOLDERS = 100_000  # more folders (a folder an image): no listing recorded (megabytes of the store's attributes)
UNSETTLED = [-1, -1]  # a recorded folder's times: list it again (modified as it was listed, or not listable)
_GONE: list[Any] = [None, None]  # a recorded folder's times now, where it cannot be seen


def _real(rel: str) -> str:
    """A folder's relative path as a listing records it (:func:`storable_path`), as the file system names it."""
    return os.fsdecode(local_path(rel))


def _times(path: str) -> list[int] | None:
    """A folder's mtime and ctime (both move when an entry is added, removed or renamed in it; a ctime cannot be put
    back by hand); None: it cannot be seen."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_ctime_ns]


def _entries(path: str) -> tuple[list[str], list[str]]:
    """A folder's entries as :func:`os.walk` following links sorts them: (files, folders), each sorted; a FIFO,
    socket or device is neither (a read of a FIFO named ``x.jpg`` waited forever)."""
    files: list[str] = []
    folders: list[str] = []
    with os.scandir(path) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir()
                is_file = not is_dir and (entry.is_symlink() or entry.is_file())  # (a broken link: a file, as before)
            except OSError:
                is_dir, is_file = False, True
            if is_dir or is_file:
                (folders if is_dir else files).append(entry.name)
    return sorted(files), sorted(folders)


class _Kept:
    """The folders a store's listing recorded (``folders``: path, mtime and ctime, in walk order; ``rows``: each
    one's number of rows) and their times now: where one's are as recorded, its rows are a run of the store's and
    its sub-folders those recorded (an entry added, removed or renamed moves a folder's times)."""

    def __init__(self, was: dict[str, Any], now: list[list[Any]]) -> None:
        stops = np.cumsum(was["rows"]).tolist()
        self.same: dict[str, tuple[list[int], int, int]] = {}  # a folder as recorded -> (times, first row, end row)
        for (rel, *times), (_, *times_now), stop, count in zip(was["folders"], now, stops, was["rows"], strict=True):
            if times == times_now and times != UNSETTLED:
                self.same[_real(rel)] = (times, stop - count, stop)
        self.children: dict[str, list[str]] = {}
        for rel, *_ in was["folders"][1:]:
            real = _real(rel)
            self.children.setdefault(real.rpartition("/")[0], []).append(real)


class _Walk:
    """One walk of a local folder tree in the listing's order: each folder's images sorted by name, then its
    sub-folders in sorted order (hidden ones skipped, links followed, a folder reached again through a link
    skipped). Each folder is stat-ed before it is listed, and recorded with its times and number of rows: the
    listing a resume checks by a stat per folder; no file is stat-ed (each row's worker fingerprints the file it
    reads). ``kept``: an earlier walk's folders, from a store: one unchanged since is not listed, its rows taken
    from the store (``recorded``)."""

    def __init__(self, top: str, extensions: Sequence[str], kept: _Kept | None = None, counting: bool = False,
                 index: dict[str, int] | None = None, stopped: Callable[[], bool] | None = None) -> None:
        self.top, self.exts, self.kept = top, tuple(e.lower() for e in extensions), kept
        self.counting = counting  # only the images counted, each folder's (no name kept)
        # streamed (:func:`_stream_folder`): each row's class index (of its top folder in ``index``) as it is taken
        self.index, self.labels = index, Column("q") if index is not None else None
        self.stopped = stopped  # asked before each folder: a listing streamed whose job stopped stops there
        self.escaped = False  # whether an id is a name that is not UTF-8, its bytes shown as \xNN
        self.ids = Strings()
        self.paths = Joining([os.path.join(top, "")], self.ids)  # a relative path is its id: held once
        self.listed = 0  # rows listed
        self.folders: list[list[Any]] = []  # [relative path ("": the root), mtime, ctime] of each folder walked
        self.counts: list[int] = []  # each one's rows
        self.runs: list[list[Any]] = []  # [from the store, start, stop]: runs of rows, the store's or listed now
        self.seen: set[str] = set()  # the real paths walked
        self.settled = time.time_ns() - _UNSETTLED_NS  # a folder modified since: recorded UNSETTLED
        self.plain = plain_utf8(top) and os.path.join(top, "x") == top.rstrip("/") + "/x"  # names joined as they are

    def walk(self) -> _Walk:
        for _, take in self.steps():
            take()
        return self

    def steps(self) -> Generator[tuple[int, Callable[[], None]], None, None]:
        """The walk a folder at a time: each folder listed, and how to take its rows (the builders grow there only:
        a listing streamed takes them under its lock), with the rows listed once it is taken."""
        todo = [""]
        while todo:
            if self.stopped is not None and self.stopped():
                raise DataError("the listing stopped: its job stopped")
            subs, take = self._folder(todo.pop())
            todo.extend(reversed(subs))
            yield self.listed, take

    def _folder(self, rel: str) -> tuple[list[str], Callable[[], None]]:
        """Folder ``rel``: its sub-folders to walk, in order, and how to take its rows."""
        path = os.path.join(self.top, rel) if rel else self.top
        real = os.path.realpath(path)
        if real in self.seen:  # a symlink loop, or a second link to a folder already walked
            if not self.counting:  # (said once: by the walk that takes the rows)
                log.warning("skipping %s: it leads back to %s, already listed", path, real)
            return [], _NOTHING
        self.seen.add(real)
        if self.kept is not None and rel in self.kept.same:
            was, start, stop = self.kept.same[rel]
            return self.kept.children.get(rel, []), functools.partial(self._add, rel, was, True, start, stop)
        return self._listed(rel, path)

    def _listed(self, rel: str, path: str) -> tuple[list[str], Callable[[], None]]:
        """Folder ``rel`` listed now: its sub-folders to walk, in order, and how to take its rows."""
        times = _times(path)  # before the listing: an entry added meanwhile moves them after
        try:
            files, folders = _entries(path)
        except OSError as err:
            if not self.counting:
                log.warning("cannot list %s: %s", path, err.strerror)
            files, folders, times = [], [], None
        names = [n for n in files if n.lower().endswith(self.exts) and not n.startswith(".")]
        start = self.listed
        self.listed += len(names)
        subfolders = [f"{rel}/{d}" if rel else d for d in folders if not d.startswith(".")]  # .git: not classes
        record = functools.partial(self._add, rel, times if times is not None and times[0] < self.settled
                                   else UNSETTLED, False, start, self.listed)
        if self.counting:
            return subfolders, record
        subs = [f"{rel}/{name}" for name in names] if rel else names

        def take() -> None:
            if plain_utf8("".join(subs)) and self.plain:  # each id its name, each path the root and it: at once
                self.ids.extend(subs)
                self.paths.parts(0, subs, are_ids=True)
            else:
                for sub in subs:
                    shown = display_name(sub)
                    self.escaped = self.escaped or shown != sub  # (its id may be another file's name: checked)
                    self.ids.append(shown)
                    self.paths.whole(storable_path(os.path.join(self.top, sub)))  # undecodable names: hex, whole
            if self.labels is not None and self.index is not None:
                self.labels.extend(np.full(len(subs), self.index.get(_top_of(storable_path(rel)), -1), np.int64))
            record()

        return subfolders, take

    def change_from(self, counted: _Walk) -> str | None:
        """What differs from the walk that ``counted`` the images first: the first folder there in one walk only,
        or that holds another number of images; None: none."""
        now = [(f[0], n) for f, n in zip(self.folders, self.counts, strict=True)]
        was = [(f[0], n) for f, n in zip(counted.folders, counted.counts, strict=True)]
        for (rel, n), (rel_was, m) in itertools.zip_longest(now, was, fillvalue=(None, 0)):
            if rel != rel_was:  # (walked in order: the first of the two is there in one walk only)
                new = rel_was is None or (rel is not None and rel.split("/") < rel_was.split("/"))
                shown = display_name(_real(str(rel if new else rel_was)))
                return f"folder {shown!r} " + ("is there now, not when its images were counted" if new else
                                               "was there when its images were counted, and is gone now")
            if n != m:
                return f"folder {display_name(_real(str(rel))) or '.'!r} held {m} images when they were counted, " \
                    f"{n} now"
        return None

    def tops(self) -> list[str]:
        """The top-level folder of each folder walked (the root's: "")."""
        return [_top_of(rel) for rel, *_ in self.folders]

    def prefix(self) -> Rows:
        """The rows taken so far (none copied: maps of the builders' files), the walk going on (streamed:
        :func:`_stream_folder`)."""
        assert self.labels is not None
        ids = self.ids.snapshot()
        return Rows(ids=ids, paths=self.paths.snapshot(ids), labels=self.labels.snapshot()[:len(ids)])

    def _add(self, rel: str, times: list[int], stored: bool, start: int, stop: int) -> None:
        self.folders.append([storable_path(rel), *times])  # (a name that is not UTF-8: hex, as a path)
        self.counts.append(stop - start)
        if self.runs and self.runs[-1][0] == stored and self.runs[-1][2] == start:
            self.runs[-1][2] = stop
        elif stop > start:
            self.runs.append([stored, start, stop])

    def rows(self, settings: dict[str, Any], recorded: Recorded | None = None) -> Rows:
        """The rows walked (those of the store's runs read from ``recorded``), their listing: ``settings`` and the
        folders walked. No fingerprints: a resume stats the files of the rows read."""
        listed = self.ids.array()
        ids: Texts | np.ndarray = listed
        paths: Joined | np.ndarray = self.paths.joined(listed)
        if any(stored for stored, _, _ in self.runs):
            assert recorded is not None
            ids, paths = (self._joined(recorded, name, own) for name, own in (("ids", listed), ("paths", paths)))
        twice = duplicate(ids) if self.escaped else None
        if twice is not None:
            raise DataError(f"data.root {self.top}: {str(ids[twice[0]])!r} names two images: a name that is not UTF-8 "
                            r"(its bytes shown as \xNN) and one written so (rows "
                            f"{twice[0] + 1} and {twice[1] + 1}); rename one of them")
        labels, classes = _folder_labels(self.tops(), self.counts, lambda: str(ids[0]))
        listing = {**settings, "folders": self.folders, "rows": self.counts} if len(self.folders) <= _MAX_FOLDERS \
            else None
        return Rows(ids=ids, paths=paths, labels=labels, classes=classes, listing=listing)


    def _joined(self, recorded: Recorded, name: str, own: Any) -> np.ndarray:
        """A column of the rows walked: the runs of the store's from its array ``name``, the others from ``own``."""
        return np.concatenate([np.asarray(recorded.column(name, a, b) if stored else own[a:b], dtype=STRINGS)
                               for stored, a, b in self.runs])


def _list_folder(root: Path, extensions: Sequence[str], settings: dict[str, Any]) -> Rows:
    if not root.exists():
        raise DataError(f"data.root {root} does not exist; set data.root to a folder of images")
    if not root.is_dir():
        raise DataError(f"data.root {root} is not a folder; for a file list use data.source: manifest")
    return _Walk(absolute(str(root)), extensions).walk().rows(settings)


def _stream_folder(root: Path, extensions: Sequence[str], settings: dict[str, Any], classes: list[str] | None,
                   then: Callable[[Rows], Rows]) -> Streamed | None:
    """The rows of :func:`_list_folder`, listed on a thread (:class:`~..streamed.Streamed`) once they are counted: a
    walk that only counts each folder's images by name, then the walk that takes them, a folder at a time (no file
    stat-ed by either). Their classes are the
    top-level folders that hold images, known from the count (where data.classes, ``classes``, names them all:
    their indices there). None (listed whole: it says what is wrong) where there is nothing to count."""
    if not root.is_dir():
        return None
    top = absolute(str(root))
    counted = _Walk(top, extensions, counting=True).walk()
    present = sorted({t for t, c in zip(counted.tops(), counted.counts, strict=True) if c and t})
    if not counted.listed or (classes is not None and not set(present) <= set(classes)):
        return None  # (the whole listing names the folders data.classes does not)
    named = list(classes) if classes is not None else present
    made: list[Streamed] = []

    def stopped() -> bool:  # (asked from its listing's thread, which may start before it is made)
        return bool(made) and made[0].stopping

    walk = _Walk(top, extensions, index={c: i for i, c in enumerate(named)}, stopped=stopped)

    def lister() -> Lister:
        yield from walk.steps()
        changed = walk.change_from(counted)
        if changed:
            raise CountError(f"data.root {top} changed while it was listed: {changed}")
        return then(walk.rows(settings))

    made.append(Streamed(counted.listed, named, lister(), walk.prefix, fingerprinted=False))
    return made[0]


class FolderSource(Source):
    """A folder of images (``data.root``), local or remote, walked in sorted order; ImageFolder labels."""

    name = "folder"
    prints_on_read = True  # (a local folder's; a remote one's listing brings every object's fingerprint)

    def list(self, data: DataSpec) -> Rows:
        assert data.root is not None  # the spec validator guarantees it
        if is_url(data.root):
            return _list_remote_folder(data.root, data.extensions, data.storage_options)
        return _list_folder(Path(data.root), data.extensions, self._settings(data))

    def stream(self, data: DataSpec, then: Callable[[Rows], Rows]) -> Streamed | None:
        assert data.root is not None
        if is_url(data.root):
            return None  # (listed by one request: fs.find)
        return _stream_folder(Path(data.root), data.extensions, self._settings(data),
                              None if data.classes is None else list(data.classes), then)

    def _settings(self, data: DataSpec) -> dict[str, Any]:
        """What a listing records beside its folders: the settings that change its rows."""
        assert data.root is not None
        return {"source": self.name, "root": absolute(data.root),
                "extensions": sorted(e.lower() for e in data.extensions)}

    def listing(self, data: DataSpec, was: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The folders ``was`` records, each with its times now (a stat each); None where it records none (a
        remote folder, whose listing is one request that brings every object's fingerprint; a store made before
        folders were recorded) or other settings."""
        assert data.root is not None
        if is_url(data.root) or was is None or "folders" not in was:
            return None
        settings = self._settings(data)
        if any(was.get(k) != v for k, v in settings.items()):
            return None
        top = settings["root"]
        return {**settings, "folders": [[rel, *(_times(os.path.join(top, _real(rel)) if rel else top) or _GONE)]
                                        for rel, *_ in was["folders"]]}

    def relist(self, data: DataSpec, recorded: Recorded, now: dict[str, Any]) -> Rows | None:
        """The folders whose times moved listed again (and any new sub-folder of theirs), the others' rows taken
        from the store. None (all listed again, which says what is
        wrong) where the root is no folder now."""
        if not os.path.isdir(now["root"]):
            return None
        kept = _Kept(recorded.listing, now["folders"])
        walk = _Walk(now["root"], data.extensions, kept).walk()
        rows = walk.rows(self._settings(data), recorded)
        return rows if data.classes is None else named(rows, list(data.classes), now["root"])


SOURCE = FolderSource()
