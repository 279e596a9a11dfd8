"""Storage-cutting captures (issue 28): sample_tokens and project, computed on the device, equal the same
sampling and projection done by hand on the full capture of the same job (a random-init timm ViT)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.jobs import job
from helpers.stores import replaced_array

import extractor
from extractor.driver.runner import run
from extractor.errors import LayerError, SpecError
from extractor.model.reduce import sample_positions as device_positions
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec
from extractor.store.sampling import draw_keys, projection_matrix, sample_positions

pytest.importorskip("timm")

VIT = {"name": "timm:vit_small_patch16_224", "weights": "random", "device": "cpu",
       "kwargs": {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48, "num_heads": 2}}  # CLS + 16 patches
DATA = {"resize": 32, "crop": 32, "shard_size": 4, "batch_size": 3}


def test_the_device_draw_equals_the_numpy_one_the_reader_reproduces():
    rng = np.random.default_rng(0)
    for seed in (0, 7, 2**31 + 5):
        rows = rng.integers(0, 2**40, 50)
        for n, k in ((16, 6), (256, 32), (5, 5)):
            want = sample_positions(seed, rows, n, k)
            got = device_positions(seed, torch.as_tensor(rows), n, k).numpy()
            assert np.array_equal(got, want)
            assert all(len(set(r)) == k and list(r) == sorted(r) for r in want)  # without replacement, in order
    draws = sample_positions(1, np.arange(2000), 16, 4)
    counts = np.bincount(draws.ravel(), minlength=16)  # every token drawn about as often: 2000 * 4 / 16 = 500
    assert counts.min() > 400 and counts.max() < 600


def test_projection_matrices_keep_norms_and_are_made_from_the_seed():
    for kind in ("gaussian", "sparse"):
        m = projection_matrix(3, 512, 256, kind)
        assert m.shape == (512, 256) and m.dtype == np.float32
        assert np.array_equal(m, projection_matrix(3, 512, 256, kind)) and not np.array_equal(m, projection_matrix(
            4, 512, 256, kind))
        x = np.random.default_rng(0).standard_normal((200, 512)).astype(np.float32)
        ratio = np.linalg.norm(x @ m, axis=1) / np.linalg.norm(x, axis=1)
        assert abs(float(ratio.mean()) - 1) < 0.05
    assert (projection_matrix(0, 64, 16, "sparse") == 0).mean() > 0.5


def test_sampled_and_projected_captures_equal_the_full_capture_cut_by_hand(image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "s.zarr", model=VIT, data=DATA, capture=[
        {"layer": "blocks.1", "reduce": "none", "key": "full"},
        {"layer": "blocks.1", "reduce": "none", "key": "sampled", "sample_tokens": 6, "seed": 3},
        {"layer": "blocks.1", "reduce": "none", "key": "patches", "sample_tokens": 5, "drop_prefix": True, "seed": 3},
        {"layer": "blocks.1", "reduce": "none", "key": "projected", "project": 8, "seed": 1},
        {"layer": "blocks.1", "reduce": "mean", "key": "pooled", "project": 5, "projection": "sparse", "seed": 2},
        {"layer": "blocks.1", "reduce": "none", "key": "both", "sample_tokens": 4, "project": 6, "seed": 9,
         "dtype": "float16"},
        {"layer": "blocks.1", "reduce": "none", "key": "patches_only", "drop_prefix": True},
    ])
    run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    full = s.numpy("full")
    keys = draw_keys(s.digests)  # each image's draw is keyed by its content digest, whatever its row
    assert s.captures["sampled"]["shape"] == [7, 48] and s.captures["sampled"]["prefix_kept"] == 1
    assert s.captures["sampled"]["sampled_by"] == "digest"

    index = s.numpy("sampled.token_index")  # CLS in front, then 6 of the 16 patch tokens, drawn per row
    assert index.dtype == np.int16 and s.extras["sampled.token_index"]["dtype"] == "int16"  # positions < 32,768
    want = np.concatenate([np.zeros((len(s), 1), np.int64), sample_positions(3, keys, 16, 6) + 1], axis=1)
    assert np.array_equal(index, want)
    assert np.array_equal(s.numpy("sampled"), np.take_along_axis(full, index[:, :, None], axis=1))

    index = s.numpy("patches.token_index")  # patch tokens only: positions in the layer's sequence, CLS counted
    assert np.array_equal(index, sample_positions(3, keys, 16, 5) + 1)
    assert np.array_equal(s.numpy("patches"), np.take_along_axis(full, index[:, :, None], axis=1))

    p = s.projection("projected")
    assert p.shape == (48, 8) and np.array_equal(p, projection_matrix(1, 48, 8))
    np.testing.assert_allclose(s.numpy("projected"), full @ p, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s.numpy("pooled"), full.mean(axis=1) @ s.projection("pooled"), rtol=1e-4, atol=1e-5)

    index = s.numpy("both.token_index")
    cut = np.take_along_axis(full, index[:, :, None], axis=1) @ s.projection("both")
    np.testing.assert_allclose(s.numpy("both").astype(np.float32), cut, rtol=2e-3, atol=2e-3)  # stored float16

    seen = {}
    for idx, data in s.token_batches("sampled", batch_size=5, shuffle=True, seed=1):
        for (row, position), x in zip(idx, data, strict=True):
            seen[(int(row), int(position))] = x
    assert len(seen) == len(s) * 7  # every kept token once, named by its position in the layer's sequence
    for (row, position), x in seen.items():
        assert np.array_equal(x, full[row, position])
    positions = s.numpy("sampled.token_index", only_ok=False)  # made before int16: int64
    replaced_array(str(tmp_path / "s.zarr"), "sampled.token_index", positions.astype(np.int64), (len(positions), 7))
    before = open_store(str(tmp_path / "s.zarr"))
    assert before.numpy("sampled.token_index").dtype == np.int64
    again = {(int(r), int(p)): x for idx, data in before.token_batches("sampled", batch_size=5, shuffle=True, seed=1)
             for (r, p), x in zip(idx, data, strict=True)}
    assert again.keys() == seen.keys()
    # a patch has one position in every capture of the layer: stored whole, without the prefix, or sampled
    for key, drop in (("full", True), ("patches_only", False), ("patches", False)):
        for idx, data in s.token_batches(key, batch_size=64, shuffle=False, drop_prefix=drop):
            assert idx[:, 1].min() >= 1  # the CLS (position 0) left out
            assert np.array_equal(data, full[idx[:, 0], idx[:, 1]])


def test_rows_reused_from_a_store_of_other_rows_keep_the_draw_a_clean_run_makes(image_dir: Path, tmp_path: Path):
    """The draw is keyed by each image's content digest, as output.reuse matches rows: a store over more images
    (every row number shifted) that takes rows from a smaller store holds the tokens a clean run samples."""
    import shutil

    some = tmp_path / "some"
    for p in sorted(image_dir.rglob("*.*"))[3:10]:  # 7 of the 12 images at other paths and rows
        (some / p.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, some / p.parent.name / f"copy-{p.name}")
    capture = [{"layer": "blocks.1", "reduce": "none", "key": "tokens", "sample_tokens": 5, "seed": 7}]
    run(parse_spec(job(some, tmp_path / "first.zarr", model=VIT, data=DATA, capture=capture)))
    reused = run(parse_spec(job(image_dir, tmp_path / "s.zarr", model=VIT, data=DATA, capture=capture,
                                output={"store": str(tmp_path / "s.zarr"), "reuse": [str(tmp_path / "first.zarr")]})))
    run(parse_spec(job(image_dir, tmp_path / "clean.zarr", model=VIT, data=DATA, capture=capture)))
    assert reused.reused == 7
    s, c = open_store(str(tmp_path / "s.zarr")), open_store(str(tmp_path / "clean.zarr"))
    assert np.array_equal(s.numpy("tokens.token_index"), c.numpy("tokens.token_index"))
    np.testing.assert_allclose(s.numpy("tokens"), c.numpy("tokens"), rtol=1e-5, atol=1e-6)  # batches of other rows
    assert np.array_equal(s.numpy("tokens.token_index")[:, 1:] - 1, sample_positions(7, draw_keys(s.digests), 16, 5))


def test_cutting_settings_that_cannot_hold_are_refused(image_dir: Path, tmp_path: Path):
    with pytest.raises(SpecError, match=r"sample_tokens keeps some tokens .* reduce: none"):
        parse_spec(job(image_dir, tmp_path / "a.zarr", capture=[{"layer": "x", "reduce": "mean", "sample_tokens": 4}]))
    with pytest.raises(SpecError, match="projection applies only with project"):
        parse_spec(job(image_dir, tmp_path / "a.zarr", capture=[{"layer": "x", "projection": "sparse"}]))
    too_many = job(image_dir, tmp_path / "b.zarr", model=VIT, data=DATA,
                   capture=[{"layer": "blocks.1", "sample_tokens": 17, "drop_prefix": True}])
    with pytest.raises(LayerError, match="sample_tokens 17 is more than its 16 patch tokens"):
        run(parse_spec(too_many))
    a_map = job(image_dir, tmp_path / "c.zarr", capture=[{"layer": "layer3", "reduce": "none", "project": 8}])
    with pytest.raises(LayerError, match="project applies to a last dimension of features"):
        run(parse_spec(a_map))
    assert not (tmp_path / "b.zarr").exists() and not (tmp_path / "c.zarr").exists()  # refused before the store


def test_sample_tokens_on_a_cnn_map_says_first_that_a_map_is_not_a_token_sequence(image_dir: Path, tmp_path: Path):
    """Before: it asked for drop_prefix, then for model.prefix_tokens, and only then said the real reason."""
    a_map = job(image_dir, tmp_path / "d.zarr", capture=[{"layer": "layer3", "reduce": "none", "sample_tokens": 4}])
    with pytest.raises(LayerError, match=r"is \(1, 32, 4, 4\), not a token sequence \(batch, tokens, features\): "
                                         r"sample_tokens samples tokens; a 4-D map \(a CNN's\) has none"):
        run(parse_spec(a_map))
    assert not (tmp_path / "d.zarr").exists()


@pytest.mark.parametrize("sharding", [True, False])
def test_a_bfloat16_capture_holds_the_full_capture_rounded_and_reads_back_as_bfloat16(image_dir: Path,
                                                                                      tmp_path: Path, sharding: bool):
    """bfloat16 is the zarr-extensions data type of that name: zarr, xarray and dask read it back as bfloat16
    (ml_dtypes'), bit for bit the float32 capture rounded by torch, and the torch views give torch.bfloat16."""
    import json

    import dask.array as da
    import xarray as xr
    import zarr

    raw = job(image_dir, tmp_path / "s.zarr", model=VIT, data=DATA, output={"store": str(tmp_path / "s.zarr"),
                                                                           "sharding": sharding},
              capture=[{"layer": "blocks.1", "reduce": "none", "key": "full"},
                       {"layer": "blocks.1", "reduce": "none", "key": "half", "dtype": "bfloat16"},
                       {"layer": "blocks.1", "reduce": "none", "key": "cut", "dtype": "bfloat16", "sample_tokens": 3,
                        "project": 8, "seed": 4}])
    run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    full = s.numpy("full")
    want = torch.from_numpy(full).to(torch.bfloat16)
    half = s.numpy("half")
    assert str(half.dtype) == "bfloat16" and (s["half"].shards is not None) == sharding
    assert np.array_equal(half.view(np.int16), want.view(torch.int16).numpy())  # the same bits
    assert s.captures["half"]["dtype"] == "bfloat16"
    meta = json.loads((tmp_path / "s.zarr" / s.attrs["generation"] / "half" / "zarr.json").read_text())
    assert meta["data_type"] == "bfloat16" and meta["fill_value"] == "NaN"

    index = s.numpy("cut.token_index")  # sampled and projected in float32 on the device, then rounded
    cut = np.take_along_axis(full, index[:, :, None], axis=1) @ s.projection("cut")
    np.testing.assert_allclose(s.numpy("cut").astype(np.float32), cut, rtol=2**-7, atol=1e-5)

    store = extractor.zarr_store(str(tmp_path / "s.zarr"))
    native = zarr.open_array(store, path="half", mode="r")
    assert str(native.dtype) == "bfloat16" and np.array_equal(native[:].view(np.int16), half.view(np.int16))
    ds = xr.open_zarr(store, consolidated=False)
    assert str(ds["half"].dtype) == "bfloat16" and np.array_equal(ds["half"].values.view(np.int16),
                                                                  half.view(np.int16))
    lazy = da.from_zarr(native)
    assert np.array_equal(lazy.compute().view(np.int16), half.view(np.int16))

    batch = next(iter(s.dataloader("half", batch_size=len(s))))
    assert batch["half"].dtype == torch.bfloat16
    assert torch.equal(batch["half"].view(torch.int16), want[batch["row"]].view(torch.int16))
    item = s.torch_dataset("half")[1]["half"]
    assert item.dtype == torch.bfloat16 and torch.equal(item.view(torch.int16), want[1].view(torch.int16))
    stats = s.stats["half"]  # summed from the stored bfloat16 values
    np.testing.assert_allclose(stats["mean"], half.astype(np.float64).mean(axis=(0, 1)), rtol=1e-5, atol=1e-6)
    if sharding:  # without ml_dtypes: a one-line error that says what to install, never other numbers
        code = ("import sys; sys.modules['ml_dtypes'] = None\n"
                "import numpy as np\n"
                "from extractor.store.dtypes import is_bfloat16\n"
                "assert not is_bfloat16(np.dtype('float64')), 'float64 taken for bfloat16'\n"
                "from extractor import open_store\n"
                f"open_store({str(tmp_path / 's.zarr')!r})")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1
        assert out.stderr.strip().splitlines()[-1].endswith("a bfloat16 capture needs ml_dtypes, through which numpy "
                                                              "holds bfloat16: pip install ml_dtypes")


def test_a_projection_wider_than_its_capture_is_refused_in_one_line(image_dir: Path, tmp_path: Path):
    """issue 37, case 12: project: 1000000000 failed as "the model failed on a blank image ... set data.crop"
    around a 1.40 TiB matrix. The capture's width bounds it, before any matrix is made."""
    small = {"name": None, "factory": "toy_models:small_cnn", "weights": None, "device": "cpu"}
    raw = job(image_dir, tmp_path / "s.zarr", model=small, data=DATA,
              capture=[{"layer": "layer1", "reduce": "mean", "project": 1_000_000_000}])
    with pytest.raises(LayerError, match=r"^capture\[0\] layer 'layer1' output: project: 1000000000 is more than "
                                         r"its 16 features; a random projection keeps fewer: set project to at most "
                                         r"16, or leave it out to store them all$"):
        run(parse_spec(raw))
    assert not (tmp_path / "s.zarr").exists()
    raw["capture"][0]["project"] = 16
    assert run(parse_spec(raw)).ok == 12
