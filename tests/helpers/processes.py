"""Child processes of the tests: their environment, the CLI run as a user runs it, free ports, cleanup."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with tests/ first on PYTHONPATH (a child then imports ``toy_models``,
    the default model of :func:`job`), and ``extra``."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``extractor ARGS`` run in this process (``cli.main``): its exit code, standard output and error (its log
    lines too) as a subprocess gives them, without a new interpreter importing torch (5-10 s on 2 loaded cores).
    For what a command prints and writes; where the process is the point (signals, Ctrl-C, ``python -m``, a
    cluster's own interpreter) tests start one."""
    from extractor.cli import main

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)  # the command's log lines, as basicConfig would print them to stderr
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    levels = {name: logging.getLogger(name).level for name in ("extractor", "extractor.progress", "asyncio")}
    hook, here = sys.unraisablehook, os.getcwd()
    logging.getLogger().addHandler(handler)
    try:
        os.chdir(cwd or here)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as stop:  # argparse: --help, a bad option
                code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    finally:
        os.chdir(here)
        logging.getLogger().removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        sys.unraisablehook = hook
    return subprocess.CompletedProcess(["extractor", *args], code, out.getvalue(), err.getvalue())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mentions(pid: str, text: str) -> bool:
    """Process ``pid``'s command line, working folder or an open file names ``text``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if text in f.read().replace(b"\0", b" ").decode(errors="replace"):
                return True
        links = [f"/proc/{pid}/cwd", *(f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd"))]
    except OSError:
        return False
    for link in links:
        try:
            if text in os.readlink(link):
                return True
        except OSError:
            continue
    return False


def kill_processes_mentioning(text: str) -> list[int]:
    """SIGKILL the processes whose command line, working folder or open files name ``text`` (a temp
    dir this test made). Ray's agents rewrite their command line (and environment), but keep their
    log files in that dir open."""
    import signal

    killed = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and _mentions(entry, text):
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except ProcessLookupError:
                pass
    return killed


def stopped_outside_a_swap(proc: subprocess.Popen, store: Path, seconds: float = 120) -> None:
    """SIGSTOP ``proc`` where it holds no swap's lock of the local store ``store`` (a process stopped inside a swap
    holds the store, and another job waits for it, as the store promises: CI run b6, beside two CPU burners, stopped
    a job there): stopped (its state seen as such), the lock tried; where the process held it, it goes on and is
    stopped again."""
    import fcntl
    import signal
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        proc.send_signal(signal.SIGSTOP)
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "Tt":
            assert time.monotonic() < deadline, "the process never stopped"
        fd = os.open(store / "__lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        except BlockingIOError:
            proc.send_signal(signal.SIGCONT)  # stopped inside a swap: on to its end (the lock then free)
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    raise AssertionError(f"process {proc.pid} held the lock of {store} every time it was stopped")
