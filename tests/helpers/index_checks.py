"""Feature-index results computed by hand with numpy, and SAE dictionaries written for tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from extractor.index.bins import HIST_EDGES
from extractor.index.dictionary import DictionaryError
from extractor.index.state import QUANTILES

D_SAE = 48


def sae(seed: int = 0, d_in: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"W_enc": rng.standard_normal((d_in, D_SAE)).astype(np.float32) * 0.5,
            "b_enc": (rng.standard_normal(D_SAE) * 0.1 - 0.05).astype(np.float32),
            "b_dec": (rng.standard_normal(d_in) * 0.01).astype(np.float32),
            "W_dec": rng.standard_normal((D_SAE, d_in)).astype(np.float32)}


def saelens(folder: Path, tensors: dict[str, np.ndarray], **cfg) -> Path:
    """An SAE saved by hand as SAELens saves one: cfg.json and sae_weights.safetensors."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "sae_weights.safetensors"))
    d_in, d_sae = tensors["W_enc"].shape
    (folder / "cfg.json").write_text(json.dumps({"d_in": int(d_in), "d_sae": int(d_sae), "architecture": "standard",
                                                 "apply_b_dec_to_input": True, "normalize_activations": "none",
                                                 "hook_name": "blocks.3.hook_resid_post", **cfg}))
    return folder


def refused(call, *args, **kwargs) -> str:
    """The message of the DictionaryError ``call`` raises: one line."""
    with pytest.raises(DictionaryError) as err:
        call(*args, **kwargs)
    assert "\n" not in str(err.value)
    return str(err.value)


ARRAYS = ("top_rows", "top_values", "top_tokens", "density_tokens", "density_rows", "mean_active", "max_value",
          "histogram", "histogram_rows", "quantile_rows", "quantile_values", "dead")


def by_hand_top(pooled: np.ndarray, fires: np.ndarray, f: int, k: int) -> np.ndarray:
    """The rows where feature f fires, by pooled value descending, then the lower row: argsort of the column."""
    rows = np.flatnonzero(fires[:, f])
    return rows[np.lexsort((rows, -pooled[rows, f]))][:k]


def hist_by_hand(values: np.ndarray) -> np.ndarray:
    """numpy's histogram over the edges 10**HIST_EDGES, the values outside them counted in the end bins."""
    edges = 10.0**HIST_EDGES
    return np.histogram(np.clip(values.astype(np.float64), edges[0], np.nextafter(edges[-1], 0)), edges)[0]


def check_against_numpy(acts: np.ndarray, rows: np.ndarray, got, k: int, pool: str, threshold: float = 0.0) -> None:
    """Every array of an index ``got`` of ``acts`` (n, T, F) of store rows ``rows``, against numpy by hand."""
    n, t, f = acts.shape
    fire = acts > threshold
    pooled = acts.max(axis=1) if pool == "max" else acts.mean(axis=1, dtype=np.float64).astype(np.float32)
    fires = pooled > threshold if pool == "max" else fire.any(axis=1)
    np.testing.assert_array_equal(got.density_tokens, fire.sum(axis=(0, 1)) / (n * t))
    np.testing.assert_array_equal(got.density_rows, fires.sum(axis=0) / n)
    np.testing.assert_array_equal(got.dead, np.flatnonzero(~fire.any(axis=(0, 1))))
    np.testing.assert_array_equal(got.max_value, acts.max(axis=(0, 1)))
    for j in range(f):
        col = acts[:, :, j]
        if fire[:, :, j].any():
            assert got.mean_active[j] == pytest.approx(col[col > threshold].mean(dtype=np.float64), rel=1e-6)
        np.testing.assert_array_equal(got.histogram[j], hist_by_hand(col[col > threshold]))
        np.testing.assert_array_equal(got.histogram_rows[j], hist_by_hand(np.maximum(pooled[fires[:, j], j], 1e-30)))
        top = by_hand_top(pooled, fires, j, k)
        np.testing.assert_array_equal(got.top_rows[j, : len(top)], rows[top])
        assert (got.top_rows[j, len(top) :] == -1).all()
        np.testing.assert_array_equal(got.top_values[j, : len(top)], pooled[top, j])
        np.testing.assert_array_equal(got.top_tokens[j, : len(top)], col[top])  # the heatmaps' values
        q_rows, q_values = got.quantile_rows[j], got.quantile_values[j]
        kept = q_rows >= 0
        at = np.searchsorted(rows, q_rows[kept])
        assert fires[at, j].all() and len(set(q_rows[kept].tolist())) == kept.sum()  # firing rows, each once
        np.testing.assert_array_equal(q_values[kept], pooled[at, j])
        lows = [v[r >= 0].min() for r, v in zip(q_rows, q_values, strict=True) if (r >= 0).any()]
        assert lows == sorted(lows)  # groups from the lowest values up
    assert got.quantile_rows.shape[1] == QUANTILES
