"""Batch JPEG decoding (``data.decode_device: cuda``) checked on the CPU against Pillow.

``JpegDecoder`` runs the same code with ``device="cpu"`` (libjpeg-turbo through
``torchvision.io.decode_jpeg``) as with ``device="cuda"`` (nvJPEG); the GPU itself is checked
by ``bench/gpu_check.py`` when a GPU is lent.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from extractor.data.decode import EncodedJpeg, ImageDecoder, JpegDecoder
from extractor.data.stream import iter_batches
from extractor.spec.data_spec import DataSpec


def photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth, photo-like content (gradients and soft blobs): what JPEG is made for."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    out = np.zeros((h, w, 3))
    for c in range(3):
        for _ in range(4):
            cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(10, max(h, w) / 2)
            out[..., c] += rng.uniform(40, 120) * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * r * r))
        out[..., c] += 60 * x / w + rng.uniform(0, 40)
    return np.clip(out, 0, 255).astype(np.uint8)


def jpeg_bytes(arr: np.ndarray, mode: str = "RGB", orientation: int | None = None) -> bytes:
    img = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    kw = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif.tobytes()
    img.save(buf, format="JPEG", quality=92, **kw)
    return buf.getvalue()


DATA = DataSpec(root="unused", resize=72, crop=64)


def decode_both(tmp_path: Path, files: dict[str, bytes]):
    """Each file through Pillow (ImageDecoder) and through JpegDecoder's read+collate on the CPU."""
    paths = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    pil = ImageDecoder(DATA)
    jpeg = JpegDecoder(DATA, torch.device("cpu"))
    batches = list(iter_batches(paths, 4, jpeg.read, None, collate=jpeg.collate))
    got: dict[int, torch.Tensor] = {}
    failed: dict[int, str] = {}
    for b in batches:
        failed.update(b.failed)
        for j, off in enumerate(b.offsets):
            got[off] = b.images[j]
    ref = {}
    for i, p in enumerate(paths):
        try:
            ref[i] = pil(p)
        except Exception as err:  # noqa: BLE001
            ref[i] = err
    return paths, got, failed, ref, jpeg


def test_batch_decode_matches_pillow_within_a_few_levels(tmp_path: Path):
    files = {
        "wide.jpg": jpeg_bytes(photo(90, 140, 1)),
        "tall.jpg": jpeg_bytes(photo(150, 100, 2)),
        "gray.jpg": jpeg_bytes(photo(100, 100, 3), mode="L"),
        "small.jpg": jpeg_bytes(photo(50, 60, 4)),  # upscaled to 72
        "cmyk.jpg": jpeg_bytes(photo(80, 96, 5), mode="CMYK"),
        "png.png": b"",
    }
    buf = io.BytesIO()
    Image.fromarray(photo(88, 77, 6)).save(buf, format="PNG")
    files["png.png"] = buf.getvalue()
    paths, got, failed, ref, jpeg = decode_both(tmp_path, files)
    assert not failed
    assert sorted(got) == list(range(len(paths)))
    for i, p in enumerate(paths):
        a, b = got[i].int(), ref[i].int()
        assert a.shape == b.shape == (3, 64, 64), p
        diff = (a - b).abs().float()
        if p.endswith(("cmyk.jpg", "png.png")):  # not for the device decoder: Pillow decodes them, identically
            assert diff.max() == 0, p
        else:
            assert diff.mean() < 0.5 and diff.max() <= 2, (p, diff.mean().item(), diff.max().item())
    # what went to the batch decoder and what to Pillow
    kinds = {Path(p).name: type(jpeg.read(p)).__name__ for p in paths}
    assert kinds == {"wide.jpg": "EncodedJpeg", "tall.jpg": "EncodedJpeg", "gray.jpg": "EncodedJpeg",
                     "small.jpg": "EncodedJpeg", "cmyk.jpg": "Tensor", "png.png": "Tensor"}


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_like_pillow(tmp_path: Path, orientation: int):
    arr = photo(60, 100, orientation)
    arr[:20, :30] = (255, 0, 0)  # a red corner shows which way the image ends up
    _, got, failed, ref, _ = decode_both(tmp_path, {"o.jpg": jpeg_bytes(arr, orientation=orientation)})
    assert not failed
    diff = (got[0].int() - ref[0].int()).abs().float()
    assert diff.mean() < 0.5 and diff.max() <= 2, (orientation, diff.mean().item())


def test_corrupt_and_oversized_files_fail_their_rows_only(tmp_path: Path):
    good = jpeg_bytes(photo(80, 80, 7))
    files = {
        "a.jpg": good,
        "garbage.jpg": b"\xff\xd8\xff\xe0" + b"\x00" * 64,  # JPEG magic, nothing behind it
        "b.jpg": good,
        "text.jpg": b"not an image at all",
        "c.jpg": good,
    }
    paths, got, failed, _ref, _ = decode_both(tmp_path, files)
    assert sorted(failed) == [1, 3] and sorted(got) == [0, 2, 4]
    assert all(failed[i] for i in failed)
    assert torch.equal(got[0], got[2])
    big = DataSpec(root="unused", resize=72, crop=64, max_image_pixels=100)
    with pytest.raises(ValueError, match="max_image_pixels"):
        JpegDecoder(big, torch.device("cpu")).read(paths[0])


def test_read_keeps_the_bytes_and_orientation(tmp_path: Path):
    p = tmp_path / "r.jpg"
    data = jpeg_bytes(photo(40, 50, 8), orientation=6)
    p.write_bytes(data)
    item = JpegDecoder(DATA, torch.device("cpu")).read(str(p))
    assert isinstance(item, EncodedJpeg) and item.orientation == 6 and item.data == data


def test_gpu_decoding_without_a_gpu_is_a_clear_error(image_dir: Path, tmp_path: Path):
    from helpers.jobs import job

    from extractor.driver.runner import run
    from extractor.errors import ModelError
    from extractor.spec.load import parse_spec

    raw = job(image_dir, tmp_path / "s.zarr", data={"decode_device": "cuda"})
    with pytest.raises(ModelError, match=r"data.decode_device: cuda needs the model on a CUDA GPU.*decode_device: cpu"):
        run(parse_spec(raw))
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize(("w", "h", "orientation", "scale"), [(200, 150, None, 2), (640, 480, None, 4),
                                                             (1200, 600, 6, 8),
                                                   (600, 1200, None, 8), (140, 100, None, 1)])
def test_jpeg_draft_decodes_at_the_smallest_scale_the_resize_allows(w: int, h: int, orientation: int | None,
                                                                     scale: int):
    """data.jpeg_draft: libjpeg's 1/2, 1/4, 1/8 scale, only while the shorter side stays >= resize
    (72 here; the crop 64); the pixels stay close to a full decode's."""
    from extractor.data.decode import rgb_from_bytes

    data = jpeg_bytes(photo(h, w, seed=w), orientation=orientation)
    drafted = ImageDecoder(DataSpec(root="unused", resize=72, crop=64, jpeg_draft=True))
    full = ImageDecoder(DATA)
    stored = rgb_from_bytes(data, None, drafted.preprocess)
    long_, short = max(w, h), min(w, h)
    assert min(stored.size) == -(-short // scale) >= 72 and max(stored.size) == -(-long_ // scale)
    if orientation == 6:  # rotated a quarter turn, after the reduced decode
        assert stored.size == (-(-h // scale), -(-w // scale))
    a, b = drafted.from_bytes(data).float(), full.from_bytes(data).float()
    assert a.shape == b.shape == (3, 64, 64)
    diff = (a - b).abs()
    if scale == 1:
        assert diff.max() == 0
    else:
        assert 0 < diff.mean() < 3 and diff.max() < 40, (diff.mean(), diff.max())


def test_jpeg_draft_leaves_other_formats_alone_and_is_refused_where_it_would_do_nothing():
    from extractor.data.decode import rgb_from_bytes

    arr = photo(480, 640)
    png = io.BytesIO()
    Image.fromarray(arr).save(png, format="PNG")
    drafted = ImageDecoder(DataSpec(root="unused", resize=72, crop=64, jpeg_draft=True))
    assert rgb_from_bytes(png.getvalue(), None, drafted.preprocess).size == (640, 480)
    assert ImageDecoder(DataSpec(root="unused", resize=None, crop=64)).preprocess.draft_size(640, 480) is None
    with pytest.raises(ValueError, match=r"resize: null .* would do nothing"):
        DataSpec(root="unused", resize=None, crop=64, jpeg_draft=True)
    with pytest.raises(ValueError, match="decode_device: cuda"):
        DataSpec(root="unused", decode_device="cuda", jpeg_draft=True)
