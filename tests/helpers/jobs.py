"""Job specs small enough for 2 CPU cores, as plain data or a YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def write_job(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


# The default model of job(): resnet18's layer names at a sixtieth of its compute (toy_models.TinyResNet).
# A test that compares against torchvision's resnet18 itself, or pins its widths, asks for RESNET18.
TINY_RESNET: dict[str, Any] = {"name": None, "factory": "toy_models:tiny_resnet", "weights": None, "device": "cpu"}


RESNET18: dict[str, Any] = {"name": "resnet18", "weights": None, "device": "cpu"}


def job(root: Path, store: Path, **sections: Any) -> dict[str, Any]:
    """A small job spec as plain data; ``sections`` replace or extend the defaults (a ``model`` that
    names a model, as ``model=RESNET18``, replaces the default toy factory)."""
    raw: dict[str, Any] = {
        "model": dict(TINY_RESNET),
        "data": {"source": "folder", "root": str(root), "resize": 72, "crop": 64,
                 "shard_size": 4, "batch_size": 3, "decode_workers": 2},
        "capture": [
            {"layer": "layer3", "reduce": "none"},
            {"layer": "layer4", "reduce": "mean"},
        ],
        "output": {"store": str(store), "chunk_rows": 2},
        "cluster": {"backend": "local"},
    }
    if isinstance(sections.get("model"), dict) and sections["model"].get("name"):  # a named model, not the toy
        raw["model"] = {k: v for k, v in raw["model"].items() if k != "factory"}
    for k, v in sections.items():
        if isinstance(v, dict) and isinstance(raw.get(k), dict):
            raw[k] = {**raw[k], **v}
        else:
            raw[k] = v
    if raw["model"].get("factory") and isinstance(raw.get("data"), dict):  # toy factories carry no preprocessing
        raw["data"].setdefault("preprocess", "imagenet")
    return raw
