"""A resume that finds the source moved but not its images (files touched, tars written again with the same
members) records the new fingerprints and listing, so that the next resume neither reads those images again nor
lists the tars again (issue 39, item 4); with nothing moved it writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers.images import make_images
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
    assert run(parse_spec(raw)).ok == 6
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
    stored = np.asarray(opened(str(tmp_path / "s.zarr"))["fingerprint"][:])
    assert (stored != 0).all()
