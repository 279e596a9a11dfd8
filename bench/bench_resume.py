"""A resume of a complete store, the whole command (issue 39): ``python -m extractor.cli run JOB --resume -q`` in a
fresh interpreter on a store whose every shard is done, per source (a folder, a CSV manifest of the same files,
WebDataset tars, Parquet files), CPU seconds of the command (``RUSAGE_CHILDREN``, user + sys), fitted along the
sizes (least squares) to 1M and 10M rows.

The stores are made without computing: the job's real listing, probe and store creation, then each shard finished
as a worker finishes it (status, digests, done marker) with no capture values written (a resume reads none).

    python bench/bench_resume.py [--rows 0.1,0.2,0.5] [--sources folder,manifest,tar,parquet] [--profile SOURCE]
"""

from __future__ import annotations

import io
import json
import os
import resource
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".bench" / "resume"
PER_PART = 10_000  # rows per tar or Parquet file, files per class folder: 1,300 (ImageNet's)
SOURCES = ("folder", "manifest", "tar", "parquet", "folder:listing", "manifest:listing")  # SOURCE:VERIFY:
# a resume with data.verify: VERIFY (default: files; a folder's or manifest's files stat-ed, those of the rows read)


def _files(n: int) -> Path:
    """``n`` empty .JPEG files in class folders of 1,300 (ImageNet's layout)."""
    root = WORK / f"files-{n}"
    done = root / ".complete"
    if not done.exists():
        for c in range(-(-n // 1300)):
            folder = root / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(c * 1300, min(n, c * 1300 + 1300)):
                open(folder / f"n{c:08d}_{i}.JPEG", "wb").close()
        done.touch()
        hour_ago = time.time_ns() - 3600 * 10**9  # settled: a folder modified as it is listed is listed again
        for folder in (root, *root.iterdir()):
            os.utime(folder, ns=(hour_ago, hour_ago))
    return root


def _tars(n: int) -> str:
    """Tars of 10,000 samples (a .jpg of 8 bytes and a .cls each); the pattern of their names."""
    root = WORK / f"tars-{n}"
    parts = -(-n // PER_PART)
    done = root / ".complete"
    if not done.exists():
        root.mkdir(parents=True, exist_ok=True)
        for t in range(parts):
            with tarfile.open(root / f"{t:06d}.tar", "w") as tar:
                for i in range(t * PER_PART, min(n, t * PER_PART + PER_PART)):
                    for ext, data in ((".jpg", b"\xff\xd8" + bytes(6)), (".cls", str(i % 1000).encode())):
                        info = tarfile.TarInfo(f"s{i:09d}{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        done.touch()
    return str(root / f"{{000000..{parts - 1:06d}}}.tar")


def _parquet(n: int) -> str:
    """Parquet files of 10,000 rows in the Hub's layout (images of a few bytes, ClassLabel names); their glob."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = WORK / f"parquet-{n}"
    parts = -(-n // PER_PART)
    done = root / ".complete"
    if not done.exists():
        root.mkdir(parents=True, exist_ok=True)
        meta = json.dumps({"info": {"features": {"image": {"_type": "Image"}, "label": {
            "names": [f"c{i}" for i in range(1000)], "_type": "ClassLabel"}}}})
        for f in range(parts):
            rows = range(f * PER_PART, min(n, f * PER_PART + PER_PART))
            images = [{"bytes": b"\xff\xd8" + bytes([i % 256]) * 6, "path": f"{i}.jpg"} for i in rows]
            table = pa.table({"image": images, "label": [i % 1000 for i in rows]})
            pq.write_table(table.replace_schema_metadata({"huggingface": meta}), root / f"train-{f:05d}.parquet",
                           row_group_size=1000)
        done.touch()
    return str(root / "train-*.parquet")


def _data(source: str, n: int) -> dict[str, Any]:
    if source == "folder":
        return {"source": "folder", "root": str(_files(n))}
    if source == "manifest":
        path = WORK / f"manifest-{n}.csv"
        if not path.exists():
            _files(n)
            with open(path.with_suffix(".tmp"), "w") as f:
                f.write("path,label\n")
                f.writelines(f"n{i // 1300:08d}/n{i // 1300:08d}_{i}.JPEG,{i // 1300}\n" for i in range(n))
            path.with_suffix(".tmp").rename(path)
        return {"source": "manifest", "manifest": str(path), "root": str(_files(n))}
    if source == "tar":
        return {"source": "tar", "tars": _tars(n)}
    return {"source": "parquet", "parquet": _parquet(n)}


def job(source: str, n: int, digests: bool = False) -> Path:
    """A job spec (resnet18, random weights: the demo's model; shards of 1,024 rows) whose store is complete;
    ``digests``: the rows' content digests those of their images (a resume that finds a source touched compares
    them), else placeholders."""
    import yaml

    name = f"{source}-{n}{'-digests' if digests else ''}"
    path, store = WORK / f"{name}.yaml", WORK / f"{name}.zarr"
    spec = {"model": {"name": "resnet18", "weights": None, "device": "cpu"},
            "data": {**_data(source, n), "resize": 72, "crop": 64, "batch_size": 32, "decode_workers": 2},
            "capture": [{"layer": "avgpool", "reduce": "flatten", "key": "embedding"}],
            "output": {"store": str(store), "chunk_rows": 256}, "cluster": {"backend": "local"}}
    path.write_text(yaml.safe_dump(spec))
    marker = WORK / f"{name}.complete"  # (beside the store: zarr warns of a file in it it does not know)
    if not (marker.exists() or (store / ".complete").exists()):
        _complete(path, digests)
        marker.touch()
    return path


def _complete(path: Path, digests: bool) -> None:
    """The job's store, complete: listed, probed and created as a run does, each shard finished as a worker
    finishes it (every row ok), no values computed."""
    from extractor.data import content_digest, local_fingerprint, read_bytes
    from extractor.driver.runner import LocalBackend, run
    from extractor.spec import load_spec
    from extractor.store.writer import ShardWriter

    class Finished(LocalBackend):
        def run(self, todo: Any, url: str, on_progress: Any, on_event: Any, ticket: Any = None,
                ready: Any = None) -> list:
            for shard in todo:
                if ready is not None:  # a new store's rows written meanwhile
                    ready.wait(shard.index)
                n = shard.stop - shard.start
                writer = ShardWriter(url, shard.start, shard.stop, shard.index, None, ticket)
                items = writer.opening()[0]
                found = np.asarray([content_digest(read_bytes(item)) for item in items], np.uint64) \
                    if digests else np.arange(1, n + 1, dtype=np.uint64)
                # each local file's fingerprint, as a worker takes it from the file it opens
                prints = np.asarray([local_fingerprint(i) if isinstance(i, str) else 0 for i in items], np.uint64)
                writer.finish(np.ones(n, np.uint8), [""] * n, None, "", found, prints=prints)
            return []

    spec = load_spec(str(path), ["output.if_exists=overwrite"])
    run(spec, backend=Finished(spec))


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def resume_cpu(path: Path, profile: str | None = None, verify: str | None = None) -> tuple[float, float, float]:
    """CPU and wall seconds of ``extractor run JOB --resume -q`` in a new interpreter, and the peak of its anonymous
    memory in MB (RssAnon, read every 10 ms: what the driver holds, file pages mapped from the disk left out)
    (``profile``: a cProfile output file of it; ``verify``: its ``data.verify``, where not the job's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    cmd = [sys.executable, *prof, "-m", "extractor.cli", "run", str(path), "--resume", "-q",
           *(["--set", f"data.verify={verify}"] if verify else [])]
    c0, t0 = _children_cpu(), time.perf_counter()
    with open(WORK / "resume.out", "w+") as out, open(WORK / "resume.err", "w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=REPO)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _anon_kb(proc.pid))
            time.sleep(0.01)
        used, wall = _children_cpu() - c0, time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        said, errors = out.read(), err.read()
    if proc.returncode != 0 or "0 shards run" not in said:
        sys.exit(f"the resume of {path} did not find a complete store:\n{said[-2000:]}\n{errors[-3000:]}")
    return used, wall, peak / 1024


def _anon_kb(pid: int) -> int:
    """A process's anonymous resident memory (KB; 0: gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("RssAnon:")), 0)
    except OSError:
        return 0


def bare_cpu() -> float:
    """CPU seconds of a new interpreter that imports nothing (the floor under every command)."""
    c0 = _children_cpu()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return _children_cpu() - c0


def resume_bench(sizes: tuple[int, ...] = (100_000, 200_000, 500_000), sources: tuple[str, ...] = SOURCES,
                 repeats: int = 2) -> dict[str, tuple[float, float]]:
    """The whole resume command per source at ``sizes`` (the best of ``repeats``), fitted to 1M and 10M rows;
    returns each source's (1M, 10M) seconds."""
    WORK.mkdir(parents=True, exist_ok=True)
    for source in sources:  # made first: their making loads the machine
        for n in sizes:
            job(source.partition(":")[0], n)
    print(f"\nresume of a complete store, the whole command (python -m extractor.cli run JOB --resume, a new "
          f"interpreter; resnet18, shards of 1,024), CPU user+sys, best of {repeats}; load "
          f"{os.getloadavg()[0]:.1f}; a bare interpreter: {bare_cpu():.2f} s")
    fitted = {}
    for source in sources:
        name, _, verify = source.partition(":")
        runs = [(n, [resume_cpu(job(name, n), verify=verify or None) for _ in range(repeats)]) for n in sizes]
        points = [(n, min(r[0] for r in rs)) for n, rs in runs]
        a, b = np.polyfit([p[0] for p in points], [p[1] for p in points], 1) if len(points) > 1 else \
            (0.0, points[0][1])
        one, ten = a * 1e6 + b, a * 1e7 + b
        fitted[source] = (one, ten)
        measured = ", ".join(f"{n / 1e6:g}M {s:.2f} s" for n, s in points)
        peaks = ", ".join(f"{max(r[2] for r in rs):.0f}" for _n, rs in runs)
        print(f"  {source:16s} {measured}; fitted: 1M {one:5.2f} s (target 5 s), 10M {ten:5.2f} s "
              f"(+{ten - one:.2f} s; target +2 s); peak anonymous memory {peaks} MB")
    return fitted


def touched_tar_bench(n: int = 30_000) -> tuple[int, int]:
    """A complete store of ``n`` samples in tars of 10,000, one tar touched (the same bytes, a later mtime), then
    resumed twice in this process: how many tars each resume lists (the touched one, then none: issue 39)."""
    from unittest import mock

    import extractor.data.sources.tar as tars
    from extractor.driver.runner import run
    from extractor.spec import load_spec

    path = job("tar", n, digests=True)
    spec = load_spec(str(path), ["output.if_exists=resume"])
    touched = WORK / f"tars-{n}" / "000001.tar"
    later = os.stat(touched).st_mtime_ns + 10**9
    os.utime(touched, ns=(later, later))
    scanned: list[str] = []
    real = tars.scan_tar
    counts = []
    with mock.patch.object(tars, "scan_tar", lambda *a: scanned.append(a[0]) or real(*a)):
        for _ in range(2):
            scanned.clear()
            assert run(spec).shards_run == 0
            counts.append(len(scanned))
    print(f"\na touched tar ({n // PER_PART} tars of {PER_PART:,} samples, one touched): the next resume lists "
          f"{counts[0]} tar(s), the one after {counts[1]} (target: 1, then 0)")
    return counts[0], counts[1]


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="0.1,0.2,0.5", help="millions of rows of each source")
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", metavar="SOURCE", help="a cProfile of one resume of SOURCE at the first size instead")
    args = p.parse_args()
    sizes = tuple(int(float(m) * 1e6) for m in args.rows.split(","))
    if args.profile:
        out = WORK / f"{args.profile}-{sizes[0]}.prof"
        print(resume_cpu(job(args.profile, sizes[0]), str(out)), out)
    else:
        resume_bench(sizes, tuple(args.sources.split(",")), args.repeats)
