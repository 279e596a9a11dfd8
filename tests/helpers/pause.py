"""A process that stops itself (SIGSTOP) at one change of a store, as a long GC pause, a frozen VM or a storage stall
stops it there: every change a store sees goes through four doors, patched here (:func:`pause_at`).

- ``objects:KEY``: an object under the store's URL put, created, swapped or removed (``objects.Objects``: the
  head ``zarr.json``, ledger blocks ``GEN/__txn/ledger/B``, claimants' records, the final record, index attributes,
  an old generation's removal ``GEN``);
- ``view:KEY``: a key of a generation written through its view (``views.GenerationStore.set``: arrays' metadata, a
  shard's per-row chunks as ``status/c/1``, the generation's root as ``zarr.json``);
- ``stream:KEY``: a shard object of a sharded array made whole (``chunks.ShardStream.close``: ``__attempts/A/KEY``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections.abc import Callable
from typing import Any


def pause_at(pattern: str, nth: int, marker: str, inside: bool = False) -> None:
    """In this process, stop at the ``nth`` change whose name (above) matches ``pattern`` (a regular expression,
    searched), writing the file ``marker`` (the process's pid) just before. ``inside``: for a swap of a local store,
    with the store's lock file held (its read and compare made, its replace not yet); otherwise before the change."""
    from extractor.store import chunks, objects, views

    wanted = re.compile(pattern)
    seen = [0]
    lock = threading.Lock()
    # a "before" stop is between two changes: no other thread of the process inside a local swap then (it would hold
    # the store's lock file while stopped, which is the "inside" case); swaps are counted, and none starts meanwhile
    swaps = threading.Condition()
    inside_swaps = [0]

    def stop(name: str) -> None:
        with lock:
            if not wanted.search(name):
                return
            seen[0] += 1
            if seen[0] != nth:
                return
        with contextlib.ExitStack() as held:
            if not inside:
                held.enter_context(swaps)
                swaps.wait_for(lambda: inside_swaps[0] == 0)
            with open(marker, "w") as f:  # the stopped process's pid: the one to wake
                f.write(str(os.getpid()))
            # to this thread: it stops before its next instruction (a SIGSTOP to the process may be taken by another
            # thread first, and this one would go on into its change for a moment)
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    def before(cls: Any, name: str, label: Callable[..., str]) -> None:
        original = getattr(cls, name)

        def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
            stop(label(self, *args))
            return original(self, *args, **kwargs)

        setattr(cls, name, patched)

    if inside:
        swapping = threading.local()
        original_swap, original_replace = objects.LocalObjects.swap, os.replace

        def swap(self: Any, key: str, version: Any, data: bytes) -> bool:
            swapping.key = key
            try:
                return original_swap(self, key, version, data)
            finally:
                swapping.key = None

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            key = getattr(swapping, "key", None)
            if key is not None:
                stop(f"objects:{key}")
            original_replace(src, dst, **kwargs)

        objects.LocalObjects.swap, os.replace = swap, replace
        return
    original_locked = objects.LocalObjects._locked

    @contextlib.contextmanager
    def counted(self: Any) -> Any:
        with swaps:
            inside_swaps[0] += 1
        try:
            with original_locked(self):
                yield
        finally:
            with swaps:
                inside_swaps[0] -= 1
                swaps.notify_all()

    objects.LocalObjects._locked = counted
    for cls in (objects.LocalObjects, objects.RemoteObjects):
        for name in ("put", "create", "swap"):
            before(cls, name, lambda self, key, *rest: f"objects:{key}")
        before(cls, "remove", lambda self, key: f"objects:{key}")
    original_set = views.GenerationStore.set

    async def view_set(self: Any, key: str, value: Any) -> None:
        stop(f"view:{key}")
        await original_set(self, key, value)

    views.GenerationStore.set = view_set
    before(chunks.ShardStream, "close", lambda self: f"stream:{self.where}")
