"""The ledger: which attempt holds each shard of a store's generation, changed only by swaps (numpy only).

A shard's values become part of the store in one step, its *commit*: a swap of its entry in the ledger that names
the attempt whose objects hold them. Until then nothing an attempt writes is read by anyone: its objects lie under
a name of its own (``__attempts/<attempt>/...``, :mod:`.views`), and an entry names at most one attempt at a time.

Each shard's entry (:data:`ENTRY`)::

    claimant   the claimant (:mod:`.claimants`) computing the shard now, or that committed it (0: none)
    attempt    the attempt in flight: objects being written under its name (0: none)
    data       the attempt whose objects hold the shard's values (0: not committed: the shard reads as pending)
    rows       the attempt holding its rows' source facts (fingerprints, locators), written when they were listed
    ok, failed rows of each status, nbytes written; at: the time of the last change

Its life, each step one swap of its block (the functions below, pure, tested alone):
:func:`claim` (pending -> claimed by a claimant for an attempt; a claim of a dead claimant is taken over),
:func:`commit` (claimed -> committed: only the attempt the entry names, of the claimant that claimed it),
:func:`reset` (committed -> pending again: a redone shard), :func:`release` (a claim given up),
:func:`amend_rows` (a done shard's source facts recorded again).

A process stopped between two steps (SIGSTOP, a frozen VM) and woken after another claimant took its claim finds
the entry changed: its commit is refused, and its objects are never read. The entries are kept in blocks (shard
``s`` in block ``s % blocks``, so that writers taking shards in order change different blocks), each one small
object: readers read every block at once; the totals of rows and bytes are sums over them.
"""

from __future__ import annotations

import enum
import json
import random
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StoreError
from .objects import Objects

__all__ = [
    "ENTRY",
    "Ledger",
    "Table",
    "Verdict",
    "amend_rows",
    "blocks_for",
    "claim",
    "commit",
    "free",
    "new_id",
    "release",
    "reset",
]

ENTRY = np.dtype([("claimant", "<u8"), ("attempt", "<u8"), ("data", "<u8"), ("rows", "<u8"), ("ok", "<u4"),
                  ("failed", "<u4"), ("nbytes", "<u8"), ("at", "<f8")])
_MAGIC = b"XLDG"
MAX_BLOCKS = 256  # readers read every block: at most this many objects
SHARDS_PER_BLOCK = 16  # blocks until MAX_BLOCKS: one per this many shards
SWAP_TRIES = 200  # a block changed under this many swaps in a row: too many writers at once


def new_id() -> int:
    """A random id of a claimant or an attempt: 64 bits, never 0 (0 means none)."""
    return uuid.uuid4().int & ((1 << 64) - 1) or 1


def blocks_for(n_shards: int) -> int:
    """How many blocks a ledger of ``n_shards`` shards has (fixed when its generation is made)."""
    return max(1, min(MAX_BLOCKS, -(-n_shards // SHARDS_PER_BLOCK)))


class Verdict(enum.Enum):
    """What a step found."""

    OK = "ok"  # done
    DONE = "done"  # the shard is committed already (by another attempt): nothing to do
    TAKEN = "taken"  # a live claimant holds the shard
    LOST = "lost"  # the entry no longer names this claimant's claim or attempt: taken over, or redone


Dead = Callable[[int], bool]  # whether a claimant (by id) is gone: its claims may be taken over


def free(e: np.void, claimant: int, dead: Dead) -> Verdict:
    """Whether ``claimant`` may take the shard (OK), or not: committed (DONE), or held by a live claimant (TAKEN).
    Changes nothing."""
    if e["data"]:
        return Verdict.DONE
    holder = int(e["claimant"])
    return Verdict.TAKEN if holder not in (0, claimant) and not dead(holder) else Verdict.OK


def claim(e: np.void, claimant: int, attempt: int, dead: Dead) -> Verdict:
    """``claimant`` takes a shard for ``attempt``: a pending shard, or one its own or a dead claimant's claim holds
    (the attempt it named, abandoned, is left to the garbage collection)."""
    verdict = free(e, claimant, dead)
    if verdict is not Verdict.OK:
        return verdict
    e["claimant"], e["attempt"], e["at"] = claimant, attempt, time.time()
    return Verdict.OK


def commit(e: np.void, claimant: int, attempt: int, ok: int, failed: int, nbytes: int) -> Verdict:
    """The shard's values are ``attempt``'s: only while the entry names this claimant's claim and this attempt."""
    if int(e["claimant"]) != claimant or int(e["attempt"]) != attempt:
        return Verdict.DONE if int(e["data"]) == attempt else Verdict.LOST
    e["data"], e["attempt"], e["ok"], e["failed"], e["nbytes"], e["at"] = attempt, 0, ok, failed, nbytes, time.time()
    return Verdict.OK


def reset(e: np.void, claimant: int, dead: Dead) -> Verdict:
    """A committed shard made pending again and claimed by ``claimant`` (its images changed: it is computed again;
    the values it held are no longer read)."""
    holder = int(e["claimant"])
    if not e["data"] and holder not in (0, claimant) and not dead(holder):
        return Verdict.TAKEN
    e["data"], e["claimant"], e["attempt"], e["ok"], e["failed"], e["nbytes"] = 0, claimant, 0, 0, 0, 0
    e["at"] = time.time()
    return Verdict.OK


def release(e: np.void, claimant: int) -> Verdict:
    """``claimant`` gives up its claim of a shard it did not commit (a job stopped): others need not wait for it."""
    if int(e["claimant"]) != claimant or e["data"]:
        return Verdict.LOST
    e["claimant"], e["attempt"], e["at"] = 0, 0, time.time()
    return Verdict.OK


def amend_rows(e: np.void, rows: int, claimant: int, dead: Dead) -> Verdict:
    """The shard's rows' source facts are now ``rows``'s (a resume by ``claimant`` that found them moved, their
    images not), unless another live claimant is computing the shard."""
    holder = int(e["claimant"])
    if not e["data"] and holder not in (0, claimant) and not dead(holder):
        return Verdict.TAKEN
    e["rows"], e["at"] = rows, time.time()
    return Verdict.OK


@dataclass(frozen=True)
class Table:
    """The ledger as read at one moment: every shard's entry, in shard order."""

    entries: np.ndarray  # (shards,) ENTRY

    @property
    def done(self) -> np.ndarray:
        """Boolean per shard: committed."""
        return self.entries["data"] != 0

    def attempts(self, slot: str) -> np.ndarray:
        """Per shard, the attempt whose objects hold ``slot`` (``data`` or ``rows``; 0: none)."""
        return self.entries[slot]

    @property
    def ok_rows(self) -> int:
        """Rows ok in the committed shards (each commit records its shard's)."""
        return int(self.entries["ok"][self.done].sum(dtype=np.int64))

    @property
    def failed_rows(self) -> int:
        """Rows failed in the committed shards."""
        return int(self.entries["failed"][self.done].sum(dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return int(self.entries["nbytes"].sum(dtype=np.int64))

    def named(self) -> set[int]:
        """Every attempt an entry names (committed, in flight, or holding rows): objects of no other are garbage."""
        e = self.entries
        return {int(a) for a in np.unique(np.concatenate([e["data"], e["attempt"], e["rows"]]))} - {0}


class Ledger:
    """The ledger of generation ``generation``: ``blocks`` objects under ``prefix`` of ``objects``. Each block names
    its generation: a block copied in from another store (or generation) is refused, never read as this one's."""

    def __init__(self, objects: Objects, prefix: str, n_shards: int, blocks: int, generation: str) -> None:
        self.objects, self.prefix, self.n_shards, self.blocks = objects, prefix.rstrip("/"), n_shards, blocks
        self.generation = generation

    def key(self, block: int) -> str:
        return f"{self.prefix}/{block}"

    def shards_of(self, block: int) -> np.ndarray:
        return np.arange(block, self.n_shards, self.blocks, dtype=np.int64)

    def create(self, rows: int, data: int = 0) -> None:
        """Every block, each shard's rows held by attempt ``rows`` and the shard pending (or, ``data``, committed to
        that attempt: a store written without a job), by the generation's maker, before anything reads it."""
        for block in range(self.blocks):
            entries = np.zeros(len(self.shards_of(block)), ENTRY)
            entries["rows"], entries["data"] = rows, data
            if not self.objects.create(self.key(block), self._encode(block, entries)):
                raise StoreError(f"the ledger of {self.objects.url} exists already ({self.key(block)}): another "
                                 "process made this generation")

    def read(self) -> Table:
        """Every shard's entry as it is now (the blocks read at once on an object store)."""
        entries = np.zeros(self.n_shards, ENTRY)
        blocks = range(self.blocks)
        if self.blocks > 1 and not hasattr(self.objects, "root"):
            with ThreadPoolExecutor(min(16, self.blocks)) as pool:
                found = list(pool.map(self._read_block, blocks))
        else:
            found = [self._read_block(b) for b in blocks]
        for block, (part, _) in zip(blocks, found, strict=True):
            entries[self.shards_of(block)] = part
        return Table(entries)

    def entry(self, shard: int) -> np.void:
        """One shard's entry as it is now (its block read)."""
        return self._read_block(shard % self.blocks)[0][shard // self.blocks]

    def apply(self, shards: Iterable[int], step: Callable[[np.void, int], Verdict]) -> dict[int, Verdict]:
        """Apply ``step(entry, shard)`` to each of ``shards``, one swap per block touched (read again and redone
        whenever another writer changed the block first). Each shard's verdict; an entry is written only where its
        step said OK."""
        by_block: dict[int, list[int]] = {}
        for s in map(int, shards):
            if not 0 <= s < self.n_shards:
                raise IndexError(f"shard {s} of a ledger of {self.n_shards}")
            by_block.setdefault(s % self.blocks, []).append(s)
        out: dict[int, Verdict] = {}
        for block, mine in by_block.items():
            out.update(self._apply_block(block, mine, step))
        return out

    def step(self, shard: int, step: Callable[[np.void], Verdict]) -> Verdict:
        """One shard's step (:meth:`apply`)."""
        return self.apply([shard], lambda e, _s: step(e))[shard]

    def claim(self, shard: int, claimant: int, attempt: int, dead: Dead) -> tuple[Verdict, int, list[int]]:
        """:func:`claim` of ``shard`` for ``claimant``'s ``attempt``: its verdict, the attempt holding its rows, and
        (where it was not taken) the other shards of its block that ``claimant`` may not take either, as the same
        read found them: a process that joined a store skips them without a read of its own (processes that never
        talk learn of each other's claims a block at a time)."""
        rows, read = [0], [np.zeros(0, ENTRY)]

        def step(e: np.void, _s: int) -> Verdict:
            rows[0] = int(e["rows"])
            return claim(e, claimant, attempt, dead)

        block = shard % self.blocks
        verdict = self._apply_block(block, [shard], step, seen=read)[shard]
        if verdict is Verdict.OK:
            return verdict, rows[0], []
        others = self.shards_of(block)
        skip = [int(s) for s, e in zip(others, read[0], strict=True)
                if s != shard and free(e, claimant, dead) is not Verdict.OK]
        return verdict, rows[0], skip

    def _apply_block(self, block: int, shards: list[int], step: Callable[[np.void, int], Verdict],
                     seen: list[np.ndarray] | None = None) -> dict[int, Verdict]:
        """``seen``: given the block's entries as last read, where no step changed them."""
        for attempt in range(SWAP_TRIES):
            entries, version = self._read_block(block)
            verdicts = {s: step(entries[s // self.blocks], s) for s in shards}
            if not any(v is Verdict.OK for v in verdicts.values()):
                if seen is not None:
                    seen[:] = [entries]
                return verdicts
            if self.objects.swap(self.key(block), version, self._encode(block, entries)):
                return verdicts
            time.sleep(random.uniform(0, 0.002 * min(attempt + 1, 10)))  # another writer changed it first
        raise StoreError(f"the ledger block {self.key(block)} of {self.objects.url} changed under each of "
                         f"{SWAP_TRIES} swaps in a row: too many writers at once on one store? Run again")

    def _read_block(self, block: int) -> tuple[np.ndarray, str | None]:
        data, version = self.objects.read(self.key(block))
        if data is None:
            raise StoreError(f"the ledger of {self.objects.url} lacks its block {self.key(block)}: the store was "
                             "made again or removed since this process opened it")
        return self._decode(block, data), version

    def _encode(self, block: int, entries: np.ndarray) -> bytes:
        head = json.dumps({"generation": self.generation, "block": block, "blocks": self.blocks,
                           "shards": self.n_shards, "nonce": uuid.uuid4().hex}).encode()  # no two writes the same
        return _MAGIC + struct.pack("<I", len(head)) + head + np.ascontiguousarray(entries, ENTRY).tobytes()

    def _decode(self, block: int, data: bytes) -> np.ndarray:
        if data[:4] != _MAGIC or len(data) < 8:
            raise StoreError(f"{self.key(block)} of {self.objects.url} is not a ledger block (damaged?)")
        (n,) = struct.unpack("<I", data[4:8])
        head: Mapping[str, Any] = json.loads(data[8 : 8 + n])
        if head.get("generation") != self.generation:
            raise StoreError(f"{self.key(block)} of {self.objects.url} is a block of another store's ledger "
                             f"(generation {head.get('generation')}, not {self.generation}): copied in? It is not read")
        if head.get("blocks") != self.blocks or head.get("shards") != self.n_shards or head.get("block") != block:
            raise StoreError(f"{self.key(block)} of {self.objects.url} belongs to a ledger of another shape: {head}")
        entries = np.frombuffer(data, ENTRY, offset=8 + n).copy()
        if len(entries) != len(self.shards_of(block)):
            raise StoreError(f"{self.key(block)} of {self.objects.url} holds {len(entries)} entries, not "
                             f"{len(self.shards_of(block))} (damaged?)")
        return entries
