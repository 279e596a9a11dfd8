"""The Hugging Face transformers model source: ``hf:REPO`` or ``hf:FOLDER``, a vision tower of composite models,
the image processor's settings as the preprocessing (or the processor itself, run by the probe)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from ...data import Preprocess
from ...errors import ModelError
from ...spec import ModelSpec
from ..processors import LibraryProcessor
from .common import _RESAMPLE, Built, _downloads, _import, _not_cached, _offline

# files of a save_pretrained folder that hold its weights (sharded: an index beside the shards)
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")


# composite configs whose vision tower has a class of its own with the image projection
_HF_TOWERS = {"clip": "CLIPVisionModelWithProjection"}
# the image processor settings extractor reproduces (the probe then checks how, on its images); any other
# setting that is on counts as one it does not (MobileViT's do_flip_channel_order, OWLv2's do_pad...)
_HF_REPRODUCED = frozenset({"do_resize", "size", "resample", "do_center_crop", "crop_size", "crop_pct", "do_rescale",
                            "rescale_factor", "do_normalize", "image_mean", "image_std", "do_convert_rgb",
                            "default_to_square"})
# names, not settings; and settings of no effect on images (segmentation labels only)
_HF_RECORDS = frozenset({"image_processor_type", "processor_class", "_processor_class", "feature_extractor_type",
                         "do_reduce_labels"})
_HF_NEUTRAL = {"ensure_multiple_of": 1, "size_divisor": 1}  # settings at a value that changes nothing


def _getter(value: Any) -> Callable[[str], Any]:
    """A processor's ``size`` or ``crop_size`` read by key, whether it is a dict or a ``SizeDict``."""
    return value.get if isinstance(value, dict) else (lambda k: getattr(value, k, None))


_SIZE_KEYS = ("height", "width", "shortest_edge", "longest_edge", "max_height", "max_width", "min_pixels",
              "max_pixels")


def _said(value: Any) -> str:
    """A processor's ``size`` or ``crop_size`` for a message: the keys it sets (``longest_edge 1333``), not a
    ``SizeDict`` of every key transformers knows."""
    get = _getter(value or {})
    keys = list(value) if isinstance(value, dict) else _SIZE_KEYS
    shown = ", ".join(f"{k} {get(k)}" for k in keys if get(k) not in (None, 0))
    return shown or "no size given"


def _hf_geometry(p: Any, src: str) -> tuple[int | tuple[int, int] | None, tuple[int, int] | None] | str:
    """A processor's resize and centre crop (or why extractor does not reproduce them)."""
    size = getattr(p, "size", None) or {}
    get = _getter(size)
    pct = getattr(p, "crop_pct", None)
    edge, longest = get("shortest_edge"), get("longest_edge")
    resize: int | tuple[int, int] | None
    crop = None
    if not getattr(p, "do_resize", True):
        resize = None
    elif pct and edge and not longest:
        # ConvNeXt's rule: below 384 the shorter side to shortest_edge / crop_pct, then a centre crop to
        # shortest_edge; from 384 on, a squash to shortest_edge x shortest_edge, no crop
        edge = int(edge)
        resize, crop = ((int(edge / pct), (edge, edge)) if edge < 384 else ((edge, edge), None))
    elif edge and not longest:
        resize = int(edge)
    elif get("height") and get("width"):
        resize = (int(get("height")), int(get("width")))
    else:
        return f"the image processor of hf:{src} resizes ({_said(size)}), which extractor does not reproduce"
    if getattr(p, "do_center_crop", False):
        cget = _getter(getattr(p, "crop_size", None) or {})
        if not (cget("height") and cget("width")):
            return (f"the image processor of hf:{src} centre-crops to {_said(getattr(p, 'crop_size', None))}, "
                    "which extractor does not reproduce")
        crop = (int(cget("height")), int(cget("width")))
    return resize, crop


def _three(value: Any) -> Any:
    """A processor's mean or std as a tuple: one number for every channel, or one per channel (as many as it has)."""
    return (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)


def _hf_unknown(p: Any) -> tuple[str, ...]:
    """The settings of an image processor outside the allow-list, that are on (``do_flip_channel_order=True``)."""
    return tuple(f"{k}={v!r}" for k, v in p.to_dict().items()
                 if k not in _HF_REPRODUCED and k not in _HF_RECORDS and v not in (False, None)
                 and _HF_NEUTRAL.get(k, ...) != v)


def _hf_run(p: Any) -> Callable[[Any], Any]:
    """One image through a transformers image processor: its ``pixel_values`` (3, h, w)."""
    return lambda img: p(img, return_tensors="pt")["pixel_values"][0]


def _hf_processor(transformers: Any, src: str, p: Any) -> LibraryProcessor:
    """An image processor as the probe and ``data.preprocess: library`` run it; the probe compares with its
    Pillow backend first (extractor resizes with Pillow), then with the processor itself."""
    name = type(p).__name__
    pil_name = name.removesuffix("Pil") + "Pil"
    pil_cls: Any = getattr(transformers, pil_name, None)
    refs = []
    if pil_cls is not None and not isinstance(p, pil_cls):
        with _offline():
            pil = pil_cls.from_pretrained(src, local_files_only=not _downloads())
        refs.append((f"{pil_name} of hf:{src}", _hf_run(pil)))
    refs.append((f"{name} of hf:{src}", _hf_run(p)))
    return LibraryProcessor(f"{name} of hf:{src}", _hf_run(p), tuple(refs), _hf_unknown(p))


def _hf_preprocess(transformers: Any, src: str) -> tuple[Preprocess | str, LibraryProcessor | None]:
    """What an ``hf:`` model's image processor does, as a :class:`Preprocess` (or why extractor cannot
    reproduce it from its settings: resize and crop, rescale (1/255 only), normalisation and resampling),
    and the processor itself (None: there is none)."""
    try:
        with _offline():
            p = transformers.AutoImageProcessor.from_pretrained(src, local_files_only=not _downloads())
    except (OSError, ValueError, KeyError) as err:
        return f"hf:{src} has no image processor config (preprocessor_config.json) here ({type(err).__name__})", None
    return _hf_settings(p, src), _hf_processor(transformers, src, p)


def _hf_settings(p: Any, src: str) -> Preprocess | str:
    """An image processor's settings as a :class:`Preprocess`, or why they cannot be one."""
    if getattr(p, "max_num_patches", None) is not None:  # Siglip2's NaFlex: each image at its own size
        return (f"the image processor of hf:{src} ({type(p).__name__}) resizes each image to its own size "
                "(variable resolution, max_num_patches): extractor stores one shape per capture and does not support "
                "variable-resolution processors; set data.resize: [H, W] (a squash) and data.crop: null to run the "
                "model at one size")
    geometry = _hf_geometry(p, src)
    if isinstance(geometry, str):
        return geometry
    resize, crop = geometry
    if getattr(p, "do_rescale", True) and abs(float(getattr(p, "rescale_factor", 1 / 255)) - 1 / 255) > 1e-9:
        return f"the image processor of hf:{src} rescales by {p.rescale_factor}, not 1/255"
    mean: Any = getattr(p, "image_mean", None)  # a number or a sequence, as the processor has it
    std: Any = getattr(p, "image_std", None)
    if not getattr(p, "do_normalize", True) or mean is None:
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    resample = getattr(p, "resample", None)
    interpolation = _RESAMPLE.get(int(resample), None) if resample is not None else "bilinear"
    if interpolation is None:
        return f"the image processor of hf:{src} resamples with {resample!r}"
    pct = getattr(p, "crop_pct", None)
    return Preprocess(resize=resize, crop=crop, interpolation=interpolation, mean=_three(mean), std=_three(std),
                      crop_pct=pct if crop is not None and pct else None, crop_offset="floor",
                      source=f"{type(p).__name__} of hf:{src}" + (f" (crop_pct {pct:.4g})" if pct else ""))


def _hf_weights(spec: ModelSpec, local: bool) -> bool:
    """Whether an ``hf:`` model loads its own weights (a folder's or a hub id's); refuses what it cannot take."""
    kind, src = spec.weights_kind, spec.model
    if kind == "name":
        raise ModelError(f"model.weights {spec.weights!r}: an hf: model takes auto or pretrained (its own weights), "
                         "a checkpoint file, or random (a random init from its config)")
    if kind == "auto" and local and not any(os.path.exists(os.path.join(src, f)) for f in HF_WEIGHT_FILES):
        raise ModelError(f"model.name {spec.name!r}: the folder holds no weights ({', '.join(HF_WEIGHT_FILES[::2])}); "
                         "set model.weights: random for a random init from its config, or a checkpoint file")
    return kind in ("auto", "pretrained")


def _hf_config(transformers: Any, spec: ModelSpec, local: bool, fetch: str) -> tuple[Any, Any]:
    """An ``hf:`` model's config and the config of the tower that runs (a composite's vision tower, with
    model.kwargs set on it)."""
    src = spec.model
    try:
        with _offline():
            config = transformers.AutoConfig.from_pretrained(src, local_files_only=not _downloads())
    except (OSError, ValueError) as err:
        if local:
            raise ModelError(f"model.name {spec.name!r}: the folder has no usable config.json: {err}") from err
        raise _not_cached(spec, err, fetch) from err
    vision = getattr(config, "vision_config", None)
    tower = config if vision is None else vision
    if vision is not None and hasattr(tower, "projection_dim") and hasattr(config, "projection_dim"):
        tower.projection_dim = config.projection_dim  # the tower's own class holds the image projection
    for k, v in spec.kwargs.items():  # config overrides, on the tower that runs
        if not hasattr(tower, k):
            raise ModelError(f"model.kwargs {k!r}: not a setting of {type(tower).__name__}")
        setattr(tower, k, v)
    return config, tower


def _hf(spec: ModelSpec) -> Built:
    transformers = _import("transformers", spec)
    src = spec.model
    local = os.path.isdir(src)
    pretrained = _hf_weights(spec, local)  # the folder's or the hub id's own weights
    fetch = f"`hf download {src}`"
    config, tower = _hf_config(transformers, spec, local, fetch)
    cls = _hf_class(transformers, config, tower, src)
    try:
        with _offline(), _quiet_transformers(transformers):
            if pretrained:
                model, report = _hf_load(cls, src, tower, tower is not config)
            else:
                model, report = cls(tower), {}  # the public constructor: a random init from the config
    except (OSError, ValueError) as err:
        raise _not_cached(spec, err, fetch) from err
    missing = list(report.get("missing_keys") or [])
    if missing:  # weights the checkpoint lacks would be a random init: refused, not muted
        raise ModelError(f"hf:{src}: its weights do not fill {cls.__name__}: {len(missing)} missing "
                         f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); name the model the "
                         "checkpoint was saved from "
                         "(its config's architectures), or set model.weights: random")
    what = f"{cls.__name__} of " if tower is not config else ""
    source = f"hf {what}{src}" + (" pretrained" if pretrained else "")
    found, processor = _hf_preprocess(transformers, src)
    size = getattr(tower, "image_size", None)
    if isinstance(found, str) and isinstance(size, int):
        found += f"; its config says image_size {size} (e.g. crop: {size})"
    return Built(model, source, found, pretrained, "hf", processor)


def _hf_load(cls: Any, src: str, config: Any, tower: bool) -> tuple[Any, dict[str, Any]]:
    """``cls.from_pretrained`` and its load report; a composite model's vision tower whose class holds its
    modules at the root (BLIP's ``BlipVisionModel``) takes them from the checkpoint's ``vision_model.``."""
    model, report = cls.from_pretrained(src, config=config, local_files_only=not _downloads(),
                                        output_loading_info=True)
    if tower and report.get("missing_keys"):
        again, second = cls.from_pretrained(src, config=config, local_files_only=not _downloads(),
                                            output_loading_info=True, key_mapping={r"^vision_model\.": ""})
        if not second.get("missing_keys"):
            return again, second
    return model, report


def _hf_tower_class(transformers: Any, tower: Any, src: str) -> Any:
    """The class of a composite model's vision tower: AutoModel's for its config, else the class its config
    names (``Owlv2VisionConfig``: ``Owlv2VisionModel``), else refused naming the way (a factory)."""
    try:
        return transformers.MODEL_MAPPING[type(tower)]
    except KeyError:
        pass
    named = type(tower).__name__.removesuffix("Config") + "Model"
    cls = getattr(transformers, named, None)
    if isinstance(cls, type):
        return cls
    raise ModelError(f"hf:{src}: its vision tower ({type(tower).__name__}) has no model class transformers builds on "
                     "its own; build the tower in a function named by model.factory, or pass it as "
                     "extractor.run(job, model=...)")


def _hf_class(transformers: Any, config: Any, tower: Any, src: str = "") -> Any:
    """The class an ``hf:`` model is built as: a composite model's vision tower (CLIP's with its projection),
    else the class its config names (``architectures``: a ``...ForImageClassification`` keeps its head, so
    ``.logits`` feed gradient jobs), else the base model of its config."""
    if tower is not config:
        name = _HF_TOWERS.get(config.model_type)
        return getattr(transformers, name) if name else _hf_tower_class(transformers, tower, src)
    for name in getattr(config, "architectures", None) or []:
        if isinstance(getattr(transformers, name, None), type):
            return getattr(transformers, name)
    return transformers.MODEL_MAPPING[type(config)]


@contextlib.contextmanager
def _quiet_transformers(transformers: Any) -> Iterator[None]:
    """transformers' load report lists the text tower's weights as unexpected when only the vision
    tower is loaded (40 lines that say "not ok"): errors only, while loading."""
    logging_ = transformers.utils.logging
    was = logging_.get_verbosity()
    logging_.set_verbosity_error()
    try:
        yield
    finally:
        logging_.set_verbosity(was)

