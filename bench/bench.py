"""`make bench`: extractor against a bare decode-and-forward loop, measured in the same run.

Each variant runs in its own process (fresh allocator, no shared caches), `--repeats` times;
the median images/s is reported with its ratio to the bare loop. The bare loop is the
best-configured plain PyTorch loop (DataLoader processes decoding with PIL, channels_last,
inference_mode, torch's huge-page allocator), not a naive one.

    python tests/bench.py [--model resnet50] [--images 256] [--batch-size 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".bench"


def bare(args: argparse.Namespace) -> dict:
    import torch
    import torchvision
    from torch.utils.data import DataLoader
    from torchvision import transforms as T

    tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = torchvision.datasets.ImageFolder(args.images, transform=tf)
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None).eval().to(memory_format=torch.channels_last)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.decode_workers)
    t0 = time.perf_counter()
    n = 0
    with torch.inference_mode():
        for x, _y in loader:
            model(x.contiguous(memory_format=torch.channels_last))
            n += len(x)
    seconds = time.perf_counter() - t0
    return {"images": n, "seconds": seconds, "images_per_s": n / seconds}


THINGSVISION = ["thingsvision==2.7.3", "torchtyping==0.1.5", "typeguard==2.13.3"]
TV_SITE = WORK / "thingsvision"


def install_thingsvision() -> None:
    """thingsvision, the closest peer, in a folder of its own (never in .venv): its pins (torchvision
    0.15, tensorflow, numpy<2) cannot share an environment with ours, so only its PyTorch code and
    the two small packages that code imports are installed, without their dependencies."""
    if (TV_SITE / "thingsvision").exists():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(TV_SITE),
                    *THINGSVISION], check=True)


def compare_thingsvision() -> str:
    """Largest per-row relative difference between thingsvision's avgpool features and the store's."""
    import numpy as np

    from extractor.read.reader import open_store

    out = WORK / "thingsvision-out"
    names = [ln.strip() for ln in (out / "file_names.txt").read_text().splitlines() if ln.strip()]
    theirs = np.load(out / "avgpool.npy")
    s = open_store(str(WORK / "pooled.zarr"))
    def key(p: str) -> tuple[str, str]:
        return Path(p).parent.name, Path(p).name

    row = {key(str(p)): i for i, p in enumerate(s.paths)}
    ours = s.numpy("avgpool")[[row[key(n)] for n in names]]
    err = np.linalg.norm(ours - theirs, axis=1) / np.linalg.norm(theirs, axis=1)
    return f"max per-row relative difference {err.max():.1e} over {len(names)} images"


def thingsvision_job(args: argparse.Namespace) -> dict:
    """The pooled job through thingsvision's own API: its ImageDataset and DataLoader (PIL in the
    main process), one pass for both modules, layer3 mean-pooled afterwards, features saved."""
    import importlib.machinery
    import types
    from unittest import mock

    import numpy as np

    def stub(name: str) -> types.ModuleType:  # TensorFlow, timm, h5py: imported at module level, unused here
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__path__ = []
        m.__getattr__ = lambda attr: mock.MagicMock(name=f"{name}.{attr}")
        return m

    for name in ("tensorflow", "tensorflow.keras", "tensorflow.keras.applications", "tensorflow.keras.layers",
                 "tensorflow.keras.models", "timm", "timm.models", "h5py"):
        sys.modules.setdefault(name, stub(name))
    np.AxisError = np.exceptions.AxisError  # thingsvision predates numpy 2
    sys.path.insert(0, str(TV_SITE))
    import torch
    import torchvision
    from thingsvision import get_extractor_from_model
    from thingsvision.utils.data import DataLoader, ImageDataset

    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None).eval()
    tv = get_extractor_from_model(model=model, device="cpu", backend="pt")
    out = WORK / "thingsvision-out"
    t0 = time.perf_counter()
    dataset = ImageDataset(root=args.images, out_path=str(out), backend="pt",
                           transforms=tv.get_transformations(resize_dim=256, crop_dim=224))
    batches = DataLoader(dataset=dataset, batch_size=args.batch_size, backend="pt")
    feats = tv.extract_features(batches=batches, module_names=["avgpool", "layer3"], flatten_acts=False,
                                output_type="ndarray")
    np.save(out / "avgpool.npy", feats["avgpool"].reshape(len(feats["avgpool"]), -1))
    np.save(out / "layer3.npy", feats["layer3"].mean(axis=(2, 3)))
    seconds = time.perf_counter() - t0
    n = len(feats["avgpool"])
    return {"images": n, "seconds": seconds, "images_per_s": n / seconds}


CAPTURES = {
    "pooled": [{"layer": "avgpool", "reduce": "flatten"}, {"layer": "layer3", "reduce": "mean"}],
    "fullmap": [{"layer": "layer3", "reduce": "none", "dtype": "float16"}],
    "early": [{"layer": "layer2", "reduce": "mean"}],
    "gradcam": [{"layer": "layer4", "what": "gradcam", "key": "cam"}],
}


def extract(args: argparse.Namespace) -> dict:
    import logging

    from extractor.driver.runner import run
    from extractor.spec.load import parse_spec

    store = WORK / f"{args.variant}.zarr"
    ray = args.variant == "ray"
    variant, unsharded = args.variant.removesuffix("-unsharded"), args.variant.endswith("-unsharded")
    cpus = os.cpu_count() or 1
    source = {"source": "parquet", "root": None, "parquet": str(as_parquet(Path(args.images)))} if \
        variant == "parquet" else {"root": args.images}  # the same images, from one Parquet file of the Hub's layout
    spec = parse_spec({
        "model": {"name": args.model, "weights": None, "device": "cpu"},
        "data": {**source, "batch_size": args.batch_size, "shard_size": 256, "decode_workers": args.decode_workers},
        "capture": CAPTURES["pooled" if ray or variant == "parquet" else variant],
        "output": {"store": str(store), "chunk_rows": 64, "if_exists": "overwrite",
                   "sharding": not unsharded},  # fullmap-unsharded: each chunk its own object, as before sharding
        "cluster": {"backend": "ray", "workers": 1, "cpus_per_worker": cpus, "local_cpus": cpus} if ray
        else {"backend": "local"},
    })
    logging.getLogger("extractor.model.build").setLevel(logging.ERROR)
    first: list[float] = []
    t0 = time.perf_counter()
    summary = run(spec, on_event=lambda name, info: first.append(time.perf_counter())
                  if name == "worker_started" and not first else None)
    end = time.perf_counter()
    seconds = end - first[0]  # from when the ready worker is handed the job: excludes start-up
    return {"images": summary.ok, "seconds": seconds, "images_per_s": summary.ok / seconds,
            "wall_seconds": end - t0, "startup_seconds": first[0] - t0,
            "store_bytes": sum(s.bytes for s in summary.per_shard)}


def reader_bench(rows: int = 40000, features: int = 512, chunk_rows: int = 1024, repeats: int = 3) -> None:
    """Shuffled streaming (chunk-aware) against a sequential read of the same store."""
    import numpy as np

    from extractor.data.rows import Rows
    from extractor.read.reader import open_store
    from extractor.store.layout import OK, StoreArrays
    from extractor.store.synthetic import create_store

    url = str(WORK / "reader.zarr")
    rng = np.random.default_rng(0)
    if not (WORK / "reader.zarr" / "zarr.json").exists():
        shard = chunk_rows * 4
        g = create_store(url, Rows(ids=[f"img{i}" for i in range(rows)], paths=[""] * rows, labels=[0] * rows),
                         StoreArrays(captures={"x": {"shape": [features], "dtype": "float32", "dims": ["x.feature"]}},
                                extras={}, shard_size=shard,
                                chunk_rows={"x": chunk_rows}),
                         attrs={"n_rows": rows, "n_shards": -(-rows // shard), "captures": {
                             "x": {"shape": [features], "dtype": "float32", "dims": ["x.feature"], "layer": "x",
                                   "what": "output", "reduce": "none"}}, "format_version": 1, "spec": {}})
        for a in range(0, rows, chunk_rows):
            g["x"][a:a + chunk_rows] = rng.standard_normal((min(chunk_rows, rows - a), features), dtype=np.float32)
        g["status"][:] = np.full(rows, OK, np.uint8)
    s = open_store(url)
    mb = rows * features * 4 / 1e6
    arr = s["x"]

    def plain() -> None:
        for a in range(0, rows, chunk_rows):
            np.asarray(arr[a:a + chunk_rows])

    def stream(shuffle: bool) -> None:
        n = 0
        for r, _x in s.batches("x", 1024, shuffle=shuffle, seed=1):
            n += len(r)
        assert n == rows

    print(f"\nreader: {rows} rows x {features} float32 ({mb:.0f} MB uncompressed), chunks of {chunk_rows} rows, "
          f"lz4 (the default); median of {repeats}")
    _against_sequential({"sequential zarr read": plain, "batches(shuffle=False)": lambda: stream(False),
                         "batches(shuffle=True)": lambda: stream(True)}, repeats, rows, "rows", mb)


def _against_sequential(variants: dict, repeats: int, items: int, unit: str, mb: float) -> dict[str, float]:
    """Median time of each variant; print items/s, MB/s and the ratio to the first (the sequential read); returns
    each variant's ratio."""
    results = {}
    for name, fn in variants.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        results[name] = statistics.median(times)
    base = next(iter(results.values()))
    for name, t in results.items():
        print(f"  {name:30s} {items / t:10.0f} {unit}/s {mb / t:8.1f} MB/s  ratio {base / t:.2f}")
    return {name: base / t for name, t in results.items()}


def token_bench(rows: int = 2000, tokens: int = 65, features: int = 384, chunk_rows: int = 64,
                repeats: int = 3) -> None:
    """Token rows for SAE training (token_batches, shuffled across images) against a sequential read."""
    import numpy as np

    from extractor.data.rows import Rows
    from extractor.read.reader import open_store
    from extractor.store.layout import OK, StoreArrays
    from extractor.store.synthetic import create_store

    url = str(WORK / "tokens.zarr")
    meta = {"shape": [tokens, features], "dtype": "float16", "dims": ["t.token", "t.feature"], "layer": "t",
            "what": "output", "reduce": "none"}
    if not (WORK / "tokens.zarr" / "zarr.json").exists():
        shard = chunk_rows * 4
        g = create_store(url, Rows(ids=[f"img{i}" for i in range(rows)], paths=[""] * rows, labels=[0] * rows),
                         StoreArrays(captures={"t": meta}, extras={}, shard_size=shard, chunk_rows={"t": chunk_rows}),
                         attrs={"n_rows": rows, "n_shards": -(-rows // shard), "captures": {"t": meta},
                                "format_version": 1, "spec": {}, "model": {"prefix_tokens": 1}})
        rng = np.random.default_rng(0)
        for a in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - a)
            g["t"][a:a + n] = rng.standard_normal((n, tokens, features), dtype=np.float32).astype(np.float16)
        g["status"][:] = np.full(rows, OK, np.uint8)
    s = open_store(url)
    mb = rows * tokens * features * 2 / 1e6
    arr = s["t"]

    def plain() -> None:
        for a in range(0, rows, chunk_rows):
            np.asarray(arr[a:a + chunk_rows])

    def stream(shuffle: bool) -> None:
        n = 0
        for index, _x in s.token_batches("t", 4096, shuffle=shuffle, seed=1):
            n += len(index)
        assert n == rows * tokens

    print(f"\ntokens: {rows} rows x {tokens} tokens x {features} float16 ({mb:.0f} MB uncompressed), chunks of "
          f"{chunk_rows} rows, lz4 (the default), batches of 4096 tokens; median of {repeats}")
    _against_sequential({"sequential zarr read": plain, "token_batches(shuffle=False)": lambda: stream(False),
                         "token_batches(shuffle=True)": lambda: stream(True)}, repeats, rows * tokens, "tokens", mb)


def sharding_bench(rows: int = 4096, tokens: int = 197, features: int = 384, shard: int = 1024,
                   repeats: int = 3) -> None:
    """All tokens of a ViT-S block (float16) stored as before (256-row chunks, one object each) and sharded (one
    object per work shard, ~1 MiB inner chunks): a row read by id, and token_batches against a sequential read
    (of 4 buffers: one buffer is read whole before its first token, the next ones while it is served)."""
    import numpy as np

    from extractor.data.rows import Rows
    from extractor.read.reader import open_store
    from extractor.spec.schema import auto_inner_rows
    from extractor.store.layout import OK, StoreArrays
    from extractor.store.synthetic import create_store

    meta = {"shape": [tokens, features], "dtype": "float16", "dims": ["t.token", "t.feature"], "layer": "t",
            "what": "output", "reduce": "none"}
    inner = auto_inner_rows(shard, tokens * features * 2)
    stores = {}
    for name, sharded, chunk in (("chunks of 256", False, 256), (f"sharded, inner {inner}", True, inner)):
        url = str(WORK / f"sharding-{int(sharded)}-{rows}.zarr")
        if not (WORK / f"sharding-{int(sharded)}-{rows}.zarr" / "zarr.json").exists():
            g = create_store(url, Rows(ids=[f"img{i}" for i in range(rows)], paths=[""] * rows, labels=[0] * rows),
                             StoreArrays(captures={"t": meta}, extras={}, shard_size=shard, chunk_rows={"t": chunk},
                                         sharded=sharded),
                             attrs={"n_rows": rows, "n_shards": -(-rows // shard), "captures": {"t": meta},
                                    "format_version": 1, "spec": {}, "model": {"prefix_tokens": 1}})
            rng = np.random.default_rng(0)
            for a in range(0, rows, shard):
                g["t"][a : a + shard] = rng.standard_normal((min(shard, rows - a), tokens, features),
                                                            dtype=np.float32).astype(np.float16)
            g["status"][:] = np.full(rows, OK, np.uint8)
        stores[name] = open_store(url)
    picks = np.random.default_rng(1).integers(0, rows, 20)
    mb = rows * tokens * features * 2 / 1e6
    print(f"\nsharding: {rows} rows x {tokens} tokens x {features} float16 ({mb:.0f} MB), shards of {shard} rows; "
          f"median of {repeats}")
    times = {}
    for name, s in stores.items():
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for r in picks:
                s.row(s.ids[int(r)])
            runs.append((time.perf_counter() - t0) / len(picks))
        times[name] = statistics.median(runs)
        print(f"  row by id, {name:22s} {times[name] * 1e3:8.2f} ms per row")
    first, second = times.values()
    print(f"  row by id: sharded {first / second:.0f}x faster")
    s = stores[f"sharded, inner {inner}"]
    arr = s["t"]

    def plain() -> None:
        for a in range(0, rows, inner * 32):
            np.asarray(arr[a:a + inner * 32])

    def stream() -> None:
        n = sum(len(index) for index, _ in s.token_batches("t", 4096, shuffle=True, seed=1))
        assert n == rows * tokens

    _against_sequential({"sequential zarr read (sharded)": plain, "token_batches(shuffle=True)": stream}, repeats,
                        rows * tokens, "tokens", mb)


def sharded_reader_bench(repeats: int = 3, compression: str = "lz4") -> dict[str, float]:
    """Shuffled epochs on sharded stores (the default layout, ``compression``) against a sequential zarr read of the
    same array:
    rows of 16 KB (64x8x8 float32, shards of 64 rows, inner chunks of 16) and token rows of 150 KB (197 tokens x 384
    float16, shards of 64 rows, inner chunks of 8). Returns each shuffled epoch's ratio to the sequential read."""
    import numpy as np

    from extractor.data.rows import Rows
    from extractor.read.reader import open_store
    from extractor.store.layout import OK, StoreArrays
    from extractor.store.synthetic import create_store

    cases = {"rows": ([64, 8, 8], "float32", 6000, 16), "tokens": ([197, 384], "float16", 640, 8)}
    ratios = {}
    for name, (shape, dtype, rows, inner) in cases.items():
        url = WORK / f"sharded-{name}-{compression}.zarr"
        meta = {"shape": shape, "dtype": dtype, "dims": [f"x.d{i}" for i in range(len(shape))], "layer": "x",
                "what": "output", "reduce": "none"}
        if not (url / "zarr.json").exists():
            g = create_store(str(url), Rows(ids=[f"i{i}" for i in range(rows)], paths=[""] * rows, labels=[0] * rows),
                             StoreArrays(captures={"x": meta}, extras={}, shard_size=64, chunk_rows={"x": inner},
                                         sharded=True, compression=compression),
                             attrs={"n_rows": rows, "n_shards": -(-rows // 64), "captures": {"x": meta},
                                    "format_version": 1, "spec": {}, "model": {"prefix_tokens": 1}})
            rng = np.random.default_rng(0)
            for a in range(0, rows, 64):
                g["x"][a:a + 64] = rng.standard_normal((min(64, rows - a), *shape), dtype=np.float32).astype(dtype)
            g["status"][:] = np.full(rows, OK, np.uint8)
        s = open_store(str(url))
        arr = s["x"]
        mb = rows * int(np.prod(shape)) * np.dtype(dtype).itemsize / 1e6

        def plain(arr: Any = arr, rows: int = rows) -> None:
            for a in range(0, rows, 64):
                np.asarray(arr[a:a + 64])

        def epoch(s: Any = s, name: str = name) -> None:
            if name == "rows":
                sum(len(r) for r, _ in s.batches("x", 1024, shuffle=True, seed=1))
            else:
                sum(len(i) for i, _ in s.token_batches("x", 4096, shuffle=True, seed=1))

        row_kb = int(np.prod(shape)) * np.dtype(dtype).itemsize / 1024
        print(f"\nsharded store, {name}: {rows} rows of {row_kb:.0f} KB ({mb:.0f} MB), shards of 64 rows, inner "
              f"chunks of {inner}, {compression}; median of {repeats}")
        what = f"{'batches' if name == 'rows' else 'token_batches'}(shuffle=True)"
        got = _against_sequential({"sequential zarr read": plain, what: epoch}, repeats, rows, "rows", mb)
        ratios[f"{what}, {row_kb:.0f} KB rows"] = got[what]
    return ratios


def mixing_bench() -> None:
    """Issue 54's mixing figure: token batches of stores written in class order (as an ImageFolder is listed), the
    largest class share per batch of the default stream against a global permutation's and the former default's
    (whole read runs, 8 to a buffer: ``spread=False``), with each buffer's memory and the read rate. Three stores:
    small rows (the tests' store, scaled up); 16 KiB rows whose classes are longer than a read run, as ImageNet's
    (6 runs of 32 MiB a class) but scaled down 8x (runs of 4 MiB, inner chunks of 256 KiB: a default buffer of 32
    MiB, 1/16 of the store); 16 KiB rows in inner chunks of 1 MiB and runs of 32 MiB, as a job writes them (a
    default buffer of 256 MiB, half the store): the read rate of chunks of the usual size."""
    import numpy as np

    sys.path.insert(0, str(REPO / "tests"))  # the mixing tests' store writer and measures
    from mixing import class_sorted, largest_share, permuted

    from extractor.read.reader import open_store

    big = {"rows": 32768, "tokens": 64, "features": 128, "dtype": "float16", "noise": True}
    stores = {"small rows": ({"rows": 20000, "classes": 100, "tokens": 16, "shard": 1000, "inner": 4}, 1024),
              "classes longer than runs": ({**big, "classes": 64, "shard": 256, "inner": 16}, 4096),
              "1 MiB chunks": ({**big, "classes": 100, "shard": 2048, "inner": 64}, 4096)}
    for name, (config, batch) in stores.items():
        url = WORK / f"mixing-{'-'.join(f'{v}' for v in config.values())}.zarr"
        if not (url / "zarr.json").exists():
            class_sorted(str(url), **config)
        s = open_store(str(url))
        labels, rows, tokens = s.labels, config["rows"], config["tokens"]
        mean, worst = largest_share(labels, permuted(np.repeat(np.arange(rows), tokens), batch))
        mb = s["t"].nbytes / 2**20
        print(f"\nmixing, {name}: {rows} rows ({mb:.0f} MiB) in {config['classes']} sorted classes, {tokens} tokens "
              f"each, batches of {batch} tokens; largest class share per batch (mean, worst); load "
              f"{os.getloadavg()[0]:.1f}")
        print(f"  global permutation              {mean:.3f} {worst:.3f}")
        for what, options in [("default", {}), ("spread=False (the former default)", {"spread": False}),
                              ("buffer_chunks=4x default", {"buffer_chunks": 4 * s.token_batches("t").state_dict()[
                                  "buffer_chunks"]})]:
            t = time.perf_counter()
            got = [i[:, 0] for i, _ in s.token_batches("t", batch, seed=1, drop_last=True, **options)]
            took = time.perf_counter() - t
            m, w = largest_share(labels, got)
            memory = s.buffer_bytes("t", options.get("buffer_chunks"), options.get("spread", True))
            print(f"  {what:33} {m:.3f} {w:.3f} ({m / mean:.2f}x), buffer {memory / 2**20:.1f} MiB, "
                  f"{rows * tokens / took / 1e6:.2f} M tokens/s ({mb / took:.0f} MiB/s)")


def as_parquet(image_dir: Path, row_group: int = 100) -> Path:
    """The images of ``image_dir`` in one Parquet file as the Hub holds them ({bytes, path} structs, ClassLabel
    names in the metadata), in the folder source's row order; row groups of 100 rows, as ``datasets`` writes."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = image_dir.with_suffix(".parquet")
    if not path.exists():
        from extractor.data.listing import list_rows
        from extractor.spec.data_spec import DataSpec

        rows = list_rows(DataSpec(root=str(image_dir)))
        images = [{"bytes": Path(p).read_bytes(), "path": i} for p, i in zip(rows.paths, rows.ids, strict=True)]
        table = pa.table({"image": images, "label": rows.labels.tolist()})
        meta = {"info": {"features": {"image": {"_type": "Image"},
                                      "label": {"names": rows.classes, "_type": "ClassLabel"}}}}
        pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps(meta)}), path, row_group_size=row_group)
    return path


def make_images(n: int) -> Path:
    from extractor.demo import CLASSES, _draw

    image_dir = WORK / f"images-{n}"
    if not image_dir.exists():
        import numpy as np

        per_class = -(-n // len(CLASSES))
        for c, name in enumerate(CLASSES):
            (image_dir / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                if c * per_class + i < n:
                    _draw(c, np.random.default_rng([7, c, i]), 256).save(image_dir / name / f"{i:05d}.jpg", quality=90)
    return image_dir


def rss_bench(args: argparse.Namespace) -> None:
    """Peak RSS of the same job on 512 and on 2048 images: memory must not grow with the data."""
    peaks = {}
    for n in (512, 2048):
        cmd = [sys.executable, __file__, "--variant", "fullmap", "--image-dir", str(make_images(n)),
               "--model", "resnet18", "--batch-size", str(args.batch_size), "--decode-workers",
               str(args.decode_workers)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, "THP_MEM_ALLOC_ENABLE": "1"})
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RSS ")), None)
        if line is None:
            sys.exit(f"rss run failed:\n{out.stderr[-3000:]}")
        peaks[n] = int(line.split()[1]) / 1024
    print(f"\npeak RSS, resnet18 layer3 full map float16, shards of 256: 512 images {peaks[512]:.0f} MB, "
          f"2048 images {peaks[2048]:.0f} MB, ratio {peaks[2048] / peaks[512]:.2f}")


def child(args: argparse.Namespace) -> None:
    variants = {"bare": bare, "thingsvision": thingsvision_job}
    result = variants.get(args.variant, extract)(args)
    print("RESULT " + json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--images", type=int, default=512, help="number of sample JPEG images")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="bare,pooled,parquet,fullmap,fullmap-unsharded,early,ray,gradcam,thingsvision")
    p.add_argument("--reader-only", action="store_true", help="only the reader benchmark")
    p.add_argument("--overhead", action="store_true", help="only the host overhead per batch (bench_overhead.py)")
    p.add_argument("--decode", action="store_true", help="only JPEG decoding per core (bench_decode.py)")
    p.add_argument("--gpu", action="store_true", help="only the device check (gpu_check.py: images/s from JPEG "
                                                      "files against the bare bfloat16 loop; small on a CPU)")
    p.add_argument("--codecs", action="store_true", help="only each codec's ratio and CPU on extractor's "
                                                         "activations (bench_codecs.py)")
    p.add_argument("--scale", action="store_true", help="only the costs that grow with the job (bench_scale.py)")
    p.add_argument("--index", action="store_true", help="only the feature index (bench_index.py)")
    p.add_argument("--join", action="store_true", help="only the claims and commits of 1, 4 and 16 processes "
                                                       "sharing one store (bench_join.py)")
    p.add_argument("--index-rows", type=int, default=1000, help="images of ViT-B tokens for the SAE index (the "
                   "issue's size: 20000, ~25 TFLOP per side)")
    p.add_argument("--index-map-rows", type=int, default=100000, help="rows of the 1,024-channel map to index")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--image-dir", dest="image_dir_arg", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        args.images = args.image_dir_arg
        child(args)
        import resource

        print("RSS " + str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
        return

    if args.reader_only:
        WORK.mkdir(exist_ok=True)
        reader_bench()
        token_bench()
        sharding_bench()
        sharded_reader_bench()
        mixing_bench()
        return
    if args.overhead:
        import bench_overhead

        bench_overhead.main()
        return
    if args.scale:
        import bench_scale

        bench_scale.main()
        return
    if args.decode:
        import bench_decode

        bench_decode.main()
        return
    if args.gpu:
        import gpu_check

        sys.argv = [sys.argv[0]]
        gpu_check.main()
        return
    if args.codecs:
        import bench_codecs

        bench_codecs.main()
        return
    if args.index:
        import bench_index

        bench_index.main(args.index_rows, args.index_map_rows)
        return
    if args.join:
        import bench_join

        sys.argv = [sys.argv[0]]
        bench_join.main()
        return
    image_dir = make_images(args.images)
    if "thingsvision" in args.variants.split(","):
        install_thingsvision()
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
    results: dict[str, list[dict]] = {}
    print(f"model {args.model}, {args.images} JPEG images 256x256, batch {args.batch_size}, "
          f"{args.decode_workers} decode workers, {os.cpu_count()} cores; median of {args.repeats}", flush=True)
    for rep in range(args.repeats):
        for variant in args.variants.split(","):
            cmd = [sys.executable, __file__, "--variant", variant, "--image-dir", str(image_dir),
                   "--model", args.model, "--batch-size", str(args.batch_size),
                   "--decode-workers", str(args.decode_workers)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"variant {variant} failed:\n{out.stderr[-3000:]}")
            r = json.loads(line.removeprefix("RESULT "))
            rss = next((ln for ln in out.stdout.splitlines() if ln.startswith("RSS ")), None)
            r["rss_mb"] = int(rss.split()[1]) / 1024 if rss else float("nan")
            results.setdefault(variant, []).append(r)
            print(f"  run {rep + 1} {variant:8s} {r['images_per_s']:.2f} images/s", flush=True)
    base = statistics.median(r["images_per_s"] for r in results["bare"]) if "bare" in results else None
    print(f"\n{'variant':12s} {'images/s':>9s} {'ratio':>6s} {'wall s':>7s} {'start s':>7s} {'RSS MB':>7s}  what")
    what = {"bare": "DataLoader + forward, outputs discarded (reference)",
            "pooled": "extractor: avgpool + layer3 mean-pooled, float32",
            "parquet": "pooled, the same images from a Parquet file (Hub layout, row groups of 100)",
            "fullmap": "extractor: layer3 full map, float16, lz4 (the default)",
            "fullmap-unsharded": "the same, each chunk its own object (output.sharding: false)",
            "early": "extractor: layer2 mean-pooled (stops after layer2)",
            "ray": "extractor on an embedded Ray, 1 worker: the pooled job",
            "gradcam": "extractor: Grad-CAM of layer4 (forward + backward from the logit)",
            "thingsvision": "thingsvision 2.7.3: the pooled job (its loader; layer3 pooled after, in memory)"}
    for variant, rs in results.items():
        ips = statistics.median(r["images_per_s"] for r in rs)
        wall = statistics.median(r.get("wall_seconds", r["seconds"]) for r in rs)
        start = statistics.median(r.get("startup_seconds", 0.0) for r in rs)
        ratio = f"{ips / base:.2f}" if base else "-"
        rss = statistics.median(r["rss_mb"] for r in rs)
        print(f"{variant:12s} {ips:9.2f} {ratio:>6s} {wall:7.1f} {start:7.1f} {rss:7.0f}  {what.get(variant, '')}")
    if "ray" in results and "pooled" in results:
        ray_ips = statistics.median(r["images_per_s"] for r in results["ray"])
        local_ips = statistics.median(r["images_per_s"] for r in results["pooled"])
        print(f"\nray backend over local backend (same pooled job, start-up excluded): {ray_ips / local_ips:.2f}")
    if "thingsvision" in results and "pooled" in results:
        tv_ips = statistics.median(r["images_per_s"] for r in results["thingsvision"])
        local_ips = statistics.median(r["images_per_s"] for r in results["pooled"])
        print(f"extractor over thingsvision (the same pooled job): {local_ips / tv_ips:.2f}; "
              f"their avgpool features against ours: {compare_thingsvision()}")
    if "parquet" in results and "pooled" in results:
        pq_ips = statistics.median(r["images_per_s"] for r in results["parquet"])
        local_ips = statistics.median(r["images_per_s"] for r in results["pooled"])
        print(f"Parquet source over the folder (the same pooled job, the same images): {pq_ips / local_ips:.2f}")
    if "gradcam" in results and "pooled" in results:
        cam_ips = statistics.median(r["images_per_s"] for r in results["gradcam"])
        local_ips = statistics.median(r["images_per_s"] for r in results["pooled"])
        print(f"Grad-CAM job over the forward-only pooled job: {cam_ips / local_ips:.2f}")
    print("\nratio = median images/s over the bare loop's. extractor's images/s runs from the first shard's "
          "start to the job's end (decode, forward, copy, write); 'start s' before it is start-up: Ray, "
          "model build, probe, store creation.")
    rss_bench(args)
    reader_bench()
    token_bench()
    sharding_bench()
    import bench_decode
    import bench_index
    import bench_join
    import bench_overhead
    import bench_scale

    bench_overhead.main()
    bench_decode.main()
    bench_scale.main()
    bench_index.main(args.index_rows, args.index_map_rows)
    sys.argv = [sys.argv[0]]
    bench_join.main()


if __name__ == "__main__":
    main()
