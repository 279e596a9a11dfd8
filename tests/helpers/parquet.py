"""Parquet files written for tests as the Hub holds them, and jobs that read them."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.jobs import job

CLASSES = ["cats", "dogs"]


def images_of(image_dir: Path) -> list[Path]:
    return sorted(p for p in image_dir.rglob("*") if p.is_file())


def write_hub_parquet(images: list[Path], out: Path, per_file: int, row_group: int, names: bool = True,
                      image: str = "image", label: str = "label") -> list[Path]:
    """Files as the Hub holds them: ``data/train-0000N-of-0000M.parquet``, an image column of {bytes, path}
    structs, integer labels with their ClassLabel names in the ``huggingface`` schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    chunks = [images[i:i + per_file] for i in range(0, len(images), per_file)]
    meta = {"info": {"features": {image: {"_type": "Image"},
                                  label: {"names": CLASSES, "_type": "ClassLabel"} if names else
                                  {"dtype": "int64", "_type": "Value"}}}}
    paths = []
    for n, chunk in enumerate(chunks):
        table = pa.table({image: [{"bytes": p.read_bytes(), "path": p.name} for p in chunk],
                          label: [CLASSES.index(p.parent.name) for p in chunk]})
        table = table.replace_schema_metadata({"huggingface": json.dumps(meta)})
        path = out / f"train-{n:05d}-of-{len(chunks):05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group)
        paths.append(path)
    return paths


def parquet_job(image_dir: Path, store: Path, pattern: str, **data):
    return job(image_dir, store, data={"source": "parquet", "root": None, "parquet": pattern, **data})
