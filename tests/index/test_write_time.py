"""A write-time feature index during extraction (issue 42): each computed batch's blocks made from the capture's
tensor as the device holds it (the host feed gets none of its rows), rows copied from another store indexed on the
host from their chunks; either way the index equals the post-hoc pass over the store, for a map and a token capture,
its raw channels and a dictionary's latents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.images import make_images
from helpers.index_checks import ARRAYS
from helpers.jobs import job

from extractor.driver.runner import run
from extractor.index import device as index_device
from extractor.index.feed import IndexFeed
from extractor.index.post_hoc import index
from extractor.index.reader import open_index
from extractor.index.state import IndexState
from extractor.read import open_store
from extractor.spec.load import parse_spec

D_SAE = 40
VIT = {"name": "timm:vit_small_patch16_224", "weights": "random", "device": "cpu",
       "kwargs": {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48, "num_heads": 2}}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("write_index") / "imgs"
    make_images(root, per_class=6, classes=("a", "b"), size=40)
    (root / "a" / "corrupt.jpg").write_bytes(b"not a jpeg")  # a failed row: in no index
    return root


def sae(path: Path, d_in: int) -> Path:
    rng = np.random.default_rng(d_in)
    np.savez(path, W_enc=rng.standard_normal((d_in, D_SAE)).astype(np.float32) * 0.5,
             b_enc=(rng.standard_normal(D_SAE) * 0.1 - 0.05).astype(np.float32),
             b_dec=(rng.standard_normal(d_in) * 0.01).astype(np.float32))
    return path


class _Paths:
    """Rows each path of the write-time index was given: the host feed's (from chunks) and the device's parts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, on_cpu: bool = True) -> None:
        """``on_cpu``: run the device path on this CPU (a CPU worker takes the host's by default)."""
        monkeypatch.setattr(index_device, "ON_CPU", on_cpu)
        self.host: list[int] = []
        self.device: list[int] = []
        add, add_part = IndexFeed.add, IndexState.add_part

        def host(feed: IndexFeed, x: np.ndarray, rows: np.ndarray) -> None:
            self.host.extend(np.asarray(rows).tolist())
            add(feed, x, rows)

        def device(state: IndexState, part) -> None:
            self.device.append(part.rows)
            add_part(state, part)

        monkeypatch.setattr(IndexFeed, "add", host)
        monkeypatch.setattr(IndexState, "add_part", device)


def _same(written, again, exact: bool) -> None:
    """Two indexes hold the same arrays: exactly (sums in another order: to rounding), or to float32 rounding where
    the dictionary's matmul met blocks of other sizes."""
    for name in ARRAYS:
        a, b = np.asarray(written.arrays[name][:]), np.asarray(again.arrays[name][:])
        if name == "mean_active" or not exact:
            np.testing.assert_allclose(a, b, rtol=1e-12 if exact else 1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


CASES = {  # capture, model, input size, dictionary width (0: raw channels)
    "map raw": ({"layer": "layer3", "reduce": "none"}, None, 32, 0),
    "map sae": ({"layer": "layer3", "reduce": "none"}, None, 32, 32),
    "tokens raw, prefix dropped": ({"layer": "blocks.1", "reduce": "none", "drop_prefix": True}, VIT, 32, 0),
    "tokens sae": ({"layer": "blocks.1", "reduce": "none"}, VIT, 32, 48),
}


@pytest.mark.parametrize("case", list(CASES))
def test_computed_rows_are_indexed_on_the_device_as_the_post_hoc_pass_indexes_them(
        case: str, images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    capture, model, size, d_in = CASES[case]
    if model is not None:
        pytest.importorskip("timm")
    want = {"k": 3, "dictionary": str(sae(tmp_path / "sae.npz", d_in))} if d_in else {"k": 3}
    path = tmp_path / "s.zarr"
    sections = {"model": model} if model is not None else {}
    raw = job(images, path, data={"resize": size, "crop": size, "shard_size": 4, "batch_size": 3},
              capture=[{**capture, "feature_index": want}], output={"chunk_rows": 2}, **sections)
    paths = _Paths(monkeypatch)
    run(parse_spec(raw))
    monkeypatch.undo()
    ok = int((open_store(str(path)).status == 1).sum())
    assert ok == 12 and paths.host == [] and sum(paths.device) == ok  # every row on the device, none on the host
    key = capture["layer"]
    written = open_index(str(path))
    again = index(str(path), key, dictionary=want.get("dictionary"), k=3, name="again")
    assert written.attrs["written"] == "write-time" and written.rows == again.rows == ok
    _same(written, again, exact=not d_in)


def test_a_cpu_worker_indexes_its_rows_on_the_writer_threads_as_the_post_hoc_pass_does(
        images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """On a CPU the numpy pass (the writer threads, from the chunks) costs less than torch's: every row goes there."""
    want = {"k": 3, "dictionary": str(sae(tmp_path / "sae.npz", 32))}
    path = tmp_path / "s.zarr"
    raw = job(images, path, data={"resize": 32, "crop": 32, "shard_size": 4, "batch_size": 3},
              capture=[{"layer": "layer3", "reduce": "none", "feature_index": want}], output={"chunk_rows": 2})
    paths = _Paths(monkeypatch, on_cpu=False)
    run(parse_spec(raw))
    monkeypatch.undo()
    assert sorted(paths.host) == np.flatnonzero(open_store(str(path)).status == 1).tolist() and paths.device == []
    _same(open_index(str(path)), index(str(path), "layer3", dictionary=want["dictionary"], k=3, name="again"),
          exact=False)


def test_rows_copied_from_another_store_are_indexed_on_the_host_with_the_computed_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Rows output.reuse takes from another store have no tensor on the device: the writer threads index them from
    their chunks, the computed rows of the same batches on the device, and the index is still the post-hoc one."""
    make_images(tmp_path / "few", per_class=3, classes=("a",), size=40)  # the first 3 images of "all"'s class a
    make_images(tmp_path / "all", per_class=5, classes=("a", "b"), size=40)
    data = {"resize": 32, "crop": 32, "shard_size": 4, "batch_size": 3}
    capture = [{"layer": "layer3", "reduce": "none", "feature_index": {"k": 3}}]
    run(parse_spec(job(tmp_path / "few", tmp_path / "few.zarr", data=data, capture=capture)))
    path = tmp_path / "all.zarr"
    raw = job(tmp_path / "all", path, data=data, capture=capture,
              output={"chunk_rows": 2, "reuse": [str(tmp_path / "few.zarr")]})
    paths = _Paths(monkeypatch)
    summary = run(parse_spec(raw))
    monkeypatch.undo()
    store = open_store(str(path))
    copied = np.flatnonzero(np.asarray(store.group["reused"][:]) >= 0)
    assert summary.reused == len(copied) == 3
    assert sorted(paths.host) == copied.tolist() and sum(paths.device) == 10 - 3
    _same(open_index(str(path)), index(str(path), "layer3", k=3, name="again"), exact=True)


def picky_net():
    """tiny_resnet, raising on a batch that holds an all-white image: that batch is retried image by image."""
    from toy_models import tiny_resnet

    net = tiny_resnet()
    inner = net.forward

    def forward(x):
        if bool((x[:, 0] > 2.0).flatten(1).all(dim=1).any()):  # white, normalised: (1 - 0.485) / 0.229
            raise RuntimeError("a white image")
        return inner(x)

    net.forward = forward
    return net


def test_rows_of_a_batch_retried_image_by_image_are_indexed_on_the_host(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """A batch that raised is retried image by image, on the host: its good rows have no batch tensor on the device,
    so the writer threads index them from their chunks; the failed row is in no index."""
    from PIL import Image

    make_images(tmp_path / "imgs", per_class=4, classes=("a", "b"), size=40)
    Image.new("RGB", (40, 40), (255, 255, 255)).save(tmp_path / "imgs" / "a" / "a01w.png")  # row 2: batch 0
    path = tmp_path / "s.zarr"
    raw = job(tmp_path / "imgs", path, model={"name": None, "factory": "test_write_time:picky_net", "weights": None,
                                              "device": "cpu"},
              data={"resize": 32, "crop": 32, "shard_size": 4, "batch_size": 3},
              capture=[{"layer": "layer3", "reduce": "none", "feature_index": {"k": 3}}], output={"chunk_rows": 2})
    paths = _Paths(monkeypatch)
    run(parse_spec(raw))
    monkeypatch.undo()
    status = open_store(str(path)).status
    assert status.tolist().count(1) == 8 and status[2] != 1
    assert sorted(paths.host) == [0, 1] and sum(paths.device) == 6  # the retried batch's good rows: on the host
    _same(open_index(str(path)), index(str(path), "layer3", k=3, name="again"), exact=True)


@pytest.mark.slow  # a paused job process
@pytest.mark.parametrize("nth", [1, 2])
def test_a_job_paused_in_its_end_merge_of_the_indexes_while_the_store_was_made_again_stops_in_one_line(
        images: Path, tmp_path: Path, nth: int):
    """T5-11: a job with write-time indexes stopped in its end merge (before it names its first index, or its
    second, whose parts it has yet to read) while another job makes its store again (``--overwrite``) died of a
    ``KeyError``. It stops in one line saying the store was made again; nothing of the other job's store changes,
    and that store is whole (its indexes equal a post-hoc pass over it)."""
    from helpers.paused_jobs import local_objects, spec_of, start_paused, wake
    from helpers.stores import wait_dead

    from extractor.store import Objects, read_head

    store = tmp_path / "s.zarr"
    indexed = [{"layer": "conv", "reduce": "mean", "key": "conv", "feature_index": {"k": 2}},
               {"layer": "conv", "reduce": "none", "key": "map", "feature_index": {"k": 2}}]
    spec_a = {**spec_of(images, str(store), "mean"), "capture": indexed}
    a = start_paused(spec_a, tmp_path, "objects:.*/indexes/zarr\\.json$", nth)
    try:
        wait_dead(str(store))
        spec_b = {**spec_a, "output": {**spec_a["output"], "if_exists": "overwrite"}}
        assert run(parse_spec(spec_b)).ok == 12
        gen = read_head(Objects.at(str(store))).generation  # type: ignore[union-attr]
        before = local_objects(store)
    finally:
        code, err = wake(a)
    assert "Traceback" not in err and "KeyError" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(lines) == 1 and "made again" in lines[0], err
    after = local_objects(store)
    assert read_head(Objects.at(str(store))).generation == gen  # type: ignore[union-attr]
    theirs = {k: v for k, v in before.items() if k == "zarr.json" or k.startswith(f"{gen}/")}
    assert {k: after.get(k) for k in theirs} == theirs
    assert not [k for k in after if k.startswith(f"{gen}/") and k not in before]
    for key in ("conv", "map"):
        made, by_hand = open_index(str(store), key), index(str(store), key, k=2, name=f"{key}-again")
        for name in ARRAYS:
            np.testing.assert_array_equal(np.asarray(made.arrays[name][:]), np.asarray(by_hand.arrays[name][:]))


def _end_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The parts each end merge read from the store (the rest it was given merged, as the shards came)."""
    from extractor.index import write_time

    read, merged = [], write_time.merged_parts

    def counted(*args, **kwargs):
        got = merged(*args, **kwargs)
        read.append(got[0])
        return got

    monkeypatch.setattr(write_time, "merged_parts", counted)
    return read


def test_the_parts_are_merged_as_the_shards_are_committed_and_left_with_the_statistics(
        images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Issue 57: a job's index parts are merged by its driver as its shards are committed, and left in its partial
    with the statistics: the store's end reads no part of a shard merged so (at 400M rows and a ViT-B's tokens,
    390,000 parts of 14 MB at the end before), but those of the shards of a claimant that left none; the index
    equals the post-hoc pass over the store either way."""
    from extractor.store import Objects, read_head
    from extractor.store.generation import Generation

    path = tmp_path / "s.zarr"
    raw = job(images, path, data={"resize": 32, "crop": 32, "shard_size": 4, "batch_size": 3},
              capture=[{"layer": "layer3", "reduce": "none", "feature_index": {"k": 3}}], output={"chunk_rows": 2})
    read = _end_reads(monkeypatch)

    def interrupt(name: str, info: dict) -> None:
        if name == "shard_done" and info["shard"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(parse_spec(raw), on_event=interrupt)
    done = int(open_store(str(path)).done_shards.sum())
    assert 2 <= done < 4 and read == []
    resumed = {**raw, "output": {**raw["output"], "if_exists": "resume"}}
    run(parse_spec(resumed))
    assert read == [0]  # the interrupted job's shards from its partial, the resume's as they came
    _same(open_index(str(path), "layer3"), index(str(path), "layer3", k=3, name="again"), exact=True)

    with pytest.raises(KeyboardInterrupt):
        run(parse_spec({**raw, "output": {**raw["output"], "if_exists": "overwrite"}}), on_event=interrupt)
    objects = Objects.at(str(path))
    gen = Generation(objects, read_head(objects).generation)  # type: ignore[union-attr, arg-type]
    objects.remove(gen.txn("partials"))  # as a claimant killed before it left one
    done = int(open_store(str(path)).done_shards.sum())
    run(parse_spec(resumed))
    assert read[1:] == [done]  # their parts read from the store at the end
    _same(open_index(str(path), "layer3"), index(str(path), "layer3", k=3, name="again"), exact=True)


def test_a_driver_whose_shard_was_committed_again_by_another_merges_it_from_the_store(images: Path, tmp_path: Path):
    """A shard this driver merged (its record and index part, of its attempt) that another process committed again
    since (a joiner with ``on_change: redo``, after its image changed): the end does not keep this driver's merge
    of it (an audit found the index, and the statistics, holding the old one): its totals start over from the
    store, and the index made of them is the one the store's parts make."""
    from helpers.stores import generation

    from extractor.index.write_time import JobIndexes, feed_of, merged_parts
    from extractor.store.stats import Totals, merge_shards, shard_record

    path = tmp_path / "s.zarr"
    raw = job(images, path, data={"resize": 32, "crop": 32, "shard_size": 4, "batch_size": 3},
              capture=[{"layer": "layer3", "reduce": "none", "feature_index": {"k": 3}}], output={"chunk_rows": 2})
    run(parse_spec(raw))
    group = generation(str(path)).open()
    captures = dict(group.attrs["extractor"])["captures"]
    parts = group["index_parts/layer3"]
    totals = Totals(parts.shape[0], JobIndexes().fresh(captures, None))
    totals.add(0, shard_record(group, 0), 12345, {"layer3": np.asarray(parts[1])})  # another attempt, another part
    merge_shards(group, totals)
    assert totals.parts == {} and totals.held.all()  # started over: every record read from the store
    feed = feed_of("layer3", captures["layer3"])
    if "layer3" in totals.parts:
        feed.state.merge(totals.parts["layer3"])
    merged_parts(group, "layer3", feed, totals.parts_held.get("layer3"))
    made, written = feed.state.finish(), open_index(str(path), "layer3")
    for name in ("top_rows", "top_values", "histogram", "histogram_rows"):
        np.testing.assert_array_equal(getattr(made, name), np.asarray(written.arrays[name][:]), err_msg=name)
