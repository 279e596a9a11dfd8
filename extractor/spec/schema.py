"""The job spec's schema: a frozen, strictly validated tree of pydantic models.

Unknown keys, wrong types and bad values raise :class:`~extractor.errors.SpecError` (through
:mod:`.load`) whose message names the field path (``capture[1].reduce: ...``).
"""

from __future__ import annotations

import copy
import math
import os
import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .identity import RESOLVED, RUN_ONLY, _marked, redact

__all__ = ["JobSpec"]


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")


def _leaf_types(ann: Any) -> set[Any]:
    """The leaf types of an annotation, also inside unions and tuples: tuple[float, ...] | Literal["auto"]."""
    args, todo = set(), [ann]
    while todo:
        inner = get_args(todo.pop())
        todo += [a for a in inner if get_args(a)]
        args |= {a for a in inner if not get_args(a)}
    return args or {ann}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """``batch_size: true`` is a mistake, not 1: only fields that take a bool take one."""
        if info.field_name is None:
            return value
        args = _leaf_types(cls.model_fields[info.field_name].annotation)
        if bool in args or not args & {int, float}:
            return value  # a bool is welcome here, or pydantic refuses it anyway
        if isinstance(value, bool):
            raise ValueError(f"expected {'an integer' if int in args else 'a number'}, not {str(value).lower()}")
        if isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value):  # mean: [true, 0.4, 0.4]
            raise ValueError(f"expected numbers, not {[str(v).lower() if isinstance(v, bool) else v for v in value]}")
        return value


MODEL_SOURCES = ("torchvision", "timm", "hf", "open_clip", "python")
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


def looks_like_path(weights: str) -> bool:
    """A ``model.weights`` value that names a file (a checkpoint), not a weights name or tag."""
    return "/" in weights or os.sep in weights or weights.endswith(CHECKPOINT_SUFFIXES) or os.path.exists(weights)


def model_folder(name: str | None) -> tuple[str, str] | None:
    """``(prefix, folder)`` of a model name that names a local folder (``hf:FOLDER``,
    ``open_clip:local-dir:FOLDER``), which workers elsewhere need as an absolute path."""
    for prefix in ("hf:", "open_clip:local-dir:"):
        if name and name.startswith(prefix) and os.path.isdir(name[len(prefix):]):
            return prefix, name[len(prefix):]
    return None


def weights_kind(weights: str | None) -> Literal["auto", "random", "pretrained", "file", "name"]:
    """What a ``model.weights`` value asks for: ``auto`` (what the model's name points at), ``random``
    (``random`` or null), ``pretrained``, a checkpoint ``file``, or a library's weights ``name`` (a
    torchvision weights enum member, an open_clip tag). The one place this is decided."""
    if weights is None or weights == "random":
        return "random"
    if weights == "auto":
        return "auto"
    if weights == "pretrained":
        return "pretrained"
    return "file" if looks_like_path(weights) else "name"


class ModelSpec(_Section):
    name: str | None = "resnet18"
    """A torchvision classification builder (``resnet50``), or ``timm:NAME`` (``timm.create_model``),
    ``hf:ID_OR_FOLDER`` (Hugging Face transformers; the vision tower of CLIP/SigLIP-style models),
    ``open_clip:ARCH`` (the visual tower: its output is ``encode_image``); ``python:CLASS`` names a
    module given to ``extractor.run(..., model=...)``."""
    weights: str | None = "auto"
    """``auto`` (the default): the weights the model's name points at (an ``hf:`` folder's or hub id's,
    an open_clip ``hf-hub:``/``local-dir:`` model's; a factory's or a module's as they are built);
    a bare architecture name (torchvision, timm, ``open_clip:ARCH``) asks for one of the others.
    ``pretrained`` (the library's own weights: timm's tag, the HF model's), a torchvision weights
    name (``IMAGENET1K_V1``, ``DEFAULT``), an open_clip pretrained tag, a checkpoint file (``.pt``,
    ``.pth``, ``.bin``, ``.safetensors``), or ``random`` (also null): a random init (seed 0), only
    when asked. Read from local caches only unless EXTRACTOR_ALLOW_DOWNLOAD=1."""
    factory: str | None = None
    """``pkg.module:function`` returning an ``nn.Module``; used instead of ``name``. A module in the
    current folder is found (as ``python -m`` finds it)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the builder: the factory, ``timm.create_model`` (``img_size: 64``), a
    Hugging Face config override (``num_hidden_layers: 4``), ``open_clip.create_model``, or a
    torchvision builder."""
    call: str | None = None
    """A method to call instead of ``forward`` (``encode_image`` of an open_clip CLIP); hooks and
    layer names stay those of the model."""
    input: str = "positional"
    """How the pixels are passed: as the first positional argument, or as this keyword (``pixel_values``)."""
    forward_kwargs: dict[str, Any] = Field(default_factory=dict)
    """More keyword arguments of every call (``output_attentions: true``, ``interpolate_pos_encoding: true``)."""
    prefix_tokens: int | Literal["auto"] = "auto"
    """Tokens before the patch tokens (CLS, distillation, registers) that ``drop_prefix`` leaves out:
    ``auto`` decides from the model's token sequences (their length less the patch grid at the input
    size, checked against timm's ``num_prefix_tokens``) and asks when they do not tell."""
    device: str = Field(default="auto", json_schema_extra=RUN_ONLY)
    """``auto`` (cuda when available, else cpu), ``cpu``, ``cuda``, ``cuda:1``..."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype; bfloat16/float16 run the forward under autocast."""
    channels_last: bool = True
    """Run convolutions in channels-last memory format (faster on CPU and recent GPUs)."""
    compile: bool = Field(default=False, json_schema_extra=RUN_ONLY)
    """Compile the hooked model with ``torch.compile`` (hooks are registered first and traced
    into the graph). Pays a compile of tens of seconds per worker; worth it on long GPU runs."""

    @model_validator(mode="before")
    @classmethod
    def _a_factory_has_no_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "factory_kwargs" in data:  # the older name of kwargs (stored specs)
            if data.get("kwargs"):
                raise ValueError("set model.kwargs only (factory_kwargs is its older name)")
            data = {**{k: v for k, v in data.items() if k != "factory_kwargs"}, "kwargs": data["factory_kwargs"]}
        if isinstance(data, dict) and data.get("factory") is not None and "name" not in data:
            return {**data, "name": None}  # not the default resnet18: the factory's model is what runs
        return data

    @model_validator(mode="after")
    def _name_or_factory(self) -> ModelSpec:
        if self.factory is not None and self.name and "name" in self.model_fields_set:
            raise ValueError("set either model.name or model.factory, not both")
        if self.factory is None and not self.name:
            raise ValueError("set model.name (a torchvision model, timm:NAME, hf:ID or open_clip:ARCH) or "
                             "model.factory")
        if self.factory is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.factory):
            raise ValueError(f"model.factory must look like 'pkg.module:function', got {self.factory!r}")
        if self.name and ":" in self.name and self.source not in MODEL_SOURCES:
            raise ValueError(f"model.name {self.name!r}: unknown source {self.source!r}; use a torchvision name, "
                             "timm:NAME, hf:ID_OR_FOLDER or open_clip:ARCH (a function building the model is "
                             "model.factory, or --factory for extractor layers)")
        if self.name and not self.model:
            raise ValueError(f"model.name {self.name!r} names no model after {self.source}:")
        return self

    @model_validator(mode="after")
    def _call_fields(self) -> ModelSpec:
        if self.input != "positional" and not self.input.isidentifier():
            raise ValueError(f"model.input must be positional or a keyword name, not {self.input!r}")
        if isinstance(self.prefix_tokens, int) and self.prefix_tokens < 0:
            raise ValueError("model.prefix_tokens must be auto or a count >= 0")
        return self

    @property
    def weights_kind(self) -> str:
        """What ``weights`` names (see :func:`weights_kind`)."""
        return weights_kind(self.weights)

    @property
    def source(self) -> str:
        """``torchvision``, ``timm``, ``hf``, ``open_clip``, ``python`` (a module given to run) or ``factory``."""
        if self.factory is not None:
            return "factory"
        assert self.name is not None
        prefix, sep, _ = self.name.partition(":")
        return prefix if sep else "torchvision"

    @property
    def model(self) -> str:
        """The name without its source (``vit_small_patch16_224`` of ``timm:vit_small_patch16_224``)."""
        if self.factory is not None:
            return self.factory
        assert self.name is not None
        prefix, sep, rest = self.name.partition(":")
        return rest if sep else prefix


def _auto_or_at_least(value: int | str, low: int, note: str = "") -> int | str:
    """A setting that is ``auto`` or a number of at least ``low``."""
    if isinstance(value, int) and value < low:
        raise ValueError(f"expected auto or a number >= {low}{note}, not {value}")
    return value


_SOURCE_NEEDS = {  # data.source: the settings of which it needs one, as the error names them
    "folder": (("root",), "data.root (the image folder)"),
    "manifest": (("manifest",), "data.manifest (a .csv or .jsonl file)"),
    "tar": (("tars",), "data.tars (tar paths or URLs, brace patterns allowed)"),
    "parquet": (("parquet", "dataset"), "data.parquet (Parquet paths or URLs, globs and brace patterns allowed) or "
                "data.dataset (a Hugging Face data set in the local cache: ORG/NAME)"),
}


class DataSpec(_Section):
    source: Literal["folder", "manifest", "tar", "parquet"] = "folder"
    """``folder`` (recursive walk; ImageFolder labels), ``manifest`` (CSV/JSONL), ``tar`` (WebDataset shards) or
    ``parquet`` (Parquet files, the Hugging Face datasets layout)."""
    root: str | None = None
    """Folder of images (a path or fsspec URL); for a manifest, the base of relative paths
    (default: the manifest's folder)."""
    manifest: str | None = None
    """CSV or JSONL file (path or URL) with a ``path`` column and optional ``id`` and ``label``."""
    outside_root: bool = False
    """Let a manifest's rows name images outside ``data.root`` (or the manifest's folder), and a Parquet row
    whose image is a path name a file outside its Parquet file's folder: absolute paths, URLs, ``..``. Off: such
    a manifest row is refused before any work, such a Parquet row fails without its file being opened, so
    neither can point the job at any file the machine can read."""
    tars: str | tuple[str, ...] | None = None
    """WebDataset tar shards: paths or URLs with brace patterns (``shards/{000000..000099}.tar``)."""
    parquet: str | tuple[str, ...] | None = None
    """Parquet files: paths or URLs with globs (``data/train-*.parquet``) or brace patterns. Each row holds an
    image (encoded bytes, a struct of ``bytes`` and ``path`` as Hugging Face writes it, or a path), and optionally
    a label (integers, class names from the file's Hugging Face metadata when it has them, or strings) and an id
    (else the file and row: ``train-00000-of-00004/17``). A relative image path is in the Parquet file's folder."""
    dataset: str | None = None
    """Instead of ``data.parquet``: a Hugging Face data set by name (``ORG/NAME``), read from the Parquet files of
    the local Hugging Face cache (``hf download ORG/NAME --repo-type dataset`` fetches them; extractor downloads
    only with ``EXTRACTOR_ALLOW_DOWNLOAD=1``)."""
    split: str = "train"
    """The split of ``data.dataset``: its files named ``SPLIT-*.parquet`` or in a folder ``SPLIT``."""
    config: str | None = None
    """The configuration (subset) of ``data.dataset``: its files in a folder of that name."""
    columns: dict[Literal["image", "label", "id"], str] = Field(default_factory=dict)
    """A manifest's or Parquet file's column names, where they are not the defaults (a manifest's ``path``,
    Parquet's ``image``; ``label``, ``id``): ``{image: file_name}`` reads a Hugging Face imagefolder's
    ``metadata.csv`` as it is, ``{image: jpg, label: cls}`` a Parquet file of WebDataset-like columns."""
    classes: tuple[str, ...] | None = None
    """Class names: label i is ``classes[i]``, stored as the store's ``classes``. For integer labels (a tar's
    ``.cls``, a manifest's numbers) a label outside them is refused; labels that are names (or folders) take
    their index from this list (a name not in it is refused), instead of the sorted names."""
    storage_options: dict[str, Any] = Field(default_factory=dict, json_schema_extra=RUN_ONLY)
    """fsspec options for remote images, manifests and tars (``endpoint_url``, ``key``, ``secret``...)."""
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS
    """File name endings taken as images by the folder source (case-insensitive)."""
    preprocess: Literal["auto", "imagenet", "library"] = Field(default="auto", json_schema_extra=RESOLVED)
    """Where the settings below that are left at ``auto`` come from: the model's own library (timm's
    data config, the Hugging Face image processor, open_clip's transform, torchvision's weights
    transforms), taken only when the probe shows extractor's resize and crop equal to that library's own
    processor; or ``imagenet`` (shorter side 256, crop 224, bilinear, ImageNet mean and std); or ``library``:
    the model's own processor runs as it is, per image in the decode workers (CPU; slower, right by
    construction), with no ``data.*`` setting of its own."""
    resize: int | tuple[int, int] | None | Literal["auto"] = Field(default="auto", json_schema_extra=RESOLVED)
    """``auto`` (see ``preprocess``); an int resizes the shorter side to it; ``[H, W]`` squashes every
    image to that size (no aspect kept); null: no resize."""
    crop: int | tuple[int, int] | None | Literal["auto"] = Field(default="auto", json_schema_extra=RESOLVED)
    """``auto`` (the model's), a centre crop to a square of this size or to ``[H, W]``, or null
    (no crop: then ``resize`` is ``[H, W]``). The crop is the model's input size."""
    crop_pct: float | None = Field(default=None, gt=0, le=1, json_schema_extra=RESOLVED)
    """Instead of ``resize``: resize the shorter side to ``crop / crop_pct`` (timm's convention)."""
    interpolation: Literal["auto", "bilinear", "bicubic", "nearest", "lanczos", "box", "hamming"] = Field(
        default="auto", json_schema_extra=RESOLVED)
    jpeg_draft: bool = False
    """Decode large JPEGs at 1/2, 1/4 or 1/8 scale (libjpeg's DCT-domain downscale, Pillow's draft
    mode) when that still leaves the shorter side at least ``resize``: about 1.5 to 2 times faster
    on photos at least twice the input size. It changes pixels a little (``make bench`` reports
    how much); off by default. CPU decoding only (not ``decode_device: cuda``)."""
    max_image_pixels: int = Field(default=178_956_970, gt=0)
    """Images with more pixels fail their row before decoding (decompression bombs); raise it for trusted data."""
    mean: tuple[float, float, float] | Literal["auto"] = Field(default="auto", json_schema_extra=RESOLVED)
    """Per-channel mean of the normalisation (``auto``: the model's; ImageNet's for torchvision)."""
    std: tuple[float, float, float] | Literal["auto"] = Field(default="auto", json_schema_extra=RESOLVED)
    shard_size: int = Field(default=1024, gt=0)
    """Rows per shard, the unit of work, retry and resume."""
    batch_size: int = Field(default=64, gt=0, json_schema_extra=RUN_ONLY)
    decode_workers: int | Literal["auto"] = Field(default="auto", json_schema_extra=RUN_ONLY)
    """Threads decoding images ahead of the forward pass: ``auto``, one per CPU of the worker (its
    ``cluster.cpus_per_worker`` on Ray, else the CPUs this process may use; at most 32), or a
    number (0: decode inline)."""
    decode_device: Literal["cpu", "cuda"] = "cpu"
    """Where JPEG files are decoded: ``cpu`` (Pillow) or ``cuda`` (nvJPEG through
    ``torchvision.io.decode_jpeg``, resized and cropped on the GPU; other formats and files
    nvJPEG rejects are decoded on the CPU). Pixels differ from Pillow's by a few levels."""

    @field_validator("decode_workers")
    @classmethod
    def _workers(cls, value: int | str) -> int | str:
        return _auto_or_at_least(value, 0, " (0: decode inline)")

    @model_validator(mode="after")
    def _draft(self) -> DataSpec:
        if self.jpeg_draft and self.decode_device == "cuda":
            raise ValueError("data.jpeg_draft makes the CPU decoder faster; with data.decode_device: cuda the GPU "
                             "decodes at full size: remove jpeg_draft, or set decode_device: cpu")
        if self.jpeg_draft and self.resize is None:
            raise ValueError("data.jpeg_draft decodes at a scale that the resize allows; with resize: null "
                             "nothing is resized, so it would do nothing: remove jpeg_draft")
        return self

    @model_validator(mode="after")
    def _library(self) -> DataSpec:
        if self.preprocess != "library":
            return self
        given = [f for f in ("resize", "crop", "interpolation", "mean", "std") if getattr(self, f) != "auto"]
        given += ["crop_pct"] if self.crop_pct is not None else []
        if given:
            raise ValueError(f"data.{given[0]} is set, but data.preprocess: library runs the model's own processor "
                             f"as it is: remove data.{', data.'.join(given)}, or set data.preprocess: auto")
        if self.decode_device == "cuda" or self.jpeg_draft:
            what = "decode_device: cuda" if self.decode_device == "cuda" else "jpeg_draft"
            raise ValueError(f"data.{what} changes how extractor decodes, but data.preprocess: library hands each "
                             f"image to the model's own processor on the CPU: remove data.{what}")
        return self

    @model_validator(mode="after")
    def _source_fields(self) -> DataSpec:
        fields, what = _SOURCE_NEEDS[self.source]
        if not any(getattr(self, f) for f in fields):
            raise ValueError(f"data.source {self.source!r} needs {what}")
        if self.parquet and self.dataset:
            raise ValueError("data.parquet and data.dataset both name the files to read: keep one")
        if self.dataset and self.source != "parquet":
            raise ValueError(f"data.dataset names a Hugging Face data set, read with data.source: parquet; data.source "
                             f"is {self.source!r}")
        if self.columns and self.source not in ("manifest", "parquet"):
            raise ValueError(f"data.columns names a manifest's or Parquet file's columns; data.source is "
                             f"{self.source!r}: remove it")
        if self.classes is not None and len(set(self.classes)) != len(self.classes):
            raise ValueError("data.classes names a class twice: each label needs one name")
        return self

    @model_validator(mode="after")
    def _sizes(self) -> DataSpec:
        if self.std != "auto" and any(s <= 0 for s in self.std):
            raise ValueError("data.std values must be positive")
        for name in ("resize", "crop"):
            value = getattr(self, name)
            sizes = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, int) and v <= 0 for v in sizes):
                raise ValueError(f"data.{name} must be positive pixels, not {value}")
        if isinstance(self.resize, int) and isinstance(self.crop, int) and self.crop > self.resize:
            raise ValueError(f"data.crop ({self.crop}) is larger than data.resize ({self.resize}), the shorter side "
                             "after resizing: the crop would be padded with black. Set crop <= resize")
        return self


class FeatureIndexSpec(_Section):
    """A feature index of the capture made while the job runs (no second pass): each feature's top rows, firing
    density and histograms, kept per shard and merged at the end (``indexes/<name>``; ``extractor index`` makes the
    same after the fact)."""

    k: int = Field(default=16, ge=1)
    """Top rows kept per feature."""
    pool: Literal["max", "mean"] = "max"
    """How a feature's values at a row's positions (patches, tokens) rank the row."""
    threshold: float = Field(default=0.0, ge=0)
    """A feature fires where it is above this."""
    dictionary: str | None = None
    """An SAE's encoder (.safetensors, .npz, .pt or a SAELens folder) whose latents are the features; none: the
    capture's own channels or features."""
    activation: str | None = None
    """The dictionary's activation (relu, jumprelu, topk:K); default: what its file says."""
    name: str | None = None
    """The index's name in the store (default: the capture's key, ``KEY@<dictionary stem>`` with a dictionary)."""


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
    """For token sequences (batch, tokens, features): leave out the prefix tokens (CLS, registers;
    ``model.prefix_tokens``) before reducing or storing: patch tokens only."""
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
    replacement from (``seed``, row) on the device, in sequence order; the prefix tokens (CLS, registers) stay in
    front unless ``drop_prefix``. The kept positions (in the layer's sequence) are stored as ``KEY.token_index``."""
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


class OutputSpec(_Section):
    store: str = Field(default="out.zarr", json_schema_extra=RUN_ONLY)
    """Path or fsspec URL (``s3://bucket/run.zarr``) of the Zarr store to write."""
    storage_options: dict[str, Any] = Field(default_factory=dict, json_schema_extra=RUN_ONLY)
    """fsspec options for a remote store; secrets here are never written to the store or logs."""
    chunk_rows: int | Literal["auto"] = Field(default="auto", json_schema_extra=RUN_ONLY)  # never changes values
    """Rows per chunk of every capture array, a divisor of data.shard_size; or ``auto`` (the
    default), decided per capture when the store is made: the largest divisor of data.shard_size
    up to 256 (250 for shards of 1000, 100 for 100), or more for a capture with small rows, up to
    about 1 MiB per chunk and a whole shard (512 rows for 512 float32 features). Chunking never
    changes values: a resumed store keeps its own."""
    sharding: bool = Field(default=True, json_schema_extra=RUN_ONLY)  # never changes values
    """Each work shard of a capture is one storage object (a Zarr v3 shard) holding chunks of
    ``chunk_rows`` rows, read one at a time: a row's read costs its chunk, not the shard. With it,
    ``chunk_rows: auto`` makes chunks of about 1 MiB (fewer rows for large rows, at least one).
    false: every chunk its own object (stores before it: a resumed store keeps its own)."""
    compression: Literal["zstd", "blosc", "gzip", "none"] = "zstd"
    compression_level: int | None = None
    if_exists: Literal["error", "resume", "overwrite"] = Field(default="error", json_schema_extra=RUN_ONLY)
    """What to do when the store exists (``--resume`` / ``--overwrite`` set this)."""
    reuse: tuple[str, ...] = Field(default=(), json_schema_extra=RUN_ONLY)  # what it takes is checked to match
    """Other stores (paths or URLs, read with ``storage_options``) to take rows from instead of computing
    them: a row whose image has the content digest of an ok row there is copied, when the store was made
    by the same model weights, preprocessing and captures (checked before the job starts; a store that
    differs is refused, naming how). The store records where each row came from (``reused``)."""
    on_change: Literal["refuse", "redo"] = Field(default="refuse", json_schema_extra=RUN_ONLY)
    """What ``--resume`` does when images of rows already computed changed since (their content digest
    differs where the source's size, modification time or ETag did): ``refuse`` names them; ``redo``
    computes their shards again. Never a store that mixes both versions."""
    lease_timeout_s: float = Field(default=60.0, gt=0, json_schema_extra=RUN_ONLY)
    """A running job renews its lease on the store; one silent this long is taken to be dead."""

    @field_validator("chunk_rows")
    @classmethod
    def _chunk_rows(cls, value: int | str) -> int | str:
        return _auto_or_at_least(value, 1)

    @field_validator("compression_level")
    @classmethod
    def _level_in_range(cls, level: int | None, info: ValidationInfo) -> int | None:
        compression = info.data.get("compression")
        if level is None or compression is None:  # unset, or compression itself is invalid (said already)
            return level
        if compression not in _LEVELS:
            raise ValueError("compression is none, so there is no level to set; remove compression_level")
        low, high = _LEVELS[compression]
        if not low <= level <= high:
            raise ValueError(f"{level} is out of range for {compression}: use {low} to {high}, "
                             "or leave it unset for the default")
        return level


_LEVELS = {"zstd": (-131072, 22), "blosc": (0, 9), "gzip": (0, 9)}  # what each codec accepts


class ClusterSpec(_Section):
    backend: Literal["ray", "local"] = "ray"
    """``ray`` runs one worker actor per GPU on a Ray cluster; ``local`` runs the worker in this process."""
    address: str | None = None
    """null starts an embedded local Ray for the job (loopback only); ``auto`` or ``HOST:PORT`` joins a cluster."""
    workers: int | Literal["auto"] = "auto"
    """Worker actors. ``auto``: as many as the cluster's free resources hold at the start (one per
    GPU; on CPU-only clusters one per ``cpus_per_worker``), and more as capacity frees or nodes
    join during the job, up to ``max_workers``. A number N: N workers; those that do not fit yet
    start when capacity appears. Either way the job goes on with the workers it has."""
    max_workers: int | None = Field(default=None, gt=0)
    """With ``workers: auto``, at most this many workers (default: no limit)."""
    gpus_per_worker: float | None = Field(default=None, ge=0)
    """GPUs per worker, fractions allowed (default: 1 when the cluster has GPUs, else 0)."""
    cpus_per_worker: float | None = Field(default=None, gt=0)
    """CPUs per worker for decoding and torch threads (default: the cluster's CPUs / workers, at most 8)."""
    max_retries: int = Field(default=3, ge=0)
    """Times a shard is retried after its worker died or raised, before the job fails."""
    local_cpus: int | None = Field(default=None, gt=0)
    """CPUs of the embedded local Ray (default: all of this machine's)."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    """How long to wait for the workers to build their models, and, when no worker is left (lost
    nodes), for one to be placed again before the job stops (resumable)."""

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        if value is None:  # specs written before workers: auto
            return "auto"
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"expected auto or a number >= 1, not {value}")
        return value

    @model_validator(mode="after")
    def _max_workers(self) -> ClusterSpec:
        if self.max_workers is not None and self.workers != "auto":
            raise ValueError(f"max_workers caps workers: auto; with workers: {self.workers} that number is the most "
                             "(remove one of them)")
        return self


class SubmitSpec(_Section):
    working_dir: str | None = None
    """A folder uploaded with the job (e.g. the code of a model.factory); the spec travels beside it."""
    pip: tuple[str, ...] = ()
    """Packages pip installs for the job on the cluster (e.g. extractor itself)."""
    env_vars: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the job on the cluster."""


MAX_AUTO_CHUNK_ROWS = 256  # output.chunk_rows: auto goes beyond it only for captures with small rows
MIN_AUTO_CHUNK_ROWS = 16  # nor goes below it, unless the shard itself is smaller
AUTO_CHUNK_BYTES = 1 << 20  # rows of small captures fill chunks up to about this size


def auto_inner_rows(shard_size: int, row_bytes: int) -> int:
    """Rows per chunk of a sharded capture: the largest divisor of ``shard_size`` whose chunk of rows of
    ``row_bytes`` holds at most AUTO_CHUNK_BYTES (one row at least)."""
    return max(d for d in range(1, shard_size + 1) if shard_size % d == 0 and (d == 1 or d * row_bytes
                                                                                <= AUTO_CHUNK_BYTES))


def auto_chunk_rows(shard_size: int, row_bytes: int = 0) -> int:
    """The largest divisor of ``shard_size`` up to MAX_AUTO_CHUNK_ROWS rows, or up to AUTO_CHUNK_BYTES
    of rows of ``row_bytes`` when that is more. A shard size whose divisors are all too small for
    sensible chunks (a prime such as 1009) is refused, saying what to set."""
    divisors = sorted({d for i in range(1, math.isqrt(shard_size) + 1) if shard_size % i == 0
                       for d in (i, shard_size // i)})
    base = max(d for d in divisors if d <= MAX_AUTO_CHUNK_ROWS)
    if base < MIN_AUTO_CHUNK_ROWS and base != shard_size:
        raise ValueError(
            f"output.chunk_rows: auto needs a divisor of data.shard_size ({shard_size}) between "
            f"{MIN_AUTO_CHUNK_ROWS} and {MAX_AUTO_CHUNK_ROWS}, and the largest is {base}; choose a shard_size "
            "with one (1000, 1024...) or set output.chunk_rows to a divisor of it"
        )
    fill = AUTO_CHUNK_BYTES // row_bytes if row_bytes > 0 else 0
    return max(d for d in divisors if d <= max(base, fill))


class JobSpec(_Section):
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec
    capture: tuple[CaptureSpec, ...] = Field(min_length=1)
    output: OutputSpec = Field(default_factory=OutputSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, json_schema_extra=RUN_ONLY)
    submit: SubmitSpec = Field(default_factory=SubmitSpec, json_schema_extra=RUN_ONLY)

    @model_validator(mode="after")
    def _chunks_fit_shards(self) -> JobSpec:
        if self.output.chunk_rows == "auto":
            auto_chunk_rows(self.data.shard_size)  # a shard size without a sensible divisor is refused here
        elif self.data.shard_size % self.output.chunk_rows:
            raise ValueError(
                f"output.chunk_rows ({self.output.chunk_rows}) must divide data.shard_size "
                f"({self.data.shard_size}) so that no two shards share a chunk"
            )
        targets = {c.score_target for c in self.capture if c.gradient}
        if len(targets) > 1:
            raise ValueError(
                f"gradient captures must share one target, got {sorted(map(str, targets))}; "
                "run one job per target"
            )
        keys = [c.key for c in self.capture if c.key and "{" not in c.key]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"capture keys must be unique; repeated: {', '.join(dup)}")
        return self

    def local_paths(self) -> list[tuple[str, str]]:
        """Every setting that names a file or folder, as ``(setting, path)``: the store, the images' root, the
        manifest, each tar, a checkpoint file, a model folder (``hf:FOLDER``, ``open_clip:local-dir:FOLDER``: the
        folder), each store reused. URLs are among them (callers pass them by); relative paths mean a place under
        the folder the job runs from. The one list of them (workers elsewhere, jobs submitted elsewhere)."""
        d, m = self.data, self.model
        tars = [d.tars] if isinstance(d.tars, str) else list(d.tars or [])
        parquet = [d.parquet] if isinstance(d.parquet, str) else list(d.parquet or [])
        out = [("output.store", self.output.store), ("data.root", d.root), ("data.manifest", d.manifest),
               *(("data.tars", t) for t in tars), *(("data.parquet", p) for p in parquet)]
        if m.weights_kind == "file":
            out.append(("model.weights", m.weights))
        folder = model_folder(m.name)
        if folder is not None:
            out.append(("model.name", folder[1]))
        out += [("output.reuse", u) for u in self.output.reuse]
        return [(k, v) for k, v in out if isinstance(v, str) and v]

    def to_dict(self) -> dict[str, Any]:
        """The resolved spec as plain JSON-able data, secrets included (for workers only)."""
        return self.model_dump(mode="json")

    def public_dict(self) -> dict[str, Any]:
        """The resolved spec with secrets (storage options, env_vars) redacted: what the store, logs and prints show."""
        return redact(self.to_dict())

    def content_dict(self) -> dict[str, Any]:
        """The parts of the spec that decide what the store contains (compared on resume)."""
        return content_of(self.to_dict())


def content_of(spec_dict: dict[str, Any]) -> dict[str, Any]:
    """``spec_dict`` (a resolved spec as plain data) without the fields marked run-only, and without the
    preprocessing settings (marked resolved): what they resolve to (the store's ``preprocess`` record) is
    compared instead, so that ``resize: auto`` and ``resize: 256`` that mean the same are the same."""
    d = copy.deepcopy(spec_dict)
    for section, info in JobSpec.model_fields.items():
        if _marked(info):
            d.pop(section, None)
            continue
        fields = getattr(info.annotation, "model_fields", {})
        if isinstance(d.get(section), dict):
            for name in [n for n, f in fields.items() if _marked(f)]:
                d[section].pop(name, None)
    return d

