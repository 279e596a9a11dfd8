"""The model: built from its library (torchvision, timm, Hugging Face, open_clip, factories), the facts read off
its forward (layers, prefix tokens), and the hooks that capture its layers. Imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .build import (
        build_model,
        build_with_processor,
        layer_table,
        model_call,
        not_rgb,
        resolve_device,
        state_dict_hash,
    )
    from .capture import Capturer
    from .processors import settle_preprocess
    from .reduce import contradicted_layouts, dim_names, reduce_tensor, reduced_otherwise, settle_layouts
    from .rounding import forward_context, reproducible_kernels, rounding_noise, unit_roundoff
    from .sources.common import Built
    from .targets import ROOT, Target, resolve_targets
    from .tokens import Claim, TokenFacts, TokenLayout, Unknown, claim_of, layer_tokens, model_prefix, token_facts

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
