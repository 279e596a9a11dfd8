"""The model: built from its library (torchvision, timm, Hugging Face, open_clip, factories), the facts read off
its forward (layers, prefix tokens), and the hooks that capture its layers. Imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:
    from .build import (
        TokenFacts,
        build_model,
        build_with_processor,
        decide_prefix_tokens,
        describe_model,
        layer_table,
        model_call,
        module_outputs,
        prefix_tokens,
        resolve_device,
        state_dict_hash,
        token_facts,
    )
    from .capture import Capturer
    from .processors import settle_preprocess
    from .reduce import (
        contradicted_layouts,
        decide_layout,
        dim_names,
        reduce_tensor,
        reduced_otherwise,
        settle_layouts,
    )
    from .sources.checkpoint import load_checkpoint
    from .sources.common import Built
    from .sources.hf import HF_WEIGHT_FILES
    from .targets import RESERVED_KEYS, ROOT, Target, resolve_targets

__all__ = [
    "build_model",
    "build_with_processor",
    "settle_preprocess",
    "model_call",
    "resolve_device",
    "describe_model",
    "layer_table",
    "state_dict_hash",
    "module_outputs",
    "prefix_tokens",
    "decide_prefix_tokens",
    "token_facts",
    "TokenFacts",
    "Built",
    "load_checkpoint",
    "HF_WEIGHT_FILES",
    "Target",
    "Capturer",
    "resolve_targets",
    "decide_layout",
    "settle_layouts",
    "contradicted_layouts",
    "reduced_otherwise",
    "dim_names",
    "reduce_tensor",
    "ROOT",
    "RESERVED_KEYS",
]

# a name of the face is never a module's name too: the module, once imported, would shadow it
__getattr__ = face(
    __name__,
    {
        "build_model": "build",
        "build_with_processor": "build",
        "settle_preprocess": "processors",
        "model_call": "build",
        "resolve_device": "build",
        "describe_model": "build",
        "layer_table": "build",
        "state_dict_hash": "build",
        "module_outputs": "build",
        "prefix_tokens": "build",
        "decide_prefix_tokens": "build",
        "token_facts": "build",
        "TokenFacts": "build",
        "Built": "sources.common",
        "load_checkpoint": "sources.checkpoint",
        "HF_WEIGHT_FILES": "sources.hf",
        "Target": "targets",
        "Capturer": "capture",
        "resolve_targets": "targets",
        "decide_layout": "reduce",
        "settle_layouts": "reduce",
        "contradicted_layouts": "reduce",
        "reduced_otherwise": "reduce",
        "dim_names": "reduce",
        "reduce_tensor": "reduce",
        "ROOT": "targets",
        "RESERVED_KEYS": "targets",
    },
)
