"""A job paused past its lease at any write of its store writes nothing into the store another job took over
(issue 37): the check and the write are one step (store.fence). Job A runs in a process that stops itself
(SIGSTOP) at one write, before or inside that step; its lease goes stale; job B replaces the store with another
spec and completes; A wakes. Every object of the store is compared before and after A woke.

``EXTRACTOR_PAUSE_REPEAT=N`` runs each point N times (once in ``make test``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import warm
import yaml
from conftest import child_env, job, make_images

from extractor.driver.runner import run
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec

TESTS = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # paused job processes, an S3 server: make test, not make check
REPEAT = range(int(os.environ.get("EXTRACTOR_PAUSE_REPEAT", "1")))
LEASE_S = 1.0


def spec_of(root: Path, store: str, reduce: str, model: dict, **output) -> dict:
    return job(root, Path(store), model={"name": None, "device": "cpu", **model},
               data={"resize": None, "crop": 32, "shard_size": 2, "batch_size": 1, "decode_workers": 1},
               capture=[{"layer": "conv", "reduce": reduce, "key": "conv"}],
               output={"store": store, "chunk_rows": 1, "lease_timeout_s": LEASE_S, "sharding": True, **output})


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fence") / "imgs"
    make_images(root, per_class=4, classes=("a",), size=40)
    return root


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def start_paused(spec: dict, tmp_path: Path, where: str, key: str, nth: int) -> tuple[subprocess.Popen, Path]:
    """Job A with --overwrite, in a process that stops itself at the write named; returns once it has stopped."""
    marker = tmp_path / "stopped"
    spec = {**spec, "model": {**spec["model"], "factory": "toy_models:stopped_at_write",
                              "factory_kwargs": {"where": where, "key": key, "nth": nth, "marker": str(marker)}}}
    path = tmp_path / "a.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = warm.Popen([sys.executable, "-m", "extractor.cli", "run", str(path), "-q", "--overwrite"],
                            env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (marker.exists() and stopped(proc.pid)):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"job A never reached {key}"
        time.sleep(0.02)
    return proc, marker


def wait_stale(read_lease) -> None:  # noqa: ANN001 - a callable giving the lease record
    """Until A's lease (A is stopped: its heartbeats too) is older than its timeout."""
    deadline = time.monotonic() + 60
    while time.time() - float(read_lease().get("heartbeat", 0)) <= LEASE_S:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def local_objects(store: Path) -> dict[str, str]:
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file()}


def wake(proc: subprocess.Popen) -> tuple[int, str]:
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=180)
    return proc.returncode, err


def equal_captures(a: str, b: str, **options: object) -> None:
    s, c = open_store(a, **options), open_store(b, **options)
    assert s.attrs["status"] == "complete" and s.done_shards.all() and (s.status == 1).all()
    np.testing.assert_array_equal(s.numpy("conv"), c.numpy("conv"))
    assert s.attrs["spec"]["capture"] == c.attrs["spec"]["capture"]


# the writes of a job that overwrites a store: the old store's removal, its creation, a shard's data and its finish
# (each per-row chunk, its statistics, its done marker), the merged statistics; (key, which write of it)
BEFORE = [("<wipe>", 1), ("zarr.json", 1), ("conv/zarr.json", 1), ("ids/c/0", 1), ("conv/c/1/0", 1),
          ("status/c/1", 1), ("digest/c/1", 1), ("shard_stats/c/1", 1), ("shard_done/c/1", 1),
          ("stats_sums/c/0", 1)]


@pytest.fixture(scope="module")
def local_case(images: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An old store (A's spec, complete) to be overwritten, and a clean run of B's and of A's spec to compare."""
    base = tmp_path_factory.mktemp("fence-local")
    spec_a = spec_of(images, str(base / "old.zarr"), "mean", {"factory": "toy_models:slow_net",
                                                               "factory_kwargs": {"seconds": 0}})
    run(parse_spec(spec_a))
    spec_b = spec_of(images, str(base / "clean-b.zarr"), "max", {"factory": "toy_models:slow_net",
                                                                 "factory_kwargs": {"seconds": 0}})
    run(parse_spec(spec_b))
    run(parse_spec({**spec_a, "output": {**spec_a["output"], "store": str(base / "clean-a.zarr")}}))
    return {"base": base, "a": spec_a, "b": spec_b}


@pytest.mark.parametrize("repeat", REPEAT)
@pytest.mark.parametrize(("key", "nth"), BEFORE)
def test_a_job_stopped_before_any_write_writes_nothing_once_another_took_the_store(
        local_case: dict, tmp_path: Path, key: str, nth: int, repeat: int):
    store = tmp_path / "s.zarr"
    shutil.copytree(local_case["base"] / "old.zarr", store)
    spec_a = {**local_case["a"], "output": {**local_case["a"]["output"], "store": str(store)}}
    a, _ = start_paused(spec_a, tmp_path, "before", key, nth)
    try:
        from extractor.store.fence import read_record

        from extractor.errors import StoreError

        wait_stale(lambda: read_record(str(store)))
        spec_b = {**local_case["b"], "output": {**local_case["b"]["output"], "store": str(store),
                                                "if_exists": "overwrite"}}
        try:
            assert run(parse_spec(spec_b)).ok == 4
        except StoreError as refused:  # another write of A's (its other threads) was in its step when A stopped:
            assert f"stopped mid-write: the job that held it (pid {a.pid}" in str(refused)  # A keeps the store
            code, err = wake(a)
            assert code == 0, err
            equal_captures(str(store), str(local_case["base"] / "clean-a.zarr"))
            return
        after_b = local_objects(store)
    finally:
        if a.returncode is None:
            code, err = wake(a)
    assert code == 1 and ("this job no longer holds" in err or "was replaced by another job" in err), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert local_objects(store) == after_b  # not one object of A's, nothing of B's removed
    equal_captures(str(store), str(local_case["base"] / "clean-b.zarr"))


@pytest.mark.parametrize("repeat", REPEAT)
@pytest.mark.parametrize(("key", "nth"), [("<wipe>", 1), ("conv/c/1/0", 1), ("shard_done/c/1", 1)])
def test_a_job_stopped_inside_a_write_keeps_the_store_and_the_other_job_refuses_naming_it(
        local_case: dict, tmp_path: Path, key: str, nth: int, repeat: int):
    """Stopped with the store's lock held: no takeover can land (the other job refuses, naming the stopped job);
    woken, it finishes its store, equal to a clean run."""
    from extractor.store.fence import read_record

    from extractor.errors import StoreError

    store = tmp_path / "s.zarr"
    shutil.copytree(local_case["base"] / "old.zarr", store)
    spec_a = {**local_case["a"], "output": {**local_case["a"]["output"], "store": str(store)}}
    a, _ = start_paused(spec_a, tmp_path, "inside", key, nth)
    try:
        wait_stale(lambda: read_record(str(store)))
        spec_b = {**local_case["b"], "output": {**local_case["b"]["output"], "store": str(store),
                                                "if_exists": "overwrite"}}
        with pytest.raises(StoreError, match=rf"is locked by a writer that stopped mid-write: the job that held it "
                                             rf"\(pid {a.pid} on .*resume it \(kill -CONT {a.pid}\)"):
            run(parse_spec(spec_b))
    finally:
        code, err = wake(a)
    assert code == 0, err
    equal_captures(str(store), str(local_case["base"] / "clean-a.zarr"))


@pytest.fixture(scope="module")
def s3_case(images: Path, moto_s3: dict[str, str]) -> dict:
    import s3fs

    options = moto_s3
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("fence")
    model = {"factory": "toy_models:slow_net", "factory_kwargs": {"seconds": 0}}
    spec_b = spec_of(images, "s3://fence/clean-b.zarr", "max", model, storage_options=options)
    run(parse_spec(spec_b))
    return {"fs": fs, "options": options, "a": spec_of(images, "", "mean", model, storage_options=options),
           "b": spec_b}


def s3_objects(fs, url: str) -> dict[str, str]:  # noqa: ANN001 - an s3fs file system
    fs.invalidate_cache()
    return {k: fs.info(k)["ETag"] for k in sorted(fs.find(url.removeprefix("s3://")))}


@pytest.mark.parametrize("repeat", REPEAT)
@pytest.mark.parametrize(("key", "nth"), [("zarr.json", 2), ("conv/c/1/0", 1), ("status/c/1", 1),
                                          ("shard_done/c/1", 1), ("stats_sums/c/0", 1)])
def test_on_s3_a_job_stopped_inside_a_conditional_write_writes_nothing_into_the_store_another_took(
        s3_case: dict, tmp_path: Path, key: str, nth: int, repeat: int):
    """On S3 there is no lock: A is stopped with its request about to go out, after every check it makes. B takes
    the store and completes; A's create-only (or If-Match) write is refused, and A stops."""
    from extractor.store.lease import _LeaseObject

    fs, options = s3_case["fs"], s3_case["options"]
    url = f"s3://fence/{tmp_path.name}.zarr"
    spec_a = {**s3_case["a"], "output": {**s3_case["a"]["output"], "store": url}}
    a, _ = start_paused(spec_a, tmp_path, "inside", key, nth)
    try:
        wait_stale(lambda: _LeaseObject(url, options).read()[0])
        spec_b = {**s3_case["b"], "output": {**s3_case["b"]["output"], "store": url, "if_exists": "overwrite"}}
        assert run(parse_spec(spec_b)).ok == 4
        after_b = s3_objects(fs, url)
    finally:
        code, err = wake(a)
    assert code == 1 and ("this job no longer holds" in err or "was replaced by another job" in err), err
    assert "Traceback" not in err, err
    assert s3_objects(fs, url) == after_b
    equal_captures(url, "s3://fence/clean-b.zarr", storage_options=options)


def test_an_object_another_writer_made_after_a_listing_is_read(moto_s3: dict[str, str]):
    """The loaded-run failure of the test above (1 in 8 under load): B's wipe listed A's store, fsspec kept that
    listing (one per thread and file system), B's shard writer made ``shard_done/c/1`` through another file system
    object, and B's own read of the done markers took c/1 from the stale listing as missing: a complete store
    marked incomplete. The job's store reads each object, never a listing from a cache."""
    import threading

    import s3fs
    import zarr
    from extractor.store.fence import fenced_group
    from zarr.core.sync import sync

    s3fs.S3FileSystem(**moto_s3).mkdir("listed")
    url = "s3://listed/s.zarr"
    zarr.open_group(url, mode="w", storage_options=moto_s3).create_array("done", shape=(2,), chunks=(1,),
                                                                         dtype="uint8", fill_value=0)[0] = 1
    group = fenced_group(url, moto_s3, None)
    fs = group.store.fs
    sync(fs._find("listed/s.zarr", detail=True))  # a listing (a wipe's): c/0 only

    def other_writer() -> None:  # a file system object of another thread: its writes invalidate nothing here
        zarr.open_group(url, mode="r+", storage_options=moto_s3)["done"][1] = 1

    t = threading.Thread(target=other_writer)
    t.start()
    t.join()
    assert group["done"][:].tolist() == [1, 1]


def test_an_s3_that_ignores_conditional_writes_is_found_and_named(images: Path, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture):
    """A storage that accepts a create-only write it should refuse (it replaces the object) is found by the
    lease's probe: the job says what it cannot promise there."""
    pytest.importorskip("s3fs")
    from conftest import free_port
    from moto.s3.responses import S3Response
    from moto.server import ThreadedMotoServer

    original = S3Response.put_object

    def ignoring(self):  # noqa: ANN001, ANN202 - moto's handler, its conditions dropped
        self.headers = {k: v for k, v in self.headers.items() if k.lower() not in ("if-none-match", "if-match")}
        return original(self)

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        S3Response.put_object = ignoring  # type: ignore[method-assign]
        import s3fs

        options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
        s3fs.S3FileSystem(**options).mkdir("loose")
        spec = spec_of(images, "s3://loose/s.zarr", "mean", {"factory": "toy_models:slow_net",
                                                               "factory_kwargs": {"seconds": 0}},
                       storage_options=options)
        with caplog.at_level("WARNING", logger="extractor"):
            assert run(parse_spec(spec)).ok == 4
        said = [r.getMessage() for r in caplog.records if "conditional writes" in r.getMessage()]
        assert len(said) == 1 and "s3://loose/s.zarr does not honour conditional writes" in said[0]
        assert "run one job at a time on this store" in said[0]
        assert open_store("s3://loose/s.zarr", storage_options=options).attrs["status"] == "complete"
        # a paused job's late renewal there would take the lease back (its If-Match ignored): it reads first
        from extractor.store.lease import Lease, _LeaseObject

        from extractor.errors import FencedError

        a = Lease("s3://loose/s.zarr", options, 60, {"pid": 1, "host": "a"})
        a.acquire()
        assert a.conditional is False
        b = Lease("s3://loose/s.zarr", options, 60, {"pid": 2, "host": "b"})
        b.object.write(b._record(), None)  # another job took the store
        with pytest.raises(FencedError, match="this job no longer holds"):
            a._write()
        assert a.lost and _LeaseObject("s3://loose/s.zarr", options).read()[0]["token"] == b.token
        a._stop.set()
    finally:
        S3Response.put_object = original  # type: ignore[method-assign]
        server.stop()


def toy_spec(root: Path, store: Path, tmp_path: Path) -> Path:
    raw = spec_of(root, str(store), "mean", {"factory": "toy_models:slow_net", "factory_kwargs": {"seconds": 0}})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_full_disk_while_the_store_is_created_is_one_error_with_the_resume_command(
        images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """issue 37, defect 7: an OSError while the arrays are created (a disk full) was an 84-line traceback."""
    import errno

    import extractor.store.layout as fmt
    from extractor.cli import main

    spec = toy_spec(images, tmp_path / "s.zarr", tmp_path)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fmt, "_create_row_arrays", full)
    assert main(["run", str(spec), "-q"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "No space left on device" in err and "The store is half-created" in err, err
    assert f"run {spec} -q --resume" in err, err
    monkeypatch.undo()
    assert main(["run", str(spec), "-q", "--resume"]) == 0
    assert open_store(str(tmp_path / "s.zarr")).attrs["status"] == "complete"


def test_ctrl_c_while_overwrite_creates_the_store_says_the_old_one_is_gone(
        images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """issue 37, defect 8: an interrupt while --overwrite re-created the store said "nothing was written"."""
    import extractor.store.layout as fmt
    from extractor.cli import main

    spec = toy_spec(images, tmp_path / "s.zarr", tmp_path)
    assert main(["run", str(spec), "-q"]) == 0

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(fmt, "_create_shard_arrays", interrupted)
    assert main(["run", str(spec), "-q", "--overwrite"]) == 130
    err = capsys.readouterr().err
    assert "nothing was written" not in err and "the store was being created (what it held before is gone)" in err
    assert f"run {spec} -q --resume" in err, err
    monkeypatch.undo()
    assert main(["run", str(spec), "-q", "--resume"]) == 0
    assert open_store(str(tmp_path / "s.zarr")).attrs["status"] == "complete"


def test_a_reader_never_sees_a_shard_object_half_replaced(tmp_path: Path):
    """issue 37, defect 9: zarr reads a shard's index, then the chunk at the offset it gives: an object replaced in
    between (a shard redone) gave "Zstd decompression error" or another chunk's rows. Two versions of one shard's
    object (other values, so other offsets) are renamed over it again and again while rows are read: each read is
    one version's rows, whole, and none fails."""
    import threading

    import zarr

    from extractor.data import Rows
    from extractor.store.layout import StoreArrays
    from extractor.store.synthetic import create_store

    def made(name: str, value: float) -> Path:
        url = str(tmp_path / name)
        meta = {"layer": "x", "module_type": "X", "what": "output", "index": None, "reduce": "none",
                "dtype": "float32", "shape": [64], "original_shape": [64], "dims": ["x.f"], "capture": 0}
        n = 32
        g = create_store(url, Rows(ids=[f"i{i}" for i in range(n)], paths=[""] * n, labels=[0] * n),
                         StoreArrays(captures={"emb": meta}, extras={}, shard_size=32, chunk_rows={"emb": 2},
                                     sharded=True),
                         {"n_rows": n, "n_shards": 1, "captures": {"emb": meta}, "format_version": 1, "spec": {},
                          "model": {}})
        rng = np.random.default_rng(int(value))
        data = (rng.normal(size=(n, 64)) * (1 + value)).astype(np.float32)
        data[: int(value) * 3] = 0  # other sizes of compressed chunks: the offsets in the two objects differ
        g["emb"][:] = data
        g["status"][:] = 1
        return Path(url)

    a, b = made("a.zarr", 1.0), made("b.zarr", 5.0)
    store = tmp_path / "s.zarr"
    shutil.copytree(a, store)
    shard = Path("emb") / "c" / "0" / "0"
    versions = [(a / shard).read_bytes(), (b / shard).read_bytes()]
    assert len({len(v) for v in versions}) == 2
    want = [np.asarray(zarr.open_array(str(x / "emb"), mode="r")[:]) for x in (a, b)]
    stop = threading.Event()

    def replace() -> None:
        i = 0
        while not stop.is_set():
            tmp = store / f"{shard}.tmp"
            tmp.write_bytes(versions[i % 2])
            os.replace(tmp, store / shard)
            i += 1

    s = open_store(str(store))
    writer = threading.Thread(target=replace)
    writer.start()
    try:
        rng = np.random.default_rng(0)
        for _ in range(1500):
            r = int(rng.integers(0, 32))
            got = s.numpy("emb", rows=[r])[0]
            assert any(np.array_equal(got, w[r]) for w in want), f"row {r} mixes two versions of its shard"
    finally:
        stop.set()
        writer.join()


def test_a_store_on_another_fsspec_file_system_is_written_with_the_lease_checked(images: Path):
    """memory:// (as gs:// and the rest): no lock, no conditional writes: the lease is read before each write, off
    zarr's event loop (a read through zarr from inside its own loop fails)."""
    url = "memory://fencing/s.zarr"
    spec = spec_of(images, url, "mean", {"factory": "toy_models:slow_net", "factory_kwargs": {"seconds": 0}})
    assert run(parse_spec(spec)).ok == 4
    spec["output"]["if_exists"] = "overwrite"
    assert run(parse_spec(spec)).ok == 4
    from extractor.store.lease import _LeaseObject

    s = open_store(url)
    assert s.attrs["status"] == "complete" and s.done_shards.all() and _LeaseObject(url, None).read()[0]["released"]
