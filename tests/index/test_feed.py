"""How a capture's rows read as positions x features (``feed.Layout``): a map's channels (either layout), a token
sequence's features with its prefix, a vector's; what makes no index is refused."""

from __future__ import annotations

import numpy as np
import pytest

from extractor.index.feed import Layout


def test_a_captures_rows_read_as_positions_by_features():
    x = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2)  # (rows, channel, y, x)
    cases = [(["k.channel", "k.y", "k.x"], x, ("map", 3, 4, (2, 2), 0)),
             (["k.y", "k.x", "k.channel"], x.transpose(0, 2, 3, 1), ("map_last", 3, 4, (2, 2), 0))]
    for dims, stored, want in cases:
        layout = Layout.of("k", {"dims": dims, "shape": list(stored.shape[1:])}, None)
        assert (layout.kind, layout.features, layout.positions, layout.grid, layout.prefix) == want
        np.testing.assert_array_equal(layout.tokens(stored), x.reshape(2, 3, 4).transpose(0, 2, 1))
    seq = np.arange(2 * 17 * 8, dtype=np.float32).reshape(2, 17, 8)  # (rows, token, feature): CLS, then 16 patches
    record = {"dims": ["t.token", "t.feature"], "shape": [17, 8]}
    patches = Layout.of("t", record, 1)  # by default the patches only (issue 54): as the heatmaps show
    assert (patches.positions, patches.grid, patches.prefix, patches.skip, patches.covers) == (16, (4, 4), 0, 1,
                                                                                              "patches")
    np.testing.assert_array_equal(patches.tokens(seq), seq[:, 1:])
    np.testing.assert_array_equal(patches.tokens(seq.astype(np.float16)), seq[:, 1:])  # float16: a view
    every = Layout.of("t", record, 1, include_prefix=True)
    assert (every.positions, every.grid, every.prefix, every.skip, every.covers) == (17, (4, 4), 1, 0, "all")
    np.testing.assert_array_equal(every.tokens(seq), seq)
    unknown = Layout.of("t", record, None)  # the store records no prefix tokens: every token, no grid
    assert (unknown.positions, unknown.grid, unknown.prefix, unknown.covers) == (17, None, 0, "unknown")
    dropped = Layout.of("t", {"dims": ["t.token", "t.feature"], "shape": [16, 8], "drop_prefix": 1}, 0)
    assert (dropped.positions, dropped.grid, dropped.prefix, dropped.skip, dropped.covers) == (16, (4, 4), 0, 0,
                                                                                              "patches")
    sampled = Layout.of("t", {**record, "shape": [6, 8], "sample_tokens": 5, "prefix_kept": 1}, 1)
    assert (sampled.positions, sampled.grid, sampled.skip) == (5, None, 1)
    assert Layout.of("v", {"dims": ["v.feature"], "shape": [8]}, None).positions == 1
    with pytest.raises(ValueError, match=r"stored as \(head, query, key\): an index needs"):
        Layout.of("a", {"dims": ["a.head", "a.query", "a.key"], "shape": [2, 4, 4]}, None)
