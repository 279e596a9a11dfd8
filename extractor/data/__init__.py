"""The images: rows and shards, where their bytes are, the preprocessing and the decoders, and the stream of
decoded batches. Needs numpy and Pillow; the spec for listing and decoding; never torch at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:
    from .decode import EncodedJpeg, ImageDecoder, JpegDecoder, open_rgb, rgb_from_bytes
    from .files import (
        Locator,
        absolute,
        content_digest,
        display_name,
        fingerprint,
        forget_reads,
        is_relative,
        is_url,
        local_fingerprint,
        read_bytes,
        remote_error,
        remote_fingerprint,
        storable_path,
        tar_url_of,
    )
    from .listing import list_rows
    from .preprocess import IMAGENET, PIL_RESAMPLE, Preprocess, from_dict, of_store, resolve
    from .rows import Rows, Shard, labels_of, plan
    from .sources.tar import expand_braces, list_tars, scan_tar, tar_listing
    from .stream import Batch, BatchStream, Reused, iter_batches

__all__ = [
    "Rows",
    "Shard",
    "plan",
    "labels_of",
    "Locator",
    "is_url",
    "is_relative",
    "absolute",
    "storable_path",
    "display_name",
    "read_bytes",
    "forget_reads",
    "tar_url_of",
    "remote_error",
    "content_digest",
    "fingerprint",
    "local_fingerprint",
    "remote_fingerprint",
    "list_rows",
    "expand_braces",
    "list_tars",
    "scan_tar",
    "tar_listing",
    "Preprocess",
    "PIL_RESAMPLE",
    "IMAGENET",
    "resolve",
    "from_dict",
    "of_store",
    "ImageDecoder",
    "JpegDecoder",
    "EncodedJpeg",
    "open_rgb",
    "rgb_from_bytes",
    "Batch",
    "BatchStream",
    "Reused",
    "iter_batches",
]

# a name of the face is never a module's name too: the module, once imported, would shadow it
__getattr__ = face(
    __name__,
    {
        "Rows": "rows",
        "Shard": "rows",
        "plan": "rows",
        "labels_of": "rows",
        "Locator": "files",
        "is_url": "files",
        "is_relative": "files",
        "absolute": "files",
        "storable_path": "files",
        "display_name": "files",
        "read_bytes": "files",
        "forget_reads": "files",
        "tar_url_of": "files",
        "remote_error": "files",
        "content_digest": "files",
        "fingerprint": "files",
        "local_fingerprint": "files",
        "remote_fingerprint": "files",
        "list_rows": "listing",
        "expand_braces": "sources.tar",
        "list_tars": "sources.tar",
        "scan_tar": "sources.tar",
        "tar_listing": "sources.tar",
        "Preprocess": "preprocess",
        "PIL_RESAMPLE": "preprocess",
        "IMAGENET": "preprocess",
        "resolve": "preprocess",
        "from_dict": "preprocess",
        "of_store": "preprocess",
        "ImageDecoder": "decode",
        "JpegDecoder": "decode",
        "EncodedJpeg": "decode",
        "open_rgb": "decode",
        "rgb_from_bytes": "decode",
        "Batch": "stream",
        "BatchStream": "stream",
        "Reused": "stream",
        "iter_batches": "stream",
    },
)
