"""A model's forward as a store records it (``model.forward``, a :class:`ForwardRecord`): what the captured
layers give on the probe's fixed input, and within what two of its forwards are one.

The class and the state dict do not say what a model computes: a factory that swaps every ReLU for a
LeakyReLU(0.01) or a ReLU6 keeps both, and moves the values by 1-3%. The worker's probe runs one fixed image
(seeded mid-grey noise, the one its determinism check runs) through the hooked model and records, per capture:

- ``digest``: a hash of the values' bits, with the ``context`` they were computed in (torch build, device and
  its libraries, CPU instruction set and threads, compute dtype: :func:`extractor.model.rounding.forward_context`).
  Where two stores' contexts are equal, their forwards are one only when every digest is equal: any other
  forward is told apart, down to a change of one bit. None where two forwards of the image in one process
  already differed in their bits (a kernel that sums in a random order): then only the summary below is compared.
- ``summary``: the values' root mean square and their projections on 8 seeded random directions (each over
  sqrt(n), so on the values' scale).
- ``noise``: how far the summary moved (relatively) when the probe ran again with every layer's inputs and
  outputs moved by the arithmetic's unit roundoff (:func:`extractor.model.rounding.rounding_noise`), at least
  that roundoff: the model's own sensitivity to rounding, which another device or thread count shows.

In other contexts (a resume on a GPU of a store made on a CPU, another thread count), two forwards are one
when their summaries differ by at most :data:`NOISE_FACTOR` times the larger noise of the two. The factor was
measured: on resnet18, ViT-B/16, ConvNeXt-T and a small CNN, the gap between a float32 forward and the exact
(float64) one was 0.2 to 2.9 times the noise measured this way, and between bfloat16 and float32 0.3 to 5.3
times; another device's forward is two such gaps apart at most. A float32 forward on a CPU is then compared
within about 1e-5 of its values' norm; TF32 (cuDNN's default on a GPU) or half precision within 1e-2 to 1e-1.
A store made before these records (no ``forward`` in its model record) is compared by class and weights only.
Needs only numpy.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any, TypedDict

import numpy as np

__all__ = ["NOISE_FACTOR", "ForwardRecord", "forward_differences", "forward_record"]

DIRECTIONS = 8  # random projections per capture, besides its root mean square
SEED = 37
NOISE_FACTOR = 25.0  # two forwards in other contexts are one within this many times their rounding noise
UNMEASURED = 0.05  # the tolerance where a store's noise could not be measured (a forward that refused the hooks)


class ForwardRecord(TypedDict):
    """The captured layers' values on the probe's fixed input, as the store's ``model.forward`` keeps them."""

    summary: dict[str, list[float]]  # per capture: [rms, p_1 .. p_8] of its values
    digest: dict[str, str] | None  # per capture: sha256 of its values' dtype, shape and bytes; None: not reproducible
    noise: dict[str, float] | None  # per capture: relative move of its summary under rounding noise; None: unmeasured
    context: dict[str, Any]  # what the digests were computed under (extractor.model.rounding.forward_context)


def _summary(values: Any) -> list[float]:
    """``[rms, p_1 .. p_8]`` of one capture's values (any shape), where ``p_j`` is their dot product with a seeded
    standard normal vector over sqrt(n); NaN and Inf count as 0."""
    v = np.nan_to_num(np.asarray(values, dtype=np.float64).reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
    scale = math.sqrt(max(v.size, 1))
    rng = np.random.default_rng(SEED)
    return [math.sqrt(float(v @ v)) / scale] + [float(rng.standard_normal(v.size) @ v) / scale
                                                for _ in range(DIRECTIONS)]


def _digest(values: np.ndarray) -> str:
    v = np.ascontiguousarray(values)
    return hashlib.sha256(f"{v.dtype.str}{v.shape}".encode() + v.tobytes()).hexdigest()


def _gap(a: Any, b: Any) -> float:
    """How far apart two summaries are, relative to the larger one's norm (0 for two zero ones)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        return math.inf
    norm = max(float(np.linalg.norm(x)), float(np.linalg.norm(y)))
    return float(np.linalg.norm(x - y)) / norm if norm else 0.0


def forward_record(values: Mapping[str, np.ndarray], perturbed: Mapping[str, np.ndarray] | None,
                   context: Mapping[str, Any], reproducible: bool) -> ForwardRecord:
    """The record of the captures' ``values`` on the fixed input (host arrays as captured), computed in ``context``
    (its ``rounding``: the arithmetic's unit roundoff); ``perturbed``: the same forward under rounding noise (None:
    it could not run); ``reproducible``: a second forward gave the same bits."""
    summary = {key: _summary(values[key]) for key in sorted(values)}
    noise = None
    if perturbed is not None:
        noise = {key: max(_gap(summary[key], _summary(perturbed[key])), float(context["rounding"]))
                 for key in summary}
    digest = {key: _digest(values[key]) for key in summary} if reproducible else None
    return ForwardRecord(summary=summary, digest=digest, noise=noise, context=dict(context))


def _tolerance(a: Mapping[str, Any], b: Mapping[str, Any], key: str) -> float:
    """How far the summaries of capture ``key`` may be apart in two contexts: NOISE_FACTOR times the larger noise."""
    noises = [r["noise"].get(key) if isinstance(r.get("noise"), Mapping) else None for r in (a, b)]
    if any(n is None for n in noises):
        return UNMEASURED
    return NOISE_FACTOR * max(float(n) for n in noises if n is not None)


def forward_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The captures whose forward differs between two stores' ``model`` records: by their digests where both were
    computed in one context (and each was reproducible), else by their summaries beyond the rounding noise. None
    when either lacks the record (a store made before it); a capture only one of them has is not compared."""
    a, b = old.get("forward"), new.get("forward")
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        return []
    exact = a.get("context") == b.get("context") and bool(a.get("digest")) and bool(b.get("digest"))
    differ = []
    for key in sorted(set(a.get("summary") or {}) & set(b.get("summary") or {})):
        if exact and key in a["digest"] and key in b["digest"]:
            if a["digest"][key] != b["digest"][key]:
                differ.append(key)
        elif _gap(a["summary"][key], b["summary"][key]) > _tolerance(a, b, key):
            differ.append(key)
    return differ
