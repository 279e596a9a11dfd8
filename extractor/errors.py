"""Errors raised by extractor.

Every error is an :class:`ExtractorError` and also inherits the built-in exception a
caller would naturally catch (``ValueError``, ``KeyError``, ``FileNotFoundError``...).
Messages say what went wrong, where (field path, file, shard, row) and how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ClusterError",
    "CountError",
    "DataError",
    "DeviceError",
    "ExtractorError",
    "FencedError",
    "LayerError",
    "ModelError",
    "OutOfRangeError",
    "ShardError",
    "ShardTaken",
    "SpecError",
    "StoreError",
    "missing_extra",
]


class ExtractorError(Exception):
    """Base class of every error this package raises on purpose."""


class SpecError(ExtractorError, ValueError):
    """The job spec is invalid: unknown key, wrong type or bad value (names the field path)."""


class DataError(ExtractorError, ValueError):
    """The image source cannot be used: missing root, empty data set, bad manifest."""


class RemakeError(DataError):
    """A source listed behind the job's start contradicts what its store was made with (``made_for``: its count of
    rows, its classes, labels taken as class indices): no resume finishes that store; ``--overwrite`` makes it
    again."""

    def __init__(self, message: str, made_for: str = "") -> None:  # (made again from its message when unpickled,
        super().__init__(message)  # its made_for put back with its other attributes)
        self.made_for = made_for


class CountError(RemakeError):
    """A source listed behind the job's start holds another number of rows than it was counted to hold, which the
    store was made with."""

    def __init__(self, message: str, made_for: str = "the rows counted first") -> None:
        super().__init__(message, made_for)


class ModelError(ExtractorError, ValueError):
    """The model cannot be built: unknown name, missing weights, bad checkpoint or factory."""


class LayerError(ExtractorError, KeyError):
    """A capture names a layer the model does not have, or takes what the layer lacks."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it as written
        return str(self.args[0]) if self.args else ""


class StoreError(ExtractorError, OSError):
    """The Zarr store cannot be created, resumed or read as asked."""


class FencedError(StoreError):
    """This job no longer holds what it writes: another job took its shard over (this one was paused past
    its member's timeout, or cut off) or made the store again. What it wrote is never read; it stops."""


class ShardTaken(StoreError):
    """A shard this job was about to compute is another member's: committed already (``verdict`` "done") or
    being computed by a live one ("taken"). Not a failure: the job goes on with other shards."""

    def __init__(self, shard: int, verdict: str, others: Sequence[int] = ()) -> None:
        held = "committed already" if verdict == "done" else "being computed by another live process"
        super().__init__(f"shard {shard} is {held}")
        self.shard, self.verdict = shard, verdict
        self.others = tuple(others)  # other shards the same read found another's: skipped without a read

    def __reduce__(self):  # pickled across Ray processes
        return type(self), (self.shard, self.verdict, self.others)


class OutOfRangeError(ExtractorError, IndexError):
    """A row, feature or rank asked of a store or an index that it does not hold (names what it holds)."""


class ShardError(ExtractorError, RuntimeError):
    """A shard failed as a whole (not just some of its rows); ``shard`` is its index when known."""

    def __init__(self, message: str, shard: int | None = None) -> None:
        super().__init__(message)
        self.shard = shard

    def __reduce__(self):  # pickled across Ray processes with its shard
        return type(self), (str(self), self.shard)


class DeviceError(ExtractorError, RuntimeError):
    """The accelerator failed (a CUDA error): its context in this process is not used again.
    A Ray worker that raises it is replaced; the local backend stops the job (``--resume``)."""


class ClusterError(ExtractorError, RuntimeError):
    """The Ray cluster cannot run the job as asked (no such cluster, not enough resources)."""


# the package that brings each optional module: the core install (numpy, zarr, fsspec) reads stores; the rest are
# extras (pyproject.toml)
EXTRAS = {
    "torch": "run", "torchvision": "run", "PIL": "run", "pydantic": "run", "tqdm": "run", "xxhash": "run",
    "ray": "ray", "pyarrow": "parquet", "s3fs": "s3", "numba": "index", "flask": "view", "jinja2": "view",
    "xarray": "analysis", "dask": "analysis", "sklearn": "analysis", "matplotlib": "analysis", "timm": "models",
    "transformers": "models", "open_clip": "models", "safetensors": "models", "datasets": "datasets",
}


def missing_extra(err: ModuleNotFoundError) -> str | None:
    """What to say of an optional module not installed (None: not one of the extras'): its name and the install
    that brings it."""
    name = (err.name or "").split(".")[0]
    if name not in EXTRAS:
        return None
    return f"needs {name}, which is not installed: pip install 'extractor[{EXTRAS[name]}]'"
