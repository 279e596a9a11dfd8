"""The worker's probe: one blank image through the hooked model measures what the store records (each capture's
shape and record, the per-row extras, the model's facts), decides the layouts left at ``auto``, and refuses a
model whose values could not be stored as one job's (a forward that draws at random, prefix tokens that are not
there). Mixed into :class:`~extractor.compute.worker.Worker`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..data import Preprocess
from ..errors import ExtractorError, LayerError, ModelError
from ..faults import describe_error, device_errors
from ..index import with_indexes
from ..model import (
    ROOT,
    Capturer,
    Claim,
    Target,
    TokenFacts,
    TokenLayout,
    Unknown,
    contradicted_layouts,
    dim_names,
    forward_context,
    layer_tokens,
    not_rgb,
    reduced_otherwise,
    reproducible_kernels,
    rounding_noise,
    settle_layouts,
)
from ..spec import JobSpec
from ..store import (
    BFLOAT16,
    BY_DIGEST,
    CaptureRecord,
    ExtraRecord,
    ForwardRecord,
    Probe,
    forward_record,
)

__all__ = ["Probing", "host_array"]

log = logging.getLogger(__name__)

_INTERRUPTS: tuple[type[BaseException], ...] = (KeyboardInterrupt, *device_errors())  # never the model's fault
# errors the probe raises as they are; any other is the model's, on a blank image
_PROBE_PASSES: tuple[type[BaseException], ...] = (ExtractorError, torch.OutOfMemoryError, *_INTERRUPTS)
# two forwards of one image may differ by float rounding (GPU kernels), not by more than this, relatively
RANDOM_FORWARD_TOLERANCE = 1e-3


class Probing:
    """The probe's part of a :class:`~extractor.compute.worker.Worker`, which holds these attributes."""

    spec: JobSpec
    preprocess: Preprocess
    model: torch.nn.Module
    device: torch.device
    model_info: dict[str, Any]
    token_facts: TokenFacts
    token_claim: Claim
    targets: list[Target]
    capturer: Capturer
    captures: dict[str, CaptureRecord] | None
    extras: dict[str, ExtraRecord]

    def _forward(
        self, images: torch.Tensor, labels: np.ndarray | None = None, eager: bool = False,
        draws: np.ndarray | None = None,
    ) -> dict[str, torch.Tensor]:
        raise NotImplementedError  # the worker's hooked forward

    def _blank(self, size: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
        """One blank image at the model's input size (or ``size``) through the hooked model, eagerly."""
        h, w = size or self.preprocess.size
        return self._forward(torch.zeros(1, 3, h, w, dtype=torch.uint8), np.zeros(1, np.int64), eager=True)

    def probe(self) -> Probe:
        """What the driver needs to create the store (captures, per-row extras, the model's facts, the resolved
        preprocessing), measured once with a blank image (:meth:`_measure`)."""
        if self.captures is None:
            self._measure()
        assert self.captures is not None
        return Probe(captures=self.captures, extras=self.extras, model=self.model_info,
                     preprocess=self.preprocess.to_dict())

    def _measure(self) -> None:
        """Run one blank image through the model: the stored shape and metadata of each capture.
        4-D outputs left at ``layout: auto`` are decided here (see :func:`~extractor.model.reduce.settle_layouts`)."""
        h, w = self.preprocess.size
        d = self.spec.data
        size_from = "data.crop" if d.crop not in ("auto", None) else "data.resize" if d.crop is None and \
            d.resize != "auto" else f"the input size from {self.preprocess.source}"
        try:
            values = self._blank()
            layouts, tokens = self._decide_layouts(), self._decide_tokens()
            if layouts or tokens:
                values = self._blank()  # again, reduced and cut as decided
            fixed, reproducible = self._check_deterministic()
        except _PROBE_PASSES:
            raise
        except Exception as err:
            channels = not_rgb(self.model)
            if channels is not None:  # the cause: not the input size the message below suggests
                raise ModelError(f"{channels}; it failed on a blank image, before any image was read: "
                                 f"{describe_error(err)}") from err
            raise ModelError(
                f"the model failed on a blank {h}x{w} image ({size_from}), before any image was read: "
                f"{describe_error(err)}. If it expects another input size, set data.crop (and "
                "data.resize) to it; if it takes its input another way, see model.call, model.input and "
                "model.forward_kwargs"
            ) from err
        self.targets = self.capturer.targets
        original = dict(self.capturer.original_shapes)
        if self.capturer.logits is not None:  # a gradient job: labels (target: label) must be among them
            self.model_info = {**self.model_info, "logits": self.capturer.logits}
        # what the captured layers give on the fixed input: resume and reuse compare it (not only class and weights)
        self.model_info = {**self.model_info, "forward": self._forward_record(fixed, reproducible)}
        modules = dict(self.model.named_modules())
        widths = dict(self.capturer.matrices)  # project: (key, features in) as the blank saw them
        self.captures = {t.key: _record(t, modules[t.layer], values[t.key].shape[1:], original[t.key],
                                        next((w for k, w in widths if k == t.key), 0))
                         for t in self.targets}
        # write-time feature indexes (capture.feature_index): their settings, checked against the capture's shape
        self.captures = with_indexes(self.spec.capture, self.captures, self.model_info.get("prefix_tokens"))
        self.extras = _extras(values, self.captures)

    def _fixed_image(self) -> torch.Tensor:
        """The probe's fixed input: seeded mid-grey noise (its patches differ, so a shuffle of equal patches would
        show; no pixel is saturated: blank images pass the model, an unusual one must not fail here instead)."""
        h, w = self.preprocess.size
        return torch.randint(64, 192, (1, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def _check_deterministic(self) -> tuple[dict[str, torch.Tensor], bool]:
        """Refuse a model whose eval forward draws at random (ViTMAE masks patches at random in eval
        mode): two forwards of one image must store the same values, else every stored row is one
        draw and a resume mixes draws. Float rounding (another kernel on a GPU) passes. Returns the
        captures of that fixed image (the model's forward record is made of them) and whether the two forwards
        gave the same bits (kernels chosen by rule: :func:`reproducible_kernels`)."""
        labels = np.zeros(1, np.int64)
        with reproducible_kernels(self.device):
            first, second = (self._forward(self._fixed_image(), labels, eager=True) for _ in range(2))
        same_bits = True
        for key, a in first.items():
            x, y = a.float(), second[key].float()
            same = (x == y) | (torch.isnan(x) & torch.isnan(y))  # equal Inf and NaN too
            same_bits = same_bits and bool(same.all())
            gap = float(torch.where(same, 0.0, (x - y).abs()).nan_to_num(nan=float("inf")).max()) if x.numel() \
                else 0.0
            scale = float(x.abs().nan_to_num(nan=0.0, posinf=0.0).max()) if x.numel() else 0.0
            if gap > RANDOM_FORWARD_TOLERANCE * max(scale, 1.0):
                raise ModelError(
                    f"the model's forward is not deterministic in eval mode: two forwards of the same image differ "
                    f"in {key} by up to {gap:.3g} (its values reach {scale:.3g}), so every stored row would be one "
                    "random draw and a resume would mix draws. A model that masks or samples at random (ViTMAE's "
                    "random_masking) needs its randomness fixed: see the docs, guides/models.md, 'A forward that "
                    "draws at random'"
                )
        return first, same_bits

    def _forward_record(self, fixed: dict[str, torch.Tensor], reproducible: bool) -> ForwardRecord:
        """The forward's record (:mod:`extractor.store.forward`): the captures' values on the fixed input, in the
        context they were computed in, and how far rounding noise at every layer moves them (one more forward)."""
        context = forward_context(self.device, self.spec.model.dtype)
        keys = [t.key for t in self.targets]
        perturbed = None
        try:
            with reproducible_kernels(self.device), rounding_noise(self.model, context["rounding"]):
                moved = self._forward(self._fixed_image(), np.zeros(1, np.int64), eager=True)
            perturbed = {k: host_array(moved[k].detach().cpu()) for k in keys}
        except _INTERRUPTS:
            raise
        except Exception as err:  # noqa: BLE001 - a model whose layers refuse the hooks: its tolerance is wider
            log.warning("the model's rounding noise could not be measured (%s): a resume or output.reuse in another "
                        "setting compares its forward within 5%%", describe_error(err))
        return forward_record({k: host_array(fixed[k].detach().cpu()) for k in keys}, perturbed, context, reproducible)

    def _decide_tokens(self) -> bool:
        """Decide which positions of each captured token sequence are patches, from its layer's length and the
        model's token facts (:func:`~extractor.model.layer_tokens`); refuse a capture that needs to know where that
        is not known, and a statement the facts contradict. True when the blank must run again: a capture keeps
        other tokens than the first look did."""
        decided: dict[str, TokenLayout] = {}
        for t in self.targets:
            shape = self.capturer.original_shapes.get(t.key)
            if shape is None:
                continue  # never ran: the forward says so
            found = layer_tokens(shape[0], self.token_facts, self.token_claim) if len(shape) == 2 else None
            _check_tokens(t, shape, found, self.token_facts)
            if isinstance(found, TokenLayout):
                decided[t.key] = found
        self.capturer.set_tokens(decided)
        self.targets = self.capturer.targets
        return any(t.key in decided and (t.drop_prefix or t.sample) for t in self.targets)

    def _decide_layouts(self) -> bool:
        """Decide ``layout: auto`` for the 4-D outputs whose layout matters (reduced, stored whole,
        Grad-CAM) from facts (:func:`settle_layouts`); a given layout the facts contradict is said, then
        obeyed. True when the blank must run again: a decided layout reduces otherwise than ``nchw`` did."""
        modules = dict(self.model.named_modules())
        shapes = dict(self.capturer.original_shapes)
        for t, fact in contradicted_layouts(self.targets, modules, shapes):
            log.warning("capture[%d] %s: layout %s is given, but layer %r (%s) gives %s outputs; its outputs "
                        "are %s (see the docs, reference/spec.md, capture)", t.capture, t.key, t.layout,
                        t.layer or ROOT, type(modules[t.layer]).__name__, fact, fact)
        layouts = settle_layouts(self.targets, modules, shapes, self.capturer.auto_4d, self._shapes_at_another_size)
        if not layouts:
            return False
        for t in self.targets:
            if t.key in layouts and not (t.reduce == "flatten" and t.what != "gradcam"):
                log.info("capture[%d] %s: layout %s", t.capture, t.key, layouts[t.key])
        self.capturer.set_layouts(layouts)
        self.targets = self.capturer.targets
        return reduced_otherwise(self.targets, layouts)

    def _shapes_at_another_size(self) -> dict[str, tuple[int, ...]]:
        """The captures' shapes for a blank image 32 pixels larger each way ({} when the model refuses it)."""
        h, w = self.preprocess.size
        shapes = self.capturer.original_shapes  # the input size's: what the store records
        try:
            self._blank((h + 32, w + 32))
            return dict(self.capturer.original_shapes)
        except _INTERRUPTS:
            raise
        except Exception:  # noqa: BLE001 - a model with a fixed input size: this fact is not to be had
            return {}
        finally:
            self.capturer.original_shapes = shapes


def _check_tokens(t: Target, shape: Sequence[int], found: TokenLayout | Unknown | None, facts: TokenFacts) -> None:
    """Refuse capture ``t`` of a layer of per-row ``shape`` whose token layout ``found`` (None: not a sequence of
    the patch grid) it cannot go with: patch tokens asked of a layer whose patches are not known, a class token asked
    of a layer that has none, a stated count the facts contradict."""
    where = f"capture[{t.capture}] {t.key}: layer {t.layer or ROOT!r}"
    if isinstance(found, Unknown) and found.contradicted:
        raise LayerError(f"{where}: {found.why}. {found.fix}")
    if t.drop_prefix or t.sample:
        _check_patches(t, shape, found, facts, where)
    if t.reduce == "cls" and isinstance(found, TokenLayout) and not found.before:
        raise LayerError(f"{where} gives {found.said()}: reduce: cls takes the first token, a patch here. Capture a "
                         "layer whose sequence holds the class token (see `extractor layers`), or reduce: mean")


def _check_patches(t: Target, shape: Sequence[int], found: TokenLayout | Unknown | None, facts: TokenFacts,
                   where: str) -> None:
    """Refuse ``drop_prefix`` or ``sample_tokens`` of a layer whose patch tokens are not known."""
    wants = "drop_prefix keeps" if t.drop_prefix else "sample_tokens samples"
    if len(shape) != 2:
        raise LayerError(f"{where} gives {tuple(shape)} per image, not a token sequence (tokens, features): {wants} "
                         "patch tokens; capture a layer that gives tokens (see `extractor layers`)")
    if isinstance(found, Unknown):
        raise LayerError(f"{where}: {found.why}. {wants} its patch tokens: {found.fix}")
    if found is None:
        grid = f"the model's {facts.patches} patches" if facts.patches else "a patch grid"
        raise LayerError(f"{where} gives {shape[0]} tokens, not a sequence of {grid} and the tokens besides them: "
                         f"{wants} its patch tokens; capture a layer of the token sequence (see `extractor layers`)")


def host_array(t: torch.Tensor) -> np.ndarray:
    """A host tensor as the numpy array it holds, bfloat16 ones as ml_dtypes' bfloat16 (numpy has none)."""
    if t.dtype == torch.bfloat16:
        assert BFLOAT16 is not None  # ml_dtypes: a dependency of the package
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def _extras(values: dict[str, torch.Tensor], captures: dict[str, CaptureRecord]) -> dict[str, ExtraRecord]:
    """The per-row results besides the captures (a gradient job's target, target_score and KEY.range; a sampled
    capture's KEY.token_index), as the blank image gave them."""
    return {
        key: {
            "dtype": "float32" if v.is_floating_point() else "int16" if v.dtype == torch.int16 else "int64",
            "shape": list(v.shape[1:]),
            "dims": [f"{key}.minmax"] if key.endswith(".range") else [f"{key}.token"] if v.ndim == 2 else [],
        }
        for key, v in values.items()
        if key not in captures
    }


def _record(t: Target, module: torch.nn.Module, shape: Sequence[int], original: Sequence[int],
            projected_from: int = 0) -> CaptureRecord:
    """How capture ``t`` is stored: ``shape`` per row as stored, ``original`` as the model computed it;
    ``projected_from``: the features ``project`` multiplied (the matrix's rows)."""
    record: CaptureRecord = {
        "layer": t.layer,
        "module_type": type(module).__name__,
        "what": t.what,
        "index": t.index,
        "reduce": t.reduce,
        "dtype": t.dtype,
        "shape": list(shape),
        "original_shape": list(original),
        "dims": dim_names(t.key, tuple(original), t.reduce, t.what, t.layout),
        "capture": t.capture,
    }
    if len(original) == 2:  # a token sequence's layout: which positions are patches (None: not known)
        record["tokens"] = t.tokens.record() if t.tokens else None
    if t.drop_prefix and t.tokens:
        record["drop_prefix"] = t.tokens.before
    if t.gradient and t.target is not None:
        record["target"] = t.target
    if t.what == "gradcam":
        record["size"] = t.size
    if t.sample:  # the kept positions: KEY.token_index; the draw: extractor.store.sampling.sample_positions
        kept = (0, 0) if t.drop_prefix or not t.tokens else (t.tokens.before, t.tokens.after)
        record["sample_tokens"], record["prefix_kept"], record["seed"] = t.sample, kept[0], t.seed
        if kept[1]:
            record["suffix_kept"] = kept[1]
        record["sampled_by"] = BY_DIGEST
    if t.project:  # the matrix: extractor.store.sampling.projection_matrix(seed, original features, project)
        record["project"], record["projection"], record["seed"] = t.project, t.projection, t.seed
        record["projected_from"] = projected_from
    return record


