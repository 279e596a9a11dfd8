"""The store's model, live (issue 59): built again from the store's record and checked to be its own, one image run
through it as the job ran its rows (``model``: its captures, its output scores, an index's feature switched off),
and phrases matched against an index's features through its text tower (``text``). The viewer's local app uses it;
nothing here writes to a store. Imports torch (and the model's library).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .model import MAX_IMAGE_BYTES, Live, LiveError, Ran
    from .text import Found, TextSearch, TextTower, joint_capture, text_tower

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
