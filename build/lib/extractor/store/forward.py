"""A model's forward as a store records it: what the captured layers give on the probe's fixed input, summarised.

The class and the state dict do not say what a model computes: a factory that swaps ReLU for GELU keeps both.
The worker's probe runs one fixed image (seeded mid-grey noise, the one its determinism check runs) through the
hooked model; :func:`forward_summary` keeps, per capture, the root mean square of the values it stored and their
projections on a few seeded random directions (each divided by sqrt(n), so on the values' scale). The store
records them as ``model.forward_summary``; a resume and ``output.reuse`` take a model as the same one only when
:func:`forward_differences` finds no capture whose summary moved.

Why summaries with a tolerance, not a hash: the same model's values differ in their last bits on another device,
thread count or kernel (TF32, a half-precision autocast), and any rounding grid has values on its edges, so a
hash of rounded values would refuse a legitimate resume elsewhere. Float rounding moves the summary by about
the values' relative error (1e-6 in float32, 1e-3 to 1e-2 in half precision); another forward moves it by tens
of percent. Stores made before the summary (no such field) are compared as before: by class and weights.
Needs only numpy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["forward_summary", "forward_differences", "FORWARD_TOLERANCE"]

DIRECTIONS = 8  # random projections per capture, besides its root mean square
SEED = 37
FORWARD_TOLERANCE = 0.05  # a summary that moved by more than this share of its norm is another forward


def forward_summary(values: Mapping[str, Any]) -> dict[str, list[float]]:
    """Per capture key, the values of one image as float numbers (any shape): ``[rms, p_1 .. p_8]``, where
    ``p_j`` is their dot product with a seeded standard normal vector over sqrt(n); NaN and Inf count as 0."""
    out: dict[str, list[float]] = {}
    for key in sorted(values):
        v = np.nan_to_num(np.asarray(values[key], dtype=np.float64).reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
        scale = math.sqrt(max(v.size, 1))
        rng = np.random.default_rng(SEED)
        summary = [math.sqrt(float(v @ v)) / scale] + [float(rng.standard_normal(v.size) @ v) / scale
                                                      for _ in range(DIRECTIONS)]
        out[key] = [float(f"{x:.6g}") for x in summary]
    return out


def forward_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The captures whose forward summary differs between two stores' ``model`` records beyond float rounding;
    none when either lacks summaries (a store made before them) or for a capture only one of them has."""
    a, b = old.get("forward_summary"), new.get("forward_summary")
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        return []
    differ = []
    for key in sorted(set(a) & set(b)):
        x, y = np.asarray(a[key], dtype=np.float64), np.asarray(b[key], dtype=np.float64)
        if x.shape != y.shape:
            differ.append(key)
            continue
        gap = float(np.linalg.norm(x - y))
        if gap > FORWARD_TOLERANCE * max(float(np.linalg.norm(x)), float(np.linalg.norm(y))):
            differ.append(key)
    return differ
