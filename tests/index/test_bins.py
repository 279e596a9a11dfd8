"""A feature index's histogram bins against ``np.searchsorted`` over the edges in float64: every float16 value, and
values of every float32 bucket (the table of top bits, and the comparison where an edge cuts a bucket)."""

from __future__ import annotations

import numpy as np

from extractor.index import bins
from extractor.index.bins import HIST_EDGES


def test_the_bins_of_every_float16_value_equal_searchsorted_over_the_edges():
    v = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    with np.errstate(invalid="ignore"):
        want = np.clip(np.searchsorted(10.0**HIST_EDGES, v.astype(np.float64), side="right") - 1, 0,
                       len(HIST_EDGES) - 2)
    want[~(v > 0)] = len(HIST_EDGES) - 1  # not counted
    np.testing.assert_array_equal(bins._bins(v), want)
    np.testing.assert_array_equal(bins._bins(v.reshape(-1, 4)[:, ::2]), want.reshape(-1, 4)[:, ::2])



def test_the_bins_of_every_float32_bucket_equal_searchsorted_over_the_edges():
    """The table of top 16 bits and the comparison at the buckets an edge cuts: against np.searchsorted in float64,
    over values of every bucket, each edge and its neighbours, zeros, infinities and NaN (those <= 0 or NaN:
    not counted)."""
    rng = np.random.default_rng(1)
    top = np.repeat(np.arange(1 << 16, dtype=np.uint32) << np.uint32(16), 4)
    top |= rng.integers(0, 1 << 16, len(top), dtype=np.uint32)
    e = (10.0**HIST_EDGES).astype(np.float32)
    v = np.concatenate([top.view(np.float32), e, np.nextafter(e, -np.inf), np.nextafter(e, np.inf),
                        np.float32([0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3e38])])
    with np.errstate(invalid="ignore"):
        want = np.clip(np.searchsorted(10.0**HIST_EDGES, v.astype(np.float64), side="right") - 1, 0,
                       len(HIST_EDGES) - 2)
    want[~(v > 0)] = len(HIST_EDGES) - 1  # not counted
    np.testing.assert_array_equal(bins._bins(v), want)
    np.testing.assert_array_equal(bins._bins(v.reshape(-1, 2)), want.reshape(-1, 2))  # any shape
