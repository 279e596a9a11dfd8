"""The open_clip model source: ``open_clip:ARCH`` with a pretrained tag, a hub model or a local folder; its visual
tower and preprocess_cfg."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...data import Preprocess
from ...errors import ModelError
from ...spec import ModelSpec
from .checkpoint import load_checkpoint
from .common import Built, _call, _import, _not_cached, _offline, _unknown


def _open_clip_preprocess(visual: nn.Module, spec: ModelSpec) -> Preprocess | str:
    cfg = dict(getattr(visual, "preprocess_cfg", {}) or {})
    if not cfg:
        return f"open_clip model {spec.model} has no preprocess_cfg"
    size = cfg.get("size", 224)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    mode = cfg.get("resize_mode", "shortest")
    if mode == "squash":
        resize: int | tuple[int, int] = (h, w)
        crop: tuple[int, int] | None = None
    elif mode == "shortest" and h == w:
        resize, crop = h, (h, w)
    else:
        return f"open_clip's transform for {spec.model} resizes with mode {mode!r} at {h}x{w}"
    return Preprocess(resize=resize, crop=crop, interpolation=cfg.get("interpolation", "bicubic"),
                      mean=tuple(cfg["mean"]), std=tuple(cfg["std"]),
                      source=f"open_clip transform of {spec.model} ({mode})")


def _open_clip_tag(open_clip: Any, spec: ModelSpec, arch: str, schema: bool) -> str | None:
    """The pretrained tag or checkpoint file an open_clip model loads (None: a random init, or an ``hf-hub:`` or
    ``local-dir:`` model's own weights); refuses a weights setting that does not say which."""
    kind = spec.weights_kind
    tags = [] if schema else open_clip.list_pretrained_tags_by_model(arch)
    if kind in ("auto", "pretrained") and not schema:
        raise ModelError(f"model.weights: {spec.weights} is ambiguous for open_clip:{arch}; name a tag "
                         f"({', '.join(tags) or 'none known'}), a checkpoint file, or random")
    if kind == "name" and spec.weights not in tags:
        raise ModelError(f"model.weights {spec.weights!r} is not a pretrained tag of open_clip:{arch} "
                         f"(tags: {', '.join(tags) or 'none'}) and no such checkpoint file exists")
    return str(spec.weights) if kind in ("name", "file") else None


def _open_clip_file(open_clip: Any, spec: ModelSpec, arch: str, path: str) -> Built:
    """An open_clip model with weights from a checkpoint file: the whole CLIP's state dict, or its visual tower's."""
    model = _call(lambda: open_clip.create_model(arch, pretrained=None, load_weights=False, **spec.kwargs), spec)
    try:
        load_checkpoint(model, path)
    except ModelError as whole:
        try:
            load_checkpoint(model.visual, path)
        except ModelError:
            raise ModelError(f"{whole} (neither open_clip:{arch}'s whole CLIP nor its visual tower)") from None
    visual = model.visual
    return Built(visual, f"open_clip {arch} visual tower, weights from checkpoint {path}",
                 _open_clip_preprocess(visual, spec), True, "open_clip")


def _open_clip(spec: ModelSpec) -> Built:
    open_clip = _import("open_clip", spec)
    arch, schema = spec.model, spec.model.startswith(("hf-hub:", "local-dir:"))
    if not schema and arch not in open_clip.list_models():
        raise _unknown(spec, open_clip.list_models(), "See open_clip.list_models()")
    w = _open_clip_tag(open_clip, spec, arch, schema)
    if spec.weights_kind == "file":
        return _open_clip_file(open_clip, spec, arch, str(w))
    pretrained = spec.weights_kind != "random"
    try:
        with _offline():
            model = _call(lambda: open_clip.create_model(
                arch, pretrained=None if schema else w, load_weights=pretrained, **spec.kwargs), spec)
    except (OSError, RuntimeError) as err:
        if not pretrained:
            raise ModelError(f"open_clip.create_model({arch!r}) failed: {type(err).__name__}: {err}") from err
        raise _not_cached(spec, err, f"python -c \"import open_clip; open_clip.create_model('{arch}', "
                                     f"pretrained='{w}')\"") from err
    visual = model.visual
    visual.preprocess_cfg = getattr(model.visual, "preprocess_cfg", None) or {}
    source = f"open_clip {arch} visual tower" + (f" ({w})" if pretrained else "")
    return Built(visual, source, _open_clip_preprocess(visual, spec), pretrained, "open_clip")

