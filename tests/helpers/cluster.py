"""A real Ray head on loopback with its dashboard (the Jobs API), and the CLI run against it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import warm

from helpers.processes import free_port, kill_processes_mentioning

VENV_BIN = Path(sys.executable).parent


def wait_for(url: str, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {seconds} s")


@contextlib.contextmanager
def jobs_head(prefix: str, **env_vars: str) -> Iterator[tuple[str, dict[str, str], str]]:
    """`ray start --head` on loopback with the dashboard (Jobs API), ``env_vars`` in its environment:
    (its Jobs API address, that environment, its temp dir); its processes killed by pid at the end."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    dash = free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "RAY_USAGE_STATS_ENABLED": "0", **env_vars}
    try:
        yield f"http://127.0.0.1:{dash}", env, tmp  # the caller may check the environment before the head starts
    finally:
        kill_processes_mentioning(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def start_head(address: str, env: dict[str, str], tmp: str) -> None:
    """Start the head of :func:`jobs_head` and wait until its Jobs API answers."""
    dash = address.rsplit(":", 1)[1]
    out = subprocess.run([str(VENV_BIN / "ray"), "start", "--head", f"--port={free_port()}", "--num-cpus=2",
                          "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                          f"--dashboard-agent-listen-port={free_port()}", f"--temp-dir={tmp}",
                          "--disable-usage-stats"], env=env, cwd=tmp, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    wait_for(f"{address}/api/version", 90)


def extractor(*args: str, env: dict, timeout: float = 400) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "-m", "extractor.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
