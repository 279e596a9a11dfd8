"""The index's two fast passes against numpy's, the reference (issue 42): the compiled pass (numba, ``kernel``) and
the device's parts (torch, ``device.block_part``, here on the CPU, merged on the host) make numpy's index of the same
rows, array for array: values at and beside every bin edge, NaN, infinities, subnormals and zeros, in a map's layout
(channels first: a strided view) and a token sequence's, float16 and float32, cut into other blocks; and the device's
index of ties, few rows and one position, also against numpy by hand (argsort, histograms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.index_checks import ARRAYS, check_against_numpy

from extractor.index import kernel
from extractor.index.bins import HIST_EDGES
from extractor.index.device import block_part
from extractor.index.state import IndexArrays, IndexState


def _made(way: str, block: np.ndarray, rows: np.ndarray, k: int, pool: str, threshold: float) -> IndexArrays:
    """The index of ``block`` (n, T, F) of store rows ``rows`` made one way: numpy's passes (the reference) or the
    compiled ones, over blocks of 40 rows; or the device's parts of blocks of 27 rows in the block's dtype, each
    sending only what beats the state's floors, merged on the host."""
    n, t, f = block.shape
    state = IndexState(f, t, k, pool, threshold)
    with pytest.MonkeyPatch.context() as m:
        if way == "numpy":
            m.setattr(kernel, "_KERNELS", None)
        if way == "device":
            for a in range(0, n, 27):
                floors = state.top.floor.copy(), state.examples.floor.copy()
                state.add_part(block_part(torch.from_numpy(block[a : a + 27]), rows[a : a + 27], k, pool, threshold,
                                          floors))
        else:
            for a in range(0, n, 40):
                state.update(block[a : a + 40], rows[a : a + 40])
    return state.finish()


def _same(got: IndexArrays, want: IndexArrays, exact_sums: bool) -> None:
    """Every array equal; the mean where a feature fires to float64 rounding unless ``exact_sums`` (the device sums
    in another order)."""
    for name in ARRAYS:
        a, b = getattr(got, name), getattr(want, name)
        if name == "mean_active" and not exact_sums:
            np.testing.assert_allclose(a, b, rtol=1e-12, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


def _edges_and_specials(dtype: type, threshold: float) -> np.ndarray:
    """(96, 11 channels, 6 positions) of ``dtype``: a map's values over 7 decades, with each bin edge, its neighbours,
    NaN, infinities, zeros, subnormals and the threshold put in at random, and one row all NaN in one channel."""
    rng = np.random.default_rng(5)
    edges = (10.0**HIST_EDGES).astype(dtype)
    special = np.concatenate([edges, np.nextafter(edges, dtype(0)), np.nextafter(edges, dtype(np.inf)),
                              [np.nan, np.inf, -np.inf, 0, -0.0, 1e-45, 6e-8, -1e-30, threshold]]).astype(dtype)
    n, c, p = 96, 11, 6
    values = (rng.standard_normal((n, c, p)) * np.logspace(-4, 3, c)[None, :, None]).astype(dtype)
    values.reshape(-1)[rng.choice(values.size, len(special) * 3)] = np.tile(special, 3)
    values[4, 2] = np.nan  # a row whose every position is NaN
    return values


@pytest.mark.parametrize("way", ["compiled", "device"])
@pytest.mark.parametrize(("pool", "threshold"), [("max", 0.0), ("mean", 0.0), ("max", 0.3), ("mean", 0.3)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_each_fast_pass_makes_numpys_index_of_edges_nans_and_both_layouts(way: str, pool: str, threshold: float,
                                                                            dtype: type):
    if way == "compiled" and not kernel.available():
        pytest.skip("numba is not installed (the index extra)")
    values = _edges_and_specials(dtype, threshold)
    rows = np.arange(len(values))
    for block in (values.swapaxes(1, 2), np.ascontiguousarray(values.swapaxes(1, 2))):  # a map's view, tokens
        want, got = _made("numpy", block, rows, 4, pool, threshold), _made(way, block, rows, 4, pool, threshold)
        _same(got, want, exact_sums=way == "compiled")


def _acts(n: int, t: int, f: int) -> np.ndarray:
    rng = np.random.default_rng(3)
    acts = rng.standard_normal((n, t, f)).astype(np.float32) * np.logspace(-5, 4.5, f, dtype=np.float32)
    acts[:, :, 1] = -1  # dead
    acts[:, :, 2] = np.round(acts[:, :, 2], 1)  # ties: the lower row first
    acts[7, 0, 3] = np.nan  # a float16 overflow
    acts[9, :, 4] = np.inf
    acts[:, :, 5] = 0.0
    acts[[3, 30, 31], 0, 5] = [1.0, 1.0, 1e-30]  # few rows, a denormal-sized one
    return acts


@pytest.mark.parametrize(("t", "pool", "threshold", "dtype"), [(5, "max", 0.0, torch.float32),
                                                                (5, "mean", 0.0, torch.float32),
                                                                (5, "max", 0.3, torch.float16),
                                                                (5, "max", 300.0, torch.float32),
                                                                (1, "max", 0.0, torch.float32)])
def test_device_blocks_merged_equal_the_numpy_state_and_numpy_by_hand(t: int, pool: str, threshold: float,
                                                                       dtype: torch.dtype):
    n, f, k = 300, 12, 6
    acts = _acts(n, t, f)
    acts = torch.from_numpy(acts).to(dtype).float().numpy()  # the values as the store keeps them
    rows = np.arange(n, dtype=np.int64) * 2 + 5
    host = IndexState(f, t, k, pool, threshold)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernel, "_KERNELS", None)  # numpy's passes: the reference
        for a in range(0, n, 64):  # the store's chunks
            host.update(acts[a : a + 64], rows[a : a + 64])
    device = IndexState(f, t, k, pool, threshold)
    for a in range(0, n, 27):  # the job's batches, in the capture's dtype, sending only what beats the floors
        floors = device.top.floor.copy(), device.examples.floor.copy()
        device.add_part(block_part(torch.from_numpy(acts[a : a + 27]).to(dtype), rows[a : a + 27], k, pool,
                                   threshold, floors))
    _same(device.finish(), host.finish(), exact_sums=False)
    clean = np.nan_to_num(acts, nan=-1.0, posinf=1e30)
    if t > 1 and pool == "max":  # by hand without the NaN and inf rows (their rules are the state's own)
        ok = np.isfinite(acts).all(axis=(1, 2))
        part = IndexState(f, t, k, pool, threshold)
        part.add_part(block_part(torch.from_numpy(clean[ok]), rows[ok], k, pool, threshold))
        check_against_numpy(clean[ok], rows[ok], part.finish(), k, pool, threshold)
