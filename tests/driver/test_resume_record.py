"""A resume that finds the source moved but not its images (files touched, tars written again with the same
members) records the new fingerprints and listing, so that the next resume neither reads those images again nor
lists the tars again (issue 39, item 4); with nothing moved it writes nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.images import make_images
from helpers.interrupts import interrupted_after
from helpers.jobs import job
from helpers.stores import opened

from extractor.data.files import local_fingerprint
from extractor.driver.runner import run
from extractor.read import open_store
from extractor.spec.load import parse_spec

TOY = {"name": None, "factory": "toy_models:slow_net", "factory_kwargs": {"seconds": 0}, "device": "cpu"}


def files_of(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


def test_a_touched_tar_is_listed_once_then_taken_from_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from helpers.sources import write_tars

    import extractor.data.sources.tar as tars_module

    files = make_images(tmp_path / "imgs", per_class=3, classes=("a", "b"), size=40)
    write_tars(files, tmp_path / "tars", per_tar=3)
    data = {"source": "tar", "root": None, "shard_size": 2, "resize": None, "crop": 32,
            "tars": str(tmp_path / "tars" / "shard-{000..001}.tar")}
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, data=data,
              capture=[{"layer": "conv", "reduce": "mean"}])
    real_prints = tars_module.member_fingerprints  # every member's under 2^63 (int64 as listed; 1 in 8 tars of 3
    monkeypatch.setattr(tars_module, "member_fingerprints",  # members by chance): the stored ones beside them
                        lambda *a: [p >> 1 or 1 for p in real_prints(*a)])  # were promoted to float64 and rounded
    assert run(parse_spec(raw)).ok == 6
    s = open_store(str(tmp_path / "s.zarr"))
    where, prints = [s.locator(i) for i in range(6)], opened(tmp_path / "s.zarr")["fingerprint"][:].tolist()
    scanned: list[str] = []
    real = tars_module.scan_tar
    monkeypatch.setattr(tars_module, "scan_tar", lambda *a: scanned.append(a[0]) or real(*a))
    raw["output"]["if_exists"] = "resume"
    later = os.stat(tmp_path / "tars" / "shard-001.tar").st_mtime_ns + 10**9
    os.utime(tmp_path / "tars" / "shard-001.tar", ns=(later, later))  # touched: same bytes, another mtime
    assert run(parse_spec(raw)).shards_run == 0  # the touched tar listed again alone, compared, recorded
    assert scanned == [str(tmp_path / "tars" / "shard-001.tar")]
    recorded = open_store(str(tmp_path / "s.zarr")).attrs["listing"]
    assert recorded["fingerprints"][1] == local_fingerprint(str(tmp_path / "tars" / "shard-001.tar"))
    assert recorded["rows"] == [3, 3]
    s = open_store(str(tmp_path / "s.zarr"))
    assert [s.locator(i) for i in range(6)] == where  # every member's offset and size kept: the untouched tar's
    now = opened(tmp_path / "s.zarr")["fingerprint"][:].tolist()  # rows as they were (bit for bit), the touched
    assert now[:3] == prints[:3] and all(a != b for a, b in zip(now[3:], prints[3:], strict=True))  # one's new
    before = files_of(tmp_path / "s.zarr")
    assert run(parse_spec(raw)).shards_run == 0 and len(scanned) == 1  # the record says so: no tar listed
    assert files_of(tmp_path / "s.zarr") == before  # and nothing written


def test_a_touched_file_is_read_again_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import extractor.store.provenance as provenance

    make_images(tmp_path / "imgs", per_class=3, classes=("a",), size=40)
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=[{"layer": "conv", "reduce": "mean"}],
              data={"resize": None, "crop": 32, "shard_size": 2, "verify": "files"})  # a file rewritten in place
    assert run(parse_spec(raw)).ok == 3
    read: list[int] = []
    real = provenance.source_digests
    monkeypatch.setattr(provenance, "source_digests", lambda g, rows, *a, **k: read.extend(rows) or real(g, rows,
                                                                                                          *a, **k))
    raw["output"]["if_exists"] = "resume"
    image = sorted((tmp_path / "imgs" / "a").iterdir())[1]
    image.write_bytes(image.read_bytes())  # the same bytes written again: other mtime and ctime
    assert run(parse_spec(raw)).shards_run == 0 and read == [1]
    assert run(parse_spec(raw)).shards_run == 0 and read == [1]  # recorded: not read again
    g = opened(str(tmp_path / "s.zarr"))  # each file's as its worker read it, the touched one's as recorded
    stored = provenance.stored_prints(g, 0, 3)
    assert stored.tolist() == [local_fingerprint(str(p)) for p in g["paths"][:]] and (stored != 0).all()
    assert np.asarray(g["fingerprint"][:]).tolist() == [*stored[:2], 0]  # (recorded for the touched one's shard)


@pytest.mark.parametrize("gone", ["removed", "fifo", "folder"])
def test_a_computed_rows_image_file_gone_is_named_as_gone_not_as_a_url(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture, gone: str):
    """A manifest's image removed after its row was computed, or put in place of a FIFO or a folder (a FIFO's read
    never ended; a folder was said to be a changed image): the resume says that file cannot be seen now, naming
    it (it blamed URLs in a manifest, which this one has none of), keeps the row's values, and says it again next
    time."""
    files = make_images(tmp_path / "imgs", per_class=3, classes=("a",), size=40)
    broken = tmp_path / "imgs" / "a" / "broken.jpg"  # a row that fails (no values), its file gone too: not said
    broken.write_bytes(b"not an image")
    manifest = tmp_path / "list.csv"
    manifest.write_text("path\n" + "".join(f"{f.relative_to(tmp_path / 'imgs')}\n" for f in [*files, broken]))
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=[{"layer": "conv", "reduce": "mean"}],
              data={"source": "manifest", "manifest": str(manifest), "resize": None, "crop": 32, "shard_size": 2})
    summary = run(parse_spec(raw))
    assert (summary.ok, summary.failed) == (3, 1)
    values = open_store(str(tmp_path / "s.zarr"))["conv"][:]
    files[1].unlink()
    if gone == "fifo":
        os.mkfifo(files[1])
    elif gone == "folder":
        files[1].mkdir()
    broken.unlink()
    raw["output"]["if_exists"] = "resume"
    said, written = [], []
    for _ in range(2):
        caplog.clear()
        before = files_of(tmp_path / "s.zarr")
        with caplog.at_level("WARNING", logger="extractor.store.provenance"):
            assert run(parse_spec(raw)).shards_run == 0
        said.append([r.getMessage() for r in caplog.records])
        written.append(files_of(tmp_path / "s.zarr") != before)
    assert written == [False, False]  # (a file gone: no fingerprint to record)
    for each in said:  # (the file's fingerprint as its worker read it is kept: the next resume names it again)
        assert len(each) == 1 and each[0].startswith("1 computed rows of ") and \
            f"cannot be seen now (removed, renamed or no longer a file since; row 1: {files[1]})" in each[0]
    np.testing.assert_array_equal(open_store(str(tmp_path / "s.zarr"))["conv"][:], values)


def test_a_row_whose_path_is_a_fifo_or_a_folder_fails_without_waiting(tmp_path: Path):
    """A manifest's row naming a FIFO (its open waited for a writer, forever) or a folder fails, saying it is not a
    regular file; the others are computed."""
    files = make_images(tmp_path / "imgs", per_class=2, classes=("a",), size=40)
    os.mkfifo(tmp_path / "imgs" / "a" / "pipe.jpg")
    (tmp_path / "imgs" / "a" / "dir.jpg").mkdir()
    (tmp_path / "list.csv").write_text("path\n" + "".join(f"a/{f.name}\n" for f in files) + "a/pipe.jpg\na/dir.jpg\n")
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=[{"layer": "conv", "reduce": "mean"}],
              data={"source": "manifest", "manifest": str(tmp_path / "list.csv"), "resize": None, "crop": 32})
    summary = run(parse_spec(raw))
    assert (summary.ok, summary.failed) == (2, 2)
    assert sorted(e for _r, _i, e in summary.failures) == [
        f"OSError: {tmp_path / 'imgs' / 'a' / name} is not a regular file" for name in ("dir.jpg", "pipe.jpg")]


def test_a_failed_rows_image_restored_is_said_to_have_failed_and_redo_computes_it(tmp_path: Path):
    """A manifest's image missing when its row was read (the row failed), put back since: the resume's refusal says
    that row failed before and holds no values (it said its stored values were the old image's), and
    ``output.on_change: redo`` computes it, equal to a run that never missed it."""
    from extractor.errors import StoreError

    files = make_images(tmp_path / "imgs", per_class=3, classes=("a",), size=40)
    manifest = tmp_path / "list.csv"
    manifest.write_text("path\n" + "".join(f"{f.relative_to(tmp_path / 'imgs')}\n" for f in files))
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=[{"layer": "conv", "reduce": "mean"}],
              data={"source": "manifest", "manifest": str(manifest), "resize": None, "crop": 32, "shard_size": 2})
    whole = {**raw, "output": {**raw["output"], "store": str(tmp_path / "whole.zarr")}}
    assert run(parse_spec(whole)).ok == 3
    kept = files[2].read_bytes()
    files[2].unlink()
    assert run(parse_spec(raw)).failed == 1
    files[2].write_bytes(kept)
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=r"the images of 1 row that failed before have changed since \(their content "
                                         r"digest differs\): 'a/a02\.\w+'\. They hold no values \(they failed\)"):
        run(parse_spec(raw))
    raw["output"]["on_change"] = "redo"
    assert run(parse_spec(raw)).ok == 3
    np.testing.assert_array_equal(open_store(str(tmp_path / "s.zarr"))["conv"][:],
                                  open_store(str(tmp_path / "whole.zarr"))["conv"][:])


def test_a_manifest_in_another_order_is_refused_saying_so(tmp_path: Path):
    """A manifest whose rows were put in another order: the refusal says the ids are the store's in another order
    (it said "the image list differs (3 rows in the store, 3 now)"); another image list names the first row that
    differs (a file renamed looked like nothing changed: a helper's audit), and a longer one the first row added."""
    import re

    from extractor.errors import StoreError

    files = make_images(tmp_path / "imgs", per_class=3, classes=("a",), size=40)
    names = [f"{f.relative_to(tmp_path / 'imgs')}\n" for f in files]
    manifest = tmp_path / "list.csv"
    manifest.write_text("path\n" + "".join(names))
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=[{"layer": "conv", "reduce": "mean"}],
              data={"source": "manifest", "manifest": str(manifest), "resize": None, "crop": 32, "shard_size": 2})
    assert run(parse_spec(raw)).ok == 3
    raw["output"]["if_exists"] = "resume"
    manifest.write_text("path\n" + "".join(reversed(names)))
    with pytest.raises(StoreError, match=r"the image list differs \(3 rows in the store, 3 now; the same ids in "
                                         r"another order\)"):
        run(parse_spec(raw))
    (tmp_path / "imgs" / "a" / "extra.jpg").write_bytes(files[0].read_bytes())
    manifest.write_text("path\n" + "".join([*names[:2], "a/extra.jpg\n"]))  # another list of as many rows
    third = re.escape(repr(names[2].strip()))
    with pytest.raises(StoreError, match=r"the image list differs \(3 rows in the store, 3 now; the first that "
                                         rf"differs: row 2, {third} in the store, 'a/extra.jpg' now\)"):
        run(parse_spec(raw))
    manifest.write_text("path\n" + "".join([*names, "a/extra.jpg\n"]))  # a row added at the end
    with pytest.raises(StoreError, match=r"the image list differs \(3 rows in the store, 4 now; the first that "
                                         r"differs: row 3, 'a/extra.jpg' now only\)"):
        run(parse_spec(raw))


@pytest.mark.parametrize(("relisted", "blocks"), [(False, None), (True, None), (False, (5, 3))],
                         ids=["rows-from-the-store", "manifest-touched", "small-blocks"])
def test_a_manifests_files_are_fingerprinted_by_the_workers_that_read_them(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           relisted: bool,
                                                                           blocks: tuple[int, int] | None):
    """Issue 57: a manifest's listing stats no image file (3.3 s of CPU a million rows); each row's worker takes the
    fingerprint of the file it opens (the store's ``read_fingerprint``, as ``os.stat`` gives it), and a resume
    stats the files of the rows read only, whether it takes the rows from the store or lists a touched manifest
    again. A done row's image rewritten in place with its mtime put back is named; one written again with the same
    bytes is read once, its new fingerprint recorded, and not read again. ``blocks``: rows compared, and stat-ed,
    at a time (a million and 65,536; their fingerprints now kept on the disk)."""
    from PIL import Image

    import extractor.data.files as files_module
    import extractor.data.sources as sources_module
    import extractor.store.provenance as provenance
    from extractor.errors import StoreError

    files = make_images(tmp_path / "imgs", per_class=10, classes=("a", "b"), size=40)
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label\n" + "".join(f"{f.relative_to(tmp_path / 'imgs')},{f.parent.name}\n"
                                                 for f in files))
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=[{"layer": "conv", "reduce": "mean"}],
              data={"source": "manifest", "manifest": str(manifest), "resize": None, "crop": 32, "shard_size": 2})

    def no_stat(*args: object, **kwargs: object) -> None:
        raise AssertionError("a manifest's listing stat-ed an image file")

    with monkeypatch.context() as listing:
        for name in ("stat_prints", "folder_prints", "local_fingerprint"):
            listing.setattr(sources_module, name, no_stat)
        listing.setattr(files_module, "local_fingerprint", no_stat)
        interrupted_after(raw, 2)  # rows 0-3 computed, and maybe a shard or two more
    g = opened(str(tmp_path / "s.zarr"))
    paths, read = [str(p) for p in g["paths"][:]], np.asarray(g["status"][:]) != 0
    assert not np.asarray(g["fingerprint"][:]).any() and read[:4].all() and not read.all()
    read_prints = np.asarray(g["read_fingerprint"][:])
    assert read_prints[read].tolist() == [local_fingerprint(p) for p, r in zip(paths, read, strict=True) if r]
    assert read_prints[read].all() and not read_prints[~read].any()

    victim, touched = Path(paths[3]), Path(paths[1])
    was = victim.stat()
    Image.fromarray(np.full((50, 60, 3), 200, np.uint8)).save(victim, format=Image.open(victim).format)
    os.utime(victim, ns=(was.st_atime_ns, was.st_mtime_ns))  # its mtime put back: its ctime moved all the same
    touched.write_bytes(touched.read_bytes())  # the same bytes: another mtime, the same digest
    if relisted:
        os.utime(manifest, ns=(was.st_atime_ns, was.st_mtime_ns - 10**9))  # listed again: its rows not taken
    stat_ed: list[int] = []
    digested: list[int] = []
    if blocks is not None:
        monkeypatch.setattr(provenance, "COMPARE_ROWS", blocks[0])
        monkeypatch.setattr(provenance, "BLOCK", blocks[1])
    real_now, real_digests = provenance.paths_now, provenance.source_digests
    monkeypatch.setattr(provenance, "paths_now", lambda p, *a: stat_ed.append(len(p)) or real_now(p, *a))
    monkeypatch.setattr(provenance, "source_digests",
                        lambda g_, rows, *a, **k: digested.extend(rows.tolist()) or real_digests(g_, rows, *a, **k))
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=r"the images of 1 row computed before have changed since \(their content "
                                         r"digest differs\): 'a/a03\.png'"):
        run(parse_spec(raw))
    assert sum(stat_ed) == read.sum() and sorted(digested) == [1, 3]  # the rows read, stat-ed; the two moved, read
    raw["output"]["on_change"] = "redo"
    summary = run(parse_spec(raw))
    pending = {s for s in range(10) if not read[2 * s]}
    assert {p.shard for p in summary.per_shard} == {1} | pending  # the changed row's shard again, and the others
    clean = job(tmp_path / "imgs", tmp_path / "clean.zarr", model=TOY, capture=[{"layer": "conv", "reduce": "mean"}],
                data={"source": "manifest", "manifest": str(manifest), "resize": None, "crop": 32, "shard_size": 2})
    run(parse_spec(clean))
    a, b = open_store(str(tmp_path / "s.zarr")), open_store(str(tmp_path / "clean.zarr"))
    np.testing.assert_array_equal(a.numpy("conv"), b.numpy("conv"))
    np.testing.assert_array_equal(a.digests, b.digests)
    digested.clear()
    before = files_of(tmp_path / "s.zarr")
    assert run(parse_spec(raw)).shards_run == 0 and digested == []  # settled: every fingerprint as it is now
    assert files_of(tmp_path / "s.zarr") == before  # and nothing written
    checked = open_store(str(tmp_path / "s.zarr")).verify_objects()  # every object its commits name (the source's
    assert checked["checked"] and not checked["missing"] and not checked["damaged"]  # facts of fill values too)


@pytest.mark.parametrize("source", ["manifest", "folder"])
def test_a_store_with_a_block_of_rows_none_read_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        source: str):
    """A resume stats the files of the rows read a block of rows at a time: a block none of whose rows was read
    (a 3M-row job stopped at 1.5M; here blocks of 4 rows) has no file to stat, and the resume finishes the store
    (an empty block raised IndexError: found by an audit)."""
    import extractor.store.provenance as provenance

    monkeypatch.setattr(provenance, "COMPARE_ROWS", 4)
    files = make_images(tmp_path / "imgs", per_class=6, classes=("a", "b"), size=40)
    data: dict[str, Any] = {"resize": None, "crop": 32, "shard_size": 2}
    if source == "manifest":
        (tmp_path / "m.csv").write_text("path\n" + "".join(f"{f.relative_to(tmp_path / 'imgs')}\n" for f in files))
        data.update(source="manifest", manifest=str(tmp_path / "m.csv"))
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=[{"layer": "conv", "reduce": "mean"}],
              data=data)
    interrupted_after(raw, 1)
    assert not (np.asarray(opened(str(tmp_path / "s.zarr"))["status"][8:]) != 0).any()  # a block none read
    raw["output"]["if_exists"] = "resume"
    assert run(parse_spec(raw)).ok > 0
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.attrs["status"] == "complete" and (s.status == 1).all()
    checked = s.verify_objects()  # (a manifest without labels: its chunks of -1 are there too; an audit found them
    assert checked["checked"] and not checked["missing"] and not checked["damaged"]  # missing, as zarr leaves them)


def test_a_redo_drops_the_fingerprints_a_resume_recorded_so_a_link_pointed_back_is_named(tmp_path: Path):
    """A resume that redoes a manifest's shard (its image changed) records no fingerprint of its own for that
    shard's rows, and drops one it recorded before: the worker that computes the shard again fingerprints the file
    it reads. Else (found by an audit): a row's link pointed at A2, its redo stopped before the shard ran, the link
    pointed at B, the shard computed from B, the link pointed back at A2: the stored print was A2's, so the next
    resume took B's values for A2's image."""
    from PIL import Image

    from extractor.errors import StoreError

    files = sorted(make_images(tmp_path / "imgs", per_class=4, classes=("a", "b"), size=40))
    (tmp_path / "m.csv").write_text("path\n" + "".join(f"{f.relative_to(tmp_path / 'imgs')}\n" for f in files))
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=[{"layer": "conv", "reduce": "mean"}],
              data={"source": "manifest", "manifest": str(tmp_path / "m.csv"), "resize": None, "crop": 32,
                    "shard_size": 2, "batch_size": 2})
    row = files[4]
    targets = {}
    for name, shade in (("A", 30), ("A2", 120), ("B", 220)):
        targets[name] = tmp_path / f"{name}.png"
        Image.fromarray(np.full((40, 40, 3), shade, np.uint8)).save(targets[name])

    def point(name: str) -> None:
        row.unlink()
        row.symlink_to(targets[name])

    point("A")
    run(parse_spec(raw))
    point("A2")
    raw["output"].update(if_exists="resume", on_change="redo")

    def stop(name: str, info: dict) -> None:
        if name == "shard_started":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(parse_spec(raw), on_event=stop)  # (shard 2 made pending again, not computed)
    point("B")
    raw["output"]["on_change"] = "refuse"
    assert run(parse_spec(raw)).shards_run == 1  # shard 2, from B
    point("A2")
    with pytest.raises(StoreError, match=r"the images of 1 row computed before have changed since \(their content "
                                         rf"digest differs\): '{row.relative_to(tmp_path / 'imgs')}'"):
        run(parse_spec(raw))
