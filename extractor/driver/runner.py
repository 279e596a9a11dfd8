"""Planning and running a job: list rows, plan shards, create or resume the store, run shards.

``run(spec)`` is the whole job on one machine (the ``local`` backend: the worker runs in this
process). The driver only ever holds shard descriptors and done flags, never activations.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .._text import count, table
from ..compute import ShardSummary, Worker
from ..data import Rows, Shard, absolute, list_rows, plan, tar_listing
from ..errors import DataError, FencedError, StoreError
from ..spec import JobSpec
from ..store import (
    FAILED,
    OK,
    PENDING,
    Lease,
    Probe,
    StoreArrays,
    Totals,
    changed_rows,
    check_resumable,
    check_sources,
    consolidate,
    create_store,
    done_shards,
    drop_partials,
    get_array,
    half_created,
    merge_shards,
    moved_members,
    now,
    open_group,
    owner,
    read_attrs,
    reset_shards,
    shard_record,
    store_attrs,
    stored_rows,
    update_attrs,
)
from ..store.feature_index import ensure_parts, finish_indexes, indexed

__all__ = ["run", "RunSummary", "Backend", "LocalBackend"]

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
Event = Callable[[str, dict[str, Any]], None]


@dataclass
class RunSummary:
    """What a run did; ``failures`` lists up to 20 failed rows as (row, id, error)."""

    store: str
    rows: int
    ok: int
    failed: int
    pending: int
    shards: int
    shards_skipped: int
    shards_run: int
    seconds: float  # the whole run: listing, model, store, shards, final attributes
    images_per_s: float  # rows processed over ``seconds``: the job's rate, end to end
    compute_images_per_s: float = 0.0  # rows processed over the time the shards ran
    bytes_per_row: dict[str, int] = field(default_factory=dict)
    failures: list[tuple[int, str, str]] = field(default_factory=list)
    per_shard: list[ShardSummary] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    nonfinite: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # key -> (rows, first rows)
    float16: list[str] = field(default_factory=list)  # captures stored as float16 (their Inf may be an overflow)
    reused: int = 0  # rows copied from other stores (output.reuse), not computed

    @property
    def all_failed(self) -> bool:
        """Every row failed: nothing usable was stored (a script must not go on)."""
        return bool(self.rows) and not self.ok and not self.pending

    def report(self) -> str:
        """What ``extractor run`` prints when a run ends: rows, shards, time, the worker table,
        NaN/Inf and failed rows."""
        lines = [
            f"{self.store}: {self.ok} ok, {self.failed} failed, {self.pending} pending rows; "
            f"{count(self.shards_run, 'shard')} run, {self.shards_skipped} already done; {self.seconds:.1f} s"
            + (f", {self.images_per_s:.1f} images/s end to end ({self.compute_images_per_s:.1f} while the shards "
               "ran)" if self.shards_run else "")
            + (f"; {count(self.reused, 'row')} taken from other stores (output.reuse)" if self.reused else "")
        ]
        if self.workers and self.shards_run:
            rows = [[str(w["worker"]), ",".join(w["nodes"]) or "-", ",".join(map(str, w["pids"])), str(w["shards"]),
                     str(w["images"]), f"{w['images_per_s']:.1f}", str(w["restarts"]), str(w["retries"])]
                    for w in self.workers]
            lines.append(table(rows, ["worker", "node", "pids", "shards", "images", "compute img/s", "restarts",
                                      "retries"]))
            lines.append("(compute img/s: a worker's images over the seconds its shards took, start to done marker)")
        for key, (rows_, first) in self.nonfinite.items():
            if key in self.float16:
                lines.append(f"warning: {count(rows_, 'row')} of {key} hold NaN or Inf; {key} is stored as float16, "
                             f"where finite values beyond +-65,504 become Inf (an overflow, unless the model gives Inf "
                             f"itself): set its capture's dtype: float32. First rows: {first[:10]}")
            else:
                lines.append(f"warning: {count(rows_, 'row')} of {key} hold NaN or Inf (stored as computed); first "
                             f"rows: {first[:10]}")
        if self.failures:
            lines.append(f"failed rows ({self.failed}):")
            lines += [f"  row {row} {id_}: {err}" for row, id_, err in self.failures]
            if self.failed > len(self.failures):
                lines.append(f"  ... and {self.failed - len(self.failures)} more (see the store's errors array)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["per_shard"] = [s.to_dict() for s in self.per_shard]
        return d


@dataclass(frozen=True)
class _Decision:
    """What a job will do to its store, decided from a read of it before anything is written."""

    create: bool  # create the store (replacing what is there when ``old`` is not None), or resume it
    old: dict[str, Any] | None  # its attributes as read (None: nothing there)
    todo: list[Shard]  # the shards to compute
    redo: list[Shard] = field(default_factory=list)  # done shards whose images changed: computed again
    fingerprints: np.ndarray | None = None  # the source's, to record on resume where they changed
    places: tuple[np.ndarray, np.ndarray] | None = None  # tar members' offsets and sizes now, where they moved

    @property
    def nothing_to_do(self) -> bool:
        """A resume of a complete store: nothing is computed, and nothing written."""
        return not self.create and not self.todo and (self.old or {}).get("status") == "complete"


def _decide(spec: JobSpec, rows: Rows, shards: list[Shard], attrs: dict[str, Any],
            old: dict[str, Any] | None) -> _Decision:
    """Whether the job may create, replace or resume the store, and what it would compute; refuses
    (another job's live lease, an existing store without --resume or --overwrite, a store made by
    another job) without writing anything."""
    url, storage = spec.output.store, spec.output.storage_options
    if old is None:
        return _Decision(True, None, shards)
    Lease.check(url, storage, spec.output.lease_timeout_s)  # another job running on it: refuse, whatever the mode
    mode = spec.output.if_exists
    if old.get("status") == "creating":  # holds no data (its job is gone): --resume starts it again
        if mode == "error":
            raise StoreError(half_created(url))
        return _Decision(True, old, shards)
    group = open_group(url, "r", storage)
    if mode == "error":
        n_done = int(done_shards(group).sum())
        raise StoreError(
            f"store {url} already exists ({n_done} of {old.get('n_shards', '?')} shards done, status "
            f"{old.get('status', '?')}); pass --resume to finish it or --overwrite to replace it"
        )
    if mode == "overwrite":
        return _Decision(True, old, shards)
    check_resumable(url, old, json.loads(json.dumps(attrs)), group, rows.paths)
    return _resume(spec, rows, shards, old, group)


def _resume(spec: JobSpec, rows: Rows, shards: list[Shard], old: dict[str, Any], group: Any) -> _Decision:
    """What resuming a store made by this job computes: the shards not done, and the done ones whose images
    changed since (refused unless output.on_change: redo)."""
    _check_labels(spec, rows, old, group)
    done = done_shards(group)
    changed, prints = changed_rows(spec, group, rows)
    hit = {r // spec.data.shard_size for r in changed}  # shards are contiguous runs of shard_size rows
    redo = [s for s in shards if done[s.index] and s.index in hit]
    if changed and spec.output.on_change != "redo":
        named = ", ".join(f"{rows.ids[r]!r}" for r in changed[:10])
        raise StoreError(
            f"cannot resume {spec.output.store}: the images of {count(len(changed), 'row')} computed before have "
            f"changed since (their content digest differs): {named}{' ...' if len(changed) > 10 else ''}. Their "
            "stored values are the old images'; resuming would mix both. Set output.on_change: redo (--set "
            "output.on_change=redo) to compute their shards again, or --overwrite"
        )
    redone = {s.index for s in redo}
    return _Decision(False, old, [s for s in shards if not done[s.index] or s.index in redone], redo, prints,
                     moved_members(group, rows))


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


def _claim(spec: JobSpec, rows: Rows, decision: _Decision, attrs: dict[str, Any], lease: Lease) -> Any:
    """Create, replace or resume the store under the job's lease, deciding again at that moment: a
    store that appeared, was replaced or whose lease another job took since :func:`_decide` read it
    is refused, naming that job. Returns the store's group (this job's from then on)."""
    url, storage = spec.output.store, spec.output.storage_options

    def unchanged() -> None:
        """The store is still the one :func:`_decide` read (checked before the lease, and again under it)."""
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
        if decision.places is not None:
            get_array(group, "byte_offset")[:], get_array(group, "byte_size")[:] = decision.places
        update_attrs(group, status="running", resumed=now(), **({"listing": attrs["listing"]} if "listing" in
                                                                attrs else {}))  # the tars as listed now
        return group
    if decision.old is not None:
        Lease.check(url, storage, spec.output.lease_timeout_s)
        log.info("%s %s", "creating again" if decision.old.get("status") == "creating" else "overwriting", url)
    arrays = StoreArrays(captures=attrs["captures"], extras=attrs["extras"], shard_size=spec.data.shard_size,
                         chunk_rows=attrs["chunk_rows"], compression=spec.output.compression,
                         compression_level=spec.output.compression_level, reuse=bool(spec.output.reuse),
                         sharded=spec.output.sharding)
    return create_store(url, rows, arrays, attrs, storage, lease=lease, fresh=decision.old is None,
                        claimed=unchanged if decision.old is not None else None)


def _record_source(spec: JobSpec, decision: _Decision, attrs: dict[str, Any]) -> None:
    """A resume with nothing to compute whose source moved but not its images (files touched, a tar rewritten with
    the same members): the source's new fingerprints, member places and tar listing recorded under the lease, so
    that the next resume neither reads those images again nor lists the tars again. Best effort: a store that
    cannot be written (a read-only file system) keeps the old record, said in the log."""
    listing = attrs.get("listing")
    moved = listing is not None and listing != (decision.old or {}).get("listing")
    if decision.fingerprints is None and decision.places is None and not moved:
        return
    lease = Lease(spec.output.store, spec.output.storage_options, spec.output.lease_timeout_s, owner())
    try:
        lease.acquire()
        group = lease.open()
        if decision.fingerprints is not None:
            get_array(group, "fingerprint")[:] = decision.fingerprints
        if decision.places is not None:
            get_array(group, "byte_offset")[:], get_array(group, "byte_size")[:] = decision.places
        update_attrs(group, **({"listing": listing} if moved else {}))
        consolidate(group)
    except (OSError, StoreError) as err:
        log.info("the source of %s moved but not its images; its new fingerprints were not recorded (%s): the next "
                 "resume compares them again", spec.output.store, err)
    finally:
        lease.release()


def _check_targets(spec: JobSpec, rows: Rows, logits: int | None) -> None:
    """``target: label`` differentiates each row's label's logit: every row needs a label, and
    one the model has an output for."""
    if any(c.gradient and c.score_target == "label" for c in spec.capture):
        missing = np.flatnonzero(rows.labels < 0)
        if len(missing):
            raise DataError(
                f"target: label needs a label on every row, but {len(missing)} rows have none "
                f"(first: {rows.ids[missing[0]]}); use target: predicted or a class index"
            )
        beyond = np.flatnonzero(rows.labels >= logits) if logits is not None else np.zeros(0, np.int64)
        if len(beyond) and logits is not None:
            first = beyond[0]
            raise DataError(
                f"target: label needs labels the model has outputs for (0 to {logits - 1}), but {len(beyond)} rows "
                f"have larger ones (first: {rows.ids[first]}, label {rows.labels[first]}). Labels must be the "
                "model's class indices; use target: predicted or a class index"
            )


class Backend(Protocol):
    """Where a job's shards run: :class:`LocalBackend` (this process) or ``RayBackend`` (one actor per GPU).
    Built with the job's spec; its workers build the model and resolve every layer before any image is read."""

    def probe(self) -> Probe:
        """What one blank image measured (every worker measures the same)."""

    def warm_up(self) -> None:
        """Compile the model where the job compiles it; called only when there are shards to compute."""

    def run(self, todo: list[Shard], url: str, on_progress: Progress, on_event: Event,
            fence: str | None = None) -> list[ShardSummary]:
        """Compute and write the shards ``todo`` into the store at ``url``, writing nothing once ``fence`` (the
        job's lease token) is no longer the store's; returns the summaries of the shards done."""

    def close(self) -> None:
        """Stop the workers (a no-op when done twice)."""


class LocalBackend:
    """The worker in this process: shards run one after another."""

    def __init__(self, spec: JobSpec, worker: Worker | None = None) -> None:
        # builds the model and resolves every layer before any image is read
        self.worker = worker if worker is not None else Worker(spec)

    def probe(self) -> Probe:
        return self.worker.probe()

    def warm_up(self) -> None:
        self.worker.warm_up()

    def run(self, todo: list[Shard], url: str, on_progress: Progress, on_event: Event,
            fence: str | None = None) -> list[ShardSummary]:
        summaries: list[ShardSummary] = []
        processed = [0]
        pid = os.getpid()

        def on_batch(n: int) -> None:
            processed[0] += n
            on_progress(processed[0])

        on_event("worker_started", {"worker": 0, "pid": pid})
        finishing: deque[tuple[Shard, Future[ShardSummary]]] = deque()

        def report(keep: int) -> None:
            """Report the shards whose done marker is written; wait while more than ``keep`` are not."""
            while finishing and (len(finishing) > keep or finishing[0][1].done()):
                shard, future = finishing.popleft()
                summary = future.result()
                on_event("shard_done", {"shard": shard.index, "worker": 0, "summary": summary})
                summaries.append(summary)

        def computed(shard: Shard, future: Future[ShardSummary]) -> None:
            # a shard's last writes and done marker are stored while the next one computes
            finishing.append((shard, future))
            report(keep=1)

        try:
            self.worker.run_shards(
                todo, url, on_batch=on_batch, on_computed=computed,
                on_started=lambda shard: on_event("shard_started", {"shard": shard.index, "worker": 0, "pid": pid}),
                fence=fence,
            )
            report(keep=0)
        except BaseException:
            for shard, future in finishing:  # what was computed is still written before the error goes up
                if future.exception() is None:
                    on_event("shard_done", {"shard": shard.index, "worker": 0, "summary": future.result()})
                    summaries.append(future.result())
            raise
        return summaries

    def close(self) -> None:
        self.worker.close()


def _backend(spec: JobSpec) -> Backend:
    if spec.cluster.backend == "local":
        return LocalBackend(spec)
    from .ray_backend import RayBackend

    return RayBackend(spec)


def _worker_table(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per worker slot: shards, images, seconds, images/s, restarts (its process replaced) and
    retries (shards that failed on it and counted a retry), from the event log."""
    table: dict[int, dict[str, Any]] = {}
    for name, info in events:
        if "worker" not in info:
            continue
        row = table.setdefault(info["worker"], {"worker": info["worker"], "pids": [], "nodes": [], "shards": 0,
                                                "images": 0, "seconds": 0.0, "restarts": 0, "retries": 0})
        if name == "worker_started" and info["pid"] not in row["pids"]:
            row["pids"].append(info["pid"])
            if info.get("node") and info["node"] not in row["nodes"]:
                row["nodes"].append(info["node"])
        elif name == "shard_done":
            s = info["summary"]
            row["shards"] += 1
            row["images"] += s.rows
            row["seconds"] += s.seconds
        elif name == "shard_failed":
            row["retries"] += 1
        elif name == "worker_died":
            row["restarts"] += 1
            row["retries"] += info.get("charged") is not None
    for row in table.values():
        row["images_per_s"] = row["images"] / row["seconds"] if row["seconds"] else 0.0
    return [table[k] for k in sorted(table)]


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


def _compute(spec: JobSpec, backend: Backend, todo: list[Shard], on_progress: Progress, on_event: Event,
             lease: Lease, group: Any) -> list[ShardSummary]:
    """Run the shards ``todo`` on ``backend`` while this job holds the store's ``lease``."""
    url = absolute(spec.output.store)  # for workers in another directory
    summaries = backend.run(todo, url, on_progress, on_event, fence=lease.token) if todo else []
    lease.verify()  # a job paused past its lease marks nothing complete in another job's store
    # still under the lease, every writer of this job done: what runs killed mid-shard left goes
    if drop_partials(group):
        log.info("removed the unfinished shard files of an earlier run of %s", spec.output.store)
    return summaries


# run is over 60 lines, a quarter of them its docstring: the job's steps, in order, read best in one place
def run(
    spec: JobSpec,
    *,
    on_start: Callable[[int, dict[str, int]], None] | None = None,
    on_progress: Progress | None = None,
    on_event: Event | None = None,
    backend: Backend | None = None,
) -> RunSummary:
    """Run a whole job; returns when every shard is done.

    ``on_start(rows_to_process, bytes_per_row)`` is called once the job knows what it will compute,
    ``on_progress(rows_processed)`` as batches finish, and ``on_event(name, info)`` on
    worker and shard events (``worker_started``, ``shard_started``, ``shard_done``,
    ``shard_failed``, ``worker_died``): ``shard_started`` once a worker begins computing the
    shard (on Ray, as seen by the driver's next progress poll, or with its result),
    ``worker_died`` with the ``shards`` it held and the one ``charged`` a retry (None when it
    held several: each is redone alone). ``backend`` replaces the one ``spec.cluster`` names
    (benchmarks: a ``LocalBackend`` around a Worker subclass); it is closed at the end.
    """
    t0 = time.perf_counter()
    rows = _list(spec, backend)
    shards = plan(len(rows), spec.data.shard_size)
    log.info("%d images in %d shards of %d", len(rows), len(shards), spec.data.shard_size)
    events = _Events(on_event)
    backend = backend if backend is not None else _backend(spec)
    lease: Lease | None = None
    group: Any = None
    decided: _Decision | None = None
    try:
        attrs, decided, per_row = _look(spec, rows, shards, backend)
        if on_start is not None:
            on_start(sum(len(s) for s in decided.todo), per_row)
        if decided.nothing_to_do:  # exit 0 without writing (but what moved in the source): also read-only
            _record_source(spec, decided, attrs)
            group = open_group(spec.output.store, "r", spec.output.storage_options)
            return _finish(spec, group, shards, [], [], per_row, time.perf_counter() - t0, write=False)
        lease = Lease(spec.output.store, spec.output.storage_options, spec.output.lease_timeout_s, owner())
        group = _claim(spec, rows, decided, attrs, lease)  # from here on the store is this job's
        ensure_parts(group, indexed(attrs["captures"]), len(shards))  # each shard's part of a write-time index
        del rows  # the store holds them now, and workers read their shards' rows from it: the driver lets them go
        events.merging(group, len(shards))
        # read again under the lease; a new store's are not read at all (on an object store a paused job's marker
        # could land in it before this read: its shard is computed, and its objects replaced)
        done = done_shards(group) if not decided.create else np.zeros(len(shards), dtype=bool)
        todo = [s for s in shards if not done[s.index]]
        t_compute = time.perf_counter()
        summaries = _compute(spec, backend, todo, on_progress or (lambda n: None), events, lease, group)
        compute_s = time.perf_counter() - t_compute
        # still under the lease: a job that takes the released store over never meets this one's last writes
        summary = _finish_done(spec, group, shards, todo, summaries, per_row, time.perf_counter() - t0, compute_s,
                               events.totals)
    except BaseException as err:
        _stopped(spec, err, lease, group, decided is not None and decided.create, events.totals)
        raise
    finally:
        backend.close()
        if lease is not None:
            lease.release()
    _consolidate(spec, group)
    summary.workers = _worker_table(events.log)
    return summary


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


def _finish_done(spec: JobSpec, group: Any, shards: list[Shard], todo: list[Shard], summaries: list[ShardSummary],
                 per_row: dict[str, int], seconds: float, compute_s: float, totals: Totals | None) -> RunSummary:
    """:func:`_finish` once every shard ran; a storage that refuses the final attributes is a StoreError that
    says the shards are kept."""
    try:
        return _finish(spec, group, shards, todo, summaries, per_row, seconds, compute_s=compute_s, totals=totals)
    except StoreError:
        raise
    except OSError as err:  # every shard is done; only the final attributes could not be written
        raise StoreError(f"cannot write the final attributes of {spec.output.store}: {type(err).__name__}: {err}; "
                         "its shards are done and kept: --resume finishes it once the storage works") from err


def _list(spec: JobSpec, backend: Backend | None) -> Rows:
    """The job's rows; a backend given to the job is closed when they cannot be listed."""
    try:
        return _recorded(spec) or list_rows(spec.data)
    except BaseException:
        if backend is not None:
            backend.close()
        raise


def _recorded(spec: JobSpec) -> Rows | None:
    """For a resume of a store made from tars: its rows as it records them, when the tars are the ones it was
    listed from (each tar's size and mtime or ETag, the extensions); else None: the tars are listed again (and
    the listing compared with the store, as for every source)."""
    if spec.data.source != "tar" or spec.output.if_exists != "resume":
        return None
    old = read_attrs(spec.output.store, spec.output.storage_options)
    recorded = (old or {}).get("listing")
    if not recorded or old is None or old.get("status") == "creating":
        return None
    if not all(k in old for k in ("n_rows", "ids_digest", "paths_digest")):
        return None
    now_ = tar_listing(spec.data.tars, spec.data.extensions, spec.data.storage_options)
    if now_ != recorded or 0 in now_["fingerprints"]:
        return None
    log.info("the tars are as listed for %s: its rows are taken from it", spec.output.store)
    labels = any(c.gradient and c.score_target == "label" for c in spec.capture)  # _check_targets reads them
    return stored_rows(open_group(spec.output.store, "r", spec.output.storage_options), labels=labels)


class _Events:
    """The job's worker and shard events: kept for the report's worker table, logged, passed on. Once the
    store is the job's (``merging``), each shard done has its statistics merged into ``totals`` as it comes."""

    def __init__(self, on_event: Event | None) -> None:
        self.log: list[tuple[str, dict[str, Any]]] = []
        self.on_event = on_event
        self.totals: Totals | None = None
        self.group: Any = None

    def merging(self, group: Any, n_shards: int) -> None:
        self.group, self.totals = group, Totals.kept(group, n_shards)

    def __call__(self, name: str, info: dict[str, Any]) -> None:
        self.log.append((name, info))
        log.debug("%s %s", name, info)
        if name == "shard_done" and self.totals is not None:
            try:
                self.totals.add(info["shard"], shard_record(self.group, info["shard"]))
            except Exception as err:  # noqa: BLE001 - the end of the run merges what is not merged yet
                log.debug("statistics of shard %s not merged now: %s", info["shard"], err)
        if self.on_event is not None:
            self.on_event(name, info)


def _look(spec: JobSpec, rows: Rows, shards: list[Shard],
          backend: Backend) -> tuple[dict[str, Any], _Decision, dict[str, int]]:
    """Everything that can fail before the first image (model, shapes, layouts, preprocessing, compile, the
    estimate, the store's state), before the store is touched: the store record this job writes, what it will
    do to the store, and the bytes per row of each capture."""
    probe = backend.probe()
    _check_targets(spec, rows, probe.model.get("logits"))
    attrs = store_attrs(spec, rows, len(shards), probe)
    if spec.output.reuse:  # every store to take rows from makes them as this job would
        check_sources(spec.output.reuse, attrs, spec.output.store, spec.output.storage_options)
    decided = _decide(spec, rows, shards, attrs, read_attrs(spec.output.store, spec.output.storage_options))
    if decided.todo:
        backend.warm_up()  # a resume with nothing left to compute compiles nothing
    return attrs, decided, probe.bytes_per_row()


def _finish(
    spec: JobSpec,
    group: Any,
    shards: list[Shard],
    todo: list[Shard],
    summaries: list[ShardSummary],
    per_row: dict[str, int],
    seconds: float,
    compute_s: float = 0.0,
    write: bool = True,
    totals: Totals | None = None,
) -> RunSummary:
    """The run's summary; with ``write``, the store's final status and statistics (a resume with nothing
    to do reads them as they are)."""
    status = np.asarray(group["status"][:])
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
        stats = merge_shards(group, totals)
        finish_indexes(group)  # write-time feature indexes: their shards' parts merged
        update_attrs(group, status="complete" if complete else "incomplete", error=None, stats=stats)
    else:
        stats = dict(group.attrs["extractor"].get("stats") or {})
    processed = sum(s.rows for s in summaries)
    return RunSummary(
        store=spec.output.store,
        rows=len(status),
        ok=int((status == OK).sum()),
        failed=len(failed_rows),
        pending=n_pending,
        shards=len(shards),
        shards_skipped=len(shards) - len(todo),
        shards_run=len(summaries),
        seconds=seconds,
        images_per_s=processed / max(seconds, 1e-9),
        compute_images_per_s=processed / max(compute_s, 1e-9),
        bytes_per_row=per_row,
        failures=failures,
        per_shard=summaries,
        nonfinite={k: (v["nonfinite_rows"], v["first_nonfinite_rows"]) for k, v in stats.items()
                   if v["nonfinite_rows"]},
        float16=[k for k, m in group.attrs["extractor"]["captures"].items() if m["dtype"] == "float16"],
        reused=sum(s.reused for s in summaries),
    )
