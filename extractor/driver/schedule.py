"""The Ray backend's scheduling (:mod:`.ray_backend`): which shards go to which worker (:class:`_Schedule`, pure
bookkeeping), one worker's state (:class:`_Slot`), how many workers fit, and the driver loop of one run
(:class:`_Job`): hand out shards, collect results, replace dead workers, redo their shards."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from ..compute import ShardSummary
from ..data import Shard
from ..errors import ClusterError, ShardError
from ..faults import whose
from ..spec import ClusterSpec

if TYPE_CHECKING:
    from ..compute import Ready
    from ..spec import JobSpec
    from ..store import Ticket

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the driver asks busy actors for their progress
IN_FLIGHT = 2  # shards handed to each actor at once: the next one starts without draining the device
DRAIN_S = 60.0  # after a device fault, how long the actor's shards already computed may take to be written
WATCH_S = 2.0  # how often the driver looks for free capacity (workers: auto)


NODE_DIED = "its node has died"  # what Ray's GCS says of an actor it marks dead as its node died


def _node_lost(err: BaseException, node_id: str) -> bool:
    """An actor's failure that its node's loss (or its connection's) caused: Ray raises it as the actor being
    unavailable or pre-empted, or as a death whose cause is the node's, or the node is already counted dead. A node
    killed at once with its workers is heard of first by the connection or by the GCS, depending on the load."""
    if isinstance(err, ActorUnavailableError) or getattr(err, "preempted", False) or NODE_DIED in str(err):
        return True
    if not isinstance(err, RayActorError) or not node_id:
        return False
    try:
        return any(n.get("NodeID") == node_id and not n.get("Alive") for n in ray.nodes())
    except Exception:  # noqa: BLE001 - the GCS not answering: the death stays the worker's
        return False


class _Schedule:
    """The driver's shard bookkeeping: which shard a worker gets next, and which one pays for a
    failure.

    A worker holds up to ``IN_FLIGHT`` shards. When its process dies holding several, any of them
    may be the cause (the queued shard's first images are decoded while the running one
    computes), so none pays a retry: each becomes a suspect, and a suspect runs alone on its
    worker. A death with one shard in flight is that shard's: a shard that keeps killing workers
    fails the job after ``max_retries`` retries, and the shards queued beside it finish. A worker
    lost with its node (or its connection) blames no shard.
    """

    def __init__(self, todo: list[Shard], max_retries: int, ready: Ready | None = None) -> None:
        self.queue: deque[Shard] = deque(todo)
        self.max_retries = max_retries
        self.ready = ready  # a new store's rows written meanwhile: a shard is handed out once its rows are in
        self.attempts: dict[int, int] = {}
        self.suspects: set[int] = set()
        self.failure: tuple[Shard, str] | None = None  # the first shard out of retries, and its last error

    def next_for(self, held: list[Shard]) -> Shard | None:
        """The next shard for a worker holding ``held``; None to leave it as it is."""
        if self.failure is not None or len(held) >= IN_FLIGHT or any(s.index in self.suspects for s in held):
            return None
        for k, shard in enumerate(self.queue):
            if self.ready is not None and not self.ready.ready(shard.index):
                return None  # rows are written in row order: neither are the shards after it (those put back were)
            if not held or shard.index not in self.suspects:
                del self.queue[k]
                return shard
        return None

    def done(self, shard: Shard) -> None:
        self.suspects.discard(shard.index)

    def drop(self, indices: Iterable[int]) -> list[Shard]:
        """Take the shards of ``indices`` out of the queue (another process's: a worker found them so)."""
        gone = set(indices)
        out = [s for s in self.queue if s.index in gone]
        self.queue = deque(s for s in self.queue if s.index not in gone)
        return out

    def lost(self, shards: list[Shard], error: str, blame: bool = True) -> Shard | None:
        """A worker died holding ``shards``: the shard that pays a retry, or None when it held several
        or (``blame`` False) its node was lost."""
        if blame and len(shards) == 1:
            self.failed(shards[0], error)
            return shards[0]
        if blame:
            self.suspects.update(s.index for s in shards)
        self.queue.extendleft(sorted(shards, key=lambda s: s.index, reverse=True))
        return None

    def failed(self, shard: Shard, error: str) -> None:
        """``shard`` failed: back to the front of the queue, or, past max_retries, the job fails
        (the shards running now finish; no other starts)."""
        self.attempts[shard.index] = self.attempts.get(shard.index, 0) + 1
        if self.attempts[shard.index] > self.max_retries:
            self.failure = self.failure or (shard, error)
            self.queue.clear()
        else:
            self.queue.appendleft(shard)


def _cause(err: BaseException) -> BaseException:
    """The user-facing exception inside a Ray error, when it carries one."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


def _worker_size(c: ClusterSpec, nodes: list[dict[str, float]]) -> tuple[float, float]:
    """CPUs and GPUs of one worker: the spec's, or a GPU each when the cluster has GPUs, and CPUs
    shared among the workers (per node for ``workers: auto``, over the cluster for a number), at
    most 8, at least 1."""
    gpu_nodes = [n for n in nodes if n.get("GPU", 0) > 0]
    gpus = c.gpus_per_worker if c.gpus_per_worker is not None else (1.0 if gpu_nodes else 0.0)
    if c.cpus_per_worker is not None:
        return c.cpus_per_worker, gpus
    if c.workers != "auto":
        share = sum(n.get("CPU", 0) for n in nodes) // c.workers
    elif gpus and gpu_nodes:  # the CPUs of a GPU node, shared by the workers it holds
        share = min(n.get("CPU", 0) // max(n["GPU"] // gpus, 1) for n in gpu_nodes)
    else:
        share = max((n.get("CPU", 0) for n in nodes), default=1)
    return float(min(max(share, 1), 8)), gpus


def _fits(free: dict[str, float], cpus: float, gpus: float) -> int:
    """How many workers of (cpus, gpus) the free resources ``free`` hold (summed over the nodes:
    an upper bound when they are spread thin)."""
    n = free.get("CPU", 0) // cpus
    return int(min(n, free.get("GPU", 0) // gpus) if gpus else n)


class _Slot:
    """A worker's place in the job: its actor (a new one after each death), where that runs, the
    shards in flight on it, and, until it is ready, the call that starts it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.actor: Any = None
        self.starting: Any = None  # the start() call of an actor not ready yet
        self.warm = False  # its actor compiled the model (or was asked to, by its start call)
        self.pid: int | None = None
        self.node = ""  # its node's IP address
        self.node_id = ""
        self.generation = 0  # bumped with each new actor: an old actor's results are told apart
        self.held: list[Shard] = []  # shards in flight on it
        self.rows = 0  # rows done in the shard it computes now (its last progress answer)
        self.failed_starts = 0  # in a row

    @property
    def ready(self) -> bool:
        return self.actor is not None and self.starting is None

    def started(self, info: dict[str, Any]) -> None:
        self.starting = None
        self.failed_starts = 0
        self.pid, self.node, self.node_id = info["pid"], info["node"], info["node_id"]

    def event(self, **more: Any) -> dict[str, Any]:
        return {"worker": self.index, "pid": self.pid, "node": self.node, "node_id": self.node_id, **more}


class _Backend(Protocol):
    """What a job uses of its backend (``ray_backend.RayBackend``, which imports this module)."""

    spec: JobSpec
    slots: list[_Slot]
    max_workers: int | None
    cpus: float
    gpus: float

    def add_slot(self) -> _Slot: ...

    def start_worker(self, slot: _Slot) -> None: ...

    def take_start(self, slot: _Slot, ref: Any, raise_errors: bool = False) -> bool: ...


class _Job:
    """One ``RayBackend.run``: hands shards to ready workers, collects their results, replaces dead
    workers in the background, adds workers on new capacity (``workers: auto``), and tells the
    runner (progress, events)."""

    def __init__(self, backend: _Backend, todo: list[Shard], url: str, ticket: Ticket | None, on_progress: Any,
                 on_event: Any, ready: Ready | None = None) -> None:
        self.backend, self.url, self.ticket = backend, url, ticket
        self.on_progress, self.on_event = on_progress, on_event
        self.plan = _Schedule(todo, backend.spec.cluster.max_retries, ready)
        self.running: dict[Any, tuple[_Slot, Shard, int]] = {}  # task ref -> (slot, shard, actor generation)
        self.started: set[int] = set()  # shards whose start was reported (in their current attempt)
        self.summaries: list[ShardSummary] = []
        self.finished_rows = 0
        self.reported = 0  # progress never goes back (a shard's rows move from partial to finished)
        self.last_poll = self.last_watch = 0.0
        self.alone_since: float | None = None  # since when no worker is ready

    # -- the four steps of the loop
    def dispatch(self) -> None:
        for slot in self.backend.slots:
            while slot.ready and (shard := self.plan.next_for(slot.held)) is not None:
                ref = slot.actor.run_shard.remote(shard.index, shard.start, shard.stop, self.url, self.ticket)
                self.running[ref] = (slot, shard, slot.generation)
                slot.held.append(shard)

    def collect(self) -> None:
        """Wait up to POLL_S for a shard's result or a worker's start, and take what came."""
        starting = {s.starting: s for s in self.backend.slots if s.starting is not None}
        refs = [*self.running, *starting]
        if not refs:  # nothing to wait for (shards wait for workers that failed to start and start again)
            time.sleep(POLL_S)
            return
        answered, _ = ray.wait(refs, num_returns=1, timeout=POLL_S)
        for ref in answered:
            if ref in starting:
                slot = starting[ref]
                if self.backend.take_start(slot, ref):
                    self.on_event("worker_started", slot.event())
            elif ref in self.running:  # not taken with a failed worker's other shards
                self._result(ref)

    def poll(self) -> None:
        """Every POLL_S, ask the busy workers how far their current shard is."""
        if time.monotonic() - self.last_poll >= POLL_S and self.running:
            self.last_poll = time.monotonic()
            busy = [s for s in self.backend.slots if s.ready and s.held]
            refs = {slot.actor.progress.remote(): slot for slot in busy}
            answered, _ = ray.wait(list(refs), num_returns=len(refs), timeout=POLL_S)  # one wait for all
            for ref in answered:
                slot = refs[ref]
                try:
                    index, rows = ray.get(ref)
                except Exception:  # noqa: BLE001 - a dying actor; its task result says what happened
                    continue
                shard = next((s for s in slot.held if s.index == index), None)
                if shard is not None:  # not a shard finished since (its result is on the way)
                    self._report_start(slot, shard)
                    slot.rows = rows
        self.reported = max(self.reported, self.finished_rows + sum(s.rows for s in self.backend.slots))
        self.on_progress(self.reported)

    def watch(self) -> None:
        """Every WATCH_S: with workers: auto, start a worker on capacity that came free or joined;
        when no worker has been ready for startup_timeout_s while shards wait, stop (resumable)."""
        b, c = self.backend, self.backend.spec.cluster
        now = time.monotonic()
        if any(s.ready for s in b.slots) or not self.plan.queue:
            self.alone_since = None
        elif self.alone_since is None:
            self.alone_since = now
        elif now - self.alone_since > c.startup_timeout_s:
            raise ClusterError(
                f"no Ray worker has been running for {c.startup_timeout_s:g} s (cluster.startup_timeout_s): "
                f"{len(b.slots)} wait to be placed or started; free resources now: {ray.available_resources()}. "
                "Finished shards are kept: run the same command with --resume when the cluster has capacity"
            )
        if (c.workers != "auto" or now - self.last_watch < WATCH_S or not self.plan.queue
                or any(s.starting is not None for s in b.slots)
                or (b.max_workers is not None and len(b.slots) >= b.max_workers)):
            return
        self.last_watch = now
        if _fits(ray.available_resources(), b.cpus, b.gpus):
            slot = b.add_slot()
            log.info("capacity for another worker appeared in the Ray cluster: starting worker %d", slot.index)
            b.start_worker(slot)

    def result(self) -> list[ShardSummary]:
        if self.plan.failure is not None:
            shard, error = self.plan.failure
            raise ShardError(
                f"shard {shard.index} (rows {shard.start}-{shard.stop - 1}) failed {self.plan.attempts[shard.index]} "
                f"times (cluster.max_retries={self.backend.spec.cluster.max_retries}); last error: "
                f"{str(error).rstrip('.')}. Finished shards are kept: fix the cause and run the same command with "
                "--resume"
            )
        return self.summaries

    # -- what a result means
    def _take(self, ref: Any) -> tuple[_Slot, Shard, int]:
        slot, shard, gen = self.running.pop(ref)
        slot.held.remove(shard)
        slot.rows = 0
        return slot, shard, gen

    def _report_start(self, slot: _Slot, shard: Shard) -> None:
        if shard.index not in self.started:
            self.started.add(shard.index)
            self.on_event("shard_started", {"shard": shard.index, "worker": slot.index, "pid": slot.pid})

    def _finished(self, slot: _Slot, shard: Shard, summary: ShardSummary) -> None:
        self._report_start(slot, shard)  # a shard that began and ended between two polls
        self.plan.done(shard)
        if summary.taken:  # another claimant's: nothing done here, nor on the shards its read found another's
            for each in [shard, *self.plan.drop(summary.skip)]:
                self.on_event("shard_skipped", {"shard": each.index, "worker": slot.index, "held": summary.taken})
            return
        self.summaries.append(summary.kept())  # its statistics record merged by the event, then let go
        self.finished_rows += summary.rows
        self.on_event("shard_done", {"shard": shard.index, "worker": slot.index, "summary": summary})

    def _result(self, ref: Any) -> None:
        slot, shard, gen = self._take(ref)
        try:
            summary: ShardSummary = ray.get(ref)
        except (RayActorError, RayTaskError) as err:
            cause = _cause(err)
            fault = whose(cause)
            if fault == "job":  # another job holds the store: stop, write nothing
                raise cause from None
            if fault == "shard" and isinstance(err, RayTaskError):  # the shard raised
                error = f"{type(cause).__name__}: {cause}"
                self._report_start(slot, shard)
                self.started.discard(shard.index)
                self.on_event("shard_failed", {"worker": slot.index, "shard": shard.index, "error": error})
                log.warning("shard %d failed on worker %d: %s", shard.index, slot.index, error)
                self.plan.failed(shard, error)
                return
            self._worker_lost(slot, gen, shard, err)
        else:
            self._finished(slot, shard, summary)

    def _worker_lost(self, slot: _Slot, gen: int, shard: Shard, err: BaseException) -> None:
        """``slot``'s actor died, or failed as a whole (its device, or an error that is no shard's),
        or its node was lost: keep what it finished, put the rest back in the queue, and start a
        replacement in the background (a CUDA context is not trusted again)."""
        cause = _cause(err)
        alive = isinstance(err, RayTaskError)
        node_lost = _node_lost(err, slot.node_id)
        lost = sorted([shard, *self._harvest(slot, gen, DRAIN_S if alive else 0.0)], key=lambda s: s.index)
        self.started.difference_update(s.index for s in lost)
        who = f"worker {slot.index} (pid {slot.pid}, node {slot.node})"
        error = (f"{who} failed: {type(cause).__name__}: {cause}" if alive else
                 f"{who} was lost with its node or connection: {type(err).__name__}" if node_lost else
                 f"{who} died: {type(err).__name__}")
        charged = self.plan.lost(lost, error, blame=not node_lost)
        self.on_event("worker_died", slot.event(error=error, shards=[s.index for s in lost],
                                                charged=charged.index if charged is not None else None))
        log.warning("%s; it held shards %s (%s); starting a replacement", error, ", ".join(str(s.index) for s in lost),
                    f"shard {charged.index} counts a retry" if charged is not None
                    else "none counts a retry" + ("" if node_lost else ": each is redone alone"))
        self.backend.start_worker(slot)

    def _harvest(self, slot: _Slot, gen: int, wait_s: float) -> list[Shard]:
        """The other shards of a slot whose actor failed: those whose calls returned (within
        ``wait_s``) are done; the rest are returned, lost."""
        others = [r for r, (sl, _, g) in self.running.items() if sl is slot and g == gen]
        answered, _ = ray.wait(others, num_returns=len(others), timeout=wait_s) if others else ([], [])
        lost = []
        for r in others:
            _, shard, _ = self._take(r)
            if r in answered:
                try:
                    self._finished(slot, shard, ray.get(r))
                    continue
                except (RayActorError, RayTaskError):
                    pass
            lost.append(shard)
        return lost

