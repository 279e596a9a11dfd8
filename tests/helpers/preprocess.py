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
