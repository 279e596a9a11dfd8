"""Channels-last maps (Swin, ConvNeXt blocks are (batch, y, x, channel)): reduced over their
spatial positions, named y, x, channel, and Grad-CAM over their channels, like a direct forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.jobs import job
from helpers.preprocess import reference_batch
from helpers.stores import root_attrs

from extractor.driver.runner import run
from extractor.errors import LayerError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec

SWIN = {"name": "swin_t", "weights": None, "device": "cpu"}
DATA = {"resize": 72, "crop": 64}  # maps of 16x16 (features.1), 8x8 (features.3)


def test_swin_maps_are_reduced_over_space_and_named_channel_last(tmp_path: Path):
    from helpers.images import make_images
    from torchvision.models import swin_t
    from torchvision.models.feature_extraction import create_feature_extractor

    make_images(tmp_path / "img", per_class=2)  # 4 images: batches of 3 and 1 (swin_t's gradients cost seconds)
    raw = job(tmp_path / "img", tmp_path / "s.zarr", model=SWIN, data=DATA, capture=[
        {"layer": "features.1", "reduce": "mean", "key": "s1"},
        {"layer": "features.3", "reduce": "none", "key": "s3", "dtype": "float32"},
        {"layer": "features.3", "what": "gradcam", "key": "cam"},
        {"layer": "features.1", "reduce": "mean", "key": "forced", "layout": "nchw"},
    ])
    assert run(parse_spec(raw)).ok == 4  # decided by which dims grow at another input size
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.captures["s1"]["dims"] == ["s1.channel"] and s["s1"].shape == (4, 96)
    assert s.captures["s3"]["dims"] == ["s3.y", "s3.x", "s3.channel"] and s["s3"].shape == (4, 8, 8, 192)
    assert s["forced"].shape == (4, 16)  # layout: nchw, as asked: the mean over (x, channel)

    torch.manual_seed(0)
    model = swin_t().eval()
    fx = create_feature_extractor(model, return_nodes=["features.1", "features.3", "head"])
    feats = fx(reference_batch([Path(p) for p in s.paths], 72, 64))
    a1, a3, logits = feats["features.1"], feats["features.3"], feats["head"]
    score = logits.gather(1, logits.argmax(1)[:, None]).sum()
    (g3,) = torch.autograd.grad(score, [a3])
    a3, g3 = a3.detach().permute(0, 3, 1, 2), g3.permute(0, 3, 1, 2)  # to (batch, channel, y, x)
    cam = torch.relu((g3.mean((2, 3), keepdim=True) * a3).sum(1))
    expected = {"s1": a1.detach().mean((1, 2)), "s3": a3.permute(0, 2, 3, 1), "cam": cam,
                "forced": a1.detach().mean((2, 3))}
    for key, ref in expected.items():
        got, ref = s.numpy(key), ref.numpy()
        err = np.abs(got - ref).max() / (np.abs(ref).max() + 1e-12)
        assert err < 2e-3, (key, err)


def test_a_store_made_before_layout_existed_still_resumes(image_dir: Path, tmp_path: Path):
    """A setting added since a store was made is compared at its default, not as a difference."""
    raw = job(image_dir, tmp_path / "s.zarr")
    run(parse_spec(raw))
    attrs = root_attrs(str(tmp_path / "s.zarr"))
    for c in attrs["spec"]["capture"]:
        del c["layout"]  # as written by the version before
    root_attrs(str(tmp_path / "s.zarr"), spec=attrs["spec"], spec_digest="0123456789abcdef")
    raw["output"]["if_exists"] = "resume"
    assert run(parse_spec(raw)).shards_skipped == 3
    raw["data"]["crop"] = 32  # a real difference is still one
    with pytest.raises(Exception, match=r"preprocess crop: \[64, 64\] in the store, \[32, 32\] now"):
        run(parse_spec(raw))


def test_a_map_whose_height_width_and_channels_are_equal_is_still_read_channels_last(tmp_path: Path):
    """swin_t features.1 at crop 384 is 96x96x96: its shape says nothing, the dims that grow at
    another input size do. The mean is over y and x, as a direct forward's."""
    from helpers.images import make_images
    from torchvision.models import swin_t
    from torchvision.models.feature_extraction import create_feature_extractor

    make_images(tmp_path / "img", per_class=1, size=300)
    raw = job(tmp_path / "img", tmp_path / "s.zarr", model=SWIN, data={"resize": 384, "crop": 384},
              capture=[{"layer": "features.1", "reduce": "mean", "key": "s1"}])
    assert run(parse_spec(raw)).ok == 2
    s = open_store(str(tmp_path / "s.zarr"))
    assert s["s1"].shape == (2, 96) and s.captures["s1"]["original_shape"] == [96, 96, 96]
    torch.manual_seed(0)
    fx = create_feature_extractor(swin_t().eval(), return_nodes=["features.1"])
    ref = fx(reference_batch([Path(p) for p in s.paths], 384, 384))["features.1"].mean((1, 2)).detach().numpy()
    assert np.abs(s.numpy("s1") - ref).max() < 1e-4 * np.abs(ref).max() + 1e-6


def test_a_map_whose_layout_no_fact_decides_is_refused(image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "s.zarr",
              model={"name": None, "factory": "toy_models:fixed_size_map", "device": "cpu"},
              data={"resize": 16, "crop": 16}, capture=[{"layer": "block", "reduce": "mean"}])
    with pytest.raises(LayerError, match=r"capture\[0\] block: layer 'block' \(Reshape\) gives 4x4x4 outputs whose "
                                         r"layout extractor cannot tell.*set capture\[0\].layout: nchw"):
        run(parse_spec(raw))
    assert not (tmp_path / "s.zarr").exists()  # refused before the store was created
    raw["capture"][0]["layout"] = "nhwc"
    assert run(parse_spec(raw)).ok == 12


def test_resume_with_another_channels_last_is_refused(image_dir: Path, tmp_path: Path):
    """issue 17, defect 12: channels_last changes stored values (about one float16 ulp); a resumed store
    must not mix both."""
    raw = job(image_dir, tmp_path / "s.zarr")
    run(parse_spec(raw))
    raw["output"]["if_exists"] = "resume"
    raw["model"]["channels_last"] = False
    with pytest.raises(Exception, match=r"model.channels_last: true in the store, false now"):
        run(parse_spec(raw))
    raw["model"]["channels_last"] = True
    raw["data"]["batch_size"] = 5  # run-only: resumes
    assert run(parse_spec(raw)).shards_skipped == 3


def test_settle_layouts_decides_from_facts_and_asks_when_none_decides():
    """The pure decision behind the probe: probabilities (attention), the module's type, the dims that grow at
    another input size, flatten (nothing to decide), a given layout (left alone); none of them: refused."""
    from torch import nn

    from extractor.model.reduce import contradicted_layouts, reduced_otherwise, settle_layouts
    from extractor.model.targets import Target

    def target(key: str, layer: str, reduce: str = "mean", layout: str = "auto") -> Target:
        return Target(key, layer, "output", None, reduce, "float32", 0, layout=layout)

    modules = {"conv": nn.Conv2d(3, 8, 3), "lin": nn.Linear(8, 8), "attn": nn.Identity(), "odd": nn.Identity(),
               "flat": nn.Identity(), "given": nn.Linear(8, 8)}
    shapes = {"conv": (8, 6, 6), "lin": (6, 6, 8), "attn": (2, 5, 5), "odd": (4, 6, 6), "flat": (4, 6, 6),
              "given": (6, 6, 8)}
    targets = [target("conv", "conv"), target("lin", "lin"), target("attn", "attn", "none"),
               target("odd", "odd"), target("flat", "flat", "flatten"), target("given", "given", layout="nchw")]
    asked: list[int] = []

    def elsewhere() -> dict[str, tuple[int, ...]]:
        asked.append(1)
        return {"odd": (4, 8, 8)}  # the spatial dims grow: channel first

    layouts = settle_layouts(targets, modules, shapes, {"attn": True}, elsewhere)
    assert layouts == {"conv": "nchw", "lin": "nhwc", "attn": "attention", "odd": "nchw", "flat": "nchw"}
    assert asked == [1]  # the other input size is run once, only for the output nothing else decides
    assert contradicted_layouts(targets, modules, shapes) == [(targets[-1], "nhwc")]
    assert reduced_otherwise(targets, layouts)  # lin's mean is over other dims than nchw's
    assert not reduced_otherwise(targets, {"conv": "nchw", "flat": "nchw"})
    with pytest.raises(LayerError, match=r"capture\[0\] odd: layer 'odd' \(Identity\) gives 4x6x6 outputs whose "
                                         r"layout extractor cannot tell \(not a module type it knows, and the model "
                                         r"does not run at another input size .*set capture\[0\].layout: nchw"):
        settle_layouts([targets[3]], modules, shapes, {}, dict)
    # issue 54: an output pooled to 1 x 1 (HF's pooler_output) keeps its shape at every size: its channels first;
    # a shape kept otherwise is refused saying so, not that the model does not run at another size
    pooled = {"pool": (8, 1, 1), "last": (1, 1, 8), "fixed": (4, 6, 6)}
    mods = dict.fromkeys(pooled, nn.Identity())
    ts = [target(k, k) for k in pooled]
    assert settle_layouts(ts[:2], mods, pooled, {}, lambda: pooled) == {"pool": "nchw", "last": "nhwc"}
    with pytest.raises(LayerError, match=r"gives 4x6x6 outputs whose layout extractor cannot tell \(not a module type "
                                         r"it knows, and it keeps this shape at another input size, so no dims grow"):
        settle_layouts(ts[2:], mods, pooled, {}, lambda: pooled)
