"""Identity by facts (issue 37): what a resume or a reuse takes as "the same" is decided from facts that cannot be
put back by hand: a local file's ctime and inode beside its size and mtime; a digest of the model's forward on the
probe's input beside its class and weights; a reused store's identity and rows checked again after their values
were read."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.interrupts import interrupted_after
from helpers.jobs import job
from helpers.stores import edited, made_again, opened, root_attrs
from PIL import Image

from extractor.data.files import fingerprint, local_fingerprint
from extractor.driver.runner import run
from extractor.errors import StoreError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec
from extractor.store.provenance import stored_prints

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


def _copy(image_dir: Path, to: Path) -> Path:
    shutil.copytree(image_dir, to)
    return to


def test_a_file_rewritten_with_its_size_and_mtime_put_back_is_found_changed(image_dir: Path, tmp_path: Path):
    """issue 37, case 4 (folder): other bytes of the same size, the mtime put back with ``touch -r``: the resume
    used to take the row as unchanged (size + mtime); its ctime moved, so its content digest is compared. (Written
    in place, it leaves its folder's times as they were: ``data.verify: files`` stats each file, issue 39.)"""
    root = _copy(image_dir, tmp_path / "imgs")
    raw = job(root, tmp_path / "s.zarr", data={"shard_size": 4, "verify": "files"})
    interrupted_after(raw, 1)  # rows 0-3 done
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
    from helpers.parquet import images_of, parquet_job

    images = images_of(image_dir)
    path = tmp_path / "data" / "train.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"image": [{"bytes": p.read_bytes(), "path": p.name} for p in images],
                             "label": [0] * len(images)}), path, compression="none")  # the bytes as they are
    raw = parquet_job(image_dir, tmp_path / "p.zarr", str(path), shard_size=4)
    interrupted_after(raw, 1)
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
    refused wholesale nor blind to a change, and records the new fingerprints. (Such stores recorded no folders:
    they are listed again; this one does, and its file is rewritten in place: ``data.verify: files``.)"""
    root = _copy(image_dir, tmp_path / "imgs")
    raw = job(root, tmp_path / "s.zarr", data={"shard_size": 4, "verify": "files"})
    interrupted_after(raw, 2)  # rows 0-7 done
    s = open_store(str(tmp_path / "s.zarr"))
    files = [root / i for i in s.ids]
    old_form = np.array([fingerprint(f.stat().st_size, f.stat().st_mtime_ns) for f in files], np.uint64)
    read = np.asarray(s.status) != 0  # (rows 0-7, and maybe a shard more: a shard still to compute holds none, as a
    edited(str(tmp_path / "s.zarr"))["fingerprint"][:] = np.where(read, old_form, 0)  # folder's listing gives none)
    victim = files[6]
    assert victim.suffix == ".jpg"
    rewrite_keeping_size_and_mtime(victim, other_bytes_of_the_same_size)
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=CHANGED + rf": {s.ids[6]!r}\."):  # only it: the others' digests agree
        run(parse_spec(raw))
    raw["output"]["on_change"] = "redo"
    summary = run(parse_spec(raw))
    assert 1 in {p.shard for p in summary.per_shard} and 0 not in {p.shard for p in summary.per_shard}
    g = opened(str(tmp_path / "s.zarr"))  # the new fingerprints: recorded by the resume, and shard 1's (computed
    assert stored_prints(g, 0, len(files)).tolist() == [local_fingerprint(str(f)) for f in files]  # again) its
    assert not np.asarray(g["fingerprint"][4:8]).any()  # worker's as it read the files, none of the resume's


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
    attrs = root_attrs(str(tmp_path / "s.zarr"))
    assert set(attrs["model"]["forward"]["summary"]) == {"layer1", "fc"}
    root_attrs(str(tmp_path / "s.zarr"), model={k: v for k, v in attrs["model"].items()  # as a store made before it
                                                if k != "forward"})
    assert extractor.run(raw, model=relu, progress=False).last_run.shards_run == 0


BRIGHT = {**SMALL, "model": {**SMALL["model"], "factory": "toy_models:bright_cnn"}}


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


@pytest.mark.parametrize("swap", ["leaky", "relu6"])
def test_every_relu_swapped_for_a_leaky_relu_or_a_relu6_is_refused_by_reuse_and_resume(image_dir: Path,
                                                                                      tmp_path: Path, swap: str):
    """T5-15: a factory that swaps every ReLU for a LeakyReLU(0.01) or a ReLU6 keeps the class and the state dict
    and moves the values, its forward's summary within the old 5% tolerance: all its rows were reused,
    and a resume with ``model=`` mixed both forwards in one store. Now both are refused, in the context the store
    was made in (by the values' digest) and at another thread count (by the summary, within the model's measured
    rounding noise)."""
    import toy_models

    import extractor

    with torch_threads(2):
        run(parse_spec(job(image_dir, tmp_path / "relu.zarr", **BRIGHT)))
        swapped = {**BRIGHT, "model": {**BRIGHT["model"], "factory": f"toy_models:bright_cnn_{swap}"}}
        run(parse_spec(job(image_dir, tmp_path / "swapped.zarr", **swapped)))
    relu, other = open_store(str(tmp_path / "relu.zarr")), open_store(str(tmp_path / "swapped.zarr"))
    was, now_ = relu.attrs["model"]["forward"], other.attrs["model"]["forward"]
    for key in ("layer1", "fc"):  # other values, which the old rule took as the same: summaries within 5%
        a, b = relu.numpy(key), other.numpy(key)
        assert np.linalg.norm(a - b) / np.linalg.norm(a) > 1e-3
        x, y = np.asarray(was["summary"][key]), np.asarray(now_["summary"][key])
        assert np.linalg.norm(x - y) < 0.05 * max(np.linalg.norm(x), np.linalg.norm(y))
    raw = job(image_dir, tmp_path / "s.zarr", **swapped, output={"reuse": [str(tmp_path / "relu.zarr")]})
    for threads in (2, 1):
        with torch_threads(threads), pytest.raises(StoreError, match=r"relu.zarr are not what this job computes: "
                                                   r"it differs in the model's forward \(other values of fc, layer1"):
            run(parse_spec(raw))
    assert not (tmp_path / "s.zarr").exists()

    raw = job(image_dir, tmp_path / "p.zarr", **BRIGHT)
    raw["model"] = {"device": "cpu"}  # the module given
    module = toy_models.bright_cnn()
    swapped_module = getattr(toy_models, f"bright_cnn_{swap}")()
    swapped_module.load_state_dict(module.state_dict())
    with torch_threads(2):
        extractor.run(raw, model=module, progress=False)
    raw["output"]["if_exists"] = "resume"
    for threads in (2, 1):
        with torch_threads(threads), pytest.raises(StoreError, match=r"the model's forward differs \(same weights, "
                                                                     r"other values of fc, layer1"):
            extractor.run(raw, model=swapped_module, progress=False)


def test_the_same_model_is_taken_in_its_context_and_at_another_thread_count(image_dir: Path, tmp_path: Path):
    """The same model's rows are reused, and its store resumed, where it was made (equal digests) and at another
    thread count (its summary within its rounding noise)."""
    import toy_models

    import extractor

    raw = job(image_dir, tmp_path / "p.zarr", **BRIGHT)
    raw["model"] = {"device": "cpu"}
    module = toy_models.bright_cnn()
    with torch_threads(2):
        run(parse_spec(job(image_dir, tmp_path / "src.zarr", **BRIGHT)))
        extractor.run(raw, model=module, progress=False)
    forward = root_attrs(str(tmp_path / "src.zarr"))["model"]["forward"]
    assert forward["context"]["threads"] == 2 and set(forward["digest"]) == set(forward["noise"]) == {"layer1", "fc"}
    assert all(2.0 ** -24 <= n < 1e-5 for n in forward["noise"].values())  # float32 rounding, as measured
    raw["output"]["if_exists"] = "resume"
    for threads in (2, 1):
        with torch_threads(threads):
            reusing = job(image_dir, tmp_path / f"r{threads}.zarr", **BRIGHT,
                          output={"reuse": [str(tmp_path / "src.zarr")]})
            assert run(parse_spec(reusing)).reused == 12
            assert extractor.run(raw, model=module, progress=False).last_run.shards_run == 0


def _record(values: dict, context: dict, noise: float | None = 1e-6, reproducible: bool = True) -> dict:
    """A store's model record of a forward that gave ``values``, and under rounding noise those values moved by
    ``noise`` (relatively, at random; None: not measured)."""
    from extractor.store.forward import forward_record

    rng = np.random.default_rng(1)
    moved = None if noise is None else {k: v * (1 + noise * rng.uniform(-1, 1, v.shape)).astype(v.dtype)
                                        for k, v in values.items()}
    return {"forward": forward_record(values, moved, context, reproducible)}


CPU = {"torch": "2", "device": "cpu", "dtype": "float32", "rounding": 2.0 ** -24, "threads": 2}


def test_one_context_compares_bits_and_another_the_summary_within_the_measured_noise():
    """Where two forwards ran in one context (device, dtype, torch, threads), any change of their bits is another
    forward: one float32 ulp of one value. Elsewhere their summaries may differ by NOISE_FACTOR times the larger
    rounding noise measured (how far the values moved with every layer moved by the unit roundoff), no more."""
    from extractor.store.forward import NOISE_FACTOR, UNMEASURED, forward_differences

    x = np.random.default_rng(0).standard_normal((64, 7, 7)).astype(np.float32)
    ulp = x.copy()
    ulp[0, 0, 0] = np.nextafter(ulp[0, 0, 0], np.float32(np.inf))
    other = {**CPU, "threads": 1}  # another context
    assert forward_differences(_record({"k": x}, CPU), _record({"k": x}, CPU)) == []
    assert forward_differences(_record({"k": x}, CPU), _record({"k": ulp}, CPU)) == ["k"]
    assert forward_differences(_record({"k": x}, CPU), _record({"k": ulp}, other)) == []  # within the noise
    relu, leaky = {"k": np.maximum(x, 0)}, {"k": np.where(x > 0, x, np.float32(0.01) * x)}
    assert forward_differences(_record(relu, CPU), _record(leaky, CPU)) == ["k"]
    assert forward_differences(_record(relu, CPU), _record(leaky, other)) == ["k"]
    # the tolerance is the measured noise's, not a constant: a fifth of it passes, five times it does not
    recorded = _record({"k": x}, CPU)
    tolerance = NOISE_FACTOR * recorded["forward"]["noise"]["k"]
    assert 1e-7 < tolerance / NOISE_FACTOR < 1e-6  # values moved by up to 1e-6 move the summary so much
    for factor, differ in ((0.2, []), (5.0, ["k"])):
        assert forward_differences(recorded, _record({"k": x * np.float32(1 + factor * tolerance)}, other)) == differ
    noisier = _record({"k": x}, other, noise=1e-3)  # the larger noise of the two decides
    assert forward_differences(recorded, _record({"k": x * np.float32(1 + 5 * tolerance)}, other, noise=1e-3)) == []
    assert forward_differences(noisier, _record({"k": x * np.float32(1 + 5 * tolerance)}, CPU)) == []
    # two forwards of one process that differed in their bits: compared by summary in their context too
    assert forward_differences(_record({"k": x}, CPU, reproducible=False), _record({"k": ulp}, CPU)) == []
    # noise not measured (a model that refused the hooks): the wide tolerance
    assert forward_differences(_record(relu, CPU, noise=None),
                               _record({"k": relu["k"] * np.float32(1 + UNMEASURED / 2)}, other)) == []
    assert forward_differences({}, _record({"k": x}, CPU)) == []  # a store made before it: not compared


def _replace(store: Path, by: Path) -> None:
    """``store`` overwritten by another job's store (another preprocessing: other values for the same images)."""
    shutil.rmtree(store)
    shutil.copytree(by, store)


def _reuse_job(image_dir: Path, store: Path, source: Path) -> dict:
    return job(image_dir, store, **SMALL, output={"store": str(store), "reuse": [str(source)]})


@pytest.mark.parametrize("when", ["after the index was built", "before the index was built"])
def test_a_source_overwritten_while_the_reusing_job_runs_gives_no_row(image_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch, when: str):
    """issue 37, case 5: the source of output.reuse overwritten by another job (another preprocessing) while the
    reusing job runs: after the driver checked it and before the worker indexed it, or after the index was built
    and before any value was copied. Rows were copied from the new store (another preprocessing's values; NaN
    where it had not written yet). Now its identity and rows are checked after their values are read (and its
    inputs when the index is built): every row is computed, and the store equals a clean run."""
    from extractor.store.reuse import ReuseIndex

    run(parse_spec(job(image_dir, tmp_path / "src.zarr", **SMALL)))
    run(parse_spec(job(image_dir, tmp_path / "other.zarr", **SMALL, data={"resize": 80})))
    built = ReuseIndex.__init__

    def replaced_at_that_moment(self, *args, **kwargs):
        if when.startswith("before"):
            _replace(tmp_path / "src.zarr", tmp_path / "other.zarr")
        built(self, *args, **kwargs)
        if when.startswith("after"):
            assert len(self) == 12  # every row indexed, from the store as it was
            _replace(tmp_path / "src.zarr", tmp_path / "other.zarr")

    monkeypatch.setattr(ReuseIndex, "__init__", replaced_at_that_moment)
    summary = run(parse_spec(_reuse_job(image_dir, tmp_path / "s.zarr", tmp_path / "src.zarr")))
    assert summary.ok == 12 and summary.reused == 0
    monkeypatch.undo()
    run(parse_spec(job(image_dir, tmp_path / "clean.zarr", **SMALL)))
    s, c = open_store(str(tmp_path / "s.zarr")), open_store(str(tmp_path / "clean.zarr"))
    for key in ("layer1", "fc"):
        np.testing.assert_allclose(s.numpy(key), c.numpy(key), rtol=1e-5, atol=1e-6)


def test_rows_of_a_source_no_longer_ok_after_their_values_were_read_are_withdrawn(image_dir: Path, tmp_path: Path):
    """The rows' status and digests are read again after their values: rows made pending (a redo) or holding
    another image since the index was built are computed, the others taken."""
    from extractor.store.reuse import ReuseIndex

    run(parse_spec(job(image_dir, tmp_path / "src.zarr", **SMALL, output={"store": str(tmp_path / "src.zarr"),
                                                                         "chunk_rows": 4})))
    digests = open_store(str(tmp_path / "src.zarr")).digests
    index = ReuseIndex([str(tmp_path / "src.zarr")], None, ["layer1", "fc"])
    group = edited(str(tmp_path / "src.zarr"))
    status, digest = group["status"][:], group["digest"][:]
    status[1], digest[2] = 0, 12345  # row 1 pending again, row 2 another image's
    group["status"][:], group["digest"][:] = status, digest
    assert index.lookup(int(digests[0])) is not None  # its chunk read: rows 0-3 checked after it
    assert index.lookup(int(digests[1])) is None and index.lookup(int(digests[2])) is None
    assert index.lookup(int(digests[3])) is not None
    made_again(str(tmp_path / "src.zarr"))  # replaced
    assert index.lookup(int(digests[4])) is None  # the next chunk read finds another store: nothing more taken
    assert index.lookup(int(digests[0])) is None
