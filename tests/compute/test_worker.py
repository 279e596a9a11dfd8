"""End-to-end extraction on real image files, checked against independent computations."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.images import make_images
from helpers.jobs import RESNET18, job
from helpers.preprocess import reference_batch
from helpers.processes import child_env
from helpers.stores import pending
from PIL import Image

from extractor.driver.runner import run
from extractor.errors import DataError, LayerError, StoreError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec


def test_matches_create_feature_extractor_on_real_jpeg_and_png(image_dir: Path, tmp_path: Path):
    from torchvision.models import resnet18
    from torchvision.models.feature_extraction import create_feature_extractor

    raw = job(image_dir, tmp_path / "s.zarr", model=RESNET18, capture=[  # torchvision's own resnet18
        {"layer": "layer1", "reduce": "none"},
        {"layer": "layer2.1.conv2", "reduce": "max"},
        {"layer": "layer3", "reduce": "mean"},
        {"layer": "layer3", "reduce": "none", "dtype": "float16", "key": "layer3_f16"},
        {"layer": "avgpool", "reduce": "flatten"},
        {"layer": "fc"},
    ])
    summary = run(parse_spec(raw))
    assert summary.ok == 12 and summary.failed == 0
    s = open_store(str(tmp_path / "s.zarr"))
    assert any(p.endswith(".jpg") for p in s.paths) and any(p.endswith(".png") for p in s.paths)

    torch.manual_seed(0)  # extractor seeds random-init models with 0
    model = resnet18().eval()
    assert s.model["parameters"] == sum(p.numel() for p in model.parameters())
    nodes = ["layer1", "layer2.1.conv2", "layer3", "avgpool", "fc"]
    fx = create_feature_extractor(model, return_nodes=nodes)
    with torch.no_grad():
        ref = fx(reference_batch([Path(p) for p in s.paths], 72, 64))
    expected = {
        "layer1": ref["layer1"],
        "layer2.1.conv2": ref["layer2.1.conv2"].amax(dim=(2, 3)),
        "layer3": ref["layer3"].mean(dim=(2, 3)),
        "layer3_f16": ref["layer3"],
        "avgpool": ref["avgpool"].flatten(1),
        "fc": ref["fc"],
    }
    for key, value in expected.items():
        got = s.numpy(key)
        assert got.shape == tuple(value.shape), key
        tol = 2e-3 if key == "layer3_f16" else 1e-4
        np.testing.assert_allclose(got.astype(np.float32), value.numpy(), rtol=tol, atol=tol, err_msg=key)
    assert s["layer3_f16"].dtype == np.float16


def test_batch_and_shard_sizes_do_not_change_results(image_dir: Path, tmp_path: Path):
    a = job(image_dir, tmp_path / "a.zarr", data={"shard_size": 12, "batch_size": 12, "decode_workers": 0},
            output={"store": str(tmp_path / "a.zarr"), "chunk_rows": 4})
    b = job(image_dir, tmp_path / "b.zarr", data={"shard_size": 2, "batch_size": 1},
            output={"store": str(tmp_path / "b.zarr"), "chunk_rows": 1})
    run(parse_spec(a))
    run(parse_spec(b))
    sa, sb = open_store(str(tmp_path / "a.zarr")), open_store(str(tmp_path / "b.zarr"))
    for key in ("layer3", "layer4"):
        np.testing.assert_allclose(sa.numpy(key), sb.numpy(key), rtol=1e-4, atol=1e-4)
    assert list(sa.ids) == list(sb.ids)


def test_the_pipeline_does_not_drain_between_shards(image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each shard's first batch goes to the model before the previous shard's last batch is read
    back, and the results are those of a run with one shard."""
    from extractor.compute import shard as shardio
    from extractor.compute import worker as worker_mod
    from extractor.driver.runner import LocalBackend

    log: list[tuple] = []
    real_add = shardio.ShardOutput.add

    def add(self, offsets, done):
        log.append(("read back", self.shard.index, offsets.tolist()))
        real_add(self, offsets, done)

    class Recording(worker_mod.Worker):
        def forward_rows(self, images, labels, draws=None):
            log.append(("forward", len(images)))
            return super().forward_rows(images, labels, draws)

    monkeypatch.setattr(shardio.ShardOutput, "add", add)
    spec = parse_spec(job(image_dir, tmp_path / "s.zarr"))  # 12 rows, shards of 4, batches of 3: 3 + 1 per shard
    run(spec, backend=LocalBackend(spec, Recording(spec)))
    assert log == [("forward", 3), ("forward", 1), ("read back", 0, [0, 1, 2]),
                   ("forward", 3), ("read back", 0, [3]), ("forward", 1), ("read back", 1, [0, 1, 2]),
                   ("forward", 3), ("read back", 1, [3]), ("forward", 1), ("read back", 2, [0, 1, 2]),
                   ("read back", 2, [3])]
    ref = job(image_dir, tmp_path / "ref.zarr", data={"shard_size": 12})
    run(parse_spec(ref))
    a, b = open_store(str(tmp_path / "s.zarr")), open_store(str(tmp_path / "ref.zarr"))
    assert a.done_shards.all()
    for key in ("layer3", "layer4"):
        np.testing.assert_allclose(a.numpy(key), b.numpy(key), rtol=1e-5, atol=1e-5)


def test_a_queue_fed_pipeline_finishes_each_shard_before_waiting_for_more(image_dir: Path, tmp_path: Path):
    """How a Ray actor runs: shards arrive one by one on an open queue. A shard with nothing queued
    after it is finished (done marker written) while the pipeline waits for more."""
    import threading
    from concurrent.futures import Future

    from extractor.compute.pipeline import ShardQueue
    from extractor.compute.worker import Worker
    from extractor.data.rows import plan

    raw = job(image_dir, tmp_path / "s.zarr")
    run(parse_spec(raw))
    before = open_store(str(tmp_path / "s.zarr"))
    expected = {k: before.numpy(k) for k in ("layer3", "layer4")}
    worker = Worker(parse_spec(raw))
    queue = ShardQueue()
    computed: list[tuple[int, Future]] = []
    ready = threading.Event()

    def on_computed(shard, future):
        computed.append((shard.index, future))
        ready.set()

    ticket = pending(str(tmp_path / "s.zarr"), [0, 1, 2])  # made pending again, for this worker to write
    thread = threading.Thread(target=worker.run_shards, args=(queue, str(tmp_path / "s.zarr")),
                              kwargs={"on_computed": on_computed, "ticket": ticket})
    thread.start()
    try:
        shards = plan(12, 4)
        queue.put(shards[0])
        assert ready.wait(60), "the only queued shard was not finished while the pipeline waited for more"
        assert computed[0][0] == 0 and computed[0][1].result(timeout=60).ok == 4
        assert thread.is_alive()  # still waiting for shards
        queue.put(shards[1])
        queue.put(shards[2])
    finally:
        queue.close()
        thread.join(60)
    worker.close()
    assert not thread.is_alive()
    assert [i for i, _ in computed] == [0, 1, 2] and all(f.result().ok == 4 for _, f in computed)
    after = open_store(str(tmp_path / "s.zarr"))
    for key, value in expected.items():
        np.testing.assert_array_equal(after.numpy(key), value)


def test_interrupted_then_resumed_equals_uninterrupted(image_dir: Path, tmp_path: Path):
    full = job(image_dir, tmp_path / "full.zarr", output={"store": str(tmp_path / "full.zarr"), "chunk_rows": 2})
    run(parse_spec(full))
    raw = job(image_dir, tmp_path / "r.zarr", output={"store": str(tmp_path / "r.zarr"), "chunk_rows": 2})
    def stop_midway(n: int) -> None:
        if n >= 7:  # inside the second of three shards
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(parse_spec(raw), on_progress=stop_midway)
    s = open_store(str(tmp_path / "r.zarr"))
    assert s.attrs["status"] == "interrupted"
    assert s.done_shards.tolist() == [True, False, False]
    assert (s.status[4:] == 0).all()  # pending rows of unfinished shards never look done

    with pytest.raises(StoreError, match="--resume"):
        run(parse_spec(raw))
    raw["output"]["if_exists"] = "resume"
    summary = run(parse_spec(raw))
    assert summary.shards_skipped == 1 and summary.shards_run == 2 and summary.ok == 12
    a, b = open_store(str(tmp_path / "full.zarr")), open_store(str(tmp_path / "r.zarr"))
    assert b.attrs["status"] == "complete"
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))
        # statistics: the interrupted run's shard (kept merged in the store) and the resume's, each once
        np.testing.assert_allclose(b.stats[key]["mean"], a.stats[key]["mean"], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(b.stats[key]["std"], a.stats[key]["std"], rtol=1e-9, atol=1e-12)
        assert [b.stats[key][k] for k in ("rows", "nan", "inf", "min", "max")] == \
            [a.stats[key][k] for k in ("rows", "nan", "inf", "min", "max")]


def test_resume_refuses_a_store_from_a_different_spec(image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "s.zarr")
    run(parse_spec(raw))
    changed = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer3", "reduce": "max"},
                                                          {"layer": "layer4", "reduce": "mean"}],
                  output={"store": str(tmp_path / "s.zarr"), "chunk_rows": 2, "if_exists": "resume"})
    with pytest.raises(StoreError, match=r"capture\[0\]\.reduce: \"none\" in the store, \"max\" now"):
        run(parse_spec(changed))
    fewer = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer3"}],
                output={"store": str(tmp_path / "s.zarr"), "chunk_rows": 2, "if_exists": "resume"})
    with pytest.raises(StoreError) as err:
        run(parse_spec(fewer))
    assert str(err.value).splitlines()[1:-1] == ["  capture[1]: in the store, not in the spec now",
                                                 "  capture layer4: in the store, not in the spec now"]
    # run-only settings may change on resume
    same = job(image_dir, tmp_path / "s.zarr", data={"batch_size": 5},
               output={"store": str(tmp_path / "s.zarr"), "chunk_rows": 2, "if_exists": "resume"})
    assert run(parse_spec(same)).shards_run == 0
    changed["output"]["if_exists"] = "overwrite"
    assert run(parse_spec(changed)).shards_run == 3


def test_never_overwrites_a_folder_it_did_not_create(image_dir: Path, tmp_path: Path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    raw = job(image_dir, precious, output={"store": str(precious), "chunk_rows": 2, "if_exists": "overwrite"})
    with pytest.raises(StoreError, match="not a Zarr store"):
        run(parse_spec(raw))
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_corrupt_files_fail_their_rows_only(tmp_path: Path):
    root = tmp_path / "imgs"
    make_images(root, per_class=3, classes=("a",))
    (root / "a" / "zero.jpg").write_bytes(b"")
    good = (root / "a" / "a00.jpg").read_bytes()
    (root / "a" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "a" / "text.jpg").write_text("this is not an image\n")
    raw = job(root, tmp_path / "s.zarr")
    summary = run(parse_spec(raw))
    assert summary.ok == 3 and summary.failed == 3 and summary.pending == 0
    s = open_store(str(tmp_path / "s.zarr"))
    failed = {str(i): str(e) for i, e, st in zip(s.ids, s.errors, s.status, strict=True) if st == 2}
    assert set(failed) == {"a/zero.jpg", "a/truncated.jpg", "a/text.jpg"}
    assert failed["a/text.jpg"] == "ValueError: not an image format Pillow reads (21 bytes)"  # never its content
    assert failed["a/zero.jpg"] == "ValueError: empty file (0 bytes)"
    assert "truncated" in failed["a/truncated.jpg"].lower()
    # failed rows hold NaN, ok rows real numbers
    allrows = s.numpy("layer4", only_ok=False)
    assert np.isnan(allrows[s.status == 2]).all() and np.isfinite(allrows[s.status == 1]).all()


def test_missing_manifest_file_fails_its_row(image_dir: Path, tmp_path: Path):
    manifest = tmp_path / "m.csv"
    manifest.write_text(f"path,id,label\n{image_dir}/cats/cats00.jpg,x0,3\nmissing.jpg,x1,4\n"
                        f"{image_dir}/dogs/dogs01.png,x2,\n")
    raw = job(image_dir, tmp_path / "s.zarr", data={"source": "manifest", "root": None, "manifest": str(manifest),
                                                    "outside_root": True})  # an absolute path among them
    summary = run(parse_spec(raw))
    assert (summary.ok, summary.failed) == (2, 1)
    s = open_store(str(tmp_path / "s.zarr"))
    assert list(s.ids) == ["x0", "x1", "x2"] and s.labels.tolist() == [3, 4, -1]
    assert "FileNotFoundError" in str(s.errors[1])


@pytest.mark.slow
def test_unreadable_file_fails_its_row(tmp_path: Path):
    """A file without read permission. Root reads anything, so root runs the job without that power."""
    import os
    import shutil
    import subprocess
    import sys

    import yaml

    root = tmp_path / "imgs"
    make_images(root, per_class=2, classes=("a",))
    (root / "a" / "a01.png").chmod(0)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job(root, tmp_path / "s.zarr")))
    cmd = [sys.executable, "-m", "extractor.cli", "run", str(spec), "-q"]
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv to drop the permission-override capabilities")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env())  # the default toy model is in tests/
    assert out.returncode == 0, out.stderr
    assert "1 ok, 1 failed" in out.stdout and "PermissionError" in out.stdout


def test_image_modes_become_rgb(tmp_path: Path):
    from extractor.data.decode import open_rgb

    rgb = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    base = Image.fromarray(rgb)
    cases = {
        "gray.png": base.convert("L"),
        "palette.png": base.convert("P"),
        "rgba.png": base.convert("RGBA"),
        "cmyk.jpg": base.convert("CMYK"),
        "gray16.png": Image.fromarray(np.asarray(base.convert("L"), dtype=np.uint16) * 257),
    }
    for name, img in cases.items():
        img.save(tmp_path / name)
        out = open_rgb(str(tmp_path / name))
        assert out.mode == "RGB" and out.size == (30, 20), name
    gray = np.asarray(base.convert("L"))
    np.testing.assert_array_equal(np.asarray(open_rgb(str(tmp_path / "gray16.png")))[..., 0], gray)
    np.testing.assert_array_equal(np.asarray(open_rgb(str(tmp_path / "gray.png")))[..., 1], gray)


def test_bad_inputs_fail_before_any_work(image_dir: Path, tmp_path: Path):
    store = tmp_path / "s.zarr"
    with pytest.raises(DataError, match="does not exist"):
        run(parse_spec(job(tmp_path / "nope", store)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no images found"):
        run(parse_spec(job(tmp_path / "empty", store)))
    with pytest.raises(LayerError, match="Closest: layer4"):
        run(parse_spec(job(image_dir, store, capture=[{"layer": "layer4."}])))
    assert not store.exists()


def test_dataset_moved_after_run_is_not_resumable(image_dir: Path, tmp_path: Path):
    root = tmp_path / "imgs"
    shutil.copytree(image_dir, root)
    raw = job(root, tmp_path / "s.zarr")
    run(parse_spec(raw))
    (root / "cats" / "cats00.jpg").unlink()
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match="image list differs"):
        run(parse_spec(raw))


def test_a_model_that_refuses_the_crop_size_is_a_model_error_naming_data_crop(image_dir: Path, tmp_path: Path):
    from extractor.compute.worker import Worker
    from extractor.errors import ModelError
    from extractor.model.build import layer_table

    raw = job(image_dir, tmp_path / "s.zarr", model={"name": "vit_b_16", "weights": None, "device": "cpu"},
              capture=[{"layer": "encoder.ln", "reduce": "cls"}])  # crop 64: ViT-B/16 takes 224 only
    worker = Worker(parse_spec(raw))
    with pytest.raises(ModelError, match=r"failed on a blank 64x64 image \(data.crop\), before any image was read: "
                                         r"AssertionError: Wrong image height.*set data.crop"):
        worker.probe()
    with pytest.raises(ModelError, match=r"cannot run on a 64x64 input.*--input-size"):
        layer_table(worker.model, 64)  # `extractor layers vit_b_16 --input-size 64`


def test_resume_differences_name_each_change_once():
    from extractor.store.provenance import differences

    assert differences({"a": {"b": 1}}, {"a": 2}) == ['a: "(unset)" in the store, 2 now',
                                                     'a.b: 1 in the store, "(unset)" now']
    assert differences({"m": {"kw": {}}}, {"m": {"kw": {"depth": 3}}}) == [
        'm.kw: {} in the store, "(unset)" now', 'm.kw.depth: "(unset)" in the store, 3 now']
    assert differences({"capture": [{"layer": "a"}, {"layer": "b", "reduce": "mean"}]},
                       {"capture": [{"layer": "a"}, {"layer": "c"}, {"layer": "d"}]}) == [
        'capture[1].layer: "b" in the store, "c" now',
        'capture[1].reduce: "mean" in the store, "(unset)" now',
        "capture[2]: in the spec now, not in the store"]


def test_the_driver_lets_the_rows_go_once_the_store_holds_them(image_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    """Issue 29: the row list (0.3-0.9 GB per million rows) is not held while the shards run: workers read
    their rows from the store."""
    import gc
    import weakref

    from extractor.driver import runner

    listed = []
    real = runner._list

    def listing(spec, backend):
        rows = real(spec, backend)
        listed.append(weakref.ref(rows))
        return rows

    monkeypatch.setattr(runner, "_list", listing)
    alive = []

    def on_event(name: str, info: dict) -> None:
        if name == "shard_done":
            gc.collect()
            alive.append(listed[0]() is not None)

    assert run(parse_spec(job(image_dir, tmp_path / "s.zarr")), on_event=on_event).ok == 12
    assert alive == [False, False, False]


def test_an_interrupt_during_a_resumes_start_leaves_the_store_saying_interrupted(image_dir: Path, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch):
    """Ctrl-C while a resume starts: while it lists the images (the store untouched, as the run before left
    it), or once it has taken the store (status running: marked interrupted); the next resume finishes."""
    from extractor.store import session

    raw = job(image_dir, tmp_path / "s.zarr", output={"store": str(tmp_path / "s.zarr"), "chunk_rows": 2})

    def stop_midway(n: int) -> None:
        if n >= 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(parse_spec(raw), on_progress=stop_midway)
    raw["output"]["if_exists"] = "resume"
    # while it reads its source (its rows taken from the store: the folder is as listed); once the store is taken
    # (its done shards read)
    for module, name in ((session, "reuse"), (session, "done_shards")):
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        with monkeypatch.context() as m:
            m.setattr(module, name, interrupted)
            with pytest.raises(KeyboardInterrupt):
                run(parse_spec(raw))
        s = open_store(str(tmp_path / "s.zarr"))
        assert s.attrs["status"] == "interrupted" and s.attrs.get("error", "").startswith("KeyboardInterrupt")
    summary = run(parse_spec(raw))
    assert summary.ok == 12 and open_store(str(tmp_path / "s.zarr")).attrs["status"] == "complete"


def test_the_driver_keeps_no_shards_statistics_once_merged_and_counts_its_workers_as_events_come(image_dir: Path,
                                                                                                 tmp_path: Path):
    """Each shard's statistics record reaches the driver with its summary and is merged as it comes; the run's
    summary keeps each shard's summary without it (up to 800 KB a shard: at 390,000 shards, hundreds of GB), and the
    store's statistics are those records merged. The worker table is counted from the events (not a log of them)."""
    from extractor.store.stats import merge

    records: list[str] = []
    toy = {"name": None, "factory": "toy_models:slow_net", "factory_kwargs": {"seconds": 0}, "device": "cpu"}
    raw = job(image_dir, tmp_path / "s.zarr", model=toy, capture=[{"layer": "conv", "reduce": "mean"}],
              data={"shard_size": 4, "resize": None, "crop": 32})
    summary = run(parse_spec(raw), on_event=lambda name, info: records.append(info["summary"].stats)
                  if name == "shard_done" else None)
    assert len(records) == 3 and all(records)  # 12 images, shards of 4: each with its record
    assert [s.stats for s in summary.per_shard] == ["", "", ""] and sorted(s.shard for s in summary.per_shard) == \
        [0, 1, 2]
    stored, merged = open_store(str(tmp_path / "s.zarr")).attrs["stats"]["conv"], merge(records)["conv"]
    np.testing.assert_allclose(stored["mean"], merged["mean"])
    np.testing.assert_allclose(stored["std"], merged["std"])
    assert stored["rows"] == merged["rows"] == 12
    assert [(w["worker"], w["shards"], w["images"]) for w in summary.workers] == [(0, 3, 12)]
