"""The torchvision model source: ``torchvision:NAME`` through ``torchvision.models.get_model`` and its weights enums."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from ...data import IMAGENET, Preprocess
from ...errors import ModelError
from ...spec import ModelSpec
from .common import Built, _ask_weights, _call, _downloads, _unknown

# builders whose pretrained weights need flags that their plain builder leaves off: a state dict
# saved from the pretrained model only works with them (inception's input transform, aux heads)
_TV_PRETRAINED_FLAGS = {
    "inception_v3": {"transform_input": True, "aux_logits": True, "init_weights": False},
    "googlenet": {"transform_input": True, "aux_logits": False, "init_weights": False},
}


def _tv_preprocess(weights: Any) -> Preprocess:
    t = weights.transforms()
    crop, resize = list(t.crop_size), list(t.resize_size)
    return Preprocess(resize=resize[0] if len(resize) == 1 else (resize[0], resize[1]),
                      crop=(crop[0], crop[0]) if len(crop) == 1 else (crop[0], crop[1]),
                      interpolation=t.interpolation.value, mean=tuple(t.mean), std=tuple(t.std),
                      source=f"torchvision {weights} transforms")


def _torchvision(spec: ModelSpec) -> Built:
    import torchvision.models as tvm

    name = spec.model
    names = sorted(tvm.list_models(module=tvm))
    if name not in names:
        raise _unknown(spec, names, "See torchvision.models.list_models(), use timm:/hf:/open_clip:, or set "
                                    "model.factory for other models")
    kind = spec.weights_kind
    kwargs = {**_TV_PRETRAINED_FLAGS.get(name, {}), **spec.kwargs}
    if kind in ("random", "file"):
        model = _call(lambda: tvm.get_model(name, weights=None, **kwargs), spec)
        if kind == "file":  # fine-tuned, say: whose preprocessing nobody recorded
            return Built(model, f"torchvision {name}", f"torchvision {name} with weights from a checkpoint file has "
                         "no transforms of its own (torchvision's weights names have theirs)", True, "torchvision")
        return Built(model, f"torchvision {name}", replace(IMAGENET, source="ImageNet defaults (torchvision's "
                     "convention; a random init has no weights transforms)"), False, "torchvision")
    enum = tvm.get_model_weights(name)
    valid = list(dict.fromkeys(["DEFAULT", *enum.__members__]))  # some enums list DEFAULT among their members
    if kind == "auto":
        raise _ask_weights(spec, f"pretrained (torchvision's DEFAULT), a weights name ({', '.join(valid[1:4])}...)")
    w = "DEFAULT" if kind == "pretrained" else str(spec.weights)
    if w not in valid:
        raise ModelError(
            f"model.weights {w!r} is not a weights name of {name} (valid: {', '.join(valid)}, pretrained) "
            "and no such checkpoint file exists"
        )
    weights = enum.DEFAULT if w == "DEFAULT" else enum[w]
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
    if not os.path.exists(cached) and not _downloads():
        raise ModelError(
            f"weights {name}.{weights.name} are not in the torch cache ({cached}). "
            f"Download {weights.url} to that path on a connected machine, set model.weights to a "
            "checkpoint path, or set EXTRACTOR_ALLOW_DOWNLOAD=1 to let torchvision download them"
        )
    model = _call(lambda: tvm.get_model(name, weights=weights, **spec.kwargs), spec)
    return Built(model, f"torchvision {name} {weights}", _tv_preprocess(weights), True, "torchvision")

