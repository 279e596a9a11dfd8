"""The images: rows and shards, where their bytes are, the preprocessing and the decoders, and the stream of
decoded batches. Needs numpy and Pillow; the spec for listing and decoding; never torch at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .decode import EncodedJpeg, ImageDecoder, JpegDecoder, open_rgb, rgb_from_bytes
    from .files import absolute, content_digest, expand_braces, fingerprint, is_relative, is_url, local_fingerprint
    from .listing import list_rows, sample_of, stream_rows
    from .preprocess import IMAGENET, PIL_RESAMPLE, Preprocess, from_dict, of_store, resolve
    from .rows import (
        BLOCK,
        LocatorArray,
        Rows,
        Shard,
        Texts,
        first_name,
        first_where,
        labels_of,
        plan,
        strings,
        text_hashes,
        texts_part,
        utf8,
    )
    from .sources import Recorded, Sampled, Stats, forget_reads, locator_names, paths_now, read_bytes, reuse, source
    from .sources._dataset import with_dataset
    from .spill import Column, by_hash
    from .stream import Batch, BatchStream, Reused, Slots, iter_batches
    from .streamed import Streamed

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
