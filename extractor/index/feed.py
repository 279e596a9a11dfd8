"""A capture's rows fed to a feature index: how they read as positions x features (:class:`Layout`), cut into
blocks and encoded by a dictionary where there is one, added to an :class:`~.state.IndexState` (:class:`IndexFeed`;
numpy, or torch tensors where the device makes the blocks).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..store import patch_span
from .state import IndexState

__all__ = ["BLOCK_VALUES", "ENCODE_VALUES", "Encoder", "IndexFeed", "Layout"]

BLOCK_VALUES = 1 << 20  # activations (rows x positions x features) taken at once: 4 MB of float32 (measured: 2x
# faster than 64 MB blocks, whose temporaries are fresh pages each time)
ENCODE_VALUES = 1 << 24  # latents a dictionary encodes at once: 64 MB (measured over ViT-B tokens: 0.95x the bare
# loop's time, against 1.97x with 4 MB blocks: a matmul of one row's tokens and the calls around it)


@dataclass(frozen=True)
class Layout:
    """How the rows of a capture are read as the index's (positions, features): a map's channels at its y x x
    positions, a token sequence's features at its tokens (its patches; every token where asked for), a vector's
    features at one position."""

    kind: str  # map (channel, y, x), map_last (y, x, channel), tokens (token, feature), vector (feature)
    features: int  # per position, as stored
    positions: int  # indexed per row
    grid: tuple[int, int] | None  # the positions after ``prefix`` as a (h, w) grid, when they make one
    prefix: int  # leading positions indexed that are not in the grid (a ViT's CLS and registers, when included;
    # positions after the grid, YOLOS's detection tokens, are not in it either)
    skip: int = 0  # leading positions of each stored row left out (the tokens before the patches, unless included)
    covers: str | None = None  # of a token capture: "patches", "all" (the tokens besides them included), "unknown"

    @classmethod
    def of(cls, key: str, record: Mapping[str, Any], prefix_tokens: int | None,
           include_prefix: bool = False) -> Layout:
        """The layout of capture ``key`` (its CaptureRecord) as an index reads it: of a token sequence its patches
        (:func:`~extractor.store.patch_span`), or with ``include_prefix`` every token; ``prefix_tokens``: the
        model's count as the store records it (read only for a store from before each capture recorded its
        tokens)."""
        names = [d.rsplit(".", 1)[-1] for d in record["dims"]]
        shape = [int(v) for v in record["shape"]]
        if names == ["channel", "y", "x"]:
            return cls("map", shape[0], shape[1] * shape[2], (shape[1], shape[2]), 0)
        if names == ["y", "x", "channel"]:
            return cls("map_last", shape[2], shape[0] * shape[1], (shape[0], shape[1]), 0)
        if names == ["feature"] or names == ["channel"]:
            return cls("vector", shape[0], 1, None, 0)
        if names == ["token", "feature"]:
            return cls._tokens(record, shape, patch_span(record, prefix_tokens), include_prefix)
        raise ValueError(f"{key} is stored as ({', '.join(names)}): an index needs channels of a map, a token "
                         "sequence's features or a vector's features")

    @classmethod
    def _tokens(cls, record: Mapping[str, Any], shape: list[int], span: tuple[int, int] | None,
                include: bool) -> Layout:
        """A token sequence's layout: its patches (``span``: first, count of the stored tokens; None: not known,
        every token), or with ``include`` every token (those before the patches in front of the grid)."""
        stored, features = shape
        if span is None:
            return cls("tokens", features, stored, None, 0, 0, "unknown")
        first, count = span
        grid = None if record.get("sample_tokens") else _patch_grid(record, count)  # sampled: no grid
        if include and count < stored:
            return cls("tokens", features, stored, grid, first, 0, "all")
        return cls("tokens", features, count, grid, 0, first, "patches")

    def tokens(self, x: Any) -> Any:
        """Rows ``x`` (n, *shape) as (n, positions, features): a numpy array (float16: a view of ``x``, which the
        index converts once and bins by a table of its values; anything else a contiguous float32 copy), or a float32
        torch tensor on its device (the write-time index's blocks: ``extractor.index.device``)."""
        n = len(x)
        if not hasattr(x, "swapaxes"):
            x = np.asarray(x)
        if self.kind == "map":
            x = x.reshape(n, self.features, self.positions).swapaxes(1, 2)
        else:
            x = x.reshape(n, -1, self.features)[:, self.skip : self.skip + self.positions]
        if isinstance(x, np.ndarray):
            return x if x.dtype == np.float16 else np.ascontiguousarray(x, np.float32)
        return x.float()


def _patch_grid(record: Mapping[str, Any], count: int) -> tuple[int, int] | None:
    """The grid of a token capture's ``count`` patch tokens, as its record says (an older store's: a square)."""
    layer = record.get("tokens")
    if layer is not None and layer.get("grid"):
        h, w = layer["grid"]
        return (h, w) if h * w == count else None
    side = int(round(max(count, 0) ** 0.5))
    return (side, side) if side and side * side == count else None


class Encoder(Protocol):
    """What turns a position's stored features into the index's features: a dictionary's ``encode``."""

    @property
    def d_sae(self) -> int: ...

    def encode(self, x: Any) -> Any: ...  # (n, d_in) numpy or torch -> (n, d_sae) float32 of the same kind


class IndexFeed:
    """One index being computed over a stream of a capture's rows: its layout, its encoder (None: the capture's own
    features), its state. A post-hoc pass adds the store's chunks (``add``); a job's write-time index adds each
    computed batch's blocks made on the device (``extractor.index.device``, from :meth:`blocks`) and the
    chunks of rows it did not compute. The state does not depend on how rows are cut into blocks."""

    def __init__(self, layout: Layout, k: int, pool: str, threshold: float, encoder: Encoder | None = None,
                 normalize: tuple[np.ndarray | None, float | None] = (None, None)) -> None:
        """``normalize``: what is subtracted from each position's stored features (per feature) and what they are
        divided by before they are indexed or encoded (None: nothing), as a normalised token stream serves them."""
        self.layout, self.encoder = layout, encoder
        self.shift, self.scale = normalize
        features = encoder.d_sae if encoder is not None else layout.features
        self.state = IndexState(features, layout.positions, k, pool, threshold)

    def lane(self) -> IndexFeed:
        """A feed for another thread beside this one: the same layout and encoder, a :meth:`IndexState.lane` of its
        state (counts of its own, the slots shared); its state is joined to this one's once done."""
        feed = copy.copy(self)
        feed.state = self.state.lane()
        return feed

    def blocks(self, x: Any, rows: np.ndarray) -> Iterator[tuple[Any, np.ndarray]]:
        """Rows ``x`` (n, *shape) of the capture (numpy, or a torch tensor on its device) of store rows ``rows``, cut
        into blocks from the first: each as (n', positions, features) float32 of the index's features (encoded by
        the dictionary) of the same kind, with its rows."""
        step = self.state.block_rows(BLOCK_VALUES if self.encoder is None else ENCODE_VALUES)
        for a in range(0, len(x), step):
            acts = self.layout.tokens(x[a : a + step])
            if self.shift is not None or self.scale is not None:
                acts = self.normalized(acts)
            if self.encoder is not None:
                n, t, d = acts.shape
                acts = self.encoder.encode(acts.reshape(n * t, d)).reshape(n, t, -1)
            yield acts, rows[a : a + step]

    def normalized(self, acts: Any) -> Any:
        """``(acts - shift) / scale`` in float32 (numpy, or a torch tensor on its device), as ``token_batches``
        normalises (``extractor.read.batching._normalized``)."""
        if isinstance(acts, np.ndarray):
            out = acts.astype(np.float32)
            if self.shift is not None:
                out -= self.shift
            if self.scale is not None:
                out /= np.float32(self.scale)
            return out
        if self.shift is not None:
            acts = acts - acts.new_tensor(self.shift)
        return acts / float(self.scale) if self.scale is not None else acts

    def add(self, x: np.ndarray, rows: np.ndarray) -> None:
        """Add rows ``x`` (n, *shape) of the capture, store rows ``rows`` (ok rows only), on the host."""
        for acts, block_rows in self.blocks(x, rows):
            self.state.update(acts, block_rows)
