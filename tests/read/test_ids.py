"""Rows by image id (ActivationStore.row_numbers, row): a few lookups compare the ids column, more build a sorted
index of the ids' hashes once (issue 39: a dict of every id cost 4.5 s at 1M rows)."""

from __future__ import annotations

import numpy as np
import pytest

from extractor.read.ids import _IdIndex


def ids_of(n: int) -> np.ndarray:
    rng = np.random.default_rng(3)
    return np.array([f"c{int(rng.integers(0, 9))}/img{i:05d}.jpg" for i in rng.permutation(n)],
                    dtype=np.dtypes.StringDType())


def test_a_few_lookups_and_many_give_the_rows_a_dict_gives():
    ids = ids_of(300)
    truth = {str(i): n for n, i in enumerate(ids)}
    index = _IdIndex(ids)
    asked = [str(ids[r]) for r in (0, 299, 17)]
    assert index.find(asked).tolist() == [truth[i] for i in asked]
    assert index.order is None  # compared, no index yet
    many = [str(i) for i in ids[::-7]]
    assert index.find(many).tolist() == [truth[i] for i in many]
    assert index.order is not None
    assert index.find(["nope.jpg", asked[0]]).tolist() == [-1, truth[asked[0]]]


def test_ids_that_share_a_hash_are_told_apart_by_their_text():
    ids = ids_of(50)
    index = _IdIndex(ids)
    index.find([str(i) for i in ids])  # the index is built
    index.order, index.hashes = np.arange(50), np.full(50, hash("x"))  # every id with one hash, as if they collided
    import builtins

    real = builtins.hash
    builtins.hash = lambda v: real("x")  # type: ignore[assignment]
    try:
        assert index.find([str(ids[41]), str(ids[3]), "gone"]).tolist() == [41, 3, -1]
    finally:
        builtins.hash = real


def test_row_of_an_unknown_id_names_it(tmp_path):
    from extractor.data import Rows
    from extractor.read.reader import open_store
    from extractor.store.layout import StoreArrays, create_store

    meta = {"shape": [2], "dtype": "float32", "dims": ["x.f"], "layer": "x", "what": "output", "reduce": "none"}
    ids = ids_of(40)
    url = str(tmp_path / "s.zarr")
    create_store(url, Rows(ids=list(ids), paths=[""] * 40, labels=[0] * 40),
                 StoreArrays(captures={"x": meta}, extras={}, shard_size=8, chunk_rows={"x": 8}),
                 {"n_rows": 40, "n_shards": 5, "captures": {"x": meta}, "format_version": 1, "spec": {}, "model": {}})
    s = open_store(url)
    assert s.row_numbers([str(ids[9]), str(ids[30])]).tolist() == [9, 30]
    assert s.row(str(ids[12]))["row"] == 12
    with pytest.raises(KeyError, match="no row with id 'missing.jpg'"):
        s.row_numbers([str(ids[1]), "missing.jpg"])
