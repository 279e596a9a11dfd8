"""Model sources: torchvision, timm, Hugging Face transformers, open_clip and user factories.

Each builder returns a :class:`Built`: the module, where its weights came from, the
preprocessing its library prescribes (or why none is known).
Weights come from local caches only; a download needs ``EXTRACTOR_ALLOW_DOWNLOAD=1``.
The optional libraries are imported only when a spec names them (extra ``models``).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..data import IMAGENET, PIL_RESAMPLE, Preprocess
from ..errors import ModelError
from ..spec import ModelSpec
from .processors import LibraryProcessor

__all__ = ["Built", "build", "load_checkpoint", "HF_WEIGHT_FILES"]

log = logging.getLogger(__name__)

# files of a save_pretrained folder that hold its weights (sharded: an index beside the shards)
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
_EXTRA = "pip install 'extractor[models]' (timm, transformers, open_clip_torch)"
# PIL resampling codes (Hugging Face image processors store them) -> data.interpolation
_RESAMPLE = {code: name for name, code in PIL_RESAMPLE.items()}  # PIL's codes, as processors store them
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


@dataclass
class Built:
    model: nn.Module
    source: str  # provenance, e.g. "timm vit_small_patch16_224 pretrained (hf-hub:timm/...)"
    preprocess: Preprocess | str  # the library's preprocessing, or why none is known
    pretrained: bool  # weights came from somewhere (not a random init of ours)
    library: str  # torchvision, timm, hf, open_clip, factory
    processor: LibraryProcessor | None = None  # the library's own processor, run by the probe (or the decoders)


def _downloads() -> bool:
    return os.environ.get("EXTRACTOR_ALLOW_DOWNLOAD") == "1"


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Hub libraries read their local caches only (unless downloads are allowed)."""
    if _downloads():
        yield
        return
    import huggingface_hub.constants as hub

    was = hub.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = was


def _import(module: str, spec: ModelSpec) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ModelError(f"model.name {spec.name!r} needs {module.split('.')[0]}, which is not installed "
                         f"({err}): {_EXTRA}") from err


def _unknown(spec: ModelSpec, names: list[str], how: str) -> ModelError:
    close = difflib.get_close_matches(spec.model, names, n=5, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else ""
    return ModelError(f"model.name {spec.name!r} is not a {spec.source} model{hint}. {how}")


def _not_cached(spec: ModelSpec, err: BaseException, fetch: str) -> ModelError:
    where = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    return ModelError(
        f"model {spec.name!r} with weights {spec.weights!r}: not in the local cache ({where}) and downloads are off "
        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). On a connected machine run "
        f"{fetch}, set EXTRACTOR_ALLOW_DOWNLOAD=1, or set model.weights to a checkpoint file"
    )


def _ask_weights(spec: ModelSpec, named: str) -> ModelError:
    """``weights: auto`` on a name that names an architecture, not weights: the tool cannot know which."""
    return ModelError(f"model.name {spec.name!r} names an architecture, not its weights: set model.weights to "
                      f"{named}, a checkpoint file, or random (a random init, seed 0)")


def build(spec: ModelSpec) -> Built:
    """The model of ``spec`` on the CPU (weights loaded; checkpoints by the caller)."""
    return {"torchvision": _torchvision, "timm": _timm, "hf": _hf, "open_clip": _open_clip,
            "factory": _factory, "python": _python}[spec.source](spec)


def from_object(model: nn.Module, spec: ModelSpec) -> Built:
    """A module made in Python and given to ``extractor.run(..., model=...)``, used as it is."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"model= takes a torch.nn.Module, not {type(model).__name__}")
    found, processor = _own_preprocess(model, spec)
    return Built(model, f"python object {type(model).__module__}.{type(model).__qualname__} (weights as given)",
                 found, True, "python", processor)


def _python(spec: ModelSpec) -> Built:
    raise ModelError(f"model.name {spec.name!r} names a module made in Python: pass it as "
                     "extractor.run(job, model=module), or name a model the spec can build")


# --------------------------------------------------------------------------- torchvision

# builders whose pretrained weights need flags that their plain builder leaves off: a state dict
# saved from the pretrained model only works with them (inception's input transform, aux heads)
_TV_PRETRAINED_FLAGS = {
    "inception_v3": {"transform_input": True, "aux_logits": True, "init_weights": False},
    "googlenet": {"transform_input": True, "aux_logits": False, "init_weights": False},
}


def _tv_preprocess(weights: Any) -> Preprocess:
    t = weights.transforms()
    crop, resize = list(t.crop_size), list(t.resize_size)
    return Preprocess(resize=resize[0] if len(resize) == 1 else (resize[0], resize[1]),
                      crop=(crop[0], crop[0]) if len(crop) == 1 else (crop[0], crop[1]),
                      interpolation=t.interpolation.value, mean=tuple(t.mean), std=tuple(t.std),
                      source=f"torchvision {weights} transforms")


def _torchvision(spec: ModelSpec) -> Built:
    import torchvision.models as tvm

    name = spec.model
    names = sorted(tvm.list_models(module=tvm))
    if name not in names:
        raise _unknown(spec, names, "See torchvision.models.list_models(), use timm:/hf:/open_clip:, or set "
                                    "model.factory for other models")
    kind = spec.weights_kind
    kwargs = {**_TV_PRETRAINED_FLAGS.get(name, {}), **spec.kwargs}
    if kind in ("random", "file"):
        model = _call(lambda: tvm.get_model(name, weights=None, **kwargs), spec)
        if kind == "file":  # fine-tuned, say: whose preprocessing nobody recorded
            return Built(model, f"torchvision {name}", f"torchvision {name} with weights from a checkpoint file has "
                         "no transforms of its own (torchvision's weights names have theirs)", True, "torchvision")
        return Built(model, f"torchvision {name}", replace(IMAGENET, source="ImageNet defaults (torchvision's "
                     "convention; a random init has no weights transforms)"), False, "torchvision")
    enum = tvm.get_model_weights(name)
    valid = list(dict.fromkeys(["DEFAULT", *enum.__members__]))  # some enums list DEFAULT among their members
    if kind == "auto":
        raise _ask_weights(spec, f"pretrained (torchvision's DEFAULT), a weights name ({', '.join(valid[1:4])}...)")
    w = "DEFAULT" if kind == "pretrained" else str(spec.weights)
    if w not in valid:
        raise ModelError(
            f"model.weights {w!r} is not a weights name of {name} (valid: {', '.join(valid)}, pretrained) "
            "and no such checkpoint file exists"
        )
    weights = enum.DEFAULT if w == "DEFAULT" else enum[w]
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
    if not os.path.exists(cached) and not _downloads():
        raise ModelError(
            f"weights {name}.{weights.name} are not in the torch cache ({cached}). "
            f"Download {weights.url} to that path on a connected machine, set model.weights to a "
            "checkpoint path, or set EXTRACTOR_ALLOW_DOWNLOAD=1 to let torchvision download them"
        )
    model = _call(lambda: tvm.get_model(name, weights=weights, **spec.kwargs), spec)
    return Built(model, f"torchvision {name} {weights}", _tv_preprocess(weights), True, "torchvision")


def _call(fn: Any, spec: ModelSpec) -> Any:
    """A builder call whose errors are the spec's (a bad keyword, a bad size)."""
    try:
        return fn()
    except ModelError:
        raise
    except TypeError as err:
        raise ModelError(f"model {spec.name or spec.factory}: the builder refused model.kwargs "
                         f"{spec.kwargs}: {err}") from err


# --------------------------------------------------------------------------- timm


def _timm_preprocess(timm: Any, model: nn.Module, spec: ModelSpec) -> Preprocess | str:
    cfg = timm.data.resolve_model_data_config(model)
    _, h, w = cfg["input_size"]
    # the data config keeps the pretrained size; a model built for another one (img_size) runs at that
    built = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if "img_size" in spec.kwargs or built is not None:
        size: Any = spec.kwargs.get("img_size", built)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
    pct, mode = cfg.get("crop_pct") or 0.875, cfg.get("crop_mode") or "center"
    scale = (int(h / pct), int(w / pct))  # math.floor, as timm does
    if mode == "squash":
        resize: int | tuple[int, int] = scale
    elif mode == "center" and h == w:
        resize = scale[0]
    else:
        return (f"timm's data config for {spec.model} asks for crop_mode {mode!r} at {h}x{w}, which extractor does "
                "not reproduce")
    interpolation = cfg.get("interpolation") or "bilinear"
    if interpolation not in _RESAMPLE.values():
        return f"timm's data config for {spec.model} asks for interpolation {interpolation!r}"
    return Preprocess(resize=resize, crop=(h, w), interpolation=interpolation, mean=tuple(cfg["mean"]),
                      std=tuple(cfg["std"]), crop_pct=pct,
                      source=f"timm data config of {spec.model} (crop_pct {pct}, {mode})")


def _timm(spec: ModelSpec) -> Built:
    timm = _import("timm", spec)
    _import("timm.data", spec)  # resolve_model_data_config

    if not timm.is_model(spec.model):
        raise _unknown(spec, timm.list_models(), "See timm.list_models()")
    kind = spec.weights_kind
    if kind == "auto":
        raise _ask_weights(spec, "pretrained (the weights of its tag" + (")" if "." in spec.model else
                                 f", or timm's default tag; name one as timm:{spec.model}.TAG)"))
    pretrained = kind == "pretrained"
    if kind == "name":
        raise ModelError(f"model.weights {spec.weights!r}: a timm model takes pretrained (the tag in its name: "
                         f"timm:{spec.model.split('.')[0]}.TAG), a checkpoint file or random")
    try:
        with _offline(), _no_url_downloads():
            model = _call(lambda: timm.create_model(spec.model, pretrained=pretrained, **spec.kwargs), spec)
    except (OSError, RuntimeError, ValueError) as err:
        if not pretrained:
            raise ModelError(f"timm.create_model({spec.model!r}) failed: {type(err).__name__}: {err}") from err
        raise _not_cached(spec, err, f"python -c \"import timm; timm.create_model('{spec.model}', pretrained=True)\"") \
            from err
    where = model.pretrained_cfg.get("hf_hub_id") or model.pretrained_cfg.get("url") or "?"
    source = f"timm {spec.model}" + (f" pretrained ({where})" if pretrained else "")
    return Built(model, source, _timm_preprocess(timm, model, spec), pretrained, "timm")


@contextlib.contextmanager
def _no_url_downloads() -> Iterator[None]:
    """timm fetches some weights from plain URLs (torch.hub): refused unless downloads are allowed."""
    if _downloads():
        yield
        return
    import importlib

    try:  # timm's own name for torch.hub's downloader (private: timm >= 0.9 to 1.0 have it here)
        hub: Any = importlib.import_module("timm.models._hub")
    except ImportError:  # pragma: no cover - a timm that moved it: torch.hub's own (a copy timm imported by name
        hub = importlib.import_module("torch.hub")  # elsewhere is not covered; HF_HUB_OFFLINE still holds for the hub)

    def refuse(url: str, *args: Any, **kwargs: Any) -> None:
        raise OSError(f"{url} is not in the torch cache and downloads are off")

    was = hub.download_url_to_file
    hub.download_url_to_file = refuse
    try:
        yield
    finally:
        hub.download_url_to_file = was


# --------------------------------------------------------------------------- Hugging Face


def _getter(value: Any) -> Callable[[str], Any]:
    """A processor's ``size`` or ``crop_size`` read by key, whether it is a dict or a ``SizeDict``."""
    return value.get if isinstance(value, dict) else (lambda k: getattr(value, k, None))


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
        return f"the image processor of hf:{src} resizes to {size}, which extractor does not reproduce"
    if getattr(p, "do_center_crop", False):
        cget = _getter(getattr(p, "crop_size", None) or {})
        if not (cget("height") and cget("width")):
            return (f"the image processor of hf:{src} centre-crops to {getattr(p, 'crop_size', None)}, which "
                    "extractor does not reproduce")
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


# --------------------------------------------------------------------------- open_clip


def _open_clip_preprocess(visual: nn.Module, spec: ModelSpec) -> Preprocess | str:
    cfg = dict(getattr(visual, "preprocess_cfg", {}) or {})
    if not cfg:
        return f"open_clip model {spec.model} has no preprocess_cfg"
    size = cfg.get("size", 224)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    mode = cfg.get("resize_mode", "shortest")
    if mode == "squash":
        resize: int | tuple[int, int] = (h, w)
        crop: tuple[int, int] | None = None
    elif mode == "shortest" and h == w:
        resize, crop = h, (h, w)
    else:
        return f"open_clip's transform for {spec.model} resizes with mode {mode!r} at {h}x{w}"
    return Preprocess(resize=resize, crop=crop, interpolation=cfg.get("interpolation", "bicubic"),
                      mean=tuple(cfg["mean"]), std=tuple(cfg["std"]),
                      source=f"open_clip transform of {spec.model} ({mode})")


def _open_clip_tag(open_clip: Any, spec: ModelSpec, arch: str, schema: bool) -> str | None:
    """The pretrained tag or checkpoint file an open_clip model loads (None: a random init, or an ``hf-hub:`` or
    ``local-dir:`` model's own weights); refuses a weights setting that does not say which."""
    kind = spec.weights_kind
    tags = [] if schema else open_clip.list_pretrained_tags_by_model(arch)
    if kind in ("auto", "pretrained") and not schema:
        raise ModelError(f"model.weights: {spec.weights} is ambiguous for open_clip:{arch}; name a tag "
                         f"({', '.join(tags) or 'none known'}), a checkpoint file, or random")
    if kind == "name" and spec.weights not in tags:
        raise ModelError(f"model.weights {spec.weights!r} is not a pretrained tag of open_clip:{arch} "
                         f"(tags: {', '.join(tags) or 'none'}) and no such checkpoint file exists")
    return str(spec.weights) if kind in ("name", "file") else None


def _open_clip_file(open_clip: Any, spec: ModelSpec, arch: str, path: str) -> Built:
    """An open_clip model with weights from a checkpoint file: the whole CLIP's state dict, or its visual tower's."""
    model = _call(lambda: open_clip.create_model(arch, pretrained=None, load_weights=False, **spec.kwargs), spec)
    try:
        load_checkpoint(model, path)
    except ModelError as whole:
        try:
            load_checkpoint(model.visual, path)
        except ModelError:
            raise ModelError(f"{whole} (neither open_clip:{arch}'s whole CLIP nor its visual tower)") from None
    visual = model.visual
    return Built(visual, f"open_clip {arch} visual tower, weights from checkpoint {path}",
                 _open_clip_preprocess(visual, spec), True, "open_clip")


def _open_clip(spec: ModelSpec) -> Built:
    open_clip = _import("open_clip", spec)
    arch, schema = spec.model, spec.model.startswith(("hf-hub:", "local-dir:"))
    if not schema and arch not in open_clip.list_models():
        raise _unknown(spec, open_clip.list_models(), "See open_clip.list_models()")
    w = _open_clip_tag(open_clip, spec, arch, schema)
    if spec.weights_kind == "file":
        return _open_clip_file(open_clip, spec, arch, str(w))
    pretrained = spec.weights_kind != "random"
    try:
        with _offline():
            model = _call(lambda: open_clip.create_model(
                arch, pretrained=None if schema else w, load_weights=pretrained, **spec.kwargs), spec)
    except (OSError, RuntimeError) as err:
        if not pretrained:
            raise ModelError(f"open_clip.create_model({arch!r}) failed: {type(err).__name__}: {err}") from err
        raise _not_cached(spec, err, f"python -c \"import open_clip; open_clip.create_model('{arch}', "
                                     f"pretrained='{w}')\"") from err
    visual = model.visual
    visual.preprocess_cfg = getattr(model.visual, "preprocess_cfg", None) or {}
    source = f"open_clip {arch} visual tower" + (f" ({w})" if pretrained else "")
    return Built(visual, source, _open_clip_preprocess(visual, spec), pretrained, "open_clip")


# --------------------------------------------------------------------------- factories


def _factory(spec: ModelSpec) -> Built:
    factory = spec.model
    module_name, _, attr = factory.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module in the current folder, as `python -m` finds it
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ModelError(f"model.factory {factory!r}: cannot import {module_name}: {err} (the current folder and "
                         "PYTHONPATH are searched)") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"model.factory {factory!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    try:
        model = obj(**spec.kwargs)
    except Exception as err:
        raise ModelError(f"model.factory {factory!r} raised {type(err).__name__}: {err}") from err
    if not isinstance(model, nn.Module):
        raise ModelError(f"model.factory {factory!r} returned {type(model).__name__}, not a torch.nn.Module")
    found, processor = _own_preprocess(model, spec)
    return Built(model, f"factory {factory} (weights as the factory built them)", found, True, "factory", processor)


def _own_preprocess(model: nn.Module, spec: ModelSpec) -> tuple[Preprocess | str, LibraryProcessor | None]:
    """The preprocessing a module made elsewhere (a factory's, one given to ``extractor.run``) carries
    with it: timm's ``pretrained_cfg``, open_clip's ``preprocess_cfg`` (on the model or its ``visual``
    tower), a Hugging Face model's processor config (its ``name_or_path`` folder or cached hub id);
    else why none is known (the job must then give the ``data.*`` settings: no silent ImageNet)."""
    if hasattr(model, "pretrained_cfg") and "timm" in sys.modules:
        return _timm_preprocess(sys.modules["timm"], model, spec), None
    for carrier in (model, getattr(model, "visual", None)):
        if isinstance(carrier, nn.Module) and getattr(carrier, "preprocess_cfg", None):
            return _open_clip_preprocess(carrier, spec), None
    source = getattr(model, "name_or_path", None)
    if isinstance(source, str) and source and "transformers" in sys.modules:
        return _hf_preprocess(sys.modules["transformers"], source)
    return (f"the model {spec.factory or spec.name} ({type(model).__name__}) carries no preprocessing extractor knows "
            "(timm's pretrained_cfg, open_clip's preprocess_cfg, a Hugging Face model's processor config)"), None


# --------------------------------------------------------------------------- checkpoints


def _read_state(path: str) -> Any:
    """What a checkpoint file holds: ``torch.load(weights_only=True)``, or a safetensors file."""
    if not os.path.exists(path):
        raise ModelError(f"model.weights checkpoint {path} does not exist")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except ImportError as err:
        raise ModelError(f"{path}: reading .safetensors needs safetensors: {_EXTRA}") from err
    except Exception as err:
        raise ModelError(
            f"cannot load checkpoint {path} with weights_only=True ({type(err).__name__}: {err}). "
            "Save a plain state dict: torch.save(model.state_dict(), path)"
        ) from err


def _state_dict_in(state: Any, path: str) -> dict[str, Any]:
    """The state dict a checkpoint holds: itself, or under ``state_dict``, ``model`` or ``model_state_dict``;
    a ``DataParallel`` one's ``module.`` prefix taken off."""
    if isinstance(state, dict):
        state = next((state[k] for k in ("state_dict", "model", "model_state_dict")
                      if k in state and isinstance(state[k], dict)), state)
    if not isinstance(state, dict):
        raise ModelError(f"checkpoint {path} holds a {type(state).__name__}, not a state dict")
    if state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def _some(keys: list[str]) -> str:
    return f"{keys[:5]}{'...' if len(keys) > 5 else ''}"


def load_checkpoint(model: nn.Module, path: str) -> None:
    """Load a state dict file (``torch.load(weights_only=True)`` or safetensors) into ``model``: every key
    it has must fill one of the model's, and every one of the model's be filled."""
    state = _state_dict_in(_read_state(path), path)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape
        first = next((ln.strip() for ln in str(err).splitlines() if "size mismatch" in ln), str(err).splitlines()[0])
        raise ModelError(f"checkpoint {path} does not fit the model: {first}") from None
    if result.missing_keys or result.unexpected_keys:
        raise ModelError(f"checkpoint {path} does not fit the model: missing keys {_some(result.missing_keys)}, "
                         f"unexpected keys {_some(result.unexpected_keys)}")
