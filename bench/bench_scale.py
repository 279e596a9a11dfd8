"""Costs that grow with the job (issue 29), measured at a size this machine holds and extrapolated linearly:
the statistics merge (24 captures x 1024 features; to 10M rows), tar planning (to 1M samples), the rows'
memory on the driver (to 10M).

    python tests/bench_scale.py        (also run by `make bench`)
"""

from __future__ import annotations

import json
import shutil
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".bench"


def _measured(fn):
    """fn()'s result, seconds, and peak of Python-tracked allocations (numpy's included), bytes."""
    tracemalloc.start()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, seconds, peak


def _list_merge(texts):
    """The merge of stores before issue 29: every record's lists of numbers decoded at once, then summed."""
    records = [json.loads(t) for t in texts if t]
    acc = {}
    for rec in records:
        for key, d in rec.items():
            a = acc.setdefault(key, {"count": 0, "sum": 0.0, "sumsq": 0.0})
            for k in ("count", "sum", "sumsq"):
                a[k] = a[k] + np.asarray(d[k])
    return acc


def stats_bench(shards: int = 128, captures: int = 24, features: int = 1024) -> None:
    import zarr

    from extractor.store.stats import ShardStats, Totals, dumps, merge_shards, shard_record

    rng = np.random.default_rng(0)
    records_new, records_old = [], []
    for _ in range(4):  # 4 distinct records, repeated over the shards
        st = {f"blocks.{i}": ShardStats(["t.token", "t.feature"], [5, features]) for i in range(captures)}
        for v in st.values():
            v.update(rng.standard_normal((2, 5, features)).astype(np.float32), np.arange(2))
        records_new.append(dumps(st))
        records_old.append(json.dumps({k: {**v.to_dict(), "count": v.count.tolist(), "sum": v.sum.tolist(),
                                           "sumsq": v.sumsq.tolist()} for k, v in st.items()}))
    groups = {}
    for name, records in (("lists", records_old), ("base64", records_new)):
        path = WORK / f"stats-{name}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        g = zarr.open_group(str(path), mode="w")
        g.create_array("shard_done", shape=(shards,), dtype="uint8", chunks=(1,), fill_value=1)[:] = 1
        arr = g.create_array("shard_stats", shape=(shards,), dtype=str, chunks=(1,), fill_value="")
        for i in range(shards):
            arr[i] = records[i % 4]
        groups[name] = g
    per = 10_000 / shards  # 10M rows = 10,000 shards of 1024
    kb = len(records_new[0]) / 1e3
    print(f"\nstatistics merge: {captures} captures x {features} features, {shards} shards of records "
          f"({kb:.0f} KB each; lists {len(records_old[0]) / 1e3:.0f} KB); x{per:.0f} for 10M rows (10,000 shards)")
    _, s_old, m_old = _measured(lambda: _list_merge(str(t) for t in groups["lists"]["shard_stats"][:]))
    print(f"  before (all records at once, lists)  {s_old:6.2f} s {m_old / 1e6:7.0f} MB   10M rows: "
          f"{s_old * per:6.0f} s {m_old * per / 1e9:5.1f} GB")
    _, s_all, m_all = _measured(lambda: merge_shards(groups["base64"]))
    print(f"  one merge of every record, slices   {s_all:6.2f} s {m_all / 1e6:7.0f} MB   10M rows: "
          f"{s_all * per:6.0f} s {m_all / 1e6:5.0f} MB (memory flat in shards)")
    totals = Totals(shards)
    t0 = time.perf_counter()
    for i in range(shards):
        totals.add(i, shard_record(groups["base64"], i))
    each = (time.perf_counter() - t0) / shards
    print(f"  the driver, per shard as it finishes {each * 1e3:6.1f} ms (read + add)")
    _, s_end, m_end = _measured(lambda: merge_shards(groups["base64"], totals))
    print(f"  end of run / resume: nothing new     {s_end:6.2f} s {m_end / 1e6:7.0f} MB   (the totals kept, written)")
    _, s_kept, m_kept = _measured(lambda: merge_shards(groups["base64"]))
    print(f"  a later merge from the kept totals   {s_kept:6.2f} s {m_kept / 1e6:7.0f} MB")


def tar_bench(tars: int = 10, per_tar: int = 10_000) -> None:
    """Planning WebDataset tars (a .jpg and a .cls per sample, as most shards hold): the plain header reader
    against tarfile's, CPU time; and the same, all through tarfile (the planner before issue 29)."""
    import io
    import resource
    import tarfile

    import extractor.data.sources.tar as tars_module
    from extractor.data.sources.tar import list_tars

    root = WORK / f"tars-{tars}x{per_tar}"
    if not (root / f"{tars - 1:03d}.tar").exists():
        root.mkdir(parents=True, exist_ok=True)
        for t in range(tars):
            with tarfile.open(root / f"{t:03d}.tar", "w") as tar:
                for i in range(per_tar):
                    for ext, data in ((".jpg", b"\xff\xd8" + bytes(300)), (".cls", str(i % 10).encode())):
                        info = tarfile.TarInfo(f"s{t:03d}_{i:06d}{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
    pattern = str(root / f"{{000..{tars - 1:03d}}}.tar")
    n = tars * per_tar

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def timed() -> tuple[float, float]:
        c0, t0 = cpu(), time.perf_counter()
        rows = list_tars(pattern, [".jpg"], {})
        assert len(rows) == n
        return cpu() - c0, time.perf_counter() - t0

    plain = timed()
    real = tars_module._headers

    def through_tarfile(f, url):
        raise tars_module._Unusual("bench")
        yield

    tars_module._headers = through_tarfile
    try:
        old = timed()
    finally:
        tars_module._headers = real
    per = 1_000_000 / n
    print(f"\ntar planning: {tars} tars x {per_tar:,} samples (.jpg + .cls); x{per:.0f} for 1M samples")
    print(f"  tarfile, same planner  {old[0]:6.2f} s CPU {old[1]:6.2f} s wall   1M: {old[0] * per:5.0f} s CPU "
          f"({old[0] / n * 1e6:.0f} us a sample)")
    print(f"  plain header reader    {plain[0]:6.2f} s CPU {plain[1]:6.2f} s wall   1M: {plain[0] * per:5.0f} s CPU "
          f"({plain[0] / n * 1e6:.0f} us a sample)")


def shard_bench(shards: int = 15) -> None:
    """A shard's opening reads (locators, labels, capture arrays) and finishing writes (status, errors, digests,
    statistics, done marker) on a local store of 2 captures, as a worker does them; the median of ``shards``."""
    import statistics

    import zarr

    from extractor.data.rows import Rows
    from extractor.store.layout import StoreArrays, create_store
    from extractor.store.lease import Lease
    from extractor.store.writer import ShardWriter

    url, size = str(WORK / "shard-open-finish.zarr"), 256
    shutil.rmtree(url, ignore_errors=True)
    caps = {k: {"shape": [512], "dtype": "float32", "dims": [f"{k}.feature"], "layer": k, "what": "output",
                "reduce": "mean"} for k in ("a", "b")}
    n = size * shards
    lease = Lease(url, None, 60.0, {"host": "bench"})
    create_store(url, Rows(ids=[f"i{i}" for i in range(n)], paths=[f"/x/i{i}.jpg" for i in range(n)], labels=[0] * n),
                 StoreArrays(captures=caps, extras={}, shard_size=size, chunk_rows=dict.fromkeys(caps, size)),
                 {"n_rows": n, "n_shards": shards, "captures": caps, "format_version": 1, "spec": {}, "model": {}},
                 lease=lease, fresh=True)
    token = lease.token
    opening, finishing = [], []
    for i in range(shards):
        t0 = time.perf_counter()
        w = ShardWriter(url, i * size, (i + 1) * size, i, None, fence=token)
        w.opening(labels=True), w.chunk_rows(caps)
        t1 = time.perf_counter()
        w.finish(np.ones(size, np.uint8), [""] * size, None, "", np.zeros(size, np.uint64))
        opening.append(t1 - t0)
        finishing.append(time.perf_counter() - t1)
    assert zarr.open_group(url, mode="r")["shard_done"][:].all()
    print(f"\nper shard (local store, 2 captures, median of {shards}): open {statistics.median(opening) * 1e3:.1f} ms, "
          f"finish {statistics.median(finishing) * 1e3:.1f} ms (the first shard of a job opens the arrays: "
          f"{opening[0] * 1e3:.1f} ms)")


def planning_bench(rows: int = 300_000, files: int = 100_000) -> None:
    """The driver's memory for the rows of a job: the peak while listing (tracked allocations, numpy's included)
    and what the listed rows hold afterwards, for a manifest, a folder and tars (the tar bench's), each listed at
    two sizes: the growth per row between them, and 10M rows extrapolated along it."""
    import tracemalloc

    from extractor.data import list_rows
    from extractor.spec import DataSpec

    def manifest(n: int) -> DataSpec:
        path = WORK / f"manifest-{n}.csv"
        if not path.exists():
            path.write_text("path,label\n" + "".join(f"train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG,{i % 1000}\n"
                                                     for i in range(n)))
        return DataSpec(source="manifest", manifest=str(path), root="/data/imagenet")

    def folder(n: int) -> DataSpec:
        root = WORK / f"folder-{n}"  # class folders of 1000 images, as ImageNet's hold 1300
        if not (root / f"c{(n - 1) // 1000:04d}" / f"{n - 1:07d}.jpg").exists():
            for i in range(n):
                (root / f"c{i // 1000:04d}").mkdir(parents=True, exist_ok=True)
                (root / f"c{i // 1000:04d}" / f"{i:07d}.jpg").touch()
        return DataSpec(source="folder", root=str(root))

    def tars(n: int) -> DataSpec:
        return DataSpec(source="tar", tars=str(WORK / "tars-10x10000" / f"{{000..{n // 10_000 - 1:03d}}}.tar"))

    def measured(data: DataSpec) -> tuple[int, int, int]:
        tracemalloc.start()
        listed = list_rows(data)
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return len(listed), peak, held

    print("\nthe rows on the driver: peak while listing, held after (bytes a row, the growth between two sizes)")
    sizes = {"manifest": (manifest, rows), "folder": (folder, files), "tar": (tars, 100_000)}
    for name, (source, n) in sizes.items():
        if name == "tar" and not (WORK / "tars-10x10000" / "009.tar").exists():
            continue
        (n1, peak1, held1), (n2, peak2, held2) = measured(source(n // 2)), measured(source(n))
        grow, keep = (peak2 - peak1) / (n2 - n1), (held2 - held1) / (n2 - n1)
        print(f"  {name:9s} {n1:,} and {n2:,} rows: peak {grow:4.0f} B a row ({peak2 / 1e6:4.0f} MB at {n2:,}), "
              f"held {keep:4.0f} B a row; 10M rows: peak {(peak2 + grow * (1e7 - n2)) / 1e9:4.2f} GB")


def parquet_bench(files: int = 100, per_file: int = 10_000, row_group: int = 1000) -> None:
    """Planning a Parquet source of ``files`` x ``per_file`` rows (Hub layout; images of a few bytes: only the
    footers and the label column are read): wall and CPU seconds."""
    import json
    import resource

    import pyarrow as pa
    import pyarrow.parquet as pq

    from extractor.data import list_rows
    from extractor.spec import DataSpec

    root = WORK / f"parquet-{files}x{per_file}"
    if not (root / f"train-{files - 1:05d}.parquet").exists():
        root.mkdir(parents=True, exist_ok=True)
        meta = json.dumps({"info": {"features": {"image": {"_type": "Image"}, "label": {
            "names": [f"c{i}" for i in range(1000)], "_type": "ClassLabel"}}}})
        for f in range(files):
            table = pa.table({"image": [{"bytes": b"\xff\xd8" + bytes([i % 256]) * 14, "path": f"{i}.jpg"}
                                        for i in range(per_file)], "label": [i % 1000 for i in range(per_file)]})
            pq.write_table(table.replace_schema_metadata({"huggingface": meta}), root / f"train-{f:05d}.parquet",
                           row_group_size=row_group)

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    c0, t0 = cpu(), time.perf_counter()
    rows = list_rows(DataSpec(source="parquet", parquet=str(root / "train-*.parquet")))
    wall, used = time.perf_counter() - t0, cpu() - c0
    assert len(rows) == files * per_file and len(rows.classes) == 1000
    print(f"\nParquet planning: {files} files x {per_file:,} rows (row groups of {row_group}): {wall:5.2f} s wall, "
          f"{used:5.2f} s CPU ({used / len(rows) * 1e6:.1f} us a row)")


def main() -> None:
    WORK.mkdir(exist_ok=True)
    stats_bench()
    tar_bench()
    parquet_bench()
    planning_bench()
    shard_bench()


if __name__ == "__main__":
    main()
