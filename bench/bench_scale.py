"""Costs that grow with the job (issues 29 and 39), measured at a size this machine holds and extrapolated
linearly: the statistics merge (24 captures x 1024 features; to 10M rows), tar planning (to 1M samples), the rows'
memory on the driver (to 10M), a shard's finish, a resume's per-file check of a folder store, shuffled reads of
sharded stores, row(id) at 1M rows, the whole resume command per source (bench_resume.py, to 1M and 10M) and a
touched tar; then issue 39's targets beside the figures, in one table.

    python bench/bench.py --scale                       (all of it: about 15 minutes on 2 loaded cores)
    python bench/bench_scale.py --only tar|rows|...     (one of them; --rows 0.1,0.5,1: the memory fit's sizes)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import tracemalloc
from pathlib import Path
from typing import Any

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


def stats_bench(shards: int = 128, captures: int = 24, features: int = 1024, history: bool = True) -> None:
    """The statistics merge (issue 29); ``history``: also the merge before it (40 s on this machine)."""
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
    if history:
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


def tar_bench(tars: int = 10, per_tar: int = 10_000, history: bool = True) -> float:
    """Planning WebDataset tars (a .jpg and a .cls per sample, as most shards hold): the plain header reader
    against tarfile's, CPU time; and the same, all through tarfile (the planner before issue 29). Returns the bulk
    reader's CPU microseconds a sample (the least of three runs). ``history``: also the readers before it."""
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

    import extractor.data.sources._tar_fast as fast

    bulk = timed()
    compiled = fast._walk_kernel() is not None
    real_fast, real_headers, real_kernel = tars_module.fast_samples, tars_module._headers, fast._KERNEL[:]
    fast._KERNEL[:] = [None]
    interpreted = min(timed() for _ in range(2)) if compiled else (float("nan"), float("nan"))
    fast._KERNEL[:] = real_kernel

    def through_tarfile(f, url):
        raise tars_module._Unusual("bench")
        yield

    plain = old = (float("nan"), float("nan"))
    try:
        if history:
            tars_module.fast_samples = lambda *a: None
            plain = timed()
            tars_module._headers = through_tarfile
            old = timed()
    finally:
        tars_module.fast_samples, tars_module._headers = real_fast, real_headers
    again = min(timed()[0] for _ in range(2))  # the bulk reader twice more: the least of three, as load varies
    bulk = (min(bulk[0], again), bulk[1])
    per = 1_000_000 / n
    print(f"\ntar planning: {tars} tars x {per_tar:,} samples (.jpg + .cls); x{per:.0f} for 1M samples")
    for name, (used, wall) in (("tarfile, same planner", old), ("plain header reader", plain),
                               ("bulk, interpreted walk", interpreted),
                               ("bulk, compiled walk" if compiled else "bulk (no numba)", bulk))[0 if history else 2:]:
        if used != used:  # (nan: not run)
            continue
        print(f"  {name:22s} {used:6.2f} s CPU {wall:6.2f} s wall   1M: {used * per:5.0f} s CPU "
              f"({used / n * 1e6:.1f} us a sample)")
    return bulk[0] / n * 1e6


def large_tar_bench(tars: int = 2, per_tar: int = 2_000) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Planning tars of real-sized images (60-140 KB, a .cls each: a header a page or more apart) in three states
    of the page cache: not there (read from the disk as listed), there as the kernel's read-ahead put it (large
    folios: a fault maps many pages), and there as small writes left it (the tars written just now: a fault a
    page, about 6 us here, and its unmapping 3); the headers read by ``pread`` (as the listing chooses for such
    tars) and walked in the mapping. CPU and wall microseconds a sample and MB read from the disk, the least of
    three runs (cold: one)."""
    import io
    import tarfile

    import extractor.data.sources._tar_fast as fast
    from extractor.data.sources.tar import list_tars

    root = WORK / f"tars-{tars}x{per_tar}-100k"
    paths = [root / f"{t:03d}.tar" for t in range(tars)]
    if not paths[-1].exists():
        root.mkdir(parents=True, exist_ok=True)
        sizes = np.random.default_rng(0).integers(60_000, 140_000, tars * per_tar)
        for t, path in enumerate(paths):
            with tarfile.open(path, "w") as tar:
                for i in range(per_tar):
                    image = b"\xff\xd8" + bytes(int(sizes[t * per_tar + i]))
                    for ext, data in ((".cls", str(i % 10).encode()), (".jpg", image)):
                        info = tarfile.TarInfo(f"s{t:03d}_{i:06d}{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
    pattern, n = str(root / f"{{000..{tars - 1:03d}}}.tar"), tars * per_tar

    def read_bytes() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))

    def listed(times: int) -> tuple[float, float, float]:
        best = (float("inf"), float("inf"), float("inf"))
        for _ in range(times):
            c0, t0, r0 = time.process_time(), time.perf_counter(), read_bytes()
            assert len(list_tars(pattern, [".jpg"], {})) == n
            took = (time.process_time() - c0, time.perf_counter() - t0, read_bytes() - r0)
            best = min(best, (took[0] / n * 1e6, took[1] / n * 1e6, took[2] / 1e6))
        return best

    def evicted() -> None:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    def both(cold: bool) -> dict[str, tuple[float, float, float]]:
        """The headers read by pread (as the listing chooses for these tars), then walked in the mapping."""
        far = fast._FAR
        try:
            evicted() if cold else None
            read = listed(1 if cold else 3)
            fast._FAR = 1 << 62
            evicted() if cold else None
            return {"pread": read, "mapped": listed(1 if cold else 3)}
        finally:
            fast._FAR = far

    out = {"not in the page cache (read as listed)": both(cold=True)}
    evicted()
    for path in paths:
        path.read_bytes()  # (read ahead by the kernel, as a file read from the disk is)
    out["in the page cache, read from the disk"] = both(cold=False)
    for path in paths:  # rewritten a tar block at a time, as tarfile writes: small folios
        with open(path, "rb") as f, open(path.with_suffix(".new"), "wb", buffering=0) as g:
            while block := f.read(10_240):
                g.write(block)
        path.with_suffix(".new").replace(path)
    out["in the page cache, as written in small writes"] = both(cold=False)
    print(f"\ntar planning, {tars} tars x {per_tar:,} samples of 60-140 KB images (.cls + .jpg), a sample: headers "
          "read by pread (as listed), and walked in the mapping")
    for state, ways in out.items():
        for way, (cpu_us, wall_us, mb) in ways.items():
            print(f"  {state if way == 'pread' else '':46s} {way:6s} {cpu_us:5.1f} us CPU {wall_us:6.1f} us wall  "
                  f"{mb:6.0f} MB read from the disk")
    return out


def shard_bench(shards: int = 15, captures: int = 4) -> float:
    """A shard's opening reads (locators, labels, capture arrays) and finishing writes (each capture's sharded object
    closed, status, errors, digests, statistics, done marker) on a local fenced store of ``captures`` captures, as a
    worker does them: CPU (all threads of the process) and wall, the median of ``shards``. Returns a finish's CPU
    milliseconds."""
    import statistics

    from extractor.data.rows import Rows
    from extractor.store import Generation, Objects, read_head
    from extractor.store.layout import StoreArrays
    from extractor.store.synthetic import create_store, ticket
    from extractor.store.writer import ShardWriter

    url, size, chunk = str(WORK / "shard-open-finish.zarr"), 256, 64
    shutil.rmtree(url, ignore_errors=True)
    caps = {f"c{k}": {"shape": [512], "dtype": "float32", "dims": [f"c{k}.feature"], "layer": f"c{k}",
                      "what": "output", "reduce": "mean"} for k in range(captures)}
    n = size * shards
    create_store(url, Rows(ids=[f"i{i}" for i in range(n)], paths=[f"/x/i{i}.jpg" for i in range(n)], labels=[0] * n),
                 StoreArrays(captures=caps, extras={}, shard_size=size, chunk_rows=dict.fromkeys(caps, chunk),
                             sharded=True),
                 {"n_rows": n, "n_shards": shards, "captures": caps, "format_version": 1}, pending=True)
    claimant = ticket(url)
    rows = np.random.default_rng(0).standard_normal((chunk, 512)).astype(np.float32)
    opening: list[tuple[float, float]] = []
    finishing: list[tuple[float, float]] = []
    for i in range(shards):
        c0, t0 = time.process_time(), time.perf_counter()
        w = ShardWriter(url, i * size, (i + 1) * size, i, None, claimant)
        w.opening(labels=True), w.chunk_rows(caps)
        opening.append((time.process_time() - c0, time.perf_counter() - t0))
        for offset in range(0, size, chunk):
            w.write(offset, dict.fromkeys(caps, rows))
        c0, t0 = time.process_time(), time.perf_counter()
        w.finish(np.ones(size, np.uint8), [""] * size, None, "", np.zeros(size, np.uint64))
        finishing.append((time.process_time() - c0, time.perf_counter() - t0))
    objects = Objects.at(url)
    assert Generation(objects, read_head(objects).generation).ledger().read().done.all()  # every shard committed

    def ms(times: list[tuple[float, float]]) -> str:
        cpu, wall = (statistics.median(t[k] for t in times[1:]) * 1e3 for k in (0, 1))
        return f"{cpu:.1f} ms CPU, {wall:.1f} ms wall"

    print(f"\nper shard (local store, its commits, {captures} sharded captures, median of {shards - 1}): open "
          f"{ms(opening)}; finish {ms(finishing)} (target 5 ms CPU); the first shard of a job opens the arrays: "
          f"{opening[0][0] * 1e3:.1f} ms CPU")
    return statistics.median(t[0] for t in finishing[1:]) * 1e3


def _synthetic(source: str, n: int, work: Path) -> tuple[Any, contextlib.ExitStack]:
    """A data spec of ``n`` rows of ``source`` and the patches that list it without files: ImageNet's names
    (class folders of 1,300, tars and Parquet files of 10,000 rows); a manifest is written once (CSV)."""
    from unittest import mock

    import extractor.data.sources as sources
    import extractor.data.sources.folder as folder
    import extractor.data.sources.parquet as parquet
    import extractor.data.sources.tar as tar
    from extractor.data.rows import Strings
    from extractor.spec import DataSpec

    stack, per = contextlib.ExitStack(), 10_000
    if source in ("manifest", "manifest-url"):  # -url: its images on S3 (no file stat-ed: what a LAION list is)
        path = work / f"manifest-{n}.csv"
        if not path.exists():
            with open(path, "w") as f:
                f.write("path,label\n")
                f.writelines(f"train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG,{i % 1000}\n" for i in range(n))
        root = "s3://bucket/imagenet" if source == "manifest-url" else "/data/imagenet"
        return DataSpec(source="manifest", manifest=str(path), root=root), stack
    if source == "folder":
        classes = -(-n // 1300)

        top = os.path.abspath(work)

        def entries(path: str) -> tuple[list[str], list[str]]:  # (files, folders) of a folder, as the walk lists
            if path == top:
                return [], [f"n{c:08d}" for c in range(classes)]
            c = int(path.rsplit("/n", 1)[1])
            return [f"n{c:08d}_{i}.JPEG" for i in range(c * 1300, min(n, c * 1300 + 1300))], []

        stack.enter_context(mock.patch.object(folder, "_entries", entries))
        stack.enter_context(mock.patch.object(sources, "folder_prints", lambda path, names: [12345] * len(names)))
        return DataSpec(source="folder", root=str(work)), stack
    if source == "tar":
        def scan(url: str, extensions: Any, storage: Any) -> Any:  # as the bulk header reader gives them
            t = int(url.rsplit("-", 1)[1][:6])
            keys = [f"imagenet-train/{t:06d}/{i:09d}" for i in range(t * per, t * per + per)]
            held = Strings()  # (the keys as the bulk reader hands them: their bytes and ends)
            held.extend(keys)
            return tar.Samples(keys=held.array(), members=[f"{k}.jpg" for k in keys],
                               offsets=list(range(t * per * 1536 + 512, (t + 1) * per * 1536 + 512, 1536)),
                               sizes=[110_000] * per, labels=[str(c) for c in range(1000)],
                               label_codes=np.arange(t * per, t * per + per) % 1000, end_names=[".jpg"],
                               end_codes=np.zeros(per, np.int64))

        stack.enter_context(mock.patch.object(tar, "scan_tar", scan))
        stack.enter_context(mock.patch.object(tar, "listing_processes", return_value=0))  # (scan: this process's)
        stack.enter_context(mock.patch.object(tar, "_tar_fingerprint", lambda url, storage: 987654321))  # noqa: PT008
        return DataSpec(source="tar", tars=f"/data/tars/train-{{000000..{n // per - 1:06d}}}.tar"), stack
    import pyarrow as pa

    labels = pa.array(np.arange(per) % 1000)  # (what _scan reads: the label column, an Arrow array)
    stack.enter_context(mock.patch.object(  # noqa: PT008  # the files as listed: what a resume finds
        parquet, "_file_fingerprint", lambda url, storage, handle=None: 987654321))
    stack.enter_context(mock.patch.object(parquet, "_scan", lambda url, cols, storage: parquet._File(  # noqa: PT008
        rows=per, labels=labels, ids=None, names=None, print=987654321)))
    stack.enter_context(mock.patch.object(  # noqa: PT008  # a job's stream counts the rows from the footers first
        parquet, "_footer", lambda url, cols, storage: parquet._Footer(rows=per, coded=True, names=None)))
    files = [f"/data/hub/imagenet-1k/data/train-{f:05d}-of-{n // per:05d}.parquet" for f in range(n // per)]
    return DataSpec(source="parquet", parquet=files), stack


def planning_bench(sizes: tuple[int, ...] = (100_000, 1_000_000, 2_000_000), sources: tuple[str, ...] = (
        "manifest", "folder", "tar", "parquet")) -> dict[str, tuple[float, float]]:
    """The driver's memory for the rows of a job, each source listed at ``sizes`` from synthetic listings (no
    files: the listing functions patched): the peak while listing and what the rows hold after (tracked
    allocations, numpy's included), fitted along the sizes (least squares) to 10M rows. Returns each source's
    (peak, held) bytes at 10M rows."""
    from extractor.data import list_rows

    print(f"\nthe rows on the driver, from synthetic listings of {', '.join(f'{n:,}' for n in sizes)} rows: peak "
          "while listing, held after (tracemalloc), fitted to 10M rows")
    out = {}
    for source in sources:
        points = []
        for n in sizes:
            spec, patched = _synthetic(source, n, WORK)
            with patched:
                tracemalloc.start()
                listed = list_rows(spec)
                held, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
            assert len(listed) == n
            del listed
            points.append((n, peak, held))
        ns = np.array([p[0] for p in points], dtype=float)
        fit = {what: np.polyfit(ns, [p[k] for p in points], 1) if len(points) > 1 else
               np.array([points[0][k] / ns[0], 0]) for k, what in ((1, "peak"), (2, "held"))}
        print(f"  {source:9s} peak {fit['peak'][0]:5.1f} B a row, held {fit['held'][0]:5.1f} B a row; 10M rows: peak "
              f"{np.polyval(fit['peak'], 1e7) / 1e9:4.2f} GB, held {np.polyval(fit['held'], 1e7) / 1e9:4.2f} GB "
              f"(target: 1 GB)")
        out[source] = (float(np.polyval(fit["peak"], 1e7)), float(np.polyval(fit["held"], 1e7)))
    return out


def _driver_one(source: str, n: int) -> dict[str, float]:
    """In this process: the driver's path from listing to a made store for ``n`` synthetic rows of ``source`` (the
    listing with its duplicate check, the rows' digests, the store's per-row arrays and id index): the peak of the
    process's anonymous memory over what the imported libraries hold (RssAnon, read every 10 ms: numpy's, pyarrow's
    and the allocator's included; file pages mapped from the disk, which the system drops and reads again, are not),
    and CPU seconds of each step (tracemalloc is off: it slows Python four times)."""
    import threading

    from extractor.data import list_rows
    from extractor.data import source as source_of
    from extractor.store.layout import StoreArrays
    from extractor.store.synthetic import create_store

    def anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    spec, patched = _synthetic(source, n, WORK)
    store = WORK / f"driver-{source}.zarr"
    shutil.rmtree(store, ignore_errors=True)
    base, peak, running = anon(), [0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], anon())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    c0 = time.process_time()
    with patched:
        rows = list_rows(spec)
    listed = time.process_time() - c0
    c0 = time.process_time()
    attrs = {"n_rows": len(rows), "n_shards": -(-len(rows) // 1024), "captures": {}, "format_version": 1,
             "ids_digest": None, "paths_digest": None}  # made as the store writes them, as a new job's are
    create_store(str(store), rows, StoreArrays(captures={}, extras={}, shard_size=1024, chunk_rows={},
                                               locators=source_of(spec.source).locators), attrs)
    stored = time.process_time() - c0
    running[0] = False
    spilled = rows.on_disk()
    sampler.join()
    shutil.rmtree(store, ignore_errors=True)
    assert len(rows) == n
    return {"list_s": listed, "store_s": stored, "anon": max(0, peak[0] - base), "disk": spilled}


def driver_bench(sizes: tuple[int, ...] = (1_000_000, 10_000_000), sources: tuple[str, ...] = (
        "manifest", "manifest-url", "folder", "tar", "parquet")) -> dict[str, list[dict[str, float]]]:
    """Issue 57: the driver's memory from its listing to a made store, each source at ``sizes`` (each in a fresh
    interpreter: :func:`_driver_one`); the growth from the first size to the last against the target (50 MB from 1M
    to 10M rows)."""
    import subprocess
    import sys

    print(f"\nthe driver from listing to a made store (synthetic listings; a fresh process each): peak memory over "
          f"the imported libraries, CPU seconds; rows {', '.join(f'{n:,}' for n in sizes)}")
    out: dict[str, list[dict[str, float]]] = {}
    for source in sources:
        out[source] = []
        for n in sizes:
            done = subprocess.run([sys.executable, __file__, "--driver-one", source, str(n)], check=True,
                                  capture_output=True, text=True, cwd=REPO)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            out[source].append(got)
            per = got["list_s"] / n * 1e6
            print(f"  {source:9s} {n:>11,} rows: peak {got['anon'] / 1e6:7.1f} MB; list {got['list_s']:6.1f} s CPU "
                  f"({per:4.1f} s a million), store "
                  f"{got['store_s']:6.1f} s CPU; {got['disk'] / n:.0f} bytes a row spilled to the disk")
        first, last = out[source][0], out[source][-1]
        print(f"  {source:9s} growth {sizes[0]:,} -> {sizes[-1]:,}: {(last['anon'] - first['anon']) / 1e6:+.1f} MB "
              "(target: +50 MB from 1M to 10M)")
    return out


def sample_bench(n: int = 100_000_000, sources: tuple[str, ...] = ("parquet", "tar")) -> dict[str, float]:
    """Issue 57: ``extractor plan``'s listing of a large source, sampled (a part of 16 files spread over it, after a
    warm-up of one): seconds to its figures at ``n`` synthetic rows, and its estimate of the rows and of the full
    listing's CPU. Returns each source's wall seconds."""
    from extractor.data import list_rows, sample_of

    print(f"\nplan of {n:,} rows, sampled (synthetic listings): the listing's part of the plan")
    out = {}
    for source in sources:
        spec, patched = _synthetic(source, n, WORK)
        with patched:
            t0, c0 = time.perf_counter(), time.process_time()
            warm, sampled = sample_of(spec, parts=1), sample_of(spec)
            assert warm is not None and sampled is not None
            list_rows(warm.data)
            c1 = time.process_time()
            rows = list_rows(sampled.data)
            cpu = (time.process_time() - c1) * sampled.scale
            out[source] = wall = time.perf_counter() - t0
        print(f"  {source:9s} {wall:5.1f} s wall, {time.process_time() - c0:5.1f} s CPU from {sampled}: rows "
              f"{round(len(rows) * sampled.scale):,} (listed whole: {n:,}), listing them all about {cpu:,.0f} s of "
              f"CPU ({cpu / n * 1e6:.1f} s a million)")
    return out


def real_parquet(files: int, per_file: int = 10_000, row_group: int = 1000) -> Path:
    """A folder of ``files`` Parquet files of ``per_file`` rows each (Hub layout: ClassLabel names, images of a few
    bytes), written once and kept under .bench."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

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
    return root


def parquet_bench(files: int = 100, per_file: int = 10_000, row_group: int = 1000) -> None:
    """Planning a Parquet source of ``files`` x ``per_file`` rows (Hub layout; images of a few bytes: only the
    footers and the label column are read): wall and CPU seconds."""
    import resource

    from extractor.data import list_rows
    from extractor.spec import DataSpec

    root = real_parquet(files, per_file, row_group)

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    c0, t0 = cpu(), time.perf_counter()
    rows = list_rows(DataSpec(source="parquet", parquet=str(root / "train-*.parquet")))
    wall, used = time.perf_counter() - t0, cpu() - c0
    assert len(rows) == files * per_file and len(rows.classes) == 1000
    print(f"\nParquet planning: {files} files x {per_file:,} rows (row groups of {row_group}): {wall:5.2f} s wall, "
          f"{used:5.2f} s CPU ({used / len(rows) * 1e6:.1f} us a row)")


def resume_bench(files: int = 200_000, folders: int = 200) -> None:
    """The source's part of a resume of a complete folder store (issue 39, item 3), CPU time: before, the folder
    listed again and its ids and paths digested to compare with the store; now, the store's rows taken while the
    tree is as listed (a stat of each folder, then of each file for its fingerprint)."""
    import resource

    import zarr

    from extractor.data import list_rows, reuse
    from extractor.spec import DataSpec
    from extractor.store import StoredRows
    from extractor.store.layout import ATTR
    from extractor.store.provenance import _digest

    root = WORK / f"folder-{files}"
    if not (root / f"c{folders - 1:03d}").exists():
        for c in range(folders):
            (root / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
            for i in range(files // folders):
                (root / f"c{c:03d}" / f"{i:06d}.jpg").write_bytes(b"\xff\xd8")
        hour_ago = time.time_ns() - 3600 * 10**9  # settled: a folder modified as it is listed is listed again
        for folder in (root, *root.iterdir()):
            os.utime(folder, ns=(hour_ago, hour_ago))
    data = DataSpec(root=str(root))

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    c0 = cpu()
    rows = list_rows(data)
    digests = _digest(rows.ids), _digest(rows.paths)
    before = cpu() - c0
    store = WORK / f"folder-{files}.zarr"
    shutil.rmtree(store, ignore_errors=True)
    group = zarr.open_group(str(store), mode="w")
    group.create_array("paths", data=np.asarray(rows.paths[:len(rows)].tolist(), dtype=str))
    group.attrs[ATTR] = {"listing": rows.listing, "n_rows": len(rows), "ids_digest": digests[0],
                         "paths_digest": digests[1], "classes": rows.classes, "spec": {"data": {"source": "folder"}}}
    c0 = cpu()
    listing_only = DataSpec(root=str(root), verify="listing")  # (the default, verify: files, stats each file too)
    again = reuse(listing_only, StoredRows(zarr.open_group(str(store), mode="r")))
    after = cpu() - c0
    assert again is not None and again.stored is not None and again.fingerprints is None
    from extractor.data.sources import files_now, source

    c0 = cpu()
    source("folder").listing(data, rows.listing)
    tree = cpu() - c0
    c0 = cpu()
    files_now(StoredRows(zarr.open_group(str(store), mode="r")))
    stats = cpu() - c0
    c0 = cpu()
    for folder in sorted(os.listdir(root)):  # the floor: a bare stat of each file by name, nothing else
        fd = os.open(root / folder, os.O_RDONLY | os.O_DIRECTORY)
        for name in sorted(os.listdir(fd)):
            os.stat(name, dir_fd=fd)
        os.close(fd)
    floor = cpu() - c0
    per = 1_000_000 / files
    print(f"\nresume of a complete folder store, the source's part: {files:,} files in {folders} folders; "
          f"x{per:.0f} for 1M")
    print(f"  listed again, digested   {before:6.2f} s CPU   1M: {before * per:5.1f} s")
    print(f"  taken from the store     {after:6.2f} s CPU   1M: {after * per:5.1f} s  (a stat a folder: listing)")
    print(f"    the folders' mtimes    {tree:6.2f} s CPU   1M: {tree * per:5.1f} s  (a stat a folder recorded)")
    print(f"    each file's stat, hash {stats:6.2f} s CPU   1M: {stats * per:5.1f} s  (files_now: data.verify: files)")
    print(f"    a bare stat a file     {floor:6.2f} s CPU   1M: {floor * per:5.1f} s  (the floor of a per-file check)")
    nfs_bench(np.asarray(rows.paths[:20_000].tolist()))


def nfs_bench(paths: np.ndarray, wait_s: float = 0.0003) -> None:
    """A network file system, simulated: each stat waits ``wait_s`` (a server's answer, 0.1-1 ms on NFS or Lustre)
    before the real one; ``stat_prints`` of ``paths`` one at a time and on its threads, wall seconds."""
    from unittest import mock

    from extractor.data.sources import STAT_THREADS, stat_prints

    real = os.stat

    def stat(*args: object, **kwargs: object) -> os.stat_result:
        time.sleep(wait_s)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    walls = {}
    with mock.patch.object(os, "stat", stat):
        for threads in (0, STAT_THREADS):
            with mock.patch.dict(os.environ, {"EXTRACTOR_STAT_THREADS": str(threads)}):
                t0 = time.perf_counter()
                stat_prints(paths)
                walls[threads] = time.perf_counter() - t0
    print(f"  a network file system, simulated ({wait_s * 1e3:.1f} ms a stat), {len(paths):,} files: one at a time "
          f"{walls[0]:.2f} s wall, {STAT_THREADS} threads {walls[STAT_THREADS]:.2f} s "
          f"({walls[0] / walls[STAT_THREADS]:.1f}x; 1M files: {walls[STAT_THREADS] * 1e6 / len(paths):.0f} s)")


def row_bench(n: int = 1_000_000) -> tuple[float, float]:
    """``Store.row(id)`` on a store of ``n`` rows (ImageNet's ids; one small capture), in a new process: the first
    call (reading the store's id index, ``id_index``; a store made before it: reading the ids and comparing them)
    and the 17th (before the id index, the one that sorted the ids' hashes), wall seconds."""
    import subprocess
    import sys

    url = WORK / f"row-by-id-{n}.zarr"
    if not (url / "done").exists() or not (url / "id_index").exists():  # (made before the id index: again)
        from extractor.data.rows import Rows
        from extractor.store.layout import OK, StoreArrays
        from extractor.store.synthetic import create_store

        shutil.rmtree(url, ignore_errors=True)
        ids = [f"train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG" for i in range(n)]
        meta = {"shape": [8], "dtype": "float32", "dims": ["x.feature"], "layer": "x", "what": "output",
                "reduce": "mean"}
        g = create_store(str(url), Rows(ids=ids, paths=ids, labels=[i % 1000 for i in range(n)]),
                         StoreArrays(captures={"x": meta}, extras={}, shard_size=1024, chunk_rows={"x": 256}),
                         attrs={"n_rows": n, "n_shards": -(-n // 1024), "captures": {"x": meta}, "format_version": 1,
                                "spec": {}})
        g["status"][:] = np.full(n, OK, np.uint8)
        (url / "done").touch()
    code = f"""
import time
from extractor.read import open_store
s = open_store({str(url)!r})
t0 = time.perf_counter(); s.row("train/n00000777/n00000777_{n - 223}.JPEG"); first = time.perf_counter() - t0
for i in range(15):
    s.row(f"train/n00000{{i:03d}}/n00000{{i:03d}}_{{i}}.JPEG")
t0 = time.perf_counter(); s.row("train/n00000005/n00000005_{n // 2 + 5}.JPEG"); index = time.perf_counter() - t0
print(first, index)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    first, index = map(float, out.stdout.split())
    print(f"\nrow(id) on a store of {n:,} rows, a new process: the first call {first:.2f} s (its id index read; "
          f"target 0.5 s); the 17th {index:.2f} s")
    return first, index


def _row(name: str, measured: str, target: str, met: bool | None) -> str:
    return f"  {name:58s} {measured:>22s}  {target:>14s}  {'-' if met is None else 'yes' if met else 'NO'}"


def main(driver_rows: tuple[int, ...] = (1_000_000, 10_000_000),
         resume_rows: tuple[int, ...] = (100_000, 200_000, 500_000)) -> None:
    """Every bench here (without the planners before issues 29 and 39: ``--only stats`` and ``--only tar`` show
    them), then each target of issue 39 beside its measured figure, in one table; about 15 minutes on 2 loaded
    cores once the benches' files exist (the first run makes them: about 20 minutes more)."""
    import sys

    import bench_resume

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench as reader

    started, load = time.perf_counter(), os.getloadavg()[0]
    WORK.mkdir(exist_ok=True)
    stats_bench(history=False)
    tar_us = tar_bench(history=False)
    large = large_tar_bench()
    parquet_bench()
    driver = driver_bench(driver_rows)
    sampled = sample_bench()
    finish_ms = shard_bench()
    resume_bench()
    ratios = reader.sharded_reader_bench()
    first, _ = row_bench()
    resumes = bench_resume.resume_bench(resume_rows)
    touched = bench_resume.touched_tar_bench()
    print(f"\nissue 39's targets, this run (load {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
          f"{(time.perf_counter() - started) / 60:.1f} minutes)")
    print(_row("target", "measured", "target", None).replace(" -", "met"))
    for what, ratio in ratios.items():
        print(_row(f"{what} / a sequential read (sharded)", f"{ratio:.2f}x", ">= 0.8x", ratio >= 0.8))
    print(_row("row(id), the first call, 1M rows", f"{first:.2f} s", "<= 0.5 s", first <= 0.5))
    fit = f"fitted from {', '.join(f'{n / 1e6:g}M' for n in resume_rows)}"
    for source, (one, ten) in resumes.items():
        shown = source.replace(":", ", verify: ")
        print(_row(f"resume of a complete store, {shown}, 1M", f"{one:.2f} s CPU ({fit[:6]})",
                   "<= 5 s", one <= 5))
        print(_row("  the same at 10M, over 1M", f"+{ten - one:.2f} s CPU", "<= +2 s", ten - one <= 2))
    for source, points in driver.items():
        grew = (points[-1]["anon"] - points[0]["anon"]) / 1e6
        print(_row(f"driver memory, {source}: {driver_rows[0] / 1e6:g}M -> {driver_rows[-1] / 1e6:g}M rows",
                   f"{points[0]['anon'] / 1e6:.0f} -> {points[-1]['anon'] / 1e6:.0f} MB", "+50 MB", grew <= 50))
    print(_row("touched tar: tars listed by the next resume, then the one after", f"{touched[0]}, then {touched[1]}",
               "1, then 0", touched == (1, 0)))
    for source, wall in sampled.items():
        print(_row(f"plan's listing of 100M rows, sampled, {source}", f"{wall:.1f} s wall", "(none)", None))
    print(_row("tar planning, a sample (bulk header reader)", f"{tar_us:.1f} us CPU", "<= 2 us", tar_us <= 2))
    read_us = large["in the page cache, read from the disk"]["pread"][0]
    print(_row("  the same, 60-140 KB images read from the disk", f"{read_us:.1f} us CPU", "<= 2 us", read_us <= 2))
    print(_row("a shard's finish, 4 captures", f"{finish_ms:.1f} ms CPU", "<= 5 ms", finish_ms <= 5))
    print(f"  (resume {fit}; driver memory: the peak of RssAnon over the imported libraries, measured)")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,10", help="millions of rows each source is listed at (--only rows, driver, "
                   "and the driver's part of the whole run)")
    p.add_argument("--sources", default="manifest,folder,tar,parquet", help="the sources the memory fit lists")
    p.add_argument("--resume-rows", default="0.1,0.2,0.5", help="millions of rows of the whole-command resume fit")
    p.add_argument("--driver-one", nargs=2, metavar=("SOURCE", "ROWS"), help=argparse.SUPPRESS)
    p.add_argument("--only", choices=["stats", "tar", "large-tar", "parquet", "rows", "shard", "resume", "row",
                                      "driver", "sample"],
                   help="one of the benches")
    args = p.parse_args()
    sizes = tuple(int(float(m) * 1e6) for m in args.rows.split(","))
    if args.driver_one:
        print(json.dumps(_driver_one(args.driver_one[0], int(args.driver_one[1]))))
    elif args.only:
        WORK.mkdir(exist_ok=True)
        sources = tuple(args.sources.split(","))
        {"stats": stats_bench, "tar": tar_bench, "large-tar": large_tar_bench, "parquet": parquet_bench,
         "rows": lambda: planning_bench(sizes, sources), "shard": shard_bench, "resume": resume_bench,
         "row": row_bench, "driver": lambda: driver_bench(sizes, sources), "sample": sample_bench}[args.only]()
    else:
        main(sizes, tuple(int(float(m) * 1e6) for m in args.resume_rows.split(",")))
