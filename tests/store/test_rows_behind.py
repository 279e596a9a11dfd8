"""A new store's rows written behind its making (issue 57): the store is made (its arrays' metadata, its ledger) once
the rows are counted, its per-row arrays are written in row order beside the first shards, each shard handed out
once its rows are in the store, then the id index and the digests: the first shard no longer waits for every row.

The stretches of rows are made tiny here (a stretch a shard) so that a store of a few images is written behind."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.images import make_images
from helpers.jobs import job
from helpers.preprocess import tiny_resnet_mean
from helpers.stores import committed_count, generation, opened

import extractor.store.claimants as claimants
import extractor.store.layout as layout
import extractor.store.provenance as provenance
from extractor.driver.runner import run
from extractor.errors import StoreError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec
from extractor.store import read_id_index, read_state
from extractor.store.layout import NamesDigest

WAIT_S = 120  # a bound on waiting for an event, never a pause


@pytest.fixture
def stretch_a_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout, "WRITE_ROWS", 2)
    monkeypatch.setattr(layout, "ONCE_ROWS", 2)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("behind") / "imgs"
    make_images(root, per_class=4, classes=("a", "b"), size=40)  # 8 images: 4 shards of 2
    return root


def _spec(images: Path, store: Path | str, **output: Any) -> Any:
    return parse_spec(job(images, store, data={"shard_size": 2, "batch_size": 2},
                          capture=[{"layer": "layer4", "reduce": "mean", "dtype": "float32"}],
                          output={"chunk_rows": 2, **output}))


def _made_as_listed(url: str, images: Path, options: dict | None = None) -> None:
    """The store is made, complete, and holds the images' rows as listed (ids, labels, digests, id index) and what
    a direct forward of the toy model on hand-preprocessed images gives."""
    s = open_store(url, options)
    assert s.attrs["status"] == "complete" and s.attrs["rows_written"] is True
    ids = [str(i) for i in s.ids]
    assert ids == sorted(str(p.relative_to(images)) for p in images.rglob("*") if p.is_file())
    assert (np.asarray(s.labels) == [0] * 4 + [1] * 4).all()
    assert s.attrs["ids_digest"] == NamesDigest.of(np.asarray(ids)) and \
        s.attrs["paths_digest"] == NamesDigest.of(np.asarray([str(p) for p in s.paths]))
    assert [s.row(i)["row"] for i in reversed(ids)] == list(range(7, -1, -1))
    index = read_id_index(opened(url, options), 8, s.attrs["ids_digest"], lambda rows: [ids[r] for r in rows])
    assert index is not None and index.find(ids[::-1]).tolist() == list(range(7, -1, -1))  # written last, whole
    ref = tiny_resnet_mean([Path(p) for p in s.paths]).numpy()
    assert np.abs(s.numpy("layer4") - ref).max() <= 2e-3 * np.abs(ref).max()


def _held_rows(monkeypatch: pytest.MonkeyPatch, release: threading.Event, order: list[str]) -> None:
    """The rows writer writes its first stretch, then waits for ``release`` before each next one."""
    write = layout._RowArrays.write

    def held(self: Any, start: int, stop: int, rows: Any) -> None:
        if start:
            assert release.wait(WAIT_S), "the first shard never began while the rows waited"
        write(self, start, stop, rows)
        order.append(f"rows {start}-{stop}")

    monkeypatch.setattr(layout._RowArrays, "write", held)


def _stopped(images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard: int, err: BaseException,
             order: list[str]) -> None:
    """Run a job whose rows are held after their first stretch until shard 0 begins, and whose callback raises
    ``err`` as shard ``shard`` begins; the stretches written go to ``order``."""
    release = threading.Event()
    _held_rows(monkeypatch, release, order)

    def on_event(name: str, info: dict) -> None:
        if name == "shard_started" and info["shard"] == 0:
            release.set()
        if name == "shard_started" and info["shard"] == shard:
            raise err

    run(_spec(images, tmp_path / "s.zarr"), on_event=on_event)


def test_the_first_shards_run_while_the_rows_are_written_and_the_store_holds_what_a_direct_forward_gives(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    release, order = threading.Event(), []
    _held_rows(monkeypatch, release, order)
    url = str(tmp_path / "s.zarr")
    seen_while: list[str] = []

    def on_event(name: str, info: dict) -> None:
        if name == "shard_started" and info["shard"] == 0:
            order.append("shard 0 began")
            seen_while.append(str((read_state(url) or {}).get("status")))
            with pytest.raises(StoreError, match="being created"):  # readers wait for the rows, as for the making
                open_store(url)
            release.set()

    summary = run(_spec(images, tmp_path / "s.zarr"), on_event=on_event)
    assert summary.ok == 8 and summary.failed == 0
    assert order[:3] == ["rows 0-2", "shard 0 began", "rows 2-4"], order  # shard 0 began before the rows after it
    assert seen_while == ["creating"]  # not made until its rows are all in
    _made_as_listed(url, images)
    again = run(_spec(images, tmp_path / "s.zarr", if_exists="resume"))
    assert again.shards_run == 0 and again.ok == 8  # its digests are the listing's: nothing to do


def test_a_job_that_fails_while_its_rows_are_written_finishes_them_and_its_resume_keeps_its_shards(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    """An error that is not an interrupt (here the caller's callback; a shard out of retries, a device) lets the
    rows be written to the end: the store is made, and the resume computes only what was not committed."""
    url = str(tmp_path / "s.zarr")
    with pytest.raises(Exception, match="callback broke"):
        _stopped(images, tmp_path, monkeypatch, 2, RuntimeError("the caller's callback broke"), [])
    state = read_state(url) or {}
    assert state["status"] == "failed" and state["rows_written"] is True, state  # made: its shards are kept
    kept = committed_count(url)
    assert kept >= 1
    again = run(_spec(images, tmp_path / "s.zarr", if_exists="resume"))
    assert again.ok == 8 and again.shards_run == 4 - kept


def _interrupted_half_made(images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str = "",
                           options: dict | None = None) -> tuple[str, int]:
    """A job interrupted once shard 0 is committed while its rows from row 4 on are held: the store half-made
    (rows 0-6 written, the stretch after the interrupt's stop included), at ``url`` (a store under ``tmp_path``
    where none is given). Its URL and its shards committed."""
    url, go, order = url or str(tmp_path / "s.zarr"), threading.Event(), []
    write, stop = layout._RowArrays.write, layout.RowsBehind.stop

    def held(self: Any, start: int, end: int, rows: Any) -> None:
        if start >= 4:
            assert go.wait(WAIT_S), "the job never stopped its rows"
        write(self, start, end, rows)
        order.append(start)

    def stopping(self: Any) -> None:
        stop(self)
        go.set()  # the stretch held is written, then the writer stops before the next

    monkeypatch.setattr(layout._RowArrays, "write", held)
    monkeypatch.setattr(layout.RowsBehind, "stop", stopping)

    def on_event(name: str, info: dict) -> None:
        if name == "shard_done" and info["shard"] == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(_spec(images, url, **({"storage_options": options} if options else {})), on_event=on_event)
    monkeypatch.undo()
    monkeypatch.setattr(layout, "WRITE_ROWS", 2)  # (undone too: the resume writes them behind as well)
    monkeypatch.setattr(layout, "ONCE_ROWS", 2)
    assert order == [0, 2, 4] and (read_state(url, options) or {})["status"] == "creating", order  # half-made
    return url, committed_count(url, options)


def test_an_interrupt_while_the_rows_are_written_leaves_the_store_half_made_and_its_resume_keeps_its_shards(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    """The resume of a store left half-made by a job that ended (here interrupted) writes its rows again behind
    its shards and keeps those committed: the store holds what a direct forward gives, its digests and id index
    are its rows'."""
    url, kept = _interrupted_half_made(images, tmp_path, monkeypatch)
    assert kept >= 1  # shard 0's commit was reported
    gen = generation(url)
    before = {k: v for k, v in enumerate(gen.ledger().read().attempts("data")) if v}
    summary = run(_spec(images, tmp_path / "s.zarr", if_exists="resume"))
    assert summary.ok == 8 and summary.shards_run == 4 - kept  # the committed shards kept
    assert generation(url).name == gen.name and all(
        generation(url).ledger().read().attempts("data")[k] == v for k, v in before.items())  # as they were
    _made_as_listed(url, images)  # its rows, id index and digests written again


def test_a_half_made_store_on_s3_is_resumed_in_place(images: Path, tmp_path: Path, stretch_a_shard: None,
                                                     monkeypatch: pytest.MonkeyPatch, moto_s3: dict[str, str]):
    """On an S3 server (moto): the resume's turn is a conditional create there, its root's record a swap (If-Match),
    and the store holds what a direct forward gives, its committed shards kept."""
    import s3fs

    s3fs.S3FileSystem(**moto_s3).mkdir("behind")
    url = f"s3://behind/{tmp_path.name}.zarr"
    url, kept = _interrupted_half_made(images, tmp_path, monkeypatch, url, moto_s3)
    summary = run(_spec(images, url, if_exists="resume", storage_options=moto_s3))
    assert summary.ok == 8 and summary.shards_run == 4 - kept
    gen = generation(url, moto_s3)
    assert gen.objects.list(gen.txn("rows-turns")) == ["00000000"]
    _made_as_listed(url, images, moto_s3)


def test_a_half_made_store_is_planned_and_joined_as_it_is_resumed(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    """``plan --resume`` says what ``run --resume`` does, and ``--join`` (what its interrupt's message names for a
    job that joined) writes its rows again and keeps its shards too, at once: its maker's record is there, gone,
    so the joiner does not wait for the head to age as for a maker not yet on the roster."""
    import extractor.store.session as session
    from extractor.driver.dry_run import preview

    url, kept = _interrupted_half_made(images, tmp_path, monkeypatch)
    planned = preview(_spec(images, tmp_path / "s.zarr", if_exists="resume"))
    assert planned.action == f"resume ({4 - kept} shards to do; a half-made store: its rows written again)"

    def aged(head: Any) -> float:
        raise AssertionError("the joiner waited on the head's age")

    monkeypatch.setattr(session, "_age_s", aged)
    summary = run(_spec(images, tmp_path / "s.zarr", if_exists="join"))
    assert summary.ok == 8 and summary.shards_run == 4 - kept
    _made_as_listed(url, images)


def test_of_two_jobs_that_come_to_write_a_half_made_stores_rows_the_one_that_takes_the_turn_does(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    """Two resumes that both found the writers gone: the turn, a create-only object, goes to one; the other is
    refused, naming it, and writes nothing, though it started first (what chose before: both wrote where the one
    started first was paused between its look and its record)."""
    import os
    import socket
    import time

    from extractor.store.session import StoreSession

    url, kept = _interrupted_half_made(images, tmp_path, monkeypatch)
    gen = generation(url)
    join = StoreSession._join

    def beside(self: Any, rows: bool = True) -> None:
        join(self, rows)  # another resume, started after this one, took the turn meanwhile
        other = {"id": "00000000000000aa", "host": socket.gethostname(), "pid": os.getpid(), "rows": True,
                 "join": False, "started": "2099-01-01T00:00:00+00:00", "heartbeat": time.time(), "timeout_s": 600}
        gen.objects.put(f"{gen.claimants_prefix}/{other['id']}", json.dumps(other).encode())
        assert gen.objects.create(gen.txn("rows-turns/00000000"), other["id"].encode())

    monkeypatch.setattr(StoreSession, "_join", beside)
    with pytest.raises(StoreError, match=r"being resumed by another extractor job now: pid \d+ .*started "
                                         r"2099-01-01.*--join") as refused:
        run(_spec(images, tmp_path / "s.zarr", if_exists="resume"))
    assert not getattr(refused.value, "resumable", False)  # (no "--resume finishes it" said after: not its to)
    assert (read_state(url) or {})["status"] == "creating" and committed_count(url) == kept


def test_a_joiner_that_found_the_turn_taken_takes_the_next_once_its_holder_is_gone(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    """A ``--join`` that found another writing the rows waits; where that one stops before they are all written,
    it takes the next turn and writes them (it waited on its own record for ever before)."""
    import os
    import socket
    import time

    from extractor.store.generation import Generation
    from extractor.store.session import StoreSession

    url, kept = _interrupted_half_made(images, tmp_path, monkeypatch)
    gen = generation(url)
    other = {"id": "00000000000000aa", "host": socket.gethostname(), "pid": os.getpid(), "rows": True,
             "join": False, "started": "2099-01-01T00:00:00+00:00", "heartbeat": time.time(), "timeout_s": 600}
    join, take = StoreSession._join, Generation.take_rows

    def beside(self: Any, rows: bool = True) -> None:
        join(self, rows)  # another resume took the turn meanwhile
        gen.objects.put(f"{gen.claimants_prefix}/{other['id']}", json.dumps(other).encode())
        assert gen.objects.create(gen.txn("rows-turns/00000000"), other["id"].encode())

    def taking(self: Generation, claimant: int) -> int | None:
        holder = take(self, claimant)
        if holder is not None:  # the holder stops, its rows not all written
            ended = {**other, "ended": {"status": "failed"}}
            gen.objects.put(f"{gen.claimants_prefix}/{other['id']}", json.dumps(ended).encode())
        return holder

    monkeypatch.setattr(StoreSession, "_join", beside)
    monkeypatch.setattr(Generation, "take_rows", taking)
    summary = run(_spec(images, tmp_path / "s.zarr", if_exists="join"))
    assert summary.ok == 8 and summary.shards_run == 4 - kept
    assert [n for n, _holder in gen.rows_turns()] == [0, 1] and gen.rows_turns()[1][1] != 0xaa
    _made_as_listed(url, images)


def test_a_joiner_whose_turn_holder_is_silent_elsewhere_stops_saying_so(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    """The turn's holder silent past its timeout on another machine (paused, or gone with its host): a joiner waiting
    for the rows stops, naming it and what to run, and writes nothing (it waited for ever)."""
    import time

    from extractor.store.session import StoreSession

    url, kept = _interrupted_half_made(images, tmp_path, monkeypatch)
    gen = generation(url)
    join = StoreSession._join

    def beside(self: Any, rows: bool = True) -> None:
        join(self, rows)
        silent = {"id": "00000000000000cc", "host": "another-host", "pid": 1, "rows": True, "join": False,
                  "started": "2099-01-01T00:00:00+00:00", "heartbeat": time.time() - 3600, "timeout_s": 600}
        gen.objects.put(f"{gen.claimants_prefix}/{silent['id']}", json.dumps(silent).encode())
        assert gen.objects.create(gen.txn("rows-turns/00000000"), silent["id"].encode())

    monkeypatch.setattr(StoreSession, "_join", beside)
    with pytest.raises(StoreError, match=r"left half-made by a job that wrote its rows and is silent now .*another-host"
                                         r".*--resume"):
        run(_spec(images, tmp_path / "s.zarr", if_exists="join"))
    assert (read_state(url) or {})["status"] == "creating" and committed_count(url) == kept


def test_a_job_that_came_to_write_the_rows_and_did_not_is_no_rows_writer(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    """A resume refused the turn, its record then as one silent on another machine leaves it: it wrote no row (its
    record says so), so the next resume writes them in place and keeps the shards (it made the store again, losing
    them, before: every resume of a half-made store said it wrote rows)."""
    test_of_two_jobs_that_come_to_write_a_half_made_stores_rows_the_one_that_takes_the_turn_does(
        images, tmp_path, stretch_a_shard, monkeypatch)
    monkeypatch.undo()
    monkeypatch.setattr(layout, "WRITE_ROWS", 2)
    monkeypatch.setattr(layout, "ONCE_ROWS", 2)
    monkeypatch.setattr(claimants, "_ENDED", set())  # (this process's claimants that ended: as another's would be)
    gen = generation(str(tmp_path / "s.zarr"))
    kept = committed_count(str(tmp_path / "s.zarr"))
    for record in gen.roster.all():
        if record["id"] == "00000000000000aa":  # the turn's holder ends, its rows not all written
            record["ended"] = {"status": "failed"}
        elif not record["ended"]["error"].startswith("KeyboardInterrupt"):  # the refused one: silent elsewhere
            assert record["rows"] is False
            record.pop("ended")
            record.update(host="another-host", heartbeat=record["heartbeat"] - 3600)
        gen.objects.put(f"{gen.claimants_prefix}/{record['id']}", json.dumps(record).encode())
    summary = run(_spec(images, tmp_path / "s.zarr", if_exists="resume"))
    assert summary.shards_run == 4 - kept and generation(str(tmp_path / "s.zarr")).name == gen.name
    _made_as_listed(str(tmp_path / "s.zarr"), images)


def test_a_turn_at_a_half_made_stores_rows_is_taken_once_and_after_its_holder_is_gone(tmp_path: Path):
    """The turns as two processes see them: one takes it, the other is told whose it is; once the holder ended
    (or its process is gone from this machine), the next turn is the other's, once."""
    import os
    import socket
    import time

    from extractor.store import Objects
    from extractor.store.generation import Generation

    gen = Generation(Objects.at(str(tmp_path / "s.zarr")), "g")

    def record(claimant: int, **more: Any) -> None:
        info = {"id": f"{claimant:016x}", "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time(),
                "timeout_s": 600, **more}
        gen.objects.put(f"{gen.claimants_prefix}/{claimant:016x}", json.dumps(info).encode())

    record(1), record(2)  # (and what a local create killed between its two steps leaves: no turn)
    gen.objects.put(gen.txn("rows-turns/00000000.0123456789ab.tmp"), b"0000000000000009")
    assert gen.take_rows(1) is None and gen.take_rows(2) == 1 and gen.take_rows(2) == 1
    record(1, ended=True)
    assert gen.take_rows(2) is None and gen.take_rows(1) == 2
    record(2, pid=2 ** 22 + 12345)  # (no such process: gone from this machine)
    record(3, host="another-host")
    assert gen.take_rows(3) is None and gen.take_rows(1) == 3  # one silent elsewhere is never taken over
    assert gen.rows_turns() == [(0, 1), (1, 2), (2, 3)]


def test_a_resume_interrupted_while_it_wrote_the_rows_leaves_the_next_turn_to_the_next_resume(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    url, _kept = _interrupted_half_made(images, tmp_path, monkeypatch)
    hold, write, stop = threading.Event(), layout._RowArrays.write, layout.RowsBehind.stop

    def held(self: Any, start: int, end: int, rows: Any) -> None:
        if start >= 6:  # (shards 1 and 2 may run)
            assert hold.wait(WAIT_S), "the resume never stopped its rows"
        write(self, start, end, rows)

    def stopping(self: Any) -> None:
        stop(self)
        hold.set()

    def on_event(name: str, info: dict) -> None:
        if name == "shard_started":
            raise KeyboardInterrupt

    monkeypatch.setattr(layout._RowArrays, "write", held)
    monkeypatch.setattr(layout.RowsBehind, "stop", stopping)
    with pytest.raises(KeyboardInterrupt):
        run(_spec(images, tmp_path / "s.zarr", if_exists="resume"), on_event=on_event)
    gen = generation(url)
    assert (read_state(url) or {})["status"] == "creating" and gen.objects.list(gen.txn("rows-turns")) == ["00000000"]
    assert run(_spec(images, tmp_path / "s.zarr", if_exists="resume")).ok == 8
    assert gen.objects.list(gen.txn("rows-turns")) == ["00000000", "00000001"]
    _made_as_listed(url, images)


def test_a_rows_writer_whose_store_was_made_again_stops_as_fenced(tmp_path: Path, images: Path):
    """A driver paused while it wrote a new store's rows, woken after another job made the store again: its rows
    writer stops at its next stretch, and says so as a claim lost (no "half-created", no resume to run)."""
    from extractor.data import list_rows
    from extractor.errors import FencedError
    from extractor.store import Objects
    from extractor.store.generation import read_head, swap_head
    from extractor.store.layout import StoreArrays, now, start_generation

    objects = Objects.at(str(tmp_path / "s.zarr"))
    name = swap_head(objects, None, now())
    rows = list_rows(_spec(images, tmp_path / "s.zarr").data)
    behind = start_generation(objects, name, rows, StoreArrays({}, {}, 2, {}), {"ids_digest": None})
    swap_head(objects, read_head(objects), now())  # made again meanwhile
    with pytest.raises(FencedError, match="made again by another job while this one wrote its rows"):
        behind.write()
    with pytest.raises(FencedError):
        behind.ready(3)


def test_the_roots_record_of_rows_written_loses_no_write_made_between_its_read_and_its_write(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch):
    """The record that the rows are written is a swap of the root: another write of the root landing between its
    read and its write is read again and kept (a read then a plain put lost it)."""
    from extractor.data import list_rows
    from extractor.store import Objects
    from extractor.store.generation import swap_head
    from extractor.store.layout import ATTR, ROOT, StoreArrays, now, start_generation

    objects = Objects.at(str(tmp_path / "s.zarr"))
    name = swap_head(objects, None, now())
    behind = start_generation(objects, name, list_rows(_spec(images, tmp_path / "s.zarr").data),
                              StoreArrays({}, {}, 2, {}), {"ids_digest": None})
    read, key = type(objects).read, f"{name}/{ROOT}"

    def read_then_another_writes(self: Any, at: str) -> Any:
        got = read(self, at)
        if at == key and not hasattr(read_then_another_writes, "done"):
            read_then_another_writes.done = True  # type: ignore[attr-defined]
            root = json.loads(got[0])
            root["attributes"][ATTR]["note"] = "another write"
            self.put(key, json.dumps(root).encode())
        return got

    monkeypatch.setattr(type(objects), "read", read_then_another_writes)
    behind.write()
    attrs = json.loads(objects.get(key))["attributes"][ATTR]  # type: ignore[arg-type]
    assert attrs["note"] == "another write" and attrs["rows_written"] is True and attrs["ids_digest"]


def test_a_half_made_store_whose_computed_rows_are_listed_otherwise_is_refused_and_left_as_it_is(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    url, kept = _interrupted_half_made(images, tmp_path, monkeypatch)
    moved = tmp_path / "moved"
    shutil.copytree(images, moved)
    (moved / "a" / "a00.jpg").rename(moved / "a" / "a000.jpg")  # row 0 (computed) is another image now
    with pytest.raises(StoreError, match=r"(?s)image list differs \(row 0, computed before: 'a/a00.jpg' in the store, "
                                         r"'a/a000.jpg' now\).*--overwrite"):
        run(_spec(moved, tmp_path / "s.zarr", if_exists="resume"))
    (moved / "a" / "a000.jpg").rename(moved / "a" / "a00.jpg")  # row 1 another image (its ids compared a row at a
    (moved / "a" / "a01.png").rename(moved / "a" / "a010.png")  # time: BLOCK is 65,536 rows) in another folder
    with monkeypatch.context() as patch:
        patch.setattr(provenance, "BLOCK", 1)
        with pytest.raises(StoreError, match=r"(?s)image list differs \(row 1, computed before: 'a/a01.png' in the "
                                             r"store, 'a/a010.png' now\).*--overwrite"):
            run(_spec(moved, tmp_path / "s.zarr", if_exists="resume"))
    (moved / "a" / "a010.png").rename(moved / "a" / "a01.png")
    (moved / "c").mkdir()
    shutil.copy(moved / "a" / "a01.png", moved / "c" / "c09.png")
    with pytest.raises(StoreError, match=r"image list differs \(8 rows in the store, 9 now\)"):
        run(_spec(moved, tmp_path / "s.zarr", if_exists="resume"))
    assert (read_state(url) or {})["status"] == "creating" and committed_count(url) == kept  # nothing written
    assert run(_spec(images, tmp_path / "s.zarr", if_exists="resume")).shards_run == 4 - kept


def test_a_half_made_store_whose_maker_may_be_paused_on_another_machine_is_made_again(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    """A maker silent past its timeout on another machine may wake and write a stretch of rows at fixed keys:
    the store is made again (a new generation, where nothing it writes is read), never written beside it."""
    url, _kept = _interrupted_half_made(images, tmp_path, monkeypatch)
    gen = generation(url)
    monkeypatch.setattr(claimants, "_ENDED", set())  # (this process's claimants that ended: as another's would be)
    for record in gen.roster.all():  # as a maker killed without a word on another host would have left it
        record.pop("ended")
        record.update(host="another-host", heartbeat=record["heartbeat"] - 3600)
        gen.objects.put(f"{gen.claimants_prefix}/{record['id']}", json.dumps(record).encode())
    summary = run(_spec(images, tmp_path / "s.zarr", if_exists="resume"))
    assert summary.ok == 8 and summary.shards_run == 4 and generation(url).name != gen.name  # made again


def test_a_store_whose_rows_could_not_be_written_is_half_made_and_its_resume_writes_them_again(
        images: Path, tmp_path: Path, stretch_a_shard: None, monkeypatch: pytest.MonkeyPatch):
    write, calls = layout._RowArrays.write, []

    def failing(self: Any, start: int, stop: int, rows: Any) -> None:
        calls.append(start)
        if start == 4:
            raise OSError(28, "No space left on device")
        write(self, start, stop, rows)

    monkeypatch.setattr(layout._RowArrays, "write", failing)
    url = str(tmp_path / "s.zarr")
    with pytest.raises(StoreError, match=r"the rows of store .* could not be written: OSError: .*No space left"):
        run(_spec(images, tmp_path / "s.zarr"))
    assert (read_state(url) or {})["status"] == "creating"  # half-made: nothing in it is trusted
    with pytest.raises(StoreError, match="half-created"):
        open_store(url)
    kept = committed_count(url)
    monkeypatch.undo()  # (the stretches too: the rows written again before the first shard)
    summary = run(_spec(images, tmp_path / "s.zarr", if_exists="resume"))
    assert summary.ok == 8 and summary.shards_run == 4 - kept  # its rows written again, its shards kept
    assert open_store(url).attrs["status"] == "complete"
