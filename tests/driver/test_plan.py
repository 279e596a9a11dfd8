"""`extractor plan` and `run --dry-run` (issue 28): what a job would write, before anything is written; the
sizes are the stored ones, and an existing store is left exactly as it was."""

from __future__ import annotations

import json
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
