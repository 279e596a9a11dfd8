"""A model's own library's image processor: the probe that shows extractor's transform equal to it, and the
transform stage that runs it as it is.

extractor's own transform (:class:`~extractor.data.Preprocess`: Pillow resize and crop in the decode workers,
normalisation on the device) is fast, but it reproduces a library's processor from a few of its settings. So
a library's values are taken only when the probe has shown them equal: the library's processor and
extractor's transform run on the same fixed probe images (smaller than any input, very wide, tall, grayscale,
larger than the input) and their outputs must agree within :data:`TOLERANCE_LEVELS`. Otherwise (a setting
extractor does not reproduce, outputs that differ, a size that varies per image) the library's values are
not used: the job gives its own ``data.*`` settings, or ``data.preprocess: library`` runs the processor
itself per image (:class:`LibraryTransform`; slower, right by construction). The store records which, and
what the probe measured (``preprocess.check``; ``extractor inspect`` shows it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..data import Preprocess, resolve
from ..errors import SpecError

__all__ = ["TOLERANCE_LEVELS", "LibraryProcessor", "LibraryTransform", "measure", "probe_images", "settle_preprocess"]

# the most two outputs may differ, in 8-bit levels (0..255) of the input: the same 8-bit pixels, normalised in
# another float order (1e-4 levels seen). A resampler that differs (Pillow and torchvision: 0.5 to 2 levels)
# is not equal.
TOLERANCE_LEVELS = 0.01
# the probe images (height, width): smaller than any input, very wide, tall, grayscale, larger than the input
PROBE_SIZES = ((13, 19), (24, 301), (181, 97), (64, 80), (333, 250))
GRAY = 3  # the index of the grayscale one
LIBRARY_WAY = "data.preprocess: library runs that processor as it is, per image on the CPU"

Run = Callable[[Any], torch.Tensor]  # one 8-bit RGB Pillow image -> float32 (3, h, w), as the model takes it


@dataclass(frozen=True)
class LibraryProcessor:
    """A model's own library's processor, for the probe and for ``data.preprocess: library``."""

    name: str
    """What it is, for messages and the store: ``MobileViTImageProcessor of hf:FOLDER``."""
    run: Run
    """The processor as its library gives it (``AutoImageProcessor``'s class; timm's ``create_transform``...)."""
    references: tuple[tuple[str, Run], ...] = ()
    """What extractor's transform is compared with, first that is equal wins (transformers' Pillow backend of
    the processor, then the processor itself); empty: ``run`` alone."""
    unknown: tuple[str, ...] = ()
    """Its settings outside the allow-list of what extractor reproduces (``do_flip_channel_order=True``)."""

    def candidates(self) -> tuple[tuple[str, Run], ...]:
        return self.references or ((self.name, self.run),)


def probe_images() -> list[Any]:
    """The fixed probe images (8-bit RGB Pillow images, the same on every call): smooth colour gradients with
    seeded noise, every channel different (a channel flip shows), one grayscale (all channels equal)."""
    from PIL import Image

    rng = np.random.default_rng(38)
    out = []
    for i, (h, w) in enumerate(PROBE_SIZES):
        y, x = np.mgrid[0:h, 0:w].astype(np.float64)
        y, x = y / max(h - 1, 1), x / max(w - 1, 1)
        base = np.stack([np.sin(5 * x + i) * 90, np.cos(4 * y) * 70 - 30, (x - y) * 100], -1) + 128
        arr = np.clip(base + rng.normal(0, 10, (h, w, 3)), 0, 255).astype(np.uint8)
        img = Image.fromarray(arr)
        out.append(img.convert("L").convert("RGB") if i == GRAY else img)
    return out


def _ours(preprocess: Preprocess, img: Any) -> torch.Tensor:
    """extractor's transform of one image, normalised as the worker does on the device: float32 (3, h, w)."""
    mean = torch.tensor(preprocess.mean).view(3, 1, 1)
    std = torch.tensor(preprocess.std).view(3, 1, 1)
    return (preprocess.apply(img).float() / 255.0 - mean) / std


def _theirs(run: Run, img: Any) -> torch.Tensor:
    return torch.as_tensor(run(img)).float()


def measure(preprocess: Preprocess, run: Run, images: list[Any]) -> dict[str, Any]:
    """How far extractor's transform is from ``run`` on ``images``: the largest difference in normalised units
    and in 8-bit levels of the input (normalised difference x std x 255); ``shapes`` when they differ."""
    ours = [_ours(preprocess, img) for img in images]
    theirs = [_theirs(run, img) for img in images]
    if any(a.shape != b.shape for a, b in zip(ours, theirs, strict=True)):
        return {"shapes": [f"{_shape(a)} vs {_shape(b)}" for a, b in zip(ours, theirs, strict=True)],
                "max_abs_levels": None, "max_abs_normalised": None}
    std = torch.tensor(preprocess.std).view(3, 1, 1)
    normalised = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))
    levels = max(float(((a - b).abs() * std * 255).max()) for a, b in zip(ours, theirs, strict=True))
    return {"max_abs_levels": round(levels, 6), "max_abs_normalised": round(normalised, 8)}


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(s) for s in t.shape)


def _sizes(processor: LibraryProcessor, images: list[Any]) -> list[tuple[int, ...]]:
    """The shape of the processor's output for each probe image."""
    return [tuple(_theirs(processor.run, img).shape) for img in images]


def _pixel_sizes(processor: LibraryProcessor, images: list[Any]) -> list[tuple[int, ...]] | str:
    """The (3, h, w) the processor gives each image, or why it gives no pixels (it fails, or gives patches)."""
    try:
        sizes = _sizes(processor, images)
    except Exception as err:  # noqa: BLE001 - a processor that needs more than an image (text, annotations...)
        return (f"the image processor {processor.name} failed on a probe image ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200] if str(err) else ''}): extractor cannot run it per image")
    if any(len(s) != 3 or s[0] != 3 for s in sizes):
        return (f"the image processor {processor.name} gives each image as {sizes[0]}, not (3, H, W) pixels: "
                "extractor cannot feed it")
    return sizes


def _varies(processor: LibraryProcessor, sizes: list[tuple[int, ...]]) -> str:
    """Why a processor that gives each probe image its own size (``sizes``) is not run."""
    shown = ", ".join(f"{h}x{w}" for h, w in (PROBE_SIZES[i] for i in range(len(sizes))))
    got = ", ".join(f"{s[1]}x{s[2]}" for s in sizes)
    return (f"the image processor {processor.name} resizes each image to its own size (variable resolution: "
            f"probe images {shown} became {got}): extractor stores one shape per capture and does not support "
            "variable-resolution processors; set data.resize: [H, W] (a squash) and data.crop: null to run the "
            "model at one size")


def _one_size(processor: LibraryProcessor, images: list[Any]) -> tuple[int, int] | str:
    """The (h, w) the processor gives every image, or why there is none (a size per image, not an image)."""
    sizes = _pixel_sizes(processor, images)
    if isinstance(sizes, str):
        return sizes
    if len(set(sizes)) > 1:
        return _varies(processor, sizes)
    return sizes[0][1], sizes[0][2]


def check(preprocess: Preprocess, processor: LibraryProcessor) -> Preprocess | str:
    """``preprocess`` (extractor's reproduction of ``processor``) with the probe's record, when the probe shows it
    equal within :data:`TOLERANCE_LEVELS`; else why not, with the way out."""
    images = probe_images()
    size = _one_size(processor, images)
    if isinstance(size, str):  # variable resolution: no data.preprocess: library either
        return size
    if processor.unknown:
        return (f"the image processor {processor.name} sets {', '.join(processor.unknown)}, which extractor does not "
                f"reproduce ({LIBRARY_WAY})")
    measured = {name: measure(preprocess, run, images) for name, run in processor.candidates()}
    equal = next((name for name, m in measured.items()
                  if m["max_abs_levels"] is not None and m["max_abs_levels"] <= TOLERANCE_LEVELS), None)
    record = {"against": equal, "probe_images": [f"{h}x{w}" for h, w in PROBE_SIZES],
              "tolerance_levels": TOLERANCE_LEVELS, "measured": measured}
    if equal is None:
        name, m = next(iter(measured.items()))
        found = f"outputs of {m['shapes'][0]}" if "shapes" in m else f"up to {m['max_abs_levels']:.3g} levels"
        return (f"extractor's resize and crop from the settings of the image processor {processor.name} differ from "
                f"{name} by {found} on the probe images (tolerance {TOLERANCE_LEVELS}) ({LIBRARY_WAY})")
    return replace(preprocess, check=record)


def _way_out(why: str, processor: LibraryProcessor) -> str:
    """Why extractor has no values of the library's (``why``: settings it does not reproduce), and ``data.preprocess:
    library`` when the processor gives images of one size. One that gives each image its own size: that is the
    cause, said in its place (not the settings, a ``SizeDict`` of them); one that gives no pixels: ``why``."""
    sizes = _pixel_sizes(processor, probe_images())
    if isinstance(sizes, str):
        return why
    if len(set(sizes)) > 1:
        return _varies(processor, sizes)
    return f"{why} ({LIBRARY_WAY})"


class LibraryTransform:
    """The transform stage of ``data.preprocess: library``: each decoded RGB image through the model's own
    processor, on a decode thread; float32 ``(3, h, w)`` as the model takes it (the worker normalises only
    8-bit images). ``preprocess`` is the store's record of it."""

    def __init__(self, processor: LibraryProcessor, preprocess: Preprocess) -> None:
        self.processor = processor
        self.preprocess = preprocess

    def apply(self, img: Any) -> torch.Tensor:
        x = _theirs(self.processor.run, img).contiguous()
        if tuple(x.shape) != (3, *self.preprocess.size):
            raise ValueError(f"the image processor {self.processor.name} gave this image as {_shape(x)}, not "
                             f"3x{self.preprocess.size[0]}x{self.preprocess.size[1]} as the probe images")
        return x


def _library(processor: LibraryProcessor | None, why: str) -> tuple[Preprocess, LibraryTransform]:
    """``data.preprocess: library``: the processor as it is, at the one size it gives (else refused)."""
    if processor is None:
        raise SpecError(f"data.preprocess: library runs the model's own processor, but {why}; set data.preprocess: "
                        "auto and the data.* settings")
    images = probe_images()
    size = _one_size(processor, images)
    if isinstance(size, str):
        raise SpecError(size.replace("set data.resize", "set data.preprocess: auto, data.resize"))
    record = Preprocess(resize=size, crop=None, interpolation="bilinear", mean=(0.0, 0.0, 0.0),
                        std=(1.0, 1.0, 1.0), runs="library",
                        source=f"{processor.name}, run per image on the CPU (data.preprocess: library)",
                        check={"runs": "library", "processor": processor.name, "size": list(size),
                               "unknown": list(processor.unknown)})
    return record, LibraryTransform(processor, record)


def settle_preprocess(data: Any, defaults: Preprocess | str,
                      processor: LibraryProcessor | None) -> tuple[Preprocess, Any]:
    """The job's preprocessing record and its transform stage (what makes each decoded image the model's input):
    the library's own processor (``data.preprocess: library``), or extractor's transform with the library's
    values where the probe shows them equal to its processor, else with the job's own (``resolve``)."""
    if data.preprocess == "library":
        why = defaults if isinstance(defaults, str) else f"the model's library brings none ({defaults.source})"
        return _library(processor, why)
    leaves_some = any(getattr(data, f) == "auto" for f in ("resize", "crop", "interpolation", "mean", "std"))
    if processor is not None and data.preprocess == "auto" and leaves_some:
        defaults = check(defaults, processor) if not isinstance(defaults, str) else _way_out(defaults, processor)
    p = resolve(data, defaults)
    return p, p
