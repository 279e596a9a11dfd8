"""Representational comparison of captures, of one store or of several: linear CKA and RSA (numpy only).

Rows are aligned by image id: only the ids ok in every store compared count, and a comparison of stores
that share none is refused. Both measures work on a seeded sample of those rows, so memory does not grow
with the store:
- linear CKA (Kornblith et al. 2019) from the centred Gram matrices of the sample (n x n: 16 MB each at
  n = 2048), equal to the feature form ``||Y'X||^2 / (||X'X|| ||Y'Y||)`` of the centred features;
- RSA: the Spearman correlation of the upper triangles of the representational dissimilarity matrices
  (1 - Pearson correlation between the rows) of a smaller sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._text import table
from ..errors import StoreError
from .reader import ActivationStore

__all__ = ["Comparison", "compare", "linear_cka"]

FEATURE_BYTES = 512 << 20  # a sample's features of one capture are read at most this big (float32)


@dataclass
class Comparison:
    """CKA and RSA between captures (``names``: STORE:KEY), on ``rows`` of the ``shared`` rows ok in all."""

    names: list[str]
    cka: np.ndarray  # (k, k)
    rsa: np.ndarray  # (k, k)
    shared: int  # ids ok in every store compared
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


def compare(captures: Sequence[tuple[ActivationStore, str]], rows: int = 2048, rsa_rows: int = 1000,
            seed: int = 0) -> Comparison:
    """CKA and RSA between each pair of ``captures`` (store, key), on a sample of ``rows`` (CKA) and of
    ``rsa_rows`` (RSA, a subset of it) of the rows whose ids are ok in every store (each capture read with
    at most ``FEATURE_BYTES`` of float32 features: the sample shrinks for wide captures, and says so)."""
    _check(captures)
    ids = _shared_ids([s for s, _ in captures])
    if len(ids) < 3:
        raise StoreError(f"the captures compared share {len(ids)} ok rows; CKA and RSA need at least 3 (an RDM of 3 "
                         "rows has 3 dissimilarities)")
    widest = max(int(np.prod(s[k].shape[1:])) for s, k in captures)
    n = min(rows, len(ids), max(FEATURE_BYTES // (4 * widest), 2))
    notes = [] if n == min(rows, len(ids)) else [f"the CKA sample is {n} rows: {widest} features a row, read at most "
                                                  f"{FEATURE_BYTES >> 20} MiB of them per capture"]
    pick = np.sort(np.random.default_rng(seed).choice(len(ids), n, replace=False))
    sample = [ids[i] for i in pick]
    m = min(rsa_rows, n)
    grams, rdms = [], []
    for store, key in captures:
        x = _rows_of(store, key, sample)
        k = _centred(x) @ _centred(x).T
        grams.append(k / np.linalg.norm(k))
        rdms.append(_ranks(_upper(1.0 - np.corrcoef(x[:m]))))
    cka = np.array([[float(np.sum(a * b)) for b in grams] for a in grams])
    rsa = np.array([[float(np.corrcoef(a, b)[0, 1]) for b in rdms] for a in rdms])
    names = [f"{s.url}:{k}" for s, k in captures]
    return Comparison(names, cka, rsa, len(ids), n, m, notes)


def _check(captures: Sequence[tuple[ActivationStore, str]]) -> None:
    if len(captures) < 2:
        raise ValueError("compare needs at least two captures (of one store or of several)")
    for store, key in captures:
        if key not in store.keys:
            raise StoreError(f"{key!r} is not a capture of {store.url}; its captures: {', '.join(store.keys)}")


def _shared_ids(stores: Sequence[ActivationStore]) -> list[str]:
    """The ids ok in every store, in the first store's row order; refused when there are none."""
    ok = [{str(i) for i in s.ids[s.ok_rows()]} for s in stores]
    common = set.intersection(*ok)
    if not common:
        raise StoreError("the stores compared share no image id whose row is ok in all of them: "
                         + ", ".join(f"{s.url} ({len(o)} ok)" for s, o in zip(stores, ok, strict=True))
                         + "; compare stores made from the same images")
    first = stores[0]
    return [str(i) for i in first.ids[first.ok_rows()] if str(i) in common]


def _rows_of(store: ActivationStore, key: str, ids: list[str]) -> np.ndarray:
    """The rows of ``ids`` of a capture, flattened, float64."""
    index = store.row_numbers(ids)
    order = np.argsort(index)
    x = np.empty((len(ids), int(np.prod(store[key].shape[1:]))), np.float64)
    x[order] = store.numpy(key, rows=index[order]).reshape(len(ids), -1)
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
