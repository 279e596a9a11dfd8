"""A batch of images of many sizes resized and centre-cropped at once, on their device (the nvJPEG path).

Resizing image by image, or group by group of one size, cost about 51 us of host dispatch a call: 6-9 ms a batch
of 256 of an ImageNet size mix (issue 55). Here the images are laid into one zero-padded float batch, and each output
pixel is a weighted sum of its image's pixels: per image, a matrix of weights for the rows and one for the columns
(Pillow's antialiased filters, as torchvision's ``resize(antialias=True)`` computes them, whose resize the crop's
window is taken of), made for the whole batch at once; two batched matrix products then resize every image, cropped.
The values are torchvision's per-image resize (float, no rounding between the passes) up to float rounding
(``tests/data/test_decode.py``).

Bilinear and bicubic only, and crops that lie inside the resized image: anything else (another filter, a crop that
pads, no crop) returns None and the caller resizes image by image. Needs torch; imported by the decoder only.
"""

from __future__ import annotations

from typing import Any, cast

from .preprocess import Preprocess

__all__ = ["resize_crop"]

_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}  # the filters' half-widths (Pillow's)
_CUBIC = -0.5  # Pillow's bicubic "a"


def _filter(x: Any, interpolation: str) -> Any:
    """Pillow's filter of ``interpolation`` at distances ``x`` (a tensor)."""
    x = x.abs()
    if interpolation == "bilinear":
        return (1 - x).clamp_(min=0)
    a = _CUBIC
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return near * (x < 1) + far * ((x >= 1) & (x < 2))


def _window(pre: Preprocess, h: int, w: int) -> tuple[int, int, int, int] | None:
    """Image (h, w)'s resized size and its crop's top-left offset, as :meth:`Preprocess.geometry` makes them (None:
    its crop pads, or there is none)."""
    if pre.crop is None:
        return None
    if isinstance(pre.resize, int):  # the shorter side, the longer one in proportion (rounded down)
        short, long = min(h, w), max(h, w)
        new_long = int(pre.resize * long / short)
        rh, rw = (new_long, pre.resize) if w <= h else (pre.resize, new_long)
    elif pre.resize is None:
        rh, rw = h, w
    else:
        rh, rw = pre.resize
    ch, cw = pre.crop
    if rh < ch or rw < cw:
        return None
    if pre.crop_offset == "floor":
        return rh, rw, (rh - ch) // 2, (rw - cw) // 2
    return rh, rw, int(round((rh - ch) / 2.0)), int(round((rw - cw) / 2.0))


def _weights(size: Any, resized: Any, offset: Any, out: int, taps: int, interpolation: str) -> Any:
    """(n, out, taps) float32: for each image (its input ``size``, ``resized`` size and crop ``offset`` along one
    axis, (n, 1, 1) tensors), the weights of its input pixels in each output pixel."""
    import torch

    scale = size / resized  # input pixels per output pixel
    stretch = scale.clamp(min=1.0)  # a downscale widens the filter (antialias)
    o = torch.arange(out, device=size.device, dtype=torch.float32).view(1, -1, 1)
    j = torch.arange(taps, device=size.device, dtype=torch.float32).view(1, 1, -1)
    centre = (o + offset + 0.5) * scale
    w = _filter((j + 0.5 - centre) / stretch, interpolation) * (j < size)
    return w / w.sum(dim=2, keepdim=True)


def resize_crop(images: list[Any], pre: Preprocess) -> Any:
    """``images`` ((3, h, w) uint8 tensors on one device) resized and centre-cropped as ``pre`` says, as one
    (n, 3, crop_h, crop_w) uint8 tensor; None where this cannot (see the module)."""
    import torch

    windows = [_window(pre, int(x.shape[-2]), int(x.shape[-1])) for x in images]
    if pre.interpolation not in _SUPPORT or not images or any(w is None for w in windows):
        return None
    device = images[0].device
    taps_h, taps_w = max(int(x.shape[-2]) for x in images), max(int(x.shape[-1]) for x in images)
    padded = torch.zeros((len(images), 3, taps_h, taps_w), dtype=torch.float32, device=device)
    for i, x in enumerate(images):
        padded[i, :, : x.shape[-2], : x.shape[-1]] = x
    # per image: input h, w; resized rh, rw; crop top, left
    known = cast(list[tuple[int, int, int, int]], windows)  # none is None (checked above)
    facts = torch.tensor([[x.shape[-2], x.shape[-1], *win] for x, win in zip(images, known, strict=True)],
                         dtype=torch.float32).to(device, non_blocking=True).view(len(images), 6, 1, 1)
    h, w, rh, rw, top, left = facts.unbind(1)
    ch, cw = pre.crop  # type: ignore[misc]  # checked by _window
    rows = _weights(h, rh, top, ch, taps_h, pre.interpolation)  # (n, ch, taps_h)
    cols = _weights(w, rw, left, cw, taps_w, pre.interpolation)  # (n, cw, taps_w)
    out = rows.unsqueeze(1) @ padded @ cols.transpose(1, 2).unsqueeze(1)  # (n, 3, ch, cw)
    return out.round_().clamp_(0, 255).to(torch.uint8)  # rounded back to 8 bits, as Pillow does
