"""The read plan of an epoch on a sharded store (issue 39): an epoch of whole read runs (in order, or shuffled with
spread=False) reads each shard's object in one request; the default shuffled one each inner chunk once (issue 54);
mixing happens in memory. Requests are counted, not timed."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from helpers.stores import opened

from extractor.data import Rows
from extractor.read.reader import open_store
from extractor.store.layout import OK, StoreArrays
from extractor.store.synthetic import create_store
from extractor.store.views import GenerationStore


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> str:
    """600 rows of 64x8x8 float32 (16 KB) and of 9x4 tokens, shards of 64 rows, inner chunks of 16."""
    url = str(tmp_path_factory.mktemp("plan") / "s.zarr")
    caps = {"x": {"shape": [64, 8, 8], "dtype": "float32", "dims": ["x.c", "x.y", "x.x"], "layer": "x",
                  "what": "output", "reduce": "none"},
            "t": {"shape": [9, 4], "dtype": "float32", "dims": ["t.token", "t.feature"], "layer": "t",
                  "what": "output", "reduce": "none"}}
    n = 600
    g = create_store(url, Rows(ids=[f"i{i}" for i in range(n)], paths=[""] * n, labels=[0] * n),
                     StoreArrays(captures=caps, extras={}, shard_size=64, chunk_rows=dict.fromkeys(caps, 16),
                                 sharded=True),
                     {"n_rows": n, "n_shards": 10, "captures": caps, "format_version": 1, "spec": {},
                      "model": {"prefix_tokens": 1}})
    rng = np.random.default_rng(0)
    g["x"][:] = rng.standard_normal((n, 64, 8, 8), dtype=np.float32)
    g["t"][:] = rng.standard_normal((n, 9, 4), dtype=np.float32)
    g["status"][:] = OK
    return url


def requests(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    seen: collections.Counter = collections.Counter()
    get = GenerationStore.get

    async def counted(self, key, prototype, byte_range=None):
        if "/c/" in key:  # the array's chunks (its metadata is read once, when it is opened)
            seen[key.split("/")[0]] += 1
        return await get(self, key, prototype, byte_range)

    monkeypatch.setattr(GenerationStore, "get", counted)
    return seen


@pytest.mark.parametrize(("shuffle", "spread"), [(False, True), (True, False)])
def test_an_epoch_of_batches_reads_each_shard_in_one_request(sharded: str, monkeypatch: pytest.MonkeyPatch,
                                                              shuffle: bool, spread: bool):
    s = open_store(sharded)
    seen = requests(monkeypatch)
    got = [r for r, _ in s.batches("x", 50, shuffle=shuffle, seed=3, spread=spread)]
    assert sorted(np.concatenate(got).tolist()) == list(range(600))
    # 9 whole shards in one request each; the last (24 rows of 64) reads its index and its two inner chunks
    assert seen["x"] == 9 + 1 + 2, seen


def test_a_shuffled_epoch_reads_each_inner_chunk_once_from_anywhere(sharded: str, monkeypatch: pytest.MonkeyPatch):
    """The default: inner chunks from anywhere in the epoch, each read once: as a slice with its shard's index, on
    threads (256 KiB chunks of rows), or in one call for the buffer (2 KiB chunks of tokens); every row once, its
    values as stored."""
    s = open_store(sharded)
    full, tokens = np.asarray(s["x"][:]), np.asarray(s["t"][:])
    seen = requests(monkeypatch)
    got = list(s.batches("x", 50, seed=3))
    assert seen["x"] <= 2 * 38, seen  # 600 rows: 38 inner chunks of 16, and an index read with each
    rows = np.concatenate([r for r, _ in got])
    assert sorted(rows.tolist()) == list(range(600))
    np.testing.assert_array_equal(np.concatenate([x for _, x in got]), full[rows])
    got = list(s.token_batches("t", 128, seed=3))
    assert seen["t"] <= 2 * 38, seen
    index = np.concatenate([i for i, _ in got])
    assert len({(int(r), int(t)) for r, t in index}) == 600 * 9
    np.testing.assert_array_equal(np.concatenate([x for _, x in got]), tokens[index[:, 0], index[:, 1]])


@pytest.mark.parametrize(("shuffle", "spread"), [(False, True), (True, False)])
def test_an_epoch_of_tokens_reads_each_shard_in_one_request(sharded: str, monkeypatch: pytest.MonkeyPatch,
                                                             shuffle: bool, spread: bool):
    s = open_store(sharded)
    seen = requests(monkeypatch)
    index = np.concatenate([i for i, _ in s.token_batches("t", 128, shuffle=shuffle, seed=3, spread=spread)])
    assert len(index) == 600 * 9 and len({(int(r), int(t)) for r, t in index}) == 600 * 9
    assert seen["t"] == 9 + 1 + 2, seen


@pytest.mark.parametrize(("batch_size", "start", "drop_last"),
                         [(7, 0, False), (25, 3, False), (25, 0, True), (4, 5, False)])
def test_batches_across_buffers_are_the_rows_in_order_each_its_own_array(batch_size: int, start: int,
                                                                         drop_last: bool):
    """A batch wider than what a buffer has left is gathered into arrays of its own (its rows copied once): the
    rows and values in the buffers' orders, shuffled or not, cut at ``batch_size``."""
    from extractor.read.batching import _Buffer, _rebatch

    rng = np.random.default_rng(1)
    sizes = [10, 3, 12, 1, 9]
    rows = np.arange(sum(sizes))
    values = rng.standard_normal((len(rows), 2, 3)).astype(np.float32)
    buffers, at = [], 0
    for n, shuffled in zip(sizes, [True, False, True, True, False], strict=True):
        perm = rng.permutation(n) if shuffled else None
        buffers.append(_Buffer(rows[at:at + n], (values[at:at + n],), perm))
        at += n
    order = np.concatenate([b.index if b.perm is None else b.index[b.perm] for b in buffers])[start:]
    batches = list(_rebatch(buffers, batch_size, drop_last, start))
    expected = [order[a:a + batch_size] for a in range(0, len(order), batch_size)]
    if drop_last and len(expected[-1]) < batch_size:
        expected.pop()
    assert [b[0].tolist() for b in batches] == [e.tolist() for e in expected]
    for index, x in batches:
        np.testing.assert_array_equal(x, values[index])
        assert x.dtype == np.float32 and x.shape[1:] == (2, 3)


def test_status_is_read_fresh_a_file_a_chunk(tmp_path):
    """Each epoch reads the rows' status (a running job updates it): a local store's chunk files read at once, as
    zarr reads them (through zarr 0.41 s at 1M rows)."""

    url = str(tmp_path / "s.zarr")
    meta = {"shape": [2], "dtype": "float32", "dims": ["x.f"], "layer": "x", "what": "output", "reduce": "none"}
    g = create_store(url, Rows(ids=[f"i{i}" for i in range(50)], paths=[""] * 50, labels=[0] * 50),
                     StoreArrays(captures={"x": meta}, extras={}, shard_size=8, chunk_rows={"x": 8}),
                     {"n_rows": 50, "n_shards": 7, "captures": {"x": meta}, "format_version": 1, "spec": {}})
    s = open_store(url)
    assert s.status.tolist() == [0] * 50 and s.epoch_rows("x") == 0
    g["status"][3:45] = OK  # the job writes on
    assert s.status.dtype == np.uint8
    assert s.status.tolist() == opened(url)["status"][:].tolist() == [0] * 3 + [1] * 42 + [0] * 5
    assert s.epoch_rows("x") == 42


@pytest.mark.parametrize("buffer_chunks", [3, 64])
def test_a_shuffled_epoch_of_rows_with_gaps_serves_each_selected_row_once_with_its_values(sharded: str,
                                                                                         buffer_chunks: int):
    """The default shuffled stream reads inner chunks from anywhere, those next to each other as one span, a round
    of spans at once; rows left out of a chunk (not selected, or not ok) are left out of what it serves."""
    s = open_store(sharded)
    x = np.asarray(s["x"][:])
    rows = np.flatnonzero(np.arange(600) % 7 != 3)  # every inner chunk has rows left out
    seen = []
    for index, data in s.batches("x", 50, seed=5, rows=rows, buffer_chunks=buffer_chunks):
        np.testing.assert_array_equal(data, x[index])
        seen.append(index)
    got = np.concatenate(seen)
    assert sorted(got.tolist()) == rows.tolist() and got.tolist() != rows.tolist()  # each once, mixed
