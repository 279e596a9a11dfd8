"""The job spec's ``model`` section: which model, from which library, with which weights."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import Field, model_validator

from .identity import RUN_ONLY
from .section import _Section

__all__ = ["MODEL_SOURCES", "ModelSpec", "looks_like_path", "model_folder", "weights_kind"]


MODEL_SOURCES = ("torchvision", "timm", "hf", "open_clip", "python")
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


def looks_like_path(weights: str) -> bool:
    """A ``model.weights`` value that names a file (a checkpoint), not a weights name or tag."""
    return "/" in weights or os.sep in weights or weights.endswith(CHECKPOINT_SUFFIXES) or os.path.exists(weights)


def model_folder(name: str | None) -> tuple[str, str] | None:
    """``(prefix, folder)`` of a model name that names a local folder (``hf:FOLDER``,
    ``open_clip:local-dir:FOLDER``), which workers elsewhere need as an absolute path."""
    for prefix in ("hf:", "open_clip:local-dir:"):
        if name and name.startswith(prefix) and os.path.isdir(name[len(prefix):]):
            return prefix, name[len(prefix):]
    return None


def weights_kind(weights: str | None) -> Literal["auto", "random", "pretrained", "file", "name"]:
    """What a ``model.weights`` value asks for: ``auto`` (what the model's name points at), ``random``
    (``random`` or null), ``pretrained``, a checkpoint ``file``, or a library's weights ``name`` (a
    torchvision weights enum member, an open_clip tag). The one place this is decided."""
    if weights is None or weights == "random":
        return "random"
    if weights == "auto":
        return "auto"
    if weights == "pretrained":
        return "pretrained"
    return "file" if looks_like_path(weights) else "name"


class ModelSpec(_Section):
    name: str | None = "resnet18"
    """A torchvision classification builder (``resnet50``), or ``timm:NAME`` (``timm.create_model``),
    ``hf:ID_OR_FOLDER`` (Hugging Face transformers; the vision tower of CLIP/SigLIP-style models),
    ``open_clip:ARCH`` (the visual tower: its output is ``encode_image``); ``python:CLASS`` names a
    module given to ``extractor.run(..., model=...)``."""
    weights: str | None = "auto"
    """``auto`` (the default): the weights the model's name points at (an ``hf:`` folder's or hub id's,
    an open_clip ``hf-hub:``/``local-dir:`` model's; a factory's or a module's as they are built);
    a bare architecture name (torchvision, timm, ``open_clip:ARCH``) asks for one of the others.
    ``pretrained`` (the library's own weights: timm's tag, the HF model's), a torchvision weights
    name (``IMAGENET1K_V1``, ``DEFAULT``), an open_clip pretrained tag, a checkpoint file (``.pt``,
    ``.pth``, ``.bin``, ``.safetensors``), or ``random`` (also null): a random init (seed 0), only
    when asked. Read from local caches only unless EXTRACTOR_ALLOW_DOWNLOAD=1."""
    factory: str | None = None
    """``pkg.module:function`` returning an ``nn.Module``; used instead of ``name``. A module in the
    current folder is found (as ``python -m`` finds it)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the builder: the factory, ``timm.create_model`` (``img_size: 64``), a
    Hugging Face config override (``num_hidden_layers: 4``), ``open_clip.create_model``, or a
    torchvision builder."""
    call: str | None = None
    """A method to call instead of ``forward`` (``encode_image`` of an open_clip CLIP); hooks and
    layer names stay those of the model."""
    input: str = "positional"
    """How the pixels are passed: as the first positional argument, or as this keyword (``pixel_values``)."""
    forward_kwargs: dict[str, Any] = Field(default_factory=dict)
    """More keyword arguments of every call (``output_attentions: true``, ``interpolate_pos_encoding: true``)."""
    prefix_tokens: int | Literal["auto"] = "auto"
    """Tokens before the patch tokens (CLS, distillation, registers): ``auto`` decides from each captured
    layer's facts (its length against the patch grid; the positions that do not depend on the image), checked
    against timm's ``num_prefix_tokens``. A count is checked the same way per layer, and decides for a layer
    whose tokens besides the patches no fact places when it accounts for all of them."""
    device: str = Field(default="auto", json_schema_extra=RUN_ONLY)
    """``auto`` (cuda when available, else cpu), ``cpu``, ``cuda``, ``cuda:1``..."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype; bfloat16/float16 run the forward under autocast."""
    channels_last: bool = True
    """Run convolutions in channels-last memory format (faster on CPU and recent GPUs)."""
    compile: bool = Field(default=False, json_schema_extra=RUN_ONLY)
    """Compile the hooked model with ``torch.compile`` (hooks are registered first and traced
    into the graph). Pays a compile of tens of seconds per worker; worth it on long GPU runs."""

    @model_validator(mode="before")
    @classmethod
    def _a_factory_has_no_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "factory_kwargs" in data:  # the older name of kwargs (stored specs)
            if data.get("kwargs"):
                raise ValueError("set model.kwargs only (factory_kwargs is its older name)")
            data = {**{k: v for k, v in data.items() if k != "factory_kwargs"}, "kwargs": data["factory_kwargs"]}
        if isinstance(data, dict) and data.get("factory") is not None and "name" not in data:
            return {**data, "name": None}  # not the default resnet18: the factory's model is what runs
        return data

    @model_validator(mode="after")
    def _name_or_factory(self) -> ModelSpec:
        if self.factory is not None and self.name and "name" in self.model_fields_set:
            raise ValueError("set either model.name or model.factory, not both")
        if self.factory is None and not self.name:
            raise ValueError("set model.name (a torchvision model, timm:NAME, hf:ID or open_clip:ARCH) or "
                             "model.factory")
        if self.factory is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.factory):
            raise ValueError(f"model.factory must look like 'pkg.module:function', got {self.factory!r}")
        if self.name and ":" in self.name and self.source not in MODEL_SOURCES:
            raise ValueError(f"model.name {self.name!r}: unknown source {self.source!r}; use a torchvision name, "
                             "timm:NAME, hf:ID_OR_FOLDER or open_clip:ARCH (a function building the model is "
                             "model.factory, or --factory for extractor layers)")
        if self.name and not self.model:
            raise ValueError(f"model.name {self.name!r} names no model after {self.source}:")
        return self

    @model_validator(mode="after")
    def _call_fields(self) -> ModelSpec:
        if self.input != "positional" and not self.input.isidentifier():
            raise ValueError(f"model.input must be positional or a keyword name, not {self.input!r}")
        if isinstance(self.prefix_tokens, int) and self.prefix_tokens < 0:
            raise ValueError("model.prefix_tokens must be auto or a count >= 0")
        return self

    @property
    def weights_kind(self) -> str:
        """What ``weights`` names (see :func:`weights_kind`)."""
        return weights_kind(self.weights)

    @property
    def source(self) -> str:
        """``torchvision``, ``timm``, ``hf``, ``open_clip``, ``python`` (a module given to run) or ``factory``."""
        if self.factory is not None:
            return "factory"
        assert self.name is not None
        prefix, sep, _ = self.name.partition(":")
        return prefix if sep else "torchvision"

    @property
    def model(self) -> str:
        """The name without its source (``vit_small_patch16_224`` of ``timm:vit_small_patch16_224``)."""
        if self.factory is not None:
            return self.factory
        assert self.name is not None
        prefix, sep, rest = self.name.partition(":")
        return rest if sep else prefix
