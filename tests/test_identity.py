"""Identity by facts (issue 37): what a resume or a reuse takes as "the same" is decided from facts that cannot be
put back by hand: a local file's ctime and inode beside its size and mtime; a digest of the model's forward on the
probe's input beside its class and weights; a reused store's identity and rows checked again after their values
were read."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import job
from PIL import Image

from extractor.data.files import fingerprint, local_fingerprint
from extractor.driver.runner import run
from extractor.errors import StoreError
from extractor.read.reader import open_store
from extractor.spec.schema import parse_spec

CHANGED = r"the images of 1 row computed before have changed since \(their content digest differs\)"


def other_bytes_of_the_same_size(data: bytes) -> bytes:
    """Another image (a grey JPEG), padded after its end marker to ``len(data)`` bytes."""
    buf = io.BytesIO()
    Image.fromarray(np.full((50, 60, 3), 200, np.uint8)).save(buf, format="JPEG")
    new = buf.getvalue()
    assert len(new) < len(data)
    return new + b"\0" * (len(data) - len(new))


def rewrite_keeping_size_and_mtime(path: Path, edit) -> None:
    """Rewrite ``path`` in place with ``edit(bytes)`` (the same size), then put its times back (``touch -r``)."""
    st = path.stat()
    data = path.read_bytes()
    new = edit(data)
    assert len(new) == len(data) and new != data
    with open(path, "r+b") as f:
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def _interrupted_after(raw: dict, shards: int) -> None:
    done = []

    def stop(name: str, info: dict) -> None:
        if name == "shard_done":
            done.append(info["shard"])
            if len(done) == shards:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(parse_spec(raw), on_event=stop)


def _copy(image_dir: Path, to: Path) -> Path:
    shutil.copytree(image_dir, to)
    return to


def test_a_file_rewritten_with_its_size_and_mtime_put_back_is_found_changed(image_dir: Path, tmp_path: Path):
    """issue 37, case 4 (folder): other bytes of the same size, the mtime put back with ``touch -r``: the resume
    used to take the row as unchanged (size + mtime); its ctime moved, so its content digest is compared."""
    root = _copy(image_dir, tmp_path / "imgs")
    raw = job(root, tmp_path / "s.zarr", data={"shard_size": 4})
    _interrupted_after(raw, 1)  # rows 0-3 done
    victim = root / open_store(str(tmp_path / "s.zarr")).ids[2]
    assert victim.suffix == ".jpg"
    rewrite_keeping_size_and_mtime(victim, other_bytes_of_the_same_size)
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=CHANGED):
        run(parse_spec(raw))


def test_a_parquet_file_rewritten_with_its_size_and_mtime_put_back_is_found_changed(image_dir: Path,
                                                                                      tmp_path: Path):
    """issue 37, case 4 (Parquet): one row's image bytes replaced inside the file, its size and mtime as they were."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from test_parquet import images_of, parquet_job

    images = images_of(image_dir)
    path = tmp_path / "data" / "train.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"image": [{"bytes": p.read_bytes(), "path": p.name} for p in images],
                             "label": [0] * len(images)}), path, compression="none")  # the bytes as they are
    raw = parquet_job(image_dir, tmp_path / "p.zarr", str(path), shard_size=4)
    _interrupted_after(raw, 1)
    first = images[0].read_bytes()
    assert images[0].suffix == ".jpg"

    def edit(data: bytes) -> bytes:
        assert data.count(first) == 1
        return data.replace(first, other_bytes_of_the_same_size(first))

    rewrite_keeping_size_and_mtime(path, edit)
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=CHANGED + r": 'train/0'"):
        run(parse_spec(raw))


def test_a_store_with_fingerprints_of_the_old_form_resumes_after_a_digest_pass(image_dir: Path, tmp_path: Path):
    """Stores made before ctime and inode were part of a file's fingerprint recorded fingerprint(size, mtime): a
    resume reads the computed rows' bytes once, compares their content digests (the ground truth), so it is neither
    refused wholesale nor blind to a change, and records the new fingerprints."""
    root = _copy(image_dir, tmp_path / "imgs")
    raw = job(root, tmp_path / "s.zarr", data={"shard_size": 4})
    _interrupted_after(raw, 2)  # rows 0-7 done
    s = open_store(str(tmp_path / "s.zarr"))
    files = [root / i for i in s.ids]
    old_form = np.array([fingerprint(f.stat().st_size, f.stat().st_mtime_ns) for f in files], np.uint64)
    zarr.open_group(str(tmp_path / "s.zarr"), mode="r+")["fingerprint"][:] = old_form
    victim = files[6]
    assert victim.suffix == ".jpg"
    rewrite_keeping_size_and_mtime(victim, other_bytes_of_the_same_size)
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=CHANGED + rf": {s.ids[6]!r}\."):  # only it: the others' digests agree
        run(parse_spec(raw))
    raw["output"]["on_change"] = "redo"
    summary = run(parse_spec(raw))
    assert 1 in {p.shard for p in summary.per_shard} and 0 not in {p.shard for p in summary.per_shard}
    now_ = np.asarray(zarr.open_group(str(tmp_path / "s.zarr"), mode="r")["fingerprint"][:])
    assert now_.tolist() == [local_fingerprint(str(f)) for f in files]
