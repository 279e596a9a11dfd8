"""Hooks on target layers: resolve selections, select elements, reduce on device.

A :class:`Capturer` registers one hook per target for the life of a ``with`` block and
always removes them (also when a forward raises); the model's train/eval mode is restored.
Captured tensors are detached copies or reductions: nothing the model computes afterwards
(an in-place ReLU, say) changes them, and the hooks never change what the model computes.
Once every target has been captured the forward is stopped: layers after the deepest
target never run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import LayerError
from ..spec import CaptureSpec
from ..store.sampling import projection_matrix, rank_keys

__all__ = ["Target", "resolve_targets", "Capturer", "RESERVED_KEYS"]

RESERVED_KEYS = frozenset({"ids", "paths", "labels", "status", "errors", "shard_done", "shard_stats", "stats_sums",
                           "byte_offset", "byte_size", "lease", "target", "target_score", "digest", "fingerprint"})
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Target:
    """One resolved capture: a module, what to take from it and how to store it."""

    key: str  # array name in the store
    layer: str  # module name in model.named_modules()
    what: str  # "output" or "input"
    index: int | str | None
    reduce: str
    dtype: str
    capture: int  # position in spec.capture (for error messages)
    target: int | str | None = None  # gradient captures: predicted, label or a class index
    size: str = "layer"  # gradcam: layer or input resolution
    layout: str = "auto"  # a 4-D output's dims: nchw, nhwc, attention, or auto (decided by the worker's probe)
    drop_prefix: int = 0  # token sequences: leading tokens (CLS, registers) left out
    sample: int = 0  # sample_tokens: patch tokens kept per image (0: all)
    keep: int = 0  # with sample: prefix tokens kept in front of the sampled ones
    project: int = 0  # project: features after the random projection (0: none)
    projection: str = "gaussian"
    seed: int = 0

    @property
    def gradient(self) -> bool:
        return self.what in ("grad_output", "gradcam")


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Module-name globs: ``*`` and ``?`` stay inside one dotted name part, ``**`` crosses parts,
    ``[1-4]`` is a character class. ``layer4.*.conv2`` matches ``layer4.0.conv2``, not deeper."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^.]*")
        elif c == "?":
            out.append("[^.]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


ROOT = "(model)"  # how a capture names the model's own output (what its forward or model.call returns)
_SUFFIX = {"output": "", "input": ".input", "grad_output": ".grad", "gradcam": ".gradcam"}


def _no_such_layer(pattern: str, names: Sequence[str], where: str, hint: str) -> LayerError:
    close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.4)
    found = f" Closest: {', '.join(close)}." if close else ""
    return LayerError(f"{where}.layer {pattern!r} matches no module of the model.{found} "
                      f"List the layers with `{hint}`.")


def _layers_of(c: CaptureSpec, names: Sequence[str], where: str, hint: str) -> list[str]:
    """The module names one capture's ``layer`` names: the model itself, a glob's matches, or one name."""
    if c.layer in ("", ROOT):
        layers = [""]
    elif _is_glob(c.layer):
        rx = glob_to_regex(c.layer)
        layers = [n for n in names if rx.match(n)]
    else:
        layers = [n for n in names if n == c.layer]
    if not layers:
        raise _no_such_layer(c.layer, names, where, hint)
    if c.key and "{" not in c.key and len(layers) > 1:
        more = ", ..." if len(layers) > 4 else ""
        raise LayerError(
            f"{where}.key {c.key!r} names one array but {c.layer!r} matches {len(layers)} layers "
            f"({', '.join(layers[:4])}{more}); drop key, name one layer, or make it a template such as '{{layer}}.cls'"
        )
    if layers == [""] and c.gradient:
        raise LayerError(f"{where}: {c.what} of {ROOT} (the model's output) is not supported; name a layer")
    return layers


def _prefix_to_drop(c: CaptureSpec, prefix_tokens: int | None, where: str) -> int:
    if not c.drop_prefix:
        return 0
    if prefix_tokens is None:
        raise LayerError(f"{where}.drop_prefix: how many prefix tokens (CLS, registers) this model has is not "
                         "known; set model.prefix_tokens")
    return prefix_tokens


UNKNOWN_PREFIX = -1  # Target.keep of a sampling capture whose model's prefix-token count is not known


def _cutting(c: CaptureSpec, prefix_tokens: int | None, where: str) -> dict[str, Any]:
    """The Target fields of sample_tokens and project: with sampling, the prefix tokens kept in front (all of the
    model's, unless drop_prefix left them out: so their count must be known)."""
    keep = 0
    if c.sample_tokens and not c.drop_prefix:
        # an unknown count is asked for once the layer's output is seen to be a token sequence (_sample): a CNN's
        # 4-D map is refused as what it is first, not after a round of prefix settings that cannot help
        keep = UNKNOWN_PREFIX if prefix_tokens is None else prefix_tokens
    return {"sample": c.sample_tokens or 0, "keep": keep, "project": c.project or 0, "projection": c.projection,
            "seed": c.seed}


def _key(c: CaptureSpec, layer: str) -> str:
    """The array a capture of ``layer`` is stored as: its key (a template with ``{layer}``), else the layer's
    name with the suffix of what it takes (the model's output: the word)."""
    if c.key:
        return c.key.format(layer=layer or "model")
    return f"{layer}{_SUFFIX[c.what]}" if layer else c.what


def _check_keys(targets: Sequence[Target]) -> None:
    """Every array name once, none the store's own (nor a Grad-CAM map's per-row min and max)."""
    seen: dict[str, Target] = {}
    ranges = {f"{g.key}.range" for g in targets if g.what == "gradcam"}  # a Grad-CAM map's per-row min, max
    ranges |= {f"{g.key}.token_index" for g in targets if g.sample}  # a sampled capture's token positions
    for t in targets:
        if t.key in RESERVED_KEYS or t.key in ranges:
            raise LayerError(
                f"capture[{t.capture}]: key {t.key!r} is reserved by the store; set capture[{t.capture}].key"
            )
        if t.key in seen:
            raise LayerError(
                f"capture[{seen[t.key].capture}] and capture[{t.capture}] both write {t.key!r}; "
                f"set a distinct key on one of them"
            )
        seen[t.key] = t


def resolve_targets(model: nn.Module, captures: Sequence[CaptureSpec], hint: str = "extractor layers JOB.yaml",
                    prefix_tokens: int | None = None) -> list[Target]:
    """Resolve names and globs against ``model.named_modules()`` before any image is read.
    ``(model)`` (or ``""``) is the model itself; globs match named submodules only. ``hint`` is
    the command that lists this model's layers; ``prefix_tokens`` its CLS and register tokens
    (None: unknown), for ``drop_prefix``."""
    names = [n for n, _ in model.named_modules() if n]
    targets: list[Target] = []
    for i, c in enumerate(captures):
        where = f"capture[{i}]"
        layers = _layers_of(c, names, where, hint)
        drop = _prefix_to_drop(c, prefix_tokens, where)
        dtype = "float32" if c.what == "gradcam" else c.dtype
        target = c.score_target if c.gradient else None
        cutting = _cutting(c, prefix_tokens, where)
        targets += [Target(_key(c, layer), layer, c.what, c.index, c.reduce, dtype, i, target, c.size, c.layout, drop,
                           **cutting) for layer in layers]
    _check_keys(targets)
    return targets


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
        if isinstance(value, dict):
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


def reduce_tensor(t: torch.Tensor, how: str, where: str, layout: str = "nchw", drop_prefix: int = 0) -> torch.Tensor:
    """Reduce a batch-first tensor on its device. Layouts: (B,C,H,W...) maps, (B,H,W,C) ones
    (``nhwc``), (B,heads,query,key) attention, and (B,T,D) tokens (the first ``drop_prefix`` left out)."""
    if drop_prefix:
        if t.ndim != 3:
            raise LayerError(f"{where} is {tuple(t.shape)}; drop_prefix needs (batch, tokens, features)")
        t = t[:, drop_prefix:]
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
    """``sample_tokens``: of (B, T, D) tokens, the ``keep`` prefix ones and ``sample`` patch ones per row; and their
    positions in the layer's sequence (B, keep + sample)."""
    if tokens.ndim != 3:
        raise LayerError(f"{where} is {tuple(tokens.shape)}, not a token sequence (batch, tokens, features): "
                         "sample_tokens samples tokens; a 4-D map (a CNN's) has none. Capture a layer that gives "
                         "tokens, or reduce the map (reduce: mean, project)")
    if t.keep == UNKNOWN_PREFIX:
        raise LayerError(f"{where}: sample_tokens keeps the prefix tokens (CLS, registers) in front of the sampled "
                         "patch tokens, but how many this model has is not known; set model.prefix_tokens, or "
                         f"capture[{t.capture}].drop_prefix: true to sample patch tokens only")
    patches = tokens.shape[1] - t.keep
    if t.sample > patches:
        raise LayerError(f"{where}: sample_tokens {t.sample} is more than its {patches} patch tokens; set at most "
                         f"{patches}, or store them all (no sample_tokens)")
    picked = sample_positions(t.seed, draws, patches, t.sample) + t.keep
    prefix = torch.arange(t.keep, device=tokens.device, dtype=torch.int64).expand(len(tokens), -1)
    index = torch.cat([prefix, picked], dim=1)
    kept = tokens.gather(1, index[:, :, None].expand(-1, -1, tokens.shape[2]))
    return kept, index + t.drop_prefix  # positions in the layer's own sequence, a dropped prefix counted


def probabilities(t: torch.Tensor) -> bool:
    """Whether every row along the last dim is a probability distribution (attention weights)."""
    t = t.detach().float()
    return bool(t.numel()) and bool((t >= 0).all()) and bool(torch.allclose(t.sum(-1), torch.ones(()), atol=1e-3))


_NCHW_MODULES = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
                 nn.GroupNorm, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Upsample,
                 nn.Dropout2d, nn.LocalResponseNorm)
_LAST_DIM_MODULES = (nn.Linear, nn.LayerNorm)  # act on the last dim: features last (exact types; timm's
# LayerNorm2d subclasses LayerNorm but normalises channels first)


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
    if other is not None and len(other) == len(shape) == 3:
        changed = tuple(i for i in range(3) if other[i] != shape[i])
        if changed == (1, 2):
            return "nchw"
        if changed == (0, 1):
            return "nhwc"
    return None


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
                "type it knows, and the model does not run at another input size to see which dims grow); set "
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


class _StopForward(BaseException):
    """Raised by the last hook to skip the rest of the forward (BaseException: not swallowed)."""


def _logits(out: Any) -> torch.Tensor:
    """The (batch, classes) logits a model returned (a Hugging Face classifier's ``.logits`` too)."""
    if not isinstance(out, torch.Tensor) and isinstance(getattr(out, "logits", None), torch.Tensor):
        out = out.logits
    if not isinstance(out, torch.Tensor) or out.ndim != 2:
        raise LayerError(f"gradient captures need a model that returns (batch, classes) logits; it returned "
                         f"{_describe(out)}")
    return out


def _target_classes(which: int | str | None, logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Each row's class whose logit is differentiated: the predicted one, its label, or one class index."""
    k = logits.shape[1]
    if which == "predicted":
        return logits.detach().argmax(dim=1)
    if which == "label":
        if labels is None or (labels < 0).any() or (labels >= k).any():
            bad = "none" if labels is None else sorted({int(v) for v in labels.tolist() if not 0 <= v < k})
            raise LayerError(
                f"target: label needs every row's label to be one of the model's {k} outputs (0 to {k - 1}); "
                f"rows have {bad}. Use target: predicted or a class index"
            )
        return labels.to(logits.device)
    assert isinstance(which, int)
    if which >= k:
        raise LayerError(f"target {which} is not a class of a model with {k} outputs")
    return torch.full((len(logits),), which, device=logits.device, dtype=torch.long)


def _gradcam(t: Target, feature: torch.Tensor, grad: torch.Tensor, input_size: Sequence[int]) -> torch.Tensor:
    """Grad-CAM of one layer: the ReLU of its channels weighted by their mean gradients, (B, h, w), at the layer's
    resolution or resized (bilinear) to the input's."""
    if feature.ndim != 4:
        raise LayerError(f"gradcam needs a (batch, channels, y, x) map; {t.layer!r} gives {tuple(feature.shape)}")
    if channels_last(t.layout):  # (B, H, W, C) -> (B, C, H, W)
        feature, grad = feature.permute(0, 3, 1, 2), grad.permute(0, 3, 1, 2)
    weights = grad.float().mean(dim=(2, 3), keepdim=True)  # (B, C, 1, 1)
    cam = torch.relu((weights * feature.float()).sum(dim=1, keepdim=True))  # (B, 1, h, w)
    if t.size == "input":
        cam = torch.nn.functional.interpolate(cam, size=tuple(input_size), mode="bilinear", align_corners=False)
    return cam[:, 0].contiguous()


class Capturer:
    """Hooks on the targets for the duration of a ``with`` block.

    ``run(x)`` returns ``{key: tensor}`` on the model's device, reduced and cast to the
    stored dtype, each a detached copy. With ``stop_early`` the forward ends once every
    target has fired. Gradient targets (``grad_output``, ``gradcam``) make ``run`` a
    forward with autograd from the first such layer on, then one ``torch.autograd.grad``
    of the target scores: parameter ``.grad`` fields are never touched and no graph
    outlives the call.

    ``entry(x)`` is how the model is called (``model.call``, ``model.input``,
    ``model.forward_kwargs``; default ``model(x)``); ``forward`` is what ``run`` calls instead (a
    ``torch.compile`` of ``entry``, made after entering the block so that the hooks are traced
    into the graph); ``run(eager=True)`` calls ``entry``. A target on the model itself (layer
    ``""``) takes what ``entry`` returns, or its input ``x``.
    """

    def __init__(
        self,
        model: nn.Module,
        targets: Sequence[Target],
        stop_early: bool = True,
        forward: Callable[[torch.Tensor], Any] | None = None,
        entry: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        self.model = model
        self.forward = forward
        self.entry = entry if entry is not None else model
        self.targets = list(targets)
        self.auto_4d: dict[str, bool] = {}  # layout: auto targets seen 4-D at the last run -> probabilities?
        self.gradient = [t for t in self.targets if t.gradient]
        self.samples = any(t.sample for t in self.targets)  # sample_tokens: run() needs the images' draw keys
        self.logits: int | None = None  # the model's outputs (classes), seen by a gradient job's forward
        self.stop_early = stop_early and not self.gradient  # gradients need the logits
        self.values: dict[str, torch.Tensor] = {}
        self.anchors: dict[str, torch.Tensor] = {}
        self.original_shapes: dict[str, tuple[int, ...]] = {}
        self.kept = 0  # targets kept in this forward (values also holds their extras: KEY.token_index)
        self.draws: torch.Tensor | None = None  # the images' draw keys (sample_tokens: their content digests)
        self.matrices: dict[tuple[str, int], torch.Tensor] = {}  # project: (key, features in) -> its matrix here
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Capturer:
        modules = dict(self.model.named_modules())
        stack = contextlib.ExitStack()
        was_training = self.model.training
        stack.callback(self.model.train, was_training)
        try:
            self.model.eval()
            for i, t in enumerate(self.targets):
                if not t.layer:
                    continue  # the model's own output or input: taken in run()
                module = modules[t.layer]
                if t.gradient:
                    handle = module.register_forward_hook(self._anchor_hook(i))
                elif t.what == "output":
                    handle = module.register_forward_hook(self._output_hook(i))
                else:
                    handle = module.register_forward_pre_hook(self._input_hook(i), with_kwargs=True)
                stack.callback(handle.remove)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks and restore the model's mode (again: a no-op)."""
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        self.values.clear()
        self.anchors.clear()

    def set_layouts(self, layouts: dict[str, str]) -> None:
        """Replace ``layout: auto`` by what the probe decided, per key (the hooks read it at each call)."""
        self.targets = [dataclasses.replace(t, layout=layouts.get(t.key, t.layout)) for t in self.targets]
        self.gradient = [t for t in self.targets if t.gradient]
        self.samples = any(t.sample for t in self.targets)  # sample_tokens: run() needs the images' draw keys

    def _store(self, t: Target, tensor: torch.Tensor, where: str) -> None:
        layout = t.layout
        if layout == "auto" and tensor.ndim == 4:  # only before the probe decided: recorded, read as nchw
            self.auto_4d[t.key] = probabilities(tensor)
            layout = "nchw"
        reduced = reduce_tensor(tensor, t.reduce, where, layout, t.drop_prefix)
        if t.sample:
            draws = self.draws if self.draws is not None else torch.zeros(len(reduced), dtype=torch.int64)
            reduced, self.values[f"{t.key}.token_index"] = _sample(t, reduced, draws.to(reduced.device), where)
        if t.project:
            reduced = self._project(t, reduced, where)
        # a copy of views (none, flatten, cls): a later in-place op on the model's tensor must not change what we
        # keep; mean, max, sampled and projected tensors are new already
        copy = t.reduce not in ("mean", "max") and not (t.sample or t.project)
        self.values[t.key] = reduced.to(dtype=_DTYPES[t.dtype], memory_format=torch.contiguous_format, copy=copy)

    def _project(self, t: Target, x: torch.Tensor, where: str) -> torch.Tensor:
        """``project``: the last dimension times the seeded matrix (made once per width, on x's device), in float32."""
        if x.ndim not in (2, 3):
            raise LayerError(f"{where} stores {tuple(x.shape)}: project applies to a last dimension of features "
                             "((batch, features) or (batch, tokens, features)); pool the map first (reduce: mean)")
        width = x.shape[-1]
        if t.project > width:  # its matrix alone would be width x project floats (1.4 TiB at project: 10**9)
            raise LayerError(f"capture[{t.capture}] {where}: project: {t.project} is more than its {width} features; a "
                             f"random projection keeps fewer: set project to at most {width}, or leave it out to store "
                             "them all")
        matrix = self.matrices.get((t.key, width))
        if matrix is None or matrix.device != x.device:
            matrix = torch.from_numpy(projection_matrix(t.seed, width, t.project, t.projection)).to(x.device)
            self.matrices[(t.key, width)] = matrix
        with torch.autocast(x.device.type, enabled=False):  # float32 also in a job that runs in float16
            return x.float() @ matrix

    def _keep(self, t: Target, value: Any) -> None:
        if t.key in self.values:  # a module called twice in one forward: keep the first call
            return
        where = f"layer {t.layer or ROOT!r} {t.what}"
        tensor = select(value, t.index, where).detach()
        self.original_shapes[t.key] = tuple(tensor.shape[1:])
        self._store(t, tensor, where)
        self.kept += 1
        if self.stop_early and self.kept == len(self.targets):
            raise _StopForward

    def _output_hook(self, i: int):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            self._keep(self.targets[i], output)

        return hook

    def _input_hook(self, i: int):
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            t = self.targets[i]
            if isinstance(t.index, str):  # a keyword argument, or a key of the one positional argument (a dict)
                self._keep(t, kwargs if t.index in kwargs or len(args) != 1 else args[0])
            else:
                self._keep(t, args if t.index is not None else (args[0] if len(args) == 1 else args))

        return hook

    def _anchor_hook(self, i: int):
        """Keep the layer's output as the tensor to differentiate against; the model goes on
        with a copy, so an in-place op after the layer (``ReLU(inplace=True)``) cannot change it."""

        def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
            t = self.targets[i]
            if not isinstance(output, torch.Tensor):
                raise LayerError(
                    f"layer {t.layer!r} gives a {_describe(output)}; {t.what} needs a layer whose output is a tensor"
                )
            self.original_shapes.setdefault(t.key, tuple(output.shape[1:]))
            if t.layer in self.anchors:  # a second gradient target on this layer, or a second call
                return None
            anchor = output if output.requires_grad else output.detach().requires_grad_(True)
            self.anchors[t.layer] = anchor
            return anchor.clone()

        return hook

    def run(
        self, x: torch.Tensor, labels: torch.Tensor | None = None, eager: bool = False,
        draws: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """One forward pass (and one backward for gradient targets); captured tensors by key.

        With gradient targets the result also holds ``target`` (the class whose logit was
        differentiated, per image), ``target_score`` (that logit) and, per Grad-CAM key,
        ``KEY.range`` (per-image min and max of the map). ``labels`` are needed for
        ``target: label``; ``draws`` (the images' draw keys: their content digests as int64) for
        ``sample_tokens`` (default: all 0).
        """
        self.draws = draws
        if self._stack is None:
            raise RuntimeError("Capturer.run() must be called inside `with Capturer(...)`")
        self.values, self.anchors, self.original_shapes, self.kept = {}, {}, {}, 0
        forward = self.entry if eager or self.forward is None else self.forward
        try:
            if self.gradient:
                with torch.inference_mode(False), torch.enable_grad():
                    self._gradients(forward, x, labels)
            else:
                try:
                    self._root("input", x)
                    self._root("output", forward(x))
                except _StopForward:
                    pass
            missing = [t for t in self.targets if t.key not in self.values]
            if missing:
                raise LayerError(
                    "these layers never ran during the forward pass, so nothing was captured: "
                    + ", ".join(f"{t.layer} ({t.what})" for t in missing)
                )
            values, self.values = self.values, {}
            return values
        finally:
            self.anchors = {}

    def _root(self, what: str, value: Any) -> None:
        """The targets on the model itself: its input ``x`` or what its call returned."""
        for t in self.targets:
            if not t.layer and t.what == what:
                self._keep(t, value)

    def _gradients(self, forward: Callable[[torch.Tensor], Any], x: torch.Tensor, labels: torch.Tensor | None) -> None:
        x = x.clone()  # a normal tensor even if the caller made it under inference_mode
        self._root("input", x)
        out = forward(x)
        self._root("output", out)
        logits = _logits(out)
        self.logits = logits.shape[1]
        target = _target_classes(self.gradient[0].target, logits, labels)
        score = logits.gather(1, target[:, None])[:, 0]  # (B,) pre-softmax logit of the target
        layers = list(self.anchors)
        if [t for t in self.gradient if t.layer not in self.anchors]:
            return  # reported as missing by run()
        # one backward for the whole batch: in eval mode each image's score depends on its own
        # activations only, so d(sum of scores)/d(activation) is the per-image gradient
        grads = dict(zip(layers, torch.autograd.grad(score.sum(), [self.anchors[k] for k in layers]), strict=True))
        for t in self.gradient:
            if t.what == "grad_output":
                self._store(t, grads[t.layer], f"layer {t.layer!r} gradient")
                continue
            cam = _gradcam(t, self.anchors[t.layer].detach(), grads[t.layer], x.shape[-2:])
            self.values[t.key] = cam
            self.values[f"{t.key}.range"] = torch.stack([cam.amin(dim=(1, 2)), cam.amax(dim=(1, 2))], dim=1)
        self.values["target"] = target.detach()
        self.values["target_score"] = score.detach().float()
