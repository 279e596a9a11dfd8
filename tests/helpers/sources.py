"""Data sources written for tests: WebDataset tars of image files."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def write_tars(images: list[Path], out: Path, per_tar: int, labels: dict[str, object] | None = None,
               json_labels: bool = False) -> list[Path]:
    """WebDataset-style shards: KEY.jpg/KEY.png plus KEY.cls (or KEY.json) per sample."""
    out.mkdir(parents=True, exist_ok=True)
    tars = []
    for t, lo in enumerate(range(0, len(images), per_tar)):
        path = out / f"shard-{t:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for img in images[lo:lo + per_tar]:
                key = f"{img.parent.name}/{img.stem}"
                tar.add(img, arcname=f"{key}{img.suffix}")
                if labels is not None:
                    label = labels[img.parent.name]
                    data = (f'{{"label": {label}}}' if json_labels else str(label)).encode()
                    info = tarfile.TarInfo(f"{key}.{'json' if json_labels else 'cls'}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        tars.append(path)
    return tars
