"""Decoding images into uint8 tensors at the model's input size: Pillow on the CPU
(:class:`ImageDecoder`), or nvJPEG on the GPU for batches of JPEGs (:class:`JpegDecoder`)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from ..faults import describe_error, device_errors
from ..spec import DataSpec
from .files import Locator
from .preprocess import IMAGENET, Preprocess
from .preprocess import resolve as resolve_preprocess
from .sources import read_bytes, read_printed

# A process-wide setting, made once here: Pillow's own pixel limit is off, data.max_image_pixels (checked
# by _open_checked before decoding) replaces it.
Image.MAX_IMAGE_PIXELS = None

__all__ = ["EncodedJpeg", "ImageDecoder", "ImageTooLarge", "JpegDecoder", "open_rgb", "rgb_from_bytes"]


class ImageDecoder:
    """Reads one image file into a uint8 ``(3, h, w)`` tensor: RGB, resized, cropped (``preprocess``;
    by default the job's ``data`` settings over ImageNet's); or, through ``transform`` (the library's own
    processor), into the float ``(3, h, w)`` pixels the model takes.

    Grayscale, palette, RGBA, CMYK and 16-bit images become 8-bit RGB; EXIF orientation
    is applied. Normalisation happens later, on the model's device.
    """

    def __init__(self, data: DataSpec, preprocess: Preprocess | None = None, transform: Any = None) -> None:
        self.preprocess = preprocess if preprocess is not None else resolve_preprocess(data, IMAGENET)
        # what makes a decoded image the model's input: extractor's (the record itself: uint8 levels) or the
        # library's processor (extractor.model.processors.LibraryTransform: float pixels); ``apply(img)``
        self.transform = transform if transform is not None else self.preprocess
        self.storage_options = data.storage_options
        self.outside_root = data.outside_root
        self.max_pixels = data.max_image_pixels
        self.draft = self.preprocess if data.jpeg_draft else None

    def __call__(self, item: Locator):  # -> torch.Tensor (3, h, w) uint8
        return self.from_bytes(self.read(item))

    def read(self, item: Locator) -> bytes:
        """The bytes of an image (a file, a URL, a tar member)."""
        return read_bytes(item, self.storage_options, self.outside_root)

    def read_printed(self, item: Locator) -> tuple[bytes, int]:
        """:meth:`read`, with the fingerprint of the file it opened (:func:`~extractor.data.sources.read_printed`)."""
        return read_printed(item, self.storage_options, self.outside_root)

    def from_bytes(self, data: bytes):  # -> torch.Tensor (3, h, w) uint8
        return self.transform.apply(rgb_from_bytes(data, self.max_pixels, self.draft))


class ImageTooLarge(ValueError):
    """An image over data.max_image_pixels (a possible decompression bomb)."""


def open_rgb(item: Locator, storage_options: dict | None = None, max_pixels: int | None = None):
    """Open an image as 8-bit RGB (the first frame of an animation) with its EXIF orientation applied."""
    return rgb_from_bytes(read_bytes(item, storage_options), max_pixels)


def _open_checked(data: bytes, max_pixels: int | None):
    """Pillow's lazy open (the header only), refusing images over ``max_pixels``."""
    if not data:
        raise ValueError("empty file (0 bytes)")
    try:
        img = Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        raise ValueError(f"not an image format Pillow reads ({len(data):,} bytes)") from None  # never its content
    w, h = img.size
    if max_pixels is not None and w * h > max_pixels:
        raise ImageTooLarge(
            f"image is {w}x{h} = {w * h:,} pixels, over data.max_image_pixels ({max_pixels:,}); "
            "raise data.max_image_pixels if the image is trusted"
        )
    return img


def rgb_from_bytes(data: bytes, max_pixels: int | None = None, draft: Preprocess | None = None):
    """Decode an encoded image as 8-bit RGB (see :func:`open_rgb`); a JPEG at a reduced scale that
    ``draft``'s resize still allows (``data.jpeg_draft``)."""
    from PIL import ImageOps

    img = _open_checked(data, max_pixels)
    if draft is not None and img.format == "JPEG" and (size := draft.draft_size(*img.size)) is not None:
        img.draft(img.mode, size)
    img.load()
    img = ImageOps.exif_transpose(img) or img
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or arr.max(initial=0) > 255 else 255.0
        arr = np.clip(arr / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
        img = Image.fromarray(arr, mode="L")
    if img.mode != "RGB":
        img = img.convert("RGB")
    return img


# EXIF orientation -> (transpose H and W first, then flip y, flip x) applied to a (C, H, W) tensor
_ORIENT = {2: (False, False, True), 3: (False, True, True), 4: (False, True, False),
           5: (True, False, False), 6: (True, False, True), 7: (True, True, True), 8: (True, True, False)}


def _oriented(imgs: Any, orientation: int) -> Any:
    """(..., 3, H, W) images turned as their EXIF ``orientation`` says (1: as stored)."""
    if orientation not in _ORIENT:
        return imgs
    transpose, flip_y, flip_x = _ORIENT[orientation]
    if transpose:
        imgs = imgs.transpose(-2, -1)
    dims = [d for d, f in ((-2, flip_y), (-1, flip_x)) if f]
    return imgs.flip(dims) if dims else imgs


GPU_RESIZE_PIXELS = 1 << 26  # pixels resized in one stack on the device (768 MB as float32 RGB)


def _padded_runs(images: list[tuple[int, Any]]) -> list[list[tuple[int, Any]]]:
    """``images`` cut into runs resized at once: each run padded to its largest height and width holds at most
    GPU_RESIZE_PIXELS pixels (a batch of 256 ImageNet-sized images is one run)."""
    runs: list[list[tuple[int, Any]]] = []
    h = w = 0
    for item in images:
        ih, iw = int(item[1].shape[-2]), int(item[1].shape[-1])
        if runs and (len(runs[-1]) + 1) * max(h, ih) * max(w, iw) <= GPU_RESIZE_PIXELS:
            runs[-1].append(item)
            h, w = max(h, ih), max(w, iw)
        else:
            runs.append([item])
            h, w = ih, iw
    return runs


@dataclass
class EncodedJpeg:
    """A JPEG file's bytes read on a decode thread, to be decoded with its batch on the device."""

    data: bytes
    orientation: int  # EXIF orientation tag (1: as stored)


class JpegDecoder:
    """Batch JPEG decoding with ``torchvision.io.decode_jpeg`` on ``device`` (nvJPEG on CUDA),
    then resize and centre crop there: the same geometry as :class:`ImageDecoder`.

    ``read`` runs on the decode threads: it reads the file and checks its header (size limit,
    colour mode, EXIF orientation). Files that are not 8-bit RGB or grayscale JPEGs (PNG,
    CMYK JPEG...) are decoded there by Pillow instead. ``collate`` decodes a batch's JPEGs in
    one call; a file the device decoder rejects is decoded by Pillow, and fails its row only
    if Pillow rejects it too.
    """

    def __init__(self, data: DataSpec, device, preprocess: Preprocess | None = None) -> None:
        self.cpu = ImageDecoder(data, preprocess)
        self.device = device
        self.storage_options = data.storage_options
        self.stream: Any = None  # torch.cuda.Stream of the batches decoded on CUDA (made at the first)

    def read(self, item: Locator):  # -> EncodedJpeg | torch.Tensor (3, crop, crop) uint8
        return self.prepare(self.cpu.read(item))

    def prepare(self, data: bytes):  # -> EncodedJpeg | torch.Tensor (3, crop, crop) uint8
        """On a decode thread: a JPEG's bytes, checked, for the device; other files decoded by Pillow here."""
        if data[:3] == b"\xff\xd8\xff":
            img = _open_checked(data, self.cpu.max_pixels)
            if img.format == "JPEG" and img.mode in ("RGB", "L"):
                try:
                    orientation = int(img.getexif().get(0x0112, 1))
                except Exception:  # noqa: BLE001 - an unreadable EXIF block: take the pixels as stored
                    orientation = 1
                return EncodedJpeg(data, orientation)
        return self.cpu.from_bytes(data)

    def _decode(self, items: list[EncodedJpeg]) -> list[Any]:
        """Device tensors (3, H, W) uint8, or the error for files the device decoder rejects."""
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg

        raw = [torch.frombuffer(bytearray(e.data), dtype=torch.uint8) for e in items]
        if self.device.type == "cuda":
            # nvJPEG's hardware decoder writes its outputs on a stream of its own, without waiting for the work
            # queued on the current one, into blocks the caching allocator recycled from tensors that queued kernels
            # still read: activations came out NaN on an H200 (pytorch/vision#9606). The current stream here is
            # the decoder's own (collate): only the previous batch's decode and resize are waited for, never the
            # forward pass, whose blocks the decode stream cannot recycle (record_stream in collate).
            torch.cuda.current_stream(self.device).synchronize()
        try:
            return list(decode_jpeg(raw, mode=ImageReadMode.RGB, device=self.device))
        except device_errors():
            raise  # a CUDA fault is the device's, never a file's
        except RuntimeError:
            out: list[Any] = []
            for r in raw:  # find the files it rejects
                try:
                    out.append(decode_jpeg(r, mode=ImageReadMode.RGB, device=self.device))
                except device_errors():
                    raise
                except RuntimeError as err:
                    out.append(err)
            return out

    def _geometry(self, imgs, orientation: int):
        """Orientation, resize and centre crop of (N, 3, H, W) images, on the device."""
        return self.cpu.preprocess.geometry(_oriented(imgs, orientation))

    def collate(self, items: list[Any]):  # -> (torch.Tensor (B, 3, crop, crop) on device, {position: error})
        """A batch on the device (see :meth:`_collate`). On CUDA it is made on a stream of the decoder's own, while
        the forward pass of the batch before runs on the current one: the current stream waits for it (an event,
        not the host) before the next forward, and the batch's memory is marked as the current stream's
        (``record_stream``: not recycled by the decode stream before that forward is done)."""
        if self.device.type != "cuda":
            return self._collate(items)
        import torch

        compute = torch.cuda.current_stream(self.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            images, failed = self._collate(items)
        if images is not None:
            images.record_stream(compute)
        compute.wait_stream(self.stream)  # the forward queued next waits for this batch; the one queued before not
        return images, failed

    def _collate(self, items: list[Any]):  # -> (torch.Tensor (B, 3, crop, crop) on device, {position: error})
        """JPEGs decoded with nvJPEG (what it rejects, by Pillow), turned by their EXIF orientation, then resized and
        cropped there all at once (:func:`~.batch_resize.resize_crop`; where it cannot, in groups of one size and
        orientation); images the threads already decoded copied over."""
        import torch

        out: list[Any] = [None] * len(items)
        failed: dict[int, str] = {}
        encoded = [i for i, x in enumerate(items) if isinstance(x, EncodedJpeg)]
        groups: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}  # same size and orientation: resized together
        for i, img in zip(encoded, self._decode([items[i] for i in encoded]) if encoded else [], strict=True):
            if isinstance(img, torch.Tensor):
                groups.setdefault((*img.shape, items[i].orientation), []).append((i, img))
            else:  # the device decoder rejected it: Pillow decides
                self._on_cpu(i, items[i].data, out, failed)
        if not self._resize_all(groups, out):
            for key, images in groups.items():
                self._resize_group(key, images, out)
        for i, x in enumerate(items):
            if out[i] is None and i not in failed:
                out[i] = x.to(self.device, non_blocking=True)
        kept = [x for x in out if x is not None]
        return (torch.stack(kept) if kept else None), failed

    def _on_cpu(self, i: int, data: bytes, out: list[Any], failed: dict[int, str]) -> None:
        """Item ``i`` decoded by Pillow, then moved to the device; or the error that fails its row."""
        try:
            out[i] = self.cpu.from_bytes(data).to(self.device)
        except device_errors():
            raise
        except Exception as err:  # noqa: BLE001 - fails its row only
            failed[i] = describe_error(err)

    def _resize_all(self, groups: dict[tuple[Any, ...], list[tuple[int, Any]]], out: list[Any]) -> bool:
        """Every decoded image turned by its orientation, then resized and cropped in one batch (False: not done,
        for a filter or crop :func:`~.batch_resize.resize_crop` does not make)."""
        from .batch_resize import resize_crop

        turned = [(i, _oriented(img, key[-1])) for key, images in groups.items() for i, img in images]
        for part in _padded_runs(turned):
            done = resize_crop([img for _, img in part], self.cpu.preprocess)
            if done is None:
                return False
            for (i, _), img in zip(part, done, strict=True):
                out[i] = img
        return True

    def _resize_group(self, key: tuple[Any, ...], images: list[tuple[int, Any]], out: list[Any]) -> None:
        """Decoded images of one size and orientation resized and cropped together, a few at a time when large."""
        import torch

        per = max(1, GPU_RESIZE_PIXELS // (key[1] * key[2]))
        for a in range(0, len(images), per):
            part = images[a : a + per]
            done = self._geometry(torch.stack([img for _, img in part]), key[-1])
            for (i, _), img in zip(part, done, strict=True):
                out[i] = img
