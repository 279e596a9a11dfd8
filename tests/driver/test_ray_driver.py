"""The driver of a Ray job as a process (issue 17): killed, stopped by SIGTERM, given an address where no
cluster listens, started too slowly; an embedded cluster on loopback. Split from test_ray.py, whose tests share a
Ray instance in the test process, so that the two files run side by side."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import warm
import yaml
from helpers.jobs import job
from helpers.processes import child_env, kill_processes_mentioning
from helpers.slow import slow_job
from helpers.stores import committed, committed_count

from extractor.driver.runner import run
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def end_embedded_ray(proc: subprocess.Popen, ray_tmp: str) -> None:
    """SIGKILL what is left of the Ray that the driver ``proc`` embedded (RAY_TMPDIR ``ray_tmp``), and return once
    none of it is alive: its session's processes, and any that keeps a file of ``ray_tmp`` open (a worker)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while kill_processes_mentioning(ray_tmp):  # until a pass finds none (a process killed no longer has files open)
        assert time.monotonic() < deadline, f"processes of {ray_tmp} still alive a minute after SIGKILL"


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_killed_driver_then_resume_redoes_only_unfinished_shards(slow_images: Path, tmp_path: Path, backend: str):
    """SIGKILL `extractor run` (embedded Ray, or the local backend) midway; `--resume` finishes with the same
    arrays, bit for bit, in a sharded store: the killed run's unfinished shard objects (temporary files) are
    removed by the resume, none is left."""
    half = {"layer": "conv", "key": "half", "dtype": "bfloat16"}  # the map in bfloat16, in shards too
    ref = slow_job(slow_images, tmp_path / "ref.zarr")
    ref["cluster"], ref["capture"] = {"backend": "local"}, [*ref["capture"], half]
    run(parse_spec(ref))
    raw = slow_job(slow_images, tmp_path / "s.zarr", workers=1, cpus_per_worker=1, local_cpus=2)
    raw["capture"] = [*raw["capture"], half]
    if backend == "local":
        raw["cluster"] = {"backend": "local"}
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = child_env(RAY_TMPDIR=ray_tmp)
    cmd = [sys.executable, "-m", "extractor.cli", "run", str(spec), "-q"]
    proc = warm.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 180
    # two shards committed (shard 1's commit may land before shard 0's, which a SIGKILL then loses: waiting for
    # shard 1 alone left one done on a loaded machine)
    while committed_count(tmp_path / "s.zarr") < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        end_embedded_ray(proc, ray_tmp)  # its worker would go on writing the shard it holds
    s = open_store(str(tmp_path / "s.zarr"))
    done_before = int(s.done_shards.sum())
    assert s.attrs["status"] == "running" and 2 <= done_before < 6
    out = warm.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=300,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr
    assert f"{6 - done_before} shards run, {done_before} already done" in out.stdout
    a, b = open_store(str(tmp_path / "ref.zarr")), open_store(str(tmp_path / "s.zarr"))
    assert (b.status == 1).all() and b.attrs["status"] == "complete"
    for key in ("conv", "map", "half"):
        assert b[key].shards is not None  # one object per work shard
        assert np.array_equal(a.numpy(key).view(np.uint8), b.numpy(key).view(np.uint8))  # bit for bit


def test_sigterm_on_the_ray_backend_interrupts_the_job_and_resume_finishes(slow_images: Path, tmp_path: Path):
    """A pre-emption (SIGTERM, also what `extractor jobs stop` sends) stops a Ray job as it stops a
    local one: store "interrupted", the resume command printed, exit code 130. (ray.init installs
    its own SIGTERM handler, which made it a "failed" store and a crash dump.)"""
    raw = slow_job(slow_images, tmp_path / "s.zarr", workers=1, cpus_per_worker=1, local_cpus=2)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = child_env(RAY_TMPDIR=ray_tmp)
    cmd = [sys.executable, "-m", "extractor.cli", "run", str(spec), "-q"]
    proc = warm.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 180
    while not committed(tmp_path / "s.zarr", 0) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        end_embedded_ray(proc, ray_tmp)
    assert proc.returncode == 130, err
    assert "--resume" in err and "SIGTERM received" not in err
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.attrs["status"] == "interrupted" and not s.done_shards.all()
    out = warm.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=300,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr
    assert (open_store(str(tmp_path / "s.zarr")).status == 1).all()


def test_an_address_where_no_cluster_listens_fails_fast(image_dir: Path, tmp_path: Path):
    """`ray.init` would wait many minutes for it, deaf to Ctrl-C (a subprocess: no Ray in it yet)."""
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job(image_dir, tmp_path / "s.zarr",
                                       cluster={"backend": "ray", "address": "127.0.0.1:1"})))
    out = warm.run([sys.executable, "-m", "extractor.cli", "run", str(spec), "-q"], capture_output=True,
                         text=True, timeout=120, env=child_env())
    assert out.returncode == 1
    assert "cannot reach a Ray cluster at cluster.address 127.0.0.1:1: ConnectionRefusedError" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "s.zarr").exists()


def test_a_stale_ray_address_in_the_environment_fails_fast_naming_it(image_dir: Path, tmp_path: Path):
    """issue 17, defect 4: a RAY_ADDRESS left from a cluster that is gone made `extractor run` retry for
    minutes, deaf to SIGINT and SIGTERM."""
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job(image_dir, tmp_path / "s.zarr", cluster={"backend": "ray"})))
    out = warm.run([sys.executable, "-m", "extractor.cli", "run", str(spec), "-q"], capture_output=True,
                         text=True, timeout=120, env=child_env(RAY_ADDRESS="127.0.0.1:1"))
    assert out.returncode == 1
    assert "cannot reach a Ray cluster at RAY_ADDRESS 127.0.0.1:1" in out.stderr and "unset RAY_ADDRESS" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "s.zarr").exists()


def test_a_sigterm_during_ray_start_up_is_an_interruption(image_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    """issue 17, defect 7: ray.init holds its own SIGTERM handler (sys.exit(15)) while it starts: a
    pre-emption then exited 15 silently instead of the interruption every other moment gives (130, the
    resume line)."""
    from extractor.driver import ray_backend as ray_backend

    def init(**kwargs):
        raise SystemExit(signal.SIGTERM)  # what Ray's handler does when SIGTERM comes during its start-up

    monkeypatch.setattr(ray_backend.ray, "init", init)
    monkeypatch.setattr(ray_backend.ray, "is_initialized", lambda: False)
    with pytest.raises(KeyboardInterrupt):
        ray_backend.RayBackend(parse_spec(job(image_dir, tmp_path / "s.zarr", cluster={"backend": "ray"})))


def test_workers_that_do_not_start_in_time_are_a_cluster_error(image_dir: Path, tmp_path: Path):
    """issue 17, defect 2 (in part): the ClusterError was built after Ray was shut down, so the job crashed
    with RaySystemError 'Ray has not been started yet' instead."""
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(job(image_dir, tmp_path / "s.zarr",
                                       cluster={"backend": "ray", "startup_timeout_s": 0.01})))
    out = warm.run([sys.executable, "-m", "extractor.cli", "run", str(spec), "-q"], capture_output=True,
                         text=True, timeout=300, env=child_env())
    assert out.returncode == 1, out.stderr[-2000:]
    assert "did not start within 0.01 s (cluster.startup_timeout_s); free resources now:" in out.stderr
    assert "Traceback" not in out.stderr and "RaySystemError" not in out.stderr


def test_an_embedded_cluster_listens_on_loopback_even_when_ray_was_imported_first():
    """Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported; ray_backend imports it, so
    setting the variable before ray.init came too late: an embedded cluster took the machine's other
    address and listened on every interface. Checked in a process without the variable (no Ray is
    started: the address Ray would bind is asked for)."""
    code = ("import os, ray._private.services as s, extractor.driver.ray_backend as rb\n"
            "assert 'RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER' not in os.environ\n"
            "rb.loopback_only()\n"
            "print(s.get_node_ip_address())\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "127.0.0.1"


def test_a_current_folder_that_is_gone_is_one_line_not_a_traceback(image_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    """issue 54: the Ray driver called os.getcwd() unguarded: a working folder removed under it was a traceback (or
    Ray's own FileNotFoundError). Refused in one line before Ray starts; a model.factory module not found says the
    folder it was not searched in is gone."""
    from extractor.driver.ray_backend import RayBackend
    from extractor.errors import ClusterError, ModelError
    from extractor.model.build import build_model
    from extractor.spec.model_spec import ModelSpec

    def gone() -> str:
        raise FileNotFoundError(2, "No such file or directory")

    spec = parse_spec(job(image_dir, tmp_path / "s.zarr", cluster={"backend": "ray", "workers": 1}))
    monkeypatch.setattr(os, "getcwd", gone)
    was = ray.is_initialized()
    with pytest.raises(ClusterError, match=r"^the current folder is gone \(removed since this command started in "
                                           r"it\): Ray starts the job's processes there.*cd into a folder that exists"):
        RayBackend(spec)
    assert ray.is_initialized() == was  # refused before Ray was started
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p])
    with pytest.raises(ModelError, match=r"cannot import no_such_factory_module: .*\(PYTHONPATH is searched: the "
                                         r"current folder is gone"):
        build_model(ModelSpec(factory="no_such_factory_module:make"))
