"""User factories (``model.factory: module:function``) and modules made in Python (``extractor.run(..., model=)``),
with the preprocessing they carry."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from torch import nn

from ...data import Preprocess
from ...errors import ModelError
from ...spec import ModelSpec
from ..processors import LibraryProcessor
from .common import Built
from .hf import _hf_preprocess
from .open_clip import _open_clip_preprocess
from .timm import _timm_preprocess


def from_object(model: nn.Module, spec: ModelSpec) -> Built:
    """A module made in Python and given to ``extractor.run(..., model=...)``, used as it is."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"model= takes a torch.nn.Module, not {type(model).__name__}")
    found, processor = _own_preprocess(model, spec)
    return Built(model, f"python object {type(model).__module__}.{type(model).__qualname__} (weights as given)",
                 found, True, "python", processor)


def _python(spec: ModelSpec) -> Built:
    raise ModelError(f"model.name {spec.name!r} names a module made in Python: pass it as "
                     "extractor.run(job, model=module), or name a model the spec can build")


def _factory(spec: ModelSpec) -> Built:
    factory = spec.model
    module_name, _, attr = factory.partition(":")
    here = current_folder()
    if "" not in sys.path and here is not None and here not in sys.path:
        sys.path.insert(0, here)  # a module in the current folder, as `python -m` finds it
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        searched = "the current folder and PYTHONPATH are searched" if here is not None else \
            "PYTHONPATH is searched: the current folder is gone (removed since this process started in it)"
        raise ModelError(f"model.factory {factory!r}: cannot import {module_name}: {err} ({searched})") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"model.factory {factory!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    try:
        model = obj(**spec.kwargs)
    except Exception as err:
        raise ModelError(f"model.factory {factory!r} raised {type(err).__name__}: {err}") from err
    if not isinstance(model, nn.Module):
        raise ModelError(f"model.factory {factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    found, processor = _own_preprocess(model, spec)
    return Built(model, f"factory {factory} (weights as the factory built them)", found, True, "factory", processor)


def current_folder() -> str | None:
    """The current folder, or None when it is gone (removed since the process started in it: ``os.getcwd`` raises)."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return None


def _own_preprocess(model: nn.Module, spec: ModelSpec) -> tuple[Preprocess | str, LibraryProcessor | None]:
    """The preprocessing a module made elsewhere (a factory's, one given to ``extractor.run``) carries
    with it: timm's ``pretrained_cfg``, open_clip's ``preprocess_cfg`` (on the model or its ``visual``
    tower), a Hugging Face model's processor config (its ``name_or_path`` folder or cached hub id);
    else why none is known (the job must then give the ``data.*`` settings: no silent ImageNet)."""
    if hasattr(model, "pretrained_cfg") and "timm" in sys.modules:
        return _timm_preprocess(sys.modules["timm"], model, spec), None
    for carrier in (model, getattr(model, "visual", None)):
        if isinstance(carrier, nn.Module) and getattr(carrier, "preprocess_cfg", None):
            return _open_clip_preprocess(carrier, spec), None
    source = getattr(model, "name_or_path", None)
    if isinstance(source, str) and source and "transformers" in sys.modules:
        return _hf_preprocess(sys.modules["transformers"], source)
    return (f"the model {spec.factory or spec.name} ({type(model).__name__}) carries no preprocessing extractor knows "
            "(timm's pretrained_cfg, open_clip's preprocess_cfg, a Hugging Face model's processor config)"), None

