"""Many launchers, one store (issue 58): the recipes of ``jobs/cluster/`` run as their launchers run them. A real
Slurm (``helpers.slurm``: slurmctld and slurmd on 127.0.0.1) runs ``slurm-array.sbatch`` as an array of 4 tasks,
one cancelled and one requeued while they compute; the store is complete and equal, bit for bit, to one job's."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers.images import make_images
from helpers.jobs import job
from helpers.processes import child_env
from helpers.slurm import local_slurm, missing, squeue
from helpers.stores import generation

from extractor.driver.runner import run
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec
from extractor.store import alive

pytestmark = pytest.mark.slow  # a Slurm, job processes
REPO = Path(__file__).resolve().parents[2]


def spec_of(images: Path, store: Path, seconds: float = 0.0) -> dict:
    return job(images, store, model={"name": None, "factory": "toy_models:stopped_at_write", "device": "cpu",
                                     "factory_kwargs": {"seconds": seconds}},
               data={"resize": None, "crop": 32, "shard_size": 2, "batch_size": 1, "decode_workers": 1},
               capture=[{"layer": "conv", "reduce": "mean", "key": "conv"}],
               output={"store": str(store), "chunk_rows": 1, "lease_timeout_s": 2.0})


def same_as(store: Path, clean: Path) -> None:
    s, c = open_store(str(store)), open_store(str(clean))
    assert s.attrs["status"] == "complete" and s.done_shards.all() and (s.status == 1).all()
    assert np.isfinite(s.numpy("conv")).all()
    np.testing.assert_array_equal(s.numpy("conv"), c.numpy("conv"))  # bit for bit


def job_state(env: dict[str, str], task: str) -> dict[str, str]:
    """``scontrol show job`` of one array task: JobState, ExitCode, Restarts..."""
    out = subprocess.run(["scontrol", "-o", "show", "job", task], env=env, capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def live_claimants(store: Path) -> list[dict]:
    try:
        return [c for c in generation(str(store)).roster.all() if alive(c)]
    except (AssertionError, OSError, ValueError):  # not made yet
        return []


def test_a_slurm_array_fills_one_store_after_a_cancel_and_a_requeue(tmp_path: Path):
    """``sbatch --array=0-3 slurm-array.sbatch``: 4 tasks join one store; task 1 is cancelled (``scancel``: SIGTERM,
    its claims given back) and task 2 requeued (``scontrol requeue``: killed, started again) once all 4 compute. The
    store ends complete, each shard committed once, equal to one job's store; the other tasks and the requeued
    one's second start end COMPLETED with exit code 0, saying how many shards they computed."""
    why = missing()
    if why:
        pytest.skip(why)
    images = tmp_path / "imgs"
    make_images(images, per_class=12, classes=("a", "b"), size=40)  # 24 images: 12 shards of 2
    clean = tmp_path / "clean.zarr"
    run(parse_spec(spec_of(images, clean)))
    store = tmp_path / "s.zarr"
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(spec_of(images, store, seconds=0.4)))
    logs = tmp_path / "logs"
    logs.mkdir()
    with local_slurm(tmp_path / "slurm") as env:
        env = {**child_env(EXTRACTOR_PYTHON=sys.executable), "SLURM_CONF": env["SLURM_CONF"]}
        # the recipe as it is, sized for this machine (no GPU, 2 cores)
        submitted = subprocess.run(["sbatch", "--parsable", "--array=0-3", "--gres=none", "--cpus-per-task=1",
                                    f"--output={logs}/%A_%a.out", f"--chdir={REPO}",
                                    str(REPO / "jobs/cluster/slurm-array.sbatch"), str(spec), "-q"],
                                   env=env, capture_output=True, text=True)
        assert submitted.returncode == 0, submitted.stderr
        array = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + 240
        while len(live_claimants(store)) < 4:  # all four compute (each listed, probed, joined)
            assert time.monotonic() < deadline, (squeue(env, array), [p.read_text() for p in logs.iterdir()])
            time.sleep(0.1)
        assert not generation(str(store)).ledger().read().done.all()  # mid-job
        subprocess.run(["scancel", f"{array}_1"], env=env, check=True)
        subprocess.run(["scontrol", "requeue", f"{array}_2"], env=env, check=True)
        # a requeued task waits 2 minutes before it may start again (Slurm's BeginTime): now, here
        while job_state(env, f"{array}_2").get("JobState") not in ("PENDING", "RUNNING", "COMPLETED"):
            time.sleep(0.1)
        subprocess.run(["scontrol", "update", f"JobId={array}_2", "StartTime=now"], env=env, check=True)
        while squeue(env, array):
            assert time.monotonic() < deadline + 240, (squeue(env, array), [p.read_text() for p in logs.iterdir()])
            time.sleep(0.5)
        states = {t: job_state(env, f"{array}_{t}") for t in range(4)}
    said = {t: (logs / f"{array}_{t}.out").read_text() for t in range(4)}
    assert states[1]["JobState"] == "CANCELLED", states[1]
    assert "--join" in said[1] and "--resume" not in said[1], said[1]  # stopped: it says to join again
    for t in (0, 2, 3):
        assert states[t]["JobState"] == "COMPLETED" and states[t]["ExitCode"] == "0:0", (states[t], said[t])
        assert re.search(r"\d+ shards? run", said[t]), said[t]
    assert "start 1" in said[2] and int(states[2]["Restarts"]) == 1, said[2]  # requeued: it ran again
    same_as(store, clean)
    gen = generation(str(store))
    records = gen.roster.all()
    assert sum(int(c["shards"]) for c in records) == 12  # each shard committed once, by one start of a task
    assert not [c for c in records if alive(c)]  # every start ended (the cancelled one too: its claims given back)


def test_the_kubernetes_indexed_job_runs_its_pods_command_and_survives_preemption_as_written(tmp_path: Path):
    """``k8s-indexed-job.yaml``: an indexed Job whose pods join one store, pre-emption ignored (started again, not
    counted as a failure), SIGTERM before the kill; its pod's command, run here as a pod runs it (the job file where
    the ConfigMap puts it), fills the store."""
    from helpers.processes import cli

    recipe = yaml.safe_load((REPO / "jobs/cluster/k8s-indexed-job.yaml").read_text())
    spec = recipe["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] <= spec["completions"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in spec["podFailurePolicy"]["rules"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= 30
    (container,) = pod["containers"]
    command = container["command"]
    mount = container["volumeMounts"][0]["mountPath"]
    assert command[:2] == ["extractor", "run"] and "--join" in command and command[2].startswith(mount + "/")
    images = tmp_path / "imgs"
    make_images(images, per_class=2, classes=("a",), size=40)
    store = tmp_path / "s.zarr"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec_of(images, store)))
    done = cli(*[str(path) if a == command[2] else a for a in command[1:]], "-q")
    assert done.returncode == 0 and re.search(r"1 shard run", done.stdout), done.stderr
    assert open_store(str(store)).attrs["status"] == "complete"
