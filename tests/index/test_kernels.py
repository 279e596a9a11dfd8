"""A write-time index's blocks computed in torch where the activations are (issue 42): merged on the host, the same
index as the numpy state of the same rows cut into other blocks, and both as numpy by hand (argsort, histograms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_state import ARRAYS, _check_against_numpy

from extractor.index.device import block_part
from extractor.index.state import IndexState


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
    for a in range(0, n, 64):  # the store's chunks
        host.update(acts[a : a + 64], rows[a : a + 64])
    device = IndexState(f, t, k, pool, threshold)
    for a in range(0, n, 27):  # the job's batches, in the capture's dtype, sending only what beats the floors
        floors = device.top.floor.copy(), device.examples.floor.copy()
        device.add_part(block_part(torch.from_numpy(acts[a : a + 27]).to(dtype), rows[a : a + 27], k, pool,
                                   threshold, floors))
    got, want = device.finish(), host.finish()
    for name in ARRAYS:
        a, b = getattr(got, name), getattr(want, name)
        if name == "mean_active":
            np.testing.assert_allclose(a, b, rtol=1e-12)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    clean = np.nan_to_num(acts, nan=-1.0, posinf=1e30)
    if t > 1 and pool == "max":  # by hand without the NaN and inf rows (their rules are the state's own)
        ok = np.isfinite(acts).all(axis=(1, 2))
        part = IndexState(f, t, k, pool, threshold)
        part.add_part(block_part(torch.from_numpy(clean[ok]), rows[ok], k, pool, threshold))
        _check_against_numpy(clean[ok], rows[ok], part.finish(), k, pool, threshold)
