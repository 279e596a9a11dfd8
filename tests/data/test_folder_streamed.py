"""A local folder listed behind the job's start (issue 57): its images counted by name first (a walk that stats no
file), the store made, then the folders walked again on a thread, each one's files stat-ed (on threads where stats
are slow: a network file system) and its rows handed out as they come, while the first shards run. Each test holds
the second walk at a folder; what is handed out and stored equals a listing made whole."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import job
from helpers.stores import opened
from helpers.streamed import WAIT_S, Held, held_at, same_rows

import extractor.data.sources as sources
import extractor.data.sources.folder as folder
import extractor.store.layout as layout
from extractor.data.files import local_fingerprint
from extractor.data.listing import list_rows, stream_rows
from extractor.data.streamed import Streamed
from extractor.driver.runner import run
from extractor.errors import CountError, DataError
from extractor.read.reader import open_store
from extractor.spec.data_spec import DataSpec
from extractor.spec.load import parse_spec


def _tree(root: Path) -> int:
    """Class folders with sub-folders, an image in the root, files that are not images (a FIFO named .jpg too), a
    hidden file and folder, a name that is not UTF-8: its folders."""
    for c in ("cat", "dog", "yak"):
        for sub in ("", "a", "a/deep", "b"):
            (root / c / sub).mkdir(parents=True, exist_ok=True)
            for i in range(4 if sub else 3):
                (root / c / sub / f"{i}.jpg").write_bytes(bytes(i + 1))
    (root / "r.jpg").write_bytes(b"r")
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "dog" / ".hidden.jpg").write_bytes(b"h")
    (root / ".git").mkdir()
    (root / ".git" / "x.jpg").write_bytes(b"g")
    (root / "yak" / "empty").mkdir()
    os.mkfifo(root / "dog" / "a" / "fifo.jpg")  # (no image: its read waited forever)
    with open(bytes(root / "yak" / "b") + b"/\xff.jpg", "wb") as f:  # a name that is not UTF-8
        f.write(b"odd")
    return 1 + 3 * 4 + 1  # the root; each class's own, a, a/deep and b; yak/empty


def _hold(monkeypatch: pytest.MonkeyPatch, folders: int, nth: int) -> Held:
    """The streamed walk waits before it lists its folder ``nth`` (from 0; the count walked ``folders`` first)."""
    return held_at(monkeypatch, folder, "_entries", folders + nth)


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("classes", [None, ("yak", "eel", "cat", "dog")])
def test_a_streamed_folder_gives_the_rows_of_a_whole_listing_prefix_by_prefix(tmp_path: Path, threads: bool,
                                                                              classes: tuple[str, ...] | None):
    """While the walk is held at a folder, the rows handed out are the whole listing's first rows (ids, paths,
    labels as the folders' classes or data.classes' indices; no fingerprints: no file is stat-ed), whatever the
    stat threads' settings; the whole equals list_rows', its classes and its record of the folders walked too."""
    folders = _tree(tmp_path / "images")
    data = DataSpec(source="folder", root=str(tmp_path / "images"), classes=classes)
    want = list_rows(data)
    assert len(want) == 1 + 3 * 15 + 1 == 47 and want.listing is not None and len(want.listing["folders"]) == folders
    with pytest.MonkeyPatch.context() as patch:
        if threads:  # every stat taken for slow: threads after the first file
            patch.setattr(sources, "SLOW_STAT_S", 0.0)
            patch.setattr(sources, "STAT_SAMPLE", 1)
            patch.setattr(sources, "STAT_PIECE", 2)
        release = _hold(patch, folders, 9)
        streamed = stream_rows(data)
        assert isinstance(streamed, Streamed) and len(streamed) == len(want)
        assert streamed.classes == want.classes == list(classes or ("cat", "dog", "yak"))
        assert release.reached.wait(WAIT_S)
        listed = streamed.listed
        assert 0 < listed < len(want)
        prefix = streamed.upto(listed)
        assert len(prefix) == len(prefix.paths) == len(prefix.labels) == listed and prefix.fingerprints is None
        same_rows(prefix, want, listed)
        release.set()
        whole = streamed.whole()
    same_rows(whole, want, len(want))
    assert whole.classes == want.classes and whole.listing == want.listing
    assert want.labels[0] == -1 and sorted(set(want.labels.tolist())) == [-1, *sorted(
        want.classes.index(c) for c in ("cat", "dog", "yak"))]


def test_a_folder_that_changes_between_its_count_and_its_walk_stops_the_listing(tmp_path: Path):
    """An image added after the count (the store is made for the rows counted), a class folder added, a folder
    removed: the listing stops at its end naming the folder (a CountError: the CLI says --overwrite); nothing that
    streamed is taken for the whole."""
    folders = _tree(tmp_path / "images")
    data = DataSpec(source="folder", root=str(tmp_path / "images"))
    with pytest.MonkeyPatch.context() as patch:
        release = _hold(patch, folders, 1)
        streamed = stream_rows(data)
        assert isinstance(streamed, Streamed) and release.reached.wait(WAIT_S)
        (tmp_path / "images" / "yak" / "b" / "9.jpg").write_bytes(b"new")
        release.set()
        with pytest.raises(CountError, match=r"data.root \S+images changed while it was listed: folder 'yak/b' held 5 "
                                             r"images when they were counted, 6 now"):
            streamed.whole()
    with pytest.MonkeyPatch.context() as patch:
        release = _hold(patch, folders, 0)  # (before the root is listed: its new folder is walked)
        streamed = stream_rows(data)
        assert isinstance(streamed, Streamed) and release.reached.wait(WAIT_S)
        (tmp_path / "images" / "zebu").mkdir()
        (tmp_path / "images" / "zebu" / "0.jpg").write_bytes(b"z")
        release.set()
        with pytest.raises(CountError, match=r"changed while it was listed: folder 'zebu' is there now, not when its "
                                             r"images were counted"):
            streamed.whole()
    with pytest.MonkeyPatch.context() as patch:
        release = _hold(patch, folders + 1, 0)
        streamed = stream_rows(data)
        assert isinstance(streamed, Streamed) and release.reached.wait(WAIT_S)
        for name in os.listdir(tmp_path / "images" / "cat" / "a" / "deep"):
            os.remove(tmp_path / "images" / "cat" / "a" / "deep" / name)
        os.rmdir(tmp_path / "images" / "cat" / "a" / "deep")
        release.set()
        with pytest.raises(CountError, match=r"changed while it was listed: folder 'cat/a/deep' was there when its "
                                             r"images were counted, and is gone now"):
            streamed.whole()


def test_folders_whose_classes_are_not_named_or_that_hold_no_image_are_listed_whole(tmp_path: Path):
    """A class folder that data.classes does not name (the whole listing says which), a folder of no image, a root
    that is no folder, a remote folder: no stream."""
    _tree(tmp_path / "images")
    data = DataSpec(source="folder", root=str(tmp_path / "images"), classes=("cat", "dog"))
    assert stream_rows(data) is None
    with pytest.raises(DataError, match=r"labels 'yak' are not in data.classes \(2 names\)"):
        list_rows(data)
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "a.txt").write_text("x")
    assert stream_rows(DataSpec(source="folder", root=str(tmp_path / "none"))) is None
    assert stream_rows(DataSpec(source="folder", root=str(tmp_path / "missing"))) is None
    assert stream_rows(DataSpec(source="folder", root="memory://images")) is None


def test_a_job_runs_its_first_shards_while_its_folder_is_walked(image_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch):
    """The folder's last class folder is walked only once shard 0 is done; the store then holds what a listing
    made whole gives (ids, paths, labels, classes, its record of the folders; each file's fingerprint as read) and
    the features of the same job listed whole first."""
    folders = len([p for p in image_dir.rglob("*") if p.is_dir()]) + 1
    assert folders == 3  # the root and two class folders: the last is walked after shard 0
    monkeypatch.setattr(layout, "WRITE_ROWS", 2)  # a stretch a shard: a store of a few rows written behind
    monkeypatch.setattr(layout, "ONCE_ROWS", 2)
    release = _hold(monkeypatch, folders, 2)

    def on_event(name: str, info: dict) -> None:
        if name == "shard_done":
            release.set()

    data = {"shard_size": 2, "batch_size": 2}
    summary = run(parse_spec(job(image_dir, tmp_path / "s.zarr", data=data)), on_event=on_event)
    assert summary.ok == 12 and release.is_set()
    monkeypatch.undo()
    want = list_rows(DataSpec(source="folder", root=str(image_dir)))
    s = open_store(str(tmp_path / "s.zarr"))
    got = s.attrs["listing"]
    assert s.attrs["status"] == "complete" and want.listing is not None
    assert {**got, "folders": None} == {**want.listing, "folders": None}  # (a folder's times: unsettled, listed
    assert all(f[0] == w[0] and f[1:] in (w[1:], folder.UNSETTLED)  # within 2 s of its change, or as now)
               for f, w in zip(got["folders"], want.listing["folders"], strict=True))
    assert s.ids.tolist() == want.ids.tolist() and [str(p) for p in s.paths] == want.paths.tolist()
    assert s.labels.tolist() == want.labels.tolist() and s.classes == want.classes and len(want.classes) == 2
    g = opened(str(tmp_path / "s.zarr"))  # no file stat-ed by the listing: each fingerprinted as its worker read it
    assert want.fingerprints is None and not g["fingerprint"][:].any()
    assert g["read_fingerprint"][:].tolist() == [local_fingerprint(p) for p in want.paths.tolist()]
    monkeypatch.setattr(folder.FolderSource, "stream", lambda self, data, then: None)
    assert run(parse_spec(job(image_dir, tmp_path / "w.zarr", data=data))).ok == 12
    np.testing.assert_array_equal(s.numpy("layer4"), open_store(str(tmp_path / "w.zarr")).numpy("layer4"))


def test_a_stopped_job_stops_its_folder_listing_before_its_next_folder(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """A job stopped (Ctrl-C) while its folder is walked: the listing stops before its next folder (no file is
    stat-ed: a folder's listing is one read of its names)."""
    for c in ("a", "b", "c", "d"):
        (tmp_path / "images" / c).mkdir(parents=True)
        for i in range(2):
            (tmp_path / "images" / c / f"{i:02d}.jpg").write_bytes(b"x")
    calls = [0]
    real = folder._entries

    def counted(*args: object) -> object:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(folder, "_entries", counted)
    release = held_at(monkeypatch, folder, "_entries", 5 + 2)  # (the count's 5 folders, then the walk's third)
    streamed = stream_rows(DataSpec(source="folder", root=str(tmp_path / "images")))
    assert isinstance(streamed, Streamed) and release.reached.wait(WAIT_S)
    streamed.stop()
    release.set()
    with pytest.raises(DataError, match=r"the listing stopped: its job stopped"):
        streamed.whole()
    streamed._thread.join(WAIT_S)  # (the listing's own end: what it listed after the stop)
    assert not streamed._thread.is_alive() and calls[0] == 5 + 3  # (the folder it was listing, not the other 2)


def test_a_name_that_is_not_utf8_and_one_written_as_it_is_shown_are_refused(tmp_path: Path):
    """An id shows a name that is not UTF-8 with its bytes as \\xNN; a file named so too made two rows of one id
    (``row(id)`` found the first). Both listings refuse it, naming the id and the rows."""
    (tmp_path / "images" / "cat").mkdir(parents=True)
    with open(bytes(tmp_path / "images" / "cat") + b"/\xff.jpg", "wb") as f:
        f.write(b"odd")
    (tmp_path / "images" / "cat" / "\\xff.jpg").write_bytes(b"plain")
    (tmp_path / "images" / "cat" / "ok.jpg").write_bytes(b"ok")
    data = DataSpec(source="folder", root=str(tmp_path / "images"))
    said = r"'cat/\\\\xff.jpg' names two images: a name that is not UTF-8 \(its bytes shown as \\xNN\) and one " \
        r"written so \(rows 1 and 3\); rename one of them"
    with pytest.raises(DataError, match=said):
        list_rows(data)
    streamed = stream_rows(data)
    assert isinstance(streamed, Streamed)
    with pytest.raises(DataError, match=said):
        streamed.whole()
