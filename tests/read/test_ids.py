"""Rows by image id (ActivationStore.row_numbers, row). A store keeps its ids' hashes sorted (``id_index``, written
with the ids): the first lookup reads those integers, not every id (issue 39: 0.25-0.65 s at 1M rows). In a store
made before it, a few lookups compare the ids column and more sort the ids' hashes once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.jobs import job
from helpers.stores import dropped, generation, root_attrs

import extractor.store.id_index as id_index
from extractor.data import Rows, text_hashes
from extractor.data.rows import Strings
from extractor.read.ids import _IdIndex
from extractor.read.reader import open_store
from extractor.store import SortedIds
from extractor.store.layout import StoreArrays
from extractor.store.synthetic import create_store

META = {"shape": [2], "dtype": "float32", "dims": ["x.f"], "layer": "x", "what": "output", "reduce": "none"}


def ids_of(n: int) -> np.ndarray:
    rng = np.random.default_rng(3)
    return np.array([f"c{int(rng.integers(0, 9))}/img{i:05d}.jpg" for i in rng.permutation(n)],
                    dtype=np.dtypes.StringDType())


def made(path: Path, ids: list[str], digest: str = "d1") -> str:
    """A store of ``ids`` as the driver creates it (its ids_digest attribute: ``digest``)."""
    url = str(path)
    n = len(ids)
    create_store(url, Rows(ids=ids, paths=[""] * n, labels=[0] * n),
                 StoreArrays(captures={"x": META}, extras={}, shard_size=8, chunk_rows={"x": 8}),
                 {"n_rows": n, "n_shards": -(-n // 8), "captures": {"x": META}, "format_version": 1, "spec": {},
                  "model": {}, "ids_digest": digest})
    return url


def first_rows(ids: list[str]) -> dict[str, int]:
    """Each id's first row, by hand."""
    truth: dict[str, int] = {}
    for n, i in enumerate(ids):
        truth.setdefault(i, n)
    return truth


def asked_of(ids: list[str]) -> list[str]:
    """Present ids (each of them, in another order), and absent ones, some a prefix or extension of a present one."""
    return [*ids[::-3], "missing.jpg", ids[0][:-1], ids[0] + "x", "", "é/ü.jpg", *ids[1::3]]


def test_the_stored_index_gives_the_rows_a_dict_gives_reading_few_ids(tmp_path: Path):
    ids = [str(i) for i in ids_of(300)]
    ids[250], ids[40] = ids[7], ids[9]  # two ids there twice: their first row counts
    url = made(tmp_path / "s.zarr", ids)
    s = open_store(url)
    truth = first_rows(ids)
    assert [s.row_numbers([i])[0] for i in ids[:5]] == [truth[i] for i in ids[:5]]
    assert isinstance(s._row_of, SortedIds) and s._id_texts is None  # the index, and only a chunk of ids a lookup
    s = open_store(url)
    asked = asked_of(ids)
    assert s._id_index().find(asked).tolist() == [truth.get(i, -1) for i in asked]
    assert s.row(ids[250])["row"] == 7


def test_ids_that_share_a_hash_are_told_apart_by_their_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    few = lambda ids: text_hashes(ids) % 3  # noqa: E731 - every id shares its hash with a third of the others
    monkeypatch.setattr(id_index, "hash_ids", few)
    ids = [str(i) for i in ids_of(120)]
    ids[100] = ids[20]
    url = made(tmp_path / "s.zarr", ids)
    assert sorted(set(open_store(url)._id_index().hashes.tolist())) == [0, 1, 2]  # written with the forced hash
    truth, asked = first_rows(ids), asked_of(ids)
    assert open_store(url)._id_index().find(asked).tolist() == [truth.get(i, -1) for i in asked]
    same = SortedIds(np.zeros(50, np.int64), np.arange(50), lambda ids: np.zeros(len(ids), np.int64),
                     lambda rows: [ids[r] for r in rows.tolist()])  # one hash for all
    assert same.find([ids[41], ids[3], "gone"]).tolist() == [41, 3, -1]


def test_a_store_without_the_index_finds_its_rows_as_before(tmp_path: Path):
    ids = [str(i) for i in ids_of(200)]
    url = made(tmp_path / "s.zarr", ids)
    dropped(url, "id_index")  # a store made before it
    s = open_store(url)
    truth, asked = first_rows(ids), asked_of(ids)
    assert [s.row_numbers([i])[0] for i in ids[:3]] == [truth[i] for i in ids[:3]]
    assert isinstance(s._row_of, _IdIndex) and s._row_of.sorted is None  # compared, no hashes sorted yet
    assert s._row_of.find(asked).tolist() == [truth.get(i, -1) for i in asked]
    assert s._row_of.sorted is not None


def test_an_index_that_does_not_cover_the_ids_as_they_are_is_not_used(tmp_path: Path):
    ids = [str(i) for i in ids_of(64)]
    url = made(tmp_path / "s.zarr", ids)
    root_attrs(url, ids_digest="other")  # the ids rewritten since (by hand)
    s = open_store(url)
    assert isinstance(s._id_index(), _IdIndex)
    url = made(tmp_path / "t.zarr", ids)
    root = Path(url) / generation(url).name / "__root.json"  # its record not written yet: half written (the
    meta = json.loads(root.read_text())  # metadata consolidated when the store was made holds what readers read)
    meta["consolidated_metadata"]["metadata"]["id_index"]["attributes"] = {}
    root.write_text(json.dumps(meta))
    assert isinstance(open_store(url)._id_index(), _IdIndex)
    assert open_store(url).row_numbers([ids[5]]).tolist() == [5]


def test_row_of_an_unknown_id_names_it(tmp_path):
    ids = ids_of(40)
    s = open_store(made(tmp_path / "s.zarr", [str(i) for i in ids]))
    assert s.row_numbers([str(ids[9]), str(ids[30])]).tolist() == [9, 30]
    assert s.row(str(ids[12]))["row"] == 12
    with pytest.raises(KeyError, match=f"no row with id 'missing.jpg' in {s.url}"):
        s.row_numbers([str(ids[1]), "missing.jpg"])


def test_a_few_lookups_and_many_give_the_rows_a_dict_gives():
    ids = ids_of(300)
    truth = {str(i): n for n, i in enumerate(ids)}
    index = _IdIndex(ids)
    asked = [str(ids[r]) for r in (0, 299, 17)]
    assert index.find(asked).tolist() == [truth[i] for i in asked]
    assert index.sorted is None  # compared, no index yet
    many = [str(i) for i in ids[::-7]]
    assert index.find(many).tolist() == [truth[i] for i in many]
    assert index.sorted is not None
    assert index.find(["nope.jpg", asked[0]]).tolist() == [-1, truth[asked[0]]]


def test_text_hashes_are_fixed_and_one_strings_alone_or_among_others():
    """The stored index keeps them: another hash for the same text would leave every index made before wrong."""
    texts = ["", "a", "b/c.jpg", "é/ü.jpg", "x" * 300, "a\0"]
    alone = [int(text_hashes([t])[0]) for t in texts]
    block = Strings()
    block.extend(texts * 2000)
    assert text_hashes(block.array()).tolist() == alone * 2000  # a Texts, hashed in blocks
    assert text_hashes(np.array(texts, dtype=np.dtypes.StringDType())).tolist() == alone
    assert len(set(alone)) == len(texts)
    assert alone[:3] == [0, 8654026580637669587, 1549845959649684521]  # the format: HASH "utf8-poly64"


def test_a_replaced_and_resumed_store_has_the_index_of_its_ids(image_dir: Path, tmp_path: Path):
    from extractor.driver.runner import run
    from extractor.spec.load import parse_spec

    images = tmp_path / "images"
    shutil.copytree(image_dir, images)
    raw = job(images, tmp_path / "s.zarr")
    run(parse_spec(raw))
    for gone in sorted(images.rglob("*.*"))[::3]:  # another image list: the store replaced
        gone.rename(gone.with_name("new-" + gone.name))
    raw["output"]["if_exists"] = "overwrite"
    run(parse_spec(raw))
    raw["output"]["if_exists"] = "resume"
    run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    ids = s.ids.tolist()
    assert any(i.split("/")[-1].startswith("new-") for i in ids)
    assert isinstance(s._id_index(), SortedIds)
    assert s._id_index().find(asked_of(ids)).tolist() == [first_rows(ids).get(i, -1) for i in asked_of(ids)]
