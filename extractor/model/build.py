"""Building models: torchvision builders, weights, checkpoints, user factories; layer listing."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from ..spec import ModelSpec
from . import sources
from .processors import LibraryProcessor
from .sources.checkpoint import load_checkpoint
from .tokens import library_prefix

__all__ = [
    "build_model",
    "build_with_processor",
    "describe_model",
    "layer_table",
    "model_call",
    "not_rgb",
    "resolve_device",
]

log = logging.getLogger(__name__)

RANDOM_SEED = 0  # random-init models are seeded so every worker builds the same weights


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda when available, else cpu; anything else must exist here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ModelError(f"model.device {name!r} is not a device (use auto, cpu, cuda, cuda:N)") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"model.device is {name!r} but this machine has no CUDA GPU; use auto or cpu")
    return device


def build_model(spec: ModelSpec, module: nn.Module | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Build the model on the CPU in eval mode (or take ``module``, made in Python); return it with
    its description (``preprocess_defaults``: what its library prescribes, or why nothing is
    known; ``prefix_tokens``)."""
    model, info, _ = build_with_processor(spec, module)
    return model, info


def build_with_processor(spec: ModelSpec, module: nn.Module | None = None) \
        -> tuple[nn.Module, dict[str, Any], LibraryProcessor | None]:
    """:func:`build_model`, and the model's own library's processor (None: it brings none)."""
    if module is not None:
        built = sources.from_object(module, spec)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            built = sources.build(spec)
    model, source = built.model, built.source
    if spec.weights_kind == "file" and spec.source != "open_clip":
        load_checkpoint(model, str(spec.weights))
        source = f"{source}, weights from checkpoint {spec.weights}"
    elif not built.pretrained:  # asked for (weights: random or null), and recorded so
        log.info("model.weights is %s: %s uses random weights (seed %d)", spec.weights, spec.name, RANDOM_SEED)
        source += f", random init (seed {RANDOM_SEED})"
    model.eval()
    info = describe_model(model, spec, source)
    # what the spec or the library says; the worker decides from the model's sequences (tokens.model_prefix)
    info["prefix_tokens"] = spec.prefix_tokens if isinstance(spec.prefix_tokens, int) else library_prefix(model)
    p = built.preprocess
    info["preprocess_defaults"] = p.to_dict() if not isinstance(p, str) else p  # what the library prescribes
    return model, info, built.processor


def model_call(model: nn.Module, spec: ModelSpec) -> Callable[[torch.Tensor], Any]:
    """How the pixels go into the model: ``model.call`` (a method instead of forward), ``model.input``
    (positional or a keyword) and ``model.forward_kwargs``."""
    fn: Any = model
    if spec.call is not None:
        fn = getattr(model, spec.call, None)
        if not callable(fn):
            methods = sorted(n for n in dir(type(model)) if not n.startswith("_") and "image" in n.lower())
            raise ModelError(f"model.call {spec.call!r}: {type(model).__name__} has no such method"
                             + (f" (image methods: {', '.join(methods)})" if methods else ""))
    kwargs, key = dict(spec.forward_kwargs), spec.input
    if key == "positional":
        return (lambda x: fn(x, **kwargs)) if kwargs else fn
    return lambda x: fn(**{key: x}, **kwargs)


def state_dict_hash(model: nn.Module) -> str:
    """sha256 over names, dtypes, shapes and bytes of the state dict (sorted by name)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def describe_model(model: nn.Module, spec: ModelSpec, source: str) -> dict[str, Any]:
    return {
        "name": spec.name if not spec.factory else spec.factory,
        "source": spec.source,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "weights": source,
        "parameters": sum(p.numel() for p in model.parameters()),
        "state_dict_sha256": state_dict_hash(model),
    }


def _shape_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "x".join(str(s) for s in value.shape)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_shape_of(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shape_of(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def module_outputs(model: nn.Module, x: torch.Tensor, entry: Any = None) -> list[tuple[str, nn.Module, Any]]:
    """``(name, module, output)`` of every named module, in the order their forwards returned,
    for one call of ``entry`` (default: the model) on ``x``; hooks removed on every path."""
    seen: list[tuple[str, nn.Module, Any]] = []
    handles = []
    try:
        for name, module in model.named_modules():
            if not name:
                continue

            def hook(m: nn.Module, _a: Any, out: Any, name: str = name) -> None:
                seen.append((name, m, out))

            handles.append(module.register_forward_hook(hook))
        with torch.inference_mode():
            seen.append(("", model, (entry or model)(x)))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def not_rgb(model: nn.Module) -> str | None:
    """Why ``model`` cannot take what extractor feeds it, 3-channel RGB images, when its first convolution (the
    stem: libraries register it first) takes another number of channels (timm's ``in_chans: 1``, a Hugging Face
    config's ``num_channels``); None when it takes 3, or has no convolution. Said where a model failed on the probe
    image: a model may turn RGB into its own channels before its first convolution."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            n = module.in_channels
            if n == 3:
                return None
            return (f"the model takes {n}-channel images (its first convolution, {name}, has in_channels {n}), and "
                    "extractor feeds 3-channel RGB (a grayscale file is read as RGB, its value in each channel): build "
                    "it for 3 channels (leave out what sets another count: model.kwargs in_chans, num_channels, a "
                    "pretrained_cfg input_size), or wrap it in a "
                    f"model.factory whose forward turns the 3 channels into its {n}")
    return None


def layer_table(model: nn.Module, size: int | tuple[int, int], entry: Any = None) -> list[dict[str, Any]]:
    """Every named module with its type, output shape (batch of 1) and parameter count; the model
    itself is ``(model)``: what ``entry`` (default: the model) returns."""
    h, w = (size, size) if isinstance(size, int) else size
    if h < 1 or w < 1:
        raise ModelError(f"--input-size must be a positive number of pixels, not {h}")
    try:
        outputs = module_outputs(model, torch.zeros(1, 3, h, w), entry)
    except Exception as err:
        channels = not_rgb(model)
        if channels is not None:
            raise ModelError(f"{channels} ({type(err).__name__}: {str(err).splitlines()[0][:200]})") from err
        raise ModelError(
            f"the model cannot run on a {h}x{w} input: {type(err).__name__}: {err}; "
            "pass the input size it expects with --input-size"
        ) from err
    shapes: dict[str, str] = {}
    for name, _module, out in outputs:
        shapes.setdefault(name, _shape_of(out))
    return [
        {
            "name": name or "(model)",
            "type": type(module).__name__,
            "output": shapes.get(name, "not run"),
            "parameters": sum(p.numel() for p in module.parameters()),
            "depth": name.count(".") + 1 if name else 0,
        }
        for name, module in model.named_modules()
    ]
