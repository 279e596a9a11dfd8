"""Where stored paths point: '#' in tar paths and member names, absolute local paths."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest
from helpers.images import make_images
from helpers.jobs import job
from helpers.sources import write_tars

from extractor.data import read_bytes
from extractor.data.decode import open_rgb
from extractor.data.listing import list_rows
from extractor.driver.runner import run
from extractor.errors import DataError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec


def tar_with_hashes(images: list[Path], path: Path) -> dict[str, bytes]:
    """A tar whose member names hold '#' too; returns member name -> the image's bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    members = {}
    with tarfile.open(path, "w") as tar:
        for n, img in enumerate(images):
            name = f"{img.parent.name}/x#{n}{img.suffix}"
            tar.add(img, arcname=name)
            members[name] = img.read_bytes()
    return members


def tar_job(image_dir: Path, store: Path, tars: str) -> dict:
    return job(image_dir, store, data={"source": "tar", "root": None, "tars": tars})


def test_a_hash_in_the_tar_path_and_in_member_names(image_dir: Path, tmp_path: Path):
    images = sorted(p for p in image_dir.rglob("*") if p.is_file())[:5]
    tar = tmp_path / "run#1" / "shard#a.tar"
    members = tar_with_hashes(images, tar)
    summary = run(parse_spec(tar_job(image_dir, tmp_path / "s.zarr", str(tar))))
    assert (summary.ok, summary.failed) == (5, 0), summary.failures
    s = open_store(str(tmp_path / "s.zarr"))
    assert [str(p) for p in s.paths] == [f"{tar}#{m}" for m in members]
    for row, data in enumerate(members.values()):  # the reader's locator reads the member back
        assert read_bytes(s.locator(row)) == data
    assert open_rgb(s.locator(0)).size == open_rgb(str(images[0])).size


def test_a_tar_path_with_a_file_at_one_of_its_hashes_is_refused(image_dir: Path, tmp_path: Path):
    images = sorted(p for p in image_dir.rglob("*") if p.is_file())[:2]
    tar = tmp_path / "run#1" / "shard.tar"
    tar_with_hashes(images, tar)
    (tmp_path / "run").write_bytes(b"a file where the tar's path has a '#'")
    with pytest.raises(DataError, match=r"run is a file too"):
        list_rows(parse_spec(tar_job(image_dir, tmp_path / "s.zarr", str(tar))).data)


def test_a_hash_in_a_remote_tar_url(image_dir: Path, tmp_path: Path):
    import fsspec

    images = sorted(p for p in image_dir.rglob("*") if p.is_file())[:3]
    members = tar_with_hashes(images, tmp_path / "local.tar")
    url = "memory://extractor-test-hash/run#1/shard.tar"
    fs = fsspec.filesystem("memory")
    fs.pipe(url, (tmp_path / "local.tar").read_bytes())
    try:
        rows = list_rows(parse_spec(tar_job(image_dir, tmp_path / "s.zarr", url)).data)
        assert list(rows.paths) == [f"{url}#{m}" for m in members]  # URLs are stored as given
        got = [read_bytes((p, o, n)) for p, o, n in zip(rows.paths, *rows.locators.values(), strict=True)]
        assert got == list(members.values())
    finally:
        fs.rm("memory://extractor-test-hash", recursive=True)


def test_local_paths_are_stored_absolute_and_read_from_any_directory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    files = make_images(work / "images", per_class=2)
    elsewhere.mkdir()
    [tar] = write_tars(files, work / "tars", per_tar=4)
    (work / "lists").mkdir()
    (work / "lists" / "m.csv").write_text("path,label\n../images/cats/cats00.jpg,0\nmemory://b/x.jpg,1\n")
    monkeypatch.chdir(work)

    def rows_of(**data):
        return list_rows(parse_spec(job(Path("images"), tmp_path / "s.zarr", data=data)).data)

    folder = rows_of()
    assert list(folder.ids) == ["cats/cats00.jpg", "cats/cats01.png", "dogs/dogs00.jpg", "dogs/dogs01.png"]  # unchanged
    assert all(os.path.isabs(p) for p in list(folder.paths))
    # ../ and a URL: outside the root by design
    in_root = rows_of(source="manifest", manifest="lists/m.csv", outside_root=True)  # relative to data.root
    no_root = rows_of(source="manifest", manifest="lists/m.csv", root=None, outside_root=True)  # to the manifest
    assert list(in_root.ids) == list(no_root.ids) == ["../images/cats/cats00.jpg", "memory://b/x.jpg"]
    assert no_root.paths[1] == "memory://b/x.jpg" and os.path.isabs(no_root.paths[0])
    tars = rows_of(source="tar", root=None, tars="tars/shard-{000..000}.tar")
    assert tars.ids.tolist() == ["cats/cats00", "cats/cats01", "dogs/dogs00", "dogs/dogs01"]
    assert all(p.startswith(f"{os.path.realpath(tar)}#") for p in tars.paths)

    monkeypatch.chdir(elsewhere)  # a Ray worker or a later reader, in another directory
    assert [read_bytes(p) for p in list(folder.paths)] == [f.read_bytes() for f in files]
    assert read_bytes(no_root.paths[0]) == files[0].read_bytes()
    assert read_bytes(in_root.paths[0]) == files[0].read_bytes()  # images/../images/cats/cats00.jpg
    got = [read_bytes((p, o, n)) for p, o, n in zip(tars.paths, *tars.locators.values(), strict=True)]
    assert got == [f.read_bytes() for f in files]


def test_a_store_of_a_relative_root_shows_its_images_from_another_directory(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    files = make_images(tmp_path / "work" / "images", per_class=2)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert run(parse_spec(job(Path("images"), tmp_path / "s.zarr"))).ok == 4
    monkeypatch.chdir(tmp_path / "elsewhere")
    s = open_store(str(tmp_path / "s.zarr"))
    assert list(s.ids) == ["cats/cats00.jpg", "cats/cats01.png", "dogs/dogs00.jpg", "dogs/dogs01.png"]
    assert open_rgb(s.locator(0)).size == open_rgb(str(files[0])).size
