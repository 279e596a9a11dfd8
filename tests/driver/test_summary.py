"""A run's summary at its end (issue 57): its row counts are the sums of the shards' commits, and its failed rows
read from the shards whose commits count some, not the whole status array (at 400M rows, 400 MB in 390,625
objects); what it says equals the status array counted by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import job

import extractor.store.session as session
from extractor.driver.runner import run
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec


def test_a_runs_counts_and_failed_rows_come_from_its_commits(image_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "images"
    shutil.copytree(image_dir, root)
    for name in ("cats/b0.jpg", "cats/zz.jpg", "dogs/b1.jpg", "dogs/zz.png"):  # in several shards
        (root / name).write_bytes(b"\xff\xd8\xff not an image")

    def whole(*args, **kwargs):
        raise AssertionError("the status array was read whole")

    monkeypatch.setattr(session, "read_all", whole)
    summary = run(parse_spec(job(root, tmp_path / "s.zarr", data={"shard_size": 4})))
    status = open_store(str(tmp_path / "s.zarr")).status[:]
    failed = np.flatnonzero(status == 2).tolist()
    assert len(failed) == 4 and len({r // 4 for r in failed}) >= 2
    assert (summary.rows, summary.ok, summary.failed, summary.pending) == \
        (len(status), int((status == 1).sum()), 4, 0)
    assert [r for r, _, _ in summary.failures] == failed
    assert all("image" in error.lower() or "identify" in error.lower() for _, _, error in summary.failures), \
        summary.failures
