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
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import LayerError
from ..store import projection_matrix
from .reduce import _describe, _sample, channels_last, probabilities, reduce_tensor, select
from .targets import ROOT, Target
from .tokens import TokenLayout

__all__ = ["Capturer"]


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
        self._retarget([dataclasses.replace(t, layout=layouts.get(t.key, t.layout)) for t in self.targets])

    def set_tokens(self, layers: dict[str, TokenLayout]) -> None:
        """Give each key's target its layer's token layout, as the probe decided it (the hooks read it at each call)."""
        self._retarget([dataclasses.replace(t, tokens=layers.get(t.key, t.tokens)) for t in self.targets])

    def _retarget(self, targets: list[Target]) -> None:
        self.targets = targets
        self.gradient = [t for t in self.targets if t.gradient]
        self.samples = any(t.sample for t in self.targets)  # sample_tokens: run() needs the images' draw keys

    def _store(self, t: Target, tensor: torch.Tensor, where: str) -> None:
        layout = t.layout
        if layout == "auto" and tensor.ndim == 4:  # only before the probe decided: recorded, read as nchw
            self.auto_4d[t.key] = probabilities(tensor)
            layout = "nchw"
        reduced = reduce_tensor(tensor, t.reduce, where, layout, t.patches)
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

