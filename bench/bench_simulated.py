"""Issue 57: a whole job of N rows simulated without images, through ``run()`` as ``extractor run`` runs it: a
synthetic Parquet listing (files that are not there: the listing patched, as bench_scale's), the store made, then
every shard claimed, its rows read from the store, its per-row arrays written and committed by a worker that reads
no image and computes nothing (a real worker's writes but the values), each shard's statistics merged by the
driver as it is committed; then a resume of the complete store (in this process: the synthetic listing is patched
here) and ``extractor inspect`` (a new interpreter). What grows with the rows and the shards, measured at that size.

    python bench/bench_simulated.py --rows 1            (millions; 100 takes about an hour on this machine)
    python bench/bench_simulated.py --first --real --rows 100   (the time to the first shard alone, from real
                                                                 Parquet files: 1.5 GB written once under .bench)
"""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".bench"


def _folder(n: int) -> Path:
    """A real folder of ``n`` empty files in ImageNet's shape (class folders of 1,300), written once under .bench."""
    root = WORK / f"folder-{n}"
    if not (root / ".made").exists():
        shutil.rmtree(root, ignore_errors=True)
        for c in range(-(-n // 1300)):
            (root / f"n{c:08d}").mkdir(parents=True)
            for i in range(c * 1300, min(n, (c + 1) * 1300)):
                open(root / f"n{c:08d}" / f"n{c:08d}_{i}.JPEG", "wb").close()
        (root / ".made").touch()
    return root


def _spec(n: int, store: Path, shard_size: int, real: bool = False, manifest: bool = False,
          tars: str = "", folder: str = "", stat_ms: float = 0.0) -> Any:
    """The job: resnet18 (random weights; probed, never run on an image), its pooled features stored. ``real``:
    real Parquet files of 10,000 rows (written once, kept under .bench), not the synthetic listing. ``manifest``: a
    CSV manifest of ``n`` paths and no labels (a LAION-like list; written once), its files not there (each stat-ed).
    ``tars``: bench_scale's synthetic tars of 10,000 samples (class indices), ``stats``: each counted by the stats
    file img2dataset writes beside it (a stand-in: its count), so streamed; ``whole``: none, so listed whole.
    ``folder``: a real folder of empty files (:func:`_folder`), ``streamed`` (counted by name, then walked behind
    the first shards) or ``whole`` (listed whole first, as before); ``stat_ms``: each stat waits this long first
    (a network file system's server, simulated)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_scale import _synthetic, real_parquet

    from extractor.spec import DataSpec, parse_spec

    if tars:
        from unittest import mock

        import extractor.data.sources.tar as tar_source

        data, patched = _synthetic("tar", n, WORK)
        patched.enter_context(mock.patch.object(tar_source, "_stats_count", lambda url, storage: (  # noqa: PT008
            10_000 if tars == "stats" else None)))
        source = {"source": "tar", "tars": data.tars}
    elif folder:
        from unittest import mock

        import extractor.data.sources.folder as folder_source

        source, patched = {"source": "folder", "root": str(_folder(n))}, contextlib.ExitStack()
        if stat_ms:  # a network file system, simulated: each stat waits for its server first
            import os

            real_stat = os.stat

            def stat(*args: Any, **kwargs: Any) -> Any:
                time.sleep(stat_ms / 1e3)
                return real_stat(*args, **kwargs)

            patched.enter_context(mock.patch.object(os, "stat", stat))
        if folder == "whole":
            patched.enter_context(mock.patch.object(folder_source.FolderSource, "stream",  # noqa: PT008
                                                    lambda self, data, then: None))
    elif manifest:
        path = WORK / f"manifest-nolabel-{n}.csv"
        if not path.exists():
            with open(path, "w") as f:
                f.write("path\n")
                f.writelines(f"train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG\n" for i in range(n))
        source = {"source": "manifest", "manifest": str(path), "root": "/data/imagenet"}
        patched = contextlib.ExitStack()
    else:
        if real:
            data, patched = DataSpec(source="parquet", parquet=str(real_parquet(n // 10_000) / "*.parquet")), \
                contextlib.ExitStack()
        else:
            data, patched = _synthetic("parquet", n, WORK)
        source = {"source": "parquet", "parquet": data.parquet}
    spec = parse_spec({
        "model": {"name": "resnet18", "weights": None, "device": "cpu"},
        "data": {**source, "resize": 72, "crop": 64, "batch_size": 32, "shard_size": shard_size},
        "capture": [{"layer": "avgpool", "reduce": "flatten", "key": "embedding", "dtype": "float16"}],
        "output": {"store": str(store), "if_exists": "overwrite"}, "cluster": {"backend": "local"}})
    return spec, patched


def _backend(spec: Any, on_first: Any, worker_cpu: list[float]) -> Any:
    """A LocalBackend whose worker writes each shard as a worker does, but no values: every row ok."""
    from extractor.compute import ShardSummary
    from extractor.driver.runner import LocalBackend
    from extractor.store.stats import ShardStats, dumps
    from extractor.store.writer import ShardWriter

    one = ShardStats(["embedding.feature"], [512])  # a shard's statistics record, as the worker makes it
    one.update(np.zeros((spec.data.shard_size, 512), np.float32), np.arange(spec.data.shard_size))
    stats = dumps({"embedding": one})

    class Simulated(LocalBackend):
        def run(self, todo: Any, url: str, on_progress: Any, on_event: Any, ticket: Any = None,
                ready: Any = None) -> list:
            out, done = [], [0]
            for shard in todo:
                if ready is not None:  # a new store's rows written meanwhile
                    ready.wait(shard.index)
                if not out:
                    on_first()
                on_event("shard_started", {"shard": shard.index, "worker": 0, "pid": 0})
                n = shard.stop - shard.start
                c = _cpu()
                writer = ShardWriter(url, shard.start, shard.stop, shard.index, None, ticket)
                writer.opening()
                writer.finish(np.ones(n, np.uint8), [""] * n, None, stats, np.arange(1, n + 1, dtype=np.uint64))
                summary = ShardSummary(shard=shard.index, rows=n, ok=n, failed=0, seconds=0.0, bytes=0, pid=0,
                                       stats=stats, attempt=writer.attempt)
                worker_cpu[0] += _cpu() - c
                on_event("shard_done", {"shard": shard.index, "worker": 0, "summary": summary})
                out.append(summary.kept())  # as LocalBackend keeps it
                done[0] += n
                on_progress(done[0])
            return out

    return Simulated(spec)


def _anon() -> int:
    """The process's anonymous memory now (RssAnon), bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def simulated(n: int, shard_size: int = 1024, keep: bool = False) -> dict[str, float]:
    """The job of ``n`` rows run whole, resumed, inspected; seconds (wall and CPU) of each step."""
    from extractor.driver.runner import run

    store = WORK / f"simulated-{n}.zarr"
    shutil.rmtree(store, ignore_errors=True)
    spec, patched = _spec(n, store, shard_size)
    first: dict[str, float] = {}
    worker_cpu = [0.0]
    with patched:
        t0, c0 = time.perf_counter(), _cpu()

        def on_first() -> None:
            first.update(wall=time.perf_counter() - t0, cpu=_cpu() - c0, anon=_anon())

        summary = run(spec, backend=_backend(spec, on_first, worker_cpu))
        wall, cpu, grew = time.perf_counter() - t0, _cpu() - c0, _anon() - first["anon"]
        assert summary.ok == n and summary.shards_run == summary.shards, summary
        resumed = spec.model_copy(update={"output": spec.output.model_copy(update={"if_exists": "resume"})})
        t1, c1 = time.perf_counter(), _cpu()
        again = run(resumed, backend=_backend(resumed, lambda: None, [0.0]))
        resume_wall, resume_cpu = time.perf_counter() - t1, _cpu() - c1
        assert again.shards_run == 0 and again.ok == n, again
    c2, t2 = _children_cpu(), time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "extractor.cli", "inspect", str(store)], capture_output=True,
                         text=True, cwd=REPO, check=True)
    inspect_cpu, inspect_wall = _children_cpu() - c2, time.perf_counter() - t2
    assert f"{n:,}" in out.stdout or str(n) in out.stdout, out.stdout[-2000:]
    c3 = _children_cpu()
    subprocess.run([sys.executable, "-c", "import extractor.cli"], check=True, cwd=REPO)
    bare = _children_cpu() - c3
    if not keep:
        shutil.rmtree(store, ignore_errors=True)
    shards = summary.shards
    got = {"rows": n, "shards": shards, "first_wall": first["wall"], "first_cpu": first["cpu"], "wall": wall,
           "cpu": cpu, "per_shard_ms": (cpu - first["cpu"]) / shards * 1e3,
           "per_shard_wall_ms": (wall - first["wall"]) / shards * 1e3,
           "worker_ms": worker_cpu[0] / shards * 1e3, "grew": grew, "resume_cpu": resume_cpu,
           "resume_wall": resume_wall, "inspect_cpu": inspect_cpu, "inspect_wall": inspect_wall,
           "import_cpu": bare}
    driver_ms = got["per_shard_ms"] - got["worker_ms"]
    print(f"  {n:>12,} rows, {shards:,} shards of {shard_size:,}: first shard after {first['wall']:.1f} s "
          f"({first['cpu']:.1f} s CPU: listing, probe, store); then {got['per_shard_ms']:.1f} ms CPU a shard "
          f"({got['per_shard_wall_ms']:.1f} ms wall), the worker's {got['worker_ms']:.1f} ms (claim, its rows read, "
          f"its arrays written, commit) and the driver's {driver_ms:.1f} ms; its memory {grew / 1e6:+.0f} MB from the "
          f"first shard to the last; {wall:.0f} s in all; resume "
          f"{resume_cpu:.1f} s CPU ({resume_wall:.1f} s wall); inspect {inspect_cpu:.1f} s CPU (a new interpreter; "
          f"importing the CLI alone {bare:.1f} s)", flush=True)
    return got


def first_shard(n: int, shard_size: int = 1024, real: bool = False, manifest: bool = False,
                tars: str = "", folder: str = "", stat_ms: float = 0.0) -> dict[str, float]:
    """The job of ``n`` rows until its first shard begins (the job stopped there, as by Ctrl-C): seconds of wall
    time and CPU from ``run()``'s call (listing, probe, the store made; a listing streamed goes on meanwhile).
    ``real``: from real Parquet files; ``manifest``: from a CSV manifest without labels; ``tars``: from tars;
    ``folder``: from a real folder (:func:`_spec`)."""
    from extractor.driver.runner import run

    store = WORK / f"first-{n}.zarr"
    shutil.rmtree(store, ignore_errors=True)
    spec, patched = _spec(n, store, shard_size, real, manifest, tars, folder, stat_ms)
    first: dict[str, float] = {}
    with patched:
        t0, c0 = time.perf_counter(), _cpu()

        def on_first() -> None:
            first.update(wall=time.perf_counter() - t0, cpu=_cpu() - c0)
            raise KeyboardInterrupt

        with contextlib.suppress(KeyboardInterrupt):  # (stopped at the first shard)
            run(spec, backend=_backend(spec, on_first, [0.0]))
    shutil.rmtree(store, ignore_errors=True)
    kind = " (real files)" if real else " (a manifest)" if manifest else f" (tars, {tars})" if tars else \
        f" (a folder, {folder}{f', {stat_ms} ms a stat' if stat_ms else ''})" if folder else ""
    print(f"  {n:>12,} rows{kind}: first shard after {first['wall']:.1f} s "
          f"({first['cpu']:.1f} s CPU)", flush=True)
    return {"rows": n, "first_wall": first["wall"], "first_cpu": first["cpu"]}


def main(sizes: tuple[int, ...], shard_size: int = 1024) -> list[dict[str, float]]:
    print("\na whole job simulated (no images; synthetic Parquet listing), in this process: "
          f"{', '.join(f'{n:,}' for n in sizes)} rows")
    return [simulated(n, shard_size) for n in sizes]


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="0.1,1", help="millions of rows, each a job")
    p.add_argument("--shard-size", type=int, default=1024)
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--first", action="store_true", help="only the time to the first shard (the job stopped there)")
    p.add_argument("--real", action="store_true", help="--first from real Parquet files of 10,000 rows")
    p.add_argument("--manifest", action="store_true", help="--first from a CSV manifest of paths, no labels")
    p.add_argument("--tars", choices=["stats", "whole"], help="--first from synthetic tars, counted by img2dataset's "
                   "stats files (streamed) or not (listed whole)")
    p.add_argument("--folder", choices=["streamed", "whole"], help="--first from a real folder of empty files "
                   "(written once under .bench), streamed or listed whole")
    p.add_argument("--stat-ms", type=float, default=0.0, help="--folder: each stat waits this long first (a network "
                   "file system, simulated)")
    args = p.parse_args()
    WORK.mkdir(exist_ok=True)
    sizes = tuple(int(float(m) * 1e6) for m in args.rows.split(","))
    figures = [first_shard(n, args.shard_size, args.real, args.manifest, args.tars or "", args.folder or "",
                           args.stat_ms) for n in sizes] \
        if args.first else main(sizes, args.shard_size)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
