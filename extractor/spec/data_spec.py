"""The job spec's ``data`` section: which images (each source's settings declared in :mod:`.sources`), how
they are decoded and preprocessed, and their shards and batches."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .identity import RESOLVED, RUN_ONLY
from .section import _auto_or_at_least, _Section
from .sources import SOURCE_SETTINGS

__all__ = ["IMAGE_EXTENSIONS", "DataSpec"]


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")


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
    """WebDataset tar shards: paths or URLs with brace patterns (``shards/{000000..000099}.tar``) or globs
    (``shards/*.tar``, sorted)."""
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
    verify: Literal["listing", "files"] = Field(default="files", json_schema_extra=RUN_ONLY)
    """What a resume checks before it takes the rows its store recorded instead of listing the source again:
    ``files`` (the default), what the rows were listed from and every image file of a folder or manifest, by a stat
    each (about 4 s a million files, measured): an image rewritten in place under the same name (``Image.save(path)``,
    ``cp new old``: same inode, its folder's times unmoved) is found; ``listing``, only what the rows were listed
    from (a folder's folders by their mtimes, which move when a file is added, removed or renamed in them; a
    manifest's size, mtime and content; tars' and Parquet files' fingerprints): for trees too big to stat on every
    resume, and blind to an image rewritten in place."""
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
    resize: int | tuple[int, int] | Literal["auto"] | None = Field(default="auto", json_schema_extra=RESOLVED)
    """``auto`` (see ``preprocess``); an int resizes the shorter side to it; ``[H, W]`` squashes every
    image to that size (no aspect kept); null: no resize."""
    crop: int | tuple[int, int] | Literal["auto"] | None = Field(default="auto", json_schema_extra=RESOLVED)
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
        declared = SOURCE_SETTINGS[self.source]
        given = [f for f in declared.places if getattr(self, f)]
        if not given:
            raise ValueError(f"data.source {self.source!r} needs {declared.needs}")
        if len(given) > 1:
            raise ValueError(f"data.{' and data.'.join(given)} each name the images to read: keep one")
        self._others_settings()
        if self.classes is not None and len(set(self.classes)) != len(self.classes):
            raise ValueError("data.classes names a class twice: each label needs one name")
        return self

    def _others_settings(self) -> None:
        """Refuse a setting only another source reads (as ``spec.sources`` declares them)."""
        for name, other in SOURCE_SETTINGS.items():
            stray = [f for f in other.only if name != self.source and getattr(self, f)]
            if stray:
                raise ValueError(f"data.{stray[0]} is read by data.source: {name}; data.source is {self.source!r}")
        if self.columns and not SOURCE_SETTINGS[self.source].columns:
            readers = " or ".join(n for n, s in SOURCE_SETTINGS.items() if s.columns)
            raise ValueError(f"data.columns names the columns of a table ({readers}); data.source is "
                             f"{self.source!r}: remove it")

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
