"""Image sources: listing rows, planning shards, reading and decoding images.

Row order is deterministic: a folder is walked in sorted order, a manifest is read in file
order, so the same spec always gives the same row for the same image.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import DataError
from .spec import DataSpec

__all__ = ["Rows", "Shard", "plan", "list_rows", "ImageDecoder", "Batch", "iter_batches"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rows:
    """The data set as the store records it: one entry per row, in row order."""

    ids: list[str]
    paths: list[str]
    labels: list[int]
    classes: list[str] = field(default_factory=list)

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


def list_rows(data: DataSpec) -> Rows:
    """List the images of a data spec, or raise :class:`DataError` before any work starts."""
    if data.source == "folder":
        assert data.root is not None  # the spec validator guarantees it
        rows = _list_folder(Path(data.root), data.extensions)
    else:
        assert data.manifest is not None
        rows = _list_manifest(Path(data.manifest), Path(data.root) if data.root else None)
    if not len(rows):
        where = data.root if data.source == "folder" else data.manifest
        raise DataError(
            f"no images found in {where} (looked for files ending in {', '.join(data.extensions)}); "
            "check data.root / data.manifest"
        )
    return rows


def _list_folder(root: Path, extensions: Sequence[str]) -> Rows:
    if not root.exists():
        raise DataError(f"data.root {root} does not exist; set data.root to a folder of images")
    if not root.is_dir():
        raise DataError(f"data.root {root} is not a folder; for a file list use data.source: manifest")
    exts = tuple(e.lower() for e in extensions)
    rel: list[str] = []

    def onerror(err: OSError) -> None:
        log.warning("cannot list %s: %s", err.filename, err.strerror)

    for dirpath, dirnames, filenames in os.walk(root, onerror=onerror):
        dirnames.sort()
        base = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            if name.lower().endswith(exts) and not name.startswith("."):
                rel.append((base / name).as_posix())
    # ImageFolder-shaped: no images directly in root, every image below a class folder
    top = [r.split("/", 1)[0] for r in rel]
    classes: list[str] = []
    labels = [-1] * len(rel)
    if rel and all("/" in r for r in rel):
        classes = sorted(set(top))
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[t] for t in top]
    paths = [str(root / r) for r in rel]
    return Rows(ids=rel, paths=paths, labels=labels, classes=classes)


def _list_manifest(manifest: Path, root: Path | None) -> Rows:
    if not manifest.exists():
        raise DataError(f"data.manifest {manifest} does not exist")
    suffix = manifest.suffix.lower()
    try:
        if suffix == ".csv":
            with manifest.open(newline="") as f:
                records = list(csv.DictReader(f))
        elif suffix in (".jsonl", ".ndjson"):
            records = []
            with manifest.open() as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            records.append(json.loads(line))
                        except json.JSONDecodeError as err:
                            raise DataError(f"{manifest}:{lineno}: not valid JSON: {err.msg}") from None
        else:
            raise DataError(f"data.manifest {manifest}: expected a .csv or .jsonl file")
    except UnicodeDecodeError as err:
        raise DataError(f"data.manifest {manifest} is not UTF-8 text: {err}") from None
    base = root if root is not None else manifest.parent
    ids, paths, raw_labels = [], [], []
    for n, rec in enumerate(records):
        where = f"{manifest} row {n + 1}"
        if not isinstance(rec, dict) or not rec.get("path"):
            raise DataError(f"{where}: missing 'path' (columns: path, optional id and label)")
        p = str(rec["path"])
        full = p if "://" in p or os.path.isabs(p) else str(base / p)
        paths.append(full)
        ids.append(str(rec["id"]) if rec.get("id") not in (None, "") else p)
        raw_labels.append(rec.get("label"))
    seen: dict[str, int] = {}
    for n, i in enumerate(ids):
        if i in seen:
            raise DataError(
                f"{manifest}: id {i!r} appears in rows {seen[i] + 1} and {n + 1}; ids must be unique"
            )
        seen[i] = n
    labels, classes = _labels(raw_labels, manifest)
    return Rows(ids=ids, paths=paths, labels=labels, classes=classes)


def _labels(raw: list[object], manifest: Path) -> tuple[list[int], list[str]]:
    present = [v for v in raw if v not in (None, "")]
    if not present:
        return [-1] * len(raw), []
    try:
        ints = [int(v) if v not in (None, "") else -1 for v in raw]  # type: ignore[call-overload]
        if all(str(v).strip().lstrip("-").isdigit() for v in present):
            return ints, []
    except (TypeError, ValueError):
        pass
    classes = sorted({str(v) for v in present})
    index = {c: i for i, c in enumerate(classes)}
    return [index[str(v)] if v not in (None, "") else -1 for v in raw], classes


# --------------------------------------------------------------------------- decoding


class ImageDecoder:
    """Reads one image file into a uint8 ``(3, crop, crop)`` tensor: RGB, resized, cropped.

    Grayscale, palette, RGBA, CMYK and 16-bit images become 8-bit RGB; EXIF orientation
    is applied. Normalisation happens later, on the model's device.
    """

    def __init__(self, data: DataSpec) -> None:
        from torchvision.transforms import InterpolationMode

        self.resize = data.resize
        self.crop = data.crop
        self.interpolation = InterpolationMode(data.interpolation)

    def __call__(self, path: str):  # -> torch.Tensor (3, crop, crop) uint8
        import torchvision.transforms.v2.functional as F

        img = open_rgb(path)
        if self.resize is not None:
            img = F.resize(img, [self.resize], interpolation=self.interpolation, antialias=True)
        img = F.center_crop(img, [self.crop, self.crop])
        return F.pil_to_tensor(img)


def open_rgb(path: str):  # -> PIL.Image.Image in mode RGB
    """Open an image file as 8-bit RGB with its EXIF orientation applied."""
    from PIL import Image, ImageOps

    with open(path, "rb") as f:
        img = Image.open(f)
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
    """A short, readable one-line error for a failed row."""
    msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
    name = type(err).__name__
    return f"{name}: {msg}"[:300] if msg else name


@dataclass
class Batch:
    """Decoded images of one batch; ``offsets`` are row offsets within the shard."""

    offsets: list[int]  # rows that decoded, in order
    images: object  # torch.Tensor (B, 3, H, W) uint8, or None when no image decoded
    failed: dict[int, str]  # row offset -> error text


def iter_batches(
    paths: Sequence[str],
    batch_size: int,
    decode,
    pool: ThreadPoolExecutor | None,
    prefetch_batches: int = 2,
) -> Iterator[Batch]:
    """Decode ``paths`` in batches, ``prefetch_batches`` ahead on ``pool`` (inline if None)."""
    import torch

    def safe(path: str):
        try:
            return decode(path), None
        except Exception as err:  # noqa: BLE001 - any decode failure fails its row only
            return None, describe_error(err)

    n = len(paths)
    window = batch_size * (prefetch_batches + 1)
    pending: deque[Future] = deque()
    submitted = 0

    def fill() -> None:
        nonlocal submitted
        while pool is not None and submitted < n and len(pending) < window:
            pending.append(pool.submit(safe, paths[submitted]))
            submitted += 1

    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        offsets, tensors, failed = [], [], {}
        for i in range(start, stop):
            fill()
            img, err = pending.popleft().result() if pool is not None else safe(paths[i])
            if err is None:
                offsets.append(i)
                tensors.append(img)
            else:
                failed[i] = err
        fill()
        images = torch.stack(tensors) if tensors else None
        yield Batch(offsets, images, failed)
