"""Preprocessing: how a decoded image becomes the model's input.

:class:`Preprocess` is the resolved record: resize, centre crop, interpolation, mean and std.
Its defaults come from the model's own library (timm's data config, the Hugging Face image
processor, open_clip's transform, torchvision's weights transforms; ImageNet's classic
256/224 otherwise); every ``data.*`` setting given in the spec (not ``auto``) replaces the
library's value. The store records the result (root attribute ``preprocess``) and the
decoders apply it. Images are resized and cropped as 8-bit RGB (Pillow on the CPU, torch on
the GPU); normalisation with ``mean``/``std`` happens on the model's device.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from ..errors import SpecError

__all__ = ["IMAGENET", "Preprocess", "from_dict", "resolve"]


Size = tuple[int, int]


@dataclass(frozen=True)
class Preprocess:
    """Resize, then centre crop, then (on the device) ``(x / 255 - mean) / std``."""

    resize: int | Size | None
    """An int resizes the shorter side to it (aspect kept); ``(h, w)`` squashes to exactly that
    size (aspect not kept, as SigLIP does); None keeps the image's size."""
    crop: Size | None
    """Centre crop ``(h, w)``; None: no crop (then ``resize`` is ``(h, w)``)."""
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_pct: float | None = None
    """The library's crop / resize ratio (timm's ``crop_pct``), when it has one: a crop asked for in
    the spec with ``resize: auto`` is resized by it (else by ``crop / resize`` of the defaults)."""
    crop_offset: str = "round"
    """Where an odd margin goes: ``round`` (torchvision's CenterCrop: timm, open_clip, torchvision)
    or ``floor`` (Hugging Face image processors): one pixel apart."""
    source: str = "ImageNet defaults"
    """Where the defaults came from (the library's config), for the store's record."""
    runs: str = "extractor"
    """Who makes the model's input: ``extractor`` (this record's resize and crop with Pillow, normalised on the
    device) or ``library`` (the model's own processor, per image on the CPU: ``data.preprocess: library``; then
    ``crop`` is the size it gives and ``mean``/``std`` are 0 and 1: its output is taken as it is)."""
    check: dict[str, Any] | None = None
    """What the probe measured: extractor's transform against the library's own processor on fixed probe
    images (see :mod:`extractor.model.processors`); None when nothing of a library's is claimed."""

    @property
    def size(self) -> Size:
        """The model's input (h, w)."""
        if self.crop is not None:
            return self.crop
        assert isinstance(self.resize, tuple)  # checked by resolve()
        return self.resize

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["check"] is None:
            del d["check"]
        for k in ("resize", "crop", "mean", "std"):
            if isinstance(d[k], tuple):
                d[k] = list(d[k])
        return d

    def draft_size(self, w: int, h: int) -> Size | None:
        """The smallest (w, h) that a ``w`` x ``h`` image may be decoded at before the resize:
        its shorter side at least the resized one (for ``(h, w)`` resizes, at least the larger of
        the two, whatever the EXIF orientation). None when nothing is resized."""
        if self.resize is None:
            return None
        side = self.resize if isinstance(self.resize, int) else max(self.resize)
        short = min(w, h)
        return -(-w * side // short), -(-h * side // short)

    def apply(self, img: Any) -> Any:  # PIL.Image.Image -> torch.Tensor (3, h, w) uint8
        """Resize and crop an 8-bit RGB Pillow image; a uint8 (3, h, w) tensor."""
        import torch

        arr = np.asarray(self.geometry(img))
        return torch.from_numpy(arr.copy()).permute(2, 0, 1)

    def geometry(self, img: Any) -> Any:
        """Resize and crop a Pillow image (Pillow only: what torchvision's resize and centre crop
        do to one), or a (..., 3, H, W) uint8 tensor on any device (torchvision, resampled in float)."""
        if not hasattr(img, "resize") or hasattr(img, "ndim"):
            return self._tensor_geometry(img)
        from PIL import Image

        if self.resize is not None:
            w, h = img.size
            if isinstance(self.resize, int):  # the shorter side, the longer one in proportion (rounded down)
                short, long = (w, h) if w <= h else (h, w)
                new_long = int(self.resize * long / short)
                size = (self.resize, new_long) if w <= h else (new_long, self.resize)
            else:
                size = (self.resize[1], self.resize[0])
            if size != img.size:
                img = img.resize(size, PIL_RESAMPLE[self.interpolation])
        if self.crop is None:
            return img
        ch, cw = self.crop
        w, h = img.size
        if w < cw or h < ch:  # padded with black, the extra pixel after (as torchvision and transformers pad)
            canvas = Image.new(img.mode, (max(w, cw), max(h, ch)))
            canvas.paste(img, ((cw - w) // 2 if cw > w else 0, (ch - h) // 2 if ch > h else 0))
            img, (w, h) = canvas, canvas.size
        if self.crop_offset == "floor":
            top, left = (h - ch) // 2, (w - cw) // 2
        else:
            top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
        return img.crop((left, top, left + cw, top + ch))

    def _tensor_geometry(self, img: Any) -> Any:
        import torch
        import torchvision.transforms.v2.functional as F
        from torchvision.transforms import InterpolationMode

        if self.resize is not None:
            size = [self.resize] if isinstance(self.resize, int) else list(self.resize)
            x = F.resize(img.float(), size, interpolation=InterpolationMode(self.interpolation), antialias=True)
            img = x.round_().clamp_(0, 255).to(torch.uint8)  # rounded back to 8 bits, as Pillow does
        if self.crop is None:
            return img
        h, w = img.shape[-2], img.shape[-1]
        ch, cw = self.crop
        if self.crop_offset == "floor" and h >= ch and w >= cw:
            return F.crop(img, (h - ch) // 2, (w - cw) // 2, ch, cw)
        return F.center_crop(img, [ch, cw])


PIL_RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}  # PIL's codes


IMAGENET = Preprocess(resize=256, crop=(224, 224), interpolation="bilinear",
                      mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def _pair(value: int | list[int] | tuple[int, ...]) -> Size:
    if isinstance(value, int):
        return value, value
    h, w = value
    return int(h), int(w)


_FIELDS = ("resize", "crop", "interpolation", "mean", "std")


def _left_auto(data: Any) -> list[str]:
    """The settings the job leaves to the model's library: ``auto``, except a resize that crop_pct sets and an
    interpolation with nothing resized (no resampling to choose)."""
    return [f for f in _FIELDS if getattr(data, f) == "auto" and not (f == "resize" and data.crop_pct is not None)
            and not (f == "interpolation" and data.resize is None)]


def _set_by_job(data: Any) -> list[str]:
    """The settings the job sets itself (null resize and crop included: "none")."""
    return [f for f in (*_FIELDS, "crop_pct") if getattr(data, f) not in ("auto", None)
            or (f in ("resize", "crop") and getattr(data, f) is None)]


def _base(data: Any, defaults: Preprocess | str) -> Preprocess:
    """What ``auto`` means: the library's values, or, where there are none (``defaults`` says why), nothing:
    every setting must then be the job's."""
    if not isinstance(defaults, str):
        return defaults
    auto = _left_auto(data)
    if auto:
        raise SpecError(
            f"{defaults}, so data.{', data.'.join(auto)} cannot be 'auto': set "
            f"{'them' if len(auto) > 1 else 'it'} in the job spec (e.g. resize: 256, crop: 224, "
            "interpolation: bicubic, mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225]), or set "
            "data.preprocess: imagenet"
        )
    return IMAGENET


def _source(data: Any, defaults: Preprocess | str, base: Preprocess) -> str:
    """Where the record's values came from, for the store and for error messages."""
    if isinstance(defaults, str) or not _left_auto(data):
        return "the job spec"
    given = _set_by_job(data)
    return base.source + (f", with data.{', data.'.join(given)} from the job spec" if given else "")


def _resize(data: Any, base: Preprocess, crop: Size | None) -> tuple[int | Size | None, float | None]:
    """The resize, and the crop_pct it came from (if any)."""
    if data.crop_pct is not None:  # the crop's own ratio: resize = crop / crop_pct
        if data.resize != "auto":
            raise SpecError("data.resize and data.crop_pct both set: crop_pct sets the resize (crop / crop_pct); "
                            "remove one of them")
        if crop is None or crop[0] != crop[1]:
            raise SpecError(f"data.crop_pct needs a square data.crop, not {crop}; set data.resize instead")
        return math.floor(crop[0] / data.crop_pct), data.crop_pct
    if data.resize != "auto":  # the job's own
        return (data.resize if data.resize is None or isinstance(data.resize, int) else _pair(data.resize)), None
    if data.crop != "auto" and crop is not None and base.crop is not None and base.resize is not None:
        # a crop of the job's own: resized in the library's proportion
        pct = base.crop_pct or base.crop[0] / (base.resize if isinstance(base.resize, int) else base.resize[0])
        if isinstance(base.resize, int):
            return math.floor(max(crop) / pct), pct
        return (math.floor(crop[0] / pct), math.floor(crop[1] / pct)), pct
    return base.resize, base.crop_pct  # the library's


def resolve(data: Any, defaults: Preprocess | str) -> Preprocess:
    """The preprocessing a job uses: ``defaults`` (the model's library's, or the reason there
    are none) with every ``data.*`` setting that is not ``auto`` in its place. The record's
    ``source`` names both; its ``crop_pct`` is the ratio the resize came from, if any.
    One step per setting, in the order each depends on the one before (timm's resolve_data_config)."""
    if data.preprocess == "imagenet":
        defaults = replace(IMAGENET, source="ImageNet defaults (data.preprocess: imagenet)")
    base = _base(data, defaults)
    # crop: the library's, none (null), or the job's (one size for both sides, or [H, W])
    crop = base.crop if data.crop == "auto" else (None if data.crop is None else _pair(data.crop))
    # resize: from crop_pct, the job's, the library's proportion for the job's crop, or the library's
    resize, pct = _resize(data, base, crop)
    out = replace(
        base,
        resize=resize,
        crop=crop,
        interpolation=base.interpolation if data.interpolation == "auto" else data.interpolation,
        mean=base.mean if data.mean == "auto" else tuple(data.mean),
        std=base.std if data.std == "auto" else tuple(data.std),
        crop_pct=pct,
        source=_source(data, defaults, base),
    )
    _check(out, data)
    return out


def _check(p: Preprocess, data: Any) -> None:
    if p.crop is None and not isinstance(p.resize, tuple):
        raise SpecError(
            f"data.crop is null but data.resize is {p.resize!r}: without a crop every image must be resized to "
            "one size; set data.resize: [H, W] (squash) or data.crop"
        )
    if p.crop is not None and p.resize is not None:
        short = p.resize if isinstance(p.resize, int) else None
        too_big = (short is not None and max(p.crop) > short) or \
            (isinstance(p.resize, tuple) and (p.crop[0] > p.resize[0] or p.crop[1] > p.resize[1]))
        # a library's crop_pct above 1 (timm's VOLO at 448: 1.15) asks for the crop larger than the resize: its own
        # transform pads the image with black, and so does this one (data.crop_pct of a job is at most 1)
        if too_big and not (p.crop_pct is not None and p.crop_pct > 1):
            raise SpecError(
                f"data.crop {list(p.crop)} is larger than data.resize {p.resize!r} (after resizing): the crop would be "
                "padded with black. Set crop <= resize"
            )
    if getattr(data, "decode_device", "cpu") == "cuda" and p.interpolation not in ("bilinear", "bicubic", "nearest"):
        raise SpecError(f"data.decode_device: cuda resizes with bilinear, bicubic or nearest, not {p.interpolation} "
                        "(from " + p.source + "); set data.interpolation or data.decode_device: cpu")


def from_dict(d: dict[str, Any]) -> Preprocess:
    """A stored record back (the store's ``preprocess`` attribute)."""
    return Preprocess(
        resize=d["resize"] if d["resize"] is None or isinstance(d["resize"], int) else _pair(d["resize"]),
        crop=None if d["crop"] is None else _pair(d["crop"]),
        interpolation=d["interpolation"],
        mean=tuple(d["mean"]),
        std=tuple(d["std"]),
        crop_pct=d.get("crop_pct"),
        crop_offset=d.get("crop_offset", "round"),
        source=d.get("source", ""),
        runs=d.get("runs", "extractor"),
        check=d.get("check"),
    )


def of_store(attrs: dict[str, Any]) -> Preprocess:
    """What a store's rows went through: its ``preprocess`` record, or (stores made before it
    existed) the explicit ``data`` settings of its spec."""
    if attrs.get("preprocess"):
        return from_dict(attrs["preprocess"])
    data = attrs.get("spec", {}).get("data", {})
    crop = data.get("crop", 224)
    return replace(IMAGENET, resize=data.get("resize", 256), crop=_pair(crop),
                   interpolation=data.get("interpolation", "bilinear"),
                   mean=tuple(data.get("mean", IMAGENET.mean)), std=tuple(data.get("std", IMAGENET.std)),
                   source="the job spec")
