"""A store's generations: what its head names, and what one generation holds besides its arrays (numpy and zarr
only).

A store is a sequence of generations. Its *head*, the root's ``zarr.json``, names the live one; making the store
(again, with ``--overwrite``) is one swap of the head to a new generation, whose objects all lie under its own
name (``<url>/<generation>/...``). So no write or removal meant for one generation ever touches another's
objects: a job paused while it removed an old generation's objects removes, once woken, only those; one paused
while it wrote shards writes them into a generation no longer read. A generation other than the head's is garbage,
removed by the next job that makes or finishes the store.

Within a generation (``<url>/<generation>/``)::

    __root.json                   its root group's metadata (zarr reads it as the root's ``zarr.json`` through the
                                  store's view; a plain reader finds no group here): the job's record (spec, model,
                                  captures, ...) and, consolidated, every array's metadata; written last when the
                                  generation is made (absent: being made)
    <array>/zarr.json, ...        the arrays (:mod:`.layout`); chunks of shards under their attempts (:mod:`.views`)
    __attempts/<attempt>/...      each attempt's objects
    __txn/ledger/<block>          the ledger (:mod:`.ledger`): which attempt holds each shard
    __txn/claimants/<claimant>        the processes writing into it (:mod:`.claimants`)
    __txn/listing                 the source's listing as last recorded (a swap)
    __txn/final                   written once, when every shard is committed: the merged statistics

Its state as readers see it (``status``, ``stats``, ...) is read from those (:meth:`Generation.state`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from ..errors import StoreError
from .claimants import Roster, alive, gone
from .ledger import Ledger, Table
from .objects import LOCK, Objects
from .views import ROOT, GenerationStore, read_view

__all__ = [
    "FORMAT",
    "TXN",
    "Generation",
    "Head",
    "collect_others",
    "done_shards",
    "open_group",
    "read_head",
    "read_state",
    "swap_head",
]

log = logging.getLogger(__name__)

_GENERATION = re.compile(r"[0-9a-f]{16}")  # a generation's name
FORMAT = 2  # the store format whose head names a generation (1: the arrays at the root, before December 2026)
HEAD = "zarr.json"
TXN = "__txn"
ATTR = "extractor"


@dataclass(frozen=True)
class Head:
    """The store's root as read: its format, the generation it names (format 2), its attributes, and the version
    it was read at (a swap of the head is conditional on it)."""

    format_version: int
    generation: str | None
    attrs: dict[str, Any]
    version: str | None


def read_head(objects: Objects) -> Head | None:
    """The store's head (None: nothing at the URL). A root that is not an extractor store is a StoreError: a local
    folder of other things, a Zarr store of other attributes (extractor never writes into, nor removes, what it did
    not make)."""
    try:
        data, version = objects.read(HEAD)
    except (StoreError, PermissionError):
        raise
    except Exception as err:
        raise StoreError(f"cannot open {objects.url} as a Zarr group: {type(err).__name__}: {err}; check the store's "
                         "URL and storage_options (endpoint_url, credentials) and that the storage answers") from err
    if data is None:
        _nothing_there(objects)
        return None
    try:
        meta = json.loads(data)
        attrs = dict((meta.get("attributes") or {}).get(ATTR) or {})
    except (ValueError, AttributeError, TypeError) as err:
        raise StoreError(f"{objects.url} holds a zarr.json that is not Zarr metadata ({err}); choose another "
                         "output.store (extractor never deletes what it did not create)") from None
    if not attrs:
        raise StoreError(f"{objects.url} is a Zarr store not written by extractor; choose another output.store "
                         "(extractor never deletes stores it did not create)")
    fmt = int(attrs.get("format_version", 1))
    return Head(fmt, str(attrs["generation"]) if fmt >= FORMAT and attrs.get("generation") else None, attrs, version)


def _nothing_there(objects: Objects) -> None:
    """Where no head is: a local path that is a file, or a folder holding more than the lock file and what a make
    cut short left, is refused (it is something else)."""
    root = getattr(objects, "root", None)
    if root is None or not os.path.exists(root):
        return
    if not os.path.isdir(root):
        raise StoreError(f"{objects.url} exists and is a file, not a Zarr store; choose another output.store "
                         "(extractor never deletes a file it did not create)")
    if [n for n in os.listdir(root) if n != LOCK and not n.endswith(".tmp")]:
        raise StoreError(f"{objects.url} exists and is a folder, not a Zarr store; choose another output.store "
                         "(extractor never deletes a folder it did not create)")


def swap_head(objects: Objects, was: Head | None, created: str) -> str:
    """Make a new generation the store's (the head swapped from ``was``, as read; absent: created); its name.
    StoreError when the head changed since ``was`` was read: another job made the store meanwhile."""
    generation = uuid.uuid4().hex[:16]
    attrs = {"format_version": FORMAT, "generation": generation, "created": created, "nonce": uuid.uuid4().hex}
    data = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {ATTR: attrs}}).encode()
    if not objects.swap(HEAD, was.version if was is not None else None, data):
        what = "created" if was is None else "replaced"
        raise StoreError(f"store {objects.url} was {what} by another job after this one looked at it; run again "
                         "(--resume finishes it)")
    return generation


class Generation:
    """One generation of the store under ``objects``: its name, ledger, claimants and records."""

    def __init__(self, objects: Objects, name: str) -> None:
        self.objects, self.name = objects, name
        self.roster = Roster(objects, f"{name}/{TXN}/claimants")
        self._root: dict[str, Any] | None = None

    @classmethod
    def of(cls, objects: Objects, head: Head) -> Generation:
        if head.generation is None:
            raise StoreError(f"{objects.url} is a store of format {head.format_version}, not {FORMAT}")
        return cls(objects, head.generation)

    def key(self, key: str) -> str:
        return f"{self.name}/{key}"

    def txn(self, key: str) -> str:
        return f"{self.name}/{TXN}/{key}"

    @property
    def claimants_prefix(self) -> str:
        return self.txn("claimants")

    # what is written once

    def root(self) -> dict[str, Any] | None:
        """The extractor attributes of the generation's root (None: still being made)."""
        if self._root is None:
            data = self.objects.get(self.key(ROOT))
            if data is None:
                return None
            self._root = dict((json.loads(data).get("attributes") or {}).get(ATTR) or {})
        return self._root

    def made(self) -> bool:
        """Whether the generation is made: its root written, and its rows (a generation whose rows are written
        behind its making, :class:`~.layout.RowsBehind`, records ``rows_written`` false until they are all in it)."""
        root = self.root()
        if root is not None and root.get("rows_written") is False:
            self._root = None  # read again: its record is rewritten once its rows are written
            root = self.root()
        return root is not None and root.get("rows_written") is not False

    def ledger(self) -> Ledger:
        root = self.root()
        if root is None:
            raise StoreError(f"store {self.objects.url} is still being made (generation {self.name})")
        return Ledger(self.objects, self.txn("ledger"), int(root["n_shards"]), int(root["ledger_blocks"]), self.name)

    def final(self) -> dict[str, Any] | None:
        """The record written once every shard was committed (None: not yet)."""
        data = self.objects.get(self.txn("final"))
        return json.loads(data) if data else None

    def leave_partial(self, claimant: int, totals: bytes, shards: int | None = None) -> str:
        """A claimant's statistics of the shards it committed (``Totals.to_bytes``), left for whoever merges them all
        (written once, under its own name; ``shards``: a checkpoint of that many, named by their number). Its key."""
        key = self.txn(f"partials/{claimant:016x}" + (f".{shards:010d}" if shards is not None else ""))
        self.objects.create(key, totals)
        return key

    def remove_partial(self, key: str) -> None:
        """A claimant's earlier checkpoint, which its next holds (what cannot be removed is refused by the merge as
        overlapping, and goes with the generation)."""
        with contextlib.suppress(OSError):
            self.objects.remove(key)

    def partials(self, but: int | None = None) -> list[bytes]:
        """The statistics the claimants (but ``but``) left (:meth:`leave_partial`), as they wrote them."""
        out = []
        for name in self.objects.list(self.txn("partials")):
            if but is not None and name.split(".", 1)[0] == f"{but:016x}":
                continue
            data = self.objects.get(self.txn(f"partials/{name}"))
            if data:
                out.append(data)
        return out

    def finish(self, record: Mapping[str, Any]) -> bool:
        """Write the final record (once: False where another process wrote it first)."""
        data = json.dumps({**dict(record), "nonce": uuid.uuid4().hex}).encode()
        return self.objects.create(self.txn("final"), data)

    # what changes

    def listing(self) -> tuple[dict[str, Any] | None, str | None]:
        """The source's listing as last recorded, and the version it was read at."""
        data, version = self.objects.read(self.txn("listing"))
        return (json.loads(data).get("listing") if data else None), version

    def record_listing(self, listing: Mapping[str, Any] | None, version: str | None) -> bool:
        """Record the source's listing, if it is still at ``version`` (False otherwise)."""
        data = json.dumps({"listing": listing, "nonce": uuid.uuid4().hex}).encode()
        return self.objects.swap(self.txn("listing"), version, data)

    def take_rows(self, claimant: int) -> int | None:
        """Take the next turn at writing this half-made generation's rows again (its maker's turn gone): the turns
        are create-only objects, numbered, so the storage lets one process have each; the next is taken only once
        the holder of the last is gone (:func:`~.claimants.gone`: ended, or its process gone from this machine).
        None where ``claimant`` took it; else the claimant whose turn it is. (Two resumes that both found the
        writers gone, one paused between its look and its record, chose by their records' start times before:
        both could write.)"""
        turns = self.rows_turns()
        if turns:
            holder = turns[-1][1]
            record = json.loads(self.objects.get(f"{self.claimants_prefix}/{holder:016x}") or b"{}")  # (as it is now)
            if holder != claimant and record and not gone(record):
                return holder
        name = f"{turns[-1][0] + 1 if turns else 0:08d}"
        if self.objects.create(self.txn(f"rows-turns/{name}"), f"{claimant:016x}".encode()):
            return None
        return int(self.objects.get(self.txn(f"rows-turns/{name}")) or b"0", 16)

    def rows_turns(self) -> list[tuple[int, int]]:
        """The turns taken at writing the rows again (:meth:`take_rows`), in order: each one's number and holder
        (a local store's creates leave their temporary files beside them a moment, or for good where killed
        between: not turns)."""
        numbers = sorted(int(t) for t in self.objects.list(self.txn("rows-turns")) if len(t) == 8 and t.isdigit())
        return [(n, int(self.objects.get(self.txn(f"rows-turns/{n:08d}")) or b"0", 16)) for n in numbers]

    def still_live(self) -> bool:
        """Whether this generation is still the one the store's head names."""
        head = read_head(self.objects)
        return head is not None and head.generation == self.name

    def state(self, table: Table | None = None) -> dict[str, Any]:
        """The generation's record as readers see it: its root's attributes with its state now: ``status``
        (creating, running, complete, incomplete, interrupted, failed), ``stats``, ``updated``, ``error``,
        ``listing`` and the ``generation``'s name."""
        if not self.made():  # (a root whose rows are not all written: its record as far as it goes)
            return {**(self.root() or {}), "status": "creating", "format_version": FORMAT, "generation": self.name}
        attrs = dict(self.root() or {})
        final = self.final()
        listing, _ = self.listing()
        if listing is not None:
            attrs["listing"] = listing
        attrs["generation"] = self.name
        if final is not None:
            attrs.update(status="complete", stats=final.get("stats") or {}, updated=final.get("at"), error=None)
            return attrs
        attrs.update(_unfinished(self.roster.all()))
        return attrs

    def being_made(self) -> str:
        """What to say of a generation not made yet: being made by a live job now, or left half-made."""
        live = self.roster.live()
        if live:
            m = live[0]
            return (f"store {self.objects.url} is being created by another extractor job now: pid {m.get('pid')} on "
                    f"{m.get('host')} (user {m.get('user')}, started {m.get('started')}); open it once that job has "
                    "created it")
        ended = [m["ended"] for m in self.roster.all() if m.get("ended")]  # (the latest started last)
        if ended and ended[-1].get("remake"):  # its listing found what the store was not made for: no resume can
            error = str(ended[-1].get("error") or "").split(": ", 1)[-1].rstrip(".")
            return (f"store {self.objects.url} was left half-created by a run whose listing stopped it ({error}); "
                    f"the store was made for {ended[-1]['remake']}: once fixed, run the job again with --overwrite")
        return (f"store {self.objects.url} was left half-created by a run that failed while creating it (or while "
                "writing its rows' arrays): run the job again with --resume (it writes the rows again and keeps the "
                "shards finished meanwhile) or --overwrite")

    def open(self, table: Table | None = None) -> zarr.Group:
        """The generation's root group, read as ``table`` (default: the ledger now) names its shards' attempts."""
        table = table if table is not None else self.ledger().read()
        view = read_view(self.objects.zarr_store(self.name), table, self.state(table), self.objects.url,
                         missing=self._missing)
        return zarr.open_group(store=view, mode="r")

    def _missing(self, key: str) -> None:
        """A committed shard's object is not there: the store was made again since this generation was opened (an
        error: its values are gone), or it was removed by hand (read as fill values; ``inspect --verify`` names
        it)."""
        if not self.still_live():
            raise StoreError(f"{self.objects.url} was made again (or removed) since it was opened (its generation "
                             f"{self.name} is gone): open it again")

    # garbage

    def collect(self) -> int:
        """Remove the objects of attempts the ledger does not name (failed, abandoned or superseded ones): listed
        first, the ledger read after, so an attempt that is named when the ledger is read is kept. How many."""
        listed = self.objects.list(self.key("__attempts"))
        named = {f"{a:016x}" for a in self.ledger().read().named()}
        garbage = [name for name in listed if name not in named]
        for name in garbage:
            self.objects.remove(self.key(f"__attempts/{name}"))
        return len(garbage)


def _unfinished(claimants: list[dict[str, Any]]) -> dict[str, Any]:
    """The state of a generation not finished, from its claimants' records (the latest started last): ``running``
    while one lives (or when all went without a word: killed), else how the last one ended, with the statistics of
    the last run that merged them (none: a run killed before it)."""
    ended = [m for m in claimants if m.get("ended")]
    state: dict[str, Any] = {}
    if any(alive(m) for m in claimants) or (claimants and not ended):
        state["status"] = "running"
    elif ended:
        last = ended[-1]["ended"]
        state.update(status=str(last.get("status") or "incomplete"), error=last.get("error"), updated=last.get("at"))
    else:
        state["status"] = "incomplete"
    with_stats = [m for m in ended if m["ended"].get("stats") is not None]
    if with_stats:
        state["stats"] = with_stats[-1]["ended"]["stats"]
    if len(claimants) > 1:
        state["resumed"] = claimants[-1].get("started")
    return state


def collect_others(objects: Objects, generation: str, legacy: bool = False) -> int:
    """Remove the other generations under the store's URL (names of 16 hex digits, and temporary files of cut-short
    writes; ``legacy``: everything but the head and the lock file, the arrays of a store of format 1 this one
    replaced), ``generation`` being the head's (read after the listing). How many names were removed."""
    listed = objects.list("")
    head = read_head(objects)
    if head is None or head.generation != generation:
        return 0  # another job's store now: not this one's to clean
    garbage = [name for name in listed if name not in (HEAD, LOCK, generation)
               and (legacy or _GENERATION.fullmatch(name) or name.endswith(".tmp"))]
    for name in garbage:
        objects.remove(name)
    return len(garbage)


def open_group(url: str, storage_options: Mapping[str, Any] | None = None) -> zarr.Group:
    """The store's root group for reading: its live generation as its ledger names it now (format 2), or the store
    itself (format 1). FileNotFoundError where nothing is; StoreError where it is not an extractor store, or still
    being made."""
    objects = Objects.at(url, storage_options)
    head = read_head(objects)
    if head is None:
        raise FileNotFoundError(url)
    if head.generation is None:  # format 1: the arrays at the root
        kwargs: dict[str, Any] = {"mode": "r", "use_consolidated": False}
        if storage_options:
            kwargs["storage_options"] = dict(storage_options)
        return zarr.open_group(url, **kwargs)
    generation = Generation(objects, head.generation)
    if not generation.made():
        raise StoreError(generation.being_made())
    return generation.open()


def read_state(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The store's extractor attributes as readers see them (format 2: its live generation's state; format 1: its
    root's attributes), None when nothing is at ``url``."""
    objects = Objects.at(url, storage_options)
    head = read_head(objects)
    if head is None:
        return None
    if head.generation is None:
        return dict(head.attrs)
    return Generation(objects, head.generation).state()


def committed_attempts(group: zarr.Group) -> np.ndarray:
    """Per shard, the attempt its commit names (0: not committed), in the ledger the group was opened at (a group
    opened otherwise: zeros)."""
    store = group.store
    if isinstance(store, GenerationStore) and store.table is not None:
        return np.asarray(store.table.attempts("data"), dtype=np.uint64)
    return np.zeros(len(done_shards(group)), np.uint64)


def done_shards(group: zarr.Group) -> np.ndarray:
    """Boolean per shard: committed (format 2: in the ledger the group was opened at; format 1: its done markers)."""
    store = group.store
    if isinstance(store, GenerationStore) and store.table is not None:
        return np.asarray(store.table.done)
    from .chunks import read_all

    return np.asarray(read_all(group["shard_done"]), dtype=bool)  # type: ignore[arg-type]
