"""`make bench BENCH_ARGS=--codecs`: each chunk codec's ratio and CPU on extractor's own activations (issue 55).

Three stores are written by extractor jobs without compression (torchvision models with random weights, on the
built-in sample images at 224x224): a pooled float32 capture (ResNet-50's avgpool, 2,048 features, and layer3
mean-pooled), ViT-B/16's block 6 tokens as float16 (197 x 768), and the same tokens as bfloat16. Their chunks, as
the writer threads hand them on (inner chunks of about 1 MiB), are then encoded by each codec on one thread:
ratio = raw bytes / encoded bytes, encode and decode CPU per MB of raw bytes (``time.thread_time``; blosc on one
thread, as on a writer thread). Medians of ``--repeats`` passes.

    python bench/bench_codecs.py [--images 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

numcodecs.blosc.use_threads = False  # as on a writer thread (numcodecs uses blosc's threads on the main one only)

# (name, numcodecs codec): zstd at levels 1 and 3 (3: the default before issue 55), blosc with each inner codec and
# shuffle; the bytes of bfloat16 go through as uint16, as the writer hands them on
CODECS: list[tuple[str, Callable[[int], Any]]] = [
    ("zstd 1", lambda size: numcodecs.Zstd(level=1)),
    ("zstd 3", lambda size: numcodecs.Zstd(level=3)),
    ("blosc zstd 5 bitshuffle", lambda size: numcodecs.Blosc("zstd", 5, numcodecs.Blosc.BITSHUFFLE, typesize=size)),
    ("blosc zstd 1 shuffle", lambda size: numcodecs.Blosc("zstd", 1, numcodecs.Blosc.SHUFFLE, typesize=size)),
    ("blosc zstd 1 bitshuffle", lambda size: numcodecs.Blosc("zstd", 1, numcodecs.Blosc.BITSHUFFLE, typesize=size)),
    ("blosc lz4 5 noshuffle", lambda size: numcodecs.Blosc("lz4", 5, numcodecs.Blosc.NOSHUFFLE, typesize=size)),
    ("blosc lz4 5 shuffle", lambda size: numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, typesize=size)),
    ("blosc lz4 5 bitshuffle", lambda size: numcodecs.Blosc("lz4", 5, numcodecs.Blosc.BITSHUFFLE, typesize=size)),
    ("blosc lz4 1 shuffle", lambda size: numcodecs.Blosc("lz4", 1, numcodecs.Blosc.SHUFFLE, typesize=size)),
    ("blosc lz4 9 bitshuffle", lambda size: numcodecs.Blosc("lz4", 9, numcodecs.Blosc.BITSHUFFLE, typesize=size)),
    ("gzip 5", lambda size: numcodecs.GZip(level=5)),
]


def activations(images: int, work: Path) -> dict[str, np.ndarray]:
    """The three captures as extractor stores them (jobs without compression), read back whole."""
    import logging

    from extractor import open_store
    from extractor.demo import write_sample_images
    from extractor.driver.runner import run
    from extractor.spec.load import parse_spec

    logging.getLogger("extractor.model.build").setLevel(logging.ERROR)
    root = work / "images"
    write_sample_images(root, per_class=-(-images // 4))
    jobs = {
        "pooled float32": ("resnet50", [{"layer": "avgpool", "reduce": "flatten", "key": "pooled"},
                                        {"layer": "layer3", "reduce": "mean", "key": "layer3"}]),
        "tokens float16": ("vit_b_16", [{"layer": "encoder.layers.encoder_layer_6", "dtype": "float16",
                                         "key": "tokens"}]),
        "tokens bfloat16": ("vit_b_16", [{"layer": "encoder.layers.encoder_layer_6", "dtype": "bfloat16",
                                          "key": "tokens"}]),
    }
    out = {}
    for name, (model, capture) in jobs.items():
        store = work / f"{name.replace(' ', '-')}-{images}.zarr"
        if (store / "zarr.json").exists():  # made by an earlier run: the same images, models and seeds
            capture = [c for c in capture if c["key"] in open_store(str(store)).captures]
            out.update({f"{name}: {c['key']}": _read(store, c["key"], images) for c in capture})
            continue
        spec = parse_spec({"model": {"name": model, "weights": None, "device": "cpu"},
                           "data": {"root": str(root), "batch_size": 16, "shard_size": images, "resize": 256,
                                    "crop": 224},
                           "capture": capture,
                           "output": {"store": str(store), "compression": "none", "if_exists": "overwrite"},
                           "cluster": {"backend": "local"}})
        run(spec)
        out.update({f"{name}: {c['key']}": _read(store, c["key"], images) for c in capture})
    return out


def _read(store: Path, key: str, images: int) -> tuple[np.ndarray, int]:
    """A capture's values and its rows per chunk."""
    from extractor import open_store

    s = open_store(str(store))
    return s.numpy(key)[:images], int(s[key].chunks[0])


def measure(values: np.ndarray, rows: int, repeats: int) -> list[tuple[str, float, float, float]]:
    """(codec, ratio, encode ms per MB, decode ms per MB) of ``values`` in chunks of ``rows`` rows."""
    bits = values.view(np.uint16) if values.dtype.itemsize == 2 and values.dtype.kind == "V" else values
    chunks = [np.ascontiguousarray(bits[a : a + rows]) for a in range(0, len(bits), rows)]
    raw = sum(c.nbytes for c in chunks)
    table = []
    for name, make in CODECS:
        codec = make(values.dtype.itemsize)
        enc, dec = [], []
        for _ in range(repeats):
            t = time.thread_time()
            encoded = [codec.encode(c) for c in chunks]
            enc.append(time.thread_time() - t)
            t = time.thread_time()
            for e in encoded:
                codec.decode(e)
            dec.append(time.thread_time() - t)
        size = sum(len(e) for e in encoded)
        mb = raw / 1e6
        table.append((name, raw / size, statistics.median(enc) / mb * 1e3, statistics.median(dec) / mb * 1e3))
    return table


def main(images: int = 64, repeats: int = 3) -> dict[str, list[tuple[str, float, float, float]]]:
    cpu = platform.processor() or platform.machine()
    print(f"\ncodecs on extractor's activations: {images} images, random-weight torchvision models; one thread; "
          f"{os.cpu_count()} cores ({cpu}); median of {repeats}")
    results = {}
    work = REPO / ".bench" / "codecs"
    work.mkdir(parents=True, exist_ok=True)
    for name, (values, rows) in activations(images, work).items():
        table = measure(values, rows, repeats)
        results[name] = table
        mb = values.nbytes / 1e6
        print(f"\n{name}: {values.shape[1:]} {values.dtype}, chunks of {rows} rows, {mb:.1f} MB")
        print(f"  {'codec':26s} {'ratio':>6s} {'encode ms/MB':>13s} {'decode ms/MB':>13s}")
        for codec, ratio, enc, dec in table:
            print(f"  {codec:26s} {ratio:6.3f} {enc:13.2f} {dec:13.2f}")
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    main(a.images, a.repeats)
