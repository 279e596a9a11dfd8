"""A stale writer can never be live (issue 53): what a process writes is read only once one conditional step names it
(the head names a generation, a ledger entry an attempt), so a process stopped anywhere and woken after another took
the store over changes nothing the other made, and no resume takes its work.

Job A runs in a process that stops itself (SIGSTOP) at one change of the store (``helpers.pause``); its claimant's
record goes stale; job B makes the store again (``--overwrite``, another spec) or finishes it (``--resume``, the
same spec); A wakes and ends. Every object of B's store is compared before and after A woke, and a third job's
``--resume`` must find nothing to do and the values of a clean run. ``EXTRACTOR_PAUSE_REPEAT=N`` runs each point N
times (once in ``make test``).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from helpers.images import make_images
from helpers.paused_jobs import local_objects, spec_of, start_paused, wake
from helpers.stores import generation, wait_dead

from extractor.driver.runner import run
from extractor.errors import StoreError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec
from extractor.store import Objects, read_head

pytestmark = pytest.mark.slow  # paused job processes, an S3 server: make test, not make check
REPEAT = range(int(os.environ.get("EXTRACTOR_PAUSE_REPEAT", "1")))




@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("txn") / "imgs"
    make_images(root, per_class=4, classes=("a",), size=40)
    return root










def equal_values(url: str, clean: str, **options: Any) -> None:
    s, c = open_store(url, **options), open_store(clean, **options)
    assert s.attrs["status"] == "complete" and s.done_shards.all() and (s.status == 1).all()
    assert np.isfinite(s.numpy("conv")).all()  # values: the clean run's are made by the same code
    np.testing.assert_array_equal(s.numpy("conv"), c.numpy("conv"))
    assert s.attrs["spec"]["capture"] == c.attrs["spec"]["capture"]


def nothing_left_to_do(spec: dict, url: str) -> None:
    """A third job's --resume of the store finds every shard committed."""
    resumed = {**spec, "output": {**spec["output"], "store": url, "if_exists": "resume"}}
    assert run(parse_spec(resumed)).shards_run == 0


@pytest.fixture(scope="module")
def local_case(images: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An old store (A's spec, complete) to be made again, and clean runs of B's and of A's spec to compare."""
    base = tmp_path_factory.mktemp("txn-local")
    spec_a = spec_of(images, str(base / "old.zarr"), "mean")
    run(parse_spec(spec_a))
    spec_b = spec_of(images, str(base / "clean-b.zarr"), "max")
    run(parse_spec(spec_b))
    run(parse_spec({**spec_a, "output": {**spec_a["output"], "store": str(base / "clean-a.zarr")}}))
    return {"base": base, "a": spec_a, "b": spec_b}


# the changes of a job that makes a store again: its head, its claimant's record, the old generation's removal, the
# new one's arrays, ledger and root, a claim, a shard's object and per-row chunks, a commit, the final record
OVERWRITE = [("objects:zarr\\.json$", 1), ("objects:[0-9a-f]{16}/__txn/claimants/", 1),
             ("objects:[0-9a-f]{16}$", 1), ("view:conv/zarr\\.json$", 1), ("objects:.*__txn/ledger/0$", 1),
             ("view:zarr\\.json$", 1), ("objects:.*__txn/ledger/0$", 2), ("stream:.*/conv/c/1/", 1),
             ("view:status/c/1$", 1), ("objects:.*__txn/ledger/0$", 4), ("objects:.*__txn/final$", 1)]


@pytest.mark.parametrize("repeat", REPEAT)
@pytest.mark.parametrize(("key", "nth"), OVERWRITE)
def test_a_job_stopped_anywhere_changes_nothing_of_the_store_made_again_after_it(
        local_case: dict, tmp_path: Path, key: str, nth: int, repeat: int):
    """T5-1: A stopped at any change while it makes the store again (an --overwrite); B makes it again with another
    spec and completes; A wakes. Nothing of B's store changed (a removal of A's takes only the old generation's
    objects; A's late writes land in its own generation, which no one reads), A stops in one line, and a resume
    finds B's store complete, equal to a clean run of B's spec."""
    store = tmp_path / "s.zarr"
    shutil.copytree(local_case["base"] / "old.zarr", store)
    spec_a = {**local_case["a"], "output": {**local_case["a"]["output"], "store": str(store)}}
    a = start_paused(spec_a, tmp_path, key, nth, False, "--overwrite")
    try:
        wait_dead(str(store))
        spec_b = {**local_case["b"], "output": {**local_case["b"]["output"], "store": str(store),
                                                "if_exists": "overwrite"}}
        assert run(parse_spec(spec_b)).ok == 4
        gen = read_head(Objects.at(str(store))).generation  # type: ignore[union-attr]
        before = local_objects(store)
    finally:
        code, err = wake(a)
    assert "Traceback" not in err, err
    assert code == 1 and ("made again" in err or "was replaced by another job" in err or "taken over" in err), err
    after = local_objects(store)
    assert read_head(Objects.at(str(store))).generation == gen  # type: ignore[union-attr]
    mine = {k: v for k, v in before.items() if k == "zarr.json" or k.startswith(f"{gen}/")}
    assert {k: after.get(k) for k in mine} == mine, [k for k in mine if after.get(k) != mine[k]]
    assert not [k for k in after if k.startswith(f"{gen}/") and k not in before]  # nothing added to B's either
    equal_values(str(store), str(local_case["base"] / "clean-b.zarr"))
    nothing_left_to_do(local_case["b"], str(store))


# a shard's attempt: its claim (the ledger's second swap: after its creation), its object, its per-row chunks, its
# commit
RESUMED = [("objects:.*__txn/ledger/0$", 3), ("stream:.*/conv/c/1/", 1), ("view:status/c/1$", 1),
           ("objects:.*__txn/ledger/0$", 5)]


@pytest.mark.parametrize("repeat", REPEAT)
@pytest.mark.parametrize(("key", "nth"), RESUMED)
def test_a_job_stopped_in_a_shard_never_has_it_taken_once_another_finished_the_store(
        local_case: dict, tmp_path: Path, key: str, nth: int, repeat: int):
    """T5-2: A stopped while it computes a shard; its claim goes stale; B resumes the store (the same spec) and
    finishes it, that shard included; A wakes: its commit is refused (the ledger names B's attempt), what it wrote
    lies under its own attempt's name, which no commit names; no object of B's changed, and a resume takes nothing
    of A's."""
    store = tmp_path / "s.zarr"
    spec_a = {**local_case["a"], "output": {**local_case["a"]["output"], "store": str(store)}}
    a = start_paused(spec_a, tmp_path, key, nth)
    try:
        wait_dead(str(store))
        gen = generation(str(store))
        a_ids = {c["id"] for c in gen.roster.all()}
        assert run(parse_spec({**spec_a, "output": {**spec_a["output"], "if_exists": "resume"}})).ok == 4
        before = local_objects(store)
    finally:
        code, err = wake(a)
    assert "Traceback" not in err, err
    assert code in (0, 1), err  # 1: its commit refused; 0: it stopped before its shard (nothing of it then ran)
    after = local_objects(store)
    theirs = {k: v for k, v in before.items() if not any(k.endswith(f"/claimants/{i}") for i in a_ids)}
    assert {k: after.get(k) for k in theirs} == theirs, [k for k in theirs if after.get(k) != theirs[k]]
    named = {f"{x:016x}" for x in gen.ledger().read().named()}
    added = [k for k in after if k not in before and not any(k.endswith(f"/claimants/{i}") for i in a_ids)]
    assert all("/__attempts/" in k and k.split("/__attempts/")[1].split("/")[0] not in named for k in added), added
    equal_values(str(store), str(local_case["base"] / "clean-a.zarr"))
    nothing_left_to_do(local_case["a"], str(store))


@pytest.mark.parametrize("repeat", REPEAT)
def test_a_job_stopped_inside_a_local_swap_holds_the_store_and_another_waits_for_it_naming_it(
        local_case: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture, repeat: int):
    """Stopped with the store's lock file held (a swap's read and compare made, its rename not yet): no other change
    of the store can land meanwhile: another job waits, saying which process it waits for, and goes on once that one
    is woken; the stopped job, woken, finishes its swap; then it finds the store made again (by the other) and
    stops, or it finished its store first (its next swaps may take the lock before the waiter wakes: flock is not
    first come, first served; on a loaded machine it did), which the other then makes again; either way the store
    is the other job's, equal to a clean run of its spec."""
    import threading

    store = tmp_path / "s.zarr"
    spec_a = {**local_case["a"], "output": {**local_case["a"]["output"], "store": str(store)}}
    a = start_paused(spec_a, tmp_path, "objects:.*__txn/ledger/0$", 3, True)
    spec_b = {**local_case["b"], "output": {**local_case["b"]["output"], "store": str(store),
                                            "if_exists": "overwrite"}}
    wait_dead(str(store))
    got: list[Any] = []
    b = threading.Thread(target=lambda: got.append(run(parse_spec(spec_b))))
    try:
        with caplog.at_level("WARNING", logger="extractor"):
            b.start()
            deadline = time.monotonic() + 600  # a guard: B logs it once it meets the lock
            while not any(f"stays locked by process {a.pid}" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline and b.is_alive(), "B never said which process it waits for"
                time.sleep(0.05)
        assert "kill -CONT PID" in caplog.text and not got  # B waits: nothing of it landed
    finally:
        code, err = wake(a)
        b.join(timeout=600)
    assert got and got[0].ok == 4
    assert (code == 1 and "made again" in err) or (code == 0 and "Traceback" not in err), (code, err)
    equal_values(str(store), str(local_case["base"] / "clean-b.zarr"))


def test_objects_copied_in_from_another_store_are_never_taken_as_done(local_case: dict, tmp_path: Path):
    """A shard's objects copied into a store from another one (its attempts, and even its ledger's block, the
    commits): the attempts are named by no commit of this store, so nothing of them is read, and a resume computes
    the shard; a ledger block of another store is refused where it is read, never taken for this one's."""
    other = tmp_path / "other.zarr"
    shutil.copytree(local_case["base"] / "clean-b.zarr", other)
    store = tmp_path / "s.zarr"
    spec_a = {**local_case["a"], "output": {**local_case["a"]["output"], "store": str(store)}}
    run(parse_spec(spec_a))
    from helpers.stores import pending

    pending(str(store), [1])  # shard 1 not committed, as a job stopped before it leaves it
    theirs, ours = generation(str(other)), generation(str(store))
    for attempt in (other / theirs.name / "__attempts").iterdir():  # the other store's objects, copied in
        shutil.copytree(attempt, store / ours.name / "__attempts" / attempt.name)
    s = open_store(str(store))
    assert not s.done_shards[1] and (s.status[2:] == 0).all() and np.isnan(s["conv"][2:]).all()
    resumed = run(parse_spec({**spec_a, "output": {**spec_a["output"], "if_exists": "resume"}}))
    assert [p.shard for p in resumed.per_shard] == [1]
    equal_values(str(store), str(local_case["base"] / "clean-a.zarr"))
    shutil.copy(other / theirs.name / "__txn" / "ledger" / "0", store / ours.name / "__txn" / "ledger" / "0")
    with pytest.raises(StoreError, match=r"is a block of another store's ledger .*copied in"):
        open_store(str(store))


# ---------------------------------------------------------------------------------------------- on S3

@pytest.fixture(scope="module")
def s3_case(images: Path, moto_s3: dict[str, str]) -> dict:
    import s3fs

    options = moto_s3
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("txn")
    spec_b = spec_of(images, "s3://txn/clean-b.zarr", "max", storage_options=options)
    run(parse_spec(spec_b))
    spec_a = spec_of(images, "s3://txn/clean-a.zarr", "mean", storage_options=options)
    run(parse_spec(spec_a))
    return {"fs": fs, "options": options, "a": spec_a, "b": spec_b}


def s3_objects(fs: Any, url: str) -> dict[str, str]:
    fs.invalidate_cache()
    base = url.removeprefix("s3://")
    return {k[len(base) + 1:]: fs.info(k)["ETag"] for k in sorted(fs.find(base))}


@pytest.mark.parametrize("repeat", REPEAT)
@pytest.mark.parametrize(("key", "nth"), [("objects:zarr\\.json$", 1), ("objects:[0-9a-f]{16}$", 1),
                                          ("view:zarr\\.json$", 1), ("view:status/c/1$", 1),
                                          ("objects:.*__txn/ledger/0$", 4)])
def test_on_s3_a_job_stopped_anywhere_changes_nothing_of_the_store_made_again_after_it(
        s3_case: dict, tmp_path: Path, key: str, nth: int, repeat: int):
    """T5-1 on S3 (the moto server): A, making the store again over an old one, stopped with its request about to go
    out; B makes it again and completes; A wakes: no object of B's store changed (a removal of A's lists the old
    generation's objects only; its writes land in its own generation; its conditional writes are refused)."""
    fs, options = s3_case["fs"], s3_case["options"]
    url = f"s3://txn/{tmp_path.name}.zarr"
    run(parse_spec({**s3_case["a"], "output": {**s3_case["a"]["output"], "store": url}}))  # the old store
    spec_a = {**s3_case["a"], "output": {**s3_case["a"]["output"], "store": url}}
    a = start_paused(spec_a, tmp_path, key, nth, False, "--overwrite")
    try:
        wait_dead(url, options)
        spec_b = {**s3_case["b"], "output": {**s3_case["b"]["output"], "store": url, "if_exists": "overwrite"}}
        assert run(parse_spec(spec_b)).ok == 4
        gen = read_head(Objects.at(url, options)).generation  # type: ignore[union-attr]
        before = s3_objects(fs, url)
    finally:
        code, err = wake(a)
    assert code == 1 and "Traceback" not in err, err
    after = s3_objects(fs, url)
    mine = {k: v for k, v in before.items() if k == "zarr.json" or k.startswith(f"{gen}/")}
    assert {k: after.get(k) for k in mine} == mine, [k for k in mine if after.get(k) != mine[k]]
    assert not [k for k in after if k.startswith(f"{gen}/") and k not in before]
    equal_values(url, "s3://txn/clean-b.zarr", storage_options=options)


@pytest.mark.parametrize("repeat", REPEAT)
@pytest.mark.parametrize(("key", "nth"), [("view:status/c/1$", 1), ("objects:.*__txn/ledger/0$", 5)])
def test_on_s3_a_job_stopped_in_a_shard_never_has_it_taken_once_another_finished_the_store(
        s3_case: dict, tmp_path: Path, key: str, nth: int, repeat: int):
    """T5-2 on S3: A stopped in a shard; B resumes and finishes; A's commit (an If-Match of the ledger's block) is
    refused, its objects named by no commit; no object of B's changed."""
    fs, options = s3_case["fs"], s3_case["options"]
    url = f"s3://txn/{tmp_path.name}.zarr"
    spec_a = {**s3_case["a"], "output": {**s3_case["a"]["output"], "store": url}}
    a = start_paused(spec_a, tmp_path, key, nth)
    try:
        wait_dead(url, options)
        a_ids = {c["id"] for c in generation(url, options).roster.all()}
        assert run(parse_spec({**spec_a, "output": {**spec_a["output"], "if_exists": "resume"}})).ok == 4
        before = s3_objects(fs, url)
    finally:
        code, err = wake(a)
    assert code in (0, 1) and "Traceback" not in err, err
    after = s3_objects(fs, url)
    theirs = {k: v for k, v in before.items() if not any(k.endswith(f"/claimants/{i}") for i in a_ids)}
    assert {k: after.get(k) for k in theirs} == theirs, [k for k in theirs if after.get(k) != theirs[k]]
    named = {f"{x:016x}" for x in generation(url, options).ledger().read().named()}
    added = [k for k in after if k not in before and not any(k.endswith(f"/claimants/{i}") for i in a_ids)]
    assert all("/__attempts/" in k and k.split("/__attempts/")[1].split("/")[0] not in named for k in added), added
    equal_values(url, "s3://txn/clean-a.zarr", storage_options=options)


def test_an_s3_that_ignores_conditional_writes_is_found_and_named(images: Path, caplog: pytest.LogCaptureFixture):
    """A storage that accepts a create-only write it should refuse (it replaces the object) is found when a process
    joins the store: the job says what it cannot promise there, and its swaps read, compare and write."""
    pytest.importorskip("s3fs")
    from helpers.processes import free_port
    from moto.s3.responses import S3Response
    from moto.server import ThreadedMotoServer

    original = S3Response.put_object

    def ignoring(self):
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
        spec = spec_of(images, "s3://loose/s.zarr", "mean", storage_options=options)
        with caplog.at_level("WARNING", logger="extractor"):
            assert run(parse_spec(spec)).ok == 4
        said = [r.getMessage() for r in caplog.records if "conditional writes" in r.getMessage()]
        assert len(said) == 1 and "s3://loose/s.zarr does not honour conditional writes" in said[0]
        assert "run one job at a time on this store" in said[0]
        assert open_store("s3://loose/s.zarr", storage_options=options).attrs["status"] == "complete"
        objects = Objects.at("s3://loose/s.zarr", options)
        assert not objects.probe()
    finally:
        S3Response.put_object = original  # type: ignore[method-assign]
        server.stop()


def test_a_store_on_another_fsspec_file_system_is_made_and_made_again(images: Path,
                                                                     caplog: pytest.LogCaptureFixture):
    """memory:// (as gs:// and the rest): no lock, no conditional writes: a change is a read, a compare and a write,
    said once; one job at a time works as anywhere."""
    url = "memory://txn/s.zarr"
    spec = spec_of(images, url, "mean")
    with caplog.at_level("WARNING", logger="extractor"):
        assert run(parse_spec(spec)).ok == 4
    assert any("run one writer at a time on this store" in r.getMessage() for r in caplog.records)
    spec["output"]["if_exists"] = "overwrite"
    assert run(parse_spec(spec)).ok == 4
    s = open_store(url)
    assert s.attrs["status"] == "complete" and s.done_shards.all()


def _job_file(images: Path, tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec_of(images, str(tmp_path / "s.zarr"), "mean")))
    return path


def test_a_full_disk_while_the_store_is_made_is_one_error_with_the_resume_command(
        images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """issue 37, defect 7: an OSError while the arrays are made (a disk full) was an 84-line traceback."""
    import errno

    import extractor.store.layout as fmt
    from extractor.cli import main

    spec = _job_file(images, tmp_path)

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


def test_ctrl_c_while_overwrite_makes_the_store_says_the_old_one_is_gone(
        images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """issue 37, defect 8: an interrupt while --overwrite made the store again said "nothing was written"."""
    import extractor.store.layout as fmt
    from extractor.cli import main

    spec = _job_file(images, tmp_path)
    assert main(["run", str(spec), "-q"]) == 0

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(fmt, "write_id_index", interrupted)
    assert main(["run", str(spec), "-q", "--overwrite"]) == 130
    err = capsys.readouterr().err
    assert "nothing was written" not in err and "the store was being created (what it held before is gone;" in err
    assert f"run {spec} -q --resume" in err, err
    assert main(["run", str(spec), "-q", "--resume"]) == 130  # its rows written again, interrupted again
    err = capsys.readouterr().err
    assert "the store's rows were being written (its finished shards are kept)" in err and "gone" not in err, err
    monkeypatch.undo()
    assert main(["run", str(spec), "-q", "--resume"]) == 0
    assert open_store(str(tmp_path / "s.zarr")).attrs["status"] == "complete"


def test_the_head_and_a_ledger_entry_are_read_as_written_never_half(tmp_path: Path):
    """What the steps rest on: a local create lands once (a second is refused, writing nothing), a swap only at
    the version read, each object replaced whole."""
    objects = Objects.at(str(tmp_path / "s"))
    assert objects.create("x", b"1") and not objects.create("x", b"2") and objects.get("x") == b"1"
    data, version = objects.read("x")
    assert data == b"1" and objects.swap("x", version, b"3") and not objects.swap("x", version, b"4")
    assert objects.get("x") == b"3" and objects.probe()


def test_a_claim_refused_names_the_shards_of_its_block_that_are_not_free_either(tmp_path: Path):
    """Processes that never talk learn of each other's claims a block at a time: a claim that finds its shard
    another's names the other shards the same read found committed or held by a live claimant (a joined job's
    workers skip them without reading), never one that is free or held by a dead claimant."""
    from extractor.data import Rows
    from extractor.store.layout import StoreArrays
    from extractor.store.ledger import Verdict, commit, new_id
    from extractor.store.synthetic import create_store

    url = str(tmp_path / "s.zarr")
    n = 40  # 3 blocks of shards s, s+3, ...: one shard a row
    create_store(url, Rows(ids=[f"i{i}" for i in range(n)], paths=[""] * n, labels=[0] * n),
                 StoreArrays(captures={}, extras={}, shard_size=1, chunk_rows={}), attrs={}, pending=True)
    ledger = generation(url).ledger()
    block = [int(s) for s in ledger.shards_of(0)]
    assert ledger.blocks > 1 and len(block) > 5
    a, b, dead_one, c = new_id(), new_id(), new_id(), new_id()
    alive_ids = {a, b, c}
    dead = lambda claimant: claimant not in alive_ids  # noqa: E731
    for s in block[:2]:  # a holds two, commits one
        attempt = new_id()
        assert ledger.claim(s, a, attempt, dead)[0] is Verdict.OK
    assert ledger.step(block[0], lambda e: commit(e, a, int(e["attempt"]), 1, 0, 0)) is Verdict.OK
    assert ledger.claim(block[2], b, new_id(), dead)[0] is Verdict.OK  # b holds one
    assert ledger.claim(block[3], dead_one, new_id(), dead)[0] is Verdict.OK  # a claimant since dead holds one
    verdict, _, skip = ledger.claim(block[1], c, new_id(), dead)
    assert verdict is Verdict.TAKEN and sorted(skip) == sorted([block[0], block[2]])
    verdict, _, skip = ledger.claim(block[0], c, new_id(), dead)
    assert verdict is Verdict.DONE and sorted(skip) == sorted([block[1], block[2]])
    verdict, _, skip = ledger.claim(block[3], c, new_id(), dead)  # the dead one's: taken over
    assert verdict is Verdict.OK and skip == []
