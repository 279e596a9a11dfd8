"""The analysis side: shuffled streaming, torch and xarray views, statistics, probes, pictures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.images import make_images
from helpers.jobs import job
from helpers.stores import claimant_record, generation, made_again, opened

from extractor.data.rows import Rows
from extractor.driver.runner import run
from extractor.errors import StoreError
from extractor.read.reader import ActivationStore, open_store
from extractor.spec.load import parse_spec
from extractor.store.layout import FAILED, OK, StoreArrays
from extractor.store.synthetic import create_store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    """20 images + 1 corrupt file; the last shard left pending by an interrupted run."""
    tmp = tmp_path_factory.mktemp("reader")
    root = tmp / "imgs"
    make_images(root, per_class=10, classes=("a", "b"), size=48)
    (root / "a" / "corrupt.jpg").write_bytes(b"not a jpeg")
    raw = job(root, tmp / "s.zarr", data={"resize": None, "crop": 32, "shard_size": 4, "batch_size": 4},
              capture=[{"layer": "layer4", "reduce": "mean"},
                       {"layer": "layer2", "key": "map", "dtype": "float16"}],
              output={"store": str(tmp / "s.zarr"), "chunk_rows": 2})

    def stop(name: str, info: dict) -> None:
        if name == "shard_started" and info["shard"] == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(parse_spec(raw), on_event=stop)
    s = open_store(str(tmp / "s.zarr"))
    assert (s.status == 0).sum() == 1 and (s.status == 2).sum() == 1  # one pending, one failed
    return s


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[ActivationStore, np.ndarray]:
    """200 rows of random values in chunks of 32, written without a model, as a killed run leaves them:
    row 8 failed, rows 192-199 pending, no stats yet. Also returns the whole capture, read with zarr."""
    url = str(tmp_path_factory.mktemp("synthetic") / "s.zarr")
    n, meta = 200, {"shape": [3], "dtype": "float32", "dims": ["emb.feature"], "layer": "x", "what": "output",
                    "reduce": "none"}
    rows = Rows(ids=[f"img{i}" for i in range(n)], paths=[""] * n, labels=[i % 2 for i in range(n)])
    g = create_store(url, rows, StoreArrays(captures={"emb": meta}, extras={}, shard_size=64, chunk_rows={"emb": 32}),
                     attrs={"n_rows": n, "n_shards": 4, "captures": {"emb": meta}, "format_version": 1, "spec": {},
                            "model": {}})
    x = np.random.default_rng(0).standard_normal((n, 3), dtype=np.float32)
    x[8] = np.nan
    g["emb"][:192] = x[:192]
    status = np.full(n, OK, np.uint8)
    status[8], status[192:] = FAILED, 0
    g["status"][:] = status
    return open_store(url), np.asarray(g["emb"][:])


ORDERS = {
    "swap inside a chunk": [0, 2, 1, 3],
    "descending in one chunk": [1, 0],
    "descending across chunks": list(range(100, 20, -1)),
    "duplicates": [5, 5, 3, 40, 5, 3, 70, 40],
    "random permutation": np.random.default_rng(1).permutation(190).tolist(),
}


@pytest.mark.parametrize("order", ORDERS, ids=list(ORDERS))
@pytest.mark.parametrize(("shuffle", "buffer_chunks"), [(False, 8), (True, 1), (True, 8)])
def test_batches_data_matches_reported_rows_for_any_order(synthetic, order, shuffle, buffer_chunks):
    s, full = synthetic
    rows = [r for r in ORDERS[order] if r != 8]
    got = []
    for r, data in s.batches("emb", 5, shuffle=shuffle, seed=2, rows=rows, buffer_chunks=buffer_chunks):
        np.testing.assert_array_equal(data, full[r])
        got += r.tolist()
    assert got == rows if not shuffle else sorted(got) == sorted(rows)  # in the order given without shuffle


def test_batches_leave_out_rows_that_are_not_ok_and_check_sizes(synthetic):
    s, full = synthetic
    got = [(r.tolist(), d) for r, d in s.batches("emb", 2, shuffle=False, rows=[9, 8, 0, 195])]
    assert [r for r, _ in got] == [[9, 0]]  # failed 8 and pending 195 are left out, and reported so
    np.testing.assert_array_equal(got[0][1], full[[9, 0]])
    for bad in ({"batch_size": 0}, {"buffer_chunks": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            next(s.batches("emb", **{"batch_size": 4, **bad}))
    for bad, said in [({"seed": -1}, "seed must be >= 0, not -1"), ({"seed": 1.5}, "seed must be an int, not 1.5"),
                      ({"seed": None}, "seed must be an int, not None"),
                      ({"batch_size": 2.5}, "batch_size must be an int, not 2.5")]:
        with pytest.raises((TypeError, ValueError), match=said):
            next(s.batches("emb", **{"batch_size": 4, **bad}))
    assert len(next(s.batches("emb", np.int64(4), seed=np.int64(3)))[0]) == 4  # numpy's ints are ints
    ids = [str(i) for i in s.ids[:2]]
    with pytest.raises(TypeError, match=f"row_numbers takes a list of image ids; of one: row_numbers\\(\\[{ids[0]!r}"):
        s.row_numbers(ids[0])
    with pytest.raises(TypeError, match=r"row takes an image id .a str., not 5; a row by its number"):
        s.row(5)


class _CountingArray:
    """Wraps a zarr array; records the chunk of every row each read touches."""

    def __init__(self, arr) -> None:
        self.arr, self.chunks, self.reads = arr, arr.chunks, []
        self.shape, self.dtype = arr.shape, arr.dtype

    def __getitem__(self, sel: slice):
        self.reads += range(sel.start // self.chunks[0], (sel.stop - 1) // self.chunks[0] + 1)
        return self.arr[sel]

    def get_basic_selection(self, sel: slice, out):  # a read of consecutive rows straight into the result
        self.reads += range(sel.start // self.chunks[0], (sel.stop - 1) // self.chunks[0] + 1)
        return self.arr.get_basic_selection(sel, out=out)

    @property
    def oindex(self):  # small chunks from anywhere, in one call: each chunk of the rows asked read once
        counting = self

        class Rows:
            def __getitem__(self, rows: np.ndarray):
                counting.reads += sorted(set((np.asarray(rows) // counting.chunks[0]).tolist()))
                return counting.arr.oindex[rows]

        return Rows()


@pytest.mark.parametrize(("shuffle", "buffer_chunks"), [(False, 8), (True, 1), (True, 8)])
def test_batches_read_each_chunk_once(synthetic, monkeypatch, shuffle, buffer_chunks):
    s, _ = synthetic
    counting = _CountingArray(s["emb"])
    monkeypatch.setattr(ActivationStore, "__getitem__", lambda self, key: counting)
    rows = list(range(180)) if not shuffle else np.random.default_rng(1).permutation(180).tolist()
    n = sum(len(r) for r, _ in s.batches("emb", 7, shuffle=shuffle, rows=rows, buffer_chunks=buffer_chunks))
    assert n == 179 and sorted(counting.reads) == list(range(6))  # 180 rows but failed row 8; chunks 0-5


def test_dataloader_rows_in_any_order(synthetic):
    pytest.importorskip("torch")
    s, full = synthetic
    rows = [3, 1, 2, 0, 33, 32, 3]
    for shuffle in (False, True):
        got = []
        for b in s.dataloader("emb", batch_size=3, shuffle=shuffle, rows=rows):
            np.testing.assert_array_equal(b["emb"].numpy(), full[b["row"].numpy()])
            got += b["row"].tolist()
        assert got == rows if not shuffle else sorted(got) == sorted(rows)


def test_numpy_never_drops_explicit_rows(synthetic):
    s, full = synthetic
    with pytest.raises(StoreError, match=r"rows asked .* not ok: 8 \(failed\); pass only_ok=False"):
        s.numpy("emb", rows=[0, 8, 9])
    with pytest.raises(StoreError, match=r"2 of the 4 .* 8 \(failed\), 194 \(pending\)"):
        s.numpy("emb", rows=slice(8, 200, 62))  # a slice or a mask is explicit too
    np.testing.assert_array_equal(s.numpy("emb", rows=[0, 8, 9], only_ok=False), full[[0, 8, 9]])
    assert np.isnan(s.numpy("emb", rows=[0, 8, 9], only_ok=False)[1]).all()
    np.testing.assert_array_equal(s.numpy("emb", rows=[40, 9, 9, -9 - 1 - 8], only_ok=False), full[[40, 9, 9, 182]])
    np.testing.assert_array_equal(s.numpy("emb"), full[s.ok_rows()])  # no rows: all ok rows
    assert len(s.numpy("emb")) == 191


def test_row_selections_that_cannot_be_meant_are_refused(synthetic):
    s, _ = synthetic
    for rows in (np.ones(10, bool), [0.5, 1.7], [[0, 1]], [200], [-201]):
        with pytest.raises(IndexError):
            s.numpy("emb", rows=rows)


def test_torch_views_without_torch_say_how_to_install(synthetic, monkeypatch):
    import sys

    s, _ = synthetic
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails as if not installed
    monkeypatch.delitem(sys.modules, "extractor.read.torch_views", raising=False)
    for view in (s.torch_dataset, s.dataloader):
        with pytest.raises(ImportError, match=r"needs torch: pip install torch"):
            view("emb")


def test_stats_of_a_store_killed_before_its_end_are_empty(synthetic, store):
    s, _ = synthetic
    assert s.stats == {} and s.summary()["stats"] == {}
    assert "stats" not in s.attrs  # as a run killed before its end leaves it
    assert store.stats == store.attrs["stats"] and set(store.stats) == {"layer4", "map"}  # interrupted: merged


def test_shuffled_epochs_cover_every_ok_row_once(store):
    ok = set(store.ok_rows().tolist())
    assert len(ok) == 19
    orders = {}
    for seed in (0, 1):
        rows = [r for batch_rows, _ in store.batches("layer4", 4, shuffle=True, seed=seed) for r in batch_rows]
        assert sorted(rows) == sorted(ok)
        orders[seed] = rows
    again = [r for b, _ in store.batches("layer4", 4, shuffle=True, seed=0) for r in b]
    assert again == orders[0] and orders[0] != orders[1] and orders[0] != sorted(ok)
    seq = [r for b, _ in store.batches("layer4", 4, shuffle=False) for r in b]
    assert seq == sorted(ok)


def test_batches_carry_the_right_rows_and_sizes(store):
    full = store.numpy("layer4", only_ok=False)
    sizes = []
    for rows, data in store.batches(["layer4", "map"], 5, shuffle=True, seed=3, buffer_chunks=2):
        sizes.append(len(rows))
        np.testing.assert_array_equal(data["layer4"], full[rows])
        np.testing.assert_array_equal(data["map"], store["map"].oindex[rows])
    assert sizes == [5, 5, 5, 4]


def test_statistics_equal_numpy(store):
    st = store.attrs["stats"]
    x = store.numpy("layer4").astype(np.float64)
    np.testing.assert_allclose(st["layer4"]["mean"], x.mean(0), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(st["layer4"]["std"], x.std(0), rtol=1e-5, atol=1e-9)
    assert st["layer4"]["min"] == pytest.approx(x.min()) and st["layer4"]["max"] == pytest.approx(x.max())
    assert st["layer4"]["mean_l2"] == pytest.approx(np.linalg.norm(x, axis=1).mean(), rel=1e-6)
    m = store.numpy("map").astype(np.float64)  # (rows, channel, y, x): per-channel statistics
    np.testing.assert_allclose(st["map"]["mean"], m.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(st["map"]["std"], m.std(axis=(0, 2, 3)), rtol=1e-4, atol=1e-7)
    assert st["layer4"]["rows"] == 19 and st["layer4"]["nan"] == 0 and st["layer4"]["nonfinite_rows"] == 0


def test_row_by_id_and_torch_views(store):
    import torch

    r = store.row("b/b03.png")
    n = r["row"]
    np.testing.assert_array_equal(r["layer4"], store["layer4"][n])
    assert r["label"] == 1 and r["status"] == "ok"
    with pytest.raises(KeyError, match="no row with id"):
        store.row("nope.jpg")
    ds = store.torch_dataset("layer4")
    assert len(ds) == 19
    item = ds[0]
    assert torch.equal(item["layer4"], torch.from_numpy(store["layer4"][int(item["row"])]))
    loader = store.dataloader(["layer4"], batch_size=8, seed=0)
    epoch1 = [b["row"] for b in loader]
    epoch2 = [b["row"] for b in loader]
    assert sorted(torch.cat(epoch1).tolist()) == sorted(store.ok_rows().tolist())
    assert torch.cat(epoch1).tolist() != torch.cat(epoch2).tolist()  # each epoch its own order
    assert epoch1[0].shape == (8,) and set(epoch1[0].tolist()) <= set(store.ok_rows().tolist())


def test_an_array_of_a_store_opened_as_a_store_says_which_store(store):
    with pytest.raises(StoreError, match=f"{store.url}/map is an array of a store, not a store: open the store "
                                         f"\\({store.url}\\) and read the array by its key"):
        open_store(f"{store.url}/map")


def test_a_store_made_again_while_open_is_refused_before_its_rows_are_read(store, tmp_path: Path):
    """Another store made at the URL (``--overwrite``): its rows would come under the ids the reader holds."""
    import shutil

    path = tmp_path / "s.zarr"
    shutil.copytree(store.url, path)
    s = open_store(str(path))
    ids = s.ids
    assert s.ok_rows().size and s.numpy("layer4").shape[0] == s.ok_rows().size
    made_again(str(path))
    for read in (s.ok_rows, lambda: s.numpy("layer4"), lambda: next(s.batches("layer4", 2)), lambda: s.status,
                 lambda: s.row(str(ids[0]))):
        with pytest.raises(StoreError, match=r"was made again .or removed. since it was opened: .* open it again"):
            read()
    assert open_store(str(path)).ids.tolist() == ids.tolist()  # opened again: read
    shutil.rmtree(path)
    with pytest.raises(StoreError, match=r"was made again .or removed."):
        s.ok_rows()


def test_an_array_read_from_a_store_made_again_and_collected_is_refused_never_fill_values(store, tmp_path: Path):
    """``s[key][a:b]`` reads the generation the reader opened: its objects, while they are there (the same values,
    never another store's); once the store is made again and the old generation collected, an error, never NaN."""
    import shutil

    path = tmp_path / "s.zarr"
    shutil.copytree(store.url, path)
    s = open_store(str(path))
    before = s["layer4"][:8]
    old = s.attrs["generation"]
    made_again(str(path))
    np.testing.assert_array_equal(s["layer4"][:8], before)  # the generation it opened, whole
    shutil.rmtree(path / old)  # collected, as the next job that makes or finishes the store does
    with pytest.raises(StoreError, match=r"was made again .or removed. since it was opened"):
        s["layer4"][:8]


def test_dataloader_refuses_what_is_no_option_of_its_own(store):
    pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"unknown option\(s\) sampler.*num_workers and the DataLoader's pin_memory"):
        store.dataloader(["layer4"], sampler=None)
    with pytest.raises(ValueError, match="num_workers must be a count >= 0"):
        store.dataloader(["layer4"], num_workers=-1)
    with pytest.raises(ValueError, match=r"part \(k, n\) needs 0 <= k < n"):
        store.dataloader(["layer4"], part=(2, 2))


def test_xarray_view_matches_raw_arrays(store):
    pytest.importorskip("xarray")
    pytest.importorskip("dask")
    ds = store.to_xarray(only_ok=False)
    assert set(ds.data_vars) == {"layer4", "map"}
    assert ds["layer4"].dims == ("row", "layer4.channel")
    assert ds["map"].dims == ("row", "map.channel", "map.y", "map.x")
    assert hasattr(ds["map"].data, "dask")
    np.testing.assert_array_equal(ds["layer4"].values, store["layer4"][:])
    assert list(ds["ids"].values) == list(store.ids)
    np.testing.assert_array_equal(ds["labels"].values, store.labels)
    np.testing.assert_array_equal(ds["status"].values, store.status)
    assert store.classes and list(ds["class_name"].values) == [store.classes[v] if v >= 0 else "" for v in store.labels]
    row = ds.sel(row=3)
    assert str(row["ids"].values) == str(store.ids[3])
    ok = store.to_xarray()  # like numpy(): the rows that are ok, each under its store row number
    bad = np.flatnonzero(store.status != 1)
    assert len(bad) and len(ok["row"]) == len(store) - len(bad)
    np.testing.assert_array_equal(ok["row"].values, store.ok_rows())
    for key in ("layer4", "map"):
        np.testing.assert_array_equal(ok[key].values, store.numpy(key))
    assert not np.isnan(ok["layer4"].values).any()
    assert str(ok.sel(row=int(store.ok_rows()[-1]))["ids"].values) == str(store.ids[store.ok_rows()[-1]])


def test_xarray_and_dask_read_it_through_zarr_store_and_refuse_it_by_url(store):
    """xarray and dask read a store through ``extractor.zarr_store`` (numpy and zarr: the commits it reads); opened by
    URL alone they refuse its arrays (Zarr's storage transformer they do not know), never reading fill values."""
    import zarr

    import extractor

    xr = pytest.importorskip("xarray")
    da = pytest.importorskip("dask.array")
    ds = xr.open_zarr(extractor.zarr_store(store.url), consolidated=False)
    assert "ids" in ds.coords and "labels" in ds.coords
    np.testing.assert_array_equal(ds["layer4"].values, store["layer4"][:])
    arr = da.from_zarr(zarr.open_array(extractor.zarr_store(store.url), path="map", mode="r"))
    assert arr.shape == store["map"].shape
    np.testing.assert_array_equal(arr.compute(), store["map"][:])
    generation = f"{store.url}/{store.attrs['generation']}"
    with pytest.raises(ValueError, match="storage transformers"):
        zarr.open_array(generation, path="map", mode="r")
    for plain in (lambda: xr.open_zarr(generation, consolidated=False), lambda: zarr.open_group(generation, mode="r")):
        with pytest.raises(FileNotFoundError):  # no group there: a plain reader meets an error, never fill values
            plain()
    assert not xr.open_zarr(store.url, consolidated=False).data_vars  # the head: a group of no arrays


def test_probe_is_near_chance_on_shuffled_labels_and_high_on_separable_classes(tmp_path: Path):
    from extractor.demo import write_sample_images
    from extractor.read.analysis import linear_probe, probe_store

    write_sample_images(tmp_path / "imgs", per_class=20, size=64)
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", data={"resize": None, "crop": 64, "shard_size": 16,
                                                             "batch_size": 16},
              capture=[{"layer": "avgpool", "reduce": "flatten", "key": "emb"}],
              output={"store": str(tmp_path / "s.zarr"), "chunk_rows": 8})
    run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    res = probe_store(s, folds=4)["emb"]
    assert res["accuracy"] >= 0.85 and res["chance"] == pytest.approx(0.25)
    x = s.numpy("emb")
    shuffled = np.random.default_rng(0).permutation(s.labels)
    null = linear_probe(x, shuffled, folds=4)
    assert null["accuracy"] <= 0.5


def test_probe_folds_are_checked_not_quietly_changed(caplog: pytest.LogCaptureFixture):
    from extractor.read.analysis import linear_probe

    x, y = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32), np.array([0, 1] * 3)
    with pytest.raises(ValueError, match="folds >= 2, not 1"):
        linear_probe(x, y, folds=1)
    with caplog.at_level("WARNING", logger="extractor.read.analysis"):
        res = linear_probe(x, y, folds=10)
    assert len(res["folds"]) == 3 and "a 10-fold probe whose smallest class has 3 rows: 3 folds" in caplog.text
    with pytest.raises(StoreError, match="class 2 has 1 labelled row: a stratified probe needs at least 2"):
        linear_probe(np.vstack([x, x[:1]]), np.array([0, 1] * 3 + [2]), folds=2)


def test_probe_equals_scikit_learn_run_by_hand_on_the_same_folds():
    """The probe is scikit-learn's: standardized on each training fold, LogisticRegression(C=1), the stratified
    folds shuffled with the seed; the same computed here by hand, fold by fold, gives the same accuracies."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold
    from sklearn.preprocessing import StandardScaler

    from extractor.read.analysis import linear_probe

    rng = np.random.default_rng(3)
    y = rng.integers(0, 3, 150)
    x = rng.normal(size=(150, 20)) + y[:, None] * 0.4 * rng.normal(size=20)
    got = linear_probe(x, y, folds=5, seed=7)
    by_hand = []
    for train, test in StratifiedKFold(5, shuffle=True, random_state=7).split(x, y):
        scale = StandardScaler().fit(x[train])
        model = LogisticRegression(C=1.0, max_iter=1000).fit(scale.transform(x[train]), y[train])
        by_hand.append(float((model.predict(scale.transform(x[test])) == y[test]).mean()))
    assert got["folds"] == by_hand and got["accuracy"] == pytest.approx(np.mean(by_hand))
    assert got["chance"] == pytest.approx(np.bincount(y).max() / 150) and 0.4 < got["accuracy"] < 1


def test_probe_and_show_commands_write_pictures(tmp_path: Path, store):
    from PIL import Image

    from extractor.cli import main

    assert main(["probe", store.url, "--folds", "3", "--out", str(tmp_path / "p.png")]) == 0
    assert Image.open(tmp_path / "p.png").size[0] > 400
    assert main(["show", store.url, "--key", "layer4", "--out", str(tmp_path / "pca.png")]) == 0
    assert Image.open(tmp_path / "pca.png").size >= (600, 450)
    assert main(["show", store.url, "--key", "layer4", "--rows", "0:6", "--columns", "3",
                 "--out", str(tmp_path / "rows.png")]) == 0
    width, height = Image.open(tmp_path / "rows.png").size  # panels of 1.9 x 2.2 inches at 100 dpi, trimmed
    assert 3 * 150 < width <= 3 * 210 and 2 * 170 < height <= 2 * 240
    assert main(["show", store.url, "--key", "nope", "--out", str(tmp_path / "x.png")]) == 1


def test_nan_and_inf_are_stored_as_computed_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    from PIL import Image

    root = tmp_path / "imgs"
    make_images(root, per_class=3, classes=("a", "b"), size=40)
    Image.new("RGB", (40, 40), (255, 255, 255)).save(root / "a" / "white.png")
    raw = job(root, tmp_path / "s.zarr", model={"name": None, "factory": "toy_models:nan_net", "device": "cpu"},
              data={"resize": None, "crop": 32}, capture=[{"layer": "conv", "reduce": "mean"}])
    summary = run(parse_spec(raw))
    assert summary.ok == 7 and summary.nonfinite == {"conv": (1, [3])}
    s = open_store(str(tmp_path / "s.zarr"))
    assert np.isinf(s.numpy("conv")[3]).all()
    st = s.attrs["stats"]["conv"]
    assert st["inf"] == 4 and st["nonfinite_rows"] == 1 and st["first_nonfinite_rows"] == [3]
    assert np.isfinite(st["mean"]).all()
    # a probe and a PCA leave such rows out, saying so (they gave a NaN accuracy and an SVD error)
    from extractor.cli import main
    from extractor.read.analysis import probe_store

    with caplog.at_level("WARNING", logger="extractor.read.analysis"):
        res = probe_store(s, folds=2)["conv"]
    assert res["rows"] == 6 and np.isfinite(res["accuracy"])
    assert "conv: 1 of 7 rows hold NaN or Inf and are left out (first: 3)" in caplog.text
    assert main(["show", s.url, "--key", "conv", "--out", str(tmp_path / "pca.png")]) == 0


def test_a_store_whose_job_was_killed_says_so(image_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    """A store whose job was SIGKILLed says neither complete nor how it stopped: its silent claimant tells it apart."""
    import re
    import time

    from extractor.cli import main

    url = str(tmp_path / "s.zarr")
    run(parse_spec(job(image_dir, tmp_path / "s.zarr")))
    assert open_store(url).stale is None  # complete
    gen = generation(url)
    gen.objects.remove(gen.txn("final"))  # as a job killed before its end leaves it
    claimant_record(url, ended=None, heartbeat=time.time() - 5, id="00000000000000ab")  # another process's
    assert open_store(url).attrs["status"] == "running"
    assert open_store(url).stale is None  # a live job renews it every 15 s (timeout 60 s)
    claimant_record(url, heartbeat=time.time() - 3600)
    assert 3600 <= open_store(url).stale < 3700
    assert main(["inspect", url]) == 0
    assert re.search(r"its job has been silent for 36\d\d s \(killed\?\): run it again with --resume",
                     capsys.readouterr().out)


def test_batches_of_no_key_is_a_clear_error(store):
    with pytest.raises(ValueError, match="at least one capture key; captures: layer4, map"):
        next(store.batches([], 4))


@pytest.fixture(scope="module")
def gradient_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[ActivationStore, dict[str, np.ndarray]]:
    """A Grad-CAM job over 6 images + 1 corrupt file (a failed row). Also returns its per-row
    extras read directly with zarr."""

    tmp = tmp_path_factory.mktemp("gradients")
    root = tmp / "imgs"
    make_images(root, per_class=3, classes=("a", "b"), size=40)
    (root / "a" / "corrupt.jpg").write_bytes(b"not a jpeg")
    raw = job(root, tmp / "g.zarr", data={"resize": None, "crop": 32, "shard_size": 4, "batch_size": 4},
              capture=[{"layer": "layer4", "what": "gradcam", "key": "cam"}, {"layer": "layer4", "reduce": "mean"}],
              output={"store": str(tmp / "g.zarr"), "chunk_rows": 2})
    assert run(parse_spec(raw)).ok == 6
    g = opened(str(tmp / "g.zarr"))
    return open_store(str(tmp / "g.zarr")), {k: np.asarray(g[k][:]) for k in ("target", "target_score", "cam.range")}


def test_gradient_extras_read_like_captures(gradient_store):
    s, raw = gradient_store
    assert s.keys == ["cam", "layer4"]  # captures only: the defaults of dataloader, probe
    assert sorted(s.extras) == ["cam.range", "target", "target_score"]
    assert s.extras["cam.range"]["dims"] == ["cam.range.minmax"] and s.extras["target"]["dtype"] == "int64"
    bad, ok = int(np.flatnonzero(s.status == FAILED)[0]), s.ok_rows()
    assert raw["target"][bad] == -1 and np.isnan(raw["target_score"][bad]) and np.isnan(raw["cam.range"][bad]).all()
    for name, want in raw.items():
        assert name in s
        np.testing.assert_array_equal(s[name][:], want)
        got = s.numpy(name)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want[ok])
        np.testing.assert_array_equal(s.numpy(name, rows=[bad, 0], only_ok=False), want[[bad, 0]])
        with pytest.raises(StoreError, match=f"{bad} \\(failed\\)"):
            s.numpy(name, rows=[bad])
    for n in (bad, int(ok[0])):
        r = s.row(str(s.ids[n]))
        for name, want in raw.items():
            np.testing.assert_array_equal(r[name], want[n])
        np.testing.assert_array_equal(r["cam"], s["cam"][n])
    rows, data = next(s.batches(["cam", "target"], 16, shuffle=True))
    assert sorted(rows.tolist()) == ok.tolist()
    np.testing.assert_array_equal(data["target"], raw["target"][rows])
    with pytest.raises(KeyError, match="captures: cam, layer4; per-row extras: ") as err:
        s["nope"]
    assert all(name in str(err.value) for name in raw)


def test_gradient_extras_in_xarray(gradient_store):
    pytest.importorskip("xarray")
    pytest.importorskip("dask")
    s, raw = gradient_store
    ds = s.to_xarray(only_ok=False)
    assert set(ds.data_vars) == {"cam", "layer4", "cam.range"}
    assert {"target", "target_score"} <= set(ds.coords)  # per-row scalars, like label: they follow every capture
    assert ds["target"].dims == ("row",) and ds["cam"]["target"].dims == ("row",)
    assert ds["cam.range"].dims == ("row", "cam.range.minmax") and list(ds["cam.range.minmax"].values) == ["min", "max"]
    for name, want in raw.items():
        np.testing.assert_array_equal(ds[name].values, want)
    ok = s.to_xarray()
    for name in raw:
        np.testing.assert_array_equal(ok[name].values, s.numpy(name))
    np.testing.assert_array_equal(ok["cam.range"].sel({"cam.range.minmax": "max"}).values, s.numpy("cam").max((1, 2)))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> tuple[ActivationStore, np.ndarray]:
    """60 rows of (5 tokens, 4 features) in chunks of 8, the model's prefix: 1 token; row 3 failed,
    rows 56-59 pending. Also returns the capture as zarr reads it."""
    url = str(tmp_path_factory.mktemp("tokens") / "s.zarr")
    n = 60
    meta = {"shape": [5, 4], "dtype": "float16", "dims": ["tok.token", "tok.feature"], "layer": "blocks.0",
            "what": "output", "reduce": "none"}
    flat = {"shape": [4], "dtype": "float32", "dims": ["b.feature"], "layer": "x", "what": "output", "reduce": "cls"}
    patches = {**meta, "shape": [4, 4], "dims": ["pat.token", "pat.feature"], "drop_prefix": 1}  # stored without CLS
    caps = {"tok": meta, "a": {**flat, "dims": ["a.feature"]}, "b": flat, "pat": patches}
    rows = Rows(ids=[f"img{i}" for i in range(n)], paths=[""] * n, labels=[i % 3 for i in range(n)])
    g = create_store(url, rows, StoreArrays(captures=caps, extras={}, shard_size=8, chunk_rows=dict.fromkeys(caps, 8)),
                     attrs={"n_rows": n, "n_shards": 8, "captures": caps, "format_version": 1, "spec": {},
                            "model": {"prefix_tokens": 1}})
    rng = np.random.default_rng(0)
    g["tok"][:56] = rng.standard_normal((56, 5, 4)).astype(np.float16)
    g["a"][:56] = rng.standard_normal((56, 4)).astype(np.float32)
    g["b"][:56] = rng.standard_normal((56, 4)).astype(np.float32)
    g["pat"][:56] = np.asarray(g["tok"][:56])[:, 1:]
    status = np.full(n, OK, np.uint8)
    status[3], status[56:] = FAILED, 0
    g["status"][:] = status
    return open_store(url), np.asarray(g["tok"][:])


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_prefix", [False, True, 2])
def test_token_batches_cover_every_token_of_every_ok_row_once(tokens, shuffle: bool, drop_prefix):
    s, full = tokens
    skip = {False: 0, True: 1, 2: 2}[drop_prefix]
    seen, sizes = [], []
    kept = list(s.token_batches("tok", 7, shuffle=shuffle, seed=3, drop_prefix=drop_prefix, buffer_chunks=2))
    for index, x in kept:  # batches kept while later ones were read: none overwritten (buffers are reused)
        assert x.shape == (len(index), 4) and x.dtype == np.float16
        np.testing.assert_array_equal(x, full[index[:, 0], index[:, 1]])  # each token is the one it says
        seen += [tuple(i) for i in index]
        sizes.append(len(index))
    ok = [r for r in range(56) if r != 3]
    assert sorted(seen) == [(r, t) for r in ok for t in range(skip, 5)]  # every (row, token) once
    assert all(n == 7 for n in sizes[:-1])
    assert (seen == sorted(seen)) != shuffle  # in row and token order unless shuffled
    if shuffle:  # tokens of many images mixed in every batch
        assert len({r for r, _ in seen[:7]}) >= 4
    again = [tuple(r) for i, _ in s.token_batches("tok", 7, shuffle=shuffle, seed=3, drop_prefix=drop_prefix,
                                                  buffer_chunks=2) for r in i]
    assert again == seen
    if shuffle:
        other = [tuple(r) for i, _ in s.token_batches("tok", 7, seed=4, drop_prefix=drop_prefix, buffer_chunks=2)
                 for r in i]
        assert other != seen and sorted(other) == sorted(seen)


def test_token_batches_refuse_what_is_not_a_token_capture(tokens):
    s, _ = tokens
    with pytest.raises(StoreError, match=r"token_batches needs a capture of \(tokens, features\) rows; 'a' is \[4\]"):
        next(s.token_batches("a"))
    with pytest.raises(StoreError, match="dropping 5 leaves none"):
        next(s.token_batches("tok", drop_prefix=5))


def test_torch_token_loader_converts_dtype_and_drops_the_last_short_batch(tokens):
    torch = pytest.importorskip("torch")
    s, full = tokens
    loader = s.dataloader("tok", batch_size=16, tokens=True, dtype=torch.float32, drop_last=True, drop_prefix=True)
    batches = list(loader)
    assert all(b["tok"].dtype == torch.float32 and b["tok"].shape == (16, 4) for b in batches)
    assert len(batches) == (55 * 4) // 16  # the short last batch left out
    b = batches[0]
    np.testing.assert_array_equal(b["tok"].numpy(), full[b["row"].numpy(), b["token"].numpy()].astype(np.float32))
    assert (b["token"] >= 1).all()
    bf = next(iter(s.dataloader("tok", batch_size=8, tokens=True, dtype=torch.bfloat16)))
    assert bf["tok"].dtype == torch.bfloat16
    rows = next(iter(s.dataloader(["a"], batch_size=50, dtype=torch.float64, drop_last=True)))
    assert rows["a"].dtype == torch.float64 and len(rows["a"]) == 50
    assert len(list(s.dataloader(["a"], batch_size=50, drop_last=True))) == 1  # 55 ok rows: one full batch


def test_dataloader_refuses_unknown_options_at_the_call(tokens):
    pytest.importorskip("torch")
    s, _ = tokens
    with pytest.raises(TypeError, match=r"unknown option\(s\) bufer_chunks; it takes .*buffer_chunks"):
        s.dataloader(["a"], bufer_chunks=2)
    with pytest.raises(KeyError, match="'nope' is not a capture"):
        s.dataloader(["nope"])
    with pytest.raises(StoreError, match=r"needs a capture of \(tokens, features\) rows; 'a' is \[4\]"):
        s.dataloader(["tok", "a"], tokens=True)


def test_to_xarray_stacks_captures_of_one_shape_on_a_layer_dim(tokens):
    import extractor

    xr = pytest.importorskip("xarray")
    pytest.importorskip("dask")
    s, _ = tokens
    da = s.to_xarray(stack=["a", "b"])
    assert da.dims == ("layer", "row", "feature") and list(da["layer"].values) == ["a", "b"]
    np.testing.assert_array_equal(da.sel(layer="a").values, s.numpy("a"))
    np.testing.assert_array_equal(da.sel(layer="b").values, s.numpy("b"))
    np.testing.assert_array_equal(da["labels"].values, s.labels[s.ok_rows()])
    with pytest.raises(ValueError, match="one shape and kind"):
        s.to_xarray(stack=["a", "tok"])
    plain = xr.open_zarr(extractor.zarr_store(s.url), consolidated=False)
    ours = s.to_xarray(only_ok=False)
    assert {"ids", "labels"} <= set(plain.coords) and {"ids", "labels"} <= set(ours.coords)  # the same names


def test_the_torch_views_take_float_dtypes_only_and_know_their_length(tokens):
    torch = pytest.importorskip("torch")
    s, _ = tokens
    with pytest.raises(TypeError, match=r"dtype must be a floating torch dtype .* not torch.int32"):
        s.dataloader("tok", tokens=True, dtype=torch.int32)
    loader = s.dataloader("tok", batch_size=16, tokens=True, dtype="float32", drop_prefix=True)
    batches = list(loader)
    assert batches[0]["tok"].dtype == torch.float32 and len(loader) == len(batches) == -(-55 * 4 // 16)
    rows = s.dataloader(["a"], batch_size=10, drop_last=True)
    assert len(rows) == len(list(rows)) == 5
    with pytest.raises(StoreError, match=r"^token_batches of several captures serves the same tokens of each; with "
                                         r"drop_prefix=False they differ \(tok: tokens 0 to 4 of its layer's sequence; "
                                         r"pat: tokens 1 to 4 of its layer's sequence\): stream them one by one"):
        s.token_batches(["tok", "pat"])
    with pytest.raises(TypeError, match="batch_size must be an int"):
        next(s.token_batches("tok", batch_size="4"))


def test_to_xarray_stack_of_one_key_or_none(tokens):
    pytest.importorskip("xarray")
    pytest.importorskip("dask")
    s, _ = tokens
    assert s.to_xarray(stack="a").dims == ("layer", "row", "feature")
    with pytest.raises(ValueError, match="at least one capture key"):
        s.to_xarray(stack=[])


def test_drop_prefix_true_drops_nothing_more_from_a_capture_stored_without_its_prefix(tokens):
    """A capture stored with drop_prefix (the dinov2 job's patches) holds patch tokens only: the README's
    drop_prefix=True reads all of them (before, the model's prefix count was cut again, from the patches), each
    named by its position in the layer's sequence, as from the capture stored whole."""
    pytest.importorskip("torch")
    s, full = tokens
    assert s.token_span("pat", True) == (0, 4) and s.token_span("tok", True) == (1, 4)
    seen = sorted(tuple(i) for i, _ in s.token_batches("pat", 7, drop_prefix=True) for i in i)
    assert seen == [(r, t) for r in range(56) if r != 3 for t in range(1, 5)]
    loader = s.dataloader("pat", batch_size=8, tokens=True, drop_prefix=True)
    assert sum(len(b["pat"]) for b in loader) == 55 * 4 and len(loader) == -(-55 * 4 // 8)
    b = next(iter(loader))
    np.testing.assert_array_equal(b["pat"].numpy(), full[b["row"].numpy(), b["token"].numpy()])  # tokens 1..4
    assert s.token_span("pat", 1) == (1, 3)  # an explicit count cuts further, from the tokens as stored


def test_two_captures_of_the_same_positions_stream_together_however_each_was_stored(tokens):
    """issue 54: a capture stored whole and one stored without its prefix serve the same tokens with drop_prefix=True
    (positions 1 to 4), yet were refused, their layouts said as internal tuples. Streamed together: each token's
    values from both, the same (pat holds tok's patch tokens)."""
    s, full = tokens
    seen = []
    for index, x in s.token_batches(["tok", "pat"], 7, seed=1, drop_prefix=True, buffer_chunks=2):
        np.testing.assert_array_equal(x["tok"], full[index[:, 0], index[:, 1]])
        np.testing.assert_array_equal(x["pat"], x["tok"])
        seen += [tuple(i) for i in index]
    assert sorted(seen) == [(r, t) for r in range(56) if r != 3 for t in range(1, 5)]
    pytest.importorskip("torch")
    batch = next(iter(s.dataloader(["pat", "tok"], batch_size=8, tokens=True, drop_prefix=True)))
    np.testing.assert_array_equal(batch["pat"].numpy(), batch["tok"].numpy())


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("workers", [2, 3])
def test_dataloader_workers_split_the_epoch_every_token_once(tokens, workers: int):
    """Real DataLoader worker processes: each reads its own part of the epoch's chunks; every (row, token)
    comes once per epoch, each epoch in its own order, and len() counts the batches that come."""
    pytest.importorskip("torch")
    s, full = tokens
    want = sorted((r, t) for r in range(56) if r != 3 for t in range(1, 5))
    loader = s.dataloader("tok", batch_size=16, tokens=True, drop_prefix=True, num_workers=workers, seed=5)
    epochs = []
    for _ in range(2):
        batches = list(loader)
        seen = [(int(r), int(t)) for b in batches for r, t in zip(b["row"], b["token"], strict=True)]
        assert sorted(seen) == want and len(batches) == len(loader)
        b = batches[0]
        np.testing.assert_array_equal(b["tok"].numpy(), full[b["row"].numpy(), b["token"].numpy()])
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    rows = s.dataloader(["a"], batch_size=5, num_workers=workers)
    got = [int(r) for b in rows for r in b["row"]]
    assert sorted(got) == sorted(s.ok_rows().tolist())


def test_a_dataloader_of_your_own_around_the_dataset_reads_each_row_once(tokens):
    """The torch idiom DataLoader(loader.dataset, num_workers=2, batch_size=None): each token once, not once
    per worker; set_epoch gives the next epoch its own order."""
    torch = pytest.importorskip("torch")
    s, _ = tokens
    ds = s.dataloader("tok", batch_size=16, tokens=True).dataset
    mine = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    first = [(int(r), int(t)) for b in mine for r, t in zip(b["row"], b["token"], strict=True)]
    assert sorted(first) == sorted((r, t) for r in range(56) if r != 3 for t in range(5))
    ds.set_epoch(1)
    second = [(int(r), int(t)) for b in mine for r, t in zip(b["row"], b["token"], strict=True)]
    assert sorted(second) == sorted(first) and second != first


def test_map_style_dataset_reads_each_chunk_once_in_row_order(tokens, monkeypatch):
    """torch_dataset in a DataLoader (batches of items, worker processes allowed) reads a chunk per chunk,
    not per row."""
    torch = pytest.importorskip("torch")
    s, full = tokens
    counting = _CountingArray(s["tok"])
    monkeypatch.setattr(ActivationStore, "__getitem__", lambda self, key: counting)
    ds = s.torch_dataset("tok")
    items = [ds[i] for i in range(len(ds))]
    assert [int(it["row"]) for it in items] == s.ok_rows().tolist()
    np.testing.assert_array_equal(torch.stack([it["tok"] for it in items]).numpy(), full[s.ok_rows()])
    assert sorted(counting.reads) == list(range(7))  # 55 ok rows in chunks 0-6: each read once
    counting.reads.clear()
    batches = list(torch.utils.data.DataLoader(ds, batch_size=10))
    assert sum(len(b["row"]) for b in batches) == 55 and sorted(counting.reads) == list(range(7))
    monkeypatch.undo()
    shuffled = torch.utils.data.DataLoader(s.torch_dataset("tok"), batch_size=10, shuffle=True, num_workers=2)
    assert sorted(int(r) for b in shuffled for r in b["row"]) == s.ok_rows().tolist()


def test_inspect_verify_objects_finds_an_object_removed_or_cut_short(store, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture):
    """``inspect --verify --objects``: each object a commit names is there and decodes; one removed by hand is
    missing, one cut short is damaged, and the command exits 1 naming both (a whole store: 0)."""
    import shutil

    from extractor.cli import main

    path = tmp_path / "s.zarr"
    shutil.copytree(store.url, path)
    assert main(["inspect", str(path), "--verify", "--objects"]) == 0
    whole = open_store(str(path)).verify_objects()
    assert whole["checked"] > 0 and not whole["missing"] and not whole["damaged"]
    attempts = path / store.attrs["generation"] / "__attempts"
    (removed,) = attempts.glob("*/map/c/1/0/0/0")
    removed.unlink()
    (cut,) = attempts.glob("*/layer4/c/3/0")
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    capsys.readouterr()
    assert main(["inspect", str(path), "--verify", "--objects"]) == 1
    out = capsys.readouterr().out
    assert f"{whole['checked']} objects its commits name, 1 missing, 1 damaged" in out
    assert "missing: map/c/1/0/0/0" in out and "damaged: layer4/c/3/0" in out
    assert main(["inspect", str(path), "--objects"]) != 0
    assert "--objects checks the store's objects with --verify" in capsys.readouterr().err


def test_row_counts_are_the_ledgers_sums_and_equal_the_status_arrays(image_dir: Path, tmp_path: Path):
    """issue 57: inspect's and repr's counts are summed over the ledger's commits (one read at open, whatever the
    rows), not counted in the per-row status array: the same figures, with failed rows, part of the shards done, and
    after the resume that finishes it."""
    import shutil

    from extractor.store.layout import STATUS_NAMES

    root = tmp_path / "imgs"
    shutil.copytree(image_dir, root)
    (root / "cats" / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")
    raw = job(root, tmp_path / "s.zarr", data={"shard_size": 4})
    spec = parse_spec(raw)

    def stop_after_two(name: str, info: dict) -> None:
        if name == "shard_done" and info["shard"] >= 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(spec, on_event=stop_after_two)
    for finished in (False, True):
        s = open_store(str(tmp_path / "s.zarr"))
        status = s.status
        by_array = {STATUS_NAMES[v]: int((status == v).sum()) for v in STATUS_NAMES}
        assert s.row_counts() == by_array == s.summary()["row_status"], finished
        assert by_array["pending"] > 0 if not finished else by_array["pending"] == 0
        if not finished:
            run(parse_spec({**raw, "output": {**raw["output"], "if_exists": "resume"}}))
    assert by_array["failed"] == 1 and by_array["ok"] == len(s) - 1


def test_a_store_written_without_a_jobs_commits_counts_its_rows_status(tmp_path: Path):
    """A synthetic store (rows written, no shard committed by a job): its counts are its status array's."""
    url = str(tmp_path / "syn.zarr")
    caps = {"x": {"shape": [2], "dtype": "float32", "dims": ["x.feature"], "layer": "x", "what": "output",
                  "reduce": "none"}}
    g = create_store(url, Rows(ids=["a", "b", "c"], paths=[""] * 3, labels=[0] * 3),
                     StoreArrays(captures=caps, extras={}, shard_size=2, chunk_rows={"x": 1}),
                     {"n_rows": 3, "n_shards": 2, "captures": caps, "format_version": 1, "spec": {}})
    g["status"][:] = np.array([OK, FAILED, OK], np.uint8)
    assert open_store(url).row_counts() == {"pending": 0, "ok": 2, "failed": 1}
