"""What a hook does to a captured tensor: select an element, reduce it on the device, sample tokens; and the
layouts (channels first or last) and dimension names of what is stored."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from ..errors import LayerError
from ..store import rank_keys
from .targets import ROOT, Target


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)} ({', '.join(_describe(v) for v in value[:4])})"
    if isinstance(value, dict):
        return f"dict with keys {list(value)[:8]}"
    return type(value).__name__


def select(value: Any, index: int | str | None, where: str) -> torch.Tensor:
    """Take the tensor a capture asks for from a module's output or input."""
    if index is None:
        if isinstance(value, torch.Tensor):
            return value
        raise LayerError(f"{where} gives a {_describe(value)}; set index (an int for tuples, a key for dicts)")
    try:
        if isinstance(value, dict):  # noqa: SIM114 - two types, and mypy tells them apart this way
            item = value[index]
        elif isinstance(value, (tuple, list)) and isinstance(index, int):
            item = value[index]
        elif isinstance(index, str) and (dataclasses.is_dataclass(value) or hasattr(value, index)):
            item = getattr(value, index)
        else:
            raise LayerError(f"{where} gives a {_describe(value)}; index {index!r} does not apply to it")
    except (KeyError, IndexError):
        raise LayerError(f"{where} gives a {_describe(value)}; it has no element {index!r}") from None
    if item is None:
        raise LayerError(f"{where}[{index!r}] is None: the model did not compute it on this call. Attention "
                         "weights of a Hugging Face model need model.forward_kwargs: {output_attentions: true} and "
                         "model.kwargs: {_attn_implementation: eager}")
    if not isinstance(item, torch.Tensor):
        raise LayerError(f"{where}[{index!r}] is a {_describe(item)}, not a tensor")
    return item


def channels_last(layout: str) -> bool:
    """Whether a (batch, ...) 4-D output of this (decided) layout holds its channels last, (B, H, W, C)."""
    return layout == "nhwc"


def reduce_tensor(t: torch.Tensor, how: str, where: str, layout: str = "nchw",
                  patches: slice | None = None) -> torch.Tensor:
    """Reduce a batch-first tensor on its device. Layouts: (B,C,H,W...) maps, (B,H,W,C) ones
    (``nhwc``), (B,heads,query,key) attention, and (B,T,D) tokens (``patches``: only those positions)."""
    if patches is not None:
        if t.ndim != 3:
            raise LayerError(f"{where} is {tuple(t.shape)}; drop_prefix needs (batch, tokens, features)")
        t = t[:, patches]
    if how == "none":
        return t
    if how == "flatten":
        return t.flatten(1)
    if t.ndim < 3:
        raise LayerError(f"{where} is {tuple(t.shape)} (batch, features) already; use reduce: none")
    if how == "cls":
        if t.ndim != 3:
            raise LayerError(f"{where} is {tuple(t.shape)}; reduce: cls needs (batch, tokens, features)")
        return t[:, 0]
    if t.ndim == 3:
        dims: tuple[int, ...] = (1,)  # tokens
    elif layout == "attention":
        raise LayerError(f"{where} holds attention probabilities (batch, head, query, key); reduce: {how} over them "
                         "is not defined: use reduce: none or flatten")
    elif channels_last(layout) and t.ndim == 4:
        dims = (1, 2)  # spatial positions of a channels-last map
    else:
        dims = tuple(range(2, t.ndim))  # spatial positions
    if how == "mean":
        return t.mean(dim=dims, dtype=torch.float32)  # accumulates in float32 without a float32 copy of the map
    if how == "max":
        return t.amax(dim=dims)
    raise LayerError(f"{where}: unknown reduce {how!r}")


def sample_positions(seed: int, rows: torch.Tensor, n_tokens: int, k: int) -> torch.Tensor:
    """On the rows' device: (B, k) int64, the k tokens each row keeps, in sequence order: the same integers as
    ``extractor.store.sampling.sample_positions`` (a hash of seed, the row's draw key and token, ranked)."""
    tokens = torch.arange(n_tokens, device=rows.device, dtype=torch.int64)[None, :]
    keys = rank_keys(seed, rows.to(torch.int64)[:, None], tokens, n_tokens)
    order = torch.argsort(keys, dim=1)[:, :k]  # the keys are distinct: no tie to break
    return order.sort(dim=1).values


def _sample(t: Target, tokens: torch.Tensor, draws: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens``: of (B, T, D) tokens, ``sample`` patch tokens per row, with the tokens before the patches
    kept in front of them and those after the patches after them (unless drop_prefix left them out); and their
    positions in the layer's sequence (B, kept). Before the probe decided the layer's tokens: all of them."""
    if tokens.ndim != 3:
        raise LayerError(f"{where} is {tuple(tokens.shape)}, not a token sequence (batch, tokens, features): "
                         "sample_tokens samples tokens; a 4-D map (a CNN's) has none. Capture a layer that gives "
                         "tokens, or reduce the map (reduce: mean, project)")
    layer = t.tokens
    if layer is None:  # the probe's first look (it refuses a layer whose patches are not known)
        return tokens, torch.arange(tokens.shape[1], device=tokens.device).expand(len(tokens), -1)
    before, after = (0, 0) if t.drop_prefix else (layer.before, layer.after)
    if t.sample > layer.patches:
        raise LayerError(f"{where}: sample_tokens {t.sample} is more than its {layer.patches} patch tokens; set at "
                         f"most {layer.patches}, or store them all (no sample_tokens)")
    arange = partial(torch.arange, device=tokens.device, dtype=torch.int64)
    picked = sample_positions(t.seed, draws, layer.patches, t.sample) + before
    index = torch.cat([arange(before).expand(len(tokens), -1), picked,
                       arange(before + layer.patches, before + layer.patches + after).expand(len(tokens), -1)], dim=1)
    kept = tokens.gather(1, index[:, :, None].expand(-1, -1, tokens.shape[2]))
    positions = index + (layer.before if t.drop_prefix else 0)  # in the layer's own sequence
    # stored as int16 where every position fits (a quarter of int64's bytes: 8.1 GB less in a 2 TB plan)
    return kept, positions.to(torch.int16) if layer.length <= POSITIONS_INT16 else positions


POSITIONS_INT16 = 1 << 15  # sequences up to this many tokens store their sampled positions as int16


def probabilities(t: torch.Tensor) -> bool:
    """Whether every row along the last dim is a probability distribution (attention weights)."""
    t = t.detach().float()
    return bool(t.numel()) and bool((t >= 0).all()) and bool(torch.allclose(t.sum(-1), torch.ones(()), atol=1e-3))


_NCHW_MODULES = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
                 nn.GroupNorm, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Upsample,
                 nn.Dropout2d, nn.LocalResponseNorm)
_LAST_DIM_MODULES = (nn.Linear, nn.LayerNorm)  # act on the last dim: features last (exact types; timm's


def decide_layout(module: nn.Module | None, shape: tuple[int, ...], probabilities_: bool | None,
                  other: tuple[int, ...] | None) -> str | None:
    """The layout of a 4-D output (``shape`` without the batch) from facts, or None when they do not
    decide: rows that are probability distributions (attention), the module's type, and which
    dims changed at another input size (``other``: the shape there; the spatial dims grow)."""
    if probabilities_:
        return "attention"
    if module is not None and isinstance(module, _NCHW_MODULES):
        return "nchw"
    if module is not None and type(module) in _LAST_DIM_MODULES:
        return "nhwc"
    return _grown_layout(shape, other) if other is not None and len(other) == len(shape) == 3 else None


def _grown_layout(shape: tuple[int, ...], other: tuple[int, ...]) -> str | None:
    """The layout the dims that grow at another input size say (``other``: the shape there), or None."""
    changed = tuple(i for i in range(3) if other[i] != shape[i])
    if changed == (1, 2):
        return "nchw"
    if changed == (0, 1):
        return "nhwc"
    if not changed and shape[1:] == (1, 1):  # pooled to one position at every size (HF's pooler_output)
        return "nchw"
    if not changed and shape[:2] == (1, 1):
        return "nhwc"
    return None


def _undecided(shape: tuple[int, ...], other: tuple[int, ...] | None) -> str:
    """Why the dims that grow at another input size do not decide a 4-D output's layout."""
    if other is None:
        return "the model does not run at another input size to see which dims grow"
    if tuple(other) == tuple(shape):
        return "it keeps this shape at another input size, so no dims grow to tell"
    return f"at another input size it gives {'x'.join(map(str, other))}: not the dims of a map"


def settle_layouts(targets: Sequence[Target], modules: dict[str, nn.Module], shapes: dict[str, tuple[int, ...]],
                   probabilities: dict[str, bool], shapes_elsewhere: Callable[[], dict[str, tuple[int, ...]]],
                   ) -> dict[str, str]:
    """The layout of each 4-D output left at ``layout: auto`` (``shapes``: per row, at the input size), from
    facts (:func:`decide_layout`): whether its rows are probability distributions (``probabilities``), its
    module's type, else which dims grow at another input size (``shapes_elsewhere()``, called at most once).
    Flattened, a 4-D output's layout changes nothing: ``nchw``. Refuses (LayerError) an output none decides."""
    auto = [t for t in targets if t.layout == "auto" and len(shapes.get(t.key, ())) == 3]
    layouts: dict[str, str] = {t.key: "nchw" for t in auto if t.reduce == "flatten" and t.what != "gradcam"}
    elsewhere: dict[str, tuple[int, ...]] | None = None
    for t in auto:
        if t.key in layouts:
            continue
        module = modules[t.layer] if t.layer else None
        layout = decide_layout(module, shapes[t.key], probabilities.get(t.key), None)
        if layout is None:
            elsewhere = shapes_elsewhere() if elsewhere is None else elsewhere
            layout = decide_layout(None, shapes[t.key], None, elsewhere.get(t.key))
        if layout is None:
            raise LayerError(
                f"capture[{t.capture}] {t.key}: layer {t.layer or ROOT!r} ({type(modules[t.layer]).__name__}) gives "
                f"{'x'.join(map(str, shapes[t.key]))} outputs whose layout extractor cannot tell (not a module "
                f"type it knows, and {_undecided(shapes[t.key], (elsewhere or {}).get(t.key))}); set "
                f"capture[{t.capture}].layout: nchw (channel, y, x), nhwc (y, x, channel) or attention "
                "(head, query, key)"
            )
        layouts[t.key] = layout
    return layouts


def contradicted_layouts(targets: Sequence[Target], modules: dict[str, nn.Module],
                         shapes: dict[str, tuple[int, ...]]) -> list[tuple[Target, str]]:
    """The 4-D outputs whose given layout their module's type contradicts, with the layout it gives."""
    out = []
    for t in targets:
        if t.layout != "auto" and len(shapes.get(t.key, ())) == 3:
            fact = decide_layout(modules[t.layer] if t.layer else None, shapes[t.key], None, None)
            if fact is not None and fact != t.layout:
                out.append((t, fact))
    return out


def reduced_otherwise(targets: Sequence[Target], layouts: dict[str, str]) -> bool:
    """Whether a decided layout reduces otherwise than the provisional ``nchw`` did (the blank runs again)."""
    return any(layout != "nchw" and (t.reduce in ("mean", "max") or t.what == "gradcam")
               for t in targets if (layout := layouts.get(t.key)) is not None)


def dim_names(key: str, original: tuple[int, ...], reduce: str, what: str = "output",
              layout: str = "nchw") -> list[str]:
    """Feature dimension names of a stored capture (without the leading ``row``)."""
    nd = len(original)  # feature dims, batch excluded
    if what == "gradcam":
        names = ["y", "x"]
    elif reduce == "flatten":
        names = ["feature"]
    elif reduce in ("mean", "max"):
        names = ["feature"] if nd == 2 else ["channel"]
    elif reduce == "cls":
        names = ["feature"]
    elif nd == 3 and layout == "attention":
        names = ["head", "query", "key"]
    elif nd == 3:
        names = ["y", "x", "channel"] if channels_last(layout) else ["channel", "y", "x"]
    elif nd == 2:
        names = ["token", "feature"]
    elif nd == 1:
        names = ["feature"]
    else:
        names = [f"dim{i + 1}" for i in range(nd)]
    return [f"{key}.{n}" for n in names]

