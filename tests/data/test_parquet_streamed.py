"""A Parquet listing streamed into a new store (issue 57): the rows counted from the files' footers, the store made,
the rows listed on a thread and written as they come, the first shards run meanwhile. Each test holds the listing
at its last file until a shard is done, which a listing made whole first never lets happen (the wait's bound fails
it); what is stored equals a listing made whole."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.jobs import job
from helpers.parquet import images_of, parquet_job, write_hub_parquet
from helpers.stores import opened

import extractor.data.sources.parquet as parquet
import extractor.store.layout as layout
from extractor.cli.run import _left
from extractor.data.listing import list_rows, stream_rows
from extractor.data.streamed import Streamed
from extractor.driver.runner import run
from extractor.errors import DataError, StoreError
from extractor.read.reader import open_store
from extractor.spec.data_spec import DataSpec
from extractor.spec.load import parse_spec
from extractor.store import read_state
from extractor.store.layout import NamesDigest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

WAIT_S = 120  # a bound on waiting for an event, never a pause


def _same(got: Any, want: Any, n: int) -> None:
    """Rows ``0:n`` of two listings hold the same ids, paths, labels and fingerprints."""
    assert np.asarray(got.ids[0:n]).tolist() == np.asarray(want.ids[0:n]).tolist()
    assert np.asarray(got.paths[0:n]).tolist() == np.asarray(want.paths[0:n]).tolist()
    assert np.asarray(got.labels[:n]).tolist() == np.asarray(want.labels[:n]).tolist()
    assert np.asarray(got.fingerprints[:n]).tolist() == np.asarray(want.fingerprints[:n]).tolist()


def test_a_streamed_listing_gives_the_rows_of_a_whole_one_prefix_by_prefix(tmp_path: Path):
    """Files of several sizes (one empty), integer labels with nulls, ids made from file and row until a file with
    an id column: each prefix handed out holds the whole listing's first rows, and the whole equals list_rows'."""
    files = {"a.parquet": {"label": pa.array([3, None, 1], pa.int32())},
             "b.parquet": {"label": pa.array([], pa.int32())},
             "bb.parquet": {"label": pa.array([None, 5], pa.uint16())},
             "c.parquet": {"label": pa.array([0, 2, None, 2, 1], pa.int64())},
             "d.parquet": {"id": pa.array(["x", "", None, "y"]), "label": pa.array([1, 1, 0, 7], pa.int8())}}
    for name, columns in files.items():
        n = len(next(iter(columns.values())))
        pq.write_table(pa.table({"image": pa.array([b"x"] * n, pa.binary()), **columns}), tmp_path / name)
    data = DataSpec(source="parquet", parquet=str(tmp_path / "*.parquet"))
    want = list_rows(data)
    for held in ("c.parquet", "d.parquet"):  # the ids of the prefixes: files and rows; then texts, from d's on
        with pytest.MonkeyPatch.context() as patch:
            release = _hold(patch, held)
            streamed = stream_rows(data)
            assert isinstance(streamed, Streamed) and len(streamed) == 14 and streamed.classes == []
            before = 5 if held == "c.parquet" else 10  # rows of the files before the one held
            for stop in (1, 3, before):
                prefix = streamed.upto(stop)
                assert stop <= len(prefix) <= before and prefix.listing is None  # (the listing held: a part)
                _same(prefix, want, len(prefix))
            release.set()
            for stop in (before + 1, 14):
                _same(streamed.upto(stop), want, stop)
            whole = streamed.whole()
            _same(whole, want, 14)
            assert whole.classes == want.classes and whole.listing == want.listing is not None
    assert want.ids.tolist()[:4] == ["a/0", "a/1", "a/2", "bb/0"] and want.ids.tolist()[10:] == ["x", "d/1", "d/2", "y"]
    assert want.labels.tolist() == [3, -1, 1, -1, 5, 0, 2, -1, 2, 1, 1, 1, 0, 7]  # (the reference: the files' values)


def test_sources_whose_rows_cannot_be_counted_first_are_listed_whole(image_dir: Path, tmp_path: Path):
    """String labels (their classes are known once all are read), an Arrow file, ClassLabel names that data.classes
    renumbers, a remote folder: no stream. A ClassLabel's names, or data.classes of integer labels, are the stream's
    classes from the start; a label beyond data.classes stops it at its end."""
    pq.write_table(pa.table({"image": [b"x"] * 2, "label": ["cat", "dog"]}), tmp_path / "s.parquet")
    assert stream_rows(DataSpec(source="parquet", parquet=str(tmp_path / "s.parquet"))) is None
    table = pa.table({"image": [b"x"] * 2})
    with pa.ipc.new_stream(str(tmp_path / "a.arrow"), table.schema) as stream:
        stream.write_table(table)
    assert stream_rows(DataSpec(source="parquet", parquet=str(tmp_path / "a.arrow"))) is None
    assert stream_rows(DataSpec(source="folder", root="memory://images")) is None  # (a remote folder: one request)
    paths = write_hub_parquet(images_of(image_dir), tmp_path / "hub", per_file=5, row_group=5)
    hub = stream_rows(DataSpec(source="parquet", parquet=[str(p) for p in paths]))
    assert hub is not None and hub.classes == ["cats", "dogs"] == hub.whole().classes
    assert stream_rows(DataSpec(source="parquet", parquet=[str(p) for p in paths], classes=("dogs", "cats"))) is None
    plain = write_hub_parquet(images_of(image_dir), tmp_path / "plain", per_file=5, row_group=5, names=False)
    named = stream_rows(DataSpec(source="parquet", parquet=[str(p) for p in plain], classes=("c", "d")))
    assert named is not None and named.classes == ["c", "d"] == named.whole().classes
    beyond = stream_rows(DataSpec(source="parquet", parquet=[str(p) for p in plain], classes=("c",)))
    assert beyond is not None
    with pytest.raises(DataError, match=r"has label 1, but data.classes names 1 classes"):
        beyond.whole()


class _Held(threading.Event):
    timed_out = False  # the wait's bound was reached: whoever should have released it never did


def _hold(monkeypatch: pytest.MonkeyPatch, last: str, fail: BaseException | None = None) -> _Held:
    """The listing waits before it scans the file ``last`` until the event returned is set (then ``fail`` raised
    there, where given: a file found unreadable)."""
    release, scan = _Held(), parquet._scan

    def held(url: str, cols: Any, storage: Any) -> Any:
        if url.endswith(last):
            release.timed_out = not release.wait(WAIT_S)
            assert not release.timed_out, "the listing was never released: no shard ran while it listed"
            if fail is not None:
                raise fail
        return scan(url, cols, storage)

    monkeypatch.setattr(parquet, "_scan", held)
    return release


def _hold_last_file(monkeypatch: pytest.MonkeyPatch, last: str, fail: BaseException | None = None) -> _Held:
    """:func:`_hold` in a job whose store's rows are written behind it a shard at a time."""
    monkeypatch.setattr(layout, "WRITE_ROWS", 2)  # a stretch a shard: a store of a few rows written behind
    monkeypatch.setattr(layout, "ONCE_ROWS", 2)
    return _hold(monkeypatch, last, fail)


def test_the_first_shards_run_while_the_files_are_listed(image_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch):
    """The last of three files is listed only once shard 0 is done; the store then holds what a listing made whole
    gives (ids, paths, labels, fingerprints, classes, digests, the listing's record, the id index) and the same
    features as the folder's store."""
    paths = write_hub_parquet(images_of(image_dir), tmp_path / "data", per_file=5, row_group=2)
    release = _hold_last_file(monkeypatch, paths[-1].name)
    pattern = str(tmp_path / "data" / "train-*.parquet")

    def on_event(name: str, info: dict) -> None:
        if name == "shard_done":
            release.set()

    summary = run(parse_spec(parquet_job(image_dir, tmp_path / "p.zarr", pattern, shard_size=2, batch_size=2)),
                  on_event=on_event)
    assert summary.ok == 12 and release.is_set()
    monkeypatch.undo()
    want = list_rows(DataSpec(source="parquet", parquet=pattern))
    s = open_store(str(tmp_path / "p.zarr"))
    assert s.attrs["status"] == "complete" and s.attrs["rows_written"] is True
    assert s.ids.tolist() == want.ids.tolist() and [str(p) for p in s.paths] == want.paths.tolist()
    assert s.labels.tolist() == want.labels.tolist() and s.classes == want.classes == ["cats", "dogs"]
    assert s.attrs["listing"] == want.listing and s.attrs["ids_digest"] == NamesDigest.of(want.ids)
    assert s.attrs["paths_digest"] == NamesDigest.of(want.paths)
    assert opened(str(tmp_path / "p.zarr"))["fingerprint"][:].tolist() == want.fingerprints.tolist()
    assert [s.row(i)["row"] for i in reversed(want.ids.tolist())] == list(range(11, -1, -1))
    assert run(parse_spec(job(image_dir, tmp_path / "f.zarr", data={"shard_size": 2, "batch_size": 2}))).ok == 12
    np.testing.assert_array_equal(s.numpy("layer4"), open_store(str(tmp_path / "f.zarr")).numpy("layer4"))
    spec = parquet_job(image_dir, tmp_path / "p.zarr", pattern, shard_size=2, batch_size=2)
    spec["output"]["if_exists"] = "resume"
    taken = []
    monkeypatch.setattr(parquet, "list_parquet", lambda *a: taken.append(a))  # (a listing again: refused)
    again = run(parse_spec(spec))
    assert again.shards_run == 0 and again.ok == 12 and not taken  # the listing recorded at the end: taken


def test_a_duplicate_id_found_at_the_listings_end_stops_the_job_and_its_resume(image_dir: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    """An id in the last file that an earlier file holds: found once every row is listed (shard 0 done by then), the
    job stops naming both rows, its store left half-made, and `extractor run` says to fix the data and resume; the
    resume lists whole first and refuses it so until the id is fixed, then keeps the shards committed before."""
    for name, ids in (("a.parquet", ["p", "q", "r", "t"]), ("b.parquet", ["s", "q"])):
        pq.write_table(pa.table({"image": [p.read_bytes() for p in images_of(image_dir)[:len(ids)]], "id": ids}),
                       tmp_path / name)
    release = _hold_last_file(monkeypatch, "b.parquet")
    spec = parquet_job(image_dir, tmp_path / "s.zarr", str(tmp_path / "*.parquet"), shard_size=2, batch_size=2)
    done: list[int] = []

    def on_event(name: str, info: dict) -> None:
        if name == "shard_done":
            done.append(info["shard"])
            release.set()

    twice = r"id 'q' appears twice: .*a.parquet row 1 and .*b.parquet row 1; ids must be unique"
    with pytest.raises(DataError, match=twice) as failed:
        run(parse_spec(spec), on_event=on_event)
    assert done and (read_state(str(tmp_path / "s.zarr")) or {})["status"] == "creating"
    assert "once the data is fixed in place (the same rows), --resume" in _left(failed.value, "error")  # (the CLI)
    spec["output"]["if_exists"] = "resume"
    with pytest.raises(DataError, match=twice):
        run(parse_spec(spec))
    monkeypatch.undo()
    pq.write_table(pa.table({"image": [p.read_bytes() for p in images_of(image_dir)[:2]], "id": ["s", "u"]}),
                   tmp_path / "b.parquet")  # the data fixed: the resume keeps what was committed
    if 2 in done:  # (computed between the last file's rows and their check: its ids changed, said so)
        with pytest.raises(StoreError, match=r"(?s)row 5, computed before: 'q' in the store, 'u' now.*--overwrite"):
            run(parse_spec(spec))
        return
    again = run(parse_spec(spec))
    assert again.ok == 6 and again.shards_run == 3 - len(done)
    assert open_store(str(tmp_path / "s.zarr")).ids.tolist() == ["p", "q", "r", "t", "s", "u"]


def test_a_job_stopped_while_its_files_are_listed_stops_the_listing(image_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    """Ctrl-C while the listing waits on its last file: the job stops at once (its writer of rows waits for no
    listing), the store half-made; the resume lists whole and completes it."""
    paths = write_hub_parquet(images_of(image_dir), tmp_path / "data", per_file=5, row_group=5)
    release = _hold_last_file(monkeypatch, paths[-1].name)
    spec = parquet_job(image_dir, tmp_path / "s.zarr", str(tmp_path / "data" / "*.parquet"), shard_size=2,
                       batch_size=2)

    def on_event(name: str, info: dict) -> None:
        if name == "shard_done":
            raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            run(parse_spec(spec), on_event=on_event)
        assert not release.is_set()  # (stopped while the listing was held)
    finally:
        release.set()
    assert (read_state(str(tmp_path / "s.zarr")) or {})["status"] == "creating"
    spec["output"]["if_exists"] = "resume"
    assert run(parse_spec(spec)).ok == 12
    s = open_store(str(tmp_path / "s.zarr"))
    want = list_rows(DataSpec(source="parquet", parquet=[str(p) for p in paths]))
    assert s.ids.tolist() == want.ids.tolist() and s.labels.tolist() == want.labels.tolist()


def test_a_file_found_unreadable_as_it_is_listed_stops_the_job_and_the_resume_keeps_its_shards(
        image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The last file's footer read, its rows not (its storage failed meanwhile): the job stops with the listing's
    one line once shard 0 is done, the store half-made; the resume, the file readable again, computes only the
    shards not committed and stores what a listing made whole gives."""
    paths = write_hub_parquet(images_of(image_dir), tmp_path / "data", per_file=5, row_group=5)
    gone = DataError(f"{paths[-1]} is not a readable Parquet file (OSError: the storage went away)")
    release = _hold_last_file(monkeypatch, paths[-1].name, fail=gone)
    spec = parquet_job(image_dir, tmp_path / "s.zarr", str(tmp_path / "data" / "*.parquet"), shard_size=2,
                       batch_size=2)
    done: list[int] = []

    def on_event(name: str, info: dict) -> None:
        if name == "shard_done":
            done.append(info["shard"])
            release.set()

    with pytest.raises(DataError, match=r"train-00002-of-00003.parquet is not a readable Parquet file"):
        run(parse_spec(spec), on_event=on_event)
    assert done and (read_state(str(tmp_path / "s.zarr")) or {})["status"] == "creating"
    monkeypatch.undo()
    spec["output"]["if_exists"] = "resume"
    again = run(parse_spec(spec))
    assert again.ok == 12 and again.shards_run == 6 - len(done)  # the shards committed before are kept
    want = list_rows(DataSpec(source="parquet", parquet=[str(p) for p in paths]))
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.ids.tolist() == want.ids.tolist() and s.labels.tolist() == want.labels.tolist()


def test_a_job_that_fails_stops_its_listing_and_does_not_wait_for_it(image_dir: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """A job that fails before its store is made (a layer the model lacks), and one that fails once a shard is
    done: each raises its own error while the listing is still held (the rest of a listing streamed may be minutes
    of files away), and the listing stops."""
    from extractor.driver import runner
    from extractor.errors import LayerError

    paths = write_hub_parquet(images_of(image_dir), tmp_path / "data", per_file=5, row_group=5)
    made: list[Streamed] = []

    def kept(data: Any) -> Any:
        made.append(stream_rows(data))
        return made[-1]

    monkeypatch.setattr(runner, "stream_rows", kept)
    pattern = str(tmp_path / "data" / "*.parquet")
    bad = parquet_job(image_dir, tmp_path / "a.zarr", pattern, shard_size=2, batch_size=2)
    bad["capture"] = [{"layer": "no_such_layer", "reduce": "mean"}]
    release = _hold_last_file(monkeypatch, paths[-1].name)

    def failing(name: str, info: dict) -> None:
        if name == "shard_done":
            raise RuntimeError("a callback failed")

    for spec, error, on_event in ((bad, LayerError, None), (parquet_job(
            image_dir, tmp_path / "b.zarr", pattern, shard_size=2, batch_size=2), RuntimeError, failing)):
        with pytest.raises(error):
            run(parse_spec(spec), on_event=on_event)
        assert not release.is_set() and not release.timed_out  # raised while the listing was held
        streamed = made[-1]
        release.set()  # the listing goes on to its next file, and stops there
        streamed._thread.join(WAIT_S)
        assert not streamed._thread.is_alive()
        with pytest.raises(DataError, match="the listing stopped"):
            streamed.whole()
        release.clear()
