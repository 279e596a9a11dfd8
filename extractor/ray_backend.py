"""The Ray backend: one actor per GPU holds the model; the driver hands out shards.

Actors run the same :class:`~extractor.worker.Worker` as the local backend and write their
shard's rows straight into the store; only small summaries travel back. The driver keeps
shard descriptors and done flags, and two shards in flight per actor so that its pipeline
does not drain between them. A dead actor is replaced and its shards redone (when it held
two, each alone, so that the next death names the shard at fault); a shard that fails
``max_retries + 1`` times fails the job after the running shards finish.
Ray is imported here only.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from .errors import ClusterError, ExtractorError, FencedError, ShardError
from .sources import Shard
from .spec import JobSpec
from .worker import ShardQueue, ShardSummary

__all__ = ["RayBackend"]

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the driver asks busy actors for their progress
IN_FLIGHT = 2  # shards handed to each actor at once: the next one starts without draining the device
DRAIN_S = 60.0  # after a device fault, how long the actor's shards already computed may take to be written


class _WorkerActor:
    """Holds one Worker for the life of the job (wrapped by ray.remote in RayBackend).

    ``run_shard`` calls queue their shard for one pipeline thread that runs
    ``Worker.run_shards`` on the queue: with two calls in flight (the driver keeps two per
    worker), the second shard starts on the device before the first one's last batch is read
    back, as in the local backend. Each call returns once its shard's done marker is written.
    """

    def __init__(self, spec_dict: dict[str, Any], threads: int, driver_cwd: str | None = None,
                 model: Any = None) -> None:
        """``driver_cwd``: the driver's folder, searched for a ``model.factory`` module (as it was there)
        when this node has it (an embedded cluster, a shared file system). ``model``: a module made
        in Python (sent by Ray with cloudpickle)."""
        if driver_cwd and os.path.isdir(driver_cwd) and driver_cwd not in sys.path:
            sys.path.append(driver_cwd)
        self.error: BaseException | None = None
        self.current: tuple[int, int] = (-1, 0)  # (shard, rows done in it)
        self.queue = ShardQueue()
        self.calls: dict[int, Future[ShardSummary]] = {}  # shard index -> its run_shard call's result
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        try:
            import torch

            torch.set_num_threads(max(threads, 1))
            from .spec import parse_spec
            from .worker import Worker

            self.worker = Worker(parse_spec(spec_dict), cpus=max(threads, 1), model=model)
            self.worker.probe()
        except Exception as err:  # noqa: BLE001 - reported to the driver by ready()
            self.error = err

    def ready(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "device": str(self.worker.device)}

    def layout(self) -> dict[str, Any]:
        return self.worker.layout()

    def warm_up(self) -> None:
        self.worker.warm_up()

    def run_shard(self, index: int, start: int, stop: int, url: str, fence: str | None = None) -> ShardSummary:
        call: Future[ShardSummary] = Future()
        with self.lock:
            if self.error is not None:  # the driver replaces this actor: run nothing more here
                raise self.error
            self.calls[index] = call
            self.queue.put(Shard(index, start, stop))
            if self.thread is None:
                self.thread = threading.Thread(target=self._pipeline, args=(url, fence), name="extractor-pipeline",
                                               daemon=True)
                self.thread.start()
        return call.result()

    def _take(self, index: int) -> Future[ShardSummary] | None:
        with self.lock:
            return self.calls.pop(index, None)

    def _pipeline(self, url: str, fence: str | None) -> None:
        def started(shard: Shard) -> None:
            self.current = (shard.index, 0)

        def on_batch(n: int) -> None:
            self.current = (self.current[0], self.current[1] + n)

        def computed(shard: Shard, future: Future[ShardSummary]) -> None:
            call = self._take(shard.index)  # this call, answered by this future (not a later call of the shard)
            if call is not None:
                future.add_done_callback(lambda f: call.set_exception(f.exception()) if f.exception() is not None
                                         else call.set_result(f.result()))

        while True:
            try:
                self.worker.run_shards(self.queue, url, on_batch=on_batch, on_computed=computed, on_started=started,
                                       fence=fence)
            except ShardError as err:  # that shard's call fails; the pipeline goes on with the queue
                self.current = (-1, 0)  # a retry of it must not look started before it is
                call = self._take(err.shard) if err.shard is not None else None
                if call is not None:
                    call.set_exception(err)
            except BaseException as err:  # noqa: BLE001 - not a shard's failure: every waiting call gets it
                self.current = (-1, 0)
                with self.lock:
                    self.error = err  # the worker's, not a shard's: the driver replaces this actor
                    while self.queue.get(block=False) is not None:  # the driver redoes them
                        pass
                    calls, self.calls = list(self.calls.values()), {}
                    self.thread = None  # the next call starts a new pipeline thread
                for call in calls:
                    call.set_exception(err)
                return

    def progress(self) -> tuple[int, int]:
        return self.current


class _Schedule:
    """The driver's shard bookkeeping: which shard a worker gets next, and which one pays for a
    failure.

    A worker holds up to ``IN_FLIGHT`` shards. When its process dies holding several, any of them
    may be the cause (the queued shard's first images are decoded while the running one
    computes), so none pays a retry: each becomes a suspect, and a suspect runs alone on its
    worker. A death with one shard in flight is that shard's: a shard that keeps killing workers
    fails the job after ``max_retries`` retries, and the shards queued beside it finish.
    """

    def __init__(self, todo: list[Shard], max_retries: int) -> None:
        self.queue: deque[Shard] = deque(todo)
        self.max_retries = max_retries
        self.attempts: dict[int, int] = {}
        self.suspects: set[int] = set()
        self.failure: tuple[Shard, str] | None = None  # the first shard out of retries, and its last error

    def next_for(self, held: list[Shard]) -> Shard | None:
        """The next shard for a worker holding ``held``; None to leave it as it is."""
        if self.failure is not None or len(held) >= IN_FLIGHT or any(s.index in self.suspects for s in held):
            return None
        for k, shard in enumerate(self.queue):
            if not held or shard.index not in self.suspects:
                del self.queue[k]
                return shard
        return None

    def done(self, shard: Shard) -> None:
        self.suspects.discard(shard.index)

    def lost(self, shards: list[Shard], error: str) -> Shard | None:
        """A worker died holding ``shards``: the shard that pays a retry, or None when it held several."""
        if len(shards) == 1:
            self.failed(shards[0], error)
            return shards[0]
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


def _check_reachable(address: str, timeout: float, where: str = "cluster.address") -> None:
    """Fail fast when nothing listens at a ``HOST:PORT`` (or ``ray://HOST:PORT``) address:
    ``ray.init`` would wait for it for many minutes, deaf to Ctrl-C. ``where`` names the setting."""
    import socket

    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        fix = ("unset RAY_ADDRESS (a cluster that is gone) for an embedded local cluster, or point it at a running "
               "one" if where == "RAY_ADDRESS" else
               "fix cluster.address, or set it to null for an embedded local cluster")
        raise ClusterError(
            f"cannot reach a Ray cluster at {where} {address}: {type(err).__name__}: {err}; start it "
            f"(`ray start --head`), or {fix}"
        ) from None


def _for_workers(spec: JobSpec) -> dict[str, Any]:
    """The spec as the actors get it: local paths made absolute, since an actor runs in another
    directory than the driver when it joins a cluster (the images' paths are absolute in the store)."""
    from .sources import absolute
    from .zoo import local_folder, looks_like_path

    d = spec.to_dict()
    for section, key in (("output", "store"), ("data", "root"), ("data", "manifest"), ("model", "weights")):
        value = d[section].get(key)
        if isinstance(value, str) and (key != "weights" or looks_like_path(value)):
            d[section][key] = absolute(value)
    folder = local_folder(spec.model.name)
    if folder is not None:  # hf:FOLDER
        d["model"]["name"] = folder[0] + absolute(folder[1])
    return d


def _cause(err: BaseException) -> BaseException:
    """The user-facing exception inside a Ray error, when it carries one."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


class RayBackend:
    def __init__(self, spec: JobSpec, model: Any = None) -> None:
        """``model``: a module made in Python, sent to every worker (it must pickle with cloudpickle)."""
        self.spec = spec
        c = spec.cluster
        self.started_ray = False
        if model is not None:
            import cloudpickle

            try:
                cloudpickle.dumps(model)
            except Exception as err:  # noqa: BLE001 - whatever pickling raises, the answer is the same
                raise ClusterError(
                    f"model= ({type(model).__name__}) cannot be sent to Ray workers: it does not pickle "
                    f"({type(err).__name__}: {err}); use cluster.backend: local, or build it in the workers with "
                    "model.factory"
                ) from err
        if not ray.is_initialized():
            self._init_ray()
        total = ray.cluster_resources()
        n_cpus, n_gpus = float(total.get("CPU", 0)), float(total.get("GPU", 0))
        gpus = c.gpus_per_worker if c.gpus_per_worker is not None else (1.0 if n_gpus else 0.0)
        workers = c.workers or (max(int(n_gpus // gpus), 1) if gpus else 1)
        cpus = c.cpus_per_worker if c.cpus_per_worker is not None else max(min(n_cpus // workers, 8), 1)
        if workers * cpus > n_cpus or workers * gpus > n_gpus:
            self.close()
            raise ClusterError(
                f"the job asks for {workers} workers x ({cpus:g} CPUs, {gpus:g} GPUs) = {workers * cpus:g} CPUs, "
                f"{workers * gpus:g} GPUs, but the Ray cluster has {n_cpus:g} CPUs and {n_gpus:g} GPUs; "
                "lower cluster.workers, cluster.cpus_per_worker or cluster.gpus_per_worker"
            )
        self.n_workers, self.cpus, self.gpus = workers, cpus, gpus
        # IN_FLIGHT run_shard calls wait at once, and progress() must still be answered
        self.actor_cls = ray.remote(num_cpus=cpus, num_gpus=gpus, max_concurrency=IN_FLIGHT + 2,
                                    max_restarts=0)(_WorkerActor)
        self.spec_dict = _for_workers(spec)
        self.model_ref = ray.put(model) if model is not None else None  # one copy in the object store
        self.actors: list[Any] = [self._new_actor() for _ in range(workers)]
        self.pids: list[int | None] = [None] * workers
        self.warm = False  # warm_up has compiled the model on the workers
        self._wait_ready(range(workers))
        log.info("%d Ray workers ready (%g CPUs, %g GPUs each)", workers, cpus, gpus)

    # ------------------------------------------------------------------ set-up
    def _init_ray(self) -> None:
        c = self.spec.cluster
        kwargs: dict[str, Any] = {"configure_logging": False, "log_to_driver": True}
        if c.address is None and os.environ.get("RAY_ADDRESS"):
            kwargs["address"] = os.environ["RAY_ADDRESS"]  # inside a Ray job: join its cluster
            _check_reachable(kwargs["address"], timeout=min(c.startup_timeout_s, 10.0), where="RAY_ADDRESS")
        elif c.address is None:
            # an embedded single-job cluster: loopback only, no dashboard
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            kwargs.update(include_dashboard=False, num_cpus=c.local_cpus or os.cpu_count())
        else:
            kwargs["address"] = c.address
            _check_reachable(c.address, timeout=min(c.startup_timeout_s, 10.0))
        main = threading.current_thread() is threading.main_thread()
        on_term = signal.getsignal(signal.SIGTERM) if main else None
        try:
            ray.init(**kwargs)
        except SystemExit as err:  # a SIGTERM while ray.init held its own handler (sys.exit(15))
            if err.code != signal.SIGTERM:
                raise
            if ray.is_initialized():
                ray.shutdown()
            raise KeyboardInterrupt from None  # interrupted, resumable: as a SIGTERM at any other moment
        except Exception as err:  # ConnectionError, RuntimeError, ValueError depending on the cause
            where = c.address or "an embedded local cluster"
            raise ClusterError(f"cannot start or join Ray at {where}: {type(err).__name__}: {err}") from err
        finally:
            if callable(on_term):  # ray.init replaces it with sys.exit: a pre-emption must still stop the
                signal.signal(signal.SIGTERM, on_term)  # job as the caller's handler says (interrupted, resumable)
        self.started_ray = True

    def _new_actor(self) -> Any:
        threads = max(int(self.cpus), 1)
        return self.actor_cls.remote(self.spec_dict, threads, os.getcwd(), self.model_ref)

    def _wait_ready(self, slots: Any, method: str = "ready") -> list[Any]:
        """Call ``method`` on the actors of ``slots`` and wait for all of them (ready: their pids)."""
        slots = list(slots)
        refs = [getattr(self.actors[i], method).remote() for i in slots]
        try:
            infos = ray.get(refs, timeout=self.spec.cluster.startup_timeout_s)
        except GetTimeoutError:
            error = ClusterError(  # built while Ray still runs: it asks Ray what is free
                f"{len(slots)} Ray workers did not {'start' if method == 'ready' else 'compile the model'} within "
                f"{self.spec.cluster.startup_timeout_s:g} s (cluster.startup_timeout_s); "
                f"free resources now: {ray.available_resources()}"
            )
            self.close()
            raise error from None
        except (RayTaskError, RayActorError) as err:
            self.close()
            cause = _cause(err)
            if isinstance(cause, ExtractorError):
                raise cause from None
            doing = "start" if method == "ready" else "compile the model"
            raise ClusterError(f"a Ray worker failed to {doing}: {type(cause).__name__}: {cause}") from err
        if method == "ready":
            for i, info in zip(slots, infos, strict=True):
                self.pids[i] = info["pid"]
        return infos

    def probe(self) -> dict[str, Any]:
        return ray.get(self.actors[0].layout.remote())

    def warm_up(self) -> None:
        """Compile the model on every worker at once (a no-op for an eager model); replacements
        compile before their first shard from then on."""
        if not self.warm:
            self._wait_ready(range(self.n_workers), "warm_up")
            self.warm = True

    # ------------------------------------------------------------------ the job
    def run(self, todo: list[Shard], url: str, on_progress: Any, on_event: Any,
            fence: str | None = None) -> list[ShardSummary]:
        for i, pid in enumerate(self.pids):
            on_event("worker_started", {"worker": i, "pid": pid})
        plan = _Schedule(todo, self.spec.cluster.max_retries)
        running: dict[Any, tuple[int, Shard, int]] = {}  # task ref -> (worker slot, shard, actor generation)
        held: list[list[Shard]] = [[] for _ in range(self.n_workers)]  # the shards in flight on each slot
        generation = [0] * self.n_workers  # bumped when a slot's actor is replaced
        partial: dict[int, int] = {}  # worker slot -> rows done in its current shard
        started: set[int] = set()  # shards whose start was reported (in their current attempt)
        reported = 0  # progress never goes back (a shard's rows move from partial to finished)
        summaries: list[ShardSummary] = []
        finished_rows = 0
        last_poll = 0.0

        def report_start(slot: int, shard: Shard) -> None:
            if shard.index not in started:
                started.add(shard.index)
                on_event("shard_started", {"shard": shard.index, "worker": slot, "pid": self.pids[slot]})

        def take(ref: Any) -> tuple[int, Shard, int]:
            slot, shard, gen = running.pop(ref)
            held[slot].remove(shard)
            partial.pop(slot, None)
            return slot, shard, gen

        def finished(slot: int, shard: Shard, summary: ShardSummary) -> None:
            nonlocal finished_rows
            report_start(slot, shard)  # a shard that began and ended between two polls
            plan.done(shard)
            summaries.append(summary)
            finished_rows += summary.rows
            on_event("shard_done", {"shard": shard.index, "worker": slot, "summary": summary})

        def harvest(slot: int, gen: int, wait_s: float) -> list[Shard]:
            """The other shards of a slot whose actor failed: those whose calls returned (within
            ``wait_s``) are done; the rest are returned, lost."""
            others = [r for r, (sl, _, g) in running.items() if sl == slot and g == gen]
            answered, _ = ray.wait(others, num_returns=len(others), timeout=wait_s) if others else ([], [])
            lost = []
            for r in others:
                _, shard, _ = take(r)
                if r in answered:
                    try:
                        finished(slot, shard, ray.get(r))
                        continue
                    except (RayActorError, RayTaskError):
                        pass
                lost.append(shard)
            return lost

        while True:
            for slot in range(self.n_workers):
                while (shard := plan.next_for(held[slot])) is not None:
                    ref = self.actors[slot].run_shard.remote(shard.index, shard.start, shard.stop, url, fence)
                    running[ref] = (slot, shard, generation[slot])
                    held[slot].append(shard)
            if not running:
                break
            ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
            for ref in ready:
                slot, shard, gen = take(ref)
                try:
                    summary: ShardSummary = ray.get(ref)
                except (RayActorError, RayTaskError) as err:
                    cause = _cause(err)
                    if isinstance(cause, FencedError):  # another job holds the store: stop, write nothing
                        raise cause from None
                    if isinstance(err, RayTaskError) and isinstance(cause, ShardError):  # the shard raised
                        error = f"{type(cause).__name__}: {cause}"
                        report_start(slot, shard)
                        started.discard(shard.index)
                        on_event("shard_failed", {"worker": slot, "shard": shard.index, "error": error})
                        log.warning("shard %d failed on worker %d: %s", shard.index, slot, error)
                        plan.failed(shard, error)
                        continue
                    # the actor died, or failed as a whole (its device, or an error that is no shard's): it
                    # is replaced (a CUDA context is not trusted again), and first its shards already
                    # written, or (a live actor) being written, are kept
                    alive = isinstance(err, RayTaskError)
                    lost = sorted([shard, *harvest(slot, gen, DRAIN_S if alive else 0.0)], key=lambda s: s.index)
                    started.difference_update(s.index for s in lost)
                    error = (f"worker {slot} (pid {self.pids[slot]}) failed: {type(cause).__name__}: {cause}" if alive
                             else f"worker {slot} (pid {self.pids[slot]}) died: {type(err).__name__}")
                    charged = plan.lost(lost, error)
                    on_event("worker_died", {"worker": slot, "pid": self.pids[slot], "error": error,
                                             "shards": [s.index for s in lost],
                                             "charged": charged.index if charged is not None else None})
                    log.warning("%s; it held shards %s (%s); starting a replacement", error,
                                ", ".join(str(s.index) for s in lost),
                                f"shard {charged.index} counts a retry" if charged is not None
                                else "none counts a retry: each is redone alone")
                    self._replace(slot)
                    generation[slot] += 1
                    on_event("worker_started", {"worker": slot, "pid": self.pids[slot]})
                else:
                    finished(slot, shard, summary)
            if time.monotonic() - last_poll >= POLL_S and running:
                last_poll = time.monotonic()
                for slot, index, rows in self._poll({slot for slot in range(self.n_workers) if held[slot]}):
                    shard = next((s for s in held[slot] if s.index == index), None)
                    if shard is not None:  # not a shard finished since (its result is on the way)
                        report_start(slot, shard)
                        partial[slot] = rows
            reported = max(reported, finished_rows + sum(partial.values()))
            on_progress(reported)
        if plan.failure is not None:
            shard, error = plan.failure
            raise ShardError(
                f"shard {shard.index} (rows {shard.start}-{shard.stop - 1}) failed {plan.attempts[shard.index]} times "
                f"(cluster.max_retries={self.spec.cluster.max_retries}); last error: {str(error).rstrip('.')}. "
                "Finished shards are kept: fix the cause and run the same command with --resume"
            )
        return summaries

    def _poll(self, slots: set[int]) -> list[tuple[int, int, int]]:
        """(slot, shard, rows done in it) for each of ``slots`` whose actor answers: the shard its
        pipeline is computing now."""
        refs = {self.actors[slot].progress.remote(): slot for slot in slots}
        answered, _ = ray.wait(list(refs), num_returns=len(refs), timeout=POLL_S)  # one wait for all of them
        out = []
        for ref in answered:
            try:
                shard_index, rows = ray.get(ref)
            except Exception:  # noqa: BLE001 - a dying actor; its task result says what happened
                continue
            out.append((refs[ref], shard_index, rows))
        return out

    def _replace(self, slot: int) -> None:
        try:
            ray.kill(self.actors[slot], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.actors[slot] = self._new_actor()
        self._wait_ready([slot])
        if self.warm:
            self._wait_ready([slot], "warm_up")

    def close(self) -> None:
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False
