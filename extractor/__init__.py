"""extractor: push image collections through PyTorch models and keep chosen layers as Zarr.

The public surface is small; everything else is private. ``open_store`` needs only numpy
and zarr; the rest is imported on first use, so importing the package pulls in neither
torch nor Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__

__all__ = ["JobSpec", "__version__", "load_spec", "open_store", "run", "zarr_store"]

if TYPE_CHECKING:
    from .api import run
    from .read import open_store, zarr_store
    from .spec import JobSpec, load_spec

_LAZY = {
    "open_store": "read",
    "zarr_store": "read",
    "load_spec": "spec",
    "JobSpec": "spec",
    "run": "api",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        try:
            return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        except ModuleNotFoundError as err:
            from .errors import missing_extra

            hint = missing_extra(err)
            if hint is None:
                raise
            raise ModuleNotFoundError(f"extractor.{name} {hint}", name=err.name) from None
    raise AttributeError(f"module 'extractor' has no attribute {name!r}")
