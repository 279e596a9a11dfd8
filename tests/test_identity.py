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


SMALL = {"model": {"name": None, "factory": "toy_models:small_cnn", "weights": None, "device": "cpu"},
         "capture": [{"layer": "layer1", "reduce": "mean"}, {"layer": "fc"}]}


def test_a_model_with_the_same_class_and_weights_but_another_forward_is_refused_for_reuse(image_dir: Path,
                                                                                           tmp_path: Path):
    """issue 37, case 6 (reuse): a factory that swaps ReLU for GELU keeps the class and the state dict; its rows
    were copied. The forward's summary on the probe's fixed input tells the two apart."""
    run(parse_spec(job(image_dir, tmp_path / "relu.zarr", **SMALL)))
    gelu = {**SMALL, "model": {**SMALL["model"], "factory": "toy_models:small_cnn_gelu"}}
    raw = job(image_dir, tmp_path / "s.zarr", **gelu, output={"reuse": [str(tmp_path / "relu.zarr")]})
    with pytest.raises(StoreError, match=r"relu.zarr are not what this job computes: it differs in the model's "
                                         r"forward \(other values of fc, layer1 on the probe's fixed input\)"):
        run(parse_spec(raw))
    assert not (tmp_path / "s.zarr").exists()
    raw = job(image_dir, tmp_path / "r.zarr", **SMALL, output={"reuse": [str(tmp_path / "relu.zarr")]})
    assert run(parse_spec(raw)).reused == 12  # the same forward: taken


def test_a_python_model_with_another_forward_cannot_resume_and_an_older_store_still_resumes(image_dir: Path,
                                                                                             tmp_path: Path):
    """issue 37, case 6 (``model=`` from Python): the same class and state dict, GELU for ReLU: the resume is
    refused naming the forward. A store made before the forward's summary (no such field) resumes as before."""
    from toy_models import small_cnn, small_cnn_gelu

    import extractor

    raw = job(image_dir, tmp_path / "s.zarr", **SMALL)
    raw["model"] = {"device": "cpu"}  # the module given
    relu, gelu = small_cnn(), small_cnn_gelu()
    gelu.load_state_dict(relu.state_dict())
    extractor.run(raw, model=relu, progress=False)
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=r"the model's forward differs \(same weights, other values of fc, layer1"):
        extractor.run(raw, model=gelu, progress=False)
    assert extractor.run(raw, model=relu, progress=False).last_run.shards_run == 0
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="r+")
    attrs = dict(group.attrs["extractor"])
    assert set(attrs["model"]["forward_summary"]) == {"layer1", "fc"}
    attrs["model"] = {k: v for k, v in attrs["model"].items() if k != "forward_summary"}
    group.attrs["extractor"] = attrs  # as a store made before it
    assert extractor.run(raw, model=relu, progress=False).last_run.shards_run == 0


def test_the_forward_summary_holds_across_float_rounding_and_not_across_another_forward():
    from extractor.store.forward import forward_differences, forward_summary

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 7, 7)).astype(np.float32)
    noisy = x * (1 + rng.uniform(-1e-3, 1e-3, x.shape)).astype(np.float32)  # half-precision-like rounding
    relu, gelu = np.maximum(x, 0), x * 0.5 * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))
    def model(values: np.ndarray) -> dict:
        return {"forward_summary": forward_summary({"k": values})}

    assert forward_differences(model(x), model(noisy)) == []
    assert forward_differences(model(relu), model(gelu)) == ["k"]
    assert forward_differences({}, model(x)) == []  # a store made before it: not compared
