"""`extractor plan` and `run --dry-run` (issue 28): what a job would write, before anything is written; the
sizes are the stored ones, and an existing store is left exactly as it was."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import job, write_job
from helpers.processes import cli

from extractor.driver.runner import run
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def _objects(store: Path, key: str) -> int:
    """The objects of capture ``key``'s chunks: each under the attempt that committed its shard."""
    return sum(p.is_file() and f"/{key}/c/" in str(p) for p in store.rglob("__attempts/*/**/*"))


def test_plan_says_what_the_run_writes_and_creates_nothing(image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "s.zarr", capture=[
        {"layer": "layer3", "reduce": "none"}, {"layer": "layer4", "reduce": "mean", "dtype": "float16"}])
    path = write_job(tmp_path / "job.yaml", raw)
    r = cli("plan", str(path), "--json")
    assert r.returncode == 0, r.stderr
    planned = json.loads(r.stdout)
    assert not (tmp_path / "s.zarr").exists()  # nothing created
    assert planned["action"] == "create" and planned["rows"] == 12 and planned["shards"] == 3

    run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    by_key = {c["key"]: c for c in planned["captures"]}
    for key in s.keys:  # the plan's figures are the store's
        arr = s[key]
        assert by_key[key]["shape"] == list(arr.shape[1:]) and by_key[key]["dtype"] == str(arr.dtype)
        assert by_key[key]["bytes_per_row"] == int(np.prod(arr.shape[1:])) * arr.dtype.itemsize
        assert by_key[key]["chunk_rows"] == arr.chunks[0]
        assert by_key[key]["objects"] == _objects(tmp_path / "s.zarr", key)
    assert planned["total_bytes"] == sum(c["bytes_per_row"] for c in planned["captures"]) * 12
    stored = [p for p in (tmp_path / "s.zarr").rglob("*")  # every object but the arrays' metadata and the lock file
              if p.is_file() and p.name not in ("zarr.json", "__root.json", "__lock")]
    assert planned["objects"] == len(stored), sorted(str(p.relative_to(tmp_path)) for p in stored)

    before = _files(tmp_path / "s.zarr")
    for args in (("plan", str(path)), ("run", str(path), "--dry-run"), ("plan", str(path), "--overwrite")):
        r = cli(*args)
        assert _files(tmp_path / "s.zarr") == before, args  # an existing store is untouched, also to overwrite it
    assert r.returncode == 0 and r.stdout.startswith(f"{tmp_path / 's.zarr'}: overwrite")
    r = cli("run", str(path), "--dry-run")
    assert r.returncode == 1 and "run would refuse: store" in r.stdout and "already exists" in r.stdout
    r = cli("plan", str(path), "--resume")
    assert r.returncode == 0 and "nothing to do (complete)" in r.stdout
    assert "0 images to process; 2.1 KiB per row uncompressed (layer3 2.0 KiB, layer4 128 B)" in r.stdout  # the toy


@pytest.mark.slow
def test_the_plan_of_a_resume_counts_the_objects_of_the_store_as_it_was_made(image_dir: Path, tmp_path: Path):
    """A store made unsharded stays so when resumed: its plan counts one object per chunk, not per shard."""
    raw = job(image_dir, tmp_path / "s.zarr", output={"store": str(tmp_path / "s.zarr"), "chunk_rows": 2,
                                                       "sharding": False})
    run(parse_spec(raw))
    raw["output"] = {**raw["output"], "sharding": True, "chunk_rows": "auto", "if_exists": "resume"}
    r = cli("plan", str(write_job(tmp_path / "job.yaml", raw)), "--json")
    assert r.returncode == 0, r.stderr
    planned = json.loads(r.stdout)
    assert planned["action"] == "nothing to do (complete)"
    for c in planned["captures"]:
        assert c["chunk_rows"] == 2 and c["objects"] == 6  # 12 rows in chunks of 2, as stored
        assert c["objects"] == _objects(tmp_path / "s.zarr", c["key"])


def _sampled(monkeypatch: pytest.MonkeyPatch, parts: int, over: int) -> None:
    """``extractor plan`` samples sources of more than ``over`` parts, listing ``parts`` of them."""
    import functools

    import extractor.driver.dry_run as dry_run
    from extractor.data import sample_of

    monkeypatch.setattr(dry_run, "sample_of", functools.partial(sample_of, parts=parts, over=over))


def test_the_plan_of_a_large_source_lists_a_part_of_it_and_scales_every_figure(image_dir: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    """Issue 57: a source of many Parquet files or tars is planned from a part of its files spread over it; where
    every file holds as many rows, every figure is the full listing's (rows, shards, bytes, objects)."""
    from helpers.parquet import images_of, parquet_job, write_hub_parquet
    from helpers.sources import write_tars

    from extractor.driver.dry_run import preview

    images = images_of(image_dir)
    write_hub_parquet(images, tmp_path / "pq", per_file=1, row_group=1)
    write_tars(images, tmp_path / "tars", per_tar=2)
    specs = {"Parquet files": parquet_job(image_dir, tmp_path / "p.zarr", str(tmp_path / "pq" / "*.parquet")),
             "tars": job(image_dir, tmp_path / "t.zarr", data={
                 "source": "tar", "root": None, "tars": str(tmp_path / "tars" / "shard-{000..005}.tar")})}
    _sampled(monkeypatch, parts=3, over=4)
    for unit, raw in specs.items():
        spec = parse_spec(raw)
        full, part = preview(spec, full=True), preview(spec)
        assert full.listing is not None and full.listing.sampled is None and full.listing.rows_listed == 12
        files = 12 if unit == "Parquet files" else 6
        footers = "; every file's rows counted from its footer" if unit == "Parquet files" else ""
        assert part.listing is not None and part.listing.sampled == f"3 of {files} {unit}{footers}"
        assert part.listing.rows_listed == 36 // files
        assert (part.rows, part.shards, part.todo_rows, part.action) == (full.rows, full.shards, 12, "create") == \
            (12, 3, 12, "create")
        assert (part.total_bytes, part.objects, part.captures) == (full.total_bytes, full.objects, full.captures)
        assert "extractor plan --full lists every row" in part.report()
        said = part.report().splitlines()  # its counts say they are estimates where they are (not counted rows)
        about = "" if footers else "about "
        assert said[1] == f"{about}12 rows in 3 shards of 4" + (f" (estimated from 3 of {files} {unit})" * bool(about))
        assert said[-1].startswith(f"{about}12 images to process")
        listed = [line for line in said if line.startswith(("the listing's time", "rows and sizes"))]
        assert len(listed) == 1 and listed[0].startswith(
            f"{'the listing' + chr(39) + 's time and disk' if footers else 'rows and sizes'} estimated from 3 of")
        assert full.report().splitlines()[1] == "12 rows in 3 shards of 4"
    uneven = tmp_path / "uneven"  # local Parquet files of other sizes: their rows counted from every footer
    write_hub_parquet(images[:4], uneven / "a", per_file=1, row_group=1)
    write_hub_parquet(images[4:], uneven / "b", per_file=8, row_group=8)  # by files: 10 rows x 5 / 3
    spec = parse_spec(parquet_job(image_dir, tmp_path / "u.zarr", str(uneven / "*" / "*.parquet")))
    part = preview(spec)
    assert part.listing is not None and part.listing.sampled == "3 of 5 Parquet files; every file's rows counted " \
        "from its footer" and (part.rows, part.shards) == (12, 3)
    run(parse_spec(specs["tars"]))  # a store there: what a run would do to it is decided on every row
    again = preview(parse_spec({**specs["tars"], "output": {**specs["tars"]["output"], "if_exists": "resume"}}))
    assert again.listing is not None and again.listing.sampled is None and again.action == "nothing to do (complete)"
    refused = preview(parse_spec(specs["tars"]))
    assert refused.action.startswith("run would refuse: store") and "already exists" in refused.action
    said = refused.report()  # the refusal and the listing, not a table of what a refused run would write
    assert said.startswith(f"{specs['tars']['output']['store']}: run would refuse: store") and refused.refused
    assert " shards of " not in said and "images to process" not in said and "the driver listed" in said


def test_a_large_manifest_is_planned_from_its_first_megabytes_read_against_its_own_folder(
        image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import gc

    import extractor.data.sources.manifest as manifest_source
    from extractor.data import list_rows, sample_of
    from extractor.driver.dry_run import preview

    (tmp_path / "images").symlink_to(image_dir)
    images = sorted(p for p in image_dir.rglob("*") if p.is_file()) * 20
    manifest = tmp_path / "big.csv"  # its paths relative to its own folder (no data.root)
    manifest.write_text("path,id,label\n" + "".join(f"images/{p.relative_to(image_dir)},r{n:03d},{p.parent.name}\n"
                                                     for n, p in enumerate(images)))
    monkeypatch.setattr(manifest_source, "PART_BYTES", 200)
    spec = parse_spec(job(image_dir, tmp_path / "m.zarr", data={"source": "manifest", "root": None,
                                                                  "manifest": str(manifest)}))
    sampled = sample_of(spec.data, parts=2, over=4)
    assert sampled is not None and sampled.taken <= 400 and sampled.parts == manifest.stat().st_size
    part = list_rows(sampled.data)
    whole = list_rows(spec.data)
    assert part.paths[:].tolist() == whole.paths[:len(part)].tolist()  # the same images, read against its folder
    assert all(Path(p).is_file() for p in part.paths[:].tolist())
    folder = Path(sampled.data.manifest).parent
    del sampled, part
    gc.collect()
    assert not folder.exists()  # the part's file goes with the sample
    _sampled(monkeypatch, parts=2, over=4)
    planned = preview(spec)
    assert planned.listing is not None and planned.listing.sampled.endswith("bytes of the manifest")
    assert abs(planned.rows - len(whole)) <= 0.15 * len(whole), (planned.rows, len(whole))
    import extractor.driver.dry_run as dry_run
    from extractor.errors import DataError

    def cut(data):  # a part refused where the whole is not (cut in a quoted value's newline): every row listed
        if data.manifest != str(manifest):
            raise DataError(f"{data.manifest} row 9: no image")
        return list_rows(data)

    monkeypatch.setattr(dry_run, "list_rows", cut)
    planned = preview(spec)
    assert planned.listing is not None and planned.listing.sampled is None and planned.rows == len(whole)


def test_the_plan_of_labels_named_without_data_classes_says_how_the_run_takes_them(image_dir: Path, tmp_path: Path,
                                                                                     monkeypatch: pytest.MonkeyPatch):
    """A manifest whose labels are indices beside names, data.classes not given: the plan says that the run lists it
    whole where its first block holds a name and stops at a name read later, and to list the classes; so for JSON
    lines of names whose first block holds none. Labels that are all names (a CSV's, or JSON lines' with a name in
    their first block: the run reads them first and streams the rows), data.classes given, labels that are class
    indices, or a folder (its classes are its folders): no such word."""
    import extractor.data.sources.manifest as manifest_module
    from extractor.driver.dry_run import preview

    images = sorted(p for p in image_dir.rglob("*") if p.is_file())
    for name, label in (("names", lambda p: p.parent.name), ("indices", lambda p: str(len(p.parent.name) % 2))):
        (tmp_path / f"{name}.csv").write_text("path,label\n" + "".join(
            f"{p.relative_to(image_dir)},{label(p)}\n" for p in images))
    said = r"labels are class indices beside class names \(the first name: 'cats', row 1\) and data.classes is not " \
        r"given: .* first block \(a megabyte\) holds a name, and stops at the first name read after it .*; list " \
        r"the classes' names in data.classes"

    def warned(data: dict) -> list[str]:
        return preview(parse_spec(job(image_dir, tmp_path / "s.zarr", data=data))).warnings

    manifest = {"source": "manifest", "root": str(image_dir)}
    assert warned({**manifest, "manifest": str(tmp_path / "names.csv")}) == []
    (tmp_path / "first.csv").write_text("path,label\n" + "".join(
        f"{p.relative_to(image_dir)},{p.parent.name if i == 0 else i % 2}\n" for i, p in enumerate(images)))
    assert any(re.search(said, w) for w in warned({**manifest, "manifest": str(tmp_path / "first.csv")}))
    assert warned({**manifest, "manifest": str(tmp_path / "names.csv"), "classes": ["cats", "dogs"]}) == []
    assert warned({**manifest, "manifest": str(tmp_path / "indices.csv")}) == []
    (tmp_path / "mixed.csv").write_text("path,label\n" + "".join(
        f"{p.relative_to(image_dir)},{'emu' if i == 9 else i % 2}\n" for i, p in enumerate(images)))
    assert any(re.search(r"labels are class indices beside class names \(the first name: 'emu', row 10\)", w)
               for w in warned({**manifest, "manifest": str(tmp_path / "mixed.csv")}))
    assert warned({}) == []
    monkeypatch.setattr(manifest_module, "BLOCK_BYTES", 100)  # (a block of two or three rows)
    for first in (0, 6):  # the first name in the first block, or after it
        (tmp_path / "m.jsonl").write_text("".join(json.dumps(
            {"path": str(p.relative_to(image_dir)), **({"label": p.parent.name} if i >= first else {})}) + "\n"
            for i, p in enumerate(images)))
        found = warned({**manifest, "manifest": str(tmp_path / "m.jsonl")})
        assert (first == 6) == any(re.search(r"labels are class names \(the first: '\w+', row 7\) and data.classes "
                                             r"is not given: .*stops at the first name read after it", w)
                                   for w in found) and (first == 6 or found == [])
