"""Building models: torchvision builders, weights, checkpoints, user factories; layer listing."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import logging
import os
from typing import Any

import torch
from torch import nn

from .errors import ModelError
from .spec import ModelSpec

__all__ = ["build_model", "resolve_device", "describe_model", "layer_table"]

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


def _torchvision_names() -> list[str]:
    import torchvision.models as tvm

    return sorted(tvm.list_models(module=tvm))


def _looks_like_path(weights: str) -> bool:
    suffixes = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
    return "/" in weights or os.sep in weights or weights.endswith(suffixes) or os.path.exists(weights)


def build_model(spec: ModelSpec) -> tuple[nn.Module, dict[str, Any]]:
    """Build the model on the CPU in eval mode; return it with its description."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_SEED)
        if spec.factory:
            model = _from_factory(spec.factory, spec.factory_kwargs)
            source = f"factory {spec.factory}"
        else:
            model, source = _from_torchvision(spec)
    if spec.weights and _looks_like_path(spec.weights):
        _load_checkpoint(model, spec.weights)
        source = f"checkpoint {spec.weights}"
    elif spec.weights is None:
        log.warning(
            "model.weights is null: %s uses random weights (seed %d); set model.weights to a "
            "torchvision weights name or a checkpoint path for trained features",
            spec.name or spec.factory,
            RANDOM_SEED,
        )
        source += f", random init (seed {RANDOM_SEED})"
    model.eval()
    return model, describe_model(model, spec, source)


def _from_torchvision(spec: ModelSpec) -> tuple[nn.Module, str]:
    import torchvision.models as tvm

    assert spec.name is not None
    names = _torchvision_names()
    if spec.name not in names:
        close = difflib.get_close_matches(spec.name, names, n=5, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise ModelError(
            f"model.name {spec.name!r} is not a torchvision classification model{hint}. "
            "See torchvision.models.list_models(), or set model.factory for other models"
        )
    w = spec.weights
    if w is None or _looks_like_path(w):
        return tvm.get_model(spec.name, weights=None), f"torchvision {spec.name}"
    enum = tvm.get_model_weights(spec.name)
    valid = list(dict.fromkeys(["DEFAULT", *enum.__members__]))  # some enums list DEFAULT among their members
    if w not in valid:
        raise ModelError(
            f"model.weights {w!r} is not a weights name of {spec.name} (valid: {', '.join(valid)}) "
            "and no such checkpoint file exists"
        )
    weights = enum.DEFAULT if w == "DEFAULT" else enum[w]
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
    if not os.path.exists(cached) and os.environ.get("EXTRACTOR_ALLOW_DOWNLOAD") != "1":
        raise ModelError(
            f"weights {spec.name}.{weights.name} are not in the torch cache ({cached}). "
            f"Download {weights.url} to that path on a connected machine, set model.weights to a "
            "checkpoint path, or set EXTRACTOR_ALLOW_DOWNLOAD=1 to let torchvision download them"
        )
    return tvm.get_model(spec.name, weights=weights), f"torchvision {spec.name} {weights}"


def _from_factory(factory: str, kwargs: dict[str, Any]) -> nn.Module:
    module_name, _, attr = factory.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ModelError(f"model.factory {factory!r}: cannot import {module_name}: {err}") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"model.factory {factory!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    try:
        model = obj(**kwargs)
    except Exception as err:
        raise ModelError(f"model.factory {factory!r} raised {type(err).__name__}: {err}") from err
    if not isinstance(model, nn.Module):
        raise ModelError(f"model.factory {factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _load_checkpoint(model: nn.Module, path: str) -> None:
    if not os.path.exists(path):
        raise ModelError(f"model.weights checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ModelError(
            f"cannot load checkpoint {path} with weights_only=True ({type(err).__name__}: {err}). "
            "Save a plain state dict: torch.save(model.state_dict(), path)"
        ) from err
    if isinstance(state, dict):
        for k in ("state_dict", "model", "model_state_dict"):
            if k in state and isinstance(state[k], dict):
                state = state[k]
                break
    if not isinstance(state, dict):
        raise ModelError(f"checkpoint {path} holds a {type(state).__name__}, not a state dict")
    if state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ModelError(
            f"checkpoint {path} does not fit the model: missing keys {result.missing_keys[:5]}"
            f"{'...' if len(result.missing_keys) > 5 else ''}, unexpected keys "
            f"{result.unexpected_keys[:5]}{'...' if len(result.unexpected_keys) > 5 else ''}"
        )


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


def layer_table(model: nn.Module, input_size: int) -> list[dict[str, Any]]:
    """Every named module with its type, output shape (batch of 1) and parameter count."""
    shapes: dict[str, str] = {}
    handles = []
    try:
        for name, module in model.named_modules():
            def hook(_m: nn.Module, _a: Any, out: Any, name: str = name) -> None:
                shapes.setdefault(name, _shape_of(out))

            handles.append(module.register_forward_hook(hook))
        if input_size < 1:
            raise ModelError(f"--input-size must be a positive number of pixels, not {input_size}")
        with torch.inference_mode():
            try:
                model(torch.zeros(1, 3, input_size, input_size))
            except Exception as err:
                raise ModelError(
                    f"the model cannot run on a {input_size}x{input_size} input: {type(err).__name__}: {err}; "
                    "pass the input size it expects with --input-size (e.g. 224)"
                ) from err
    finally:
        for h in handles:
            h.remove()
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
