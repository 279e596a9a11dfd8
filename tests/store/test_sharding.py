"""Sharded capture arrays (issue 28): each work shard of a capture is one Zarr v3 shard, written as a stream of
inner chunks with its index last; what lands opens natively in zarr, xarray and dask and equals an unsharded
store of the same job; stores made before keep their chunking when resumed."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import zarr
from helpers.jobs import job
from helpers.stores import generation, pending
from zarr.codecs import ZstdCodec

from extractor.driver.runner import run
from extractor.read.reader import open_store
from extractor.spec.load import parse_spec
from extractor.spec.schema import auto_inner_rows
from extractor.store.chunks import ChunkCodec, ShardStream, write_chunks

CAPTURES = [{"layer": "layer3", "reduce": "none"}, {"layer": "layer4", "reduce": "mean", "dtype": "float16"}]


def _job(image_dir: Path, store: Path, **output) -> dict:
    return job(image_dir, store, data={"shard_size": 8, "batch_size": 3}, capture=CAPTURES,
               output={"store": str(store), "chunk_rows": 2, **output})


def test_a_sharded_store_equals_an_unsharded_one_and_opens_natively(image_dir: Path, tmp_path: Path):
    import extractor

    run(parse_spec(_job(image_dir, tmp_path / "sharded.zarr")))
    run(parse_spec(_job(image_dir, tmp_path / "plain.zarr", sharding=False)))
    a, b = open_store(str(tmp_path / "sharded.zarr")), open_store(str(tmp_path / "plain.zarr"))
    attempts = tmp_path / "sharded.zarr" / a.attrs["generation"] / "__attempts"
    for key in a.keys:
        array = zarr.open_array(extractor.zarr_store(str(tmp_path / "sharded.zarr")), path=key, mode="r")
        assert array.shards == (8, *array.shape[1:]) and array.chunks == (2, *array.shape[1:])
        objects = [p for p in attempts.rglob("*") if p.is_file() and f"/{key}/c/" in str(p)]
        assert len(objects) == 2  # 12 rows, shards of 8: one object per work shard, each its attempt's
        assert np.array_equal(array[:], b[key][:], equal_nan=True)
        assert np.array_equal(a.numpy(key), b.numpy(key))
    xr = pytest.importorskip("xarray")
    ds = xr.open_zarr(extractor.zarr_store(str(tmp_path / "sharded.zarr")), consolidated=False)
    assert np.array_equal(ds["layer3"].values, b["layer3"][:], equal_nan=True)
    da = pytest.importorskip("dask.array")
    assert np.array_equal(da.from_zarr(a["layer4"]).compute(), b["layer4"][:])
    assert np.array_equal(a.row(a.ids[5])["layer3"], b["layer3"][5])  # a row by id: one inner chunk read


def test_inner_chunks_written_in_any_order_from_threads_read_back_in_zarr(tmp_path: Path):
    """The stream appends chunks as they come; the index says where each is. A partial last chunk is padded
    with the fill value, as zarr stores an edge chunk, and chunks past the array's end stay absent."""
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    array = group.create_array("x", shape=(13, 3), dtype="float32", chunks=(2, 3), shards=(8, 3),
                               compressors=ZstdCodec(level=3), fill_value=np.nan)
    data = np.random.default_rng(0).standard_normal((13, 3)).astype(np.float32)
    codec = ChunkCodec.of(array)
    assert codec is not None and codec.shard_rows == 8 and codec.rows == 2
    for shard in (0, 8):
        streams = {"x": ShardStream(codec, shard, array.store, str(tmp_path / "s.zarr"), None)}
        starts = list(range(shard, min(shard + 8, 13), 2))[::-1]  # backwards, each from its own thread
        threads = [threading.Thread(target=write_chunks, args=(s, {"x": (array, codec, data[s : s + 2])}, streams))
                   for s in starts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        streams["x"].close()
    assert np.array_equal(zarr.open_array(str(tmp_path / "s.zarr" / "x"), mode="r")[:], data)


def test_auto_inner_chunks_hold_about_a_mebibyte():
    assert auto_inner_rows(1024, 257 * 768 * 2) == 2  # ViT-B tokens in float16: 395 KB rows
    assert auto_inner_rows(1024, 2048) == 512 and auto_inner_rows(1024, 4) == 1024  # never past a shard
    assert auto_inner_rows(1000, 3 << 20) == 1  # a row larger than a mebibyte: one row per chunk


def test_a_store_made_unsharded_stays_so_when_resumed(image_dir: Path, tmp_path: Path):
    store = tmp_path / "s.zarr"
    run(parse_spec(_job(image_dir, store, sharding=False)))
    clean = {k: open_store(str(store)).numpy(k) for k in ("layer3", "layer4")}
    pending(str(store), [1])  # as if the job had stopped before shard 1
    run(parse_spec(_job(image_dir, store, if_exists="resume")))  # the spec now says sharding: true (the default)
    s = open_store(str(store))
    assert s["layer3"].shards is None  # its own chunking kept
    for key, values in clean.items():
        assert np.array_equal(s.numpy(key), values)


def test_two_attempts_at_one_shard_never_share_an_object_and_the_unnamed_go_at_the_end(image_dir: Path,
                                                                                       tmp_path: Path):
    """A Ray worker drained while its shard runs again elsewhere: each attempt writes objects of its own name, and
    the one the ledger names is read, whole. What an attempt no commit names left (a killed run's, a failed
    one's) is removed when the store is finished."""
    from extractor.store.ledger import new_id
    from extractor.store.views import write_view

    store = tmp_path / "job.zarr"
    run(parse_spec(_job(image_dir, store)))
    gen = generation(str(store))
    s = open_store(str(store))
    codec = ChunkCodec.of(s["layer4"])
    assert codec is not None
    views = [write_view(gen.objects.zarr_store(gen.name, read_only=False), {"data": new_id()}, range(1))
             for _ in range(2)]
    streams = [ShardStream(codec, 0, view, str(store), None) for view in views]
    assert streams[0].where != streams[1].where and streams[0].where.endswith("layer4/c/0/0")
    for stream, bias in zip(streams, (100, 200), strict=True):
        for start in range(0, 8, 2):
            write_chunks(start, {"layer4": (s["layer4"], codec, s["layer4"][start : start + 2] + bias)},
                         {"layer4": stream})
        stream.close()
    assert np.array_equal(open_store(str(store))["layer4"][:8], s["layer4"][:8])  # what the ledger names
    pending(str(store), [0])
    run(parse_spec(_job(image_dir, store, if_exists="resume")))
    named = {f"{a:016x}" for a in gen.ledger().read().named()}
    assert sorted(p.name for p in (store / gen.name / "__attempts").iterdir()) == sorted(named)


def test_a_shard_whose_object_fails_to_close_is_never_read_and_is_removed_at_the_end(
        image_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A full disk as the first of two captures' shard objects closes: the shard fails, nothing of its attempt is
    read (its rows are NaN, not committed), and --resume finishes the store as a clean run, leaving no object of
    the failed attempt."""
    import errno

    from extractor.errors import ShardError

    real_close, calls = ShardStream.close, []

    def full_disk(self: ShardStream) -> None:
        calls.append(self.key)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_close(self)

    monkeypatch.setattr(ShardStream, "close", full_disk)
    store = tmp_path / "s.zarr"
    with pytest.raises(ShardError, match="No space left on device"):
        run(parse_spec(_job(image_dir, store)))
    failed = int(calls[0].split("/c/")[1].split("/")[0])  # the shard whose object failed to close
    s = open_store(str(store))
    assert not s.done_shards[failed]
    for key in ("layer3", "layer4"):  # nothing of its attempt read: the failed shard's rows are fill values (NaN)
        assert np.isnan(s[key][failed * 8 : failed * 8 + 8].astype(np.float32)).all()
    monkeypatch.setattr(ShardStream, "close", real_close)
    run(parse_spec(_job(image_dir, store, if_exists="resume")))
    run(parse_spec(_job(image_dir, tmp_path / "clean.zarr")))
    a, b = open_store(str(store)), open_store(str(tmp_path / "clean.zarr"))
    for key in a.keys:
        assert np.array_equal(a.numpy(key), b.numpy(key))
    gen = generation(str(store))
    named = {f"{a:016x}" for a in gen.ledger().read().named()}
    assert sorted(p.name for p in (store / gen.name / "__attempts").iterdir()) == sorted(named)


def test_on_a_store_whose_files_show_half_written_a_shard_is_put_whole_at_its_end():
    """fsspec stores other than object stores (memory://, file://) show a file as it is written: the shard's
    chunks are kept and put in one piece when it closes; one given up leaves nothing."""
    group = zarr.open_group("memory://sharding-test.zarr", mode="w")
    array = group.create_array("x", shape=(16, 3), dtype="float32", chunks=(2, 3), shards=(8, 3), fill_value=np.nan)
    codec = ChunkCodec.of(array)
    assert codec is not None
    data = np.arange(48, dtype=np.float32).reshape(16, 3)
    kept, dropped = (ShardStream(codec, start, array.store, "memory://sharding-test.zarr", None) for start in (0, 8))
    assert kept.parts is not None and kept.fd is None and kept.file is None
    for start in range(0, 16, 2):
        write_chunks(start, {"x": (array, codec, data[start : start + 2])}, {"x": kept if start < 8 else dropped})
    assert np.isnan(array[:]).all()  # nothing shows before the shard closes
    kept.close()
    dropped.abort()
    back = zarr.open_group("memory://sharding-test.zarr", mode="r")["x"][:]
    assert np.array_equal(back[:8], data[:8]) and np.isnan(back[8:]).all()


@pytest.mark.parametrize("shards", [None, (16, 3)])
def test_rows_taken_in_any_order_equal_numpy_indexing_sharded_or_not(shards):
    """take_rows (every read of rows by number: numpy(rows=...), batches, token_batches) reads stretches of
    chunks by slice, straight into the result where rows are consecutive; it equals numpy's fancy indexing."""
    from extractor.store import take_rows

    group = zarr.open_group(f"memory://take-rows-{bool(shards)}.zarr", mode="w")
    array = group.create_array("x", shape=(100, 3), dtype="float32", chunks=(4, 3), shards=shards)
    full = np.random.default_rng(0).standard_normal((100, 3), dtype=np.float32)
    array[:] = full
    rng = np.random.default_rng(1)
    picks = [np.arange(0), np.arange(100), np.arange(37, 91), np.array([5, 5, 99, 0, 6, 7, 8]),
             *(rng.integers(0, 100, rng.integers(1, 60)) for _ in range(50))]
    for rows in picks:
        assert np.array_equal(take_rows(array, rows), full[rows])
    into = np.zeros((54, 3), np.float32)
    assert take_rows(array, np.arange(37, 91), into) is into and np.array_equal(into, full[37:91])
