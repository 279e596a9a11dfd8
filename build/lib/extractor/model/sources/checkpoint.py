"""Checkpoint files (``model.weights: FILE``): a state dict, or a safetensors file, loaded strictly into a model."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ...errors import ModelError
from .common import _EXTRA


def _read_state(path: str) -> Any:
    """What a checkpoint file holds: ``torch.load(weights_only=True)``, or a safetensors file."""
    if not os.path.exists(path):
        raise ModelError(f"model.weights checkpoint {path} does not exist")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except ImportError as err:
        raise ModelError(f"{path}: reading .safetensors needs safetensors: {_EXTRA}") from err
    except Exception as err:
        raise ModelError(
            f"cannot load checkpoint {path} with weights_only=True ({type(err).__name__}: {err}). "
            "Save a plain state dict: torch.save(model.state_dict(), path)"
        ) from err


def _state_dict_in(state: Any, path: str) -> dict[str, Any]:
    """The state dict a checkpoint holds: itself, or under ``state_dict``, ``model`` or ``model_state_dict``;
    a ``DataParallel`` one's ``module.`` prefix taken off."""
    if isinstance(state, dict):
        state = next((state[k] for k in ("state_dict", "model", "model_state_dict")
                      if k in state and isinstance(state[k], dict)), state)
    if not isinstance(state, dict):
        raise ModelError(f"checkpoint {path} holds a {type(state).__name__}, not a state dict")
    if state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def _some(keys: list[str]) -> str:
    return f"{keys[:5]}{'...' if len(keys) > 5 else ''}"


def load_checkpoint(model: nn.Module, path: str) -> None:
    """Load a state dict file (``torch.load(weights_only=True)`` or safetensors) into ``model``: every key
    it has must fill one of the model's, and every one of the model's be filled."""
    state = _state_dict_in(_read_state(path), path)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape
        first = next((ln.strip() for ln in str(err).splitlines() if "size mismatch" in ln), str(err).splitlines()[0])
        raise ModelError(f"checkpoint {path} does not fit the model: {first}") from None
    if result.missing_keys or result.unexpected_keys:
        raise ModelError(f"checkpoint {path} does not fit the model: missing keys {_some(result.missing_keys)}, "
                         f"unexpected keys {_some(result.unexpected_keys)}")

