"""Preprocessing: the library's defaults under the spec's settings, and the geometry (Pillow as torchvision)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from extractor.data.preprocess import IMAGENET, Preprocess, of_store, resolve
from extractor.errors import SpecError
from extractor.spec.data_spec import DataSpec

TIMM = Preprocess(resize=248, crop=(224, 224), interpolation="bicubic", mean=(0.5,) * 3, std=(0.5,) * 3,
                  crop_pct=0.9, source="timm data config of x")


def data(**kw) -> DataSpec:
    return DataSpec(root="imgs", **kw)


def test_auto_takes_the_library_and_explicit_settings_win():
    p = resolve(data(), TIMM)
    assert p == TIMM
    p = resolve(data(interpolation="bilinear", mean=[0.1, 0.2, 0.3]), TIMM)
    assert (p.interpolation, p.mean, p.std, p.resize) == ("bilinear", (0.1, 0.2, 0.3), (0.5,) * 3, 248)
    assert p.source == "timm data config of x, with data.interpolation, data.mean from the job spec"
    assert resolve(data(crop=112), TIMM).resize == 124  # a crop of the job's own, in timm's proportion
    assert resolve(data(crop=112), IMAGENET).resize == 128  # 256 / 224
    assert resolve(data(crop=96, crop_pct=0.75), TIMM).resize == 128
    assert resolve(data(crop=96, crop_pct=0.75), TIMM).crop_pct == 0.75
    assert resolve(data(resize=300), TIMM).crop_pct is None  # a resize of the job's own: no ratio
    assert resolve(data(crop=112), IMAGENET).crop_pct == 224 / 256  # the proportion the resize came from
    assert resolve(data(preprocess="imagenet"), TIMM).mean == IMAGENET.mean


def test_squash_and_non_square_crops():
    p = resolve(data(resize=[40, 60], crop=None), IMAGENET)
    assert p.size == (40, 60) and p.crop is None
    assert resolve(data(resize=[50, 70], crop=[40, 60]), IMAGENET).size == (40, 60)


@pytest.mark.parametrize(("kw", "message"), [
    ({"crop": None}, r"data.crop is null but data.resize is 256"),
    ({"resize": 100, "crop_pct": 0.9}, r"data.resize and data.crop_pct both set"),
    ({"crop": [32, 48], "crop_pct": 0.9}, r"crop_pct needs a square data.crop"),
    ({"resize": [30, 30], "crop": [32, 32]}, r"data.crop \[32, 32\] is larger than data.resize"),
])
def test_bad_combinations_are_one_line_errors(kw: dict, message: str):
    with pytest.raises(SpecError, match=message):
        resolve(data(**kw), IMAGENET)


def test_a_librarys_crop_pct_above_one_pads_and_a_jobs_crop_above_its_resize_is_refused():
    """issue 54: timm's crop_pct 1.15 (VOLO at 448) resizes the shorter side to 389 and crops 448, padding, as timm's
    transform does: taken (it was refused as a crop larger than data.resize the job never set)."""
    volo = Preprocess(resize=389, crop=(448, 448), interpolation="bicubic", mean=(0.5,) * 3, std=(0.5,) * 3,
                      crop_pct=1.15, source="timm data config of volo_d4_448")
    assert resolve(data(), volo) == volo
    assert resolve(data(crop=224), volo).resize == 194  # a crop of the job's own, in timm's proportion
    with pytest.raises(SpecError, match=r"data.crop \[448, 448\] is larger than data.resize 300"):
        resolve(data(resize=300), volo)


def test_no_known_preprocessing_asks_only_for_what_is_left_at_auto():
    why = "hf:x has no image processor config (preprocessor_config.json) here"
    with pytest.raises(SpecError, match=r"hf:x has no image processor config .*so data.resize, data.crop, "
                                        r"data.interpolation, data.mean, data.std cannot be 'auto'"):
        resolve(data(), why)
    with pytest.raises(SpecError, match=r"so data.mean, data.std cannot be 'auto'"):
        resolve(data(resize=40, crop=32, interpolation="bicubic"), why)
    p = resolve(data(resize=40, crop=32, interpolation="bicubic", mean=[0.5] * 3, std=[0.5] * 3), why)
    assert p.size == (32, 32) and p.source == "the job spec"


def test_a_store_made_before_the_record_reads_its_spec():
    old = {"spec": {"data": {"resize": 72, "crop": 64, "interpolation": "bilinear", "mean": [0.4] * 3,
                             "std": [0.2] * 3}}}
    p = of_store(old)
    assert (p.resize, p.crop, p.mean) == (72, (64, 64), (0.4, 0.4, 0.4))
    assert of_store({"preprocess": p.to_dict()}) == p


@pytest.mark.parametrize("offset", ["round", "floor"])
@pytest.mark.parametrize("size", [(97, 131), (131, 97), (20, 30), (224, 225)])
def test_pillow_geometry_equals_torchvision_and_odd_margins_fall_as_asked(offset: str, size: tuple[int, int]):
    import torchvision.transforms.v2.functional as F
    from PIL import Image

    h, w = size
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    p = Preprocess(resize=40, crop=(32, 35), interpolation="bicubic", mean=(0,) * 3, std=(1,) * 3, crop_offset=offset)
    got = p.apply(img)
    resized = F.pil_to_tensor(F.resize(img, [40], interpolation=F.InterpolationMode.BICUBIC))
    if offset == "round":
        want = F.center_crop(resized, [32, 35])
    else:
        rh, rw = resized.shape[-2:]
        want = resized[:, (rh - 32) // 2:(rh - 32) // 2 + 32, (rw - 35) // 2:(rw - 35) // 2 + 35]
    assert got.shape == (3, 32, 35) and torch.equal(got, want)
    small = Preprocess(resize=None, crop=(40, 50), interpolation="bilinear", mean=(0,) * 3, std=(1,) * 3,
                       crop_offset=offset)
    if h < 40 or w < 50:  # padded with black like torchvision
        assert torch.equal(small.apply(img), F.center_crop(F.pil_to_tensor(img), [40, 50]))
