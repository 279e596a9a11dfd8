"""A block of a write-time feature index computed where the activations are (issue 42): in torch, on the tensor's
device, sending the host only what it adds to the index (:class:`~extractor.index.state.BlockPart`: counts,
sums, and the few candidates that may take a slot), merged there into the shard's state as ``IndexState.update``
would make it of the same rows. The same code runs on the CPU.

Every rule is the numpy state's (the reference), restated in int64 arithmetic: bins of the same float32 edges,
top keys (the pooled value's ordered bits, then the lower row) and sample keys (a 32-bit pair hash of :mod:`.keys`'s
constants, then the lower row) with the sign bit flipped, so that signed order is the host's unsigned order;
``tests/index/test_kernels.py`` holds the two equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .bins import HIST_BINS, bin_tables
from .feed import IndexFeed
from .keys import FEATURE_ADD, FEATURE_MUL, FMIX_MUL, PAIR_MUL, ROW_MUL
from .state import EXAMPLES, BlockPart

__all__ = ["block_part", "index_on_device", "serves"]

# A worker on the CPU indexes its rows on the writer threads instead (numpy, IndexState.update): this pass in torch
# took 1.8x the CPU there (measured on 2 cores: torch's CPU gathers and bucketize against numpy's tables), and it
# would run on the thread that feeds the model. Tests set it to run this module's path on a CPU.
ON_CPU = False


def serves(tensor: torch.Tensor) -> bool:
    """Whether a capture's tensor is indexed here, where it is (an accelerator's), rather than on the host."""
    return tensor.device.type != "cpu" or ON_CPU

_SIGN = -(1 << 63)  # int64 with only the sign bit: x ^ _SIGN maps unsigned order to signed order
_LOW32 = 0xFFFFFFFF
_EDGES: dict[torch.device, torch.Tensor] = {}


def _bins(x: torch.Tensor) -> torch.Tensor:
    """bins._bins in torch: int64 bins, HIST_BINS (not counted) for values <= 0 and NaN. A binary search
    over the same float32 edges (``v >= edge`` in float32 is the host's ``v >= 10**edge``), below the first and above
    the last in the first and last bin (measured on the CPU: 2.2x faster than the host's table of top bits in torch,
    whose gathers torch does slowly)."""
    if x.device not in _EDGES:
        _EDGES[x.device] = torch.from_numpy(bin_tables()[2]).to(x.device)
    at = (torch.bucketize(x, _EDGES[x.device], right=True) - 1).clamp_(0, HIST_BINS - 1)
    return torch.where(x > 0, at, HIST_BINS)


def _fired_bins(x: torch.Tensor, fire: torch.Tensor, exact: bool) -> torch.Tensor:
    bins = _bins(x)
    if exact:
        return bins
    return torch.where(fire, torch.where(bins == HIST_BINS, 0, bins), HIST_BINS)


def _counts(bins: torch.Tensor) -> np.ndarray:
    """(F, HIST_BINS) counts of bins (..., F), HIST_BINS left out."""
    f = bins.shape[-1]
    cells = bins + torch.arange(f, device=bins.device) * (HIST_BINS + 1)
    counts = torch.bincount(cells.reshape(-1), minlength=f * (HIST_BINS + 1))
    return counts.view(f, HIST_BINS + 1)[:, :HIST_BINS].cpu().numpy()


def _firing(flat: torch.Tensor, fire: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per feature of ``flat`` (N, F): the count (F,), float64 sum (F,) and (F, HIST_BINS) bin counts of its firing
    entries, listed first (an SAE's latents: few fire; measured on the CPU, 1.7x faster than dense reductions). A
    firing value is above a threshold >= 0: it has a bin."""
    f = flat.shape[1]
    at = torch.nonzero(fire.reshape(-1)).squeeze(1)
    feature, values = at % f, flat.reshape(-1)[at]
    counts = torch.bincount(feature, minlength=f)
    sums = torch.bincount(feature, weights=values.double(), minlength=f)
    bins = torch.bincount(feature * HIST_BINS + _bins(values), minlength=f * HIST_BINS).view(f, HIST_BINS)
    return counts.cpu().numpy(), sums.cpu().numpy(), bins.cpu().numpy()


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """keys._fmix32 on int64 holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * FMIX_MUL[0]) & _LOW32
    x = x ^ (x >> 13)
    x = (x * FMIX_MUL[1]) & _LOW32
    return x ^ (x >> 16)


def _hashes(rows: torch.Tensor, f: int) -> torch.Tensor:
    """keys.sample_hashes: (n, F) int64 holding uint32."""
    a = _fmix32(((rows & _LOW32) * ROW_MUL) & _LOW32)
    b = _fmix32((torch.arange(f, device=rows.device) * FEATURE_MUL + FEATURE_ADD) & _LOW32)
    x = a[:, None] ^ b[None, :]
    x = (x * PAIR_MUL) & _LOW32
    return x ^ (x >> 16)


def _ordered(values: torch.Tensor) -> torch.Tensor:
    """keys._ordered: float32 -> int64 holding the uint32 whose order is the values'."""
    bits = values.view(torch.int32).to(torch.int64) & _LOW32
    return torch.where(bits >= 0x80000000, (~bits) & _LOW32, bits | 0x80000000)


def _host_keys(signed: torch.Tensor) -> np.ndarray:
    """Signed-order int64 keys -> the host's uint64 keys."""
    return (signed ^ _SIGN).cpu().numpy().view(np.uint64)


def _signed(host_keys: np.ndarray, device: torch.device) -> torch.Tensor:
    """The host's uint64 keys in signed order, on ``device``."""
    return torch.from_numpy(host_keys.view(np.int64) ^ np.int64(_SIGN)).to(device)


def _top(x: torch.Tensor, rows: torch.Tensor, pooled: torch.Tensor, fires: torch.Tensor, k: int,
         floor: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per feature the block's k best firing rows above its ``floor`` (signed keys; None: none): features, keys,
    values at every position."""
    n, _t, f = x.shape
    keys = (((_ordered(pooled) - (1 << 31)) << 32) | (_LOW32 - rows[:, None]))  # (n, F) signed order
    if floor is not None:
        fires = fires & (keys > floor)
    keys = torch.where(fires, keys, torch.iinfo(torch.int64).min)
    best, at = torch.topk(keys, min(k, n), dim=0)  # (k', F)
    feature = torch.arange(f, device=x.device).expand_as(at)
    keep = best != torch.iinfo(torch.int64).min
    at, feature, best = at[keep], feature[keep], best[keep]
    tokens = x[at, :, feature]  # (m, T)
    return feature.cpu().numpy(), _host_keys(best), tokens.float().cpu().numpy()


def _examples(rows: torch.Tensor, pooled: torch.Tensor, bins: torch.Tensor,
              floor: torch.Tensor | None) -> tuple[np.ndarray, ...]:
    """Per row bin (feature x HIST_BINS + bin) the block's EXAMPLES firing pairs of the smallest hashes, of those
    above the bin's ``floor`` (signed keys; None: none)."""
    _n, f = pooled.shape
    row, feature = torch.nonzero(bins != HIST_BINS, as_tuple=True)
    h = _hashes(rows, f)[row, feature]
    cell = feature * HIST_BINS + bins[row, feature]
    keys = ~((h << 32) | rows[row])  # keys.sample_keys, as int64 bits
    if floor is not None:
        fit = (keys ^ _SIGN) > floor[cell]
        cell, row, feature, h, keys = cell[fit], row[fit], feature[fit], h[fit], keys[fit]
    if not len(row):
        empty = np.zeros(0, np.int64)
        return empty, empty.view(np.uint64), np.zeros(0, np.float32)
    order = torch.argsort((cell << 32) | h)  # by cell, then hash: unique within a feature (the hash is a bijection)
    cell, row, feature, keys = cell[order], row[order], feature[order], keys[order]
    first = torch.ones_like(cell, dtype=torch.bool)
    first[1:] = cell[1:] != cell[:-1]
    place = torch.arange(len(cell), device=cell.device)
    start = torch.cummax(torch.where(first, place, 0), dim=0).values
    keep = place - start < EXAMPLES
    cell, row, feature, keys = cell[keep], row[keep], feature[keep], keys[keep]
    return cell.cpu().numpy(), keys.cpu().numpy().view(np.uint64), pooled[row, feature].cpu().numpy()


def block_part(acts: torch.Tensor, rows: Any, k: int, pool: str, threshold: float,
               floors: tuple[np.ndarray, np.ndarray] | None = None) -> BlockPart:
    """The part of a block ``acts`` (n, T, F), any float dtype on any device, of store rows ``rows`` (n,), that
    ``IndexState(F, T, k, pool, threshold).add_part`` merges: what ``update`` makes of the same rows (sums to
    float64 rounding in another order). ``floors``: the state's ``top.floor`` and ``examples.floor`` (or lower
    ones): candidates at or below them, which ``add_part`` would drop, are not sent to the host."""
    with torch.inference_mode():
        x = acts.float().contiguous()
        n, t, f = x.shape
        rows_t = torch.as_tensor(np.asarray(rows, np.int64), device=x.device)
        fire = x > threshold
        peak = x.amax(dim=1) if t > 1 else x[:, 0]
        if t == 1:
            pooled, fires = peak, fire[:, 0]
        elif pool == "max":
            pooled, fires = peak, peak > threshold
        else:
            pooled = (x.double().sum(dim=1) / t).float()
            fires = fire.any(dim=1) & ~torch.isnan(pooled)
        row_bins = _fired_bins(pooled, fires, threshold == 0 and (pool == "max" or t == 1))
        no_nan = torch.where(torch.isnan(peak), -torch.inf, peak)
        top_floor, example_floor = (None, None) if floors is None else (_signed(a, x.device) for a in floors)
        top_features, top_keys, top_tokens = _top(x, rows_t, pooled, fires, k, top_floor)
        cells, keys, values = _examples(rows_t, pooled, row_bins, example_floor)
        fire_tokens, sum_active, histogram = _firing(x.view(n * t, f), fire.view(n * t, f))
        return BlockPart(
            rows=n, fire_tokens=fire_tokens, fire_rows=fires.sum(dim=0).cpu().numpy(), sum_active=sum_active,
            max_value=no_nan.amax(dim=0).cpu().numpy() if n else np.full(f, -np.inf, np.float32), histogram=histogram,
            histogram_rows=_counts(row_bins), top_features=top_features, top_keys=top_keys, top_tokens=top_tokens,
            example_cells=cells, example_keys=keys, example_values=values)


def index_on_device(feed: IndexFeed, values: torch.Tensor, rows: np.ndarray, lock: Any) -> None:
    """Add a forwarded batch's capture ``values`` (n, *shape) as the device holds them, of store rows ``rows`` (n,),
    to ``feed``'s state: its blocks (the capture's layout, the dictionary's latents) made and summed on the device,
    each a small :class:`BlockPart` (only candidates above the state's floors) merged on the host under ``lock``
    (the writer threads add rows the device did not compute)."""
    s = feed.state
    with torch.inference_mode():
        for acts, block_rows in feed.blocks(values.detach(), rows):
            with lock:
                floors = s.top.floor.copy(), s.examples.floor.copy()
            part = block_part(acts, block_rows, s.k, s.pool, s.threshold, floors)
            with lock:
                s.add_part(part)
