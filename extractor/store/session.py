"""One job's session with its store: what the job does to it, from the first read to the last write.

:class:`StoreSession` has the store's life cycle in a few verbs, in the shape of Ray Data's ``Datasink``:
decide (read only; ``extractor plan`` stops there), claim (``on_write_start``), the workers' writes (each
shard's ``ShardWriter``, opened at the session's URL with its fence), then ``on_write_complete`` or
``on_write_failed``, and ``close``. Every write goes through the job's lease (:class:`Lease`) and its fence.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .._text import count
from ..data import Rows, Shard, reuse, source
from ..errors import FencedError, StoreError
from ..spec import JobSpec
from .chunks import read_all
from .layout import (
    FAILED,
    OK,
    PENDING,
    StoreArrays,
    consolidate,
    create_store,
    done_shards,
    drop_partials,
    get_array,
    now,
    open_group,
    reset_shards,
    update_attrs,
)
from .lease import Lease, half_created, read_attrs
from .provenance import (
    Probe,
    StoreRecord,
    changed_rows,
    check_resumable,
    kept_probe,
    moved_locators,
    owner,
    store_attrs,
)
from .recorded import StoredRows
from .reuse import check_sources
from .stats import Totals, merge_shards, shard_record

__all__ = ["StoreSession", "Decision", "Outcome"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """What a job will do to its store, decided from a read of it before anything is written."""

    create: bool  # create the store (replacing what is there when ``old`` is not None), or resume it
    old: dict[str, Any] | None  # its attributes as read (None: nothing there)
    todo: list[Shard]  # the shards to compute
    redo: list[Shard] = field(default_factory=list)  # done shards whose images changed: computed again
    fingerprints: np.ndarray | None = None  # the source's, to record on resume where they changed
    locators: dict[str, np.ndarray] | None = None  # the source's locator arrays now, where it moved the bytes

    @property
    def nothing_to_do(self) -> bool:
        """A resume of a complete store: nothing is computed, and nothing written."""
        return not self.create and not self.todo and (self.old or {}).get("status") == "complete"


def decide(spec: JobSpec, rows: Rows, shards: list[Shard], attrs: StoreRecord,
            old: dict[str, Any] | None) -> Decision:
    """Whether the job may create, replace or resume the store, and what it would compute; refuses
    (another job's live lease, an existing store without --resume or --overwrite, a store made by
    another job) without writing anything."""
    url, storage = spec.output.store, spec.output.storage_options
    if old is None:
        return Decision(True, None, shards)
    Lease.check(url, storage, spec.output.lease_timeout_s)  # another job running on it: refuse, whatever the mode
    mode = spec.output.if_exists
    if old.get("status") == "creating":  # holds no data (its job is gone): --resume starts it again
        if mode == "error":
            raise StoreError(half_created(url))
        return Decision(True, old, shards)
    group = open_group(url, "r", storage)
    if mode == "error":
        n_done = int(done_shards(group).sum())
        raise StoreError(
            f"store {url} already exists ({n_done} of {old.get('n_shards', '?')} shards done, status "
            f"{old.get('status', '?')}); pass --resume to finish it or --overwrite to replace it"
        )
    if mode == "overwrite":
        return Decision(True, old, shards)
    check_resumable(url, old, json.loads(json.dumps(attrs)), group, rows.paths)
    return _resume(spec, rows, shards, old, group)


def _resume(spec: JobSpec, rows: Rows, shards: list[Shard], old: dict[str, Any], group: Any) -> Decision:
    """What resuming a store made by this job computes: the shards not done, and the done ones whose images
    changed since (refused unless output.on_change: redo)."""
    _check_labels(spec, rows, old, group)
    done = done_shards(group)
    changed, prints = changed_rows(spec, group, rows)
    hit = {r // spec.data.shard_size for r in changed}  # shards are contiguous runs of shard_size rows
    redo = [s for s in shards if done[s.index] and s.index in hit]
    if changed and spec.output.on_change != "redo":
        ids = rows.ids if rows.stored is None else get_array(group, "ids")  # rows left in the store: its ids
        named = ", ".join(f"{str(ids[r])!r}" for r in changed[:10])
        raise StoreError(
            f"cannot resume {spec.output.store}: the images of {count(len(changed), 'row')} computed before have "
            f"changed since (their content digest differs): {named}{' ...' if len(changed) > 10 else ''}. Their "
            "stored values are the old images'; resuming would mix both. Set output.on_change: redo (--set "
            "output.on_change=redo) to compute their shards again, or --overwrite"
        )
    redone = {s.index for s in redo}
    return Decision(False, old, [s for s in shards if not done[s.index] or s.index in redone], redo, prints,
                     moved_locators(group, rows))


def _check_labels(spec: JobSpec, rows: Rows, old: dict[str, Any], group: Any) -> None:
    """Refuse to resume a store whose source now gives other labels or class names (a tar's ``.cls`` rewritten, a
    manifest's label column edited): its rows keep the labels they were listed with, and a gradient of the
    label's logit used them."""
    if rows.stored is not None:  # the rows as the store lists them: nothing to compare
        return
    was = np.asarray(get_array(group, "labels")[:])
    if len(was) != len(rows):  # another listing altogether: check_resumable refused it
        return
    differ = np.flatnonzero(was != rows.labels)
    if not len(differ) and list(old.get("classes") or []) == list(rows.classes):
        return
    what = (f"the labels of {count(len(differ), 'row')} differ from the store's (first: row {differ[0]} "
            f"{rows.ids[differ[0]]!r}, {was[differ[0]]} in the store, {rows.labels[differ[0]]} now)") if len(differ) \
        else f"the class names differ from the store's ({old.get('classes')} in the store, {rows.classes} now)"
    raise StoreError(f"cannot resume {spec.output.store}: {what}; its rows keep the labels they were listed with "
                     "(and a gradient of the label's logit used them): resuming would mix both. Use --overwrite")


def _claim(spec: JobSpec, rows: Rows, decision: Decision, attrs: StoreRecord, lease: Lease) -> Any:
    """Create, replace or resume the store under the job's lease, deciding again at that moment: a
    store that appeared, was replaced or whose lease another job took since :func:`decide` read it
    is refused, naming that job. Returns the store's group (this job's from then on)."""
    url, storage = spec.output.store, spec.output.storage_options

    def unchanged() -> None:
        """The store is still the one :func:`decide` read (checked before the lease, and again under it)."""
        now_there = read_attrs(url, storage)
        if (now_there or {}).get("created") != (decision.old or {}).get("created"):
            Lease.check(url, storage, spec.output.lease_timeout_s, lease.token)  # names a live job that did it
            what = "created" if decision.old is None else "replaced"
            raise StoreError(f"store {url} was {what} by another job after this one looked at it; run again "
                             "(--resume finishes it)")

    unchanged()
    if not decision.create:
        lease.acquire()  # a live lease refuses; a stale one is taken over
        unchanged()  # a job that replaced it meanwhile and stopped: its store is not this job's to resume
        group = lease.open()  # every write from here on through the lease's fence
        reset_shards(group, [(s.index, s.start, s.stop) for s in decision.redo])  # before any new fingerprint
        if decision.fingerprints is not None:
            get_array(group, "fingerprint")[:] = decision.fingerprints
        for name, column in (decision.locators or {}).items():
            get_array(group, name)[:] = column
        update_attrs(group, status="running", resumed=now(), **({"listing": attrs["listing"]} if "listing" in
                                                                attrs else {}))  # the source as listed now
        return group
    if decision.old is not None:
        Lease.check(url, storage, spec.output.lease_timeout_s)
        log.info("%s %s", "creating again" if decision.old.get("status") == "creating" else "overwriting", url)
    arrays = StoreArrays(captures=attrs["captures"], extras=attrs["extras"], shard_size=spec.data.shard_size,
                         chunk_rows=attrs["chunk_rows"], compression=spec.output.compression,
                         compression_level=spec.output.compression_level, reuse=bool(spec.output.reuse),
                         sharded=spec.output.sharding, locators=source(spec.data.source).locators)
    return create_store(url, rows, arrays, attrs, storage, lease=lease, fresh=decision.old is None,
                        claimed=unchanged if decision.old is not None else None)


def _record_source(spec: JobSpec, decision: Decision, attrs: StoreRecord) -> None:
    """A resume with nothing to compute whose source moved but not its images (files touched, a tar rewritten with
    the same members): the source's new fingerprints, locators and listing recorded under the lease, so that the
    next resume neither reads those images again nor lists the source again. Best effort: a store that
    cannot be written (a read-only file system) keeps the old record, said in the log."""
    listing = attrs.get("listing")
    moved = listing is not None and listing != (decision.old or {}).get("listing")
    if decision.fingerprints is None and decision.locators is None and not moved:
        return
    lease = Lease(spec.output.store, spec.output.storage_options, spec.output.lease_timeout_s, owner())
    try:
        lease.acquire()
        group = lease.open()
        if decision.fingerprints is not None:
            get_array(group, "fingerprint")[:] = decision.fingerprints
        for name, column in (decision.locators or {}).items():
            get_array(group, name)[:] = column
        update_attrs(group, **({"listing": listing} if moved else {}))
        consolidate(group)
    except (OSError, StoreError) as err:
        log.info("the source of %s moved but not its images; its new fingerprints were not recorded (%s): the next "
                 "resume compares them again", spec.output.store, err)
    finally:
        lease.release()


def _mark_stopped(spec: JobSpec, group: Any, url: str, err: BaseException, totals: Totals | None) -> None:
    """Mark the store ``interrupted`` or ``failed`` with ``err`` and the statistics of the shards that
    finished; a storage that refuses (the one that failed the job may) only gets a warning."""
    status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
    try:
        stats = merge_shards(group, totals)
        update_attrs(group, status=status, error=f"{type(err).__name__}: {err}"[:1000], stats=stats)
    except Exception as mark:  # noqa: BLE001 - whatever the storage raises, its done shards are kept
        log.warning("could not mark %s %s (%s: %s); its done shards are kept", url, status, type(mark).__name__,
                    mark)


def _consolidate(spec: JobSpec, group: Any) -> None:
    """The store's metadata in one object (fast to open on object stores), written once the lease is released so
    that it holds the released lease; through the job's fence: when another job took the store at once, it is
    left to that job (a store opens without it, only slower)."""
    try:
        consolidate(group)
    except (FencedError, StoreError, OSError) as err:
        log.info("%s: metadata not consolidated (%s)", spec.output.store, err)


def _stopped(spec: JobSpec, err: BaseException, lease: Lease | None, group: Any, create: bool,
             totals: Totals | None) -> None:
    """What a job that held its store (and still does) leaves in it when ``err`` stops it: the store marked
    interrupted or failed with the shards that finished (a store stopped while being created stays "creating":
    --resume starts it again), and the command that finishes it (``err.resumable``, said by the CLI)."""
    if lease is None or not lease.held or isinstance(err, FencedError) or lease.lost:
        return  # before the store was touched, or not a word more into another job's store
    creating = create and group is None
    if group is None and not creating:  # a resume stopped while it claimed the store: its shards are kept
        try:
            group = lease.open()
        except Exception:  # noqa: BLE001 - the storage that stopped it may refuse this too: the status stays
            group = None
    if group is not None:
        _mark_stopped(spec, group, spec.output.store, err, totals)
    err.resumable = True  # type: ignore[attr-defined]  # the CLI prints the command that finishes it
    err.creating = creating  # type: ignore[attr-defined]  # and says what is left of the store


@dataclass(frozen=True)
class Outcome:
    """What the store holds once the job is over, read from it for the run's summary."""

    rows: int
    ok: int
    failed: int
    pending: int
    failures: list[tuple[int, str, str]]  # up to 20 failed rows: (row, id, error)
    nonfinite: dict[str, tuple[int, list[int]]]  # capture -> (rows holding NaN or Inf, the first of them)
    float16: list[str]  # captures stored as float16


class WriteTimeIndexes(Protocol):
    """A job's write-time feature indexes as its session meets them (``extractor.index.JobIndexes``, handed in by
    the driver: the store does not import the index)."""

    def on_write_start(self, group: Any, captures: Mapping[str, Any], n_shards: int) -> None:
        """The store is claimed: make what keeps each shard's part of each index."""

    def on_write_complete(self, group: Any) -> list[str]:
        """Every shard ran (under the lease, before the final status): merge the parts, write each index."""


class StoreSession:
    """One job's session with its store.

    :meth:`decide` reads the store and says what the job would do, writing nothing; :meth:`on_write_start` claims
    it under the job's lease (created, replaced or resumed) and returns the shards to compute; the workers write
    them, each through a ``ShardWriter`` opened at the store with :attr:`fence`; :meth:`shard_done` merges a done
    shard's statistics as it comes; :meth:`on_write_complete` writes the final status, or :meth:`on_write_failed`
    marks the store stopped; :meth:`close` releases the lease (and consolidates a completed store's metadata after
    it). A resume with nothing to do calls :meth:`unchanged` instead of claiming the store."""

    def __init__(self, spec: JobSpec, indexes: WriteTimeIndexes | None = None) -> None:
        self.spec = spec
        self.indexes = indexes  # the job's write-time feature indexes (None: a session that writes none)
        self.record: StoreRecord | None = None  # what this job records in the store (decide)
        self.decision: Decision | None = None  # decide's
        self.shards: list[Shard] = []  # the job's, all of them
        self.lease: Lease | None = None  # the job's, from on_write_start
        self.group: Any = None  # the store's root group, this job's from on_write_start
        self.totals: Totals | None = None  # done shards' statistics, merged as they come
        self._completed = False  # on_write_complete wrote the final status

    @property
    def fence(self) -> str | None:
        """The token every writer of the job checks (None before the store is claimed)."""
        return self.lease.token if self.lease is not None else None

    def recorded(self) -> dict[str, Any] | None:
        """The store's attributes as they are now (None: no store there)."""
        return read_attrs(self.spec.output.store, self.spec.output.storage_options)

    def kept_probe(self) -> Probe | None:
        """What a complete store's probe measured, where this job's model would measure the same without being built
        (:func:`~.provenance.kept_probe`); None: the job builds and probes its model."""
        return kept_probe(self.spec, self.recorded())

    def stored_rows(self, labels: bool = False) -> Rows | None:
        """The rows as the store records them, where the source is as it was listed or only parts of it changed
        (those listed again: ``data.reuse``); None: the source is listed again."""
        group = open_group(self.spec.output.store, "r", self.spec.output.storage_options)
        return reuse(self.spec.data, StoredRows(group, labels))

    def stored_chunking(self, keys: list[str]) -> dict[str, tuple[int, bool]]:
        """Rows per chunk and whether sharded, of the store's capture arrays ``keys``."""
        group = open_group(self.spec.output.store, "r", self.spec.output.storage_options)
        arrays = {k: get_array(group, k) for k in keys}
        return {k: (int(a.chunks[0]), bool(getattr(a, "shards", None))) for k, a in arrays.items()}

    def decide(self, rows: Rows, shards: list[Shard], probe: Probe, sources: bool = True) -> Decision:
        """What the job would do to the store (:func:`decide`), writing nothing; ``sources``: the stores of
        output.reuse checked first. The store record this job writes is :attr:`record` from then on."""
        spec = self.spec
        self.shards = shards
        self.record = store_attrs(spec, rows, len(shards), probe)
        if sources and spec.output.reuse:  # every store to take rows from makes them as this job would
            check_sources(spec.output.reuse, self.record, spec.output.store, spec.output.storage_options)
        self.decision = decide(spec, rows, shards, self.record,
                               read_attrs(spec.output.store, spec.output.storage_options))
        return self.decision

    def _decided(self) -> tuple[Decision, StoreRecord]:
        if self.decision is None or self.record is None:
            raise RuntimeError("StoreSession.decide comes first")
        return self.decision, self.record

    def unchanged(self) -> Outcome:
        """A resume with nothing to compute: what moved in the source recorded (best effort, :func:`_record_source`),
        nothing else written; the store's outcome as it is."""
        decision, record = self._decided()
        _record_source(self.spec, decision, record)
        self.group = open_group(self.spec.output.store, "r", self.spec.output.storage_options)
        return self._outcome(write=False)

    def on_write_start(self, rows: Rows) -> list[Shard]:
        """Claim the store under the job's lease (:func:`_claim`); the shards to compute, read again under it (a new
        store's are not read at all: on an object store a paused job's marker could land in it before this read;
        its shard is computed, and its objects replaced)."""
        decision, record = self._decided()
        spec = self.spec
        self.lease = Lease(spec.output.store, spec.output.storage_options, spec.output.lease_timeout_s, owner())
        self.group = _claim(spec, rows, decision, record, self.lease)
        if self.indexes is not None:  # write-time indexes: the arrays of their shards' parts
            self.indexes.on_write_start(self.group, record["captures"], len(self.shards))
        self.totals = Totals.kept(self.group, len(self.shards))
        done = done_shards(self.group) if not decision.create else np.zeros(len(self.shards), dtype=bool)
        return [s for s in self.shards if not done[s.index]]

    def shard_done(self, index: int) -> None:
        """Merge a done shard's statistics now (what is not merged now, the end merges)."""
        if self.totals is None:
            return
        try:
            self.totals.add(index, shard_record(self.group, index))
        except Exception as err:  # noqa: BLE001 - the end of the run merges what is not merged yet
            log.debug("statistics of shard %s not merged now: %s", index, err)

    def on_write_complete(self) -> Outcome:
        """Every shard ran: still under the lease (a job that takes the released store over never meets this one's
        last writes), the unfinished shard files of killed runs removed, then the final status and statistics. A
        storage that refuses the final attributes is a StoreError that says the shards are kept."""
        if self.lease is None:
            raise RuntimeError("StoreSession.on_write_start comes first")
        self.lease.verify()  # a job paused past its lease marks nothing complete in another job's store
        # every writer of this job done: what runs killed mid-shard left goes
        if drop_partials(self.group):
            log.info("removed the unfinished shard files of an earlier run of %s", self.spec.output.store)
        try:
            outcome = self._outcome(write=True)
        except StoreError:
            raise
        except OSError as err:  # every shard is done; only the final attributes could not be written
            raise StoreError(f"cannot write the final attributes of {self.spec.output.store}: {type(err).__name__}: "
                             f"{err}; its shards are done and kept: --resume finishes it once the storage works") \
                from err
        self._completed = True
        return outcome

    def on_write_failed(self, err: BaseException) -> None:
        """``err`` stopped the job: the store marked as :func:`_stopped` says, when this job holds it."""
        create = self.decision is not None and self.decision.create
        _stopped(self.spec, err, self.lease, self.group, create, self.totals)

    def close(self) -> None:
        """Release the lease; a completed store's metadata is then consolidated (holding the released lease)."""
        if self.lease is not None:
            self.lease.release()
        if self._completed:
            _consolidate(self.spec, self.group)

    def _outcome(self, write: bool) -> Outcome:
        """The store's rows as they ended; with ``write``, its final status and statistics (a resume with nothing
        to do reads them as they are)."""
        group = self.group
        status = read_all(get_array(group, "status"))
        failed_rows = np.flatnonzero(status == FAILED)
        failures = []
        if len(failed_rows):
            ids = group["ids"]
            errors = group["errors"]
            for r in failed_rows[:20]:
                failures.append((int(r), str(ids[int(r)]), str(errors[int(r)])))
        n_pending = int((status == PENDING).sum())
        if write:
            complete = bool(done_shards(group).all())
            stats = merge_shards(group, self.totals)
            if self.indexes is not None:  # write-time feature indexes: their shards' parts merged
                self.indexes.on_write_complete(group)
            update_attrs(group, status="complete" if complete else "incomplete", error=None, stats=stats)
        else:
            stats = dict(group.attrs["extractor"].get("stats") or {})
        return Outcome(
            rows=len(status),
            ok=int((status == OK).sum()),
            failed=len(failed_rows),
            pending=n_pending,
            failures=failures,
            nonfinite={k: (v["nonfinite_rows"], v["first_nonfinite_rows"]) for k, v in stats.items()
                       if v["nonfinite_rows"]},
            float16=[k for k, m in group.attrs["extractor"]["captures"].items() if m["dtype"] == "float16"],
        )
