"""A warm interpreter for the tests that start ``python -m extractor.cli`` (issue 40).

A fresh interpreter spends 5-10 s of CPU importing torch and torchvision (torchvision's ops import
torch._dynamo) before the command does anything; the tests that need a real process (one that is
paused, killed, interrupted, that exits with a code of its own) start about a hundred. Here one server
per test process imports them once and forks a child for each command: the child is a real process
(its own pid, signals, exit status, standard streams through pipes) running exactly what
``python -m extractor.cli ARGS`` runs, in the environment and folder it is given.

    proc = warm.Popen([sys.executable, "-m", "extractor.cli", "run", job], env=..., stdout=PIPE, text=True)
    r = warm.run([...], capture_output=True, text=True, timeout=300)   # a CompletedProcess

Both take the same arguments as :mod:`subprocess`'s for these commands. The server runs as
``python tests/warm.py SOCKET`` and is ended with the test process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

PIPE, DEVNULL = subprocess.PIPE, subprocess.DEVNULL
PRELOAD = ("torch", "torchvision", "torchvision.io", "numpy", "zarr", "PIL.Image", "yaml", "extractor.cli",
           "extractor.driver.runner", "extractor.compute.worker", "extractor.read.reader")


# ---- the server: imports once, forks a child per command, reports each child's exit status -----------------------

def _child(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become ``python -m extractor.cli ARGS`` in the folder and environment asked for."""
    import runpy

    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:] = [os.getcwd(), *extra, *sys.path[1:]]  # `python -m` puts the current folder first
    sys.argv = ["-m", *request["args"]]
    if request["env"].get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
    code: Any = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit status 1
        import traceback

        traceback.print_exc()
        code = 1
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def serve(path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    parent = os.getppid()
    while os.getppid() == parent:  # ends with the test process, also one that was killed
        readable, _, _ = select.select([server], [], [], 0.02)
        if readable:
            conn, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            pid = os.fork()
            if pid == 0:
                for sock in (server, conn, *children.values()):
                    sock.close()
                _child(json.loads(message), fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:  # reap: each child's exit status to its client, as subprocess gives it
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


# ---- the client: Popen and run as subprocess has them ---------------------------------------------------------------

class _Server:
    """This test process's server, started on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.path = ""

    def address(self) -> str:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.path = os.path.join(tempfile.mkdtemp(prefix="warm-"), "socket")
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")]))}
                self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdout=PIPE, env=env,
                                             stdin=DEVNULL, start_new_session=True)
                assert self.proc.stdout is not None
                line = self.proc.stdout.readline()  # after its imports
                assert line == b"ready\n", f"the warm interpreter did not start: {line!r}"
                atexit.register(self.close)
            return self.path

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_SERVER = _Server()


def _command(args: list[str]) -> tuple[str, list[str]]:
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-m":
        raise ValueError(f"warm runs `{sys.executable} -m MODULE ARGS`, not {args[:3]}")
    return args[2], list(args[3:])


class Popen:
    """A command in a child of the warm interpreter: pid, signals, poll/wait/communicate, streams, returncode."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 stdout: Any = None, stderr: Any = None, text: bool = False, start_new_session: bool = False) -> None:
        module, rest = _command([str(a) for a in args])
        self.args, self.returncode = args, None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        theirs: list[int] = []  # the child's ends of pipes and /dev/null, closed here once sent
        fds = [self._end(DEVNULL, 0, text, theirs), self._end(stdout, 1, text, theirs),
               self._end(stderr, 2, text, theirs)]
        request = {"module": module, "args": rest, "env": dict(os.environ if env is None else env),
                   "cwd": str(cwd or os.getcwd()), "new_session": start_new_session}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_SERVER.address())
        socket.send_fds(self._conn, [json.dumps(request).encode()], fds)
        for fd in theirs:
            os.close(fd)
        self._lines = self._conn.makefile("r")
        self.pid = int(self._lines.readline())

    def _end(self, how: Any, target: int, text: bool, theirs: list[int]) -> int:
        """The descriptor the child gets as ``target``; a pipe's read end kept as this object's stream."""
        if how == PIPE:
            r, w = os.pipe()
            setattr(self, ("stdin", "stdout", "stderr")[target], os.fdopen(r, "r" if text else "rb"))
            theirs.append(w)
            return w
        if how == DEVNULL:
            theirs.append(os.open(os.devnull, os.O_RDWR))
            return theirs[-1]
        if how is None:
            return target  # this process's own
        return how.fileno() if hasattr(how, "fileno") else int(how)  # a file

    def _status(self, timeout: float | None) -> None:
        """Read the exit status once the server sends it (``timeout`` 0: only if it has)."""
        if self.returncode is None and select.select([self._conn], [], [], timeout)[0]:
            self.returncode = int(self._lines.readline())
            self._lines.close()
            self._conn.close()

    def poll(self) -> int | None:
        self._status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Everything the child writes to its pipes until it exits (as subprocess reads them: a thread each)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        got: dict[str, Any] = {}
        readers = [threading.Thread(target=lambda n=name, s=stream: got.__setitem__(n, s.read()), daemon=True)
                   for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)) if stream is not None]
        for t in readers:
            t.start()
        for t in readers:
            t.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.01))
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return got.get("stdout"), got.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def run(args: list[str], *, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess:
    if capture_output:
        kwargs.update(stdout=PIPE, stderr=PIPE)
    proc = Popen(args, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, args, out, err)
    return subprocess.CompletedProcess(args, proc.returncode or 0, out, err)


if __name__ == "__main__":
    serve(sys.argv[1])
