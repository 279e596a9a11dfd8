"""An index's atlas (issue 59): every feature's neighbours by three measures (:mod:`.neighbours`: decoder cosine
where the dictionary has a decoder, co-occurrence over tokens, correlation over rows) and a 2-D map of all features
(:mod:`.projection`), made in a bounded second pass over a sample of the store's rows and kept in the index: a
subgroup of its arrays that its attributes' ``atlas`` names, added by one swap (numpy and zarr).

    >>> add_atlas("out.zarr", "blocks.11@my_sae")     # index() adds one by default
    >>> ix.neighbours(42)["decoder"].features         # its nearest latents by decoder cosine
    >>> ix.map                                        # (F, 2): one point per feature

The sample (``atlas_rows``): every ok row where there are at most ``rows``; else the features' top rows, rank by
rank, up to half of them, and a seeded draw of the others; kept in a seeded order, of which the first rows whose
tokens make at most ``tokens`` count co-occurrence. Memory: the sample's pooled values (rows x features), its
firing entries, and a block of features' scores against all.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError
from ..read import ActivationStore
from ..store import OK, Generation, Objects, get_array, now, take_rows
from .feed import ENCODE_VALUES
from .layout import pointer, write_atlas
from .neighbours import NEIGHBOURS, Cooccurrence, correlation, decoder_cosine
from .projection import feature_map
from .reader import FeatureIndex, _store, open_index

__all__ = ["ATLAS_ROWS", "ATLAS_TOKENS", "add_atlas", "sample_rows"]

log = logging.getLogger(__name__)
ATLAS_ROWS = 1024  # rows of the second pass: their pooled values (correlation, the map without a decoder)
ATLAS_TOKENS = 1 << 16  # tokens of the first of them whose firing is counted (co-occurrence)


def sample_rows(ix: FeatureIndex, rows: int, seed: int) -> np.ndarray:
    """The atlas's rows, in the seeded order the pass reads them in (see the module's doc)."""
    ok = np.flatnonzero(ix.store.status == OK)
    rng = np.random.default_rng(seed)
    if len(ok) <= rows:
        return rng.permutation(ok)
    top = np.asarray(get_array(ix.arrays, "top_rows")[:]).T.reshape(-1)  # rank by rank: each feature's best first
    top = top[top >= 0]
    _, first = np.unique(top, return_index=True)
    chosen = top[np.sort(first)][: rows // 2]
    rest = rng.choice(np.setdiff1d(ok, chosen), rows - len(chosen), replace=False)
    return rng.permutation(np.concatenate([chosen, rest]))


def add_atlas(store_or_path: ActivationStore | str | Path, name: str | None = None, *, rows: int = ATLAS_ROWS,
              tokens: int = ATLAS_TOKENS, neighbours: int = NEIGHBOURS, seed: int = 0, method: str = "auto",
              storage_options: Mapping[str, Any] | None = None) -> FeatureIndex:
    """Make index ``name``'s atlas (see the module's doc) in one pass over at most ``rows`` of the store's rows and
    write it into the index (an atlas it had is replaced); the index, read again. ``neighbours`` per feature and
    measure; the map by ``method`` (auto: UMAP where installed, else PCA) from ``seed``. Refused where the index
    was written again meanwhile (nothing of this one is named)."""
    store = _store(store_or_path, storage_options)
    ix = open_index(store, name)
    generation = _generation(ix)
    at = pointer(generation, ix.name)
    if at[1] != ix.attrs.get("arrays"):
        raise StoreError(f"index {ix.name} of {store.url} was made again since it was opened: open it again")
    sample = sample_rows(ix, rows, seed)
    pooled, cooc, counted = _pass(ix, sample, tokens)
    arrays, record = _atlas(ix, pooled, cooc, neighbours, seed, method)
    record.update(rows=len(sample), cooccurrence_rows=counted, seed=seed, created=now())
    arrays["rows"] = sample.astype(np.int64)
    if not write_atlas(generation, ix.name, arrays, record, at, ix.attrs):
        raise StoreError(f"index {ix.name} of {store.url} was written by another process while its atlas was made; "
                         "run extractor index --atlas again")
    log.info("atlas of %s: %d features over %d rows (%d for co-occurrence), map by %s", ix.name, ix.features,
             len(sample), counted, record["map"]["method"])
    return open_index(store, ix.name)


def _generation(ix: FeatureIndex) -> Generation:
    name = ix.store.attrs.get("generation")
    if name is None:
        raise StoreError(f"{ix.store.url} was made by an older extractor: make it again to add an atlas")
    return Generation(Objects.at(ix.store.url, ix.store.storage_options), str(name))


def _pass(ix: FeatureIndex, sample: np.ndarray, tokens: int) -> tuple[np.ndarray, Cooccurrence, int]:
    """The sample's rows read (in row order, a block at a time) and encoded as the index encodes them: each row's
    pooled (max) values (rows, F) float32 in the sample's order, and the firing of the tokens of its first rows
    (at most ``tokens``); how many rows those are."""
    arr = ix.store[ix.key]
    t = int(ix.attrs["positions"])
    counted = max(1, min(len(sample), tokens // max(t, 1)))
    pooled = np.zeros((len(sample), ix.features), np.float32)
    cooc = Cooccurrence(ix.features)
    order = np.argsort(sample, kind="stable")  # read in row order
    step = max(1, ENCODE_VALUES // max(1, t * ix.features))
    threshold = float(ix.attrs.get("threshold", 0.0))
    for a in range(0, len(order), step):
        places = order[a : a + step]
        latents = ix.encode(take_rows(arr, sample[places]))  # (n, T, F)
        pooled[places] = latents.max(axis=1)
        counts = places < counted  # the first rows of the sample count co-occurrence (in any order: a sum)
        cooc.add((latents[counts] > threshold).reshape(-1, ix.features))
    return pooled, cooc, counted


def _atlas(ix: FeatureIndex, pooled: np.ndarray, cooc: Cooccurrence, m: int, seed: int,
           method: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The atlas's arrays and record, from the pass's pooled values and firing."""
    arrays: dict[str, np.ndarray] = {}
    dic = ix.dictionary
    w_dec = dic.w_dec if dic is not None else None
    measures = []
    if w_dec is not None:
        arrays["decoder.features"], arrays["decoder.scores"] = decoder_cosine(w_dec, m)
        measures.append("decoder")
    features, scores, counts = cooc.neighbours(m)
    arrays.update({"cooccurrence.features": features, "cooccurrence.scores": scores, "cooccurrence.counts": counts})
    arrays["correlation.features"], arrays["correlation.scores"] = correlation(pooled, m)
    measures += ["cooccurrence", "correlation"]
    vectors, source = _map_vectors(w_dec, pooled)
    coords, made = feature_map(vectors, seed, method)
    arrays["map"] = coords
    return arrays, {"measures": measures, "neighbours": m, "map": {**made, "source": source},
                    "threshold": float(ix.attrs.get("threshold", 0.0))}


def _map_vectors(w_dec: np.ndarray | None, pooled: np.ndarray) -> tuple[np.ndarray, str]:
    """What places each feature on the map: its decoder direction (unit length), else its pooled values over the
    sample (centred, unit length: features that rise and fall together lie together)."""
    if w_dec is not None:
        w = np.asarray(w_dec, np.float64)
        return w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-12), "decoder"
    z = np.asarray(pooled, np.float64).T
    z = z - z.mean(axis=1, keepdims=True)
    return z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12), "activations"
