"""A resume takes its rows from the store while the source is as it was listed (issue 39): each source's
fingerprint (a folder's folders walked, with their times; a manifest's size, mtime and digest; the Parquet files')
is recorded with the store; an unchanged source is not listed again (the listing calls counted), a changed one is
(a folder: only the folders whose times moved), and its new listing is recorded, so the resume after it lists
nothing"""

from __future__ import annotations

import os
import time
from pathlib import Path
from stat import S_ISDIR
from typing import Any

import numpy as np
import pytest
from helpers.images import make_images
from helpers.jobs import job
from helpers.stores import root_attrs

import extractor.data.sources.folder as folder
import extractor.data.sources.manifest as manifest
from extractor.data.files import local_fingerprint
from extractor.data.listing import list_rows
from extractor.data.rows import Rows
from extractor.driver.runner import run
from extractor.errors import DataError, StoreError
from extractor.read import open_store
from extractor.spec.load import parse_spec

TOY = {"name": None, "factory": "toy_models:slow_net", "factory_kwargs": {"seconds": 0}, "device": "cpu"}
CAPTURE = [{"layer": "conv", "reduce": "mean"}]


def counted(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[object]:
    """The calls of ``module.name`` from now on."""
    calls: list[object] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def touch(path: Path) -> None:
    later = os.stat(path).st_mtime_ns + 10**9
    os.utime(path, ns=(later, later))


def settle(root: Path) -> None:
    """Every folder under ``root`` modified an hour ago: settled (a folder modified during its listing is listed
    again by the next resume, whatever its mtime)."""
    hour_ago = time.time_ns() - 3600 * 10**9
    for folder_path, _, _ in os.walk(root):
        os.utime(folder_path, ns=(hour_ago, hour_ago))


class Seen:
    """The folders listed (``os.scandir``) and the files stat-ed (``os.stat`` of a path that is not a folder, or by
    name in an open folder) under ``root`` from now on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.listed: list[str] = []
        self.files: list[str] = []
        scandir, stat, under = os.scandir, os.stat, str(root)

        def counted_scandir(path: Any = ".") -> Any:
            if str(path).startswith(under):
                self.listed.append(str(path))
            return scandir(path)

        def counted_stat(path: Any, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> Any:
            found = stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
            if dir_fd is not None or (str(path).startswith(under) and not S_ISDIR(found.st_mode)):
                self.files.append(str(path))
            return found

        monkeypatch.setattr(os, "scandir", counted_scandir)
        monkeypatch.setattr(os, "stat", counted_stat)


def resumed(raw: dict[str, Any]) -> Rows | None:
    """The rows a resume of ``raw``'s store takes (:func:`extractor.data.sources.reuse`); None: listed again."""
    from extractor.store.session import StoreSession

    return StoreSession(parse_spec({**raw, "output": {**raw["output"], "if_exists": "resume"}})).stored_rows()


def assert_listed_as_now(rows: Rows | None, raw: dict[str, Any]) -> None:
    """``rows`` (partly from the store) are the rows a listing of the source gives now."""
    listed = list_rows(parse_spec(raw).data)
    assert rows is not None and rows.stored is None
    assert list(rows.ids) == list(listed.ids) and list(rows.paths) == list(listed.paths)
    assert rows.labels.tolist() == listed.labels.tolist() and rows.classes == listed.classes
    assert rows.fingerprints is None and listed.fingerprints is None  # (the workers fingerprint the files they read)


def folder_job(tmp_path: Path, per_class: int = 3, classes: tuple[str, ...] = ("a", "b"),
               **data: Any) -> dict[str, Any]:
    """A complete store of a settled folder of images (those made here, beside any there already)."""
    make_images(tmp_path / "imgs", per_class=per_class, classes=classes, size=40)
    settle(tmp_path / "imgs")
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=CAPTURE,
              data={"resize": None, "crop": 32, "shard_size": 2, **data})
    done = run(parse_spec(raw))
    assert done.ok == done.rows > 0
    raw["output"]["if_exists"] = "resume"
    return raw


@pytest.mark.parametrize("verify", ["files", "listing"])
def test_an_unchanged_folder_is_not_listed_and_its_files_stat_ed_by_default(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            verify: str):
    """The folders' times as recorded: a stat each, the rows taken from the store, no folder listed, nothing to
    compute; each file stat-ed once by name (``data.verify: files``, the default), none with ``listing``."""
    raw = folder_job(tmp_path, verify=verify)
    assert [rel for rel, *_ in open_store(str(tmp_path / "s.zarr")).attrs["listing"]["folders"]] == ["", "a", "b"]
    seen = Seen(monkeypatch, tmp_path / "imgs")
    assert run(parse_spec(raw)).shards_run == 0
    assert seen.listed == []
    assert sorted(seen.files) == (sorted(f.name for f in (tmp_path / "imgs").glob("*/*")) if verify == "files"
                                  else [])
    assert resumed(raw).stored is not None  # type: ignore[union-attr]


def test_a_file_added_lists_its_folder_alone_and_finds_the_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    raw = folder_job(tmp_path)
    first = sorted((tmp_path / "imgs" / "b").iterdir())[0]
    (first.parent / f"b99{first.suffix}").write_bytes(first.read_bytes())
    seen = Seen(monkeypatch, tmp_path / "imgs")
    rows = resumed(raw)
    assert seen.listed == [str(tmp_path / "imgs" / "b")]  # a's rows from the store, unlisted
    assert rows is not None and rows.classes == ["a", "b"] and rows.labels[list(rows.ids).index("b/b99.jpg")] == 1
    assert_listed_as_now(rows, raw)
    with pytest.raises(StoreError, match="different job"):  # the image list differs from the store's
        run(parse_spec(raw))


def test_a_file_added_is_found_when_its_folder_mtime_was_put_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``touch -r`` puts a folder's mtime back, never its ctime."""
    raw = folder_job(tmp_path)
    b = tmp_path / "imgs" / "b"
    was = os.stat(b)
    (b / "b99.png").write_bytes((b / "b01.png").read_bytes())
    os.utime(b, ns=(was.st_atime_ns, was.st_mtime_ns))
    assert os.stat(b).st_mtime_ns == was.st_mtime_ns
    seen = Seen(monkeypatch, tmp_path / "imgs")
    rows = resumed(raw)
    assert seen.listed == [str(b)] and rows is not None and "b/b99.png" in list(rows.ids)


def test_an_image_in_a_new_folder_under_a_folder_without_images_is_found(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """``a`` holds no image, only ``a/x``: a new ``a/y`` moves ``a``'s mtime (not the root's, not ``a/x``'s)."""
    make_images(tmp_path / "imgs" / "a" / "x", per_class=2, classes=("p", "q"), size=40)
    (tmp_path / "imgs" / "b").mkdir()
    (tmp_path / "imgs" / "b" / "b.png").write_bytes((tmp_path / "imgs" / "a" / "x" / "p" / "p01.png").read_bytes())
    raw = folder_job(tmp_path, per_class=0, classes=())
    (tmp_path / "imgs" / "a" / "y").mkdir()
    (tmp_path / "imgs" / "a" / "y" / "new.png").write_bytes((tmp_path / "imgs" / "b" / "b.png").read_bytes())
    seen = Seen(monkeypatch, tmp_path / "imgs")
    rows = resumed(raw)
    assert seen.listed == [str(tmp_path / "imgs" / p) for p in ("a", "a/y")]
    assert rows is not None and rows.classes == ["a", "b"] and rows.labels[list(rows.ids).index("a/y/new.png")] == 0
    assert_listed_as_now(rows, raw)


def test_a_file_added_behind_a_linked_folder_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The walk follows links: a linked folder's mtime is its target's."""
    make_images(tmp_path / "elsewhere", per_class=2, classes=("c",), size=40)
    settle(tmp_path / "elsewhere")
    (tmp_path / "imgs").mkdir()
    os.symlink(tmp_path / "elsewhere" / "c", tmp_path / "imgs" / "c")
    raw = folder_job(tmp_path)
    (tmp_path / "elsewhere" / "c" / "c99.png").write_bytes((tmp_path / "elsewhere" / "c" / "c01.png").read_bytes())
    seen = Seen(monkeypatch, tmp_path / "imgs")
    rows = resumed(raw)
    assert seen.listed == [str(tmp_path / "imgs" / "c")]
    assert rows is not None and "c/c99.png" in list(rows.ids)
    assert_listed_as_now(rows, raw)


def test_a_folder_modified_while_it_was_listed_is_listed_again_once(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """A file added within one tick of the folder's mtime after its listing would leave the mtime as recorded: a
    folder modified shortly before its listing is recorded unsettled, and the next resume lists it again (and
    records its mtime), the one after lists nothing."""
    monkeypatch.setattr(folder, "_UNSETTLED_NS", 10**15)  # every folder modified "shortly" before
    raw = folder_job(tmp_path)
    assert [t for _, *t in open_store(str(tmp_path / "s.zarr")).attrs["listing"]["folders"]] == [folder.UNSETTLED] * 3
    monkeypatch.setattr(folder, "_UNSETTLED_NS", 0)
    seen = Seen(monkeypatch, tmp_path / "imgs")
    assert run(parse_spec(raw)).shards_run == 0 and len(seen.listed) == 3
    assert folder.UNSETTLED not in [t for _, *t in open_store(str(tmp_path / "s.zarr")).attrs["listing"]["folders"]]
    assert run(parse_spec(raw)).shards_run == 0 and len(seen.listed) == 3


def test_a_store_that_recorded_the_tree_digest_is_listed_once_then_resumes_by_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Stores made before the folders were recorded (a digest of the tree): listed again whole, the folders
    recorded, then taken from the store."""
    raw = folder_job(tmp_path)
    listing = open_store(str(tmp_path / "s.zarr")).attrs["listing"]
    root_attrs(str(tmp_path / "s.zarr"),
               listing={k: v for k, v in listing.items() if k not in ("folders", "rows")} | {"tree": 7})
    walks = counted(monkeypatch, folder, "_list_folder")
    assert run(parse_spec(raw)).shards_run == 0 and len(walks) == 1
    assert open_store(str(tmp_path / "s.zarr")).attrs["listing"] == listing
    assert run(parse_spec(raw)).shards_run == 0 and len(walks) == 1


def test_a_tree_of_too_many_folders_records_no_listing_and_is_listed_again(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """Past _MAX_FOLDERS (a folder an image) the folders would be megabytes of the store's attributes: none
    recorded, each resume lists the tree again, as before issue 39."""
    monkeypatch.setattr(folder, "_MAX_FOLDERS", 2)
    raw = folder_job(tmp_path)
    assert "listing" not in open_store(str(tmp_path / "s.zarr")).attrs
    walks = counted(monkeypatch, folder, "_list_folder")
    assert run(parse_spec(raw)).shards_run == 0 and len(walks) == 1


def test_a_file_rewritten_in_place_beside_a_folder_listed_again_is_found(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """A folder's times moved (a file made and removed in it: the same rows), another one's file rewritten in place:
    the first is listed again, the other's rows taken from the store with their files stat-ed (by default), and the
    rewritten one found."""
    raw = folder_job(tmp_path)
    (tmp_path / "imgs" / "b" / "notes.tmp").write_text("x")
    (tmp_path / "imgs" / "b" / "notes.tmp").unlink()
    image, other = sorted((tmp_path / "imgs" / "a").iterdir())[1:3]
    image.write_bytes(other.read_bytes())  # other bytes, the same name
    seen = Seen(monkeypatch, tmp_path / "imgs")
    with pytest.raises(StoreError, match=rf"changed since .*'a/{image.name}'"):
        run(parse_spec(raw))
    assert seen.listed == [str(tmp_path / "imgs" / "b")]


def test_a_root_gone_since_is_named(tmp_path: Path):
    raw = folder_job(tmp_path)
    (tmp_path / "imgs").rename(tmp_path / "moved")
    with pytest.raises(DataError, match="does not exist"):
        run(parse_spec(raw))


@pytest.mark.parametrize("verify", ["listing", "files"])
def test_a_file_written_in_place_is_found_by_verify_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          verify: str):
    """Its folder's mtime does not move: the rows come from the store, no folder listed; with ``data.verify:
    files`` (the default) each file is stat-ed (by name, no listing) and the changed image found; with ``listing``
    it is not looked at (the documented trade, for trees too big to stat: about 4 s a million files)."""
    raw = folder_job(tmp_path, classes=("a",), verify=verify)
    image, other = sorted((tmp_path / "imgs" / "a").iterdir())[1:3]
    settled = os.stat(image.parent).st_mtime_ns
    image.write_bytes(other.read_bytes())  # other bytes, the same name
    assert os.stat(image.parent).st_mtime_ns == settled
    seen = Seen(monkeypatch, tmp_path / "imgs")
    if verify == "files":
        with pytest.raises(StoreError, match="changed since"):
            run(parse_spec(raw))
        assert len(seen.files) >= 3
    else:
        assert run(parse_spec(raw)).shards_run == 0 and seen.files == []
    assert seen.listed == []


def test_a_manifest_touched_is_listed_once_then_taken_from_the_store(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    files = make_images(tmp_path / "imgs", per_class=2, classes=("a", "b"), size=40)
    (tmp_path / "m.csv").write_text("path,label\n" + "".join(f"{f},{f.parent.name}\n" for f in files))
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=CAPTURE,
              data={"source": "manifest", "manifest": str(tmp_path / "m.csv"), "root": None, "outside_root": True,
                    "resize": None, "crop": 32, "shard_size": 2})
    assert run(parse_spec(raw)).ok == 4
    listed = counted(monkeypatch, manifest, "_list_manifest")
    raw["output"]["if_exists"] = "resume"
    assert run(parse_spec(raw)).shards_run == 0 and listed == []
    touch(tmp_path / "m.csv")
    assert run(parse_spec(raw)).shards_run == 0 and len(listed) == 1  # listed again, compared, recorded
    assert run(parse_spec(raw)).shards_run == 0 and len(listed) == 1  # the record says so


def test_a_manifest_edited_to_the_same_size_and_mtime_is_read_again(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    """An unchanged manifest: the rows from the store, each image file stat-ed once (the default data.verify:
    files); one whose rows were swapped (the same size) and its mtime put back: its digest differs, it is read
    again (and the image list differs)."""
    files = make_images(tmp_path / "imgs", per_class=2, classes=("a", "b"), size=40)
    lines = [f"{f},{f.parent.name}\n" for f in files]
    (tmp_path / "m.csv").write_text("path,label\n" + "".join(lines))
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=CAPTURE,
              data={"source": "manifest", "manifest": str(tmp_path / "m.csv"), "root": None, "outside_root": True,
                    "resize": None, "crop": 32, "shard_size": 2}, output={"if_exists": "resume"})
    assert run(parse_spec(raw)).ok == 4
    listed = counted(monkeypatch, manifest, "_list_manifest")
    seen = Seen(monkeypatch, tmp_path / "imgs")
    assert run(parse_spec(raw)).shards_run == 0 and listed == [] and sorted(seen.files) == sorted(f.name for f in files)
    was = os.stat(tmp_path / "m.csv")
    (tmp_path / "m.csv").write_text("path,label\n" + "".join([lines[1], lines[0], *lines[2:]]))
    os.utime(tmp_path / "m.csv", ns=(was.st_atime_ns, was.st_mtime_ns))
    assert os.stat(tmp_path / "m.csv").st_size == was.st_size
    with pytest.raises(StoreError, match="different job"):
        run(parse_spec(raw))
    assert len(listed) == 1


def test_parquet_files_touched_are_listed_once_then_taken_from_the_store(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("pyarrow")
    from helpers.parquet import write_hub_parquet

    import extractor.data.sources.parquet as parquet

    files = make_images(tmp_path / "imgs", per_class=2, classes=("cats", "dogs"), size=40)
    written = write_hub_parquet(sorted(files), tmp_path / "pq", per_file=2, row_group=2)
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=CAPTURE,
              data={"source": "parquet", "root": None, "parquet": str(tmp_path / "pq" / "*.parquet"),
                    "resize": None, "crop": 32, "shard_size": 2})
    assert run(parse_spec(raw)).ok == 4
    listed = counted(monkeypatch, parquet, "list_parquet")
    raw["output"]["if_exists"] = "resume"
    assert run(parse_spec(raw)).shards_run == 0 and listed == []
    touch(written[1])
    assert run(parse_spec(raw)).shards_run == 0 and len(listed) == 1
    assert run(parse_spec(raw)).shards_run == 0 and len(listed) == 1


def test_every_declared_source_is_registered_and_the_spec_offers_exactly_them():
    from typing import get_args

    from extractor.data.sources import REGISTRY, Source, source
    from extractor.spec import SOURCE_SETTINGS
    from extractor.spec.data_spec import DataSpec

    assert get_args(DataSpec.model_fields["source"].annotation) == tuple(SOURCE_SETTINGS) == tuple(REGISTRY)
    for name in SOURCE_SETTINGS:
        assert isinstance(source(name), Source) and source(name).name == name


def test_read_bytes_asks_the_source_that_reads_a_locator(tmp_path: Path):
    from extractor.data import read_bytes
    from extractor.data.sources import source

    (tmp_path / "x.bin").write_bytes(b"0123456789")
    assert read_bytes(str(tmp_path / "x.bin")) == b"0123456789"  # a file: read whole
    assert source("tar").reads((f"{tmp_path / 'x.bin'}#m", 2, 3))
    assert read_bytes((f"{tmp_path / 'x.bin'}#m", 2, 3)) == b"234"  # a byte range: the tar source's
    assert source("parquet").reads(f"{tmp_path}/f.parquet#image/3") and not source("parquet").reads("a#b.jpg")


class _Column:
    """A store's ``paths`` column, as a resume reads it back (``Recorded``)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths, self.listing = paths, {}

    def rows(self) -> list[str]:
        return self.paths

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        assert name == "paths"
        return np.asarray(self.paths[start:stop], dtype=np.dtypes.StringDType())


@pytest.mark.parametrize(("block", "by_name", "piece", "threads"),
                         [(2, True, 1024, "16"), (100_000, True, 1, "3"), (3, False, 2, "16"), (100_000, True, 1, "0")])
def test_files_now_are_each_files_own_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int,
                                                  by_name: bool, piece: int, threads: str):
    """The resume's stat of each file, by name in its open folder: the fingerprint files.local_fingerprint gives
    that path (0 where it cannot be seen), for files in several folders, a folder back again after another, one
    missing, a folder that cannot be read (searched only) and a symbolic link, across blocks of rows; stat-ed by
    threads a piece of a folder at a time (or one at a time, EXTRACTOR_STAT_THREADS=0), taken in order."""
    import extractor.data.sources as sources

    monkeypatch.setattr(sources, "STAT_PIECE", piece)
    monkeypatch.setattr(sources, "SLOW_STAT_S", 0.0)  # (threads after the first piece)
    monkeypatch.setattr(sources, "STAT_SAMPLE", 1)
    monkeypatch.setenv("EXTRACTOR_STAT_THREADS", threads)

    for d in ("a", "b", "c", "hidden"):
        (tmp_path / d).mkdir()
        for i in range(3):
            (tmp_path / d / f"{i}.jpg").write_bytes(bytes(i + len(d)))
    (tmp_path / "b" / "link.jpg").symlink_to(tmp_path / "a" / "1.jpg")
    (tmp_path / "hidden").chmod(0o311)  # no listing, a stat by path still sees its files
    paths = [str(tmp_path / p) for p in ("a/0.jpg", "a/1.jpg", "b/link.jpg", "b/0.jpg", "a/2.jpg", "c/9.jpg",
                                         "c/1.jpg", "hidden/2.jpg", "hidden/0.jpg", "c/2.jpg")]
    monkeypatch.setattr(sources, "BLOCK", block)
    monkeypatch.setattr(sources, "_BY_NAME", by_name)
    try:
        now = sources.files_now(_Column(paths))
    finally:
        (tmp_path / "hidden").chmod(0o755)
    expected = [local_fingerprint(p) for p in paths]
    assert now.tolist() == expected and expected[5] == 0 and 0 not in expected[:5] + expected[6:]


def _stats_meet(monkeypatch: pytest.MonkeyPatch, at_once: int, last: str) -> list[tuple[str, bool]]:
    """``os.stat`` of an image made to wait, in each of its first ``at_once`` calls on a thread other than the
    caller's, until all of them are in it (a barrier), and in the first of them until image ``last`` (its name) was
    stat-ed: that piece is done last. Files stat-ed one at a time on threads never get past the first (its wait
    fails). The images stat-ed, each with whether the caller's own thread stat-ed it."""
    import threading

    real, barrier, seen = os.stat, threading.Barrier(at_once, timeout=60), []  # (60 s: the failure's, not a pace)
    lock, last_done, threaded = threading.Lock(), threading.Event(), []

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        name = os.fsdecode(path)
        if not name.endswith(".jpg"):  # (a folder's times: the walk's own thread)
            return real(path, *args, **kwargs)
        inline = threading.current_thread() is threading.main_thread()
        with lock:
            seen.append((name, inline))
            if not inline:
                threaded.append(name)
            first, very_first = not inline and len(threaded) <= at_once, not inline and len(threaded) == 1
        if first:
            barrier.wait()
        if very_first:
            assert last_done.wait(60), f"{last} was not stat-ed while the first piece waited: {seen}"
        out = real(path, *args, **kwargs)
        if name.endswith(last):
            last_done.set()
        return out

    monkeypatch.setattr(os, "stat", stat)
    return seen


def _three_folders(tmp_path: Path) -> Any:
    for d in ("a", "b/c", "b/d"):
        (tmp_path / d).mkdir(parents=True)
        for i in range(5):
            (tmp_path / d / f"{d[-1]}{i}.jpg").write_bytes(bytes(i + len(d)))  # (a name each: stat-ed by name)
    return parse_spec(job(tmp_path, tmp_path / "s.zarr")).data


def test_slow_stats_go_to_threads_and_their_fingerprints_come_in_order(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """Once stats are found slow (a network file system waits for its server: 10M files one at a time took hours),
    a resume's stats (files_now) run four at a time here, their fingerprints taken in the rows' order though the
    first piece on the threads finishes last: each file's fingerprint is its own. The folder's listing stats no
    file (each row's worker fingerprints the file it reads)."""
    import extractor.data.sources as sources

    data = _three_folders(tmp_path)
    monkeypatch.setenv("EXTRACTOR_STAT_THREADS", "4")
    monkeypatch.setattr(sources, "STAT_PIECE", 2)  # pieces of 2 files: 9 pieces of 15 files
    monkeypatch.setattr(sources, "SLOW_STAT_S", 0.0)  # every stat slow: threads after the first piece, timed
    monkeypatch.setattr(sources, "STAT_SAMPLE", 1)
    with monkeypatch.context() as listing:
        seen = _stats_meet(listing, 4, "d4.jpg")
        rows = list_rows(data)
    assert seen == [] and rows.fingerprints is None and len(rows) == 15
    for last, paths in (("d4.jpg", [str(p) for p in rows.paths]), ("d0.jpg", [str(p) for p in rows.paths][::-1])):
        expected = [local_fingerprint(p) for p in paths]  # (reversed: folders interleave)
        with monkeypatch.context() as resume:
            seen = _stats_meet(resume, 4, last)  # (the first piece on the threads done after the last)
            assert sources.files_now(_Column(paths)).tolist() == expected
        assert [inline for _, inline in seen].count(True) == 2 and len(seen) == 15  # the timed piece, then threads


@pytest.mark.parametrize(("threads", "slow_s"), [("16", 1.0), ("0", 0.0)])
def test_quick_stats_stay_on_the_caller_s_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: str,
                                                 slow_s: float):
    """A local disk's stats answer at once: on threads they took twice the wall time and 2.5 times the CPU
    (contending for the GIL), so they stay on the caller's thread while quick; EXTRACTOR_STAT_THREADS=0 keeps
    them there however slow."""
    import extractor.data.sources as sources

    data = _three_folders(tmp_path)
    monkeypatch.setenv("EXTRACTOR_STAT_THREADS", threads)
    monkeypatch.setattr(sources, "STAT_PIECE", 2)
    monkeypatch.setattr(sources, "SLOW_STAT_S", slow_s)
    monkeypatch.setattr(sources, "STAT_SAMPLE", 1)
    paths = [str(p) for p in list_rows(data).paths]
    expected = [local_fingerprint(p) for p in paths]
    seen = _stats_meet(monkeypatch, 1, "d4.jpg")
    assert sources.files_now(_Column(paths)).tolist() == expected
    assert len(seen) == 15 and all(inline for _, inline in seen)


def test_a_bad_number_of_stat_threads_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import extractor.data.sources as sources

    monkeypatch.setenv("EXTRACTOR_STAT_THREADS", "many")
    with pytest.raises(DataError, match=r"EXTRACTOR_STAT_THREADS='many' is not a number of threads; set it to 0"):
        sources.files_now(_Column([str(tmp_path / "a.jpg")]))
