"""Every data source keeps the one contract (issue 56): the same images, given as a folder, a manifest, WebDataset
tars or Parquet files, list as rows in a fixed order, with unique ids and their classes; a row's bytes read back
through the registry (``read_bytes`` of its path and locators, as a worker reads them from the store) are the
image's own; what a listing was made from is the same when nothing changed, and JSON. A new source joins the
registry only with a case here."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import job
from helpers.parquet import images_of, write_hub_parquet
from helpers.sources import write_tars

from extractor.data import list_rows, spill
from extractor.data.rows import Joined, Texts
from extractor.data.sources import REGISTRY, read_bytes, source
from extractor.spec.load import parse_spec

CLASSES = ["cats", "dogs"]


def _data(name: str, image_dir: Path, tmp_path: Path) -> dict:
    """The ``data`` section of each source over the same images."""
    images = images_of(image_dir)
    if name == "folder":
        return {"source": "folder", "root": str(image_dir)}
    if name == "manifest":
        lines = [f"{p.relative_to(image_dir)},{p.parent.name}" for p in images]
        (tmp_path / "m.csv").write_text("path,label\n" + "\n".join(lines) + "\n")
        return {"source": "manifest", "manifest": str(tmp_path / "m.csv"), "root": str(image_dir)}
    if name == "tar":
        write_tars(images, tmp_path / "tars", per_tar=5, labels={c: i for i, c in enumerate(CLASSES)})
        return {"source": "tar", "root": None, "tars": str(tmp_path / "tars" / "shard-{000..002}.tar")}
    pytest.importorskip("pyarrow")
    write_hub_parquet(images, tmp_path / "data", per_file=5, row_group=2)
    return {"source": "parquet", "root": None, "parquet": str(tmp_path / "data" / "train-*.parquet")}


@pytest.mark.parametrize("name", ["folder", "manifest", "tar", "parquet"])
def test_every_source_lists_and_reads_the_same_images(name: str, image_dir: Path, tmp_path: Path):
    data = parse_spec(job(image_dir, tmp_path / "s.zarr", data=_data(name, image_dir, tmp_path))).data
    src = source(name)
    rows, again = src.list(data), src.list(data)
    n = len(rows)
    ids = [str(i) for i in rows.ids]
    assert n == len(images_of(image_dir)) and len(set(ids)) == n  # every image once, ids unique
    assert ids == [str(i) for i in again.ids]  # a fixed order
    by_hand = {hashlib.sha256(p.read_bytes()).hexdigest(): p.parent.name for p in images_of(image_dir)}
    names = rows.classes or CLASSES  # tars' .cls files hold the class numbers alone
    read = {}
    for i in range(n):
        locator = (str(rows.paths[i]), *(rows.locators[a.name][i].item() for a in src.locators))
        data_bytes = read_bytes(locator if src.locators else locator[0], None)
        label = int(rows.labels[i])
        read[hashlib.sha256(data_bytes).hexdigest()] = names[label] if label >= 0 else None
    assert read == by_hand  # each row's bytes are one image's, with its class
    assert np.asarray(rows.fingerprints if rows.fingerprints is not None else np.zeros(n)).shape == (n,)
    now = src.listing(data)
    assert now == src.listing(data) and (now is None or json.loads(json.dumps(now)) == now)


def test_every_registered_source_keeps_the_contract():
    assert sorted(REGISTRY) == sorted(["folder", "manifest", "tar", "parquet"])  # a new one: a case above


@pytest.mark.parametrize("name", ["folder", "manifest", "tar", "parquet"])
def test_every_source_lists_the_same_rows_when_they_spill_to_the_disk(name: str, image_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """Issue 57: past a megabyte a column of the listing goes to the disk (``data.spill``); forced at 16 bytes and
    buckets of 2 hashes, every column listed is the one listed in memory."""
    data = parse_spec(job(image_dir, tmp_path / "s.zarr", data=_data(name, image_dir, tmp_path))).data
    held = list_rows(data)
    monkeypatch.setattr(spill, "SPILL_BYTES", 16)
    monkeypatch.setattr(spill, "BUCKET_ROWS", 2)
    spilled = list_rows(data)
    ids = spilled.ids.tails if isinstance(spilled.ids, Joined) else spilled.ids  # (a Parquet file's row numbers)
    assert spill.on_disk(ids.data if isinstance(ids, Texts) else ids) and spill.on_disk(spilled.labels)
    assert spilled.ids.tolist() == held.ids.tolist() and list(spilled.paths) == list(held.paths)
    assert spilled.labels.tolist() == held.labels.tolist() and spilled.classes == held.classes
    assert (spilled.fingerprints is None) == (held.fingerprints is None)
    if held.fingerprints is not None:
        assert spilled.fingerprints.tolist() == held.fingerprints.tolist()
    assert {k: v.tolist() for k, v in spilled.locators.items()} == {k: v.tolist() for k, v in held.locators.items()}
    assert spilled.listing == held.listing

