"""Tars listed by worker processes (issue 57): a tar's headers are walked by a Python loop that holds the GIL (about
1 us a member in bulk, 6 us by the plain reader), so threads list no faster than one; a driver of many cores lists
a large tar source on as many processes, each its share of the tars in order, their samples handed back in order.

The workers are plain ``python -c`` processes that call :func:`serve` (not :mod:`multiprocessing`, whose children
import the caller's main script again: a script that runs a job without an ``if __name__ == "__main__"`` guard
would run it in each). Each reads its tars from its standard input, then writes each tar's :class:`~.tar.Samples`
(or the error that stopped it) as a pickle to its standard output; a worker holds one tar's samples at most while
the driver reads another's (the pipe's buffer bounds it).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable, Generator, Sequence
from typing import Any

from ...errors import DataError

__all__ = ["PROCESS_TARS", "listing_processes", "scanned", "serve"]

_PACKAGE = __name__.rsplit(".", 1)[0]
_WORKER = f"from {_PACKAGE} import tar, _tar_processes; _tar_processes.serve(tar.scan_tar)"
PROCESS_TARS = 64  # tars in a listing before it is shared out (a worker's start: 0.15 s of imports, 2 KB a tar)
MAX_PROCESSES = 16


def listing_processes(tars: int) -> int:
    """The worker processes a listing of ``tars`` tars takes: one a core (at most 16, at least 8 tars each; the
    environment's ``EXTRACTOR_LISTING_PROCESSES`` at most, 0: none); 0 (listed in this process) for fewer than
    :data:`PROCESS_TARS` tars or one core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    most = os.environ.get("EXTRACTOR_LISTING_PROCESSES", "").strip()
    if most:
        if not (most.isascii() and most.isdigit()):  # (a negative number too: none is fewer than none)
            raise DataError(f"EXTRACTOR_LISTING_PROCESSES={most!r} is not a number of processes; set it to 0 (list "
                            "tars in the driver) or more")
        cores = min(cores, int(most))
    if cores < 2 or tars < PROCESS_TARS:
        return 0
    return max(2, min(cores, MAX_PROCESSES, tars // 8))


def scanned(urls: Sequence[str], extensions: Sequence[str], storage: dict[str, Any],
            processes: int) -> Generator[Any, None, None]:
    """:func:`~.tar.scan_tar` of each tar, in order, by ``processes`` workers (tar i by worker i mod processes);
    a tar's error is raised as the worker met it, when its turn comes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # (this process's extractor)
    workers: list[subprocess.Popen[bytes]] = []
    done = False
    try:
        for _ in range(processes):  # all started, then each given its tars (a long list waits on its worker's imports)
            workers.append(subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, env=env))
        for w, worker in enumerate(workers):
            assert worker.stdin is not None
            pickle.dump((list(urls[w::processes]), list(extensions), storage), worker.stdin)
            worker.stdin.close()
        for t, url in enumerate(urls):
            worker = workers[t % processes]
            assert worker.stdout is not None
            try:
                ok, value = pickle.load(worker.stdout)
            except EOFError:
                code = worker.wait()
                raise DataError(f"the process listing tar shard {url} stopped (exit status {code}); its error is "
                                "above (EXTRACTOR_LISTING_PROCESSES=0 lists the tars in the driver)") from None
            if not ok:
                raise value
            yield value
        done = True
    finally:
        for worker in workers:
            if done:  # (each has written its last: it ends by itself)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.wait(timeout=30)
            if worker.poll() is None:
                worker.kill()
            worker.wait()
            if worker.stdout is not None:
                worker.stdout.close()


def _lean(samples: Any) -> Any:
    """The samples as the listing takes them, quicker to pickle: byte ranges as arrays; the members' names left out
    where each is its key and one of a few ends (the listing takes those)."""
    import numpy as np

    samples.offsets, samples.sizes = np.asarray(samples.offsets, np.int64), np.asarray(samples.sizes, np.int64)
    if samples.end_codes is not None:
        samples.members = []
    return samples


def serve(scan_tar: Callable[[str, Sequence[str], dict[str, Any]], Any]) -> None:
    """A worker: the tars its standard input names listed by ``scan_tar``, each one's samples (or error) written as
    it is done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C is the driver's: it ends its workers)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what anything prints goes to the standard error, never into the pickles
    urls, extensions, storage = pickle.load(sys.stdin.buffer)
    for url in urls:
        try:
            item: tuple[bool, Any] = (True, _lean(scan_tar(url, extensions, storage)))
        except Exception as err:  # noqa: BLE001 - handed to the driver, which raises it
            item = (False, err)
        try:
            data = pickle.dumps(item)
        except Exception:  # noqa: BLE001 - an error that does not pickle: its words
            data = pickle.dumps((False, DataError(f"tar shard {url}: {type(item[1]).__name__}: {item[1]}")))
        out.write(data)
        out.flush()
        if not item[0]:
            return

