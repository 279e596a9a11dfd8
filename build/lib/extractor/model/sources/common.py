"""What every model source shares: the :class:`Built` it returns, its local-cache-only downloads, and its errors
(an optional library missing, an unknown name, weights not cached)."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...data import PIL_RESAMPLE, Preprocess
from ...errors import ModelError
from ...spec import ModelSpec
from ..processors import LibraryProcessor

_EXTRA = "pip install 'extractor[models]' (timm, transformers, open_clip_torch)"
# PIL resampling codes (Hugging Face image processors store them) -> data.interpolation
_RESAMPLE = {code: name for name, code in PIL_RESAMPLE.items()}  # PIL's codes, as processors store them


@dataclass
class Built:
    model: nn.Module
    source: str  # provenance, e.g. "timm vit_small_patch16_224 pretrained (hf-hub:timm/...)"
    preprocess: Preprocess | str  # the library's preprocessing, or why none is known
    pretrained: bool  # weights came from somewhere (not a random init of ours)
    library: str  # torchvision, timm, hf, open_clip, factory
    processor: LibraryProcessor | None = None  # the library's own processor, run by the probe (or the decoders)


def _downloads() -> bool:
    return os.environ.get("EXTRACTOR_ALLOW_DOWNLOAD") == "1"


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Hub libraries read their local caches only (unless downloads are allowed)."""
    if _downloads():
        yield
        return
    import huggingface_hub.constants as hub

    was = hub.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = was


def _import(module: str, spec: ModelSpec) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ModelError(f"model.name {spec.name!r} needs {module.split('.')[0]}, which is not installed "
                         f"({err}): {_EXTRA}") from err


def _unknown(spec: ModelSpec, names: list[str], how: str) -> ModelError:
    close = difflib.get_close_matches(spec.model, names, n=5, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else ""
    return ModelError(f"model.name {spec.name!r} is not a {spec.source} model{hint}. {how}")


def _not_cached(spec: ModelSpec, err: BaseException, fetch: str) -> ModelError:
    where = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    return ModelError(
        f"model {spec.name!r} with weights {spec.weights!r}: not in the local cache ({where}) and downloads are off "
        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). On a connected machine run "
        f"{fetch}, set EXTRACTOR_ALLOW_DOWNLOAD=1, or set model.weights to a checkpoint file"
    )


def _ask_weights(spec: ModelSpec, named: str) -> ModelError:
    """``weights: auto`` on a name that names an architecture, not weights: the tool cannot know which."""
    return ModelError(f"model.name {spec.name!r} names an architecture, not its weights: set model.weights to "
                      f"{named}, a checkpoint file, or random (a random init, seed 0)")


def _call(fn: Any, spec: ModelSpec) -> Any:
    """A builder call whose errors are the spec's (a bad keyword, a bad size)."""
    try:
        return fn()
    except ModelError:
        raise
    except TypeError as err:
        raise ModelError(f"model {spec.name or spec.factory}: the builder refused model.kwargs "
                         f"{spec.kwargs}: {err}") from err

