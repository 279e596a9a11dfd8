"""Which stored tokens of a capture are patches: the record of its layer's token sequence (written by the worker's
probe, one per capture) and the one rule every reader takes it by (streams, xarray, indexes, the viewer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

__all__ = ["TokenRecord", "patch_span"]


class TokenRecord(TypedDict):
    """A captured layer's token sequence as the model computed it: ``before`` tokens (CLS, registers), the
    ``patches`` (row after row of ``grid``), ``after`` tokens (YOLOS's detection tokens)."""

    before: int
    patches: int
    after: int
    grid: list[int] | None  # [h, w] of the patches; None where the patch embedding's grid is not known


def patch_span(record: Mapping[str, Any], model_prefix: int | None) -> tuple[int, int] | None:
    """Of each stored row of a (tokens, features) capture (its CaptureRecord): ``(first, count)``, the stored
    tokens that are patches; None where that is not known. ``model_prefix``: the store's ``model.prefix_tokens``,
    read only for a store from before each capture recorded its layer's tokens."""
    stored = int(record["shape"][0])
    sampled = record.get("sample_tokens")
    if "tokens" not in record:  # an older store: the model's count, in front of every layer's patches
        if record.get("drop_prefix"):
            return 0, stored
        if sampled:
            return int(record.get("prefix_kept") or 0), int(sampled)
        return None if model_prefix is None else (model_prefix, stored - model_prefix)
    layer = record["tokens"]
    if layer is None:
        return None
    if sampled:  # the tokens kept before the patches, the sampled patches, the tokens kept after them
        return int(record.get("prefix_kept") or 0), int(sampled)
    if "drop_prefix" in record:  # stored without the tokens besides the patches
        return 0, int(layer["patches"])
    return int(layer["before"]), int(layer["patches"])
