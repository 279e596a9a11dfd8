"""The Ray backend: one actor per GPU holds the model; the driver hands out shards.

Actors run the same :class:`~extractor.compute.worker.Worker` as the local backend and write their
shard's rows straight into the store; only small summaries travel back. The driver keeps
shard descriptors and done flags, and two shards in flight per actor so that its pipeline
does not drain between them. A dead actor is replaced in the background while the others go
on, and its shards redone (when it held two, each alone, so that the next death names the
shard at fault; after a lost node, none is blamed); a shard that fails ``max_retries + 1``
times fails the job after the running shards finish. With ``cluster.workers: auto`` the driver
starts workers on capacity that joins the cluster during the job (the scheduling: :mod:`.schedule`). Ray is
imported in the driver only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from concurrent.futures import Future
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from ..compute import Ready, ShardQueue, ShardSummary
from ..data import Shard
from ..errors import ClusterError, ExtractorError, ShardError
from ..spec import JobSpec
from ..store import Probe, Ticket
from .schedule import IN_FLIGHT, _cause, _fits, _Job, _Slot, _worker_size

__all__ = ["RayBackend"]

log = logging.getLogger(__name__)


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
            from ..compute import Worker
            from ..spec import parse_spec

            self.worker = Worker(parse_spec(spec_dict), cpus=max(threads, 1), model=model)
            self.worker.probe()
        except Exception as err:  # noqa: BLE001 - reported to the driver by ready()
            self.error = err

    def ready(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "device": str(self.worker.device)}

    def start(self, warm: bool) -> dict[str, Any]:
        """ready(), after compiling the model when ``warm`` (the job has compiled it)."""
        info = self.ready()
        if warm:
            self.worker.warm_up()
        return info

    def probe(self) -> Probe:
        return self.worker.probe()

    def run_shard(self, index: int, start: int, stop: int, url: str, ticket: Ticket | None = None) -> ShardSummary:
        call: Future[ShardSummary] = Future()
        with self.lock:
            if self.error is not None:  # the driver replaces this actor: run nothing more here
                raise self.error
            self.calls[index] = call
            self.queue.put(Shard(index, start, stop))
            if self.thread is None:
                self.thread = threading.Thread(target=self._pipeline, args=(url, ticket), name="extractor-pipeline",
                                               daemon=True)
                self.thread.start()
        return call.result()

    def _take(self, index: int) -> Future[ShardSummary] | None:
        with self.lock:
            return self.calls.pop(index, None)

    def _pipeline(self, url: str, ticket: Ticket | None) -> None:
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
                                       ticket=ticket)
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


def loopback_only() -> None:
    """Make the Ray that this process starts listen on 127.0.0.1 only (unless the environment says
    otherwise). Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when it is imported, which this
    module did already: without the second line an embedded cluster listened on every interface
    under the machine's address. The variable also reaches the processes Ray starts."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        try:  # private (Ray pinned below 2.61 in pyproject.toml); read at call time by services.get_node_ip_address
            import ray._private.ray_constants as ray_constants
        except ImportError as err:  # pragma: no cover - a Ray that moved it: refuse rather than listen everywhere
            raise ClusterError("this Ray has no ray._private.ray_constants: extractor cannot keep an embedded "
                               "cluster on 127.0.0.1; install a Ray between 2.50 and 2.60") from err
        ray_constants.ENABLE_RAY_CLUSTER = False


def _driver_folder() -> str:
    """The driver's current folder, as the job starts (a worker replaced later gets the same); one that is gone
    (removed since the command started in it) is a one-line error: Ray cannot start there (it was a traceback)."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise ClusterError("the current folder is gone (removed since this command started in it): Ray starts the "
                           "job's processes there, and its workers search it for a model.factory module; cd into a "
                           "folder that exists and run the command again") from None


def _for_workers(spec: JobSpec) -> dict[str, Any]:
    """The spec as the actors get it: local paths made absolute (``JobSpec.local_paths``), since an actor runs
    in another directory than the driver when it joins a cluster (the images' paths are absolute in the store)."""
    from ..data import absolute

    d = spec.to_dict()
    for setting, path in spec.local_paths():
        section, key = setting.split(".")
        value = d[section][key]
        if isinstance(value, list):  # data.tars, data.parquet, output.reuse
            d[section][key] = [absolute(v) if v == path else v for v in value]
        else:  # a path, or model.name's folder after its prefix
            d[section][key] = value[: len(value) - len(path)] + absolute(path)
    return d


class RayBackend:
    def __init__(self, spec: JobSpec, model: Any = None) -> None:
        """``model``: a module made in Python, sent to every worker (it must pickle with cloudpickle)."""
        self.spec = spec
        c = spec.cluster
        self.started_ray = False
        self.slots: list[_Slot] = []
        if model is not None:
            import cloudpickle

            try:
                cloudpickle.dumps(model)
            except Exception as err:
                raise ClusterError(
                    f"model= ({type(model).__name__}) cannot be sent to Ray workers: it does not pickle "
                    f"({type(err).__name__}: {err}); use cluster.backend: local, or build it in the workers with "
                    "model.factory"
                ) from err
        self.driver_cwd = _driver_folder()  # for the workers: a model.factory module found there
        if not ray.is_initialized():
            self._init_ray()
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        total = ray.cluster_resources()
        n_cpus, n_gpus = float(total.get("CPU", 0)), float(total.get("GPU", 0))
        self.cpus, self.gpus = _worker_size(c, nodes)
        if not any(_fits(n, self.cpus, self.gpus) for n in nodes):
            self.close()
            raise ClusterError(
                f"a worker needs {self.cpus:g} CPUs and {self.gpus:g} GPUs, but no node of the Ray cluster has "
                f"that ({n_cpus:g} CPUs and {n_gpus:g} GPUs in all); lower cluster.cpus_per_worker or "
                "cluster.gpus_per_worker"
            )
        fit = _fits(ray.available_resources(), self.cpus, self.gpus)
        if c.workers == "auto":
            self.max_workers = c.max_workers
            workers = max(min(fit, c.max_workers or fit), 1)
        else:
            self.max_workers = workers = c.workers
            if workers > fit:
                log.warning("%d of the %d workers asked for (cluster.workers) fit in the Ray cluster's free "
                            "resources now; the others start when capacity frees up or joins", fit, workers)
        # IN_FLIGHT run_shard calls wait at once, and progress() must still be answered
        self.actor_cls = ray.remote(  # type: ignore[call-overload]  # Ray's stubs lack the actor option max_concurrency
            num_cpus=self.cpus, num_gpus=self.gpus, max_concurrency=IN_FLIGHT + 2, max_restarts=0)(_WorkerActor)
        self.spec_dict = _for_workers(spec)
        self.model_ref = ray.put(model) if model is not None else None  # one copy in the object store
        self.warm = False  # warm_up has compiled the model on the workers
        for _ in range(workers):
            self.start_worker(self.add_slot())
        self._wait_started(self.slots, need=max(min(fit, workers), 1))  # whichever Ray places first
        log.info("%d Ray workers ready (%g CPUs, %g GPUs each)", sum(s.ready for s in self.slots), self.cpus,
                 self.gpus)

    # ------------------------------------------------------------------ set-up
    def _init_ray(self) -> None:
        c = self.spec.cluster
        kwargs: dict[str, Any] = {"configure_logging": False, "log_to_driver": True}
        if c.address is None and os.environ.get("RAY_ADDRESS"):
            kwargs["address"] = os.environ["RAY_ADDRESS"]  # inside a Ray job: join its cluster
            _check_reachable(kwargs["address"], timeout=min(c.startup_timeout_s, 10.0), where="RAY_ADDRESS")
        elif c.address is None:
            loopback_only()  # an embedded single-job cluster: loopback only, no dashboard
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

    def add_slot(self) -> _Slot:
        self.slots.append(_Slot(len(self.slots)))
        return self.slots[-1]

    def start_worker(self, slot: _Slot) -> None:
        """Give ``slot`` a new actor (its old one killed) and call its start without waiting: Ray
        places it when the cluster has room, and the driver hears of it when it is ready."""
        if slot.actor is not None:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(slot.actor, no_restart=True)
            slot.generation += 1
        slot.actor = self.actor_cls.remote(self.spec_dict, max(int(self.cpus), 1), self.driver_cwd, self.model_ref)
        slot.warm = self.warm
        slot.starting = slot.actor.start.remote(self.warm)
        slot.pid, slot.held, slot.rows = None, [], 0

    def _wait_started(self, slots: list[_Slot], need: int | None = None) -> None:
        """Wait up to startup_timeout_s for ``need`` (default all) of the start calls of ``slots``,
        whichever answer first: Ray places actors in no set order. Only when none of them started is
        that an error (the others keep starting in the background)."""
        refs = {slot.starting: slot for slot in slots if slot.starting is not None}
        if not refs:
            return
        need = min(need or len(refs), len(refs))
        answered, _ = ray.wait(list(refs), num_returns=need, timeout=self.spec.cluster.startup_timeout_s)
        for ref in answered:
            self.take_start(refs[ref], ref, raise_errors=True)
        if not any(s.ready for s in self.slots):
            doing = "compile the model" if self.warm and self.spec.model.compile else "start"
            error = ClusterError(  # built while Ray still runs: it asks Ray what is free
                f"{len(refs)} Ray workers did not {doing} within "
                f"{self.spec.cluster.startup_timeout_s:g} s (cluster.startup_timeout_s); "
                f"free resources now: {ray.available_resources()}"
            )
            self.close()
            raise error from None
        if sum(refs[ref].ready for ref in answered) < need:
            late = [s.index for s in slots if not s.ready]
            log.warning("workers %s did not start within cluster.startup_timeout_s; the job goes on without them "
                        "while they keep starting", ", ".join(map(str, late)))

    def take_start(self, slot: _Slot, ref: Any, raise_errors: bool = False) -> bool:
        """Take the answer of ``slot``'s start call: True when the worker is ready. An error of the
        job's own (a layer, the model) is raised; a worker that died starting is started again,
        and one failing to start ``max_retries + 1`` times in a row is a ClusterError."""
        try:
            info = ray.get(ref)
        except (RayTaskError, RayActorError) as err:
            cause = _cause(err)
            if isinstance(cause, ExtractorError):
                self.close()
                raise cause from None
            slot.failed_starts += 1
            doing = "compile the model" if slot.warm and self.spec.model.compile else "start"
            if raise_errors or slot.failed_starts > self.spec.cluster.max_retries:
                error = ClusterError(f"a Ray worker failed to {doing}: {type(cause).__name__}: {cause}")
                self.close()
                raise error from err
            log.warning("worker %d failed to %s (%s: %s); starting it again", slot.index, doing,
                        type(cause).__name__, cause)
            self.start_worker(slot)
            return False
        slot.started(info)
        if self.warm and not slot.warm:  # started before the job compiled the model: compile it too
            slot.warm = True
            slot.starting = slot.actor.start.remote(True)
            return False
        return True

    def probe(self) -> Probe:
        return ray.get(next(s for s in self.slots if s.ready).actor.probe.remote())

    def warm_up(self) -> None:
        """Compile the model on every ready worker at once (a no-op for an eager model); workers that
        start later compile before their first shard."""
        if not self.warm:
            self.warm = True
            ready = [s for s in self.slots if s.ready]
            for slot in ready:
                slot.warm, slot.starting = True, slot.actor.start.remote(True)
            self._wait_started(ready)

    # ------------------------------------------------------------------ the job
    def run(self, todo: list[Shard], url: str, on_progress: Any, on_event: Any,
            ticket: Ticket | None = None, ready: Ready | None = None) -> list[ShardSummary]:
        job = _Job(self, todo, url, ticket, on_progress, on_event, ready)
        for slot in self.slots:
            if slot.ready:
                on_event("worker_started", slot.event())
        while job.plan.queue or job.running:
            job.dispatch()
            job.collect()
            job.poll()
            job.watch()
        return job.result()

    def close(self) -> None:
        for slot in self.slots:
            with contextlib.suppress(Exception):  # already gone, or never made
                ray.kill(slot.actor, no_restart=True)
        self.slots = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False

