"""Representational comparison of captures, of one store or of several: linear CKA and RSA (numpy only).

Rows are aligned by image id: only the ids ok in every store compared count, and a comparison of stores
that share none is refused. Memory does not grow with the rows:
- linear CKA (Kornblith et al. 2019) in its feature form ``||Y'X||^2 / (||X'X|| ||Y'Y||)`` of the centred
  features, its cross-products summed a batch of rows at a time: over every shared row (or ``rows`` of them),
  in memory of the features' widths squared. Captures too wide for that (their widths summed past
  ``FEATURE_WIDTH``) take the Gram form on a seeded sample (n x n: 32 MB at n = 2048), equal to it;
- RSA: the Spearman correlation of the upper triangles of the representational dissimilarity matrices
  (1 - Pearson correlation between the rows) of a seeded sample, its size stated.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._text import table
from ..errors import StoreError
from .reader import ActivationStore

__all__ = ["Comparison", "compare", "linear_cka"]

FEATURE_BYTES = 512 << 20  # a sample's features of one capture are read at most this big (float32)
FEATURE_WIDTH = 8192  # the feature form's cross-products: (this many features in all)^2 float64 = 512 MiB at most
BATCH_BYTES = 64 << 20  # the feature form reads this many bytes of rows (float64, all captures) at a time
SAMPLE_ROWS = 2048  # the Gram form's sample, when rows is not given


@dataclass
class Comparison:
    """CKA and RSA between captures (``names``: STORE:KEY), on ``rows`` of the ``shared`` rows ok in all."""

    names: list[str]
    cka: np.ndarray  # (k, k)
    rsa: np.ndarray  # (k, k)
    shared: int  # images ok in every store compared (by id, else by content digest)
    cka_rows: int  # rows in the CKA sample
    rsa_rows: int  # rows in the RSA sample
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"names": self.names, "cka": self.cka.tolist(), "rsa": self.rsa.tolist(), "shared_rows": self.shared,
                "cka_rows": self.cka_rows, "rsa_rows": self.rsa_rows, "notes": self.notes}

    def report(self) -> str:
        short = [f"[{i}]" for i in range(len(self.names))]
        lines = [f"{s} {n}" for s, n in zip(short, self.names, strict=True)]
        for what, m, n in (("linear CKA", self.cka, self.cka_rows), ("RSA (Spearman of RDMs)", self.rsa,
                                                                      self.rsa_rows)):
            lines.append(f"\n{what}, {n} of {self.shared} shared rows:")
            lines.append(table([[s, *(f"{v:.3f}" for v in row)] for s, row in zip(short, m, strict=True)],
                               ["", *short]))
        return "\n".join(lines + self.notes)

    def figure(self) -> Any:
        """Both matrices as heatmaps side by side (a ``matplotlib`` Figure)."""
        from .figures import heatmap

        return heatmap({f"linear CKA ({self.cka_rows} rows)": self.cka,
                        f"RSA: Spearman of RDMs ({self.rsa_rows} rows)": self.rsa}, self.names,
                       f"representational similarity, {self.shared} shared rows")


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA of two feature matrices of the same rows (n x p, n x q), in the feature form."""
    x, y = _centred(x), _centred(y)
    cross = np.linalg.norm(y.T @ x) ** 2
    return float(cross / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


def compare(captures: Sequence[tuple[ActivationStore, str]], rows: int | None = None, rsa_rows: int = 1000,
            seed: int = 0) -> Comparison:
    """CKA and RSA between each pair of ``captures`` (store, key), over the rows whose ids are ok in every
    store: CKA over all of them, or a seeded sample of ``rows`` (in the feature form, memory the widths squared;
    captures wider than ``FEATURE_WIDTH`` in all: the Gram form on a sample of ``rows``, default
    ``SAMPLE_ROWS``, each capture read with at most ``FEATURE_BYTES`` of float32), RSA on ``rsa_rows`` of the
    sample."""
    _check(captures)
    aligned, how = _aligned([s for s, _ in captures])
    total = len(aligned[0])
    if total < 3:
        raise StoreError(f"the captures compared share {total} ok rows; CKA and RSA need at least 3 (an RDM of 3 "
                         "rows has 3 dissimilarities)")
    widths = [int(np.prod(s[k].shape[1:])) for s, k in captures]
    features = sum(widths) <= FEATURE_WIDTH
    want = min(rows or (total if features else SAMPLE_ROWS), total)
    n = want if features else min(want, max(FEATURE_BYTES // (4 * max(widths)), 3))
    notes = [] if n == want else [f"the CKA sample is {n} rows: {max(widths)} features a row, read at most "
                                  f"{FEATURE_BYTES >> 20} MiB of them per capture"]
    notes += [how] if how else []
    sample = [r[_sample(total, n, seed)] for r in aligned]
    cka = _cka_features(captures, sample, widths) if features else _cka_grams(captures, sample)
    m = min(rsa_rows, n)
    few = _sample(n, m, seed + 1)
    rdms = [_ranks(_upper(1.0 - np.corrcoef(_rows_of(store, key, r[few]))))
            for (store, key), r in zip(captures, sample, strict=True)]
    rsa = np.array([[float(np.corrcoef(a, b)[0, 1]) for b in rdms] for a in rdms])
    names = [f"{s.url}:{k}" for s, k in captures]
    return Comparison(names, cka, rsa, total, n, m, notes)


def _sample(total: int, n: int, seed: int) -> np.ndarray:
    """A seeded sample of ``n`` of the places ``0 .. total - 1``, in order (all of them when ``n`` is ``total``)."""
    if n >= total:
        return np.arange(total)
    return np.sort(np.random.default_rng(seed).choice(total, n, replace=False))


def _cka_features(captures: Sequence[tuple[ActivationStore, str]], rows: list[np.ndarray], widths: list[int]
                  ) -> np.ndarray:
    """Linear CKA of every pair, in the feature form: the features' sums and cross-products (all captures side by
    side) summed over ``rows`` (of each capture, aligned) a batch at a time, centred at the end."""
    edges = np.cumsum([0, *widths])
    total = int(edges[-1])
    cross = np.zeros((total, total))
    sums = np.zeros(total)
    batch = max(1, BATCH_BYTES // (8 * total))
    n = len(rows[0])
    for start in range(0, n, batch):
        x = np.hstack([_rows_of(store, key, r[start:start + batch]) for (store, key), r in zip(captures, rows,
                                                                                              strict=True)])
        cross += x.T @ x
        sums += x.sum(axis=0)
    centred = cross - np.outer(sums, sums) / n  # X'X of the centred features: sum x x' - n mean mean'
    blocks = [slice(int(a), int(b)) for a, b in itertools.pairwise(edges)]
    norms = [np.linalg.norm(centred[b, b]) for b in blocks]
    k = len(blocks)
    out = np.empty((k, k))
    for i in range(k):
        for j in range(k):
            out[i, j] = np.linalg.norm(centred[blocks[i], blocks[j]]) ** 2 / (norms[i] * norms[j])
    return out


def _cka_grams(captures: Sequence[tuple[ActivationStore, str]], rows: list[np.ndarray]) -> np.ndarray:
    """Linear CKA of every pair from the centred Gram matrices of ``rows`` (of each capture, aligned; for captures
    too wide for the feature form)."""
    grams = []
    for (store, key), r in zip(captures, rows, strict=True):
        x = _centred(_rows_of(store, key, r))
        g = x @ x.T
        grams.append(g / np.linalg.norm(g))
    return np.array([[float(np.sum(a * b)) for b in grams] for a in grams])


def _check(captures: Sequence[tuple[ActivationStore, str]]) -> None:
    if len(captures) < 2:
        raise StoreError("compare needs at least two captures (of one store or of several): name them as "
                         "STORE:KEY, or give a store of several captures")
    bad = next((c for c in captures if not (isinstance(c, tuple) and len(c) == 2 and
                                            isinstance(c[0], ActivationStore))), None)
    if bad is not None:
        raise StoreError(f"compare takes (store, key) pairs, [(open_store(URL), KEY), ...], not {bad!r}")
    for store, key in captures:
        if key not in store.keys:
            raise StoreError(f"{key!r} is not a capture of {store.url}; its captures: {', '.join(store.keys)}")


def _ok_places(store: ActivationStore, values: np.ndarray) -> dict[str, int]:
    """Of the store's ok rows: each value (id, digest) -> the first row holding it."""
    ok = store.ok_rows()
    return {str(v): int(r) for v, r in zip(values[ok[::-1]], ok[::-1], strict=True)}


def _aligned(stores: Sequence[ActivationStore]) -> tuple[list[np.ndarray], str | None]:
    """Per store, the rows of the images ok in every store (the i-th of each the same image), in the first store's
    row order: matched by image id or, where the stores share no id (one image set read from two sources: a
    folder and its Parquet copy), by content digest, with a note saying so. Refused when none is shared."""
    places = [_ok_places(s, s.ids) for s in stores]
    common = set.intersection(*(set(p) for p in places))
    how = None
    if not common and all(s.digests is not None for s in stores):
        by_digest = [_ok_places(s, np.asarray(s.digests)) for s in stores]
        for p in by_digest:
            p.pop("0", None)  # a row never read has no digest
        common = set.intersection(*(set(p) for p in by_digest))
        if common:
            places, how = by_digest, (f"no image id is shared: {len(common)} rows aligned by content digest "
                                      "(the same image bytes)")
    if not common:
        raise StoreError("the stores compared share no image id (nor image content digest) whose row is ok in all "
                         "of them: " + ", ".join(f"{s.url} ({len(p)} ok)" for s, p in zip(stores, places, strict=True))
                         + "; compare stores made from the same images")
    keys = sorted(common, key=places[0].__getitem__)
    return [np.array([p[k] for k in keys], dtype=np.int64) for p in places], how


def _rows_of(store: ActivationStore, key: str, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of a capture, flattened, float64."""
    order = np.argsort(rows)
    x = np.empty((len(rows), int(np.prod(store[key].shape[1:]))), np.float64)
    x[order] = store.numpy(key, rows=rows[order]).reshape(len(rows), -1)
    if not np.isfinite(x).all():
        raise StoreError(f"{store.url}:{key} holds NaN or Inf in rows of the sample (see extractor inspect): "
                         "compare needs finite values")
    return x


def _centred(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - x.mean(axis=0, keepdims=True)


def _upper(m: np.ndarray) -> np.ndarray:
    return m[np.triu_indices(len(m), k=1)]


def _ranks(v: np.ndarray) -> np.ndarray:
    """Ranks of ``v`` (ties get their mean rank), for a Spearman correlation."""
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v), np.float64)
    ranks[order] = np.arange(len(v), dtype=np.float64)
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    if len(counts) < len(v):  # ties: each the mean of its group's ranks
        sums = np.bincount(inverse, weights=ranks)
        ranks = (sums / counts)[inverse]
    return ranks
