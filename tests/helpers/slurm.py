"""A real Slurm on this machine for the tests (Debian's ``slurm-wlm`` and ``munge``: ``make slurm`` installs them):
``munged``, ``slurmctld`` and ``slurmd`` on 127.0.0.1, one node of this machine's cores, state in a temporary
folder. :func:`local_slurm` starts them (or says why it cannot: the tests skip with that reason) and stops the ones
it started, by their pids."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel", "scontrol")


def missing() -> str | None:
    """Why a local Slurm cannot run here (None: it can)."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing): `make slurm` installs slurm-wlm and munge"
    if os.geteuid() != 0:
        return "a local Slurm needs root here (slurmd runs the tasks as their user)"
    if not Path("/etc/munge/munge.key").exists():
        return "munge has no key (/etc/munge/munge.key): reinstall munge"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _conf(folder: Path, host: str) -> Path:
    cpus = os.cpu_count() or 2
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=extractor-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "AuthType=auth/munge",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmUser=root",
        "SlurmdUser=root",
        "ReturnToService=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "KillWait=5",
        "MinJobAge=300",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd.log",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8",
        "",
    ]))
    for sub in ("state", "spool"):
        (folder / sub).mkdir(exist_ok=True)
    return conf


def _munge() -> subprocess.Popen | None:
    """munged, started as the munge user unless one runs already (None then: not ours to stop)."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return None
    os.makedirs("/run/munge", exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    return subprocess.Popen(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--foreground"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait(what: str, ready: callable, seconds: float, logs: list[Path]) -> None:  # type: ignore[valid-type]
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            said = "\n".join(p.read_text()[-2000:] for p in logs if p.exists())
            raise RuntimeError(f"the local Slurm's {what} did not come up in {seconds:.0f} s:\n{said}")
        time.sleep(0.2)


@contextlib.contextmanager
def local_slurm(folder: Path) -> Iterator[dict[str, str]]:
    """A running one-node Slurm; yields the environment its commands need (``SLURM_CONF``)."""
    host = socket.gethostname().split(".")[0]
    conf = _conf(folder, host)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[subprocess.Popen] = []
    munge = _munge()
    if munge is not None:
        started.append(munge)
    try:
        _wait("munge", lambda: Path("/run/munge/munge.socket.2").exists(), 30, [])
        for daemon in ("slurmctld", "slurmd"):
            started.append(subprocess.Popen([f"/usr/sbin/{daemon}", "-D", "-f", str(conf)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            return out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc")

        _wait("node", idle, 60, [folder / "slurmctld.log", folder / "slurmd.log"])
        yield env
    finally:
        for proc in reversed(started):  # ours only, by pid
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def squeue(env: dict[str, str], job: str) -> list[tuple[str, str]]:
    """The job's tasks still known to Slurm: (JOBID_TASK, state)."""
    out = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%i %T"], env=env, capture_output=True, text=True)
    return [tuple(line.split()) for line in out.stdout.splitlines() if line.strip()]  # type: ignore[misc]
