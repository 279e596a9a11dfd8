"""Feature indexes: what every feature of a capture (its channels, or a dictionary's latents) responds to. The
streamed state (numpy, the reference) and its compiled (numba) and device (torch) passes, the dictionaries, the
index's layout in the store, a job's write-time parts, the post-hoc pass and the reader, and its figures.
Reads stores through ``read``; imports with torch missing (only ``device`` needs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .device import block_part, index_on_device, serves
    from .dictionary import Dictionary, DictionaryError, load_dictionary
    from .layout import ensure_parts, finish_indexes, indexed, with_indexes
    from .reader import FeatureIndex, TopRows, describe, index, index_names, open_index, summary
    from .state import IndexState

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
