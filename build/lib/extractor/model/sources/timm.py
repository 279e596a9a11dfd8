"""The timm model source: ``timm:NAME`` and ``timm:hf-hub:...``, its pretrained_cfg as the preprocessing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ...data import Preprocess
from ...errors import ModelError
from ...spec import ModelSpec
from .common import _RESAMPLE, Built, _ask_weights, _call, _downloads, _import, _not_cached, _offline, _unknown


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
    padded = ": the crop is larger than the resize, padded with black as timm's transform pads it" if pct > 1 else ""
    return Preprocess(resize=resize, crop=(h, w), interpolation=interpolation, mean=tuple(cfg["mean"]),
                      std=tuple(cfg["std"]), crop_pct=pct,
                      source=f"timm data config of {spec.model} (crop_pct {pct}, {mode}{padded})")


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

