"""extractor.data.batch_resize: images of many sizes resized and cropped at once give what torchvision's resize of
each image gives (Preprocess.geometry on a tensor), up to float rounding; what it does not make is said (None)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from extractor.data.batch_resize import resize_crop
from extractor.data.preprocess import Preprocess

BASE = Preprocess(resize=48, crop=(40, 40), interpolation="bilinear", mean=(0.5,) * 3, std=(0.5,) * 3)


def images() -> list[torch.Tensor]:
    """Smooth pictures with noise, of sizes that shrink, grow and keep their side."""
    g = torch.Generator().manual_seed(0)
    out = []
    for h, w in ((60, 80), (80, 60), (55, 90), (48, 48), (40, 100), (120, 64), (45, 41)):
        base = torch.rand(1, 3, h // 6 + 1, w // 6 + 1, generator=g) * 255
        x = torch.nn.functional.interpolate(base, size=(h, w), mode="bilinear")[0]
        out.append((x + torch.rand(3, h, w, generator=g) * 30).clamp(0, 255).to(torch.uint8))
    return out


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("crop_offset", ["round", "floor"])
@pytest.mark.parametrize("resize", [48, (44, 52), None])
def test_a_batch_resized_at_once_is_each_image_resized_by_torchvision(interpolation: str, crop_offset: str,
                                                                      resize: int | tuple[int, int] | None):
    pre = dataclasses.replace(BASE, interpolation=interpolation, crop_offset=crop_offset, resize=resize)
    imgs = images() if resize is not None else [x for x in images() if min(x.shape[-2:]) >= 40]
    got = resize_crop(imgs, pre)
    want = torch.stack([pre.geometry(x) for x in imgs])
    assert got.shape == want.shape == (len(imgs), 3, 40, 40) and got.dtype == torch.uint8
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 1e-3  # a level, on a pixel that rounds the other way


def test_what_it_does_not_make_is_none():
    imgs = images()
    assert resize_crop(imgs, dataclasses.replace(BASE, interpolation="lanczos")) is None  # another filter
    assert resize_crop(imgs, dataclasses.replace(BASE, resize=(48, 48), crop=None)) is None  # no crop
    assert resize_crop(imgs, dataclasses.replace(BASE, resize=32)) is None  # a crop larger than the image: padded
    assert resize_crop([], BASE) is None
