"""Image sources: listing rows, planning shards, reading and decoding images.

Row order is deterministic: a folder is walked in sorted order, a manifest is read in file
order, so the same spec always gives the same row for the same image.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import logging
import os
import re
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError
from .preprocess import IMAGENET, Preprocess
from .preprocess import resolve as resolve_preprocess
from .spec import DataSpec

__all__ = ["Rows", "Shard", "plan", "list_rows", "ImageDecoder", "Batch", "BatchStream", "iter_batches"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rows:
    """The data set as the store records it: one entry per row, in row order."""

    ids: list[str]
    paths: list[str]
    labels: list[int]
    classes: list[str] = field(default_factory=list)
    offsets: list[int] | None = None  # tar sources: where each image's bytes start in its tar
    sizes: list[int] | None = None  # and how many there are

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Shard:
    """A contiguous range of rows ``[start, stop)``: the unit of work, retry and resume."""

    index: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def plan(n_rows: int, shard_size: int) -> list[Shard]:
    """Split ``n_rows`` rows into shards of ``shard_size`` rows (the last may be shorter)."""
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    return [
        Shard(i, start, min(start + shard_size, n_rows))
        for i, start in enumerate(range(0, n_rows, shard_size))
    ]


# --------------------------------------------------------------------------- listing


def is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def absolute(path: str) -> str:
    """A local path made absolute (against the current directory), so that workers running
    elsewhere and later readers find the file; URLs (``s3://``, ``file://``...) unchanged."""
    return path if "://" in path else os.path.abspath(path)


def list_rows(data: DataSpec) -> Rows:
    """List the images of a data spec, or raise :class:`DataError` before any work starts."""
    so = data.storage_options
    if data.source == "folder":
        assert data.root is not None  # the spec validator guarantees it
        rows = _list_remote_folder(data.root, data.extensions, so) if is_url(data.root) else \
            _list_folder(Path(data.root), data.extensions)
        where = data.root
    elif data.source == "manifest":
        assert data.manifest is not None
        rows = _list_manifest(data.manifest, data.root, so)
        where = data.manifest
    else:
        from .tarsource import list_tars

        rows = list_tars(data.tars, data.extensions, so)
        where = str(data.tars)
    if not len(rows):
        raise DataError(
            f"no images found in {where} (looked for files ending in {', '.join(data.extensions)}); "
            "check data.root / data.manifest / data.tars"
        )
    return rows


def _remote_error(what: str, url: str, err: BaseException) -> DataError:
    name = type(err).__name__
    hint = ""
    text = str(err).lower()
    if "credential" in text or "access denied" in text or "forbidden" in text or "signature" in text:
        hint = "; check the credentials in data.storage_options"
    elif "bucket" in text or isinstance(err, FileNotFoundError):
        hint = "; check the bucket and path"
    elif "connect" in text or "endpoint" in text:
        hint = "; check data.storage_options.endpoint_url and the network"
    return DataError(f"cannot read {what} {url}: {name}: {err}{hint}")


def _list_remote_folder(root: str, extensions: Sequence[str], so: dict) -> Rows:
    import fsspec

    exts = tuple(e.lower() for e in extensions)
    try:
        fs, base = fsspec.core.url_to_fs(root, **so)
        found = sorted(p for p in fs.find(base) if p.lower().endswith(exts))
    except Exception as err:  # noqa: BLE001 - every backend raises its own errors
        raise _remote_error("data.root", root, err) from err
    base = base.rstrip("/")
    rel = [p[len(base) + 1:] for p in found]
    rel = [r for r in rel if not any(part.startswith(".") for part in r.split("/"))]  # hidden files and folders
    labels, classes = _folder_labels(rel)
    return Rows(ids=rel, paths=[f"{root.rstrip('/')}/{r}" for r in rel], labels=labels, classes=classes)


def _folder_labels(rel: list[str]) -> tuple[list[int], list[str]]:
    """ImageFolder labels: an image's class is its top-level folder. Images directly in the
    root have no class (-1); when others do, a warning names them."""
    nested = [r for r in rel if "/" in r]
    if not nested:
        return [-1] * len(rel), []
    loose = [r for r in rel if "/" not in r]
    if loose:
        log.warning("%d images lie directly in data.root (first: %s), outside the class folders; they get "
                    "no label (-1). Move them into a class folder, or list them in a manifest",
                    len(loose), display_name(loose[0]))
    classes = sorted({r.split("/", 1)[0] for r in nested})
    index = {c: i for i, c in enumerate(classes)}
    return [index[r.split("/", 1)[0]] if "/" in r else -1 for r in rel], classes


def _list_folder(root: Path, extensions: Sequence[str]) -> Rows:
    if not root.exists():
        raise DataError(f"data.root {root} does not exist; set data.root to a folder of images")
    if not root.is_dir():
        raise DataError(f"data.root {root} is not a folder; for a file list use data.source: manifest")
    exts = tuple(e.lower() for e in extensions)
    rel: list[str] = []
    seen_dirs: set[str] = set()

    def onerror(err: OSError) -> None:
        log.warning("cannot list %s: %s", err.filename, err.strerror)

    for dirpath, dirnames, filenames in os.walk(root, onerror=onerror, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen_dirs:  # a symlink loop, or a second link to a folder already walked
            log.warning("skipping %s: it leads back to %s, already listed", dirpath, real)
            dirnames[:] = []
            continue
        seen_dirs.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .ipynb_checkpoints, .git: not classes
        base = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            if name.lower().endswith(exts) and not name.startswith("."):
                rel.append((base / name).as_posix())
    labels, classes = _folder_labels(rel)
    top = absolute(str(root))
    paths = [storable_path(os.path.join(top, r)) for r in rel]
    return Rows(ids=[display_name(r) for r in rel], paths=paths, labels=labels, classes=classes)


def _list_manifest(manifest: str, root: str | None, so: dict) -> Rows:
    suffix = Path(manifest.split("?", 1)[0]).suffix.lower()
    if suffix not in (".csv", ".jsonl", ".ndjson"):
        raise DataError(f"data.manifest {manifest}: expected a .csv or .jsonl file")
    try:
        if is_url(manifest):
            import fsspec

            try:
                with fsspec.open(manifest, "rb", **so) as f:
                    text = f.read().decode("utf-8-sig")  # a spreadsheet's byte-order mark is not a column name
            except UnicodeDecodeError:
                raise
            except Exception as err:  # noqa: BLE001
                raise _remote_error("data.manifest", manifest, err) from err
        else:
            if not Path(manifest).exists():
                raise DataError(f"data.manifest {manifest} does not exist")
            text = Path(manifest).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataError(f"data.manifest {manifest} is not UTF-8 text: {err}") from None
    if suffix == ".csv":
        records: list[Any] = list(csv.DictReader(io.StringIO(text, newline="")))
    else:
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{manifest}:{lineno}: not valid JSON: {err.msg}") from None
    base = root if root is not None else (manifest.rsplit("/", 1)[0] if "/" in manifest else ".")
    ids, paths, raw_labels = [], [], []
    for n, rec in enumerate(records):
        where = f"{manifest} row {n + 1}"
        if not isinstance(rec, dict) or not rec.get("path"):
            raise DataError(f"{where}: missing 'path' (columns: path, optional id and label)")
        p = str(rec["path"])
        full = p if "://" in p or os.path.isabs(p) else f"{base.rstrip('/')}/{p}"
        paths.append(absolute(full))
        ids.append(str(rec["id"]) if rec.get("id") not in (None, "") else p)
        raw_labels.append(rec.get("label"))
    seen: dict[str, int] = {}
    for n, i in enumerate(ids):
        if i in seen:
            raise DataError(
                f"{manifest}: id {i!r} appears in rows {seen[i] + 1} and {n + 1}; ids must be unique"
            )
        seen[i] = n
    labels, classes = labels_of(raw_labels, lambda n: f"{manifest} row {n + 1}")
    return Rows(ids=ids, paths=paths, labels=labels, classes=classes)


_NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")  # no "+": "+1"/"-1" stay two class names, as before


def _label_number(value: object) -> Decimal | None:
    """A label read as a number: a JSON int or float, or text such as ``3``, ``3.0``, ``1e1``
    (what pandas writes for an integer column with gaps); None for a class name."""
    if isinstance(value, bool):  # JSON true/false: names, as before
        return None
    if isinstance(value, int | float):
        return Decimal(value)  # exact; NaN and infinities included, refused by the caller
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return Decimal(value.strip())
    return None


def labels_of(raw: list[object], where: Callable[[int], str] = lambda n: f"row {n + 1}") -> tuple[list[int], list[str]]:
    """Integer labels as given, or class names mapped to sorted indices; -1 where missing.

    Numbers are class indices when every present value is a whole number: ``3``, ``3.0`` and
    JSON ``3.0`` are all label 3. Otherwise every value is a class name (``"3"`` beside
    ``"cat"``); when all of them looked like numbers (``2.5``), with a warning naming
    ``where(row)`` of the first that is not whole.
    """
    present = [(n, v) for n, v in enumerate(raw) if v not in (None, "")]
    if not present:
        return [-1] * len(raw), []
    numbers = {n: d for n, v in present if (d := _label_number(v)) is not None}
    if len(numbers) == len(present):
        odd = [n for n, d in numbers.items()
               if not d.is_finite() or d != d.to_integral_value() or not -(2**63) <= d < 2**63]
        if not odd:
            ints = [-1] * len(raw)
            for n, d in numbers.items():
                ints[n] = int(d)
            return ints, []
        log.warning("%s: label %r is not a whole number, so every label is taken as a class name (class indices "
                    "are whole numbers: 3, or 3.0 as spreadsheets write it)", where(odd[0]), raw[odd[0]])
    classes = sorted({str(v) for _, v in present})
    index = {c: i for i, c in enumerate(classes)}
    return [index[str(v)] if v not in (None, "") else -1 for v in raw], classes


# --------------------------------------------------------------------------- decoding


class ImageDecoder:
    """Reads one image file into a uint8 ``(3, h, w)`` tensor: RGB, resized, cropped (``preprocess``;
    by default the job's ``data`` settings over ImageNet's).

    Grayscale, palette, RGBA, CMYK and 16-bit images become 8-bit RGB; EXIF orientation
    is applied. Normalisation happens later, on the model's device.
    """

    def __init__(self, data: DataSpec, preprocess: Preprocess | None = None) -> None:
        self.preprocess = preprocess if preprocess is not None else resolve_preprocess(data, IMAGENET)
        self.storage_options = data.storage_options
        self.max_pixels = data.max_image_pixels

    def __call__(self, item: Locator):  # -> torch.Tensor (3, h, w) uint8
        return self.from_bytes(read_bytes(item, self.storage_options))

    def from_bytes(self, data: bytes):  # -> torch.Tensor (3, h, w) uint8
        return self.preprocess.apply(rgb_from_bytes(data, self.max_pixels))


Locator = str | tuple[str, int, int]  # a path or URL, or (tar URL#member, byte offset, byte size)


FS_BYTES = "fsbytes:"  # prefix of a stored path whose file name is not valid UTF-8 (hex of the raw bytes)


def storable_path(path: str) -> str:
    """A path the store can hold (UTF-8): names with undecodable bytes are hex-encoded, reversibly."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return FS_BYTES + os.fsencode(path).hex()


def display_name(path: str) -> str:
    """A readable UTF-8 form of a file name (undecodable bytes shown as \\xNN)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _local_path(path: str) -> str | bytes:
    if path.startswith(FS_BYTES):
        return bytes.fromhex(path[len(FS_BYTES):])
    return path.removeprefix("file://")


def read_bytes(item: Locator, storage_options: dict | None = None) -> bytes:
    """The bytes of one image: a file, a URL, or a member's byte range inside a tar."""
    if isinstance(item, tuple):
        from .tarsource import tar_url_of

        path, offset, size = item
        url = tar_url_of(path, storage_options or {})
        if is_url(url):
            import fsspec

            fs, p = fsspec.core.url_to_fs(url, **(storage_options or {}))
            return fs.cat_file(p, start=offset, end=offset + size)
        with open(url.removeprefix("file://"), "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise OSError(f"{url} ends before the member's {size} bytes at offset {offset}: truncated tar")
        return data
    if is_url(item):
        import fsspec

        with fsspec.open(item, "rb", **(storage_options or {})) as f:
            return f.read()
    with open(_local_path(item), "rb") as f:
        return f.read()


class ImageTooLarge(ValueError):
    """An image over data.max_image_pixels (a possible decompression bomb)."""


def open_rgb(item: Locator, storage_options: dict | None = None, max_pixels: int | None = None):
    """Open an image as 8-bit RGB (the first frame of an animation) with its EXIF orientation applied."""
    return rgb_from_bytes(read_bytes(item, storage_options), max_pixels)


def _open_checked(data: bytes, max_pixels: int | None):
    """Pillow's lazy open (the header only), refusing images over ``max_pixels``."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None  # the limit below replaces Pillow's global one
    if not data:
        raise ValueError("empty file (0 bytes)")
    try:
        img = Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        raise ValueError(f"not an image format Pillow reads ({len(data):,} bytes, starting {data[:8]!r})") from None
    w, h = img.size
    if max_pixels is not None and w * h > max_pixels:
        raise ImageTooLarge(
            f"image is {w}x{h} = {w * h:,} pixels, over data.max_image_pixels ({max_pixels:,}); "
            "raise data.max_image_pixels if the image is trusted"
        )
    return img


def rgb_from_bytes(data: bytes, max_pixels: int | None = None):
    """Decode an encoded image as 8-bit RGB (see :func:`open_rgb`)."""
    from PIL import Image, ImageOps

    img = _open_checked(data, max_pixels)
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


def describe_error(err: BaseException) -> str:
    """A short, readable one-line error for a failed row (no closing period: callers go on after it)."""
    msg = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else ""
    name = type(err).__name__
    return f"{name}: {msg}"[:300] if msg else name


# EXIF orientation -> (transpose H and W first, then flip y, flip x) applied to a (C, H, W) tensor
_ORIENT = {2: (False, False, True), 3: (False, True, True), 4: (False, True, False),
           5: (True, False, False), 6: (True, False, True), 7: (True, True, True), 8: (True, True, False)}


@functools.cache
def device_errors() -> tuple[type[BaseException], ...]:
    """What a CUDA fault raises (``torch.AcceleratorError``, torch >= 2.8): the device context may
    be broken, so it is never taken for a bad image nor retried in the same process."""
    import torch

    error = getattr(torch, "AcceleratorError", None)
    return (error,) if error is not None else ()


GPU_RESIZE_PIXELS = 1 << 26  # pixels resized in one stack on the device (768 MB as float32 RGB)


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

    def read(self, item: Locator):  # -> EncodedJpeg | torch.Tensor (3, crop, crop) uint8
        data = read_bytes(item, self.storage_options)
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
            # nvJPEG's hardware decoder writes its outputs without waiting for the work queued on
            # the stream, into blocks the caching allocator recycled from tensors that queued
            # kernels still read: activations came out NaN on an H200 (pytorch/vision#9606).
            # Drain the stream first; the forward pass already queued is what we wait for.
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
        if orientation in _ORIENT:
            transpose, flip_y, flip_x = _ORIENT[orientation]
            if transpose:
                imgs = imgs.transpose(-2, -1)
            dims = [d for d, f in ((-2, flip_y), (-1, flip_x)) if f]
            if dims:
                imgs = imgs.flip(dims)
        return self.cpu.preprocess.geometry(imgs)

    def collate(self, items: list[Any]):  # -> (torch.Tensor (B, 3, crop, crop) on device, {position: error})
        import torch

        out: list[Any] = [None] * len(items)
        failed: dict[int, str] = {}
        encoded = [i for i, x in enumerate(items) if isinstance(x, EncodedJpeg)]
        groups: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}  # same size and orientation: resized together
        for i, img in zip(encoded, self._decode([items[i] for i in encoded]) if encoded else [], strict=True):
            if isinstance(img, torch.Tensor):
                groups.setdefault((*img.shape, items[i].orientation), []).append((i, img))
                continue
            try:  # the device decoder rejected it: Pillow decides
                out[i] = self.cpu.from_bytes(items[i].data).to(self.device)
            except device_errors():
                raise
            except Exception as err:  # noqa: BLE001 - fails its row only
                failed[i] = describe_error(err)
        for key, members in groups.items():
            per = max(1, GPU_RESIZE_PIXELS // (key[1] * key[2]))  # large photos are resized a few at a time
            for a in range(0, len(members), per):
                part = members[a : a + per]
                done = self._geometry(torch.stack([img for _, img in part]), key[-1])
                for (i, _), img in zip(part, done, strict=True):
                    out[i] = img
        for i, x in enumerate(items):
            if out[i] is None and i not in failed:
                out[i] = x.to(self.device, non_blocking=True)
        kept = [x for x in out if x is not None]
        return (torch.stack(kept) if kept else None), failed


@dataclass
class Batch:
    """Decoded images of one batch; ``offsets`` are row offsets within the shard."""

    offsets: list[int]  # rows that decoded, in order
    images: object  # torch.Tensor (B, 3, H, W) uint8, or None when no image decoded
    failed: dict[int, str]  # row offset -> error text


class BatchStream:
    """Decoded batches of one shard's rows after another's.

    ``add(paths)`` queues a shard; ``next()`` returns the current shard's next batch, or
    None at its end (the call after that reads the following shard). A batch never spans
    two shards. Decoding runs ``prefetch_batches`` batches ahead on ``pool`` (inline when
    None), across shard boundaries: the next shard's first images decode while this shard's
    last batches compute. ``collate(items)`` turns a batch's decoded items into
    ``(images, {position: error})``; by default the items are uint8 tensors, stacked.
    """

    def __init__(self, batch_size: int, decode, pool: ThreadPoolExecutor | None, prefetch_batches: int = 2,
                 collate=None) -> None:
        self.batch_size, self.decode, self.pool, self.collate = batch_size, decode, pool, collate
        self.window = batch_size * (prefetch_batches + 1)  # rows decoding or decoded, not yet returned
        self.shards: deque[Sequence[Locator]] = deque()  # queued shards; [0] is being read
        self.pending: deque[Future] = deque()  # decodes in flight, in row order across shards
        self.sub_shard = self.sub_row = 0  # the next row to submit: shards[sub_shard][sub_row]
        self.row = 0  # the next row of shards[0] to return

    def add(self, paths: Sequence[Locator]) -> None:
        self.shards.append(paths)
        self._fill()

    def _safe(self, path: Locator):
        try:
            return self.decode(path), None
        except Exception as err:  # noqa: BLE001 - any decode failure fails its row only
            return None, describe_error(err)

    def _fill(self) -> None:
        while self.pool is not None and len(self.pending) < self.window and self.sub_shard < len(self.shards):
            paths = self.shards[self.sub_shard]
            if self.sub_row == len(paths):
                self.sub_shard, self.sub_row = self.sub_shard + 1, 0
                continue
            self.pending.append(self.pool.submit(self._safe, paths[self.sub_row]))
            self.sub_row += 1

    def next(self) -> Batch | None:
        import torch

        if not self.shards:
            return None
        paths = self.shards[0]
        if self.row == len(paths):  # this shard is over: the next call reads the following one
            self.shards.popleft()
            self.row = 0
            if self.sub_shard:
                self.sub_shard -= 1
            else:
                self.sub_row = 0
            return None
        start, stop = self.row, min(self.row + self.batch_size, len(paths))
        offsets, items, failed = [], [], {}
        for i in range(start, stop):
            self._fill()
            img, err = self.pending.popleft().result() if self.pool is not None else self._safe(paths[i])
            if err is None:
                offsets.append(i)
                items.append(img)
            else:
                failed[i] = err
        self.row = stop
        self._fill()
        if self.collate is None or not items:
            images = torch.stack(items) if items else None
        else:
            images, bad = self.collate(items)
            for j, err in bad.items():
                failed[offsets[j]] = err
            offsets = [o for j, o in enumerate(offsets) if j not in bad]
        return Batch(offsets, images, dict(sorted(failed.items())))


def iter_batches(
    paths: Sequence[Locator],
    batch_size: int,
    decode,
    pool: ThreadPoolExecutor | None,
    prefetch_batches: int = 2,
    collate=None,
) -> Iterator[Batch]:
    """The batches of one shard's ``paths`` (see :class:`BatchStream`)."""
    stream = BatchStream(batch_size, decode, pool, prefetch_batches, collate)
    stream.add(paths)
    while (batch := stream.next()) is not None:
        yield batch
