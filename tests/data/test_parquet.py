"""Parquet files as a source (issue 30): the Hugging Face layout written by pyarrow and by the ``datasets`` library,
equal row for row to the same images from a folder and from tars; row groups read once and only their image
column; the tar source's promises for bad files, bad rows and missing columns."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.jobs import job
from helpers.parquet import CLASSES, images_of, parquet_job, write_hub_parquet
from helpers.sources import write_tars
from helpers.stores import pending

from extractor.data.listing import list_rows
from extractor.data.rows import labels_of
from extractor.data.sources.parquet import row_groups
from extractor.driver.runner import run
from extractor.errors import DataError
from extractor.read.reader import open_store
from extractor.spec.data_spec import DataSpec
from extractor.spec.load import parse_spec

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")









def test_parquet_equals_the_folder_and_the_tars_row_for_row(image_dir: Path, tmp_path: Path):
    images = images_of(image_dir)
    write_hub_parquet(images, tmp_path / "data", per_file=5, row_group=2)  # 3 files, row groups of 2, 2, 1
    write_tars(images, tmp_path / "tars", per_tar=5, labels={"cats": 0, "dogs": 1})
    run(parse_spec(job(image_dir, tmp_path / "f.zarr")))
    run(parse_spec(job(image_dir, tmp_path / "t.zarr", data={"source": "tar", "root": None, "tars": str(
        tmp_path / "tars" / "shard-{000..002}.tar")})))
    before = row_groups.reads
    summary = run(parse_spec(parquet_job(image_dir, tmp_path / "p.zarr", str(tmp_path / "data" / "train-*.parquet"))))
    assert summary.ok == 12
    assert row_groups.reads - before == 3 + 3 + 1  # files of 5, 5, 2 rows in row groups of 2: each read once
    f, t, p = (open_store(str(tmp_path / n)) for n in ("f.zarr", "t.zarr", "p.zarr"))
    assert p.classes == CLASSES == f.classes and p.labels.tolist() == f.labels.tolist() == t.labels.tolist()
    assert p.ids.tolist()[:6] == ["train-00000-of-00003/0", "train-00000-of-00003/1", "train-00000-of-00003/2",
                                  "train-00000-of-00003/3", "train-00000-of-00003/4", "train-00001-of-00003/0"]
    assert str(p.paths[6]).endswith("train-00001-of-00003.parquet#image/1")
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(p.numpy(key), f.numpy(key))
        np.testing.assert_array_equal(p.numpy(key), t.numpy(key))
    from extractor.read.figures import image_grid, pixels  # pictures read the row's bytes, as the job did

    np.testing.assert_array_equal(pixels(image_grid(p, np.array([7]), columns=1)),
                                  pixels(image_grid(f, np.array([7]), columns=1)))


def test_an_image_rewritten_after_a_run_in_the_same_process_is_found_changed(image_dir: Path, tmp_path: Path):
    """The row groups a run read stay cached in its process (the local backend's worker is the driver): a check
    that reads the rows again (verify, and a resume's changed_rows) reads the files as they are now."""
    images = images_of(image_dir)
    paths = write_hub_parquet(images, tmp_path / "data", per_file=12, row_group=4)
    run(parse_spec(parquet_job(image_dir, tmp_path / "p.zarr", str(paths[0]))))
    assert row_groups.groups  # what the run read, kept
    write_hub_parquet([images[5], *images[1:]], tmp_path / "data", per_file=12, row_group=4)  # row 0: another image
    found = open_store(str(tmp_path / "p.zarr")).verify()
    assert found["checked"] == 12 and [row for row, _ in found["changed"]] == [0]


def test_a_shard_reads_only_its_row_groups_and_only_the_image_column(image_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    images = images_of(image_dir)
    [path] = write_hub_parquet(images, tmp_path / "data", per_file=12, row_group=4)  # 3 row groups of 4 rows
    reads: list[tuple[int, tuple[str, ...]]] = []
    wholes: list[tuple[str, ...]] = []
    real_group, real_read = pq.ParquetFile.read_row_group, pq.ParquetFile.read

    def group(self, i, columns=None, **kw):
        reads.append((i, tuple(columns or ("every column",))))
        return real_group(self, i, columns=columns, **kw)

    def whole(self, columns=None, **kw):
        wholes.append(tuple(columns or ("every column",)))
        return real_read(self, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", group)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    raw = parquet_job(image_dir, tmp_path / "s.zarr", str(path), shard_size=4)
    assert run(parse_spec(raw)).ok == 12
    assert sorted(reads) == [(0, ("image",)), (1, ("image",)), (2, ("image",))]  # once each, the image only
    assert wholes == [("label",)]  # planning: the footer and the label column
    # a shard run alone (the resume of one shard) reads its one row group

    pending(str(tmp_path / "s.zarr"), [1])
    reads.clear()
    raw["output"]["if_exists"] = "resume"
    assert run(parse_spec(raw)).shards_run == 1
    assert reads == [(1, ("image",))]


def test_datasets_library_parquet_and_column_mapping(image_dir: Path, tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    images = images_of(image_dir)
    features = datasets.Features({"img": datasets.Image(), "category": datasets.ClassLabel(names=CLASSES),
                                  "key": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"img": [str(p) for p in images],
                                     "category": [CLASSES.index(p.parent.name) for p in images],
                                     "key": [p.stem for p in images]}, features=features)
    ds.to_parquet(str(tmp_path / "hf.parquet"))
    rows = list_rows(DataSpec(source="parquet", parquet=str(tmp_path / "hf.parquet"),
                              columns={"image": "img", "label": "category", "id": "key"}))
    assert rows.ids.tolist() == [p.stem for p in images] and rows.classes == CLASSES
    assert rows.labels.tolist() == [CLASSES.index(p.parent.name) for p in images]
    raw = parquet_job(image_dir, tmp_path / "s.zarr", str(tmp_path / "hf.parquet"),
                      columns={"image": "img", "label": "category", "id": "key"},
                      outside_root=True)  # to_parquet keeps files' absolute paths (no bytes): elsewhere by design
    run(parse_spec(raw))
    run(parse_spec(job(image_dir, tmp_path / "f.zarr")))
    a, b = open_store(str(tmp_path / "s.zarr")), open_store(str(tmp_path / "f.zarr"))
    np.testing.assert_array_equal(a.numpy("layer4"), b.numpy("layer4"))
    assert a.classes == b.classes


def test_bad_parquet_files_missing_columns_and_bad_rows(image_dir: Path, tmp_path: Path):
    images = images_of(image_dir)
    [good] = write_hub_parquet(images, tmp_path / "data", per_file=12, row_group=6)
    not_parquet = tmp_path / "data" / "notes.parquet"
    not_parquet.write_text("not a parquet file")
    with pytest.raises(DataError, match=r"notes.parquet is not a readable Parquet file"):
        list_rows(DataSpec(source="parquet", parquet=str(not_parquet)))
    truncated = tmp_path / "cut.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError, match=r"cut.parquet is not a readable Parquet file"):
        list_rows(DataSpec(source="parquet", parquet=str(truncated)))
    with pytest.raises(DataError, match=r"has no image column 'jpg' \(its columns: image, label\); name it with "
                                        r"data.columns"):
        list_rows(DataSpec(source="parquet", parquet=str(good), columns={"image": "jpg"}))
    with pytest.raises(DataError, match=r"data.columns: 'cls' is not a column of"):
        list_rows(DataSpec(source="parquet", parquet=str(good), columns={"label": "cls"}))
    with pytest.raises(DataError, match=r"names no Parquet files"):
        list_rows(DataSpec(source="parquet", parquet=str(tmp_path / "none-*.parquet")))
    # a row whose bytes are not an image fails that row only; the others are computed
    table = pq.read_table(good)
    column = table.column("image").to_pylist()
    column[3] = {"bytes": b"garbage, not an image", "path": "x.jpg"}
    bad = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(0, "image", pa.array(column, type=table.schema.field("image").type)), bad,
                   row_group_size=6)
    summary = run(parse_spec(parquet_job(image_dir, tmp_path / "s.zarr", str(bad))))
    s = open_store(str(tmp_path / "s.zarr"))
    assert summary.failed == 1 and s.status.tolist()[3] == 2 and (np.delete(s.status, 3) == 1).all()
    assert str(s.errors[3]) == "ValueError: not an image format Pillow reads (21 bytes)"
    # a row group spoilt after planning (its pages overwritten, the footer intact): its rows fail, the others not
    spoilt = tmp_path / "spoilt.parquet"
    data = bytearray(good.read_bytes())
    chunk = pq.ParquetFile(good).metadata.row_group(1).column(0)  # the second row group's image bytes
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    data[start + 16:start + chunk.total_compressed_size - 16] = b"\x07" * (chunk.total_compressed_size - 32)
    spoilt.write_bytes(bytes(data))
    summary = run(parse_spec(parquet_job(image_dir, tmp_path / "spoilt.zarr", str(spoilt))))
    s = open_store(str(tmp_path / "spoilt.zarr"))
    assert summary.failed == 6 and s.status.tolist() == [1] * 6 + [2] * 6, s.errors[:]
    assert all(str(e) for e in s.errors[6:]) and not any(str(e) for e in s.errors[:6])


def test_an_empty_file_and_ids_twice_in_one_file_are_said_so(tmp_path: Path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"image": pa.array([], pa.binary())}), empty)
    with pytest.raises(DataError, match=r"no images found in .*empty.parquet \(its files hold no rows\); check "
                                        r"data.parquet"):
        list_rows(DataSpec(source="parquet", parquet=str(empty)))
    twice = tmp_path / "twice.parquet"
    pq.write_table(pa.table({"image": [b"x"] * 4, "id": ["a", "b", "c", "b"]}), twice)
    with pytest.raises(DataError, match=r"id 'b' appears twice: .*twice.parquet row 1 and .*twice.parquet row 3"):
        list_rows(DataSpec(source="parquet", parquet=str(twice)))
    table = pa.table({"image": [b"x"] * 2})  # no id column: FILE/ROW, of two files of one name but its extension
    pq.write_table(table, tmp_path / "same.parquet")
    with pa.ipc.new_stream(str(tmp_path / "same.arrow"), table.schema) as stream:
        stream.write_table(table)
    with pytest.raises(DataError, match=r"id 'same/0' appears twice: .*same.parquet row 0 and .*same.arrow row 0"):
        list_rows(DataSpec(source="parquet", parquet=[str(tmp_path / "same.parquet"), str(tmp_path / "same.arrow")]))


def test_ids_and_labels_of_every_column_type_are_each_rows_value(tmp_path: Path):
    """Ids and labels are taken from Arrow columns in bulk: each row's is what its Python value gives (an empty or
    missing id: FILE/ROW; a label by type and value)."""
    files = {"0.parquet": {"label": pa.array(["cat", "cat", "dog", "dog"])},  # no id column: made, then as text
             "a.parquet": {"id": pa.array(["x", None, "", "é"]), "label": pa.array(["dog", None, "cat", "dog"])},
             "b.parquet": {"id": pa.array([10, None, 12, 13]), "label": pa.array([1.0, 2.0, None, 1.0])},
             "c.parquet": {"id": pa.array(["y", "z", "w", "v"], pa.large_string()),
                           "label": pa.array(["cat", "dog", "bird", "cat"]).dictionary_encode()}}
    want_ids, want_labels = [], []
    for name, columns in files.items():
        pq.write_table(pa.table({"image": [b"x"] * 4, **columns}), tmp_path / name)
        stem = name.removesuffix(".parquet")
        given = columns["id"].to_pylist() if "id" in columns else [None] * 4
        want_ids += [str(g) if g not in (None, "") else f"{stem}/{r}" for r, g in enumerate(given)]
        want_labels += columns["label"].to_pylist()
    rows = list_rows(DataSpec(source="parquet", parquet=str(tmp_path / "*.parquet")))
    assert rows.ids.tolist() == want_ids
    codes, classes = labels_of(want_labels)  # the reference: the labels one by one (1.0 among names: a name)
    assert rows.labels.tolist() == codes.tolist() and rows.classes == classes == ["1.0", "2.0", "bird", "cat", "dog"]


def test_ids_made_from_file_and_row_are_held_as_the_files_and_numbers_and_hash_as_their_text(tmp_path: Path):
    """Files without an id column: each id ``FILE/ROW`` held as its file's part and its row's number (no string
    made a row), read, hashed for the store's id index and digested as the strings they are."""
    from extractor.data.rows import Joined, strings, text_hashes
    from extractor.store.layout import NamesDigest

    for name, n in (("a.parquet", 3), ("sub/b.parquet", 12)):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        pq.write_table(pa.table({"image": [b"x"] * n}), tmp_path / name)
    rows = list_rows(DataSpec(source="parquet", parquet=[str(tmp_path / "a.parquet"), str(tmp_path / "sub/b.parquet")]))
    want = [f"a/{r}" for r in range(3)] + [f"sub/b/{r}" for r in range(12)]
    assert isinstance(rows.ids, Joined) and rows.ids[0:15].tolist() == want and rows.ids[14] == "sub/b/11"
    assert text_hashes(rows.ids).tolist() == text_hashes(strings(want)).tolist()  # the id index's, as text's
    assert NamesDigest.of(rows.ids) == NamesDigest.of(strings(want))


def test_integer_labels_without_names_take_data_classes(image_dir: Path, tmp_path: Path):
    [path] = write_hub_parquet(images_of(image_dir), tmp_path / "data", per_file=12, row_group=12, names=False)
    plain = list_rows(DataSpec(source="parquet", parquet=str(path)))
    assert plain.classes == [] and plain.labels.tolist() == [0] * 6 + [1] * 6
    named = list_rows(DataSpec(source="parquet", parquet=str(path), classes=("cat", "dog")))
    assert named.classes == ["cat", "dog"] and named.labels.tolist() == plain.labels.tolist()
    with pytest.raises(DataError, match=r"has label 1, but data.classes names 1 classes"):
        list_rows(DataSpec(source="parquet", parquet=str(path), classes=("cat",)))


def test_labels_a_dataframe_wrote_as_floats_are_class_indices_and_labels_beside_class_names_are_checked(
        tmp_path: Path):
    """pandas writes an integer column with gaps as floats, its gaps NaN: whole numbers are class indices, NaN none,
    and the files' ClassLabel names apply. A label below -1 is refused (it indexed the names from their end), and
    so is a label column of names in files whose metadata names classes (it was taken as names, the metadata
    ignored)."""
    import json

    def write(name: str, labels: Any, names: list[str] | None = ("cat", "dog", "eel")) -> str:
        table = pa.table({"image": [b"x"] * len(labels), "label": labels})
        if names:
            table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": {
                "label": {"names": list(names), "_type": "ClassLabel"}}}})})
        pq.write_table(table, tmp_path / name)
        return str(tmp_path / name)

    floats = write("f.parquet", pa.array([0.0, 2.0, None, 2.0, float("nan")], pa.float64()))
    rows = list_rows(DataSpec(source="parquet", parquet=floats))
    assert rows.labels.tolist() == [0, 2, -1, 2, -1] and rows.classes == ["cat", "dog", "eel"]
    below = write("n.parquet", pa.array([0, -2, 1], pa.int16()))
    for classes in (None, ("eel", "cat", "dog")):
        with pytest.raises(DataError, match=r"row 'n/1' has label -2, but their Hugging Face metadata names "
                                            r"3 classes \(labels 0 to 2, or -1: none\)"):
            list_rows(DataSpec(source="parquet", parquet=below, classes=classes))
    names = write("s.parquet", pa.array(["cat", "eel"]))
    with pytest.raises(DataError, match=r"the label column 'label' holds names or numbers that are not class indices "
                                        r"\('cat', 'eel'\), but the files' Hugging Face metadata names its classes"):
        list_rows(DataSpec(source="parquet", parquet=names))
    plain = write("p.parquet", pa.array([3.0, float("nan")]), names=None)  # no names: indices all the same
    assert list_rows(DataSpec(source="parquet", parquet=plain)).labels.tolist() == [3, -1]


def test_a_datasets_dataset_is_read_from_its_arrow_files_and_refused_where_it_cannot_be(image_dir: Path,
                                                                                        tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    import extractor
    from extractor.errors import SpecError

    images = images_of(image_dir)
    features = datasets.Features({"picture": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    memory = datasets.Dataset.from_dict({"picture": [str(p) for p in images],
                                         "label": [CLASSES.index(p.parent.name) for p in images]}, features=features)
    raw = job(image_dir, tmp_path / "s.zarr")
    del raw["data"]["root"]
    raw["data"]["source"] = "folder"
    with pytest.raises(SpecError, match=r"job names its data too \(data.source\)"):
        extractor.run(raw, dataset=memory, progress=False)
    raw["data"].pop("source")
    with pytest.raises(SpecError, match=r"held in memory only.*save_to_disk"):
        extractor.run(raw, dataset=memory, progress=False)
    memory.save_to_disk(str(tmp_path / "saved"))
    ds = datasets.load_from_disk(str(tmp_path / "saved"))
    assert ds.cache_files and ds.cache_files[0]["filename"].endswith(".arrow")
    with pytest.raises(SpecError, match=r"selection of its files' rows.*flatten_indices"):
        extractor.run(raw, dataset=ds.shuffle(seed=0), progress=False)
    with pytest.raises(SpecError, match=r"has the columns img, label, but its file .*\.arrow holds picture, label: a "
                                        r"rename or removal made in memory is not in the files"):
        extractor.run(raw, dataset=ds.rename_column("picture", "img"), progress=False)
    store = extractor.run(raw, dataset=ds, progress=False)
    ref = extractor.run(job(image_dir, tmp_path / "f.zarr"), progress=False)
    assert store.classes == ref.classes and store.labels.tolist() == ref.labels.tolist()
    assert str(store.paths[0]).endswith(".arrow#picture/0")
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(store.numpy(key), ref.numpy(key))


def test_a_hub_data_set_by_name_from_the_local_cache(image_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch):
    """data.dataset: ORG/NAME resolves to the Parquet files of its split in the Hugging Face cache, offline (the
    cache laid out as huggingface_hub lays it: refs/main, snapshots/REVISION/, links to blobs)."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    repo = cache / "datasets--org--toy"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    images = images_of(image_dir)
    made = write_hub_parquet(images, tmp_path / "made", per_file=6, row_group=6)  # train-00000, train-00001
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / revision / "data"
    snapshot.mkdir(parents=True)
    for n, f in enumerate([*made, made[0]]):
        blob = repo / "blobs" / f"blob{n}"
        blob.write_bytes(f.read_bytes())
        name = f.name if n < 2 else "test-00000-of-00001.parquet"
        (snapshot / name).symlink_to(blob)
    other = repo / "snapshots" / revision / "cfg2" / "train"  # a second configuration, in a folder of its own
    other.mkdir(parents=True)
    (other / "0000.parquet").symlink_to(repo / "blobs" / "blob0")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(DataError, match=r"split 'train' has files in 2 folders \(cfg2, data\), each a configuration "
                                        r"of the data set: name one with data.config"):
        list_rows(DataSpec(source="parquet", dataset="org/toy"))
    assert len(list_rows(DataSpec(source="parquet", dataset="org/toy", config="cfg2"))) == 6
    monkeypatch.delenv("EXTRACTOR_ALLOW_DOWNLOAD", raising=False)
    train = list_rows(DataSpec(source="parquet", dataset="org/toy", config="data"))
    assert len(train) == 12 and train.classes == CLASSES and train.ids.tolist()[6] == "train-00001-of-00002/0"
    assert len(list_rows(DataSpec(source="parquet", dataset="org/toy", split="test"))) == 6  # in data/ only
    with pytest.raises(DataError, match=r"no Parquet files of split 'validation'.*there: cfg2/train/0000.parquet, "
                                        r"data/test"):
        list_rows(DataSpec(source="parquet", dataset="org/toy", split="validation"))
    with pytest.raises(DataError, match=r"'org/missing' is not in the local Hugging Face cache .*hf download "
                                        r"org/missing --repo-type dataset fetches it"):
        list_rows(DataSpec(source="parquet", dataset="org/missing"))
    raw = job(image_dir, tmp_path / "s.zarr", data={"source": "parquet", "root": None, "dataset": "org/toy",
                                                     "config": "data"})
    run(parse_spec(raw))
    run(parse_spec(job(image_dir, tmp_path / "f.zarr")))
    np.testing.assert_array_equal(open_store(str(tmp_path / "s.zarr")).numpy("layer4"),
                                  open_store(str(tmp_path / "f.zarr")).numpy("layer4"))
    # the same images from the folder take the data set's rows: where images are is not what they become
    reused = run(parse_spec(job(image_dir, tmp_path / "r.zarr", output={"store": str(tmp_path / "r.zarr"),
                                                                        "reuse": [str(tmp_path / "s.zarr")]})))
    assert reused.reused == 12


def test_image_paths_that_leave_the_files_folder_follow_the_manifests_rule(image_dir: Path, tmp_path: Path):
    """issue 37, case 10: a Parquet row whose image is a path was opened wherever it led (an absolute path to a
    system file, ``../../..``), while a manifest refuses the same. One rule (data.outside_root): such a row fails
    without its file being opened, naming the rule; with data.outside_root: true it is read."""
    images = images_of(image_dir)
    folder = tmp_path / "deep" / "data"
    folder.mkdir(parents=True)
    (folder / "beside.jpg").write_bytes(images[0].read_bytes())
    climbing = "../../../" + images[2].relative_to(tmp_path.parent).as_posix()
    paths = ["beside.jpg", str(images[2]), climbing, "./beside.jpg"]
    assert (folder / climbing).resolve() == images[2].resolve()
    pq.write_table(pa.table({"image": [{"bytes": None, "path": p} for p in paths], "label": [0, 0, 0, 0]}),
                   folder / "rows.parquet")
    raw = parquet_job(image_dir, tmp_path / "s.zarr", str(folder / "rows.parquet"))
    summary = run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.status.tolist() == [1, 2, 2, 1] and summary.failed == 2
    for row in (1, 2):
        assert str(s.errors[row]) == ("DataError: image path leaves the Parquet file's folder (refused, as a "
                                      f"manifest's; data.outside_root: true allows it): {paths[row]!r}")
    raw["data"]["outside_root"] = True
    raw["output"]["store"] = str(tmp_path / "t.zarr")
    assert run(parse_spec(raw)).ok == 4


def test_an_image_column_of_another_type_is_refused_at_planning(image_dir: Path, tmp_path: Path):
    """issue 37, case 11: data.columns: {image: label} (an integer column) ran the whole job, then failed every
    row. Its type is refused at planning, in one line."""
    [good] = write_hub_parquet(images_of(image_dir), tmp_path / "data", per_file=12, row_group=6)
    with pytest.raises(DataError, match=r"^[^\n]*train-00000-of-00001.parquet: image column 'label' holds int64, not "
                                        r"images \(bytes, a path, or a struct of bytes and path\); name the image "
                                        r"column with data.columns: \{image: COLUMN\}$"):
        list_rows(DataSpec(source="parquet", parquet=str(good), columns={"image": "label"}))
    paths = tmp_path / "paths.parquet"  # a column of paths is an image column
    pq.write_table(pa.table({"file": [str(p) for p in images_of(image_dir)]}), paths)
    assert len(list_rows(DataSpec(source="parquet", parquet=str(paths), columns={"image": "file"}))) == 12


def _mixed(part: int, *places: int) -> int:
    """splitmix64's finalizer over each place, in Python integers (what part_fingerprints does in bulk)."""
    m, x = (1 << 64) - 1, part
    for place in places:
        x ^= (place * 0x9E3779B97F4A7C15) & m
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & m
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & m
        x ^= x >> 31
    return x or 1


def test_a_files_row_fingerprints_made_at_once_are_each_rows_own():
    from extractor.data.sources.parquet import _row_prints
    from extractor.data.sources.tar import member_fingerprints

    prints = _row_prints(987654321, 300)
    assert prints.dtype == np.uint64 and prints.tolist() == [_mixed(987654321, r) for r in range(300)]
    assert len(set(prints.tolist())) == 300 and 0 not in prints  # each row's own; never "unknown"
    other = _row_prints(987654322, 300)  # the file rewritten: every row's differs (a bijection for each row)
    assert (other != prints).all()
    assert _row_prints(0, 3).tolist() == [0, 0, 0]  # the file's unknown: every row's
    members = member_fingerprints(2**63 + 5, [512, 2048], [1000, 7])  # (a tar's print past 2^63)
    assert members.tolist() == [_mixed(2**63 + 5, 512, 1000), _mixed(2**63 + 5, 2048, 7)]


def test_a_parquet_store_with_row_fingerprints_of_the_old_form_resumes_after_a_digest_pass(image_dir: Path,
                                                                                            tmp_path: Path):
    """Stores made before the rows' fingerprints were mixed in bulk recorded ``fingerprint(file, row, 0)``. While
    the source is as listed a resume takes its rows from the store; once it is listed again (here the file is
    touched), every row's fingerprint differs: the images are read once to compare content digests (all agree:
    nothing is computed again, nothing refused), and the new fingerprints are recorded."""
    from helpers.stores import edited, opened

    from extractor.data.files import fingerprint
    from extractor.data.sources.parquet import _file_fingerprint, _row_prints

    paths = write_hub_parquet(images_of(image_dir), tmp_path / "data", per_file=12, row_group=4)
    raw = parquet_job(image_dir, tmp_path / "p.zarr", str(paths[0]), shard_size=4)
    run(parse_spec(raw))
    file_print = _file_fingerprint(str(paths[0]), {})
    edited(str(tmp_path / "p.zarr"))["fingerprint"][:] = np.array([fingerprint(file_print, r, 0) for r in range(12)],
                                                                    np.uint64)
    raw["output"]["if_exists"] = "resume"
    os.utime(paths[0], ns=(paths[0].stat().st_atime_ns, paths[0].stat().st_mtime_ns + 10**9))
    assert run(parse_spec(raw)).shards_run == 0
    file_print = _file_fingerprint(str(paths[0]), {})
    assert np.asarray(opened(str(tmp_path / "p.zarr"))["fingerprint"][:]).tolist() == \
        _row_prints(file_print, 12).tolist()


def test_rows_whose_image_is_a_path_are_said_to_be_unchecked_by_a_resume(image_dir: Path, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture):
    """A row whose image is a file its path names (no bytes in the Parquet file) has the Parquet file's fingerprint:
    a resume does not see that image file rewritten in place. The listing says how many such rows there are, from
    the footers' statistics (a path column: every row); files whose images are bytes say nothing."""
    images = images_of(image_dir)
    mixed = [{"bytes": None, "path": str(p)} for p in images[:3]] + \
        [{"bytes": p.read_bytes(), "path": p.name} for p in images[3:5]]
    pq.write_table(pa.table({"image": mixed, "label": [0] * 5}), tmp_path / "mixed.parquet", row_group_size=2)
    pq.write_table(pa.table({"image": [str(p) for p in images[:2]], "label": [0, 0]}), tmp_path / "paths.parquet")
    pq.write_table(pa.table({"image": mixed[3:], "label": [0, 0]}), tmp_path / "bytes.parquet")
    pq.write_table(pa.table({"image": [{"path": str(images[0])}], "label": [0]}), tmp_path / "struct.parquet")
    with caplog.at_level("WARNING", logger="extractor.data.sources.parquet"):
        assert len(list_rows(DataSpec(source="parquet", parquet=str(tmp_path / "bytes.parquet")))) == 2
        assert not caplog.records
        rows = list_rows(DataSpec(source="parquet", parquet=[str(tmp_path / "mixed.parquet"),
                                                             str(tmp_path / "paths.parquet"),
                                                             str(tmp_path / "struct.parquet")]))
    assert len(rows) == 8
    assert [r.getMessage().split(" rows")[0] for r in caplog.records] == ["6"]  # 3, 2 and 1 of the three files
    assert "a resume sees the Parquet files change, not those image files" in caplog.records[0].getMessage()
