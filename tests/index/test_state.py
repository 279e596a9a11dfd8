"""The feature index's streamed state (issue 42) against numpy by hand: top-k rows and values as argsort of the
pooled matrix, densities, means, histograms, heatmap values, quantile groups, in any order and partition, both ways
a block's numbers are made (the compiled pass and numpy's); a part's bytes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.index_checks import ARRAYS, check_against_numpy

from extractor.index import kernel
from extractor.index.feed import Layout
from extractor.index.state import IndexState


@pytest.fixture(params=["compiled", "numpy"])
def block_pass(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test on both ways a block's numbers are made: the compiled passes and numpy's."""
    if request.param == "numpy":
        monkeypatch.setattr(kernel, "_KERNELS", None)
    elif not kernel.available():
        pytest.skip("numba is not installed (the index extra)")
    return request.param








@pytest.mark.usefixtures("block_pass")
@pytest.mark.parametrize(("pool", "threshold"), [("max", 0.0), ("mean", 0.0), ("max", 0.25), ("max", 20.0)])
def test_the_streamed_state_equals_numpy_by_hand_in_any_order_and_partition(pool: str, threshold: float):
    rng = np.random.default_rng(0)
    n, t, f, k = 400, 6, 9, 5
    acts = rng.standard_normal((n, t, f)).astype(np.float32) * np.logspace(-3, 2, f, dtype=np.float32)
    acts[:, :, 2] = -1  # dead
    acts[:, :, 4] = np.round(acts[:, :, 4], 1)  # ties: the lower row ranks first
    acts[::3, :, 6] = 0  # fires in fewer rows than... still many; feature 7 in 3 rows only:
    acts[:, :, 7] = -1
    acts[[5, 50, 300], 2, 7] = [0.5, 2.0, 0.5]
    rows = np.arange(n, dtype=np.int64) * 3 + 7  # store rows need not be contiguous
    whole = IndexState(f, t, k, pool, threshold)
    for a in range(0, n, 64):
        whole.update(acts[a : a + 64], rows[a : a + 64])
    got = whole.finish()
    check_against_numpy(acts, rows, got, k, pool, threshold)
    if threshold < 0.5:  # feature 7 fires at 0.5 and 2.0 only
        assert got.top_rows[7].tolist() == [rows[50], rows[5], rows[300], -1, -1]
    # the same rows in another order, cut into parts merged through their bytes: the same index
    parts = [IndexState(f, t, k, pool, threshold) for _ in range(3)]
    order = rng.permutation(n)
    for i, a in enumerate(range(0, n, 50)):
        pick = np.sort(order[a : a + 50])
        parts[i % 3].update(acts[pick], rows[pick])
    merged = IndexState(f, t, k, pool, threshold)
    for part in parts:
        again = IndexState(f, t, k, pool, threshold)
        assert again.load(part.to_bytes())
        merged.merge(again)
    other = merged.finish()
    for name in ARRAYS:
        a, b = getattr(got, name), getattr(other, name)
        if name == "mean_active":
            np.testing.assert_allclose(a, b, rtol=1e-12)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.usefixtures("block_pass")
def test_lanes_on_threads_share_one_states_slots_and_give_its_index():
    """A pass's lanes (IndexState.lane): each thread adds its blocks to counts of its own and offers to the slots they
    share, at the same moments (a barrier before each block); joined, the index of the rows added in one state."""
    rng = np.random.default_rng(3)
    n, t, f, k, lanes, step = 720, 4, 12, 5, 3, 40
    acts = rng.standard_normal((n, t, f)).astype(np.float32)
    acts[:, :, 3] = np.round(acts[:, :, 3], 1)  # ties, decided by the lower row whatever lane offers first
    rows = np.arange(n, dtype=np.int64) * 2
    whole = IndexState(f, t, k)
    for a in range(0, n, step):
        whole.update(acts[a : a + step], rows[a : a + step])
    state = IndexState(f, t, k)
    states = [state, *(state.lane() for _ in range(lanes - 1))]
    assert all(s.top is state.top and s.examples is state.examples for s in states)
    together = threading.Barrier(lanes)

    def lane(i: int) -> None:
        for a in range(i * step, n, lanes * step):
            together.wait()
            states[i].update(acts[a : a + step], rows[a : a + step])

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for other in states[1:]:
        state.join(other)
    got, want = state.finish(), whole.finish()
    check_against_numpy(acts, rows, got, k, "max")
    for name in ARRAYS:
        if name == "mean_active":
            np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-12)
        else:
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    with pytest.raises(ValueError, match="not a lane of this one"):
        state.join(IndexState(f, t, k))


@pytest.mark.usefixtures("block_pass")
@pytest.mark.parametrize(("pool", "threshold"), [("max", 0.0), ("mean", 0.0), ("max", 0.25)])
def test_a_float16_map_read_as_stored_equals_its_float32_values(pool: str, threshold: float):
    """A float16 map's rows as Layout.tokens gives them (a view of the stored channels x positions, binned by a table
    of float16 values, its histogram counted in the stored order) make the same index as the float32 blocks of the
    same values, and that index is numpy's by hand."""
    rng = np.random.default_rng(3)
    n, c, h, w, k = 300, 7, 2, 3, 4
    stored = (rng.standard_normal((n, c, h, w)) * np.logspace(-5, 4, c)[None, :, None, None]).astype(np.float16)
    stored[:, 1] = np.float16(-2)  # dead
    stored[7, 3, 1, 2] = np.float16(np.inf)  # a float16 overflow fires, in the last bin
    stored[8, 4, 0, 0] = np.float16(6e-8)  # a subnormal fires, in the first bin
    layout = Layout.of("m", {"dims": ["m.channel", "m.y", "m.x"], "shape": [c, h, w]}, None)
    rows = np.arange(n, dtype=np.int64) * 2
    as_stored, as_float32 = IndexState(c, h * w, k, pool, threshold), IndexState(c, h * w, k, pool, threshold)
    for a in range(0, n, 64):
        block = layout.tokens(stored[a : a + 64])
        assert block.dtype == np.float16 and not block.flags.c_contiguous  # the stored bytes, not a copy
        as_stored.update(block, rows[a : a + 64])
        as_float32.update(np.ascontiguousarray(block, np.float32), rows[a : a + 64])
    got, want = as_stored.finish(), as_float32.finish()
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    with np.errstate(invalid="ignore"):
        check_against_numpy(np.ascontiguousarray(layout.tokens(stored), np.float32), rows, got, k, pool, threshold)
    assert got.histogram[3, -1] >= 1 and (got.histogram[4, 0] >= 1 or threshold > 0)


def test_a_part_cut_short_or_never_written_is_no_state():
    state = IndexState(3, 2, 4)
    state.update(np.ones((2, 2, 3), np.float32), np.arange(2))
    blob = state.to_bytes()
    assert len(blob) == state.nbytes()
    fresh = IndexState(3, 2, 4)
    assert not fresh.load(np.zeros_like(blob)) and not fresh.load(blob[:-1])
    broken = blob.copy()
    broken[-1] ^= 1
    assert not fresh.load(broken) and fresh.load(blob) and fresh.rows == 2
