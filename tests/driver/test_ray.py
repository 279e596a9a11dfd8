"""The Ray backend on a real Ray instance bound to loopback (2 CPUs, a temp dir)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import warm
import yaml
from helpers.images import make_images
from helpers.jobs import job
from helpers.processes import child_env
from helpers.slow import slow_job
from helpers.stores import committed, generation
from PIL import Image

from extractor.compute.worker import PROBE_FORWARDS
from extractor.data.rows import Shard
from extractor.driver.runner import run
from extractor.errors import ClusterError, LayerError, ShardError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec

ray = pytest.importorskip("ray")
TESTS = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow






def test_two_workers_equal_the_local_backend(ray_cluster, image_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch):
    """Also: each shard's part of a write-time index comes back with its result, and is merged by the driver as it
    comes (its end reads none from the store), the index as the post-hoc pass makes it."""
    from extractor.index import write_time
    from extractor.index.post_hoc import index
    from extractor.index.reader import open_index

    local = job(image_dir, tmp_path / "local.zarr")
    remote = job(image_dir, tmp_path / "ray.zarr", cluster={"backend": "ray", "workers": 2, "cpus_per_worker": 1})
    remote["capture"][1]["feature_index"] = {"k": 2}
    read, merged_parts = [], write_time.merged_parts
    monkeypatch.setattr(write_time, "merged_parts", lambda *a: read.append(merged_parts(*a)[0]) or (read[-1], 0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker (cpus_per_worker: 1): oneDNN's sums depend on the thread count
    try:
        run(parse_spec(local))
    finally:
        torch.set_num_threads(threads)
    events: list[tuple[str, dict]] = []
    summary = run(parse_spec(remote), on_event=lambda n, i: events.append((n, i)))
    assert summary.ok == 12 and summary.shards_run == 3
    workers = {i["worker"] for n, i in events if n == "shard_done"}
    pids = {i["pid"] for n, i in events if n == "worker_started"}
    assert workers == {0, 1} and os.getpid() not in pids and len(pids) == 2
    a, b = open_store(str(tmp_path / "local.zarr")), open_store(str(tmp_path / "ray.zarr"))
    assert list(a.ids) == list(b.ids)
    for key in ("layer3", "layer4"):
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))
    assert [w["shards"] for w in summary.workers] and sum(w["shards"] for w in summary.workers) == 3
    assert all(i["summary"].parts for n, i in events if n == "shard_done") and read == [0]
    store = str(tmp_path / "ray.zarr")
    written, again = open_index(store, "layer4"), index(store, "layer4", k=2, name="again")
    assert written.attrs["written"] == "write-time"
    for name in ("top_rows", "top_values", "density_rows", "histogram"):
        np.testing.assert_array_equal(np.asarray(written.arrays[name][:]), np.asarray(again.arrays[name][:]))


def test_relative_paths_reach_workers_that_run_in_another_directory(ray_cluster, image_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """Ray's workers started in the directory the cluster was started from, not this one: the
    spec's relative data.root and output.store still mean what they mean here."""
    import shutil

    shutil.copytree(image_dir, tmp_path / "imgs")
    monkeypatch.chdir(tmp_path)
    raw = job(Path("imgs"), Path("s.zarr"), cluster={"backend": "ray", "workers": 1, "cpus_per_worker": 1})
    summary = run(parse_spec(raw))
    assert summary.ok == 12 and summary.failed == 0
    s = open_store(str(tmp_path / "s.zarr"))
    assert (s.status == 1).all() and s.done_shards.all() and s.attrs["spec"]["output"]["store"] == "s.zarr"


@pytest.fixture(scope="module")
def slow_reference(slow_images: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The store a clean run of the slow job makes on the local backend (what a Ray job of it must equal)."""
    ref = slow_job(slow_images, tmp_path_factory.mktemp("reference") / "ref.zarr")
    ref["cluster"] = {"backend": "local"}
    run(parse_spec(ref))
    return Path(ref["output"]["store"])


def test_killed_worker_is_replaced_and_its_shard_redone(ray_cluster, slow_images: Path, slow_reference: Path,
                                                        tmp_path: Path):
    killed: list[int] = []
    pids: dict[int, int] = {}

    def on_event(name: str, info: dict) -> None:
        # at once: it holds the shard queued behind (0.3 s of slow_net at least), which is then never complete
        # (a pause here to let it compute some rows raced it: a shard finished first left no death to see)
        if name == "shard_done" and info["worker"] == 0 and not killed:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
        elif name == "worker_started":
            pids[info["worker"]] = info["pid"]

    events: list[tuple[str, dict]] = []
    spec = parse_spec(slow_job(slow_images, tmp_path / "s.zarr", workers=2, cpus_per_worker=1))
    summary = run(spec, on_event=lambda n, i: (events.append((n, i)), on_event(n, i)))
    assert killed and tuple(n for n, i in events if n == "worker_died")[:1] == ("worker_died", )
    died = next(i for n, i in events if n == "worker_died")
    assert died["pid"] == killed[0]
    done = sorted(s.shard for s in summary.per_shard)
    assert len(done) == len(set(done))  # each shard done once: by this run's workers, or (CI run b6, beside two CPU
    # burners) committed by the killed worker after its claim and before its result came back, then taken by no one
    assert set(done) | set(died["shards"]) == set(range(6))
    assert summary.ok == 12 and summary.failed == 0
    # the replacement starts in the background: worker 1 may finish the job before it is ready
    assert summary.workers[0]["restarts"] == 1 and len(summary.workers[0]["pids"]) in (1, 2)
    assert summary.workers[0]["retries"] == (died["charged"] is not None)  # a death with two in flight is no retry
    a, b = open_store(str(slow_reference)), open_store(str(tmp_path / "s.zarr"))
    assert (b.status == 1).all() and b.done_shards.all()
    for key in ("conv", "map"):
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))


def test_a_worker_killed_by_an_image_of_its_queued_shard_charges_that_shard(ray_cluster, slow_images: Path,
                                                                            tmp_path: Path):
    """The worker holds two shards; reading an image of the queued one kills its process while the
    running one computes. Neither pays a retry for that death: both are redone one at a time, so
    the shard at fault is the one charged, and the one it was queued behind finishes."""
    raw = slow_job(slow_images, tmp_path / "s.zarr", workers=1, cpus_per_worker=1, max_retries=1)
    raw["model"].update(factory="toy_models:crash_on_read", factory_kwargs={"name": "a02.jpg"})  # row 2: shard 1
    events: list[tuple[str, dict]] = []
    with pytest.raises(ShardError) as err:
        run(parse_spec(raw), on_event=lambda n, i: events.append((n, i)))
    assert "shard 1 (rows 2-3) failed 2 times" in str(err.value) and "died" in str(err.value)
    died = [i for n, i in events if n == "worker_died"]
    assert [(d["shards"], d["charged"]) for d in died] == [([0, 1], None), ([1], 1), ([1], 1)]
    first_death = next(k for k, (n, _) in enumerate(events) if n == "worker_died")
    assert {i["shard"] for n, i in events[:first_death] if n == "shard_started"} <= {0}  # 1 was only queued
    assert [i["shard"] for n, i in events if n == "shard_done"] == [0]
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.done_shards.tolist() == [True] + [False] * 5 and (s.status[:2] == 1).all()


@pytest.mark.parametrize(("factory", "words"), [
    ("faulty_device", "device failed.*illegal memory access"),  # a CUDA fault (torch.AcceleratorError)
    ("broken_worker", "failed: WorkerBroken: the worker's state is broken"),  # an error that is no shard's
])
def test_a_worker_that_fails_as_a_whole_is_replaced_and_the_job_finishes(ray_cluster, slow_images: Path,
                                                                         slow_reference: Path, tmp_path: Path,
                                                                         factory: str, words: str):
    """A worker whose device faults, or that raises an error of its own (neither a shard's nor a
    death), fails every call it holds: it is replaced rather than kept (a CUDA context may be
    broken), its shards are redone without a shard_failed (a shard pays a retry only if it was
    alone on it), and the store equals a clean run."""
    import re

    raw = slow_job(slow_images, tmp_path / "s.zarr", workers=1, cpus_per_worker=1, max_retries=1)
    after = PROBE_FORWARDS + 2  # in the second shard
    raw["model"].update(factory=f"toy_models:{factory}", factory_kwargs={"marker": str(tmp_path / "fault"),
                                                                         "after": after})
    events: list[tuple[str, dict]] = []
    summary = run(parse_spec(raw), on_event=lambda n, i: events.append((n, i)))
    died = [i for n, i in events if n == "worker_died"]
    assert len(died) == 1 and re.search(words, died[0]["error"]), died
    assert died[0]["shards"] and not [i for n, i in events if n == "shard_failed"]
    assert summary.ok == 12 and summary.failed == 0 and sorted(s.shard for s in summary.per_shard) == list(range(6))
    assert all(i["summary"].stats for n, i in events if n == "shard_done")  # each record came with its shard,
    assert not any(s.stats for s in summary.per_shard)  # and the driver kept none of them once merged
    assert len(summary.workers[0]["pids"]) == 2 and summary.workers[0]["restarts"] == 1  # replaced
    assert summary.workers[0]["retries"] == (died[0]["charged"] is not None)
    a, b = open_store(str(slow_reference)), open_store(str(tmp_path / "s.zarr"))
    assert (b.status == 1).all() and b.done_shards.all()
    for key in ("conv", "map"):
        np.testing.assert_array_equal(a.numpy(key), b.numpy(key))


def test_a_worker_that_always_fails_as_a_whole_ends_the_job(ray_cluster, slow_images: Path, tmp_path: Path):
    """Replacing a worker costs no retry when it held two shards, but a shard run alone pays: a
    worker-wide error on every shard cannot replace workers forever."""
    raw = slow_job(slow_images, tmp_path / "s.zarr", workers=1, cpus_per_worker=1, max_retries=1)
    raw["model"].update(factory="toy_models:broken_worker",
                        factory_kwargs={"marker": str(tmp_path / "broken"), "after": PROBE_FORWARDS, "once": False})
    events: list[tuple[str, dict]] = []
    msg = r"failed 2 times \(cluster.max_retries=1\); last error: worker 0 .*WorkerBroken"
    with pytest.raises(ShardError, match=msg):
        run(parse_spec(raw), on_event=lambda n, i: events.append((n, i)))
    died = [i for n, i in events if n == "worker_died"]
    assert len(died) <= 4 and [d["charged"] for d in died if d["charged"] is not None] == [died[-1]["charged"]] * 2


def test_shards_lost_together_are_redone_alone_and_only_a_lone_death_is_charged():
    from extractor.driver.schedule import _Schedule

    shards = [Shard(i, 2 * i, 2 * i + 2) for i in range(5)]
    plan = _Schedule(shards[:4], max_retries=0)
    held = [plan.next_for([])]
    held.append(plan.next_for(held))
    assert held == shards[:2] and plan.next_for(held) is None  # two in flight per worker
    assert plan.lost(held, "died") is None and plan.failure is None  # either may be at fault: none pays
    assert plan.next_for([shards[4]]) == shards[2]  # a busy worker gets no suspect...
    assert plan.next_for([]) == shards[0]  # ...an idle one does, and runs it alone
    assert plan.next_for([shards[0]]) is None
    plan.done(shards[0])
    assert plan.next_for([]) == shards[1]
    assert plan.lost([shards[1]], "died again") == shards[1]  # alone: its death is its own
    assert plan.failure == (shards[1], "died again") and plan.next_for([]) is None


def test_a_shard_is_handed_out_once_its_rows_are_in_the_store():
    """A new store's rows are written behind its making (issue 57): Ray's schedule hands a shard out once they
    say it may begin, in row order; a shard put back (its worker died) was begun, so it goes first; the rows'
    writer's error stops the job."""
    from extractor.driver.schedule import _Schedule

    class Rows:
        written, error = 1, None  # shards whose rows are in

        def ready(self, shard: int) -> bool:
            if self.error is not None:
                raise self.error
            return shard < self.written

        def wait(self, shard: int) -> None:  # (Ray's loop asks ready, never waits)
            raise AssertionError

    shards, rows = [Shard(i, 2 * i, 2 * i + 2) for i in range(4)], Rows()
    plan = _Schedule(shards, max_retries=1, ready=rows)
    first = plan.next_for([])
    assert first == shards[0] and plan.next_for([]) is None and plan.next_for([first]) is None
    rows.written = 3
    assert plan.next_for([first]) == shards[1] and plan.next_for([]) == shards[2] and plan.next_for([]) is None
    assert plan.lost([first], "died") == first and plan.next_for([]) == first  # begun before: no wait
    rows.error = OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        plan.next_for([])


def test_on_ray_a_new_stores_rows_are_written_behind_its_first_shards(ray_cluster, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    """The whole path on a Ray cluster: a manifest listed behind the job's start (its last rows read once shard 0
    began), the rows written a shard at a time (stretches made tiny), workers given each shard once its rows are in;
    the store holds the manifest's rows and what a direct forward gives."""
    from helpers.preprocess import tiny_resnet_mean

    import extractor.data.sources.manifest as manifest
    import extractor.store.layout as layout

    root = tmp_path / "imgs"
    images = make_images(root, per_class=4, classes=("a", "b"), size=40)
    (tmp_path / "m.csv").write_text("path\n" + "".join(f"{p.relative_to(root)}\n" for p in images))
    spec: dict[str, Any] = {"data": {"source": "manifest", "manifest": str(tmp_path / "m.csv"), "shard_size": 2,
                                     "batch_size": 2},
                            "capture": [{"layer": "layer4", "reduce": "mean", "dtype": "float32"}]}
    monkeypatch.setattr(layout, "WRITE_ROWS", 2)
    monkeypatch.setattr(layout, "ONCE_ROWS", 2)
    monkeypatch.setattr(manifest, "BLOCK_BYTES", 32)  # a row or two a block
    written, release = [], threading.Event()
    write, prepare, blocks = layout._RowArrays.write, manifest._Bulk.prepare, []

    def held(self: Any, start: int, stop: int, rows: Any) -> None:  # stretch 0, then the rest once shard 0 began
        assert not start or release.wait(120), "shard 0 never began while the rows waited"
        write(self, start, stop, rows)
        written.append(start)

    def listed(self: Any, *block: Any) -> Any:  # the manifest's blocks past its second once shard 0 began
        blocks.append(len(block[0]))
        assert len(blocks) < 3 or release.wait(120), "shard 0 never began while the manifest was listed"
        return prepare(self, *block)

    def on_event(name: str, info: dict) -> None:
        if name == "shard_started" and info["shard"] == 0:
            written.append("shard 0 began")
            release.set()

    monkeypatch.setattr(layout._RowArrays, "write", held)
    monkeypatch.setattr(manifest._Bulk, "prepare", listed)
    raw = job(root, tmp_path / "s.zarr", cluster={"backend": "ray", "workers": 1, "cpus_per_worker": 1}, **spec)
    assert run(parse_spec(raw), on_event=on_event).ok == 8
    assert written == [0, "shard 0 began", 2, 4, 6], written  # 4 stretches, shard 0 begun behind the first
    assert len(blocks) >= 3 and sum(blocks) == 8  # (streamed: a listing made whole first never lets shard 0 begin)
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.attrs["rows_written"] is True and s.attrs["status"] == "complete" and s.row(str(s.ids[5]))["row"] == 5
    assert s.ids.tolist() == [str(p.relative_to(root)) for p in images] and s.attrs["listing"]["source"] == "manifest"
    ref = tiny_resnet_mean([Path(p) for p in s.paths]).numpy()
    assert np.abs(s.numpy("layer4") - ref).max() <= 2e-3 * np.abs(ref).max()


def test_shard_failing_every_time_fails_the_job_then_resume_completes(ray_cluster, tmp_path: Path):
    root = tmp_path / "imgs"
    make_images(root, per_class=4, classes=("a",), size=40)
    for p in (root / "a").iterdir():  # dark images: PickyNet accepts them
        Image.fromarray((np.asarray(Image.open(p).convert("RGB")) // 3).astype(np.uint8)).save(p)
    bad = [root / "a" / "a02.jpg", root / "a" / "a03.png"]  # rows 2-3 are shard 1: every image of it raises
    for p in bad:
        Image.new("RGB", (40, 40), (255, 255, 255)).save(p)
    raw = job(root, tmp_path / "s.zarr", model={"name": None, "factory": "toy_models:picky_net", "device": "cpu"},
              data={"resize": None, "crop": 32, "shard_size": 2, "batch_size": 2},
              capture=[{"layer": "conv", "reduce": "mean"}],
              cluster={"backend": "ray", "workers": 1, "cpus_per_worker": 1, "max_retries": 1})
    with pytest.raises(ShardError) as err:
        run(parse_spec(raw))
    msg = str(err.value)
    assert "shard 1 (rows 2-3) failed 2 times" in msg and "saturated pixels" in msg and "--resume" in msg
    s = open_store(str(tmp_path / "s.zarr"))
    assert s.done_shards.tolist() == [True, False] and s.attrs["status"] == "failed"
    assert (s.status[:2] == 1).all() and (s.status[2:] == 0).all()
    for p in bad:
        Image.new("RGB", (40, 40), (20, 30, 40)).save(p)  # the cause, fixed
    raw["output"]["if_exists"] = "resume"
    summary = run(parse_spec(raw))
    assert summary.shards_run == 1 and summary.shards_skipped == 1
    assert (open_store(str(tmp_path / "s.zarr")).status == 1).all()


def test_more_workers_than_fit_run_on_those_that_fit(ray_cluster, image_dir: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture):
    """issue 17: asking for more workers than the cluster holds now is no error (on a real cluster
    capacity comes and goes): the job runs on those that fit, the rest wait to be placed."""
    raw = job(image_dir, tmp_path / "s.zarr", cluster={"backend": "ray", "workers": 3, "cpus_per_worker": 1})
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # the actors of the tests before release their CPUs a moment after they are killed
    with caplog.at_level("WARNING", logger="extractor.driver.ray_backend"):
        summary = run(parse_spec(raw))
    assert "2 of the 3 workers asked for (cluster.workers) fit" in caplog.text
    # Ray places actors in no set order: any two of the three run, and the start waits for those two,
    # not for the first two asked for (that wait was startup_timeout_s whenever Ray placed worker 2 first)
    assert "did not start within" not in caplog.text
    ran = {w["worker"] for w in summary.workers}
    assert summary.ok == 12 and len(ran) == 2 and ran <= {0, 1, 2}


def test_a_worker_no_node_can_hold_fails_fast(ray_cluster, image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "s.zarr", cluster={"backend": "ray", "workers": 1, "gpus_per_worker": 1})
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"a worker needs 2 CPUs and 1 GPUs, but no node .* \(2 CPUs and 0 GPUs"):
        run(parse_spec(raw))
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "s.zarr").exists()


def test_layer_errors_from_workers_reach_the_driver(ray_cluster, image_dir: Path, tmp_path: Path):
    raw = job(image_dir, tmp_path / "s.zarr", capture=[{"layer": "layer44"}],
              cluster={"backend": "ray", "workers": 1, "cpus_per_worker": 1})
    with pytest.raises(LayerError, match="Closest: layer4"):
        run(parse_spec(raw))


def test_a_ray_job_that_looked_before_another_created_the_store_refuses_instead_of_wiping_it(
        ray_cluster, slow_images: Path, tmp_path: Path):
    """issue 26, defect 1 on Ray: job A (Ray workers ready, the store looked at: nothing there) is held at its
    estimate line while job B creates the store and finishes a shard; A then refuses naming B, and B
    finishes a store equal to a clean run."""
    from extractor.errors import StoreError

    store = tmp_path / "s.zarr"
    raw = slow_job(slow_images, store, workers=1, cpus_per_worker=1)
    local = {**raw, "cluster": {"backend": "local"}}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(local))
    env = child_env()
    procs: list[subprocess.Popen] = []

    def while_a_waits(total: int, per_row: dict) -> None:
        b = warm.Popen([sys.executable, "-m", "extractor.cli", "run", str(tmp_path / "b.yaml"), "-q"],
                             env=env, stderr=subprocess.PIPE, text=True)
        procs.append(b)
        deadline = time.time() + 120
        while not committed(store, 0) and b.poll() is None and time.time() < deadline:
            time.sleep(0.05)

    with pytest.raises(StoreError, match=r"was created by another job after this one looked at it \(by another "
                                         r"extractor job: pid \d+"):
        run(parse_spec(raw), on_start=while_a_waits)
    _, err = procs[0].communicate(timeout=300)
    assert procs[0].returncode == 0, err
    run(parse_spec({**local, "output": {**local["output"], "store": str(tmp_path / "clean.zarr")}}))
    s, c = open_store(str(store)), open_store(str(tmp_path / "clean.zarr"))
    assert s.attrs["status"] == "complete"
    for key in ("conv", "map"):
        np.testing.assert_array_equal(s.numpy(key), c.numpy(key))


def only_held_by_the_stopped(store: Path) -> bool:
    """Some shards committed, every other held by one claimant (a stopped worker holds its shard and the next one
    it opened meanwhile)."""
    entries = generation(str(store)).ledger().read().entries
    pending = entries[entries["data"] == 0]
    return len(pending) < len(entries) and len(set(pending["claimant"].tolist())) == 1 and pending["claimant"][0] != 0


def test_two_ray_clusters_that_join_one_store_fill_it_each_shard_once(ray_cluster, tmp_path: Path):
    """Two Ray clusters, one store (issue 58): a job on a cluster of its own (a process that starts an embedded
    Ray) joins the store and its worker stops (SIGSTOP) in its first shard; a job on another cluster (this process's
    Ray) joins and computes every other shard, then waits for the one held by the first (its driver is alive);
    woken, the first commits it. Both exit complete, each shard committed once, equal to one job's store."""
    import threading

    root = tmp_path / "imgs"
    make_images(root, per_class=4, classes=("a", "b"), size=40)  # 8 images: 4 shards of 2

    def spec(store: Path) -> dict:
        raw = slow_job(root, store, workers=1, cpus_per_worker=1)
        raw["model"] = {"name": None, "factory": "toy_models:stopped_at_write", "device": "cpu"}
        raw["capture"] = [{"layer": "conv", "reduce": "mean", "key": "conv"}]
        raw["output"]["lease_timeout_s"] = 5.0
        return raw

    clean = tmp_path / "clean.zarr"
    run(parse_spec({**spec(clean), "cluster": {"backend": "local"}}))
    store = tmp_path / "s.zarr"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**spec(store), "output": {**spec(store)["output"], "if_exists": "join"}}))
    marker = tmp_path / "stopped"
    env = {k: v for k, v in child_env(EXTRACTOR_TEST_PAUSE=f"view:status/c/\\d+$|1|{marker}|before").items()
           if k != "RAY_ADDRESS"}  # a cluster of its own
    first = warm.Popen([sys.executable, "-m", "extractor.cli", "run", str(path), "-q"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (marker.exists() and marker.read_text()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    stopped = int(marker.read_text())  # the first cluster's worker, in its first shard
    got: list = []
    second = threading.Thread(target=lambda: got.append(run(parse_spec({**spec(store), "output": {
        **spec(store)["output"], "if_exists": "join"}}))))
    second.start()
    try:
        while not only_held_by_the_stopped(store):  # the second did every shard but those the stopped worker holds
            assert second.is_alive() and time.monotonic() < deadline + 120, "the second cluster's job stopped"
            time.sleep(0.05)
    finally:
        os.kill(stopped, signal.SIGCONT)
    second.join(timeout=180)
    out, err = first.communicate(timeout=180)
    assert first.returncode == 0, err
    ran = int(re.search(r"(\d+) shards? run", out).group(1))  # type: ignore[union-attr]
    assert got and got[0].shards_run >= 1 and ran >= 1 and got[0].shards_run + ran == 4, (got, out)
    s, c = open_store(str(store)), open_store(str(clean))
    assert s.attrs["status"] == "complete" and (s.status == 1).all()
    np.testing.assert_array_equal(s.numpy("conv"), c.numpy("conv"))
