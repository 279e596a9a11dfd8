"""Capture targets: a spec's captures resolved against the model's layers (globs, keys), checked before the first
image is read; each token sequence's layout (which positions are patches) is added by the worker's probe."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..data import locator_names
from ..errors import LayerError
from ..spec import CaptureSpec
from .tokens import TokenLayout

__all__ = ["RESERVED_KEYS", "Target", "resolve_targets"]

RESERVED_KEYS = frozenset({"ids", "paths", "labels", "status", "errors", "shard_done", "shard_stats", "stats_sums",
                           "lease", "target", "target_score", "digest", "fingerprint", "read_fingerprint", "reused",
                           "id_index", "index_parts", "indexes"})
# and the sources' locators; names beginning "__" (a generation's own: its attempts and ledger), refused where a key
# is checked


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
    target: int | str | None = None  # gradient captures: predicted, label or a class index
    size: str = "layer"  # gradcam: layer or input resolution
    layout: str = "auto"  # a 4-D output's dims: nchw, nhwc, attention, or auto (decided by the worker's probe)
    drop_prefix: bool = False  # token sequences: the patch tokens only (CLS, registers, detection tokens left out)
    sample: int = 0  # sample_tokens: patch tokens kept per image (0: all)
    project: int = 0  # project: features after the random projection (0: none)
    projection: str = "gaussian"
    seed: int = 0
    tokens: TokenLayout | None = None  # the layer's token sequence, as the probe decided it (None: not yet, not one)

    @property
    def gradient(self) -> bool:
        return self.what in ("grad_output", "gradcam")

    @property
    def patches(self) -> slice | None:
        """The positions of the layer's sequence that ``drop_prefix`` keeps (None: all, or not decided yet)."""
        if not self.drop_prefix or self.tokens is None:
            return None
        return slice(self.tokens.before, self.tokens.before + self.tokens.patches)


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Module-name globs: ``*`` and ``?`` stay inside one dotted name part, ``**`` crosses parts,
    ``[1-4]`` is a character class. ``layer4.*.conv2`` matches ``layer4.0.conv2``, not deeper."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^.]*")
        elif c == "?":
            out.append("[^.]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : j]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


ROOT = "(model)"  # how a capture names the model's own output (what its forward or model.call returns)
_SUFFIX = {"output": "", "input": ".input", "grad_output": ".grad", "gradcam": ".gradcam"}


def _no_such_layer(pattern: str, names: Sequence[str], where: str, hint: str) -> LayerError:
    close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.4)
    found = f" Closest: {', '.join(close)}." if close else ""
    return LayerError(f"{where}.layer {pattern!r} matches no module of the model.{found} "
                      f"List the layers with `{hint}`.")


def _layers_of(c: CaptureSpec, names: Sequence[str], where: str, hint: str) -> list[str]:
    """The module names one capture's ``layer`` names: the model itself, a glob's matches, or one name."""
    if c.layer in ("", ROOT):
        layers = [""]
    elif _is_glob(c.layer):
        rx = glob_to_regex(c.layer)
        layers = [n for n in names if rx.match(n)]
    else:
        layers = [n for n in names if n == c.layer]
    if not layers:
        raise _no_such_layer(c.layer, names, where, hint)
    if c.key and "{" not in c.key and len(layers) > 1:
        more = ", ..." if len(layers) > 4 else ""
        raise LayerError(
            f"{where}.key {c.key!r} names one array but {c.layer!r} matches {len(layers)} layers "
            f"({', '.join(layers[:4])}{more}); drop key, name one layer, or make it a template such as '{{layer}}.cls'"
        )
    if layers == [""] and c.gradient:
        raise LayerError(f"{where}: {c.what} of {ROOT} (the model's output) is not supported; name a layer")
    return layers


def _cutting(c: CaptureSpec) -> dict[str, Any]:
    """The Target fields of sample_tokens and project."""
    return {"sample": c.sample_tokens or 0, "project": c.project or 0, "projection": c.projection, "seed": c.seed}


def _key(c: CaptureSpec, layer: str) -> str:
    """The array a capture of ``layer`` is stored as: its key (a template with ``{layer}``), else the layer's
    name with the suffix of what it takes (the model's output: the word)."""
    if c.key:
        return c.key.format(layer=layer or "model")
    return f"{layer}{_SUFFIX[c.what]}" if layer else c.what


def _check_keys(targets: Sequence[Target]) -> None:
    """Every array name once, none the store's own (nor a Grad-CAM map's per-row min and max)."""
    seen: dict[str, Target] = {}
    ranges = {f"{g.key}.range" for g in targets if g.what == "gradcam"}  # a Grad-CAM map's per-row min, max
    ranges |= {f"{g.key}.token_index" for g in targets if g.sample}  # a sampled capture's token positions
    for t in targets:
        if t.key in RESERVED_KEYS or t.key in ranges or t.key in locator_names() or t.key.startswith("__"):
            raise LayerError(
                f"capture[{t.capture}]: key {t.key!r} is reserved by the store; set capture[{t.capture}].key"
            )
        if t.key in seen:
            raise LayerError(
                f"capture[{seen[t.key].capture}] and capture[{t.capture}] both write {t.key!r}; "
                f"set a distinct key on one of them"
            )
        seen[t.key] = t


def resolve_targets(model: nn.Module, captures: Sequence[CaptureSpec],
                    hint: str = "extractor layers JOB.yaml") -> list[Target]:
    """Resolve names and globs against ``model.named_modules()`` before any image is read.
    ``(model)`` (or ``""``) is the model itself; globs match named submodules only. ``hint`` is
    the command that lists this model's layers."""
    names = [n for n, _ in model.named_modules() if n]
    targets: list[Target] = []
    for i, c in enumerate(captures):
        where = f"capture[{i}]"
        layers = _layers_of(c, names, where, hint)
        dtype = "float32" if c.what == "gradcam" else c.dtype
        target = c.score_target if c.gradient else None
        cutting = _cutting(c)
        targets += [Target(_key(c, layer), layer, c.what, c.index, c.reduce, dtype, i, target, c.size, c.layout,
                           c.drop_prefix, **cutting) for layer in layers]
    _check_keys(targets)
    return targets

