"""Hooks on target layers: resolve selections, select elements, reduce on device.

A :class:`Capturer` registers one hook per target for the life of a ``with`` block and
always removes them (also when a forward raises); the model's train/eval mode is restored.
Captured tensors are detached copies or reductions: nothing the model computes afterwards
(an in-place ReLU, say) changes them, and the hooks never change what the model computes.
Once every target has been captured the forward is stopped: layers after the deepest
target never run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import LayerError
from .spec import CaptureSpec

__all__ = ["Target", "resolve_targets", "Capturer", "RESERVED_KEYS"]

RESERVED_KEYS = frozenset({"ids", "paths", "labels", "status", "errors", "shard_done"})
_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class Target:
    """One resolved capture: a module, what to take from it and how to store it."""

    key: str  # array name in the store
    layer: str  # module name in model.named_modules()
    what: str  # "output" or "input"
    index: int | str | None
    reduce: str
    dtype: str
    capture: int  # position in spec.capture (for error messages)


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _no_such_layer(pattern: str, names: Sequence[str], where: str) -> LayerError:
    close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.4)
    hint = f" Closest: {', '.join(close)}." if close else ""
    return LayerError(
        f"{where}.layer {pattern!r} matches no module of the model.{hint} "
        "List the layers with `extractor layers MODEL`."
    )


def resolve_targets(model: nn.Module, captures: Sequence[CaptureSpec]) -> list[Target]:
    """Resolve names and globs against ``model.named_modules()`` before any image is read."""
    names = [n for n, _ in model.named_modules() if n]
    targets: list[Target] = []
    for i, c in enumerate(captures):
        where = f"capture[{i}]"
        layers = fnmatch.filter(names, c.layer) if _is_glob(c.layer) else [n for n in names if n == c.layer]
        if not layers:
            raise _no_such_layer(c.layer, names, where)
        if c.key and len(layers) > 1:
            raise LayerError(
                f"{where}.key {c.key!r} names one array but {c.layer!r} matches {len(layers)} layers "
                f"({', '.join(layers[:4])}{', ...' if len(layers) > 4 else ''}); drop key or name one layer"
            )
        for layer in layers:
            key = c.key or (layer if c.what == "output" else f"{layer}.input")
            targets.append(Target(key, layer, c.what, c.index, c.reduce, c.dtype, i))
    seen: dict[str, Target] = {}
    for t in targets:
        if t.key in RESERVED_KEYS:
            raise LayerError(
                f"capture[{t.capture}]: key {t.key!r} is reserved by the store; set capture[{t.capture}].key"
            )
        if t.key in seen:
            raise LayerError(
                f"capture[{seen[t.key].capture}] and capture[{t.capture}] both write {t.key!r}; "
                f"set a distinct key on one of them"
            )
        seen[t.key] = t
    return targets


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)} ({', '.join(_describe(v) for v in value[:4])})"
    if isinstance(value, dict):
        return f"dict with keys {list(value)[:8]}"
    return type(value).__name__


def select(value: Any, index: int | str | None, where: str) -> torch.Tensor:
    """Take the tensor a capture asks for from a module's output or input."""
    if index is None:
        if isinstance(value, torch.Tensor):
            return value
        raise LayerError(f"{where} gives a {_describe(value)}; set index (an int for tuples, a key for dicts)")
    try:
        if isinstance(value, dict):
            item = value[index]
        elif isinstance(value, (tuple, list)) and isinstance(index, int):
            item = value[index]
        elif isinstance(index, str) and (dataclasses.is_dataclass(value) or hasattr(value, index)):
            item = getattr(value, index)
        else:
            raise LayerError(f"{where} gives a {_describe(value)}; index {index!r} does not apply to it")
    except (KeyError, IndexError):
        raise LayerError(f"{where} gives a {_describe(value)}; it has no element {index!r}") from None
    if not isinstance(item, torch.Tensor):
        raise LayerError(f"{where}[{index!r}] is a {_describe(item)}, not a tensor")
    return item


def reduce_tensor(t: torch.Tensor, how: str, where: str) -> torch.Tensor:
    """Reduce a batch-first tensor on its device. Layouts: (B,C,H,W...) maps, (B,T,D) tokens."""
    if how == "none":
        return t
    if how == "flatten":
        return t.flatten(1)
    if t.ndim < 3:
        raise LayerError(f"{where} is {tuple(t.shape)} (batch, features) already; use reduce: none")
    if how == "cls":
        if t.ndim != 3:
            raise LayerError(f"{where} is {tuple(t.shape)}; reduce: cls needs (batch, tokens, features)")
        return t[:, 0]
    dims = (1,) if t.ndim == 3 else tuple(range(2, t.ndim))  # tokens, or spatial positions
    if how == "mean":
        return t.float().mean(dim=dims)
    if how == "max":
        return t.amax(dim=dims)
    raise LayerError(f"{where}: unknown reduce {how!r}")


def dim_names(key: str, original: tuple[int, ...], reduce: str) -> list[str]:
    """Feature dimension names of a stored capture (without the leading ``row``)."""
    nd = len(original)  # feature dims, batch excluded
    if reduce == "flatten":
        names = ["feature"]
    elif reduce in ("mean", "max"):
        names = ["feature"] if nd == 2 else ["channel"]
    elif reduce == "cls":
        names = ["feature"]
    elif nd == 3:
        names = ["channel", "y", "x"]
    elif nd == 2:
        names = ["token", "feature"]
    elif nd == 1:
        names = ["feature"]
    else:
        names = [f"dim{i + 1}" for i in range(nd)]
    return [f"{key}.{n}" for n in names]


class _StopForward(BaseException):
    """Raised by the last hook to skip the rest of the forward (BaseException: not swallowed)."""


class Capturer:
    """Hooks on the targets for the duration of a ``with`` block.

    ``run(x)`` returns ``{key: tensor}`` on the model's device, reduced and cast to the
    stored dtype, each a detached copy. With ``stop_early`` the forward ends once every
    target has fired.
    """

    def __init__(self, model: nn.Module, targets: Sequence[Target], stop_early: bool = True) -> None:
        self.model = model
        self.targets = list(targets)
        self.stop_early = stop_early
        self.values: dict[str, torch.Tensor] = {}
        self.original_shapes: dict[str, tuple[int, ...]] = {}
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Capturer:
        modules = dict(self.model.named_modules())
        stack = contextlib.ExitStack()
        was_training = self.model.training
        stack.callback(self.model.train, was_training)
        try:
            self.model.eval()
            for t in self.targets:
                module = modules[t.layer]
                if t.what == "output":
                    handle = module.register_forward_hook(self._output_hook(t))
                else:
                    handle = module.register_forward_pre_hook(self._input_hook(t), with_kwargs=True)
                stack.callback(handle.remove)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None
        self.values.clear()

    def _keep(self, t: Target, value: Any) -> None:
        if t.key in self.values:  # a module called twice in one forward: keep the first call
            return
        where = f"layer {t.layer!r} {t.what}"
        tensor = select(value, t.index, where).detach()
        self.original_shapes[t.key] = tuple(tensor.shape[1:])
        reduced = reduce_tensor(tensor, t.reduce, where)
        # copy=True: a later in-place op on the model's tensor must not change what we keep
        self.values[t.key] = reduced.to(dtype=_DTYPES[t.dtype], memory_format=torch.contiguous_format, copy=True)
        if self.stop_early and len(self.values) == len(self.targets):
            raise _StopForward

    def _output_hook(self, t: Target):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            self._keep(t, output)

        return hook

    def _input_hook(self, t: Target):
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if isinstance(t.index, str):
                self._keep(t, kwargs)
            else:
                self._keep(t, args if t.index is not None else (args[0] if len(args) == 1 else args))

        return hook

    def run(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """One forward pass; returns the captured tensors by key."""
        if self._stack is None:
            raise RuntimeError("Capturer.run() must be called inside `with Capturer(...)`")
        self.values = {}
        try:
            self.model(x)
        except _StopForward:
            pass
        missing = [t for t in self.targets if t.key not in self.values]
        if missing:
            raise LayerError(
                "these layers never ran during the forward pass, so nothing was captured: "
                + ", ".join(f"{t.layer} ({t.what})" for t in missing)
            )
        values, self.values = self.values, {}
        return values
