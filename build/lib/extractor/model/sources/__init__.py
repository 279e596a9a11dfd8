"""Model sources: torchvision, timm, Hugging Face transformers, open_clip and user factories, one module each.

Each builder returns a :class:`~.common.Built`: the module, where its weights came from, the
preprocessing its library prescribes (or why none is known).
Weights come from local caches only; a download needs ``EXTRACTOR_ALLOW_DOWNLOAD=1``.
The optional libraries are imported only when a spec names them (extra ``models``).
"""

from __future__ import annotations

from ...spec import ModelSpec
from .common import Built
from .factory import _factory, _python, from_object
from .hf import _hf
from .open_clip import _open_clip
from .timm import _timm
from .torchvision import _torchvision

__all__ = ["build", "from_object"]


def build(spec: ModelSpec) -> Built:
    """The model of ``spec`` on the CPU (weights loaded; checkpoints by the caller)."""
    return {"torchvision": _torchvision, "timm": _timm, "hf": _hf, "open_clip": _open_clip,
            "factory": _factory, "python": _python}[spec.source](spec)
