"""The zarr-python internals extractor needs, imported here only (no public name gives them in zarr 3.1): the
event loop's ``sync`` (a shard's objects written from a thread outside zarr's loop), ``BaseFloat`` (bfloat16 as a
zarr data type) and ``ArrayConfigParams`` (the typed array config). zarr is pinned below 3.2 in pyproject.toml; a
release that moves one fails here, at import, in one line naming the range extractor is tested with, not somewhere
in a job."""

from __future__ import annotations

import zarr

try:
    from zarr.core.array_spec import ArrayConfigParams
    from zarr.core.dtype.npy.float import BaseFloat
    from zarr.core.sync import sync
except ImportError as err:  # pragma: no cover - a zarr that moved them
    raise ImportError(f"extractor needs zarr >=3.1,<3.2 (zarr {zarr.__version__} moved an internal it uses: {err}): "
                      "pip install 'zarr>=3.1,<3.2'") from err

__all__ = ["ArrayConfigParams", "BaseFloat", "sync"]
