"""The mixing figure of issue 44: the largest class share per batch of a stream, against a global permutation's."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def largest_share(labels: np.ndarray, batches: Iterable[np.ndarray]) -> tuple[float, float]:
    """Mean and worst, over the full batches, of the largest share one class has of a batch (rows of ``labels``)."""
    shares = []
    for rows in batches:
        counts = np.bincount(labels[rows])
        shares.append(counts.max() / len(rows))
    return float(np.mean(shares)), float(np.max(shares))


def permuted(rows: np.ndarray, batch_size: int, seed: int = 0) -> list[np.ndarray]:
    """The full batches of ``rows`` (one per item: a row, or a token's row) in a global random permutation."""
    order = np.random.default_rng(seed).permutation(rows)
    return [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]


def class_sorted(url: str, rows: int = 4000, classes: int = 40, tokens: int = 4, shard: int = 100,
                 inner: int = 2, features: int = 2, dtype: str = "float32", noise: bool = False) -> None:
    """A sharded store of ``rows`` rows of (tokens, features) in class order (``classes`` equal blocks), inner chunks
    of ``inner`` rows in shards of ``shard``; zeros, or with ``noise`` seeded normal values (which compress as
    activations do: hardly)."""
    from extractor.data import Rows
    from extractor.store.layout import OK, StoreArrays
    from extractor.store.synthetic import create_store

    caps = {"t": {"shape": [tokens, features], "dtype": dtype, "dims": ["t.token", "t.feature"], "layer": "t",
                  "what": "output", "reduce": "none"}}
    labels = [classes * i // rows for i in range(rows)]
    g = create_store(url, Rows(ids=[f"i{i}" for i in range(rows)], paths=[""] * rows, labels=labels),
                     StoreArrays(captures=caps, extras={}, shard_size=shard, chunk_rows={"t": inner}, sharded=True),
                     {"n_rows": rows, "n_shards": -(-rows // shard), "captures": caps, "format_version": 1,
                      "spec": {}, "model": {}, "classes": [f"c{c}" for c in range(classes)]})
    rng = np.random.default_rng(0)
    for a in range(0, rows, shard):
        n = min(shard, rows - a)
        values = rng.standard_normal((n, tokens, features), dtype=np.float32) if noise else \
            np.zeros((n, tokens, features), np.float32)
        g["t"][a : a + n] = values.astype(dtype)
    g["status"][:] = OK
