"""Image sources: folders, manifests, WebDataset tar shards; planning arithmetic."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers.images import make_images
from helpers.jobs import job
from helpers.sources import write_tars
from hypothesis import given
from hypothesis import strategies as st

from extractor.data.files import expand_braces
from extractor.data.listing import list_rows
from extractor.data.rows import plan
from extractor.driver.runner import run
from extractor.errors import DataError, SpecError
from extractor.read.reader import open_store
from extractor.spec.data_spec import DataSpec
from extractor.spec.load import parse_spec


def test_brace_expansion():
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand_braces("{a,b}/x-{1..2}.tar") == ["a/x-1.tar", "a/x-2.tar", "b/x-1.tar", "b/x-2.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]


def test_tar_shards_give_the_same_arrays_as_the_folder(image_dir: Path, tmp_path: Path):
    images = sorted(p for p in image_dir.rglob("*") if p.is_file())
    write_tars(images, tmp_path / "tars", per_tar=5, labels={"cats": 0, "dogs": 1})
    folder = job(image_dir, tmp_path / "f.zarr")
    tars = job(image_dir, tmp_path / "t.zarr",
               data={"source": "tar", "root": None, "tars": str(tmp_path / "tars" / "shard-{000..002}.tar")})
    run(parse_spec(folder))
    summary = run(parse_spec(tars))
    assert summary.ok == 12
    a, b = open_store(str(tmp_path / "f.zarr")), open_store(str(tmp_path / "t.zarr"))
    assert [i.rsplit(".", 1)[0] for i in a.ids] == list(b.ids)  # ids are the sample keys
    np.testing.assert_array_equal(a.labels, b.labels)
    assert str(b.paths[0]).endswith("shard-000.tar#cats/cats00.jpg")
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))
    # pictures of tar rows read the member's bytes, as the job did
    from extractor.read.figures import image_grid

    tiles = [image_grid(s, np.array([0]), columns=1).axes[0].get_images()[0].get_array() for s in (a, b)]
    np.testing.assert_array_equal(tiles[0], tiles[1])


def test_json_labels_and_class_names(image_dir: Path, tmp_path: Path):
    images = sorted(p for p in image_dir.rglob("*") if p.is_file())
    write_tars(images, tmp_path / "tars", per_tar=12, labels={"cats": 7, "dogs": 3}, json_labels=True)
    rows = list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr", data={
        "source": "tar", "root": None, "tars": [str(tmp_path / "tars" / "shard-000.tar")]})).data)
    assert list(rows.labels) == [7] * 6 + [3] * 6
    assert list(rows.locators) == ["byte_offset", "byte_size"] and len(rows.locators["byte_size"]) == 12


def test_json_metadata_without_a_label_is_not_parsed_and_a_key_written_with_escapes_is(tmp_path: Path):
    """img2dataset's .json metadata (no label) is skipped unparsed; a label key written with an escape, or in
    metadata beside others, is still read as json.loads reads it; a .cls after it wins, as before."""
    import io
    import tarfile

    import extractor.data.sources.tar as tar

    members = {"a.jpg": b"x", "a.json": b'{"url": "http://e/a.jpg", "caption": "no label here"}',
               "b.jpg": b"x", "b.json": b'{"\\u006cabel": "cat", "url": "u"}',
               "c.jpg": b"x", "c.json": b'{"status": "success",\n "label": 4}',
               "d.jpg": b"x", "d.json": b'{"label": 1}', "d.cls": b"2"}
    with tarfile.open(tmp_path / "t.tar", "w") as f:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            f.addfile(info, io.BytesIO(data))
    found = tar.scan_tar(str(tmp_path / "t.tar"), (".jpg",), {})
    assert found.each_label() == [None, "cat", 4, "2"]
    parsed, loads = [], tar.json.loads
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tar.json, "loads", lambda text: parsed.append(text) or loads(text))
        assert tar.scan_tar(str(tmp_path / "t.tar"), (".jpg",), {}).each_label() == [None, "cat", 4, "2"]
    assert len(parsed) == 3 and not any("no label here" in t for t in parsed)


def test_bad_tars_are_clear_errors(image_dir: Path, tmp_path: Path):
    def tar_job(pattern: str) -> dict:
        return job(image_dir, tmp_path / "s.zarr", data={"source": "tar", "root": None, "tars": pattern})

    (tmp_path / "bad.tar").write_bytes(b"this is not a tar archive" * 40)
    with pytest.raises(DataError, match=r"bad\.tar is not a readable tar file"):
        run(parse_spec(tar_job(str(tmp_path / "bad.tar"))))
    with tarfile.open(tmp_path / "noimg.tar", "w") as tar:
        info = tarfile.TarInfo("a/readme.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(DataError, match=r"holds no image members \(keys: a/readme\)"):
        run(parse_spec(tar_job(str(tmp_path / "noimg.tar"))))
    with pytest.raises(DataError, match="does not exist"):
        run(parse_spec(tar_job(str(tmp_path / "missing-{0..1}.tar"))))
    assert not (tmp_path / "s.zarr").exists()


def test_a_tar_member_whose_name_is_not_utf8_is_stored_under_its_shown_name(image_dir: Path, tmp_path: Path):
    """A member named in Latin-1 (a tar written elsewhere): its id and path show the byte as \\xNN (the store holds
    UTF-8; the member is read by its byte range), and its values are the same image's from a plain name."""
    image = sorted(p for p in image_dir.rglob("*.jpg"))[0]
    data = image.read_bytes()
    with tarfile.open(tmp_path / "latin.tar", "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
        for name in ("caf\xe9.jpg", "plain.jpg"):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    summary = run(parse_spec(job(image_dir, tmp_path / "s.zarr", data={
        "source": "tar", "root": None, "tars": str(tmp_path / "latin.tar")})))
    s = open_store(str(tmp_path / "s.zarr"))
    assert summary.ok == 2 and s.ids[:].tolist() == ["caf\\xe9", "plain"]
    assert s.paths[0].endswith("latin.tar#caf\\xe9.jpg")
    np.testing.assert_array_equal(s.numpy("layer4")[0], s.numpy("layer4")[1])


def test_truncated_tar_member_fails_its_row(image_dir: Path, tmp_path: Path):
    images = sorted(p for p in image_dir.rglob("*") if p.is_file())[:4]
    [tar] = write_tars(images, tmp_path / "tars", per_tar=4)
    rows = list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr",
                                    data={"source": "tar", "root": None, "tars": str(tar)})).data)
    data = tar.read_bytes()
    offsets, sizes = rows.locators["byte_offset"], rows.locators["byte_size"]
    tar.write_bytes(data[: offsets[3] + sizes[3] // 2])  # cut inside the last image
    summary = run(parse_spec(job(image_dir, tmp_path / "s.zarr",
                                 data={"source": "tar", "root": None, "tars": str(tar)})))
    assert (summary.ok, summary.failed) == (3, 1)
    assert "truncated" in summary.failures[0][2]


def test_manifest_jsonl_and_string_labels(image_dir: Path, tmp_path: Path):
    m = tmp_path / "m.jsonl"
    m.write_text('{"path": "cats/cats00.jpg", "label": "cat"}\n{"path": "dogs/dogs01.png", "label": "dog"}\n'
                 '{"path": "cats/cats02.jpg", "label": "cat", "id": "c2"}\n')
    rows = list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr", data={
        "source": "manifest", "manifest": str(m), "root": str(image_dir)})).data)
    assert list(rows.ids) == ["cats/cats00.jpg", "dogs/dogs01.png", "c2"]
    assert list(rows.labels) == [0, 1, 0] and rows.classes == ["cat", "dog"]
    m.write_text("path,id\na.jpg,x\nb.jpg,x\n")
    m2 = m.with_suffix(".csv")
    m.rename(m2)
    with pytest.raises(DataError, match="id 'x' appears in rows 1 and 2"):
        list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr", data={"source": "manifest",
                                                                       "manifest": str(m2)})).data)


def manifest_rows(image_dir: Path, tmp_path: Path, name: str, text: str):
    m = tmp_path / name
    m.write_text(text)
    return list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr", data={
        "source": "manifest", "manifest": str(m), "root": str(image_dir)})).data)


def test_whole_numbers_written_as_floats_are_integer_labels(image_dir: Path, tmp_path: Path):
    # pandas writes an int column with a gap as floats: 3.0, not a class named "3.0"
    rows = manifest_rows(image_dir, tmp_path, "m.csv", "path,label\ncats/cats00.jpg,3.0\ncats/cats01.png,5.0\n"
                         "dogs/dogs00.jpg,10.0\ndogs/dogs01.png,\ncats/cats02.jpg,7\n")
    assert list(rows.labels) == [3, 5, 10, -1, 7] and rows.classes == []
    rows = manifest_rows(image_dir, tmp_path, "m.jsonl", '{"path": "cats/cats00.jpg", "label": 1.0}\n'
                         '{"path": "dogs/dogs00.jpg", "label": 2.0}\n{"path": "dogs/dogs01.png", "label": "2.0"}\n'
                         '{"path": "cats/cats01.png", "label": null}\n{"path": "cats/cats02.jpg", "label": -1}\n')
    assert list(rows.labels) == [1, 2, 2, -1, -1] and rows.classes == []


def test_numbers_that_are_not_all_whole_stay_class_names_with_a_warning(image_dir: Path, tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture):
    with caplog.at_level("WARNING", logger="extractor.data.rows"):
        rows = manifest_rows(image_dir, tmp_path, "m.csv", "path,label\ncats/cats00.jpg,1\ncats/cats01.png,2.5\n")
    assert rows.classes == ["1", "2.5"] and list(rows.labels) == [0, 1]
    assert "m.csv row 2: label '2.5' is not a whole number, so every label is taken as a class name" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="extractor.data.rows"):
        rows = manifest_rows(image_dir, tmp_path, "m.jsonl", '{"path": "cats/cats00.jpg", "label": 0.5}\n')
    assert rows.classes == ["0.5"] and "m.jsonl row 1: label 0.5 is not a whole number" in caplog.text
    rows = manifest_rows(image_dir, tmp_path, "m.csv", "path,label\ncats/cats00.jpg,+1\ncats/cats01.png,-1\n")
    assert rows.classes == ["+1", "-1"] and list(rows.labels) == [0, 1]  # LIBSVM-style: two classes, as before


def test_class_names_stay_names_even_beside_numbers(image_dir: Path, tmp_path: Path):
    rows = manifest_rows(image_dir, tmp_path, "m.csv", "path,label\ncats/cats00.jpg,cat\ncats/cats01.png,2.5\n"
                         "dogs/dogs00.jpg,3\ndogs/dogs01.png,dog\n")
    assert rows.classes == ["2.5", "3", "cat", "dog"] and list(rows.labels) == [2, 0, 1, 3]


def test_tar_labels_written_as_floats_are_integers(image_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    images = sorted(p for p in image_dir.rglob("*") if p.is_file())
    def tar_rows(out: str, **kw):
        [tar] = write_tars(images, tmp_path / out, per_tar=12, **kw)
        return list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr", data={
            "source": "tar", "root": None, "tars": str(tar)})).data)

    rows = tar_rows("cls", labels={"cats": "3.0", "dogs": "10.0"})
    assert list(rows.labels) == [3] * 6 + [10] * 6 and rows.classes == []
    rows = tar_rows("json", labels={"cats": 2.0, "dogs": 0.0}, json_labels=True)
    assert list(rows.labels) == [2] * 6 + [0] * 6 and rows.classes == []
    with caplog.at_level("WARNING", logger="extractor.data.rows"):
        rows = tar_rows("half", labels={"cats": "0.5", "dogs": "1"})
    assert rows.classes == ["0.5", "1"] and "tar shard " in caplog.text
    assert "sample 'cats/cats00': label '0.5'" in caplog.text


def test_a_csv_manifest_saved_by_a_spreadsheet_with_a_byte_order_mark(image_dir: Path, tmp_path: Path):
    m = tmp_path / "m.csv"
    m.write_bytes("path,label\ncats/cats00.jpg,cat\ndogs/dogs01.png,dog\n".encode("utf-8-sig"))
    rows = list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr", data={
        "source": "manifest", "manifest": str(m), "root": str(image_dir)})).data)
    assert list(rows.ids) == ["cats/cats00.jpg", "dogs/dogs01.png"] and list(rows.labels) == [0, 1]


def test_folder_row_order_is_deterministic_and_labels_follow_folders(tmp_path: Path):
    make_images(tmp_path / "a", per_class=3, classes=("z", "b"))
    rows = list_rows(parse_spec(job(tmp_path / "a", tmp_path / "s.zarr")).data)
    assert list(rows.ids) == sorted(rows.ids) and rows.classes == ["b", "z"]
    assert list(rows.labels) == [0, 0, 0, 1, 1, 1]



def test_a_stray_image_in_the_root_gets_no_label_and_a_warning_and_hidden_folders_are_no_class(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    make_images(tmp_path / "a", per_class=2, classes=("z", "b"))
    (tmp_path / "a" / "top.png").write_bytes((tmp_path / "a" / "b" / "b01.png").read_bytes())
    (tmp_path / "a" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "a" / ".ipynb_checkpoints" / "c.png").write_bytes((tmp_path / "a" / "b" / "b01.png").read_bytes())
    with caplog.at_level("WARNING", logger="extractor.data.sources.folder"):
        rows = list_rows(parse_spec(job(tmp_path / "a", tmp_path / "s.zarr")).data)
    assert list(rows.ids) == ["top.png", "b/b00.jpg", "b/b01.png", "z/z00.jpg", "z/z01.png"]
    assert rows.classes == ["b", "z"] and list(rows.labels) == [-1, 0, 0, 1, 1]  # the others keep their labels
    assert "1 images lie directly in data.root (first: top.png)" in caplog.text


@given(n=st.integers(0, 5000), shard=st.integers(1, 700), chunk_div=st.integers(1, 16))
def test_every_row_in_exactly_one_shard_and_shards_align_with_chunks(n: int, shard: int, chunk_div: int):
    chunk = max(shard // chunk_div, 1)
    shard = shard // chunk * chunk  # the spec requires chunk | shard
    shards = plan(n, shard)
    covered = np.zeros(n, int)
    for s in shards:
        covered[s.start:s.stop] += 1
        assert s.start % chunk == 0 and s.start % shard == 0  # every shard starts on a chunk boundary
        assert 0 < len(s) <= shard
    assert (covered == 1).all()
    assert [s.index for s in shards] == list(range(len(shards)))


def test_batch_stream_decodes_ahead_across_shards_but_never_mixes_them():
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from extractor.data.stream import BatchStream

    started: list[str] = []
    lock = threading.Lock()

    def decode(path: str) -> torch.Tensor:
        with lock:
            started.append(path)
        if path.endswith("bad"):
            raise ValueError("not an image")
        return torch.full((3, 2, 2), int(path.split("-")[1]), dtype=torch.uint8)

    shards = [[f"s{k}-{i}" + ("-bad" if (k, i) == (1, 0) else "") for i in range(n)] for k, n in enumerate((5, 3, 2))]
    with ThreadPoolExecutor(2) as pool:
        stream = BatchStream(2, decode, pool, prefetch_batches=1)
        for paths in shards:
            stream.add(paths)
        got: list[list] = []
        for paths in shards:
            batches = []
            while (batch := stream.next()) is not None:
                batches.append(batch)
                if paths is shards[0] and batch.offsets == [4]:  # shard 0's last batch is out:
                    deadline = time.monotonic() + 120  # shard 1 already queued: a pool thread starts it
                    while not any(p.startswith("s1-") for p in started) and time.monotonic() < deadline:
                        time.sleep(0.01)  # (without waiting: a race on a loaded machine)
                    assert any(p.startswith("s1-") for p in started)  # shard 1 already decoding
            got.append(batches)
        assert stream.next() is None
    assert [[b.offsets for b in bs] for bs in got] == [[[0, 1], [2, 3], [4]], [[1], [2]], [[0, 1]]]
    assert got[1][0].failed == {0: "ValueError: not an image"}
    for bs in got:
        for b in bs:
            assert b.images[:, 0, 0, 0].tolist() == b.offsets


def test_manifest_paths_outside_the_root_are_refused_unless_allowed(image_dir: Path, tmp_path: Path):
    """issue 26, defect 8 (T3-5): ``../../etc/passwd`` and absolute paths in a manifest were read without a word
    (and the first bytes of a non-image copied into the store's errors)."""
    import re

    outside = tmp_path / "secret.txt"
    outside.write_text("password=hunter2\n")
    for path in ("../../../../etc/passwd", str(outside), "cats/../../x.jpg", "s3://bucket/x.jpg"):
        m = tmp_path / "m.csv"
        m.write_text(f"path\ncats/cats00.jpg\n{path}\n")
        with pytest.raises(DataError, match=rf"m.csv row 2: path {re.escape(repr(path))} lies outside data.root "
                                            r".*set data.outside_root: true"):
            list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr", data={"source": "manifest", "manifest": str(m),
                                                                           "root": str(image_dir)})).data)
    m.write_text(f"path\ncats/cats00.jpg\ncats/../dogs/dogs01.png\n{outside}\n")  # inside, inside, allowed
    raw = job(image_dir, tmp_path / "s.zarr", data={"source": "manifest", "manifest": str(m), "root": str(image_dir),
                                                    "outside_root": True})
    assert run(parse_spec(raw)).ok == 2
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.errors[2] == "ValueError: not an image format Pillow reads (17 bytes)"  # its content never copied
    assert "hunter2" not in "".join(map(str, s.errors))


def _tarfile_listing(path: Path) -> list[tuple[str, int, int]]:
    with tarfile.open(path, "r:") as tar:
        return [(m.name, m.offset_data, m.size) for m in tar if m.isfile()]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_tar_header_reader_lists_members_exactly_as_tarfile(tmp_path: Path, fmt: int):
    """ustar prefixes, GNU long names (L headers), pax extended and global headers, folders, links and empty
    members: the plain 512-byte header reader gives tarfile's names, data offsets and sizes."""
    from extractor.data.sources._tar_headers import _headers

    path = tmp_path / "t.tar"
    deep = "/".join(["folder-with-a-long-name"] * 5)  # 119 characters: a ustar prefix, a GNU L or pax path
    names = ["a.jpg", "a.cls", f"{deep}/b.jpg", f"{deep}/b.json", "c/d.png", "empty.jpg"]
    if fmt != tarfile.USTAR_FORMAT:
        names += ["x" * 150 + ".jpg"]  # too long for ustar
    if fmt == tarfile.PAX_FORMAT:
        names += ["ünïcödé-名前.jpg"]
    with tarfile.open(path, "w", format=fmt, pax_headers={"comment": "global"} if fmt == tarfile.PAX_FORMAT
                      else None) as tar:
        dir_info = tarfile.TarInfo("c")
        dir_info.type = tarfile.DIRTYPE
        tar.addfile(dir_info)
        for i, name in enumerate(names):
            data = b"" if name == "empty.jpg" else bytes([i]) * (100 + 700 * i)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("link.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "a.jpg"
        tar.addfile(link)
    with open(path, "rb") as f:
        listed = list(_headers(f, str(path)))
    assert listed == _tarfile_listing(path) and [n for n, _, _ in listed] == names
    cut = tmp_path / "cut.tar"  # cut inside the fourth member's header: the listing ends before it, as tarfile's
    cut.write_bytes(path.read_bytes()[: listed[3][1] - 200])
    with open(cut, "rb") as f:
        assert list(_headers(f, str(cut))) == listed[:3]


def test_a_file_that_is_not_a_tar_is_refused_by_the_header_reader(tmp_path: Path):
    from extractor.data.sources.tar import scan_tar

    for name, data in (("noise.tar", np.random.default_rng(0).bytes(4096)), ("empty.tar", b"")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=f"tar shard .*{name} is not a readable tar file"):
            scan_tar(str(tmp_path / name), [".jpg"], {})
    (tmp_path / "zeros.tar").write_bytes(bytes(1024))  # an archive of no members
    with pytest.raises(DataError, match=r"zeros.tar holds no image members"):
        scan_tar(str(tmp_path / "zeros.tar"), [".jpg"], {})


def test_a_sample_key_in_two_tars_is_refused_naming_both(tmp_path: Path):
    from extractor.data.sources.tar import list_tars

    files = make_images(tmp_path / "imgs", per_class=2, classes=("a",), size=16)
    first = write_tars(files, tmp_path / "one", per_tar=2)[0]
    second = write_tars(files[1:], tmp_path / "two", per_tar=2)[0]  # a/ of the second file again
    with pytest.raises(DataError, match=rf"sample key 'a/\w+' appears in {first} and {second}; keys must be unique"):
        list_tars([str(first), str(second)], [".png", ".jpg"], {})


def test_an_hf_imagefolder_metadata_csv_reads_as_it_is_through_data_columns(tmp_path: Path):
    """Issue 30: a Hugging Face imagefolder's metadata.csv names its image column file_name; data.columns maps
    it (and any label or id column), and the rows equal those of the same manifest with the default names."""
    from extractor.spec.data_spec import DataSpec

    files = make_images(tmp_path / "imgs", per_class=3, classes=("cat", "dog"), size=16)
    rel = [f.relative_to(tmp_path / "imgs").as_posix() for f in files]
    (tmp_path / "imgs" / "metadata.csv").write_text(
        "file_name,category,caption\n" + "".join(f"{r},{r.split('/')[0]},a photo\n" for r in rel))
    (tmp_path / "imgs" / "plain.csv").write_text("path,label\n" + "".join(f"{r},{r.split('/')[0]}\n" for r in rel))
    hf = list_rows(DataSpec(source="manifest", manifest=str(tmp_path / "imgs" / "metadata.csv"),
                            columns={"image": "file_name", "label": "category"}))
    plain = list_rows(DataSpec(source="manifest", manifest=str(tmp_path / "imgs" / "plain.csv")))
    for column in ("ids", "paths", "labels"):
        assert list(getattr(hf, column)) == list(getattr(plain, column))
    assert hf.classes == plain.classes
    assert hf.classes == ["cat", "dog"] and list(hf.labels) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(DataError, match=r"metadata.csv row 1: missing 'path' \('file_name', 'category', 'caption' "
                                        r"there\).*data.columns maps other names"):
        list_rows(DataSpec(source="manifest", manifest=str(tmp_path / "imgs" / "metadata.csv")))
    with pytest.raises(DataError, match=r"data.columns.label: 'label_name' is not a column of .*metadata.csv"):
        list_rows(DataSpec(source="manifest", manifest=str(tmp_path / "imgs" / "metadata.csv"),
                           columns={"image": "file_name", "label": "label_name"}))
    with pytest.raises(SpecError, match=r"data.columns names the columns of a table \(manifest or "
                                        r"parquet\); data.source is 'folder'"):
        parse_spec({**job(tmp_path / "imgs", tmp_path / "s.zarr"), "data": {"root": str(tmp_path / "imgs"),
                                                                           "columns": {"image": "file_name"}}})


def test_data_classes_name_integer_labels_and_order_named_ones(tmp_path: Path):
    """Issue 30: data.classes gives integer labels (a tar's .cls) their names, stored as the store's classes and
    checked against the labels seen; labels that are names take their index from it."""
    from extractor.spec.data_spec import DataSpec

    files = make_images(tmp_path / "imgs", per_class=2, classes=("a", "b"), size=16)
    tars = write_tars(files, tmp_path / "tars", per_tar=2, labels={"a": 0, "b": 1})
    pattern = str(tmp_path / "tars" / "shard-{000..001}.tar")
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", data={"source": "tar", "root": None, "tars": pattern,
                                                             "classes": ["apple", "banana"]})
    run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.classes == ["apple", "banana"] and s.labels.tolist() == [0, 0, 1, 1]
    with pytest.raises(DataError, match=r"row 'b/\w+' has label 1, but data.classes names 1 classes \(labels 0 to 0, "
                                        r"or -1: none\)"):
        list_rows(DataSpec(source="tar", tars=pattern, classes=("apple",)))
    folder = list_rows(DataSpec(root=str(tmp_path / "imgs"), classes=("b", "a")))  # names: the order given
    assert folder.classes == ["b", "a"] and list(folder.labels) == [1, 1, 0, 0]
    with pytest.raises(DataError, match=r"labels 'b' are not in data.classes \(2 names\)"):
        list_rows(DataSpec(root=str(tmp_path / "imgs"), classes=("a", "c")))
    with pytest.raises(ValueError, match=r"data.classes names a class twice"):
        DataSpec(root="x", classes=("a", "a"))
    assert len(tars) == 2


def test_a_sample_with_two_images_is_refused_naming_both(image_dir: Path, tmp_path: Path):
    """A key names one sample and its one image: a second image under the key (a repeated member, or .jpg beside
    .png) is ambiguous, refused before any work; data.extensions picks one."""
    images = sorted(p for p in image_dir.rglob("*") if p.is_file())
    tar = tmp_path / "two.tar"
    with tarfile.open(tar, "w") as t:
        t.add(images[0], arcname="k0.jpg")
        t.add(images[1], arcname="k0.png")
        t.add(images[2], arcname="k1.jpg")
    with pytest.raises(DataError, match=r"two.tar: sample 'k0' has two images, k0.jpg and k0.png: a key names one "
                                        r"sample.*set data.extensions"):
        list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr", data={"source": "tar", "root": None,
                                                                         "tars": str(tar)})).data)
    rows = list_rows(parse_spec(job(image_dir, tmp_path / "s.zarr", data={
        "source": "tar", "root": None, "tars": str(tar), "extensions": [".jpg"]})).data)
    assert rows.ids.tolist() == ["k0", "k1"] and [p.rsplit("#", 1)[1] for p in rows.paths] == ["k0.jpg", "k1.jpg"]


@pytest.mark.parametrize("text", ["", "path,label\n"])
def test_an_empty_manifest_is_said_to_hold_no_rows_not_to_lack_extensions(tmp_path: Path, text: str):
    """A manifest with a header alone, or nothing: said so (its rows are not filtered by data.extensions, which
    the message named)."""
    (tmp_path / "m.csv").write_text(text)
    with pytest.raises(DataError, match=r"^no images found in .*m\.csv \(it holds no rows: a header at most\); check "
                                        r"data\.manifest$"):
        list_rows(DataSpec(source="manifest", manifest=str(tmp_path / "m.csv"), root=str(tmp_path)))


def test_data_tars_takes_globs_as_data_parquet_does(image_dir: Path, tmp_path: Path):
    """``data.tars: shards/*.tar`` lists the tars it matches, sorted (it was taken as one file named ``*.tar``, "does
    not exist"); one that matches nothing says what patterns the setting takes."""
    images = sorted(p for p in image_dir.rglob("*") if p.is_file())
    write_tars(images, tmp_path / "tars", per_tar=5)
    braces = list_rows(DataSpec(source="tar", tars=str(tmp_path / "tars" / "shard-{000..002}.tar")))
    globbed = list_rows(DataSpec(source="tar", tars=str(tmp_path / "tars" / "*.tar")))
    assert list(globbed.ids) == list(braces.ids) and list(globbed.paths) == list(braces.paths) and len(braces) == 12
    with pytest.raises(DataError, match=r"data\.tars '.*nothing-\*\.tar' names no tar shards; check the paths and "
                                        r"patterns \(brace ranges .*, or globs such as shards/\*\.tar\)$"):
        list_rows(DataSpec(source="tar", tars=str(tmp_path / "tars" / "nothing-*.tar")))


def test_a_path_with_glob_characters_is_taken_as_named_where_it_is_one(tmp_path: Path):
    """A tar's URL with a query string (``?download=true``) and a local file whose folder is named ``run[1]`` are
    the files they name, not globs (a glob matching nothing refused them); ``*`` still matches."""
    from extractor.data.files import matched_urls

    url = "https://huggingface.co/datasets/o/n/resolve/main/shard-000.tar?download=true"
    assert matched_urls(url, {}, "data.tars") == [url]
    (tmp_path / "run[1]").mkdir()
    (tmp_path / "run[1]" / "shard-000.tar").write_bytes(b"")
    (tmp_path / "run[1]" / "shard-001.tar").write_bytes(b"")
    named = str(tmp_path / "run[1]" / "shard-000.tar")
    assert matched_urls(named, {}, "data.tars") == [named]
    assert matched_urls(str(tmp_path / "run?1?" / "*.tar"), {}, "data.tars") == \
        [named, str(tmp_path / "run[1]" / "shard-001.tar")]
