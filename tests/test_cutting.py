"""Storage-cutting captures (issue 28): sample_tokens and project, computed on the device, equal the same
sampling and projection done by hand on the full capture of the same job (a random-init timm ViT)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import job

from extractor.driver.runner import run
from extractor.errors import LayerError, SpecError
from extractor.model.capture import sample_positions as device_positions
from extractor.read.reader import open_store
from extractor.spec.schema import parse_spec
from extractor.store.sampling import projection_matrix, sample_positions

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
    ])
    run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    full = s.numpy("full")
    rows = np.arange(len(s))
    assert s.captures["sampled"]["shape"] == [7, 48] and s.captures["sampled"]["prefix_kept"] == 1

    index = s.numpy("sampled.token_index")  # CLS in front, then 6 of the 16 patch tokens, drawn per row
    want = np.concatenate([np.zeros((len(s), 1), np.int64), sample_positions(3, rows, 16, 6) + 1], axis=1)
    assert np.array_equal(index, want)
    assert np.array_equal(s.numpy("sampled"), np.take_along_axis(full, index[:, :, None], axis=1))

    index = s.numpy("patches.token_index")  # patch tokens only: positions in the layer's sequence, CLS counted
    assert np.array_equal(index, sample_positions(3, rows, 16, 5) + 1)
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


def test_cutting_settings_that_cannot_hold_are_refused(image_dir: Path, tmp_path: Path):
    with pytest.raises(SpecError, match="sample_tokens keeps some tokens .* reduce: none"):
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
