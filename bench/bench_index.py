"""`make bench` (or `python bench/bench.py --index`): the feature index (issue 42) against what it must be as fast as,
both targets printed side by side at the end of one run.

- SAE latents over ViT tokens: ``extractor.index.index`` with a dictionary (read from the store, encode, top-k,
  densities, histograms, quantile samples, written into the store) against the bare computation in torch over the
  same array already in memory (encoder matmul + ReLU + a running top-k of each latent's max over a row's tokens),
  in the same blocks of rows. Target: 1.3x.
- Raw channels of a 1,024-channel map: one index pass against a sequential zarr read of the same array. Target: the
  reader's speed.

Each side is timed by the wall clock and by the CPU seconds of its process (all threads): on a shared machine the
load moves the wall-clock ratio, the CPU ratio much less; both are printed, with the load (``uptime``). Peak memory
of the pass (the map's: numpy's allocations by tracemalloc, in a pass of its own, as it slows every allocation; the
SAE's: its peak RSS, run in a process of its own before the bare loop reads the array into memory) is printed beside
the bound: features x k x positions of top-row values, plus the examples and histograms per feature, plus a block of
activations. ``--rows 0`` or ``--map-rows 0`` leaves that part out. The defaults finish in a few minutes on 2 cores;
the issue's sizes are ``--rows 20000`` (20,000 images of 196 x 768 tokens: 6 GB of float16, ~25 TFLOP per side)
and ``--map-rows 100000`` (the default).

    python bench/bench_index.py [--rows 1000] [--map-rows 100000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import statistics
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WORK = Path(__file__).resolve().parents[1] / ".bench"
TOKENS, WIDTH, LATENTS, K = 196, 768, 4096, 16


def _store(url: Path, rows: int, shape: list[int], dims: list[str], dtype: str, chunk_rows: int) -> None:
    """A store of ``rows`` random rows of one capture ``x`` (made once, kept under .bench)."""
    from extractor.data.rows import Rows
    from extractor.store.layout import OK, StoreArrays
    from extractor.store.synthetic import create_store

    if (url / "zarr.json").exists():
        return
    meta: dict[str, Any] = {"shape": shape, "dtype": dtype, "dims": dims, "layer": "x", "what": "output",
                            "reduce": "none"}
    shard = chunk_rows * 4
    g = create_store(str(url), Rows(ids=[f"img{i}" for i in range(rows)], paths=[""] * rows, labels=[0] * rows),
                     StoreArrays(captures={"x": meta}, extras={}, shard_size=shard, chunk_rows={"x": chunk_rows}),
                     attrs={"n_rows": rows, "n_shards": -(-rows // shard), "captures": {"x": meta},
                            "format_version": 1, "spec": {}, "model": {"prefix_tokens": 0}, "created": "bench"})
    rng = np.random.default_rng(0)
    for a in range(0, rows, chunk_rows):
        n = min(chunk_rows, rows - a)
        g["x"][a : a + n] = rng.standard_normal((n, *shape), dtype=np.float32).astype(dtype)
    g["status"][:] = np.full(rows, OK, np.uint8)
    g.attrs.update({"extractor": {**dict(g.attrs["extractor"]), "status": "complete"}})


def _sae(path: Path) -> np.ndarray:
    """An SAE of LATENTS latents whose biases make about 2% of them fire per token (as trained ones do)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((WIDTH, LATENTS), dtype=np.float32) / np.sqrt(WIDTH)).astype(np.float32)
    b = np.full(LATENTS, -2.0, np.float32)
    np.savez(path, W_enc=w, b_enc=b, b_dec=np.zeros(WIDTH, np.float32))
    return w


def bare_sae(x: np.ndarray, w: np.ndarray, rows_per_block: int) -> tuple[float, float]:
    """The bare computation in torch over ``x`` (rows, tokens, width) in memory: wall and CPU seconds."""
    import torch

    wt, bt = torch.from_numpy(w), torch.full((LATENTS,), -2.0)
    best = torch.full((K, LATENTS), -float("inf"))
    best_rows = torch.zeros((K, LATENTS), dtype=torch.long)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for a in range(0, len(x), rows_per_block):
            xb = torch.from_numpy(np.asarray(x[a : a + rows_per_block], np.float32))
            acts = torch.relu(xb.reshape(-1, WIDTH) @ wt + bt).view(len(xb), TOKENS, LATENTS)
            pooled = acts.amax(dim=1)
            rows = torch.arange(a, a + len(xb))[:, None].expand(-1, LATENTS)
            best, at = torch.topk(torch.cat([best, pooled]), K, dim=0)
            best_rows = torch.gather(torch.cat([best_rows, rows]), 0, at)
    return time.perf_counter() - t0, time.process_time() - c0


@dataclass(frozen=True)
class Timed:
    """One side of a target: wall-clock and CPU seconds (all the process's threads), and the load meanwhile."""

    wall: float
    cpu: float
    load: str


@dataclass(frozen=True)
class Target:
    """A target's two sides, for the summary."""

    name: str
    ours: Timed
    base: Timed
    base_name: str
    goal: float


def _timed_index(url: Path, **kwargs: Any) -> tuple[Timed, Any]:
    """Times and the index of one ``index`` call."""
    from extractor.index import index

    t0, c0 = time.perf_counter(), time.process_time()
    ix = index(str(url), "x", **kwargs)
    return Timed(time.perf_counter() - t0, time.process_time() - c0, _load()), ix


def _traced_index(url: Path, **kwargs: Any) -> int:
    """Peak traced bytes (numpy's allocations included) of one ``index`` call: a pass of its own, as tracemalloc
    slows every allocation (it made the map's pass 1.4x as long)."""
    from extractor.index import index

    tracemalloc.start()
    index(str(url), "x", **kwargs)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def _in_child(url: Path, dictionary: Path) -> tuple[Timed, int, float]:
    """One SAE index pass in a fresh process: times, peak RSS bytes, dead latents."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        wall, cpu, load, rss, dead = pool.apply(_child_pass, (str(url), str(dictionary)))
    return Timed(wall, cpu, load), rss, dead


def _child_pass(url: str, dictionary: str) -> tuple[float, float, str, int, int]:
    timed, ix = _timed_index(Path(url), dictionary=dictionary, k=K)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KB on Linux
    return timed.wall, timed.cpu, timed.load, rss, len(ix.dead)


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def _bound(ix: Any) -> float:
    """The memory the index may hold, in MB: features x (k x positions of float32 + examples and histograms)."""
    from extractor.index.state import IndexState

    state = IndexState(ix.features, int(ix.attrs["positions"]), ix.k)
    return state.nbytes() / 1e6


def _median(runs: list[Timed]) -> Timed:
    return Timed(statistics.median(r.wall for r in runs), statistics.median(r.cpu for r in runs), runs[-1].load)


def sae_bench(rows: int, repeats: int) -> Target:
    import torch

    from extractor._machine import Machine
    from extractor.index.feed import ENCODE_VALUES
    from extractor.index.state import IndexState
    from extractor.read import open_store

    url = WORK / f"index-tokens-{rows}.zarr"
    _store(url, rows, [TOKENS, WIDTH], ["x.token", "x.feature"], "float16", 64)
    w = _sae(WORK / "sae.npz")
    block = max(1, ENCODE_VALUES // (TOKENS * LATENTS))
    runs = [_in_child(url, WORK / "sae.npz") for _ in range(repeats)]  # before the array is read into memory here
    x = open_store(str(url)).numpy("x")  # the bare loop's array, in memory (float16, as stored)
    bare = []
    for _ in range(repeats):
        wall, cpu = bare_sae(x, w, block)
        bare.append(Timed(wall, cpu, _load()))
    base, ours = _median(bare), _median([r[0] for r in runs])
    rss, dead = max(r[1] for r in runs), runs[-1][2]
    state = IndexState(LATENTS, TOKENS, K).nbytes()
    lanes = Machine.here().index_lanes(ENCODE_VALUES * 4)  # as the pass decides (its chunks' read-ahead aside)
    gb = rows * TOKENS * WIDTH * 2 / 1e9
    print(f"\nindex: {LATENTS} SAE latents over {rows} rows x {TOKENS} tokens x {WIDTH} (float16, {gb:.2f} GB), k "
          f"{K}, {torch.get_num_threads()} torch threads, blocks of {block} rows; median of {repeats}")
    print(f"  bare torch (array in memory: matmul + relu + top-k)  {_side(base, rows)}")
    print(f"  extractor index (read + encode + everything)          {_side(ours, rows)}")
    print(f"  the pass: peak RSS {rss / 1e6:.0f} MB (torch and the reader included); bound: the index state "
          f"{state / 1e6:.0f} MB (its slots shared by {lanes} lanes) + {lanes} lanes x a block of "
          f"{ENCODE_VALUES * 4 / 1e6:.0f} MB latents, x a few temporaries; dead latents {dead}")
    del x
    return Target(f"SAE: {LATENTS} latents, {rows} x {TOKENS} tokens", ours, base, "bare torch", 1.3)


def _side(t: Timed, rows: int) -> str:
    return f"{t.wall:7.2f} s wall {t.cpu:7.2f} s CPU  {rows / t.wall:9.1f} rows/s  ({t.load})"


def map_bench(rows: int, repeats: int, channels: int = 1024, side: int = 2) -> Target:
    from extractor.read import open_store

    url = WORK / f"index-map-{rows}.zarr"
    _store(url, rows, [channels, side, side], ["x.channel", "x.y", "x.x"], "float16", 1024)
    arr = open_store(str(url))["x"]

    def plain() -> Timed:
        t0, c0 = time.perf_counter(), time.process_time()
        for a in range(0, rows, 1024):
            np.asarray(arr[a : a + 1024])
        return Timed(time.perf_counter() - t0, time.process_time() - c0, _load())

    read = _median([plain() for _ in range(repeats)])
    runs = [_timed_index(url, k=K) for _ in range(repeats)]
    ours, ix = _median([r[0] for r in runs]), runs[-1][1]
    peak = _traced_index(url, k=K)
    gb = rows * channels * side * side * 2 / 1e9
    print(f"\nindex: raw channels of a {channels}-channel {side}x{side} map over {rows} rows (float16, {gb:.2f} GB); "
          f"median of {repeats}")
    print(f"  sequential zarr read      {_side(read, rows)}")
    print(f"  extractor index           {_side(ours, rows)}")
    print(f"  the pass: peak numpy memory {peak / 1e6:.0f} MB (state bound {_bound(ix):.0f} MB)")
    return Target(f"raw channels: {channels} x {side}x{side} map, {rows} rows", ours, read, "zarr read", 1.0)


def summary(targets: list[Target]) -> None:
    """Both targets side by side: each ratio by the wall clock and by CPU seconds."""
    print(f"\n{'feature index target':44s} {'ours s':>8s} {'base s':>8s} {'wall x':>7s} {'CPU x':>6s} {'goal':>5s}  "
          "against")
    for t in targets:
        print(f"{t.name:44s} {t.ours.wall:8.2f} {t.base.wall:8.2f} {t.ours.wall / t.base.wall:7.2f} "
              f"{t.ours.cpu / t.base.cpu:6.2f} {t.goal:5.1f}  {t.base_name}")


def main(rows: int = 1000, map_rows: int = 100000, repeats: int = 1) -> None:
    WORK.mkdir(exist_ok=True)
    targets = []
    if rows > 0:
        targets.append(sae_bench(rows, repeats))
    if map_rows > 0:
        targets.append(map_bench(map_rows, repeats))
    summary(targets)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1000, help="images of 196 x 768 tokens for the SAE index (the "
                   "issue's: 20000)")
    p.add_argument("--map-rows", type=int, default=100000, help="rows of the 1,024-channel map")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--fresh", action="store_true", help="make the stores again")
    args = p.parse_args()
    if args.fresh:
        for old in WORK.glob("index-*.zarr"):
            shutil.rmtree(old)
    main(args.rows, args.map_rows, args.repeats)
