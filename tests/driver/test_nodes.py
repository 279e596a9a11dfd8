"""The Ray backend on a real two-node Ray cluster on loopback (issue 17, elastic workers): a
head and a second raylet on 127.0.0.1, each a `ray start --block` process killed with everything
under it by pid. A node lost mid-job leaves the job to the workers left; a node that joins
mid-job gets a worker (``cluster.workers: auto``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.images import make_images
from helpers.jobs import job
from helpers.processes import free_port

from extractor.driver.runner import run
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec

ray = pytest.importorskip("ray")
TESTS = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class Node:
    """A `ray start --block` process: the node's daemons and workers are all under it."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        """SIGKILL every process of the node at once, as a pre-empted VM goes."""
        pids = descendants(self.proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


# A node killed is known dead after 3 failed health checks 1 s apart, not Ray's 5 checks 3 s apart (17 s a
# loss here); a live node must be deaf for 3 checks of 3 s each to be taken for dead, even on a loaded machine.
HEALTH_CHECKS = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                 "health_check_timeout_ms": 3000, "health_check_failure_threshold": 3}


def alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


class Cluster:
    """A head with 1 CPU (``address``); ``join()`` adds a node with 1 CPU and the resource
    ``node_b``; ``drop()`` kills every node joined before and waits until Ray knows."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                    "RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
        self.address = f"127.0.0.1:{free_port()}"
        self.nodes = [Node([str(VENV_BIN / "ray"), "start", "--head", f"--port={self.address.rsplit(':', 1)[1]}",
                            "--num-cpus=1", "--node-ip-address=127.0.0.1", f"--temp-dir={tmp}",
                            "--include-dashboard=false", "--disable-usage-stats", "--block",
                            f"--system-config={json.dumps(HEALTH_CHECKS)}"], self.env, tmp / "head.log")]

    def join(self) -> tuple[Node, str]:
        before = {n["NodeID"] for n in alive_nodes()}
        node = Node([sys.executable, str(TESTS / "join_node.py"), f"--address={self.address}", "--num-cpus=1",
                     "--node-ip-address=127.0.0.1", '--resources={"node_b": 1}', "--disable-usage-stats",
                     "--block"], self.env, self.tmp / f"node{len(self.nodes)}.log")
        self.nodes.append(node)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            new = [n["NodeID"] for n in alive_nodes() if n["NodeID"] not in before]
            if new:
                return node, new[0]
            assert node.proc.poll() is None, node.log.read_text()[-2000:]
            time.sleep(0.5)
        raise AssertionError("the second node did not join: " + node.log.read_text()[-2000:])

    def drop(self) -> None:
        for node in self.nodes[1:]:
            node.kill()
        while len(alive_nodes()) > 1:
            time.sleep(0.5)

    def close(self) -> None:
        for node in reversed(self.nodes):
            node.kill()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(Path(tempfile.mkdtemp(prefix="rayn", dir="/tmp")))  # short: socket paths stay under 107 bytes
    try:
        deadline = time.monotonic() + 120
        while True:  # the driver of these tests (RayBackend sees Ray initialised and joins it as it is)
            try:
                ray.init(address=c.address, configure_logging=False, log_to_driver=False)
                break
            except Exception:  # noqa: BLE001 - whatever Ray raises while the head starts
                assert time.monotonic() < deadline and c.nodes[0].proc.poll() is None, \
                    c.nodes[0].log.read_text()[-2000:]
                time.sleep(1)
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.close()


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nodes")
    make_images(root, per_class=12, classes=("a", "b"), size=40)
    return root


def slow_job(root: Path, store: Path, seconds: float, **cluster: Any) -> dict:
    return job(root, store, model={"name": None, "factory": "toy_models:slow_net", "device": "cpu",
                                   "kwargs": {"seconds": seconds}},
               data={"resize": None, "crop": 32, "shard_size": 2, "batch_size": 1, "decode_workers": 1,
                     "preprocess": "imagenet"},
               capture=[{"layer": "conv", "reduce": "mean"}, {"layer": "conv", "key": "map"}],
               output={"store": str(store), "chunk_rows": 1}, cluster={"backend": "ray", **cluster})


def reference(root: Path, store: Path) -> Any:
    raw = slow_job(root, store, 0.0)
    raw["cluster"] = {"backend": "local"}
    run(parse_spec(raw))
    return open_store(str(store))


def assert_same(a: Any, b: Any) -> None:
    assert list(a.ids) == list(b.ids) and (b.status == 1).all() and b.done_shards.all()
    for key in ("conv", "map"):
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))


def test_a_node_lost_mid_job_leaves_its_shards_to_the_workers_left(cluster, images: Path, tmp_path: Path):
    """Every process of the second node is SIGKILLed while its worker computes a shard: the shards
    it held go back to the queue at once (no retry counted: a node's loss is no shard's fault),
    the head's worker takes them while the replacement waits to be placed, and the store equals a
    clean local run."""
    cluster.drop()
    node_b, b_id = cluster.join()
    ref = reference(images, tmp_path / "ref.zarr")
    nodes: dict[int, str] = {}  # worker slot -> node id
    events: list[tuple[str, dict]] = []
    killed: list[float] = []

    def on_event(name: str, info: dict) -> None:
        events.append((name, info))
        if name == "worker_started":
            nodes[info["worker"]] = info["node_id"]
        elif name == "shard_started" and nodes.get(info["worker"]) == b_id and not killed:
            node_b.kill()
            killed.append(time.monotonic())

    raw = slow_job(images, tmp_path / "s.zarr", 0.3, address=cluster.address, cpus_per_worker=1)
    summary = run(parse_spec(raw), on_event=on_event)
    assert killed and set(nodes.values()) >= {b_id}
    died = [i for n, i in events if n == "worker_died"]
    assert len(died) == 1 and died[0]["node_id"] == b_id and died[0]["charged"] is None and died[0]["shards"]
    assert "lost with its node" in died[0]["error"]
    assert sorted(s.shard for s in summary.per_shard) == list(range(12)) and summary.ok == 24
    assert all(i["worker"] != died[0]["worker"] for n, i in events if n == "shard_done"
               and i["summary"].shard in died[0]["shards"])  # redone by the worker left
    assert_same(ref, open_store(str(tmp_path / "s.zarr")))


def test_a_node_that_joins_mid_job_gets_a_worker_that_takes_shards(cluster, images: Path, tmp_path: Path):
    """workers: auto on a cluster with room for one worker; a node joins once the job runs (its
    first batch held at a gate until then): the driver sees the new capacity, starts a worker
    there, and it takes shards."""
    cluster.drop()
    ref = reference(images, tmp_path / "ref.zarr")
    gate = tmp_path / "gate"
    gate.touch()
    joined: list[str] = []
    events: list[tuple[str, dict]] = []
    joiner = threading.Thread(target=lambda: joined.append(cluster.join()[1]))

    def on_event(name: str, info: dict) -> None:
        events.append((name, info))
        if name == "worker_started" and info["worker"] == 0:
            joiner.start()  # the driver goes on meanwhile
        elif name == "worker_started":
            gate.unlink()

    raw = slow_job(images, tmp_path / "s.zarr", 0.0, address=cluster.address, cpus_per_worker=1)
    raw["model"].update(factory="toy_models:gated_net", kwargs={"gate": str(gate)})
    summary = run(parse_spec(raw), on_event=on_event)
    joiner.join()
    started = {i["worker"]: i["node_id"] for n, i in events if n == "worker_started"}
    assert joined and started[0] != joined[0] and started.get(1) == joined[0] and not gate.exists()
    assert summary.workers[1]["shards"] >= 1 and summary.workers[1]["nodes"] == ["127.0.0.1"] and summary.ok == 24
    assert_same(ref, open_store(str(tmp_path / "s.zarr")))


def test_no_worker_left_for_startup_timeout_stops_the_job_and_resume_finishes(cluster, images: Path,
                                                                               tmp_path: Path):
    """The head's CPU is held by another actor, the job's one worker runs on the second node, and
    that node is lost: the replacement cannot be placed anywhere, so after startup_timeout_s the
    job stops with a ClusterError saying so (built while Ray runs); once capacity is back,
    --resume finishes with the store a clean run makes."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from extractor.driver.ray_backend import RayBackend
    from extractor.errors import ClusterError

    ref = reference(images, tmp_path / "ref.zarr")
    head = next(n["NodeID"] for n in alive_nodes() if "node_b" not in n["Resources"])
    cluster.drop()
    node_b, b_id = cluster.join()
    class Hog:
        """An actor that only holds its CPU (defined here: Ray ships it by value, its worker imports no test module)."""

        def ping(self) -> bool:
            return True

    hog = ray.remote(num_cpus=1)(Hog).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
    ray.get(hog.ping.remote())
    nodes: dict[int, str] = {}

    def on_event(name: str, info: dict) -> None:
        if name == "worker_started":
            nodes[info["worker"]] = info["node_id"]
        elif name == "shard_done" and node_b.proc.poll() is None:
            node_b.kill()

    raw = slow_job(images, tmp_path / "s.zarr", 0.3, address=cluster.address, cpus_per_worker=1, startup_timeout_s=3)
    # the worker's start is an event, however loaded the machine (issue 26, defect 14: a 3 s start timeout
    # failed a fresh-clone run): the backend waits for it under a long timeout; then 3 s without any worker stop
    backend = RayBackend(parse_spec({**raw, "cluster": {**raw["cluster"], "startup_timeout_s": 600}}))
    backend.spec = parse_spec(raw)
    with pytest.raises(ClusterError, match=r"no Ray worker has been running for 3 s .*--resume"):
        run(parse_spec(raw), on_event=on_event, backend=backend)
    assert nodes == {0: b_id}
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.attrs["status"] == "failed" and 0 < s.done_shards.sum() < 12
    ray.kill(hog)
    raw["output"]["if_exists"] = "resume"
    raw["cluster"]["startup_timeout_s"] = 600  # capacity is back: its worker starts, however slowly
    summary = run(parse_spec(raw))
    assert summary.shards_skipped >= 1 and summary.ok == 24
    assert_same(ref, open_store(str(tmp_path / "s.zarr")))
