"""Jobs in processes stopped at a chosen change of the store (EXTRACTOR_TEST_PAUSE), woken by the test."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import warm
import yaml

from helpers.jobs import job
from helpers.processes import child_env

TIMEOUT_S = 1.0  # the jobs' output.lease_timeout_s: a stopped claimant is dead this long after its last renewal


MODEL = {"factory": "toy_models:stopped_at_write"}  # stops where EXTRACTOR_TEST_PAUSE says: only in job A's process


def spec_of(root: Path, store: str, reduce: str, **output: Any) -> dict:
    return job(root, Path(store), model={"name": None, "device": "cpu", **MODEL},
               data={"resize": None, "crop": 32, "shard_size": 2, "batch_size": 1, "decode_workers": 1},
               capture=[{"layer": "conv", "reduce": reduce, "key": "conv"}],
               output={"store": store, "chunk_rows": 1, "lease_timeout_s": TIMEOUT_S, "sharding": True, **output})


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def start_paused(spec: dict, tmp_path: Path, key: str, nth: int, inside: bool = False,
                 *flags: str) -> subprocess.Popen:
    """Job A (``flags``: ``--overwrite``, ``--resume``) in a process that stops itself at the change named; returns
    once it has stopped."""
    marker = tmp_path / "stopped"
    path = tmp_path / "a.yaml"
    path.write_text(yaml.safe_dump(spec))
    pause = f"{key}|{nth}|{marker}|{'inside' if inside else 'before'}"
    proc = warm.Popen([sys.executable, "-m", "extractor.cli", "run", str(path), "-q", *flags],
                      env=child_env(EXTRACTOR_TEST_PAUSE=pause), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
    deadline = time.monotonic() + 180
    while not (marker.exists() and stopped(proc.pid)):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"job A never reached {key} ({nth})"
        time.sleep(0.02)
    return proc


def wake(proc: subprocess.Popen) -> tuple[int, str]:
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=180)
    return proc.returncode, err


def local_objects(store: Path) -> dict[str, str]:
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file() and not p.name.endswith(".tmp")}
