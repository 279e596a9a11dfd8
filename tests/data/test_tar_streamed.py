"""WebDataset tars listed behind the job's start (issue 57) where img2dataset's stats file beside each tar counts
its samples with an image (``NAME_stats.json``: ``successes``): the store made with that count, the tars listed on
a thread and their rows written as they come, the first shards run meanwhile. Each test holds the listing at a tar
until a shard is done (or a prefix is read), which a listing made whole first never lets happen (the wait's bound
fails it); what is stored equals a listing made whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.jobs import job
from helpers.parquet import images_of
from helpers.sources import write_tars
from helpers.stores import opened
from helpers.streamed import WAIT_S, Held, held_at, same_rows

import extractor.data.sources.tar as tar
import extractor.store.layout as layout
from extractor.cli.run import _stopped
from extractor.data.listing import list_rows, stream_rows
from extractor.data.streamed import Streamed
from extractor.driver.runner import run
from extractor.errors import CountError, DataError, RemakeError, StoreError
from extractor.read.reader import open_store
from extractor.spec.data_spec import DataSpec
from extractor.spec.load import parse_spec


def _hold(monkeypatch: pytest.MonkeyPatch, nth: int) -> Held:
    """The listing waits before it scans its tar ``nth`` (from 0: the first, scanned before the stream starts)
    until the event returned is set."""
    return held_at(monkeypatch, tar, "scan_tar", nth)


def _tars(image_dir: Path, out: Path, labels: dict[str, object] | None, counts: list[int] | None = None) -> str:
    """Tars of 4 images each with img2dataset's stats files (``counts``: what they say; else the truth); their
    pattern."""
    paths = write_tars(images_of(image_dir), out, per_tar=4, labels=labels)
    for t, path in enumerate(paths):
        n = counts[t] if counts is not None else 4
        (out / f"{path.stem}_stats.json").write_text(json.dumps({"count": n + 1, "successes": n,
                                                                 "failed_to_download": 1, "failed_to_resize": 0}))
    return str(out / "shard-*.tar")


def _same(got: Any, want: Any, n: int) -> None:
    same_rows(got, want, n, (tar.OFFSET, tar.SIZE))


@pytest.mark.parametrize("kind", ["none", "indices", "names"])
def test_streamed_tars_give_the_rows_of_a_whole_listing_prefix_by_prefix(image_dir: Path, tmp_path: Path,
                                                                          kind: str):
    """No labels, class indices (.cls), names of data.classes: each prefix handed out while the listing is held
    holds the whole listing's first rows, and the whole equals list_rows' (its listing record too)."""
    folders = sorted({p.parent.name for p in images_of(image_dir)})
    labels = None if kind == "none" else {f: (i if kind == "indices" else f"c{i}") for i, f in enumerate(folders)}
    classes = tuple(f"c{i}" for i in range(len(folders))) if kind == "names" else None
    data = DataSpec(source="tar", tars=_tars(image_dir, tmp_path / "tars", labels), classes=classes)
    want = list_rows(data)
    with pytest.MonkeyPatch.context() as patch:
        release = _hold(patch, 2)
        streamed = stream_rows(data)
        assert isinstance(streamed, Streamed) and len(streamed) == 12 and streamed.classes == list(classes or [])
        assert release.reached.wait(WAIT_S)
        prefix = streamed.upto(4)
        assert 4 <= len(prefix) < 12
        _same(prefix, want, len(prefix))
        release.set()
        whole = streamed.whole()
    _same(whole, want, 12)
    assert whole.classes == want.classes and whole.listing == want.listing is not None
    assert want.labels.tolist() == ([-1] * 12 if kind == "none" else
                                    [folders.index(p.parent.name) for p in images_of(image_dir)])


def test_tars_without_stats_or_whose_first_disagrees_are_listed_whole(image_dir: Path, tmp_path: Path):
    """No stats file beside a tar, a first tar that holds another count than its file says (data.extensions that
    leave some out), labels that are names without data.classes (numbered once all are read), data.classes with a
    name that reads as a number: no stream, and the listing made whole is what it was."""
    folders = sorted({p.parent.name for p in images_of(image_dir)})
    pattern = _tars(image_dir, tmp_path / "a", None)
    (tmp_path / "a" / "shard-001_stats.json").unlink()
    assert stream_rows(DataSpec(source="tar", tars=pattern)) is None
    pattern = _tars(image_dir, tmp_path / "b", None, counts=[3, 4, 4])
    assert stream_rows(DataSpec(source="tar", tars=pattern)) is None
    assert len(list_rows(DataSpec(source="tar", tars=pattern))) == 12
    pattern = _tars(image_dir, tmp_path / "c", {f: f"c{i}" for i, f in enumerate(folders)})
    assert stream_rows(DataSpec(source="tar", tars=pattern)) is None
    assert stream_rows(DataSpec(source="tar", tars=pattern, classes=("c0", "7", "c1", "c2"))) is None
    assert list_rows(DataSpec(source="tar", tars=pattern)).classes == [f"c{i}" for i in range(len(folders))]


def test_a_later_tar_that_disagrees_stops_the_listing_naming_it(image_dir: Path, tmp_path: Path):
    """A later tar that holds another count than its stats file says, or a label name where data.classes is not
    given (the first tar's labels were class indices): the listing stops at that tar, naming it and the fix, its
    first rows handed out."""
    folders = sorted({p.parent.name for p in images_of(image_dir)})
    pattern = _tars(image_dir, tmp_path / "a", None, counts=[4, 4, 5])
    streamed = stream_rows(DataSpec(source="tar", tars=pattern))
    assert streamed is not None and len(streamed) == 13
    with pytest.raises(DataError, match=r"shard-002.tar holds 4 samples with an image of data.extensions .*, but "
                                        r"its _stats.json counts 5; fix or remove the stats files"):
        streamed.whole()
    images = images_of(image_dir)
    labels: dict[str, object] = {f: i for i, f in enumerate(folders)}
    labels[images[-1].parent.name] = "emu"
    first = next(i for i, p in enumerate(images) if p.parent.name == images[-1].parent.name)
    assert first >= 4  # (in a later tar than the first)
    pattern = _tars(image_dir, tmp_path / "b", labels)
    streamed = stream_rows(DataSpec(source="tar", tars=pattern))
    assert streamed is not None
    with pytest.raises(DataError, match=rf"shard-00{first // 4}.tar, sample '{images[first].parent.name}/"
                                        rf"{images[first].stem}': label 'emu' is a class name, .* list the classes' "
                                        r"names in data.classes"):
        streamed.whole()


def test_a_job_whose_later_tar_disagrees_says_to_make_its_store_again(image_dir: Path, tmp_path: Path):
    """The store was made for the rows the stats files count: a later tar that holds another number stops the job,
    and the command it says to run once the stats are fixed is --overwrite (no resume can finish that store); it
    then completes."""
    pattern = _tars(image_dir, tmp_path / "tars", None, counts=[4, 4, 5])
    spec = job(image_dir, tmp_path / "t.zarr", data={"source": "tar", "tars": pattern, "shard_size": 4,
                                                     "batch_size": 4})
    with pytest.raises(CountError, match=r"its _stats\.json counts 5") as failed:
        run(parse_spec(spec))
    said = _stopped(failed.value, "extractor run job.yaml --resume", ["run", "job.yaml", "--resume"], None)
    assert "--overwrite makes it again" in said and "run the job again with:" in said
    assert said.endswith("run job.yaml --overwrite") and "--resume" not in said
    for again in (lambda: run(parse_spec(spec)), lambda: open_store(str(tmp_path / "t.zarr"))):  # (run, inspect)
        with pytest.raises(StoreError) as left:  # the half-made store says the same, not --resume
            again()
        assert "left half-created by a run whose listing stopped it (tar shard " in str(left.value)
        assert str(left.value).endswith("the store was made for the rows counted first: once fixed, run the job "
                                         "again with --overwrite") and "--resume" not in str(left.value)
    (tmp_path / "tars" / "shard-002_stats.json").write_text(json.dumps({"successes": 4}))
    spec["output"]["if_exists"] = "overwrite"
    assert run(parse_spec(spec)).ok == 12


def test_a_job_whose_later_tar_holds_a_class_name_says_to_make_its_store_again(image_dir: Path, tmp_path: Path):
    """Labels taken as class indices as the tars came (data.classes not given), then a name: the job stops at its
    sample, and the command it says to run once data.classes lists the classes is --overwrite (a resume with
    another data.classes is refused: the store was made without it); that run completes."""
    images = images_of(image_dir)
    folders = sorted({p.parent.name for p in images})
    labels: dict[str, object] = {f: i for i, f in enumerate(folders)}
    labels[images[-1].parent.name] = "emu"
    spec = job(image_dir, tmp_path / "t.zarr", data={"source": "tar", "tars": _tars(image_dir, tmp_path / "tars",
                                                                                    labels), "shard_size": 4,
                                                     "batch_size": 4})
    with pytest.raises(RemakeError, match=r"label 'emu' is a class name") as failed:
        run(parse_spec(spec))
    said = _stopped(failed.value, "extractor run job.yaml --resume", ["run", "job.yaml", "--resume"], None)
    assert "The store was made for labels taken as class indices (data.classes not given): once fixed, --overwrite " \
        "makes it again" in said and said.endswith("run job.yaml --overwrite") and "--resume" not in said
    assert folders[0] != images[-1].parent.name  # (the first folder's label 0, the last's "emu")
    spec["data"]["classes"] = ["0", "emu"]
    spec["output"]["if_exists"] = "overwrite"
    assert run(parse_spec(spec)).ok == 12


def test_a_job_runs_its_first_shards_while_its_tars_are_listed(image_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    """The last tar is scanned only once shard 0 is done; the store then holds what a listing made whole gives (ids,
    paths, labels, fingerprints, byte ranges, the listing's record) and the folder's store's features."""
    pattern = _tars(image_dir, tmp_path / "tars", None)
    monkeypatch.setattr(layout, "WRITE_ROWS", 2)  # a stretch a shard: a store of a few rows written behind
    monkeypatch.setattr(layout, "ONCE_ROWS", 2)
    release = _hold(monkeypatch, 2)

    def on_event(name: str, info: dict) -> None:
        if name == "shard_done":
            release.set()

    data = {"source": "tar", "tars": pattern, "shard_size": 2, "batch_size": 2}
    summary = run(parse_spec(job(image_dir, tmp_path / "t.zarr", data=data)), on_event=on_event)
    assert summary.ok == 12 and release.is_set()
    monkeypatch.undo()
    want = list_rows(DataSpec(source="tar", tars=pattern))
    s = open_store(str(tmp_path / "t.zarr"))
    assert s.attrs["status"] == "complete" and s.attrs["listing"] == want.listing is not None
    assert s.ids.tolist() == want.ids.tolist() and [str(p) for p in s.paths] == want.paths.tolist()
    assert s.labels.tolist() == want.labels.tolist() == [-1] * 12
    group = opened(str(tmp_path / "t.zarr"))
    assert group["fingerprint"][:].tolist() == want.fingerprints.tolist()
    assert group[tar.OFFSET][:].tolist() == want.locators[tar.OFFSET].tolist()
    assert run(parse_spec(job(image_dir, tmp_path / "f.zarr", data={"shard_size": 2, "batch_size": 2}))).ok == 12
    np.testing.assert_array_equal(s.numpy("layer4"), open_store(str(tmp_path / "f.zarr")).numpy("layer4"))
