"""Claimants: the processes writing into a store's generation, each with a record it alone writes and renews.

A claimant's claims (:mod:`.ledger`) hold while it lives: its record is renewed every ``timeout_s / 4`` by a
thread; a record not renewed for ``timeout_s`` (its own job's ``output.lease_timeout_s``), or one whose process
is gone from this machine, belongs to a dead claimant, whose claims others take over. A claimant that wakes after
that (SIGSTOP, a frozen VM) finds its claims taken: its commits are refused. A claimant never stops another one;
the ledger decides.

The renewing thread also reads the store's head: once the generation it writes into is no longer the store's
(made again by ``--overwrite``), the claimant is :attr:`Claimant.lost` and the job stops.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypedDict, cast

from .._text import now
from ..errors import FencedError
from ..spec import redact
from .ledger import new_id
from .objects import Objects

__all__ = ["Claimant", "ClaimantRecord", "Roster", "alive", "gone"]

log = logging.getLogger(__name__)


class ClaimantRecord(TypedDict, total=False):
    """A claimant's record (``__txn/claimants/<id>``), written by that claimant only."""

    id: str  # hex
    heartbeat: float  # time.time() of its last renewal
    timeout_s: float  # silent this long, it is dead
    host: str
    pid: int
    user: str
    started: str
    command: str
    join: bool  # joined a store that others write too (--join)
    rows: bool  # writes the generation's rows (made it, or writes them again: a half-made store resumed)
    shards: int  # shards it committed so far
    ended: dict[str, Any]  # how it ended: status (complete, incomplete, interrupted, failed), error, at, stats


_ENDED: set[str] = set()  # claimants of this process that ended (their last word may have failed to land)
SUPERSEDED: set[str] = set()  # generations this process found the head no longer names: its writers stop


def alive(record: Mapping[str, Any], now: float | None = None) -> bool:
    """A claimant whose record is renewed within its timeout, not ended, and whose process, when it ran on this
    machine, is still there (and, when it is this process, has not ended)."""
    if not record or record.get("ended") or record.get("id") in _ENDED:
        return False
    now = time.time() if now is None else now
    if now - float(record.get("heartbeat", 0)) > float(record.get("timeout_s", 0)):
        return False
    return not (record.get("host") == socket.gethostname() and not _running(int(record.get("pid", 0))))


def gone(record: Mapping[str, Any]) -> bool:
    """A claimant known to write nothing more: it ended (its writers stopped first), or its process ran on this
    machine and is gone. One silent on another machine is dead to :func:`alive` once its timeout passed (its claims
    are taken), but it may be paused, and write when it wakes."""
    if record.get("ended") or record.get("id") in _ENDED:
        return True
    return record.get("host") == socket.gethostname() and not _running(int(record.get("pid", 0)))


def _running(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Roster:
    """The claimants of a generation as another process sees them: records read when asked (cached a moment)."""

    def __init__(self, objects: Objects, prefix: str, fresh_s: float = 0.5) -> None:
        self.objects, self.prefix, self.fresh_s = objects, prefix.rstrip("/"), fresh_s
        self._seen: dict[int, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def record(self, claimant: int) -> dict[str, Any]:
        """Claimant ``claimant``'s record ({} when there is none)."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(claimant)
            if seen is not None and now - seen[0] < self.fresh_s:
                return seen[1]
        data = self.objects.get(f"{self.prefix}/{claimant:016x}")
        record = json.loads(data) if data else {}
        with self._lock:
            self._seen[claimant] = (now, record)
        return record

    def dead(self, claimant: int) -> bool:
        """Whether ``claimant``'s claims may be taken over."""
        return not alive(self.record(claimant))

    def all(self) -> list[dict[str, Any]]:
        """Every claimant's record, the latest started last."""
        records = []
        for name in self.objects.list(self.prefix):
            data = self.objects.get(f"{self.prefix}/{name}")
            if data:
                records.append(json.loads(data))
        return sorted(records, key=lambda r: (str(r.get("started", "")), float(r.get("heartbeat", 0))))

    def live(self) -> list[dict[str, Any]]:
        return [r for r in self.all() if alive(r)]


class Claimant:
    """This process as a claimant of a generation: its record, renewed by a thread until :meth:`end`."""

    def __init__(self, objects: Objects, prefix: str, timeout_s: float, info: Mapping[str, Any],
                 still_ours: Callable[[], bool] | None = None) -> None:
        if not timeout_s > 0:  # renewed every timeout_s / 4: at 0 the thread would write without pause
            raise ValueError(f"a claimant's timeout must be > 0 s, not {timeout_s}")
        self.objects, self.prefix, self.timeout_s = objects, prefix.rstrip("/"), timeout_s
        self.id = new_id()
        self.key = f"{self.prefix}/{self.id:016x}"
        self.record = cast(ClaimantRecord, {**dict(info), "id": f"{self.id:016x}", "timeout_s": timeout_s, "shards": 0})
        self.still_ours = still_ours  # whether the generation is still the store's (read at each renewal)
        self.lost = False  # the generation is no longer the store's: this claimant stops
        self._stop: threading.Event | None = None
        self._beat: threading.Thread | None = None
        self._lock = threading.Lock()  # the record: renewals and counts from several threads

    def start(self) -> None:
        """Write the record, then renew it in the background."""
        self._write()
        stop = self._stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.timeout_s / 4):
                try:
                    if self.still_ours is not None and not self.still_ours():
                        self.lost = True
                        SUPERSEDED.add(self.prefix.split("/", 1)[0])  # the generation's name
                        log.info("%s was made again by another job: this one stops", self.objects.url)
                        return
                    self._write()
                except Exception as err:  # noqa: BLE001 - a missed renewal is tried again at the next one
                    log.debug("renewal of %s failed: %s", self.key, err)

        self._beat = threading.Thread(target=beat, name="extractor-claimant", daemon=True)
        self._beat.start()

    def check(self) -> None:
        """Raise :class:`FencedError` once the generation is no longer the store's."""
        if self.lost:
            raise FencedError(f"{self.objects.url} was made again by another job (--overwrite) while this one wrote "
                              "into it; this job stops. Look at the store with `extractor inspect`")

    def say(self, **fields: Any) -> None:
        """Add ``fields`` to the record, written now."""
        with self._lock:
            self.record.update(fields)  # type: ignore[typeddict-item]
        self._write()

    def committed(self, n: int = 1) -> None:
        with self._lock:
            self.record["shards"] = int(self.record.get("shards", 0)) + n

    def end(self, status: str, error: str | None = None, **extra: Any) -> None:
        """Stop renewing (after a renewal in flight lands) and write how the claimant ended: others no longer wait
        for it."""
        if self._stop is not None:
            self._stop.set()
            if self._beat is not None:
                self._beat.join(timeout=max(self.timeout_s, 1.0))
            self._stop = self._beat = None
        _ENDED.add(str(self.record["id"]))  # dead to this process at once, whatever the storage says
        with self._lock:
            self.record["ended"] = {"status": status, "error": error, "at": now(), **extra}
        try:
            self._write()
        except Exception as err:  # noqa: BLE001 - an unended record goes stale by itself
            log.debug("could not end %s: %s", self.key, err)

    def _write(self) -> None:
        with self._lock:
            self.record["heartbeat"] = time.time()
            data = json.dumps(redact(self.record)).encode()  # an error's URL with a password: never stored
        self.objects.put(self.key, data)
