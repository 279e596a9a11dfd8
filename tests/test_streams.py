"""Streams an SAE trainer relies on (issue 44): equal parts per rank, resumable mid-epoch."""

from __future__ import annotations

import datetime
import multiprocessing
import socket

import numpy as np
import pytest
from helpers.stores import root_attrs

from extractor.data import Rows
from extractor.errors import StoreError
from extractor.read.reader import ActivationStore, open_store
from extractor.store.layout import FAILED, OK, StoreArrays
from extractor.store.synthetic import create_store

N, TOKENS, FEATURES = 61, 6, 4


def _make(url: str) -> None:
    """61 rows of (6 tokens, 4 features) in chunks of 8, row 5 failed; labels: 4 classes in sorted blocks."""
    meta = {"shape": [TOKENS, FEATURES], "dtype": "float32", "dims": ["t.token", "t.feature"], "layer": "t",
            "what": "output", "reduce": "none"}
    caps = {"t": meta, "u": {**meta, "dims": ["u.token", "u.feature"], "layer": "u"}}
    rows = Rows(ids=[f"i{i}" for i in range(N)], paths=[""] * N, labels=[4 * i // N for i in range(N)])
    g = create_store(url, rows, StoreArrays(captures=caps, extras={}, shard_size=8, chunk_rows=dict.fromkeys(caps, 8)),
                     attrs={"n_rows": N, "n_shards": 8, "captures": caps, "format_version": 1, "spec": {},
                            "model": {"prefix_tokens": 1}})
    rng = np.random.default_rng(0)
    g["t"][:] = rng.standard_normal((N, TOKENS, FEATURES), dtype=np.float32)
    g["u"][:] = rng.standard_normal((N, TOKENS, FEATURES), dtype=np.float32)
    status = np.full(N, OK, np.uint8)
    status[5] = FAILED
    g["status"][:] = status


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> ActivationStore:
    url = str(tmp_path_factory.mktemp("streams") / "s.zarr")
    _make(url)
    return open_store(url)


def pairs(index: np.ndarray) -> list[tuple[int, int]]:
    return [(int(r), int(t)) for r, t in index]


OK_ROWS = [r for r in range(N) if r != 5]
ALL = sorted((r, t) for r in OK_ROWS for t in range(TOKENS))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_parts_have_equal_lengths_and_drop_only_the_remainder(store, n: int, shuffle: bool):
    """60 ok rows: each of n parts gets 60 // n rows' tokens, the parts are disjoint, only 60 % n rows left out."""
    seen = []
    for k in range(n):
        got = pairs(np.concatenate([i for i, _ in store.token_batches("t", 7, shuffle=shuffle, seed=2, part=(k, n))]))
        assert len(got) == (60 // n) * TOKENS and len(set(got)) == len(got)
        assert store.epoch_rows("t", shuffle=shuffle, seed=2, part=(k, n)) == 60 // n
        seen += got
    assert len(set(seen)) == len(seen) and set(seen) <= set(ALL)
    assert len({r for r, _ in set(ALL) - set(seen)}) == 60 % n  # whole rows left out, the remainder only
    # the workers of a part split it, leaving none out
    part = sorted(pairs(np.concatenate([i for i, _ in store.token_batches("t", 7, seed=2, part=(1, n))])))
    split = [p for w in range(3) for i, _ in store.token_batches("t", 7, seed=2, part=(1, n), worker=(w, 3))
             for p in pairs(i)]
    assert sorted(split) == part


def test_more_parts_than_rows_a_part_not_a_whole_number_or_a_state_not_a_dict_are_refused(store):
    """issue 54: part=(k, 61) over 60 ok rows gave every rank an empty epoch (equal parts: 0 rows each), part=(1.5, 3)
    was taken as (1, 3), load_state_dict([1, 2, 3]) was an AttributeError. Each is one line saying why."""
    assert store.epoch_rows("t", part=(59, 60)) == 1  # as many parts as rows: one each
    for call in (lambda: store.epoch_rows("t", part=(0, 61)), lambda: store.batches("t", part=(3, 61)),
                 lambda: store.token_batches("t", part=(60, 61))):
        with pytest.raises(ValueError, match=r"the epoch's 60 rows make no 61 parts of equal length .*every part would "
                                             r"be empty.* at most 60 parts"):
            call()
    assert len(list(store.batches("t", part=(0, 1), worker=(0, 61)))) == 0  # a DataLoader worker may have none
    for part in [(1.5, 3), (1, 3.0), (True, 2), ("1", "3")]:
        with pytest.raises(TypeError, match=r"part \(k, n\) takes whole numbers"):
            store.batches("t", part=part)
    for part, why in [((3, 3), r"part 3 of 3 does not exist \(the parts are 0 to 2\)"), ((-1, 3), "part -1 of 3"),
                      ((0, 0), "at least one part")]:
        with pytest.raises(ValueError, match=r"part \(k, n\) needs 0 <= k < n, not .*" + why):
            store.batches("t", part=part)
    assert store.epoch_rows("t", part=(np.int64(1), np.int32(2))) == 30  # numpy's ints are whole numbers
    with pytest.raises(TypeError, match=r"^load_state_dict\(\) takes the dict that state_dict\(\) returned, not a "
                                        r"list \(\[1, 2, 3\]\)$"):
        store.batches("t").load_state_dict([1, 2, 3])


def _rank(rank: int, url: str, port: int, out: multiprocessing.Queue) -> None:
    """One rank of a two-process gloo group: a DDP-like loop (an all-reduce per batch), its batches and pairs."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        loader = open_store(url).dataloader("t", batch_size=16, tokens=True, num_workers=0)
        seen, batches = [], 0
        for b in loader:
            dist.all_reduce(torch.ones(1))  # a rank with a batch more would wait here for ever (to the timeout)
            batches += 1
            seen += [(int(r), int(t)) for r, t in zip(b["row"], b["token"], strict=True)]
        dist.barrier()
        out.put((rank, batches, len(loader), seen))
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_two_gloo_ranks_get_equal_batch_counts_and_end_together(store):
    """torch.distributed initialised: the loader reads this rank's part with no part= given; both ranks run the
    same number of batches (an all-reduce each) and reach the end, their tokens disjoint."""
    pytest.importorskip("torch")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store.url, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=300) for _ in procs)  # each rank says when it is through
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (_, b0, len0, seen0), (_, b1, len1, seen1) = got
    assert b0 == b1 == len0 == len1 == -(-30 * TOKENS // 16)
    assert not set(seen0) & set(seen1) and sorted(seen0 + seen1) == ALL


@pytest.mark.parametrize("tokens", [True, False])
def test_a_stream_resumed_from_its_state_yields_exactly_what_it_had_not(store, tokens: bool):
    def stream():
        if tokens:
            return store.token_batches("t", 10, seed=4, buffer_chunks=2)
        return store.batches("t", 7, seed=4, buffer_chunks=2)

    def keys(index: np.ndarray) -> list:
        return pairs(index) if tokens else index.tolist()

    whole = [p for i, _ in stream() for p in keys(i)]
    first = stream()
    before = [p for _, (i, _) in zip(range(5), first, strict=False) for p in keys(i)]
    state = first.state_dict()
    first.close()
    rest = stream()
    rest.load_state_dict(state)
    after = [p for i, _ in rest for p in keys(i)]
    assert before + after == whole  # the same order from where it stopped: nothing twice, nothing lost
    again = stream()
    with pytest.raises(ValueError, match="another epoch: seed 5"):
        again.load_state_dict({**state, "seed": 5})


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_resumed_mid_epoch_gives_exactly_the_missing_tokens(store, workers: int):
    pytest.importorskip("torch")

    def loader():
        return store.dataloader("t", batch_size=16, tokens=True, seed=1, num_workers=workers, buffer_chunks=2)

    first = loader()
    next(iter(first))  # epoch 0 whole; the state then says epoch 1, none given
    it = iter(first)
    before = [p for _, b in zip(range(7), it, strict=False)
              for p in zip(b["row"].tolist(), b["token"].tolist(), strict=True)]
    state = first.state_dict()
    assert state["epoch"] == 1 and state["batches"] == 7
    del it
    second = loader()
    second.load_state_dict(state)
    after = [p for b in second for p in zip(b["row"].tolist(), b["token"].tolist(), strict=True)]
    assert not set(before) & set(after) and sorted(before + after) == ALL
    assert second.state_dict()["epoch"] == 2  # the resumed epoch ended: the next one is due
    whole = [p for b in loader() for p in zip(b["row"].tolist(), b["token"].tolist(), strict=True)]
    assert sorted(whole) == ALL


def test_the_default_stream_mixes_a_class_sorted_store_as_a_global_permutation(tmp_path):
    """Issue 54: 4000 rows in 40 classes stored in order (shards of 100 rows, inner chunks of 4): the default buffer
    holds what 8 read runs held before (800 rows: a fifth of the store), now as 200 inner chunks from anywhere in
    the epoch (5 a class): the largest class share per batch is within 10% of a global permutation's (seeded:
    the same figures at every run), where the former default (8 runs: spread=False) gave twice it, and every token
    comes once."""
    from mixing import class_sorted, largest_share, permuted

    class_sorted(str(tmp_path / "s.zarr"), rows=4000, classes=40, tokens=4, shard=100, inner=4)
    s = open_store(str(tmp_path / "s.zarr"))
    labels = s.labels
    best = np.mean([largest_share(labels, permuted(np.repeat(np.arange(4000), 4), 32, seed))[0] for seed in range(3)])
    got = [i for i, _ in s.token_batches("t", 32, seed=1)]
    former = [i for i, _ in s.token_batches("t", 32, seed=1, spread=False, buffer_chunks=8)]
    assert largest_share(labels, [i[:, 0] for i in got[:-1]])[0] <= 1.1 * best
    assert largest_share(labels, [i[:, 0] for i in former[:-1]])[0] >= 1.8 * best
    assert sorted(pairs(np.concatenate(got))) == sorted((r, t) for r in range(4000) for t in range(4))
    assert s.buffer_bytes("t") == s.buffer_bytes("t", spread=False) == 800 * 4 * 2 * 4  # the same memory
    assert s.buffer_bytes("t", 256) == 256 * 4 * 4 * 2 * 4


def test_per_token_norms_and_normalized_streams_equal_numpy(tmp_path):
    """The statistics of a token capture hold its mean token norm (numpy's, over every token of the finite rows);
    normalize= subtracts the per-feature mean, divides by it, or centres and divides by the centred RMS norm."""
    from extractor.store.stats import ShardStats, Totals, dumps

    url = str(tmp_path / "s.zarr")
    _make(url)
    s = open_store(url)
    x = np.asarray(s["t"][:], np.float64)
    x[7, 2, 1] = np.nan  # a row holding NaN: out of the norms, as of the moments
    totals = Totals(2)
    for shard, rows in enumerate([np.arange(0, 30), np.arange(30, N)]):  # two shards' records, merged
        st = ShardStats(s.captures["t"]["dims"], s.captures["t"]["shape"])
        st.update(x[rows].astype(np.float32), rows)
        totals.add(shard, dumps({"t": st}))
    stats = totals.summary()["t"]
    finite = np.delete(x, 7, axis=0)
    np.testing.assert_allclose(stats["mean_token_l2"], np.linalg.norm(finite, axis=-1).mean(), rtol=1e-6)
    assert stats["mean_l2"] != pytest.approx(stats["mean_token_l2"])  # a row's norm is another figure

    root_attrs(url, stats={"t": stats})  # as the store's end records them
    s = open_store(url)
    data = np.asarray(s["t"][:], np.float64)
    mean = np.asarray(stats["mean"])
    for normalize, want in [("mean", data - mean), ("norm", data / stats["mean_token_l2"]),
                            (("mean", "norm"), (data - mean) / np.sqrt(np.sum(np.square(stats["std"]))))]:
        for index, got in s.token_batches("t", 50, seed=3, normalize=normalize):
            np.testing.assert_allclose(got, want[index[:, 0], index[:, 1]], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="'mean', 'norm' or both"):
        s.token_batches("t", normalize="unit")


def test_a_stream_without_the_prefix_tokens_is_normalised_by_the_patches_statistics(tmp_path):
    """issue 54: normalize divided by a mean over every token, CLS included, also when the stream leaves the CLS out.
    The statistics keep the sums of the tokens besides the patches apart (the shard's ``span``); the patches' equal
    numpy's over tokens 1: of the finite rows, and a stream with drop_prefix=True is scaled by them; a cut the store
    has no statistics of is refused, as is a store whose records do not keep them apart."""
    from extractor.store.stats import ShardStats, Totals, dumps

    url = str(tmp_path / "s.zarr")
    _make(url)  # model.prefix_tokens 1: token 0 of each row is its CLS
    s = open_store(url)
    x = np.asarray(s["t"][:], np.float64)
    x[:, 0] *= 40  # a CLS far larger than the patches (as a ViT's): every-token figures are far off the patches'
    x[7, 2, 1] = np.nan  # a row holding NaN: out of the norms, as of the moments
    totals = Totals(2)
    for shard, rows in enumerate([np.arange(0, 30), np.arange(30, N)]):
        shape = s.captures["t"]["shape"]
        st = ShardStats(s.captures["t"]["dims"], shape, span=(1, shape[0] - 1))
        st.update(x[rows].astype(np.float32), rows)
        totals.add(shard, dumps({"t": st}))
    stats = totals.summary()["t"]
    finite = np.delete(x, 7, axis=0)[:, 1:]
    patches = stats["patches"]
    assert patches["span"] == [1, x.shape[1] - 1]
    np.testing.assert_allclose(patches["mean_token_l2"], np.linalg.norm(finite, axis=-1).mean(), rtol=1e-6)
    patch_values = x[:, 1:].reshape(-1, FEATURES)  # the moments: every finite value (row 7's others count)
    np.testing.assert_allclose(patches["mean"], np.nanmean(patch_values, axis=0), rtol=1e-6)
    np.testing.assert_allclose(patches["std"], np.nanstd(patch_values, axis=0), rtol=1e-5)
    assert stats["mean_token_l2"] > 3 * patches["mean_token_l2"]  # CLS included: another figure
    assert Totals.from_bytes(totals.to_bytes(), 2).summary()["t"]["patches"] == patches  # kept as the driver keeps

    root_attrs(url, stats={"t": stats})
    s = open_store(url)
    data = np.asarray(s["t"][:], np.float64)
    for normalize, want in [("norm", data / patches["mean_token_l2"]), ("mean", data - np.asarray(patches["mean"]))]:
        for index, got in s.token_batches("t", 50, seed=3, drop_prefix=True, normalize=normalize):
            assert (index[:, 1] >= 1).all()
            np.testing.assert_allclose(got, want[index[:, 0], index[:, 1]], rtol=1e-5, atol=1e-6)
        shift, scale = s.normalization("t", normalize, drop_prefix=True)  # what the feature index reads
        assert (scale, shift is None) == ((patches["mean_token_l2"], True) if normalize == "norm" else (None, False))
    for index, got in s.token_batches("t", 50, normalize="norm"):  # every token: every token's statistics
        np.testing.assert_allclose(got, data[index[:, 0], index[:, 1]] / stats["mean_token_l2"], rtol=1e-5)
    with pytest.raises(StoreError, match=r"over tokens 2 to 5 of each row of 't': the store's statistics are of every "
                                         r"stored token, or of its patches \(tokens 1 to 5\)"):
        s.token_batches("t", drop_prefix=2, normalize="norm")
    root_attrs(url, stats={"t": {k: v for k, v in stats.items() if k != "patches"}})  # made before they were kept
    with pytest.raises(StoreError, match="statistics of its patches alone, which it does not have"):
        open_store(url).token_batches("t", drop_prefix=True, normalize="norm")


def test_token_batches_of_two_layers_are_aligned_position_by_position(store):
    """token_batches(["t", "u"]): each batch holds the same (row, token) positions of both captures, every
    position once; the DataLoader view gives both keys."""
    t, u = np.asarray(store["t"][:]), np.asarray(store["u"][:])
    seen = []
    for index, data in store.token_batches(["t", "u"], 13, seed=6, buffer_chunks=2):
        assert set(data) == {"t", "u"}
        np.testing.assert_array_equal(data["t"], t[index[:, 0], index[:, 1]])
        np.testing.assert_array_equal(data["u"], u[index[:, 0], index[:, 1]])
        seen += pairs(index)
    assert sorted(seen) == ALL
    one = [pairs(i) for i, _ in store.token_batches("t", 13, seed=6, buffer_chunks=2)]
    assert [p for b in one for p in b] == seen  # the order of one capture's stream, with the other alongside
    pytest.importorskip("torch")
    b = next(iter(store.dataloader(["t", "u"], batch_size=13, tokens=True)))
    rows, tok = b["row"].numpy(), b["token"].numpy()
    np.testing.assert_array_equal(b["u"].numpy(), u[rows, tok])
    np.testing.assert_array_equal(b["t"].numpy(), t[rows, tok])
