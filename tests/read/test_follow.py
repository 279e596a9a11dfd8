"""Training while extracting (issue 58): ``batches(..., follow=True)`` over a store its job writes now yields the
rows of each shard as its commit lands, every ok row once, and ends when the store is complete; its state resumes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.images import make_images
from helpers.jobs import job
from helpers.stores import committed, generation

import extractor.read.follow as follow
from extractor.driver.runner import run
from extractor.errors import StoreError
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec


def spec_of(images: Path, store: Path, seconds: float) -> dict:
    return job(images, store, model={"name": None, "factory": "toy_models:stopped_at_write", "device": "cpu",
                                     "factory_kwargs": {"seconds": seconds}},
               data={"resize": None, "crop": 32, "shard_size": 2, "batch_size": 1, "decode_workers": 1},
               capture=[{"layer": "conv", "reduce": "mean", "key": "conv"}],
               output={"store": str(store), "chunk_rows": 1})


@pytest.fixture
def images(tmp_path: Path) -> Path:
    root = tmp_path / "imgs"
    make_images(root, per_class=5, classes=("a", "b"), size=40)  # 10 images and a broken file: 6 shards of 2
    (root / "a" / "broken.jpg").write_bytes(b"not a jpeg")  # a failed row: never yielded
    return root


def started(spec: dict, store: Path) -> threading.Thread:
    """The job, in a thread; returns once its store is made, before its first commit."""
    job_thread = threading.Thread(target=run, args=(parse_spec(spec),))
    job_thread.start()
    deadline = time.monotonic() + 120
    while True:
        try:
            if generation(str(store)).made():
                break
        except (AssertionError, OSError, ValueError):
            pass
        assert job_thread.is_alive() and time.monotonic() < deadline, "the job never made its store"
        time.sleep(0.01)
    return job_thread


def test_a_followed_stream_yields_every_ok_row_once_as_shards_commit(images: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(follow, "POLL_S", 0.02)
    store = tmp_path / "s.zarr"
    job_thread = started(spec_of(images, store, seconds=0.15), store)
    s = open_store(str(store))
    assert not s.done_shards.all()
    stream = s.batches("conv", batch_size=3, follow=True)
    seen, first_at = [], None
    for rows, data in stream:
        if first_at is None:
            first_at = int(generation(str(store)).ledger().read().done.sum())  # shards committed at the first batch
        seen.append((rows, data))
    job_thread.join()
    done = open_store(str(store))
    assert done.attrs["status"] == "complete" and first_at is not None and first_at < done.attrs["n_shards"]
    rows = np.concatenate([r for r, _ in seen])
    assert sorted(rows.tolist()) == done.ok_rows().tolist() and len(rows) == 10  # every ok row once, not the failed
    values = np.concatenate([d for _, d in seen])
    np.testing.assert_array_equal(values, done["conv"][:][rows])  # the values committed


def test_a_followed_stream_resumes_from_its_state_and_refuses_what_it_cannot_serve(images: Path, tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(follow, "POLL_S", 0.02)
    store = tmp_path / "s.zarr"
    job_thread = started(spec_of(images, store, seconds=0.1), store)
    s = open_store(str(store))
    with pytest.raises(ValueError, match="follow=True serves one reader over the whole store: part= is not taken"):
        s.batches("conv", follow=True, part=(0, 2))
    first = s.batches("conv", batch_size=2, follow=True, seed=7)
    got = [next(first)[0] for _ in range(2)]
    state = first.state_dict()
    first.close()
    again = s.batches("conv", batch_size=2, follow=True, seed=7)
    again.load_state_dict(state)
    got += [rows for rows, _ in again]
    job_thread.join()
    rows = np.concatenate(got)
    assert sorted(rows.tolist()) == open_store(str(store)).ok_rows().tolist()  # each once, across the two streams


def test_a_followed_stream_whose_job_stopped_says_how_to_finish_the_store(images: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(follow, "POLL_S", 0.02)
    store = tmp_path / "s.zarr"

    def stop(name: str, info: dict) -> None:
        if name == "shard_started" and info["shard"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(parse_spec(spec_of(images, store, seconds=0.0)), on_event=stop)
    assert committed(str(store), 0) and not committed(str(store))
    stream = open_store(str(store)).batches("conv", follow=True)
    with pytest.raises(StoreError, match=r"no job writes .* any more and 4 of its 6 shards are not "
                                         r"committed \(the stream served the rows of the 2 committed\): .*--resume"):
        for _ in stream:
            pass
