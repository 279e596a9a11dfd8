"""Whose fault an error is: an image's, a shard's, the worker's (its device's) or the job's.

The worker, the batch stream and the Ray driver decide with these, so that the same error is
never a bad image in one place and a dead device in another:

- an image's: a decode error, or a forward that raises on that image alone (its row fails);
- a shard's: anything else raised while the shard runs (it is retried, then fails the job);
- the device's: a CUDA fault (``torch.AcceleratorError``), which may break the device context,
  so nothing more runs in that process (a Ray worker is replaced);
- the job's: a fenced-off writer (another job holds the store), an interruption, a caller's
  callback: they stop everything and are raised as they are.
"""

from __future__ import annotations

import functools
from typing import Literal

from .errors import FencedError, LayerError, ShardError, ShardTaken

__all__ = ["blame", "describe_error", "device_errors", "device_fault", "not_an_image", "shard_failed", "whose"]


def describe_error(err: BaseException) -> str:
    """A short, readable one-line error for a failed row (no closing period: callers go on after it)."""
    msg = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else ""
    name = type(err).__name__
    return f"{name}: {msg}"[:300] if msg else name


@functools.cache
def device_errors() -> tuple[type[BaseException], ...]:
    """What a CUDA fault raises (``torch.AcceleratorError``, torch >= 2.8): the device context may
    be broken, so it is never taken for a bad image nor retried in the same process."""
    import torch

    error = getattr(torch, "AcceleratorError", None)
    return (error,) if error is not None else ()


@functools.cache
def not_an_image() -> tuple[type[BaseException], ...]:
    """Errors of a forward that are never an image's: they fail the shard (or stop the worker), not a row."""
    return (LayerError, KeyboardInterrupt, SystemExit, *device_errors())


def device_fault(err: BaseException) -> BaseException | None:
    """The CUDA fault behind ``err`` (itself, or a cause or context of it), if any."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, device_errors()):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def blame(err: BaseException, shard: int, passes: tuple[type[BaseException], ...] = ()) -> Literal[
        "this", "another", "as_is"]:
    """Whose failure ``err``, raised while shard ``shard`` ran, is: ``this`` shard's (to be
    raised as its ShardError), ``another`` shard's (a ShardError of the shard before it, read
    back late: this one is not at fault), or ``as_is`` (already this shard's ShardError, or
    the job's: a fenced-off writer, an interruption, or one of ``passes``)."""
    if isinstance(err, ShardError):
        return "another" if err.shard != shard else "as_is"
    if isinstance(err, (FencedError, ShardTaken, *passes)) or not isinstance(err, Exception):
        return "as_is"
    return "this"


def shard_failed(index: int, start: int, stop: int, err: BaseException) -> ShardError:
    """The ShardError of shard ``index`` (rows ``start`` to ``stop - 1``) that ``err`` failed."""
    return ShardError(f"shard {index} (rows {start}-{stop - 1}) failed: {type(err).__name__}: {err}", index)


def whose(err: BaseException) -> Literal["job", "shard", "worker"]:
    """What a worker's error stops, as its driver sees it: the ``job`` (a fenced-off writer: another
    job holds the store), one ``shard`` (a ShardError: retried, then the job fails), or the
    ``worker`` (anything else, a device fault included: it is replaced and its shards redone)."""
    if isinstance(err, FencedError):
        return "job"
    return "shard" if isinstance(err, ShardError) else "worker"
