"""Which positions of a layer's token sequence are patches: a fact of each captured layer, not of the model.

One forward of two images (blank, noise) shows the patch embedding's grid and, per sequence length, which positions
do not depend on the image where they first appear (a class token, registers, YOLOS's detection tokens: parameters
put before or after the patches). :func:`layer_tokens` decides a layer's :class:`TokenLayout` from its length and
these facts, checked against what ``model.prefix_tokens`` or the library (timm's ``num_prefix_tokens``) states;
where they do not tell, it says why (the probe then refuses a capture that needs to know, naming its layer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..store import TokenRecord

__all__ = [
    "Claim",
    "TokenFacts",
    "TokenLayout",
    "Unknown",
    "claim_of",
    "layer_tokens",
    "library_prefix",
    "model_prefix",
    "token_facts",
]

SAME = 1e-5  # two images' values at a position closer than this (relative to the output's largest) are the same


@dataclass(frozen=True)
class TokenLayout:
    """A layer's token sequence: ``before`` tokens, then the ``patches`` (row after row of ``grid``), then ``after``."""

    before: int  # CLS, distillation, register tokens
    patches: int
    after: int  # YOLOS's detection tokens
    grid: tuple[int, int] | None  # (h, w) of the patches, where the patch embedding's grid is known

    @property
    def length(self) -> int:
        return self.before + self.patches + self.after

    def record(self) -> TokenRecord:
        return {"before": self.before, "patches": self.patches, "after": self.after,
                "grid": list(self.grid) if self.grid else None}

    def said(self) -> str:
        ends = [f"{self.before} before" if self.before else "", f"{self.after} after" if self.after else ""]
        others = " and ".join(e for e in ends if e)
        return f"{self.patches} patches" + (f", {others} them" if others else " only")


@dataclass(frozen=True)
class Unknown:
    """Why a layer's patch positions are not known; ``contradicted``: a statement the facts contradict (refused
    whatever the capture does)."""

    why: str
    fix: str
    contradicted: bool = False


@dataclass(frozen=True)
class Claim:
    """What is stated of the tokens before the patches (None: nothing), and by whom."""

    before: int | None
    by: str  # "model.prefix_tokens", "the library's num_prefix_tokens"


@dataclass(frozen=True)
class TokenFacts:
    """What one forward of two images (blank, noise) shows of a vision transformer's tokens (None: not such a model)."""

    patches: int | None  # positions of the patch embedding's output grid at the probed input size
    width: int | None  # its channels: the width of the token sequence
    tokens: int | None  # the most common length of the (batch, tokens, width) outputs: the model's main sequence
    grid: tuple[int, int] | None = None  # (h, w) of the patch grid
    # per sequence length: the positions where the first output of that length whose other positions depend on the
    # image gives both images the same values (its mask, True: the same)
    fixed: Mapping[int, tuple[bool, ...]] = field(default_factory=dict)

    def ends(self, length: int) -> tuple[int, int] | None:
        """(before, after): the tokens of sequences of ``length`` that do not depend on the image, when they are
        exactly the ``length - patches`` tokens besides the patches and sit at the ends; None when not."""
        mask = self.fixed.get(length)
        if mask is None or self.patches is None:
            return None
        before = next((i for i, same in enumerate(mask) if not same), length)
        after = next((i for i, same in enumerate(reversed(mask)) if not same), length)
        if before + after != length - self.patches or sum(mask) != before + after:
            return None
        return before, after


def library_prefix(model: nn.Module) -> int | None:
    """The prefix-token count the model's library states (timm's ``num_prefix_tokens``), or None."""
    n = getattr(model, "num_prefix_tokens", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def claim_of(model: nn.Module, given: int | None) -> Claim:
    """What is stated of the tokens before the patches: ``model.prefix_tokens`` when set, else the library's count."""
    if given is not None:
        return Claim(given, "model.prefix_tokens")
    return Claim(library_prefix(model), "the library's num_prefix_tokens")


class _Watch:
    """Forward hooks that gather :class:`TokenFacts` as the outputs come, keeping none of them."""

    def __init__(self) -> None:
        self.grids: dict[int, tuple[int, int]] = {}  # channels -> (h, w) of the latest conv output with that many
        self.patches: tuple[int, int] | None = None
        self.width: int | None = None
        self.lengths: Counter[int] = Counter()
        self.fixed: dict[int, tuple[bool, ...]] = {}

    def __call__(self, module: nn.Module, _args: Any, out: Any) -> None:
        if not isinstance(out, torch.Tensor) or out.shape[:1] != (2,) or not out.is_floating_point():
            return
        if out.ndim == 4 and isinstance(module, nn.Conv2d) and self.patches is None:
            self.grids[int(out.shape[1])] = (int(out.shape[2]), int(out.shape[3]))
        elif out.ndim == 3:
            self._sequence(out.detach())

    def _sequence(self, out: torch.Tensor) -> None:  # (2, L, D)
        length, d = int(out.shape[1]), int(out.shape[2])
        if self.patches is None and d in self.grids:
            self.patches, self.width = self.grids[d], d
        if d == self.width:
            self.lengths[length] += 1
        if length not in self.fixed:
            x = out.float()
            gap = (x[0] - x[1]).abs().amax(dim=-1)  # (L,)
            same = gap <= SAME * float(x.abs().amax().nan_to_num(0.0))
            if not bool(same.all()):  # a position embedding alone (all the same) tells nothing
                self.fixed[length] = tuple(bool(v) for v in same.tolist())

    def facts(self) -> TokenFacts:
        tokens = self.lengths.most_common(1)[0][0] if self.lengths else None
        grid = self.patches
        return TokenFacts(grid[0] * grid[1] if grid else None, self.width, tokens, grid, dict(self.fixed))


def token_facts(model: nn.Module, size: tuple[int, int], entry: Callable[[torch.Tensor], Any] | None = None,
                device: torch.device | None = None) -> TokenFacts:
    """:class:`TokenFacts` of ``model`` at input ``size`` from one forward of a blank and a seeded noise image (all
    unknown when the model refuses them: the worker's probe reports that); hooks removed on every path."""
    noise = torch.randn((1, 3, *size), generator=torch.Generator().manual_seed(0))
    x = torch.cat([torch.zeros(1, 3, *size), noise]).to(device)
    watch = _Watch()
    handles = []
    try:
        handles = [m.register_forward_hook(watch) for name, m in model.named_modules() if name]
        with torch.inference_mode():
            (entry or model)(x)
    except Exception:  # noqa: BLE001 - a model that fails here fails the probe, which says why
        return TokenFacts(None, None, None)
    finally:
        for handle in handles:
            handle.remove()
    return watch.facts()


def _fix(claim: Claim, before: int) -> str:
    return (f"set model.prefix_tokens to {before}" if claim.by == "model.prefix_tokens" else
            f"set model.prefix_tokens to {before} (the count before the patches; the library's is not this layer's)")


def layer_tokens(length: int, facts: TokenFacts, claim: Claim) -> TokenLayout | Unknown | None:
    """The layout of a layer's sequence of ``length`` tokens, one case at a time; None: not a sequence of the patch
    grid (shorter than the grid, or more than twice as long: a CNN's map, Swin's merged stages, a class token alone)."""
    patches, grid = facts.patches, facts.grid
    if patches is None:
        # no patch grid to check against: the stated count, as stated
        if claim.before is None or not 0 <= claim.before < length:
            return Unknown(f"the model shows no patch grid (no convolution before its token sequences) and "
                           f"{claim.by} says nothing of its {length} tokens",
                           "set model.prefix_tokens to the count of tokens before the patch tokens")
        return TokenLayout(claim.before, length - claim.before, 0, None)
    extra = length - patches
    if not 0 <= extra < patches:
        return None
    # every position a patch: the tokens besides them are added in later layers (CaiT, XCiT), not in this one
    if extra == 0:
        return TokenLayout(0, patches, 0, grid)
    ends = facts.ends(length)
    # the fact: the tokens that do not depend on the image where they first appear
    if ends is not None:
        before, after = ends
        if claim.before is not None and claim.before != before:
            return Unknown(f"its {extra} tokens besides the {patches} patches are {before} before and {after} after "
                           f"them (the positions a blank and a noise image give alike), but {claim.by} says "
                           f"{claim.before} before them", _fix(claim, before), contradicted=True)
        return TokenLayout(before, patches, after, grid)
    # no such fact: the stated count, where it accounts for every token besides the patches
    if claim.before == extra:
        return TokenLayout(extra, patches, 0, grid)
    said = f"{claim.by} says {claim.before} before the patches" if claim.before is not None else "nothing says where"
    return Unknown(f"{length} tokens for a grid of {patches} patches: {extra} more, which no fact places (where "
                   f"sequences of {length} first appear, they depend on the image) and {said}; so which positions "
                   "are patches is not known",
                   f"set model.prefix_tokens to {extra} if all {extra} come before the patches")


def model_prefix(facts: TokenFacts, claim: Claim) -> int | None:
    """The tokens before the patches in the model's main sequence (its most common length), for the store's model
    record; None where that is not known."""
    if facts.tokens is None:
        return claim.before
    found = layer_tokens(facts.tokens, facts, claim)
    return found.before if isinstance(found, TokenLayout) else claim.before if found is None else None
