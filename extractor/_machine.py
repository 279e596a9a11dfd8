"""What this process may use of its machine (CPUs, memory), and the thread counts and depths made from them: the
writer threads and the chunks queued for them, the batches decoded ahead, an index pass's lanes and its read-ahead.
Each was a constant tuned on a 2-core machine; each rule below gives that constant's value there (issue 55).

``EXTRACTOR_CPUS`` overrides the CPUs (a process that shares its node; a benchmark's 16-core settings on a smaller
machine). Stdlib only: the ground floor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import SpecError

__all__ = ["CPUS_VARIABLE", "Machine"]

CPUS_VARIABLE = "EXTRACTOR_CPUS"
MEMORY_SHARE = 16  # a queue or a read-ahead holds at most this share of the memory (1/16)


@dataclass(frozen=True)
class Machine:
    cpus: int  # CPUs this process may run on (EXTRACTOR_CPUS, else its affinity mask)
    memory: int  # bytes it may use: its cgroup's limit where there is one, else the machine's memory

    @classmethod
    def here(cls, cpus: int | None = None) -> Machine:
        """This process's machine; ``cpus``: a share given to it (a Ray actor's), unless EXTRACTOR_CPUS says."""
        return cls(_cpus_setting() or cpus or _affinity(), _memory())

    @property
    def write_threads(self) -> int:
        """Chunks compressed and stored at once: half the CPUs (the decode threads and the main thread have the
        others; lz4 and zstd let go of the GIL), at least 4 (writes to an object store wait on the network), at most
        32. 4 on 2 cores, 8 on 16."""
        return max(4, min(self.cpus // 2, 32))

    def write_queue(self, chunk_bytes: int) -> int:
        """Chunks (one of each capture, ``chunk_bytes`` together) that may wait for the writer threads: one per
        thread, as 1/16 of the memory holds them (one at least). 4 on 2 cores, 8 on 16."""
        fits = self.memory // MEMORY_SHARE // max(chunk_bytes, 1)
        return max(1, min(self.write_threads, fits))

    def decode_ahead(self, batch_size: int, threads: int, batch_bytes: int) -> int:
        """Batches decoded ahead of the one the model takes: 2, or more where a batch is small beside the decode
        threads (each thread about 4 images ahead), as 1/16 of the memory allows. 2 at batch 64 or more on 16."""
        wanted = max(2, -(-4 * threads // max(batch_size, 1)))
        fits = self.memory // MEMORY_SHARE // max(batch_bytes, 1)
        return max(2, min(wanted, fits, 16))

    def index_lanes(self, lane_bytes: int) -> int:
        """Threads an index pass adds chunks on: one per CPU (its compiled pass, numpy's loops and the encoder's
        matmul let go of the GIL) while 1/16 of the memory holds their blocks (``lane_bytes`` each), at most 16.
        2 on 2 cores."""
        fits = self.memory // MEMORY_SHARE // max(lane_bytes, 1)
        return max(1, min(self.cpus, fits, 16))

    @property
    def read_ahead(self) -> int:
        """Chunks an index lane reads ahead of its pass (zarr decodes on the reading threads): 2."""
        return 2


def _cpus_setting() -> int | None:
    """EXTRACTOR_CPUS as a number of CPUs (None when unset); anything else is refused, saying what to set."""
    text = os.environ.get(CPUS_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise SpecError(f"{CPUS_VARIABLE}={text!r}: expected a whole number of CPUs (1 or more); unset it to use "
                         "the CPUs this process may run on")
    return int(text)


def _affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _memory() -> int:
    """The cgroup's memory limit (v2, then v1) where it is below the machine's memory, else the machine's."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: a conservative 8 GiB
        total = 8 << 30
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            return int(text)
    return total
