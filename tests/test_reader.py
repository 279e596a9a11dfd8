"""The analysis side: shuffled streaming, torch and xarray views, statistics, probes, pictures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import job, make_images

from extractor.reader import open_store
from extractor.runner import run
from extractor.spec import parse_spec


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


def test_xarray_view_matches_raw_arrays(store):
    pytest.importorskip("xarray")
    pytest.importorskip("dask")
    ds = store.to_xarray()
    assert set(ds.data_vars) == {"layer4", "map"}
    assert ds["layer4"].dims == ("row", "layer4.channel")
    assert ds["map"].dims == ("row", "map.channel", "map.y", "map.x")
    assert hasattr(ds["map"].data, "dask")
    np.testing.assert_array_equal(ds["layer4"].values, store["layer4"][:])
    assert list(ds["id"].values) == list(store.ids)
    np.testing.assert_array_equal(ds["label"].values, store.labels)
    row = ds.sel(row=3)
    assert str(row["id"].values) == str(store.ids[3])


def test_xarray_open_zarr_without_this_package(store):
    """The format stands on its own: xarray and dask read it with no extractor code."""
    xr = pytest.importorskip("xarray")
    da = pytest.importorskip("dask.array")
    ds = xr.open_zarr(store.url, consolidated=False)
    assert "ids" in ds.coords and "labels" in ds.coords
    np.testing.assert_array_equal(ds["layer4"].values, store["layer4"][:])
    arr = da.from_zarr(store.url, component="map")
    assert arr.shape == store["map"].shape


def test_probe_is_near_chance_on_shuffled_labels_and_high_on_separable_classes(tmp_path: Path):
    from extractor.analysis import linear_probe, probe_store
    from extractor.demo import write_sample_images

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


def test_probe_and_show_commands_write_pictures(tmp_path: Path, store):
    from PIL import Image

    from extractor.cli import main

    assert main(["probe", store.url, "--folds", "3", "--out", str(tmp_path / "p.png")]) == 0
    assert Image.open(tmp_path / "p.png").size[0] > 400
    assert main(["show", store.url, "--key", "layer4", "--out", str(tmp_path / "pca.png")]) == 0
    assert Image.open(tmp_path / "pca.png").size == (640, 520)
    assert main(["show", store.url, "--key", "layer4", "--rows", "0:6", "--columns", "3",
                 "--out", str(tmp_path / "rows.png")]) == 0
    assert Image.open(tmp_path / "rows.png").size == (3 * 32, 2 * (32 + 16))
    assert main(["show", store.url, "--key", "nope", "--out", str(tmp_path / "x.png")]) == 1


def test_nan_and_inf_are_stored_as_computed_and_counted(tmp_path: Path):
    from PIL import Image

    root = tmp_path / "imgs"
    make_images(root, per_class=3, classes=("a",), size=40)
    Image.new("RGB", (40, 40), (255, 255, 255)).save(root / "a" / "white.png")
    raw = job(root, tmp_path / "s.zarr", model={"name": None, "factory": "toy_models:nan_net", "device": "cpu"},
              data={"resize": None, "crop": 32}, capture=[{"layer": "conv", "reduce": "mean"}])
    summary = run(parse_spec(raw))
    assert summary.ok == 4 and summary.nonfinite == {"conv": (1, [3])}
    s = open_store(str(tmp_path / "s.zarr"))
    assert np.isinf(s.numpy("conv")[3]).all()
    st = s.attrs["stats"]["conv"]
    assert st["inf"] == 4 and st["nonfinite_rows"] == 1 and st["first_nonfinite_rows"] == [3]
    assert np.isfinite(st["mean"]).all()
