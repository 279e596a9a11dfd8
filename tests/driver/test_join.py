"""Many processes, one store (issue 58): ``extractor run JOB --join`` started several times at once, by processes that
never talk to each other, fills one store: the first to come makes it (once), each shard is claimed by one process at
a time and committed once, a killed process's claims are taken over, a paused one's late commit is refused, and every
process exits 0 once the store is complete, equal to one job's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import warm
import yaml
from helpers.images import make_images
from helpers.jobs import job
from helpers.processes import child_env
from helpers.stores import generation

from extractor.driver.runner import run
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec

pytestmark = pytest.mark.slow  # several job processes at once


def spec_of(images: Path, store: Path, seconds: float = 0.0) -> dict:
    return job(images, store, model={"name": None, "factory": "toy_models:stopped_at_write", "device": "cpu",
                                     "factory_kwargs": {"seconds": seconds}},
               data={"resize": None, "crop": 32, "shard_size": 2, "batch_size": 1, "decode_workers": 1},
               capture=[{"layer": "conv", "reduce": "mean", "key": "conv"}],
               output={"store": str(store), "chunk_rows": 1, "lease_timeout_s": 1.0})


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("join") / "imgs"
    make_images(root, per_class=8, classes=("a", "b"), size=40)  # 16 images: 8 shards of 2
    return root


@pytest.fixture(scope="module")
def clean(images: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("join-clean") / "clean.zarr"
    run(parse_spec(spec_of(images, store)))
    return store


def joiners(spec: dict, tmp_path: Path, n: int, **env: str) -> list[subprocess.Popen]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return [warm.Popen([sys.executable, "-m", "extractor.cli", "run", str(path), "-q", "--join"],
                       env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(n)]


def ended(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """Each process's exit code, standard output and error, once it has ended."""
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        out.append((p.returncode, stdout, stderr))
    return out


def same_as(store: Path, clean: Path) -> None:
    s, c = open_store(str(store)), open_store(str(clean))
    assert s.attrs["status"] == "complete" and s.done_shards.all() and (s.status == 1).all()
    assert np.isfinite(s.numpy("conv")).all()
    np.testing.assert_array_equal(s.numpy("conv"), c.numpy("conv"))  # bit for bit


def shards_said(out: str) -> int:
    """The shards a process says it ran (its summary: "N shards run")."""
    import re

    found = re.search(r"(\d+) shards? run", out)
    assert found, out
    return int(found.group(1))


def wait_holding(victim: subprocess.Popen, store: Path) -> None:
    """Until ``victim`` holds a claim of a shard not committed."""
    deadline = time.monotonic() + 120
    while True:
        try:
            gen = generation(str(store))
            entries = gen.ledger().read().entries
            mine = [c for c in gen.roster.all() if c.get("pid") == victim.pid]
        except (AssertionError, OSError):
            entries, mine = None, []
        if entries is not None and mine and ((entries["claimant"] == int(mine[0]["id"], 16))
                                             & (entries["data"] == 0)).any():
            return
        assert time.monotonic() < deadline and victim.poll() is None, "the victim never held a shard"
        time.sleep(0.05)


def test_three_processes_that_join_one_store_fill_it_each_shard_once(images: Path, clean: Path, tmp_path: Path):
    store = tmp_path / "s.zarr"
    procs = joiners(spec_of(images, store, seconds=0.05), tmp_path, 3)
    results = ended(procs)
    for code, _, err in results:
        assert code == 0 and "Traceback" not in err, err
    same_as(store, clean)
    gen = generation(str(store))
    claimants = gen.roster.all()
    assert len(claimants) == 3 and all(c["ended"]["status"] == "complete" for c in claimants)
    assert sum(c["shards"] for c in claimants) == 8  # each shard committed once, by one of them
    assert sum(shards_said(out) for _, out, _ in results) == 8
    named = {f"{a:016x}" for a in gen.ledger().read().named()}
    assert sorted(p.name for p in (store / gen.name / "__attempts").iterdir()) == sorted(named)  # no garbage left
    # the statistics: a process that waited with nothing to take left those of its own shards (one that saw every
    # shard committed merges them itself); the merge of all equals one job's
    partials = store / gen.name / "__txn" / "partials"
    left = [p.name for p in partials.iterdir()] if partials.exists() else []
    assert set(left) <= {c["id"] for c in claimants if c["shards"]}, left
    s, c = open_store(str(store)).stats["conv"], open_store(str(clean)).stats["conv"]
    np.testing.assert_allclose(s["mean"], c["mean"], rtol=1e-6)
    np.testing.assert_allclose(s["std"], c["std"], rtol=1e-5)
    assert (s["rows"], s["nan"], s["min"]) == (c["rows"], c["nan"], c["min"])


def test_a_process_killed_while_it_holds_shards_has_them_taken_over(images: Path, clean: Path, tmp_path: Path):
    """SIGKILL one of three joined processes while it computes (a preempted node): its claims are taken once its
    record is silent for its timeout; the others finish the store, each exiting 0."""
    store = tmp_path / "s.zarr"
    procs = joiners(spec_of(images, store, seconds=0.3), tmp_path, 3)
    victim = procs[0]
    wait_holding(victim, store)
    os.kill(victim.pid, signal.SIGKILL)
    results = ended(procs[1:])
    for code, _, err in results:
        assert code == 0 and "Traceback" not in err, err
    assert victim.wait() == -signal.SIGKILL
    same_as(store, clean)


def test_a_paused_process_woken_after_its_shard_was_taken_writes_nothing_live(images: Path, clean: Path,
                                                                              tmp_path: Path):
    """A joined process stopped (SIGSTOP) in its shard past its timeout: another joins and finishes the store, that
    shard included; woken, the first finds its commit refused (the shard is the other's now), writes nothing live,
    and exits 0: the store is complete."""
    store = tmp_path / "s.zarr"
    marker = tmp_path / "stopped"
    a = joiners(spec_of(images, store), tmp_path, 1,
                EXTRACTOR_TEST_PAUSE=f"view:status/c/1$|1|{marker}|before")[0]
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert a.poll() is None and time.monotonic() < deadline, a.communicate()
        time.sleep(0.02)
    try:  # B waits, for the shard A holds, until A's record is silent for its timeout
        b = joiners(spec_of(images, store), tmp_path, 1)[0]
        (code, _, err), = ended([b])
        assert code == 0, err
        same_as(store, clean)
        gen = generation(str(store))
        named = {f"{x:016x}" for x in gen.ledger().read().named()}
    finally:
        os.kill(a.pid, signal.SIGCONT)
    (code, _out, err), = ended([a])
    assert code == 0 and "Traceback" not in err, err
    same_as(store, clean)
    assert {f"{x:016x}" for x in generation(str(store)).ledger().read().named()} == named  # nothing of A's named


def test_a_process_stopped_with_sigterm_gives_its_claims_back_at_once(images: Path, clean: Path, tmp_path: Path):
    """Pre-emption (a spot node reclaimed, ``scancel``, Kubernetes evicting a pod) sends SIGTERM: the joined process
    stops cleanly, its record says it ended (so its claims are free at once, long before its timeout), and it says
    to join again; the others finish the store."""
    store = tmp_path / "s.zarr"
    spec = spec_of(images, store, seconds=0.3)
    spec["output"]["lease_timeout_s"] = 600.0  # were its claims left to time out, the others would wait 10 minutes
    procs = joiners(spec, tmp_path, 2)
    victim = procs[0]
    wait_holding(victim, store)
    victim.send_signal(signal.SIGTERM)
    (code, _, err), = ended([victim])
    assert code == 130 and "--join" in err and "Traceback" not in err, err
    record = next(c for c in generation(str(store)).roster.all() if c.get("pid") == victim.pid)
    assert record["ended"]["status"] == "interrupted"
    (code, _, err), = ended(procs[1:])
    assert code == 0, err
    same_as(store, clean)


def test_a_joiner_that_looks_before_the_makers_record_waits_for_the_store(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """A maker swaps the store's head, then writes its claimant's record. A joiner that looked in between found a
    generation with no live claimant and took it for one left half-made: it made the store again over it, and the
    maker stopped, "made again by another job" (the first task of a Slurm array, started with the others). Now a
    generation the head names since less than a claimant's timeout is being made: the joiner waits for it."""
    import threading

    import extractor.store.session as session
    from extractor.store import Generation, Objects, now, read_head
    from extractor.store.generation import swap_head
    from extractor.store.views import ROOT

    objects = Objects.at(str(tmp_path / "s.zarr"))
    name = swap_head(objects, None, now())  # the maker's head: no record of it yet, no root
    head = read_head(objects)
    looked, root = threading.Event(), Generation.root

    def counted(self: Generation):  # the joiner's second look: it waits (it did not take the store as half-made)
        found = root(self)
        if found is None and getattr(self, "_looks", 0) >= 1:
            looked.set()
        self._looks = getattr(self, "_looks", 0) + 1
        return found

    monkeypatch.setattr(Generation, "root", counted)
    monkeypatch.setattr(session, "WAIT_S", 0.04)
    joiner = threading.Thread(target=session._made_by_another, args=(Generation(objects, name), objects.url, head, 60))
    joiner.start()
    while not looked.is_set() and joiner.is_alive():
        looked.wait(0.05)
    assert looked.is_set(), "the joiner did not wait for the generation its head names"
    objects.put(f"{name}/{ROOT}", b'{"attributes": {"extractor": {"n_shards": 1}}}')  # the maker made it
    joiner.join(30)
    assert not joiner.is_alive()
