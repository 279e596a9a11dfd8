"""Failure injection: bad images, bad batches, signals, concurrent jobs, storage errors, bad specs."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import warm
import yaml
import zarr
from helpers.images import make_images
from helpers.interrupts import interrupted_after
from helpers.jobs import job
from helpers.processes import child_env, stopped_outside_a_swap
from helpers.stores import committed, generation, pending, root_attrs, wait_dead
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from extractor.compute.worker import PROBE_FORWARDS
from extractor.data.listing import list_rows
from extractor.driver.runner import run
from extractor.errors import DeviceError, ShardError, SpecError, StoreError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec
from extractor.store.writer import ShardWriter

TESTS = Path(__file__).resolve().parents[1]


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height pixels (a decompression bomb's header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0\0\0\0")) + \
        chunk(b"IEND", b"")


def test_odd_images(tmp_path: Path):
    root = tmp_path / "imgs"
    make_images(root, per_class=2, classes=("a",), size=40)
    a = root / "a"
    (a / "a01.png").rename(a / "disguised.jpg")  # a PNG named .jpg: decoded by content
    (a / "bomb.png").write_bytes(png_claiming(100_000, 100_000))
    red, blue = Image.new("RGB", (40, 40), (200, 0, 0)), Image.new("RGB", (40, 40), (0, 0, 200))
    red.save(a / "anim.gif", save_all=True, append_images=[blue], duration=100, loop=0)
    red.save(a / "red.png")
    wide = np.zeros((20, 40, 3), np.uint8)
    wide[:, :20] = 255  # left half white
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    Image.fromarray(wide).save(a / "rotated.jpg", exif=exif, quality=95)
    Image.fromarray(wide).save(a / "plain.png")
    weird = os.fsencode(str(a)) + b"/caf\xe9.png"  # a Latin-1 file name: not valid UTF-8
    with open(weird, "wb") as f:
        red.save(f, format="PNG")
    raw = job(root, tmp_path / "s.zarr", data={"resize": None, "crop": 20, "max_image_pixels": 10_000_000},
              capture=[{"layer": "conv1", "key": "c"}], model={"name": "resnet18", "channels_last": False,
                                                              "device": "cpu", "weights": None})
    summary = run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    by_id = {str(i): (int(st_), str(e)) for i, st_, e in zip(s.ids, s.status, s.errors, strict=True)}
    assert by_id["a/bomb.png"][0] == 2 and "100000x100000" in by_id["a/bomb.png"][1]
    assert "max_image_pixels" in by_id["a/bomb.png"][1]
    assert by_id["a/disguised.jpg"][0] == 1 and by_id["a/anim.gif"][0] == 1
    assert by_id["a/caf\\xe9.png"][0] == 1  # undecodable bytes shown as \\xNN in the id
    assert summary.failed == 1
    c = {str(i): v for i, v in zip(s.ids, s.numpy("c", only_ok=False), strict=True)}
    np.testing.assert_array_equal(c["a/anim.gif"], c["a/red.png"])  # the first frame
    np.testing.assert_array_equal(c["a/caf\\xe9.png"], c["a/red.png"])
    # EXIF orientation applied: the 40x20 image stands up as 20x40, so a 20x20 crop of it differs
    # from the crop of the same pixels without the tag
    assert not np.array_equal(c["a/rotated.jpg"], c["a/plain.png"])
    from extractor.data.decode import open_rgb

    assert open_rgb(str(a / "rotated.jpg")).size == (20, 40)


def test_symlink_loops_do_not_hang_listing(tmp_path: Path):
    root = tmp_path / "imgs"
    make_images(root, per_class=2, classes=("a",), size=40)
    os.symlink(root / "a", root / "a" / "loop")  # a/loop -> a
    os.symlink(root, root / "a" / "up")  # a/up -> root
    rows = list_rows(parse_spec(job(root, tmp_path / "s.zarr")).data)
    assert list(rows.ids) == ["a/a00.jpg", "a/a01.png"]


def dark_images(root: Path, n: int) -> None:
    make_images(root, per_class=n, classes=("a",), size=40)
    for p in (root / "a").iterdir():
        Image.fromarray((np.asarray(Image.open(p).convert("RGB")) // 3).astype(np.uint8)).save(p)


def picky_job(root: Path, store: Path, **data) -> dict:
    return job(root, store, model={"name": None, "factory": "toy_models:picky_net", "device": "cpu"},
               data={"resize": None, "crop": 32, "shard_size": 4, "batch_size": 4, **data},
               capture=[{"layer": "conv", "reduce": "mean"}], output={"store": str(store), "chunk_rows": 2})


def test_a_batch_that_raises_on_one_image_fails_only_that_row(tmp_path: Path):
    root = tmp_path / "imgs"
    dark_images(root, 4)
    Image.new("RGB", (40, 40), (255, 255, 255)).save(root / "a" / "a01.png")  # PickyNet raises on it
    summary = run(parse_spec(picky_job(root, tmp_path / "s.zarr")))
    assert (summary.ok, summary.failed) == (3, 1)
    s = open_store(str(tmp_path / "s.zarr"))
    assert "forward failed on this image: ValueError: PickyNet" in str(s.errors[1])
    ref = tmp_path / "ref.zarr"
    run(parse_spec(picky_job(root, ref, batch_size=1)))  # one image per batch: no retry needed
    np.testing.assert_array_equal(s.numpy("conv"), open_store(str(ref)).numpy("conv"))


def test_a_batch_where_every_image_raises_fails_the_shard(tmp_path: Path):
    root = tmp_path / "imgs"
    dark_images(root, 4)
    for p in (root / "a").iterdir():
        Image.new("RGB", (40, 40), (255, 255, 255)).save(p)
    with pytest.raises(ShardError, match=r"shard 0 \(rows 0-3\) failed: ValueError: PickyNet"):
        run(parse_spec(picky_job(root, tmp_path / "s.zarr")))


def test_a_failing_shard_keeps_what_the_shard_before_it_computed(tmp_path: Path):
    """The pipeline runs across shard boundaries: shard 0's last batch is still on its way to
    the host when shard 1's first batch raises. It is written, and shard 0 is done."""
    root = tmp_path / "imgs"
    dark_images(root, 8)
    ref = tmp_path / "ref.zarr"
    run(parse_spec(picky_job(root, ref, batch_size=3)))
    for p in sorted((root / "a").iterdir())[4:]:
        Image.new("RGB", (40, 40), (255, 255, 255)).save(p)
    store = tmp_path / "s.zarr"
    with pytest.raises(ShardError, match=r"shard 1 \(rows 4-7\) failed: ValueError: PickyNet"):
        run(parse_spec(picky_job(root, store, batch_size=3)))  # shard 0's batches: rows 0-2, then row 3 alone
    s = open_store(str(store))
    assert s.done_shards.tolist() == [True, False]
    assert s.status.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    np.testing.assert_array_equal(s.numpy("conv")[:4], open_store(str(ref)).numpy("conv")[:4])


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_device_fault_stops_the_job_and_resume_finishes(tmp_path: Path, batch_size: int):
    """What a CUDA fault raises (torch.AcceleratorError) is not an image's fault, even in a batch of
    one, and not retried on a context that may be broken: the job stops naming the device; the
    shards before it are kept and --resume finishes."""
    root = tmp_path / "imgs"
    dark_images(root, 8)
    ref = tmp_path / "ref.zarr"
    run(parse_spec(picky_job(root, ref, batch_size=batch_size)))
    raw = picky_job(root, tmp_path / "s.zarr", batch_size=batch_size)
    forwards = PROBE_FORWARDS + -(-4 // batch_size)  # the probe's, then shard 0's: the fault in shard 1's first batch
    raw["model"].update(factory="toy_models:faulty_device",
                        factory_kwargs={"marker": str(tmp_path / "fault"), "after": forwards, "seconds": 0})
    with pytest.raises(DeviceError, match=r"cpu device failed while shard 1 was running: AcceleratorError: "
                                          r"CUDA error: an illegal memory access.*--resume"):
        run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.done_shards.tolist() == [True, False] and s.attrs["status"] == "failed"
    assert (s.status[4:] == 0).all()  # no row blamed
    raw["output"]["if_exists"] = "resume"
    summary = run(parse_spec(raw))
    assert summary.shards_run == 1 and summary.failed == 0
    r = open_store(str(ref))
    for key in ("conv",):
        np.testing.assert_allclose(open_store(str(tmp_path / "s.zarr")).numpy(key), r.numpy(key), rtol=1e-6)


def test_an_error_in_a_callers_callback_goes_up_unchanged(tmp_path: Path):
    root = tmp_path / "imgs"
    dark_images(root, 12)

    def on_event(name: str, info: dict) -> None:
        if name == "shard_done" and info["shard"] == 0:
            raise ValueError("callback bug")

    with pytest.raises(ValueError, match=r"^callback bug$"):  # not a ShardError blaming a later shard
        run(parse_spec(picky_job(root, tmp_path / "s.zarr", batch_size=3)), on_event=on_event)
    assert open_store(str(tmp_path / "s.zarr")).done_shards[0]


def test_a_shard_interrupted_by_the_failure_of_the_one_before_goes_back_to_the_queue(
        image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Shard 0's last batch is read back during shard 1's first batch; a write error of shard 0
    surfacing there fails shard 0 only, and shard 1 returns to the queue (a Ray actor's
    pipeline then runs it: its caller must not wait forever)."""
    from extractor._machine import Machine
    from extractor.compute import pipeline as pipeline
    from extractor.compute import worker as worker_mod
    from extractor.data.rows import plan

    raw = job(image_dir, tmp_path / "s.zarr", output={"store": str(tmp_path / "s.zarr"), "chunk_rows": 1})
    run(parse_spec(raw))  # creates the store
    monkeypatch.setattr(Machine, "write_queue", lambda self, chunk_bytes: 0)  # each chunk's write waited for at once
    real_write = ShardWriter.write

    def write(self, offset, chunks):
        if self.index == 0 and offset == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, offset, chunks)

    monkeypatch.setattr(ShardWriter, "write", write)
    worker = worker_mod.Worker(parse_spec(raw))
    queue = pipeline.ShardQueue(plan(12, 4)[:2])  # open, as an actor's
    computed: list[int] = []
    ticket = pending(str(tmp_path / "s.zarr"), [0, 1])
    with pytest.raises(ShardError, match="No space left") as err:
        worker.run_shards(queue, str(tmp_path / "s.zarr"), on_computed=lambda shard, f: computed.append(shard.index),
                          ticket=ticket)
    worker.close()
    assert err.value.shard == 0 and computed == []
    assert list(queue.items) == [plan(12, 4)[1]]


def test_storage_error_fails_the_job_and_resume_completes(image_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    run(parse_spec(job(image_dir, tmp_path / "ref.zarr")))
    real_write = ShardWriter.write

    def failing_write(self, offset, chunks):
        if self.index == 1 and offset == 2:  # inside the second shard
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, offset, chunks)

    monkeypatch.setattr(ShardWriter, "write", failing_write)
    raw = job(image_dir, tmp_path / "s.zarr")
    with pytest.raises(ShardError, match="No space left on device"):
        run(parse_spec(raw))
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.attrs["status"] == "failed" and "No space left" in s.attrs["error"]
    done = s.done_shards.tolist()
    # the shard before is durable; the one after may be too (it computes while the failing one is stored)
    assert done[:2] == [True, False]
    monkeypatch.setattr(ShardWriter, "write", real_write)  # space freed
    raw["output"]["if_exists"] = "resume"
    assert run(parse_spec(raw)).shards_run == 3 - sum(done)
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(open_store(str(tmp_path / "s.zarr")).numpy(key),
                                      open_store(str(tmp_path / "ref.zarr")).numpy(key))


def test_store_of_another_format_version_is_refused(image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "s.zarr")
    run(parse_spec(raw))
    root_attrs(str(tmp_path / "s.zarr"), format_version=99)
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match="format version 99 in the store, 2 now"):
        run(parse_spec(raw))


def test_a_store_of_format_1_is_read_refused_for_resume_and_made_again_by_overwrite(image_dir: Path,
                                                                                      tmp_path: Path):
    """A store of the first format (its arrays at its root, before December 2026): read as it is; a resume is
    refused in one line; --overwrite makes it again (its arrays removed) as a store of format 2."""

    url = str(tmp_path / "s.zarr")
    old = zarr.open_group(url, mode="w")
    old.attrs["extractor"] = {"format_version": 1, "status": "complete", "n_rows": 2, "n_shards": 1, "captures": {},
                              "spec": {}, "model": {}, "created": "2026-11-01T00:00:00+00:00"}
    old.create_array("ids", shape=(2,), dtype=str, chunks=(2,))[:] = ["a", "b"]
    old.create_array("status", shape=(2,), dtype="uint8", chunks=(2,))[:] = [1, 1]
    assert open_store(url).ids.tolist() == ["a", "b"] and open_store(url).attrs["format_version"] == 1
    raw = job(image_dir, tmp_path / "s.zarr", output={"store": url, "chunk_rows": 2, "if_exists": "resume"})
    with pytest.raises(StoreError, match=r"made by an older extractor \(format 1, now 2\).*--overwrite makes it"):
        run(parse_spec(raw))
    raw["output"]["if_exists"] = "overwrite"
    assert run(parse_spec(raw)).ok == 12
    s = open_store(url)
    assert s.attrs["format_version"] == 2 and len(s) == 12
    assert sorted(p.name for p in (tmp_path / "s.zarr").iterdir()) == sorted(["zarr.json", "__lock",
                                                                              s.attrs["generation"]])


def slow_spec(root: Path, store: Path, tmp_path: Path, seconds: float = 0.15, **output) -> Path:
    raw = job(root, store, model={"name": None, "factory": "toy_models:slow_net", "device": "cpu",
                                  "factory_kwargs": {"seconds": seconds}},
              data={"resize": None, "crop": 32, "shard_size": 2, "batch_size": 1, "decode_workers": 1},
              capture=[{"layer": "conv", "reduce": "mean"}],
              output={"store": str(store), "chunk_rows": 1, **output})
    path = tmp_path / f"job-{len(list(tmp_path.glob('job-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def start(spec: Path, *args: str) -> subprocess.Popen:
    env = child_env()
    return warm.Popen([sys.executable, "-m", "extractor.cli", "run", str(spec), "-q", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_shard(store: Path, shard: int, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not committed(store, shard) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert committed(store, shard), proc.stderr.read() if proc.poll() is not None else "timeout"


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_resume_finishes(tmp_path: Path):
    root = tmp_path / "imgs"
    make_images(root, per_class=8, classes=("a",), size=40)
    store = tmp_path / "s.zarr"
    spec = slow_spec(root, store, tmp_path)
    proc = start(spec)
    wait_for_shard(store, 0, proc)
    proc.send_signal(signal.SIGTERM)  # what a cluster scheduler sends on pre-emption
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "--resume" in err, err
    s = open_store(str(store))
    assert s.attrs["status"] == "interrupted" and not s.done_shards.all()
    proc = start(spec, "--resume")
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert (open_store(str(store)).status == 1).all()


@pytest.mark.slow
def test_second_job_on_the_same_store_is_refused_until_the_first_is_gone(tmp_path: Path):
    """The first job is held at its first image (toy_models.GatedNet) until it is killed: however slow the
    machine, it is still running while the second and third jobs are refused."""
    root = tmp_path / "imgs"
    make_images(root, per_class=30, classes=("a",), size=40)
    store = tmp_path / "s.zarr"
    spec = slow_spec(root, store, tmp_path, lease_timeout_s=10)
    raw = yaml.safe_load(spec.read_text())
    gate, held = tmp_path / "gate", tmp_path / "held"
    gate.touch()
    raw["model"].update(factory="toy_models:gated_net", factory_kwargs={"gate": str(gate), "marker": str(held)})
    spec.write_text(yaml.safe_dump(raw))
    first = start(spec)
    wait_for_file(held, first)
    second = start(spec, "--resume")
    _, err = second.communicate(timeout=120)
    assert second.returncode == 1
    assert f"in use by another extractor job: pid {first.pid} on {os.uname().nodename}" in err
    third = start(spec, "--overwrite")
    _, err = third.communicate(timeout=120)
    assert third.returncode == 1 and "in use by another extractor job" in err
    assert first.poll() is None  # still running: the refusals above were about a live job
    first.kill()  # the first job dies without a word; on this host its pid is seen to be gone
    first.wait()
    gate.unlink()
    resumed = start(spec, "--resume")
    _out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    s = open_store(str(store))
    assert (s.status == 1).all() and [c["ended"]["status"] for c in s.claimants() if c.get("ended")] == ["complete"]


def test_a_claimant_on_another_host_is_taken_for_dead_after_its_timeout(image_dir: Path, tmp_path: Path):
    """A process of another host that writes the store (its record renewed): a job is refused, naming it; once its
    record is silent for its timeout, it counts as dead and the job goes on."""
    raw = job(image_dir, tmp_path / "s.zarr")
    run(parse_spec(raw))
    url = str(tmp_path / "s.zarr")
    other = {"id": "00000000000000aa", "host": "node-7", "pid": 4242, "user": "ana", "started": "then",
             "heartbeat": time.time(), "timeout_s": 30}
    gen = generation(url)
    gen.objects.put(f"{gen.claimants_prefix}/{other['id']}", json.dumps(other).encode())
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=r"in use by another extractor job: pid 4242 on node-7 \(user ana"):
        run(parse_spec(raw))
    other["heartbeat"] = time.time() - 31  # silent for longer than its timeout: dead
    gen.objects.put(f"{gen.claimants_prefix}/{other['id']}", json.dumps(other).encode())
    assert run(parse_spec(raw)).shards_run == 0


_SECTIONS = ["model", "data", "capture", "output", "cluster", "submit"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=5),
                    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                          max_size=2))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(section=st.sampled_from(_SECTIONS), key=st.text(min_size=1, max_size=12), value=_VALUES,
       known=st.booleans())
def test_random_invalid_specs_raise_spec_errors_naming_a_field(section: str, key: str, value, known: bool):
    base = {"data": {"root": "images"}, "capture": [{"layer": "layer3"}]}
    from extractor.spec.schema import JobSpec

    if section == "capture":
        fields = list(JobSpec.model_fields["capture"].annotation.__args__[0].model_fields)
        name = fields[hash(key) % len(fields)] if known else key
        raw = {**base, "capture": [{"layer": "layer3", name: value}]}
        where = f"capture[0].{name}" if name != "layer" else "capture[0]"
    else:
        model = JobSpec.model_fields[section].annotation
        fields = list(model.model_fields)
        name = fields[hash(key) % len(fields)] if known else key
        raw = {**base, section: {**base.get(section, {}), name: value}}
        where = section
    try:
        parse_spec(raw)
    except SpecError as err:
        assert where.split(".")[0].split("[")[0] in str(err)  # noqa: PT017 - any input: SpecError or nothing
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"{type(err).__name__} instead of SpecError for {raw}: {err}")


def test_a_storage_that_dies_mid_job_is_one_line_with_the_resume_command(
        image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """issue 17, defect 6: a full disk made the runner's own "failed" mark raise too, masking the first
    error: a raw traceback, the store left "running", no resume hint."""
    from extractor.cli import main
    from extractor.store.claimants import Claimant

    real_write, real_record = ShardWriter.write, Claimant._write

    def failing_write(self, offset, chunks):
        if self.index == 1 and offset == 2:  # inside the second shard
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, offset, chunks)

    def failing_record(self):
        if (self.record.get("ended") or {}).get("status") == "failed":  # the job's own word of how it ended
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_record(self)

    monkeypatch.setattr(ShardWriter, "write", failing_write)
    monkeypatch.setattr(Claimant, "_write", failing_record)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job(image_dir, tmp_path / "s.zarr")))
    assert main(["run", str(spec), "-q"]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Traceback" not in err and "--resume" in err
    monkeypatch.undo()
    assert main(["run", str(spec), "-q", "--resume"]) == 0
    assert open_store(str(tmp_path / "s.zarr")).attrs["status"] == "complete"


@pytest.mark.slow
def test_a_job_paused_past_its_lease_writes_nothing_into_the_store_that_took_it_over(tmp_path: Path):
    """issue 17, defect 1 (data lost): job A is paused (SIGSTOP) past output.lease_timeout_s; job B takes
    the store with --overwrite and another spec and completes; A resumes. A must stop, writing nothing:
    B's store stays B's, bit for bit as a clean run of B's spec."""
    root = tmp_path / "imgs"
    make_images(root, per_class=8, classes=("a",), size=40)
    store = tmp_path / "s.zarr"
    spec_a = slow_spec(root, store, tmp_path, lease_timeout_s=2)
    raw_a = yaml.safe_load(spec_a.read_text())
    proc = start(spec_a)
    wait_for_shard(store, 0, proc)
    stopped_outside_a_swap(proc, store)  # SLURM suspend, a frozen VM, a long storage stall
    try:
        wait_dead(str(store))
        raw_b = {**raw_a, "capture": [{"layer": "conv", "reduce": "max", "key": "conv"}],  # A's key, B's values
                 "model": {**raw_a["model"], "factory_kwargs": {"seconds": 0}}}
        raw_b["output"] = {**raw_a["output"], "if_exists": "overwrite"}
        assert run(parse_spec(raw_b)).ok == 8
        clean = {**raw_b, "output": {**raw_b["output"], "store": str(tmp_path / "clean.zarr")}}
        run(parse_spec(clean))
    finally:
        proc.send_signal(signal.SIGCONT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "made again by another job" in err, err
    s, c = open_store(str(store)), open_store(str(tmp_path / "clean.zarr"))
    assert s.attrs["status"] == "complete" and list(s.captures) == ["conv"] and s.done_shards.all()
    np.testing.assert_array_equal(s.numpy("conv"), c.numpy("conv"))  # not one of A's means among B's maxima
    assert s.attrs["spec"]["capture"] == c.attrs["spec"]["capture"]


def test_a_relative_data_root_resumed_from_another_folder_is_refused_naming_both_places(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """issue 17, defect 3: the first run listed ``imgs`` under folder A; the images then moved to
    folder B and the job was resumed from there: the listing matched (same ids), so resume read
    the store's old paths, failed every pending row and said complete, exit 0. Now resume compares
    where the images are read from; the same place spelt as an absolute path is the same job."""
    a, b = tmp_path / "A", tmp_path / "B"
    make_images(a / "imgs", per_class=2)
    b.mkdir()
    raw = job(Path("imgs"), tmp_path / "s.zarr", cluster={"backend": "local"}, data={"shard_size": 2})
    monkeypatch.chdir(a)
    run(parse_spec(raw))
    pending(str(tmp_path / "s.zarr"), [1])  # as if interrupted after the first shard
    (a / "imgs").rename(b / "imgs")
    monkeypatch.chdir(b)
    resume = {**raw, "output": {**raw["output"], "if_exists": "resume"}}
    with pytest.raises(StoreError, match=r"images would be read from another place: row 0's image: '.*/A/imgs/.*' "
                                         r"in the store, '.*/B/imgs/.*' now.*run it from the folder of its first"):
        run(parse_spec(resume))
    (b / "imgs").rename(a / "imgs")
    summary = run(parse_spec({**resume, "data": {**resume["data"], "root": str(a / "imgs")}}))
    assert summary.ok == 4 and summary.shards_skipped == 1 and summary.failed == 0


def paused_job(root: Path, store: Path, tmp_path: Path, point: str, **output) -> Path:
    """A slow job that stops at ``point`` (see toy_models.paused_at) until the file tmp_path/gate goes."""
    (tmp_path / "gate").touch()
    raw = yaml.safe_load(slow_spec(root, store, tmp_path, **output).read_text())
    raw["model"].update(factory="toy_models:paused_at", factory_kwargs={
        "point": point, "gate": str(tmp_path / "gate"), "marker": str(tmp_path / "marker"), "seconds": 0.15})
    path = tmp_path / "paused.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def wait_for_file(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not path.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert path.exists(), proc.stderr.read() if proc.poll() is not None else "timeout"


@pytest.mark.slow
def test_a_job_that_looked_before_another_created_the_store_refuses_instead_of_wiping_it(tmp_path: Path):
    """issue 26, defect 1 (data lost, T3-11): job A found no store and paused (a slow compile, a frozen VM);
    job B created the store and ran shards; A woke. A decides again at the moment it would create: it
    refuses, naming B, and B finishes a store equal to a clean run (before: A wiped B's store, B died
    fenced)."""
    root = tmp_path / "imgs"
    make_images(root, per_class=8, classes=("a",), size=40)
    store = tmp_path / "s.zarr"
    a = start(paused_job(root, store, tmp_path, "claim"))
    wait_for_file(tmp_path / "marker", a)  # A has looked: nothing there
    spec_b = slow_spec(root, store, tmp_path)
    b = start(spec_b)
    wait_for_shard(store, 0, b)
    (tmp_path / "gate").unlink()
    _, err_a = a.communicate(timeout=120)
    said = f"was created by another job after this one looked at it (by another extractor job: pid {b.pid}"
    assert a.returncode == 1 and said in err_a, err_a
    assert "Traceback" not in err_a
    _, err_b = b.communicate(timeout=300)
    assert b.returncode == 0, err_b
    clean = yaml.safe_load(spec_b.read_text())
    clean["output"]["store"] = str(tmp_path / "clean.zarr")
    run(parse_spec(clean))
    s, c = open_store(str(store)), open_store(str(tmp_path / "clean.zarr"))
    assert s.attrs["status"] == "complete" and s.done_shards.all()
    np.testing.assert_array_equal(s.numpy("conv"), c.numpy("conv"))


def test_a_store_created_and_finished_meanwhile_is_named_not_wiped(image_dir: Path, tmp_path: Path):
    """The same, when B created and finished the store while A was paused at its estimate line."""
    raw = job(image_dir, tmp_path / "s.zarr")
    other = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer2", "reduce": "mean"}])
    with pytest.raises(StoreError, match=r"store .*s.zarr was created by another job after this one looked at it; "
                                         r"run again \(--resume finishes it\)"):
        run(parse_spec(raw), on_start=lambda total, per_row: run(parse_spec(other)))
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.attrs["status"] == "complete" and list(s.captures) == ["layer2"] and (s.status == 1).all()


@pytest.mark.slow
def test_a_job_paused_while_creating_its_store_stops_in_one_line_when_another_replaced_it(tmp_path: Path):
    """issue 26, defect 1: A paused mid-creation (its root and lease written) past its lease; B replaced the
    store (--overwrite) and finished; A wakes: one line, nothing written (before: a raw ContainsArrayError
    traceback); B's store equals a clean run."""
    root = tmp_path / "imgs"
    make_images(root, per_class=8, classes=("a",), size=40)
    store = tmp_path / "s.zarr"
    a = start(paused_job(root, store, tmp_path, "arrays", lease_timeout_s=1))
    wait_for_file(tmp_path / "marker", a)
    a.send_signal(signal.SIGSTOP)
    try:
        wait_dead(str(store))
        (tmp_path / "gate").unlink()
        raw_b = yaml.safe_load(slow_spec(root, store, tmp_path, seconds=0).read_text())
        raw_b["capture"] = [{"layer": "conv", "reduce": "max", "key": "conv"}]
        raw_b["output"]["if_exists"] = "overwrite"
        assert run(parse_spec(raw_b)).ok == 8
    finally:
        a.send_signal(signal.SIGCONT)
    _, err = a.communicate(timeout=120)
    assert a.returncode == 1 and "was made again by another job (--overwrite) while this one wrote into it" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    clean = {**raw_b, "output": {**raw_b["output"], "store": str(tmp_path / "clean.zarr")}}
    run(parse_spec(clean))
    s, c = open_store(str(store)), open_store(str(tmp_path / "clean.zarr"))
    assert s.attrs["status"] == "complete" and s.done_shards.all()
    np.testing.assert_array_equal(s.numpy("conv"), c.numpy("conv"))


def test_overwrite_leaves_the_old_store_untouched_until_the_job_has_proven_it_can_run(image_dir: Path,
                                                                                       tmp_path: Path):
    """issue 25, item 10: the estimate is printed before an existing store is replaced; an interrupt there (a
    SIGTERM at that line) leaves the old store whole (before: 126 of 496 ok rows were left)."""
    raw = job(image_dir, tmp_path / "s.zarr")
    run(parse_spec(raw))
    before = open_store(str(tmp_path / "s.zarr")).numpy("layer4")
    raw["output"]["if_exists"] = "overwrite"
    raw["capture"] = [{"layer": "layer2", "reduce": "mean"}]

    def at_estimate(total: int, per_row: dict) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(parse_spec(raw), on_start=at_estimate)
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.attrs["status"] == "complete" and (s.status == 1).all() and "layer4" in s.captures
    np.testing.assert_array_equal(s.numpy("layer4"), before)


@pytest.mark.parametrize("mode", ["create", "resume"])
def test_an_interrupt_before_the_first_shard_marks_the_store_interrupted(image_dir: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch, mode: str):
    """issue 25 item 12, issue 26 defect 12: a store just created, or resumed and marked running, that is
    interrupted before its shards start says interrupted (before: running)."""
    import extractor.driver.runner as runner

    raw = job(image_dir, tmp_path / "s.zarr")
    if mode == "resume":
        with pytest.raises(KeyboardInterrupt):
            run(parse_spec(raw), on_event=lambda n, i: (_ for _ in ()).throw(KeyboardInterrupt)
                if n == "shard_done" else None)
        raw["output"]["if_exists"] = "resume"

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_compute", interrupted)  # the signal lands before the first shard starts
    with pytest.raises(KeyboardInterrupt):
        run(parse_spec(raw))
    assert open_store(str(tmp_path / "s.zarr")).attrs["status"] == "interrupted"


def test_resuming_a_complete_store_writes_nothing(image_dir: Path, tmp_path: Path):
    """issue 26, defect 10: nothing to do is exit 0 without a write (a read-only file system, a read-only
    bucket): not the lease, not the status."""
    raw = job(image_dir, tmp_path / "s.zarr")
    run(parse_spec(raw))
    raw["output"]["if_exists"] = "resume"

    def snapshot() -> dict:
        return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (tmp_path / "s.zarr").rglob("*") if p.is_file()}

    before = snapshot()
    summary = run(parse_spec(raw))
    assert summary.shards_run == 0 and summary.ok == 12 and summary.shards_skipped == 3
    assert snapshot() == before


@pytest.mark.slow
def test_a_claimant_ends_after_a_slow_renewal_without_a_thread_error(image_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """issue 26, defect 6: a job that ends while its renewal writes to a slow storage: the renewing thread must not
    crash, and no renewal lands after the record that says it ended."""
    import threading

    from extractor.store import Objects
    from extractor.store.claimants import Claimant

    run(parse_spec(job(image_dir, tmp_path / "s.zarr")))
    gen = generation(str(tmp_path / "s.zarr"))
    claimant = Claimant(Objects.at(str(tmp_path / "s.zarr")), gen.claimants_prefix, 0.2, {"pid": os.getpid()})
    writing, slow = threading.Event(), threading.Event()
    real = claimant._write

    def slow_write() -> None:
        if not claimant.record.get("ended"):  # a renewal: slow
            writing.set()
            slow.wait(5)
        real()

    errors: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    claimant._write = slow_write  # type: ignore[method-assign]
    claimant.start()
    assert writing.wait(10)  # a renewal is in flight
    ending = threading.Thread(target=claimant.end, args=("complete",))
    ending.start()
    slow.set()
    ending.join(10)
    mine = [c for c in gen.roster.all() if c["id"] == claimant.record["id"]]
    assert not errors and mine and mine[0]["ended"]["status"] == "complete"


@pytest.mark.slow
def test_a_second_ctrl_c_while_stopping_exits_130(tmp_path: Path):
    """issue 26, defect 9: a second Ctrl-C within a second of the first killed the process (exit -2)."""
    root = tmp_path / "imgs"
    make_images(root, per_class=8, classes=("a",), size=40)
    store = tmp_path / "s.zarr"
    proc = start(slow_spec(root, store, tmp_path))
    wait_for_shard(store, 0, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)  # the second press, as a user's: the first is being handled
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert open_store(str(store)).done_shards[0]  # finished shards are kept


def test_a_store_being_created_by_a_live_job_is_said_so(image_dir: Path, tmp_path: Path):
    """issue 26, defect 11: a store a live job is creating was called "left half-created by a run that failed"."""
    from extractor.store import Objects, now, read_state
    from extractor.store.claimants import Claimant
    from extractor.store.generation import swap_head

    url = str(tmp_path / "s.zarr")
    objects = Objects.at(url)
    name = swap_head(objects, None, now())  # as a job making the store: the head first, then itself a claimant
    maker = Claimant(objects, f"{name}/__txn/claimants", 60, {"pid": os.getpid(),
                                                               "host": __import__("socket").gethostname()})
    maker.start()
    try:
        with pytest.raises(StoreError, match=r"is being created by another extractor job now: pid \d+"):
            open_store(url)
        with pytest.raises(StoreError, match=r"is being made by another extractor job"):
            run(parse_spec(job(image_dir, tmp_path / "s.zarr", output={"store": url, "if_exists": "resume"})))
    finally:
        maker.end("interrupted")
    assert read_state(url)["status"] == "creating"
    with pytest.raises(StoreError, match="left half-created by a run that failed"):
        open_store(url)




def test_an_image_changed_between_a_run_and_its_resume_is_named_or_redone_never_mixed(
        image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """issue 26, defect 2 (T3-1): an image replaced at the same path between a run and --resume was accepted:
    done rows kept the old image's values, pending rows got the new one's. Per-row content digests: the
    resume names the changed rows; with output.on_change: redo their shards are computed again, and the
    store equals a clean run on the new images (values and statistics). Written in place, the image leaves its
    folder's mtime as it was: ``data.verify: files`` has each file stat-ed (issue 39)."""
    import extractor.store.provenance as provenance

    monkeypatch.setattr(provenance, "COMPARE_ROWS", 5)  # the store's arrays compared 5 rows at a time
    import shutil

    root = tmp_path / "imgs"
    shutil.copytree(image_dir, root)
    raw = job(root, tmp_path / "s.zarr", data={"shard_size": 4, "verify": "files"})
    interrupted_after(raw, 2)  # shards 0 and 1 done: rows 0-7
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.done_shards.tolist()[:2] == [True, True] and s.attrs["status"] == "interrupted"
    victim = root / s.ids[5]
    untouched = root / s.ids[1]
    Image.fromarray(np.full((50, 60, 3), 200, np.uint8)).save(victim, format=Image.open(victim).format)
    os.utime(untouched)  # touched, same bytes: its fingerprint changes, its digest does not
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=rf"the images of 1 row computed before have changed since \(their content "
                                         rf"digest differs\): {re.escape(repr(s.ids[5]))}.*output.on_change: redo"):
        run(parse_spec(raw))
    raw["output"]["on_change"] = "redo"
    summary = run(parse_spec(raw))
    assert 1 in {p.shard for p in summary.per_shard} and 0 not in {p.shard for p in summary.per_shard}
    clean = job(root, tmp_path / "clean.zarr", data={"shard_size": 4})
    run(parse_spec(clean))
    a, b = open_store(str(tmp_path / "s.zarr")), open_store(str(tmp_path / "clean.zarr"))
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))
    assert a.stats["layer4"]["mean"] == pytest.approx(b.stats["layer4"]["mean"], rel=1e-6)
    np.testing.assert_array_equal(a.digests, b.digests)
    raw["output"]["on_change"] = "refuse"
    assert run(parse_spec(raw)).shards_run == 0  # settled: the new fingerprints were recorded


def test_an_image_rewritten_in_place_is_found_by_a_default_resume(image_dir: Path, tmp_path: Path):
    """issue 54, T5-3: killed after 2 shards, a done row's JPEG rewritten in place by ``Image.save(path)`` (the
    same inode and size, a new mtime, its folder's times untouched); the default ``--resume`` took the rows
    from the store (its folders' times as recorded) and kept that row's old values, exit 0. The default
    ``data.verify: files`` stats every file: the row is named, and with ``output.on_change: redo`` computed
    again, the store equal to a clean run on the images as they are now."""
    import shutil

    root = tmp_path / "imgs"
    shutil.copytree(image_dir, root)
    hour_ago = time.time_ns() - 3600 * 10**9
    for folder in (root, *root.iterdir()):  # settled, as a data set's folders are (not listed again for their age)
        os.utime(folder, ns=(hour_ago, hour_ago))
    raw = job(root, tmp_path / "s.zarr", data={"shard_size": 4})
    assert "verify" not in raw["data"]
    interrupted_after(raw, 2)  # rows 0-7 done
    s = open_store(str(tmp_path / "s.zarr"))
    row = next(i for i in range(8) if s.ids[i].endswith(".jpg"))
    victim = root / s.ids[row]
    was, folder_was = victim.stat(), victim.parent.stat()
    Image.fromarray(np.full((50, 60, 3), 200, np.uint8)).save(victim)  # in place: opened for writing, truncated
    with open(victim, "ab") as f:  # the same size: bytes after the JPEG's end marker, which decoders skip
        f.write(b"\0" * (was.st_size - victim.stat().st_size))
    now_ = victim.stat()
    assert (now_.st_ino, now_.st_size) == (was.st_ino, was.st_size) and now_.st_mtime_ns != was.st_mtime_ns
    assert (victim.parent.stat().st_mtime_ns, victim.parent.stat().st_ctime_ns) == \
        (folder_was.st_mtime_ns, folder_was.st_ctime_ns)
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=rf"the images of 1 row computed before have changed since \(their content "
                                         rf"digest differs\): {re.escape(repr(s.ids[row]))}"):
        run(parse_spec(raw))
    raw["output"]["on_change"] = "redo"
    summary = run(parse_spec(raw))
    assert row // 4 in {p.shard for p in summary.per_shard}
    run(parse_spec(job(root, tmp_path / "clean.zarr", data={"shard_size": 4})))
    a, b = open_store(str(tmp_path / "s.zarr")), open_store(str(tmp_path / "clean.zarr"))
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))
    np.testing.assert_array_equal(a.digests, b.digests)


def test_a_changed_tar_member_is_named_on_resume(tmp_path: Path):
    from helpers.sources import write_tars

    files = make_images(tmp_path / "imgs", per_class=4, classes=("a",), size=40)
    tars = write_tars(files, tmp_path / "tars", per_tar=2)
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", data={"source": "tar", "root": None, "shard_size": 2,
                                                           "tars": str(tmp_path / "tars" / "shard-{000..001}.tar")})
    interrupted_after(raw, 1)
    Image.fromarray(np.full((40, 40, 3), 9, np.uint8)).save(files[1], format="PNG")
    write_tars(files, tmp_path / "tars", per_tar=2)  # the same members, one with other bytes
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=r"the images of 1 row computed before have changed since"):
        run(parse_spec(raw))
    assert len(tars) == 2


def test_a_resume_takes_the_rows_of_unchanged_tars_from_the_store_and_lists_changed_ones_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Planning once: the store records the tars it was listed from (each one's size and mtime); a resume with the
    same tars reads no tar header and takes its rows from the store; one whose tars changed lists them again (a
    resume with work to do records the new listing; a complete store is never written to by a resume)."""
    from helpers.sources import write_tars

    import extractor.data.sources.tar as tars_module

    files = make_images(tmp_path / "imgs", per_class=4, classes=("a", "b"), size=40)
    write_tars(files, tmp_path / "tars", per_tar=3)
    data = {"source": "tar", "root": None, "shard_size": 2, "tars": str(tmp_path / "tars" / "shard-{000..002}.tar")}
    clean = job(tmp_path / "imgs", tmp_path / "clean.zarr", data=data)
    run(parse_spec(clean))
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", data=data)
    interrupted_after(raw, 1)
    assert open_store(str(tmp_path / "s.zarr")).attrs["listing"]["tars"][0].endswith("shard-000.tar")
    scanned = []
    real = tars_module.scan_tar
    monkeypatch.setattr(tars_module, "scan_tar", lambda *a: scanned.append(a[0]) or real(*a))
    raw["output"]["if_exists"] = "resume"
    summary = run(parse_spec(raw))
    assert scanned == [] and summary.shards_run >= 1 and summary.ok == 8  # no tar listed again
    from extractor.driver.runner import _recorded

    left = _recorded(parse_spec(raw))  # the rows stay in the store: their number and digests are taken from it
    assert left is not None and len(left) == 8 and len(left.ids) == 0 and left.stored is not None
    assert left.stored["ids_digest"] == open_store(str(tmp_path / "s.zarr")).attrs["ids_digest"]
    a, b = open_store(str(tmp_path / "clean.zarr")), open_store(str(tmp_path / "s.zarr"))
    assert b.ids.tolist() == a.ids.tolist() and b.classes == a.classes and (b.labels == a.labels).all()
    for key in a.keys:
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))
    write_tars(files, tmp_path / "tars", per_tar=3)  # written again: the same members, new mtimes
    assert run(parse_spec(raw)).shards_run == 0 and len(scanned) == 3  # listed again, compared, nothing to do


def test_a_rewritten_tar_names_only_the_image_that_changed_and_a_changed_label_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A tar rewritten with one image changed moves every member after it: the content of the moved ones is
    read where they are now and found the same, so only the changed row is named (and with on_change: redo only
    its shard is computed again). A .cls rewritten since the store was listed is refused: the store's rows keep
    the labels they were listed with."""
    import extractor.store.provenance as provenance

    monkeypatch.setattr(provenance, "COMPARE_ROWS", 3)  # the store's arrays compared 3 rows at a time
    import io
    import tarfile

    from PIL import Image

    files = make_images(tmp_path / "imgs", per_class=3, classes=("a", "b"), size=40)
    tar = tmp_path / "t.tar"

    def write(labels: dict[str, str], replace: bytes | None = None) -> None:
        with tarfile.open(tar, "w") as t:
            for n, f in enumerate(files):
                for name, data in ((f"k{n}.jpg", replace if replace is not None and n == 1 else f.read_bytes()),
                                   (f"k{n}.cls", labels.get(f"k{n}", f.parent.name).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))

    write({})
    raw = job(tmp_path / "imgs", tmp_path / "s.zarr", data={"source": "tar", "root": None, "tars": str(tar),
                                                            "shard_size": 2})
    run(parse_spec(raw))
    small = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(small, format="JPEG")
    write({}, replace=small.getvalue())  # k1's image changed, smaller: k2 ... k5 moved
    checked = open_store(str(tmp_path / "s.zarr")).verify()  # the moved members read where they are now
    assert checked["changed"] == [(1, "k1")] and checked["unreadable"] == [] and checked["checked"] == 6
    raw["output"]["if_exists"] = "resume"
    with pytest.raises(StoreError, match=r"the images of 1 row computed before have changed since .*: 'k1'\. "):
        run(parse_spec(raw))
    raw["output"]["on_change"] = "redo"
    assert run(parse_spec(raw)).shards_run == 1  # k1's shard only
    write({"k3": "a"}, replace=small.getvalue())  # k3's .cls now says a (it was b)
    raw["output"]["on_change"] = "refuse"
    with pytest.raises(StoreError, match=r"the labels of 1 row differ from the store's \(first: row 3 'k3', 1 in the "
                                         r"store, 0 now\).*Use --overwrite"):
        run(parse_spec(raw))


def test_inspect_verify_reads_every_image_again(image_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    import shutil

    from extractor.cli import main

    root = tmp_path / "imgs"
    shutil.copytree(image_dir, root)
    run(parse_spec(job(root, tmp_path / "s.zarr")))
    assert main(["inspect", str(tmp_path / "s.zarr"), "--verify"]) == 0
    assert "12 rows read again, 0 changed since they were computed, 0 unreadable now" in capsys.readouterr().out
    s = open_store(str(tmp_path / "s.zarr"))
    (root / s.ids[3]).write_bytes((root / s.ids[4]).read_bytes())
    (root / s.ids[7]).unlink()
    assert main(["inspect", str(tmp_path / "s.zarr"), "--verify"]) == 1
    out = capsys.readouterr().out
    assert f"changed: row 3 {s.ids[3]}" in out and f"unreadable: row 7 {s.ids[7]}" in out
    assert s.verify()["checked"] == 12


def test_a_job_over_a_superset_takes_the_rows_another_store_computed_and_equals_a_clean_run(image_dir: Path,
                                                                                             tmp_path: Path):
    """issue 26, item 3: output.reuse copies the rows whose image bytes (content digest) another store computed
    with the same model, preprocessing and captures; only the new images are computed; the store records
    where each row came from and equals a clean run."""
    import shutil

    some = tmp_path / "some"
    for p in sorted(image_dir.rglob("*.*"))[:7]:  # 7 of the 12 images, at other paths: digests, not names
        (some / p.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, some / p.parent.name / f"copy-{p.name}")
    first = job(some, tmp_path / "first.zarr", data={"shard_size": 4})
    run(parse_spec(first))
    raw = job(image_dir, tmp_path / "s.zarr", data={"shard_size": 4},
              output={"reuse": [str(tmp_path / "first.zarr")]})
    summary = run(parse_spec(raw))
    assert summary.reused == 7 and summary.ok == 12
    assert "7 rows taken from other stores (output.reuse)" in summary.report()
    run(parse_spec(job(image_dir, tmp_path / "clean.zarr", data={"shard_size": 4})))
    s, c = open_store(str(tmp_path / "s.zarr")), open_store(str(tmp_path / "clean.zarr"))
    for key in ("layer3", "layer4"):
        np.testing.assert_allclose(s.numpy(key), c.numpy(key), rtol=1e-5, atol=1e-6)  # batches of other rows
    assert s.stats["layer4"]["mean"] == pytest.approx(c.stats["layer4"]["mean"], rel=1e-5)
    reused = np.asarray(s.group["reused"][:])
    assert (reused == 0).sum() == 7 and (reused == -1).sum() == 5
    assert s.attrs["reused_from"] == [str(tmp_path / "first.zarr")]
    np.testing.assert_array_equal(s.digests, c.digests)


def test_a_store_made_otherwise_is_refused_for_reuse_naming_how(image_dir: Path, tmp_path: Path):
    """Stale reuse is impossible by construction: another model's weights, another preprocessing, a capture
    made otherwise: refused before anything is written, naming what differs."""
    run(parse_spec(job(image_dir, tmp_path / "other.zarr", data={"resize": 80, "crop": 64})))
    raw = job(image_dir, tmp_path / "s.zarr", output={"reuse": [str(tmp_path / "other.zarr")]})
    with pytest.raises(StoreError, match=r"output.reuse: the rows of .*other.zarr are not what this job computes: it "
                                         r"differs in preprocess.*Remove it from output.reuse"):
        run(parse_spec(raw))
    assert not (tmp_path / "s.zarr").exists()
    run(parse_spec(job(image_dir, tmp_path / "pooled.zarr", capture=[{"layer": "layer3", "reduce": "mean"},
                                                                     {"layer": "layer4", "reduce": "mean"}])))
    raw["output"]["reuse"] = [str(tmp_path / "pooled.zarr")]
    with pytest.raises(StoreError, match=r"differs in .*captures layer3 \(absent there, or made otherwise\)"):
        run(parse_spec(raw))
