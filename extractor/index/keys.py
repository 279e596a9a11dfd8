"""The keys a feature index ranks by, and the hash its example rows are drawn by (numpy: the reference).

A top key is one uint64 per (row, feature): the pooled value's ordered bits, then the lower row (:func:`top_keys`),
so that ties never depend on the order rows come in. A sample key ranks a (row, feature) pair by a 32-bit hash of
the two, then the lower row (:func:`sample_hashes`, :func:`sample_keys`): the example rows of a bin are those of the
largest keys, a sample that does not depend on the order either. The hash's constants are defined here once; the
compiled pass (:mod:`.kernel`) and the device's (:mod:`.device`) make the same hashes from them.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "FEATURE_ADD",
    "FEATURE_MUL",
    "FMIX_MUL",
    "PAIR_MUL",
    "ROW_MUL",
    "key_rows",
    "key_values",
    "sample_hashes",
    "sample_keys",
    "top_keys",
]

FMIX_MUL = (0x85EBCA6B, 0xC2B2AE35)  # murmur3's finaliser (fmix32): its two multipliers
ROW_MUL = 0x9E3779B1  # a row is mixed as fmix32(row x ROW_MUL)
FEATURE_MUL, FEATURE_ADD = 0x85EBCA77, 0x165667B1  # a feature as fmix32(feature x FEATURE_MUL + FEATURE_ADD)
PAIR_MUL = 0xC2B2AE3D  # a pair: (row mix ^ feature mix) x PAIR_MUL, its high half xor-ed into its low half
_EMPTY = np.uint64(0)  # the key of an empty slot: below every real key
_ROW_MASK = np.uint64(0xFFFFFFFF)


def _ordered(values: np.ndarray) -> np.ndarray:
    """float32 -> uint32 whose order is the values' order (IEEE bits, negatives flipped)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    return np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))


def _unordered(u: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_ordered`."""
    u = u.astype(np.uint32)
    bits = np.where(u & np.uint32(0x80000000), u & np.uint32(0x7FFFFFFF), ~u)
    return bits.view(np.float32)


def top_keys(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """One uint64 per (row, feature): higher value first, then the lower row (rows < 2**32 - 1)."""
    high = _ordered(values).astype(np.uint64) << np.uint64(32)
    return high | (_ROW_MASK - rows.astype(np.uint64).reshape(-1, *([1] * (values.ndim - 1))))


def key_rows(keys: np.ndarray) -> np.ndarray:
    """Row numbers of top keys (-1 for empty slots)."""
    return np.where(keys == _EMPTY, -1, (_ROW_MASK - (keys & _ROW_MASK)).astype(np.int64))


def key_values(keys: np.ndarray) -> np.ndarray:
    """Pooled values of top keys (NaN for empty slots)."""
    return np.where(keys == _EMPTY, np.float32(np.nan), _unordered(keys >> np.uint64(32)))


def _fmix32(x: np.ndarray) -> np.ndarray:
    """murmur3's finaliser: uint32 -> uint32, every bit of the input spread over the output."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(FMIX_MUL[0])
        x ^= x >> np.uint32(13)
        x *= np.uint32(FMIX_MUL[1])
        return x ^ (x >> np.uint32(16))


def sample_hashes(rows: np.ndarray, features: np.ndarray) -> np.ndarray:
    """A 32-bit hash of each pair of ``rows`` (n,) and ``features`` (F,): (n, F) uint32, computed densely (each row
    and each feature mixed once, then each pair by a multiply and a shift: a bijection of the two mixed values'
    xor, so no two rows of a feature collide)."""
    a, b = _row_mix(rows), _feature_mix(features)
    with np.errstate(over="ignore"):
        x = a[:, None] ^ b[None, :]
        x *= np.uint32(PAIR_MUL)
        x ^= x >> np.uint32(16)
    return x


def _row_mix(rows: np.ndarray) -> np.ndarray:
    """Each row mixed (uint32), as :func:`sample_hashes` combines it with a feature's."""
    return _fmix32((np.asarray(rows, np.int64) & 0xFFFFFFFF).astype(np.uint32) * np.uint32(ROW_MUL))


def _feature_mix(features: np.ndarray) -> np.ndarray:
    return _fmix32(np.asarray(features, np.int64).astype(np.uint32) * np.uint32(FEATURE_MUL) + np.uint32(FEATURE_ADD))


def sample_keys(hashes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The key by which example rows are kept, per (row, feature) pair of hash ``hashes`` (:func:`sample_hashes`):
    larger for a smaller hash, then the lower row; the kept ones of a bin are those of the largest keys (a uniform
    sample of the bin's rows, whatever order they came in)."""
    return ~((hashes.astype(np.uint64) << np.uint64(32)) | rows.astype(np.uint64))

