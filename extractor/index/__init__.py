"""Feature indexes: what every feature of a capture (its channels, or a dictionary's latents) responds to. The
streamed state (``state``, numpy: the reference; its ``keys``, ``bins`` and ``slots``) and its compiled (``kernel``,
numba) and device (``device``, torch) passes; dictionaries; a capture's rows fed to it (``feed``); its layout in the
store (``layout``); a job's write-time parts (``write_time``); the post-hoc pass (``post_hoc``), the reader
(``reader``) and its figures; its atlas (``atlas``: ``neighbours`` and a map, ``projection``). Reads stores through
``read``; imports with torch missing (only ``device`` needs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .atlas import add_atlas
    from .device import index_on_device, serves
    from .dictionary import Dictionary, DictionaryError, load_dictionary
    from .post_hoc import index
    from .reader import FeatureIndex, Neighbours, TopRows, coverage, describe, index_names, open_index, summary
    from .write_time import JobIndexes, indexed, with_indexes

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
