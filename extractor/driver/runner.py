"""Planning and running a job: list rows, plan shards, create or resume the store, run shards.

``run(spec)`` is the whole job on one machine (the ``local`` backend: the worker runs in this
process). The driver only ever holds shard descriptors and done flags, never activations.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .._text import count, table
from ..data import Rows, Shard, Streamed, absolute, first_where, list_rows, plan, stream_rows
from ..errors import DataError, StoreError
from ..index import JobIndexes
from ..spec import JobSpec
from ..store import Decision, Outcome, Probe, StoreSession, Ticket

if TYPE_CHECKING:  # the worker imports torch: only a job that builds its model loads it
    from ..compute import Ready, ShardSummary, Worker

__all__ = ["Backend", "LocalBackend", "RunSummary", "run"]

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


def _check_targets(spec: JobSpec, rows: Rows | Streamed, logits: int | None) -> None:
    """``target: label`` differentiates each row's label's logit: every row needs a label, and
    one the model has an output for."""
    if label_targets(spec):
        labels = rows.labels  # (a block at a time: 400M labels are spilled to the disk, not the driver's memory)
        missing = first_where(labels, lambda block: block < 0)
        if missing is not None:
            raise DataError(
                f"target: label needs a label on every row, but {int((labels < 0).sum())} rows have none "
                f"(first: {rows.ids[missing]}); use target: predicted or a class index"
            )
        first = first_where(labels, lambda block: block >= logits) if logits is not None else None
        if first is not None and logits is not None:
            raise DataError(
                f"target: label needs labels the model has outputs for (0 to {logits - 1}), but "
                f"{int((labels >= logits).sum())} rows have larger ones (first: {rows.ids[first]}, label "
                f"{labels[first]}). Labels must be the model's class indices; use target: predicted or a class index"
            )


class Backend(Protocol):
    """Where a job's shards run: :class:`LocalBackend` (this process) or ``RayBackend`` (one actor per GPU).
    Built with the job's spec; its workers build the model and resolve every layer before any image is read."""

    def probe(self) -> Probe:
        """What one blank image measured (every worker measures the same)."""

    def warm_up(self) -> None:
        """Compile the model where the job compiles it; called only when there are shards to compute."""

    def run(self, todo: list[Shard], url: str, on_progress: Progress, on_event: Event,
            ticket: Ticket | None = None, ready: Ready | None = None) -> list[ShardSummary]:
        """Compute and write the shards ``todo`` into the store at ``url``, each claimed and committed for
        ``ticket``'s claimant (one another claimant holds is left); returns the summaries of the shards committed.
        ``ready``: a new store's rows written meanwhile; a shard is begun once its rows are in the store."""

    def close(self) -> None:
        """Stop the workers (a no-op when done twice)."""


class LocalBackend:
    """The worker in this process: shards run one after another."""

    def __init__(self, spec: JobSpec, worker: Worker | None = None) -> None:
        # builds the model and resolves every layer before any image is read
        if worker is None:
            from ..compute import Worker

            worker = Worker(spec)
        self.worker = worker

    def probe(self) -> Probe:
        return self.worker.probe()

    def warm_up(self) -> None:
        self.worker.warm_up()

    def run(self, todo: list[Shard], url: str, on_progress: Progress, on_event: Event,
            ticket: Ticket | None = None, ready: Ready | None = None) -> list[ShardSummary]:
        from ..compute import ShardQueue

        summaries: list[ShardSummary] = []
        processed = [0]
        pid = os.getpid()

        def on_batch(n: int) -> None:
            processed[0] += n
            on_progress(processed[0])

        on_event("worker_started", {"worker": 0, "pid": pid})
        finishing: deque[tuple[Shard, Future[ShardSummary]]] = deque()

        def done(shard: Shard, summary: ShardSummary) -> None:
            if summary.taken:  # another claimant's: nothing done here
                on_event("shard_skipped", {"shard": shard.index, "worker": 0, "held": summary.taken})
                return
            on_event("shard_done", {"shard": shard.index, "worker": 0, "summary": summary})
            summaries.append(summary.kept())  # its statistics record merged by the event, then let go

        def report(keep: int) -> None:
            """Report the shards that are committed; wait while more than ``keep`` are not."""
            while finishing and (len(finishing) > keep or finishing[0][1].done()):
                shard, future = finishing.popleft()
                done(shard, future.result())

        def computed(shard: Shard, future: Future[ShardSummary]) -> None:
            # a shard's last writes and done marker are stored while the next one computes
            finishing.append((shard, future))
            report(keep=1)

        queue = ShardQueue(todo, ready=ready, closed=True)
        try:
            self.worker.run_shards(
                queue, url, on_batch=on_batch, on_computed=computed,
                on_started=lambda shard: on_event("shard_started", {"shard": shard.index, "worker": 0, "pid": pid}),
                ticket=ticket,
            )
            report(keep=0)
            if queue.error is not None:  # the store's rows could not be written: the shards left cannot begin
                raise queue.error
        except BaseException:
            for shard, future in finishing:  # what was computed is still written before the error goes up
                if future.exception() is None:
                    done(shard, future.result())
            raise
        return summaries

    def close(self) -> None:
        self.worker.close()


def _backend(spec: JobSpec) -> Backend:
    if spec.cluster.backend == "local":
        return LocalBackend(spec)
    from .ray_backend import RayBackend

    return RayBackend(spec)


class _Workers:
    """Per worker slot: shards, images, seconds, images/s, restarts (its process replaced) and retries (shards that
    failed on it and counted a retry), counted as the events come (a log of every event grew with the shards)."""

    def __init__(self) -> None:
        self.table: dict[int, dict[str, Any]] = {}

    def add(self, name: str, info: dict[str, Any]) -> None:
        if "worker" not in info:
            return
        row = self.table.setdefault(info["worker"], {"worker": info["worker"], "pids": [], "nodes": [], "shards": 0,
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

    def rows(self) -> list[dict[str, Any]]:
        out = [dict(self.table[k]) for k in sorted(self.table)]
        for row in out:
            row["images_per_s"] = row["images"] / row["seconds"] if row["seconds"] else 0.0
        return out


def _compute(spec: JobSpec, backend: Backend, todo: list[Shard], on_progress: Progress, on_event: Event,
             session: StoreSession) -> list[ShardSummary]:
    """Run the shards ``todo`` on ``backend``, each claimed and committed for this job's claimant; then, until every
    shard is committed, the shards left that this claimant may take (pending, or held by claimants that died: a
    process that joined the store, or was paused, or killed), waiting while other live claimants hold the rest."""
    url = absolute(spec.output.store)  # for workers in another directory
    ticket = session.ticket
    summaries: list[ShardSummary] = []
    stalled = 0  # passes in a row that committed nothing and left the same shards
    while todo:
        done = backend.run(todo, url, on_progress, on_event, ticket=ticket, ready=session.rows_ready)
        summaries += done
        left = session.remaining(wait=True)
        stalled = stalled + 1 if not done and {s.index for s in left} == {s.index for s in todo} else 0
        if stalled >= 2:
            raise StoreError(f"shards {[s.index for s in left][:10]} of {spec.output.store} stay uncommitted pass "
                             "after pass; run again with --resume")
        todo = left
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
    listing = rows if isinstance(rows, Streamed) else None  # listed on a thread: stopped where the job stops first
    try:
        shards = plan(len(rows), spec.data.shard_size)
        log.info("%d images in %d shards of %d", len(rows), len(shards), spec.data.shard_size)
        events = _Events(on_event)
        session = StoreSession(spec, JobIndexes())  # the store meets the job's write-time indexes through them
        done = _complete(spec, rows, shards, session, on_start, t0) if backend is None else None
        if done is not None:  # a complete store, its model fixed by its record: nothing built, nothing computed
            return done
        backend = backend if backend is not None else _backend(spec)
    except BaseException:
        if listing is not None:
            listing.stop()
        raise
    try:
        decided, per_row = _look(spec, rows, shards, backend, session)
        if on_start is not None:
            on_start(sum(len(s) for s in decided.todo), per_row)
        if decided.nothing_to_do:  # exit 0 without writing (but what moved in the source): also read-only
            return _summary(spec, session.unchanged(), shards, [], [], per_row, time.perf_counter() - t0)
        todo = session.on_write_start(rows)  # from here on the store is this job's
        del rows  # the store holds them now, and workers read their shards' rows from it: the driver lets them go
        listing = None  # (the store's writer of its rows stops it now)
        events.session = session  # each shard done has its statistics merged as it comes
        t_compute = time.perf_counter()
        summaries = _compute(spec, backend, todo, on_progress or (lambda n: None), events, session)
        compute_s = time.perf_counter() - t_compute
        seconds = time.perf_counter() - t0
        summary = _summary(spec, session.on_write_complete(), shards, todo, summaries, per_row, seconds, compute_s)
    except BaseException as err:
        session.on_write_failed(err)
        raise
    finally:
        if listing is not None:
            listing.stop()
        backend.close()
        session.close()  # the claimant ended (its record removed); a store's end was merged before
    summary.workers = events.workers.rows()
    return summary


def _complete(spec: JobSpec, rows: Rows | Streamed, shards: list[Shard], session: StoreSession,
              on_start: Callable[[int, dict[str, int]], None] | None, t0: float) -> RunSummary | None:
    """A resume of a complete store whose record fixes what this job's model would measure
    (:meth:`StoreSession.kept_probe`): decided from that record, without torch or the model. The run's summary when
    there is nothing to compute; None otherwise (the job builds its model, probes it and decides again)."""
    probe = session.kept_probe()
    if probe is None:
        return None
    _check_targets(spec, rows, probe.model.get("logits"))
    if not session.decide(rows, shards, probe).nothing_to_do:
        return None
    per_row = probe.bytes_per_row()
    if on_start is not None:
        on_start(0, per_row)
    return _summary(spec, session.unchanged(), shards, [], [], per_row, time.perf_counter() - t0)


def _list(spec: JobSpec, backend: Backend | None) -> Rows | Streamed:
    """The job's rows; a backend given to the job is closed when they cannot be listed."""
    try:
        return _recorded(spec) or _streamed(spec) or list_rows(spec.data)
    except BaseException:
        if backend is not None:
            backend.close()
        raise


def _streamed(spec: JobSpec) -> Streamed | None:
    """A new store's rows, listed on a thread while the model is built, the store made and its first shards run,
    where the source counts them without listing them (:func:`~extractor.data.stream_rows`); None: listed whole
    first, where the job needs every row before it starts (labels as gradient targets, rows taken from other
    stores, a store to resume or join: its rows compared with the listing)."""
    if spec.output.if_exists == "join" or spec.output.reuse or label_targets(spec):
        return None
    if spec.output.if_exists != "overwrite" and StoreSession(spec).recorded() is not None:
        return None
    return stream_rows(spec.data)


def label_targets(spec: JobSpec) -> bool:
    """Whether a capture takes the rows' labels as its gradients' targets (its listing is then made whole first)."""
    return any(c.gradient and c.score_target == "label" for c in spec.capture)


def _recorded(spec: JobSpec) -> Rows | None:
    """For a resume: its rows from the store, where its source is as it was listed (the source's fingerprint, as
    the store records it) or only parts of it changed (those listed again); else None: the source is listed
    again (and the listing compared with the store, as for every source)."""
    if spec.output.if_exists not in ("resume", "join"):
        return None
    store = StoreSession(spec)
    old = store.recorded()
    if old is None or not old.get("listing") or old.get("status") == "creating":
        return None
    if not all(k in old for k in ("n_rows", "ids_digest", "paths_digest")):
        return None
    rows = store.stored_rows(labels=label_targets(spec))  # (_check_targets reads them)
    if rows is not None:
        log.info("the source is as listed for %s%s", spec.output.store, ": its rows are taken from it" if
                 rows.stored is not None else " but for the parts listed again")
    return rows


class _Events:
    """The job's worker and shard events: counted for the report's worker table, logged, passed on (none kept: a
    job's events grow with its shards). Once the store is the job's (``session``), each shard done has its
    statistics and index parts merged as it comes."""

    def __init__(self, on_event: Event | None) -> None:
        self.workers = _Workers()
        self.on_event = on_event
        self.session: StoreSession | None = None

    def __call__(self, name: str, info: dict[str, Any]) -> None:
        self.workers.add(name, info)
        log.debug("%s %s", name, info)
        if name == "shard_done" and self.session is not None:
            summary = info["summary"]
            self.session.shard_done(info["shard"], summary.stats, summary.attempt, summary.parts)
        if self.on_event is not None:
            self.on_event(name, info)


def _look(spec: JobSpec, rows: Rows | Streamed, shards: list[Shard], backend: Backend,
          session: StoreSession) -> tuple[Decision, dict[str, int]]:
    """Everything that can fail before the first image (model, shapes, layouts, preprocessing, compile, the
    estimate, the store's state), before the store is touched: what the job will do to the store, and the bytes
    per row of each capture."""
    probe = backend.probe()
    _check_targets(spec, rows, probe.model.get("logits"))
    decided = session.decide(rows, shards, probe)
    if decided.todo:
        backend.warm_up()  # a resume with nothing left to compute compiles nothing
    return decided, probe.bytes_per_row()


def _summary(spec: JobSpec, outcome: Outcome, shards: list[Shard], todo: list[Shard], summaries: list[ShardSummary],
             per_row: dict[str, int], seconds: float, compute_s: float = 0.0) -> RunSummary:
    """The run's summary, from the store's outcome and the shards' summaries."""
    processed = sum(s.rows for s in summaries)
    return RunSummary(
        store=spec.output.store,
        rows=outcome.rows,
        ok=outcome.ok,
        failed=outcome.failed,
        pending=outcome.pending,
        shards=len(shards),
        shards_skipped=len(shards) - len(todo),
        shards_run=len(summaries),
        seconds=seconds,
        images_per_s=processed / max(seconds, 1e-9),
        compute_images_per_s=processed / max(compute_s, 1e-9),
        bytes_per_row=per_row,
        failures=outcome.failures,
        per_shard=summaries,
        nonfinite=outcome.nonfinite,
        float16=outcome.float16,
        reused=sum(s.reused for s in summaries),
    )
