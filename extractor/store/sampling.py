"""The storage-cutting captures' randomness, reproducible from the store alone (numpy only).

``sample_tokens: K`` keeps K patch tokens per image, chosen without replacement by a hash of
(seed, the image's content digest, token): the digest the store keeps per row (``digest``, xxh3-64 of
the bytes read), :func:`token_scores` ranks a row's tokens and the K lowest are kept, in sequence
order. An image keeps its draw whatever its row or id: in a store over more images, or rows taken
from another store (``output.reuse`` matches rows by that digest). The worker computes the same integers on the device
(``extractor.model.reduce.sample_positions``); a test holds the two equal. ``project: D``
multiplies the last dimension by :func:`projection_matrix` (made from the seed by numpy, on the
worker as here), so a reader regenerates the matrix instead of storing it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "BY_DIGEST",
    "HASH",
    "MASK",
    "draw_keys",
    "projection_matrix",
    "rank_keys",
    "sample_positions",
    "token_scores",
]

MASK = (1 << 31) - 1  # 31-bit arithmetic: every product below stays under 2**62 in int64
HASH = (0x5BD1E995, 0x2C1B3C6D, 0x297A2D39, 0x68E31DA4, 0x1B873593)  # odd multipliers, each under 2**31
BY_DIGEST = "digest"  # a capture record's ``sampled_by``: draws keyed by content digest (absent: by row number)


def draw_keys(digests: Any) -> np.ndarray:
    """(N,) int64: the keys of the draws of rows whose content digests are ``digests`` (the store's ``digest``
    array, uint64): their bits as int64, as the worker hands them to the device."""
    return np.asarray(digests, dtype=np.uint64).view(np.int64)


def rank_keys(seed: int, rows: Any, tokens: Any, n_tokens: int) -> Any:
    """Each token's rank key in its row: a hash of (seed, row key, token), made distinct by the position. ``rows``
    (B, 1): the rows' :func:`draw_keys`, and ``tokens`` (1, T) are int64 numpy arrays or torch tensors: the same
    integers either way (the worker ranks on the device with this function, a reader with numpy)."""
    a, b, c, d, e = HASH
    x = (((rows & MASK) * a & MASK) + ((tokens * b) & MASK) + (((seed & MASK) * c) & MASK)) & MASK
    x ^= x >> 15
    x = (x * d) & MASK
    x ^= x >> 13
    x = (x * e) & MASK
    x ^= x >> 16
    return x * n_tokens + tokens  # distinct in a row: ties broken by position


def token_scores(seed: int, rows: np.ndarray, n_tokens: int) -> np.ndarray:
    """(len(rows), n_tokens) int64: each token's rank key in its row (``rows``: their :func:`draw_keys`)."""
    rows = np.asarray(rows, dtype=np.int64)[:, None]
    return rank_keys(seed, rows, np.arange(n_tokens, dtype=np.int64)[None, :], n_tokens)


def sample_positions(seed: int, rows: np.ndarray, n_tokens: int, k: int) -> np.ndarray:
    """(len(rows), k) int64: the k tokens of each row (of ``n_tokens``) that ``sample_tokens: k`` keeps, in
    sequence order (positions among the tokens sampled from, the prefix not counted). ``rows``: the rows'
    :func:`draw_keys` (``draw_keys(s.digests)``); of a store whose capture records no ``sampled_by``, the
    row numbers."""
    order = np.argsort(token_scores(seed, rows, n_tokens), axis=1, kind="stable")[:, :k]
    return np.sort(order, axis=1)


def projection_matrix(seed: int, d_in: int, d_out: int, kind: str = "gaussian") -> np.ndarray:
    """(d_in, d_out) float32, scaled so that norms are kept in expectation: Gaussian entries of variance
    1/d_out, or sparse Rademacher ones (Achlioptas: +-sqrt(3/d_out) with probability 1/6 each, else 0)."""
    rng = np.random.default_rng([seed, d_in, d_out])
    if kind == "gaussian":
        return (rng.standard_normal((d_in, d_out)) / np.sqrt(d_out)).astype(np.float32)
    if kind == "sparse":
        signs = rng.choice(np.array([-1.0, 0.0, 1.0]), size=(d_in, d_out), p=[1 / 6, 2 / 3, 1 / 6])
        return (signs * np.sqrt(3.0 / d_out)).astype(np.float32)
    raise ValueError(f"projection must be gaussian or sparse, not {kind!r}")
