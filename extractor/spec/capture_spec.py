"""The job spec's ``capture`` entries: which layers, what of them, how reduced and stored, and a write-time
feature index."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .section import _Section

__all__ = ["CaptureSpec", "FeatureIndexSpec", "index_name_problem"]

_METADATA = {"zarr.json", "zarr.json.tmp"}  # a store's own objects in a group: an index of that name overwrites one


def index_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a feature index in a store (its group ``indexes/<name>``), in one line; None: it
    can. One word of the store: no path (``/``, ``\\``, ``.``, ``..``), nothing hidden (a leading ``.``), nothing
    Zarr reserves (a leading ``__``: the store's ``__txn``), no object of the store's own (``zarr.json``), no control
    character."""
    why = None
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith("."):
        why = "no '/', no leading '.'"
    elif name.startswith("__"):
        why = "no leading '__', which Zarr keeps"
    elif name in _METADATA:
        why = f"not {name}, which is the store's own metadata"
    elif re.search(r"[\x00-\x1f\x7f]", name):
        why = "no control character"
    if why is None:
        return None
    return (f"index name {name!r}: an index is named by one word of the store ({why}), such as blocks.11 or "
            "blocks.11@my_sae")


class FeatureIndexSpec(_Section):
    """A feature index of the capture made while the job runs (no second pass): each feature's top rows, firing
    density and histograms, kept per shard and merged at the end (``indexes/<name>``; ``extractor index`` makes the
    same after the fact)."""

    k: int = Field(default=16, ge=1)
    """Top rows kept per feature."""
    pool: Literal["max", "mean"] = "max"
    """How a feature's values at a row's positions (patches, tokens) rank the row."""
    threshold: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """A feature fires where it is above this."""
    dictionary: str | None = None
    """An SAE's encoder (.safetensors, .npz, .pt or a SAELens folder) whose latents are the features; none: the
    capture's own channels or features."""
    activation: str | None = None
    """The dictionary's activation (relu, jumprelu, topk:K); default: what its file says."""
    name: str | None = None
    """The index's name in the store (default: the capture's key, ``KEY@<dictionary stem>`` with a dictionary)."""
    include_prefix: bool = False
    """Index a token sequence's prefix tokens (CLS, registers) too; by default only its patches, as its heatmaps
    show (every token where the model's prefix tokens are not known)."""

    @field_validator("name")
    @classmethod
    def _one_word(cls, name: str | None) -> str | None:
        problem = None if name is None else index_name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        return name


class CaptureSpec(_Section):
    layer: str
    """Module name as in ``model.named_modules()``, a glob (``layer4.*.conv2``), or ``(model)`` (also
    ``""``): what the model's forward (or ``model.call``) returns."""
    what: Literal["output", "input", "grad_output", "gradcam"] = "output"
    """The module's output or input (its one positional argument; with ``index``, the Nth one, or a
    keyword argument or key of a dict argument); the gradient of the target score with respect
    to its output; or a Grad-CAM map built from its output and that gradient."""
    index: int | str | None = None
    """Element of a tuple/list (int) or dict/dataclass (str) output or input."""
    reduce: Literal["none", "mean", "max", "flatten", "cls"] = "none"
    """none; mean/max over spatial positions or tokens (prefix tokens included unless ``drop_prefix``);
    flatten; cls (token 0)."""
    drop_prefix: bool = False
    """For token sequences (batch, tokens, features): keep the patch tokens only, before reducing or storing (the
    CLS and register tokens before them and YOLOS's detection tokens after them left out: each layer's own, decided
    when the model is probed)."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Stored dtype (Grad-CAM maps are always float32). float16 is finite up to 65504; bfloat16 keeps float32's
    range with 8 bits of mantissa, and reads back as bfloat16 (numpy's through ml_dtypes)."""
    key: str | None = None
    """Array name in the store (default: the layer name). With a glob, a template: ``{layer}.cls``."""
    target: int | Literal["predicted", "label"] | None = None
    """For grad_output and gradcam: whose logit to differentiate: the arg-max class (default),
    the row's label, or a class index."""
    size: Literal["layer", "input"] = "layer"
    """For gradcam: keep the map at the layer's resolution or upsample it (bilinear) to the crop."""
    sample_tokens: int | None = Field(default=None, gt=0)
    """For token sequences stored whole (reduce: none): keep this many patch tokens per image, drawn without
    replacement from (``seed``, row) on the device, in sequence order; the tokens before the patches (CLS,
    registers) stay in front and those after them after, unless ``drop_prefix``. The kept positions (in the layer's
    sequence) are stored as ``KEY.token_index``."""
    project: int | None = Field(default=None, gt=0)
    """Store a seeded random projection of the last dimension (features) to this many, computed on the device
    (``projection``: its matrix; the reader regenerates it from ``seed``: ``s.projection(KEY)``)."""
    projection: Literal["gaussian", "sparse"] = "gaussian"
    """With ``project``: Gaussian entries, or sparse Rademacher ones (+-sqrt(3/D) with probability 1/6 each);
    both keep norms in expectation."""
    seed: int = Field(default=0, ge=0)
    """The seed of ``sample_tokens`` and ``project``."""
    layout: Literal["auto", "nchw", "nhwc", "attention"] = "auto"
    """How a 4-D output holds its dims: (batch, channel, y, x), (batch, y, x, channel) as in Swin and
    ConvNeXt blocks, or attention probabilities (batch, head, query, key). ``auto`` decides from
    facts (probabilities that sum to 1, the module's type, which dims grow with the input size)
    and refuses when they do not decide."""
    feature_index: FeatureIndexSpec | None = None
    """Index what each of the capture's features responds to while the job runs (``{k: 16}``; see
    ``extractor index``)."""

    @field_validator("key")
    @classmethod
    def _template(cls, key: str | None) -> str | None:
        if key is not None and "{" in key:
            try:
                key.format(layer="x")
            except (KeyError, IndexError, ValueError):
                raise ValueError(f"a key template takes only {{layer}}, not {key!r}") from None
        return key

    @model_validator(mode="after")
    def _gradient_fields(self) -> CaptureSpec:
        grad = self.what in ("grad_output", "gradcam")
        if self.target is not None and not grad:
            raise ValueError("target applies only to what: grad_output or gradcam")
        if self.size != "layer" and self.what != "gradcam":
            raise ValueError("size applies only to what: gradcam")
        if self.what == "gradcam" and (self.reduce != "none" or self.index is not None):
            raise ValueError("a gradcam capture takes no reduce or index: it is one map per image")
        if self.what == "gradcam" and self.dtype != "float32":
            raise ValueError(f"a gradcam map is stored as float32 (it is normalised per image), not {self.dtype}: "
                             "leave dtype out")
        if isinstance(self.target, int) and self.target < 0:
            raise ValueError("target must be a class index >= 0, 'predicted' or 'label'")
        if self.drop_prefix and (self.reduce == "cls" or self.what == "gradcam"):
            raise ValueError("drop_prefix leaves out the CLS token: it does not go with reduce: cls or gradcam")
        return self

    @model_validator(mode="after")
    def _cutting_fields(self) -> CaptureSpec:
        if self.sample_tokens is not None and (self.reduce != "none" or self.what == "gradcam"):
            raise ValueError("sample_tokens keeps some tokens of each image's sequence: it takes reduce: none (and "
                             "no gradcam)")
        if self.project is not None and self.what == "gradcam":
            raise ValueError("project applies to features, not to a gradcam map")
        if self.projection != "gaussian" and self.project is None:
            raise ValueError("projection applies only with project: D")
        return self

    @property
    def gradient(self) -> bool:
        return self.what in ("grad_output", "gradcam")

    @property
    def score_target(self) -> int | str:
        return "predicted" if self.target is None else self.target
