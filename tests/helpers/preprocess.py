"""The preprocessing of a batch computed by hand with torchvision, to compare stored values against."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image


def reference_batch(paths: list[Path], resize: int, crop: int) -> torch.Tensor:
    """Independent preprocessing: PIL + the classic torchvision transforms."""
    from torchvision import transforms as T

    tf = T.Compose([T.Resize(resize), T.CenterCrop(crop), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    return torch.stack([tf(Image.open(p).convert("RGB")) for p in paths])


def tiny_resnet_mean(paths: list[Path], layer: str = "layer4") -> torch.Tensor:
    """A direct forward of the default toy model of ``helpers.jobs.job`` (weights as the job builds them: seed 0)
    on ``paths`` preprocessed by hand (72, 64): ``layer``'s output, its mean over space."""
    from toy_models import tiny_resnet

    torch.manual_seed(0)
    model, got = tiny_resnet().eval(), {}
    model.get_submodule(layer).register_forward_hook(lambda m, i, o: got.update(out=o))
    with torch.no_grad():
        model(reference_batch(paths, 72, 64))
    return got["out"].mean((2, 3))
