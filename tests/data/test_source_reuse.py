"""A resume takes its rows from the store while the source is as it was listed (issue 39, item 3): each source's
fingerprint (a folder's tree, a manifest's size, mtime and digest, the Parquet files') is recorded with the store;
an unchanged source is not listed again (the listing calls counted), a changed one is, and its new listing is
recorded, so the resume after it lists nothing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import job, make_images

import extractor.data.sources.folder as folder
import extractor.data.sources.manifest as manifest
from extractor.data.files import local_fingerprint
from extractor.driver.runner import run
from extractor.errors import StoreError
from extractor.spec.load import parse_spec

TOY = {"name": None, "factory": "toy_models:slow_net", "factory_kwargs": {"seconds": 0}, "device": "cpu"}
CAPTURE = [{"layer": "conv", "reduce": "mean"}]


def counted(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[object]:
    """The calls of ``module.name`` from now on."""
    calls: list[object] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def touch(path: Path) -> None:
    later = os.stat(path).st_mtime_ns + 10**9
    os.utime(path, ns=(later, later))


def test_an_unchanged_folder_is_not_listed_again_and_a_changed_one_is(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    make_images(tmp_path / "imgs", per_class=3, classes=("a", "b"), size=40)
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=CAPTURE,
              data={"resize": None, "crop": 32, "shard_size": 2})
    assert run(parse_spec(raw)).ok == 6
    walks = counted(monkeypatch, folder, "_list_folder")
    raw["output"]["if_exists"] = "resume"
    assert run(parse_spec(raw)).shards_run == 0 and walks == []  # the tree as listed: taken from the store
    first = sorted((tmp_path / "imgs" / "b").iterdir())[0]
    (first.parent / f"extra{first.suffix}").write_bytes(first.read_bytes())
    with pytest.raises(StoreError, match="different job"):  # a file added: listed again, and the listing differs
        run(parse_spec(raw))
    assert len(walks) == 1


def test_a_file_written_in_place_is_found_without_listing_the_folder(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """Its folder's mtime does not move: the tree is as listed, the rows come from the store, and each file's
    fingerprint is taken again (a stat, no listing): the changed image is found."""
    make_images(tmp_path / "imgs", per_class=3, classes=("a",), size=40)
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=CAPTURE,
              data={"resize": None, "crop": 32, "shard_size": 2})
    assert run(parse_spec(raw)).ok == 3
    walks = counted(monkeypatch, folder, "_list_folder")
    image = sorted((tmp_path / "imgs" / "a").iterdir())[1]
    other = sorted((tmp_path / "imgs" / "a").iterdir())[2]
    image.write_bytes(other.read_bytes())  # other bytes, the same name
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match="changed since"):
        run(parse_spec(raw))
    assert walks == []


def test_a_manifest_touched_is_listed_once_then_taken_from_the_store(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    files = make_images(tmp_path / "imgs", per_class=2, classes=("a", "b"), size=40)
    (tmp_path / "m.csv").write_text("path,label\n" + "".join(f"{f},{f.parent.name}\n" for f in files))
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=CAPTURE,
              data={"source": "manifest", "manifest": str(tmp_path / "m.csv"), "root": None, "outside_root": True,
                    "resize": None, "crop": 32, "shard_size": 2})
    assert run(parse_spec(raw)).ok == 4
    listed = counted(monkeypatch, manifest, "_list_manifest")
    raw["output"]["if_exists"] = "resume"
    assert run(parse_spec(raw)).shards_run == 0 and listed == []
    touch(tmp_path / "m.csv")
    assert run(parse_spec(raw)).shards_run == 0 and len(listed) == 1  # listed again, compared, recorded
    assert run(parse_spec(raw)).shards_run == 0 and len(listed) == 1  # the record says so


def test_parquet_files_touched_are_listed_once_then_taken_from_the_store(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("pyarrow")
    from test_parquet import write_hub_parquet

    import extractor.data.sources.parquet as parquet

    files = make_images(tmp_path / "imgs", per_class=2, classes=("cats", "dogs"), size=40)
    written = write_hub_parquet(sorted(files), tmp_path / "pq", per_file=2, row_group=2)
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", model=TOY, capture=CAPTURE,
              data={"source": "parquet", "root": None, "parquet": str(tmp_path / "pq" / "*.parquet"),
                    "resize": None, "crop": 32, "shard_size": 2})
    assert run(parse_spec(raw)).ok == 4
    listed = counted(monkeypatch, parquet, "list_parquet")
    raw["output"]["if_exists"] = "resume"
    assert run(parse_spec(raw)).shards_run == 0 and listed == []
    touch(written[1])
    assert run(parse_spec(raw)).shards_run == 0 and len(listed) == 1
    assert run(parse_spec(raw)).shards_run == 0 and len(listed) == 1


def test_every_declared_source_is_registered_and_the_spec_offers_exactly_them():
    from typing import get_args

    from extractor.data.sources import REGISTRY, Source, source
    from extractor.spec import SOURCE_SETTINGS
    from extractor.spec.data_spec import DataSpec

    assert get_args(DataSpec.model_fields["source"].annotation) == tuple(SOURCE_SETTINGS) == tuple(REGISTRY)
    for name in SOURCE_SETTINGS:
        assert isinstance(source(name), Source) and source(name).name == name


def test_read_bytes_asks_the_source_that_reads_a_locator(tmp_path: Path):
    from extractor.data import read_bytes
    from extractor.data.sources import source

    (tmp_path / "x.bin").write_bytes(b"0123456789")
    assert read_bytes(str(tmp_path / "x.bin")) == b"0123456789"  # a file: read whole
    assert source("tar").reads((f"{tmp_path / 'x.bin'}#m", 2, 3))
    assert read_bytes((f"{tmp_path / 'x.bin'}#m", 2, 3)) == b"234"  # a byte range: the tar source's
    assert source("parquet").reads(f"{tmp_path}/f.parquet#image/3") and not source("parquet").reads("a#b.jpg")


class _Column:
    """A store's ``paths`` column, as a resume reads it back (``Recorded``)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths, self.listing = paths, {}

    def rows(self) -> list[str]:
        return self.paths

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        assert name == "paths"
        return np.asarray(self.paths[start:stop], dtype=np.dtypes.StringDType())


@pytest.mark.parametrize("block,by_name", [(2, True), (100_000, True), (3, False)])
def test_files_now_are_each_files_own_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int,
                                                  by_name: bool):
    """The resume's stat of each file, by name in its open folder: the fingerprint files.local_fingerprint gives
    that path (0 where it cannot be seen), for files in several folders, a folder back again after another, one
    missing, a folder that cannot be read (searched only) and a symbolic link, across blocks of rows."""
    import extractor.data.sources as sources

    for d in ("a", "b", "c", "hidden"):
        (tmp_path / d).mkdir()
        for i in range(3):
            (tmp_path / d / f"{i}.jpg").write_bytes(bytes(i + len(d)))
    (tmp_path / "b" / "link.jpg").symlink_to(tmp_path / "a" / "1.jpg")
    (tmp_path / "hidden").chmod(0o311)  # no listing, a stat by path still sees its files
    paths = [str(tmp_path / p) for p in ("a/0.jpg", "a/1.jpg", "b/link.jpg", "b/0.jpg", "a/2.jpg", "c/9.jpg",
                                         "c/1.jpg", "hidden/2.jpg", "hidden/0.jpg", "c/2.jpg")]
    monkeypatch.setattr(sources, "BLOCK", block)
    monkeypatch.setattr(sources, "_BY_NAME", by_name)
    try:
        now = sources.files_now(_Column(paths))
    finally:
        (tmp_path / "hidden").chmod(0o755)
    expected = [local_fingerprint(p) for p in paths]
    assert now.tolist() == expected and expected[5] == 0 and 0 not in expected[:5] + expected[6:]
