"""`make bench BENCH_ARGS=--join`: what it costs processes that never talk to each other to share one store's shards:
the CPU of the claims and commits (the ledger's swaps, a claimant's record) per shard, for 1, 4 and 16 processes.

Each process is a claimant of one store's generation, with a near-free "model": it claims the next shard it may take
(``Ledger.claim``: where another has it, the other shards of its block that the same read found taken are
skipped too, as a joined job's workers skip them), writes nothing, and commits it (``ledger.commit``), until every
shard is committed. What each process spends is its own CPU (``time.process_time``) over the shards it committed;
the figure is the mean over the processes, per shard, with the ledger's reads and the swaps refused (another
process changed the block first) per shard.

    python bench/bench_join.py [--shards 4096] [--writers 1,4,16]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _make(url: str, shards: int) -> str:
    """A store of ``shards`` shards of one row each, every shard pending; its generation's name."""
    sys.path.insert(0, str(REPO))
    from extractor.data import Rows
    from extractor.store.layout import StoreArrays
    from extractor.store.synthetic import create_store, ticket

    create_store(url, Rows(ids=[f"i{i}" for i in range(shards)], paths=[""] * shards, labels=[0] * shards),
                 StoreArrays(captures={}, extras={}, shard_size=1, chunk_rows={}), attrs={}, pending=True)
    return ticket(url).generation


def _writer(url: str, generation: str, start: int, out: mp.Queue) -> None:
    """One process: claims, then commits, shard after shard, from ``start`` on, until none is left to take."""
    from extractor.store import Objects
    from extractor.store.claimants import Claimant
    from extractor.store.generation import Generation
    from extractor.store.ledger import Verdict, commit, new_id

    gen = Generation(Objects.at(url), generation)
    ledger = gen.ledger()
    me = Claimant(gen.objects, gen.claimants_prefix, 60.0, {"pid": os.getpid(), "host": "bench"})
    me.start()
    refused, reads = [0], [0]
    real_swap, real_read = gen.objects.swap, gen.objects.read

    def swap(key: str, version: object, data: bytes) -> bool:
        landed = real_swap(key, version, data)  # type: ignore[arg-type]
        refused[0] += not landed
        return landed

    def read(key: str) -> object:
        reads[0] += 1
        return real_read(key)

    gen.objects.swap, gen.objects.read = swap, read  # type: ignore[method-assign,assignment]
    dead = gen.roster.dead
    n, cpu0 = 0, time.process_time()
    order = list(range(ledger.n_shards))
    order = order[start:] + order[:start]
    while True:
        took, skip = 0, set()
        for s in order:  # as a joined job's worker does: a shard found another's drops the others its read found so
            if s in skip:
                continue
            attempt = new_id()
            verdict, _, others = ledger.claim(s, me.id, attempt, dead)
            if verdict is not Verdict.OK:
                skip.update(others)
                continue
            if ledger.step(s, lambda e, a=attempt: commit(e, me.id, a, 1, 0, 0)) is Verdict.OK:
                n, took = n + 1, took + 1
                me.committed()
        if not took:
            break
        order = [int(s) for s in (~ledger.read().done).nonzero()[0]]
        if not order:
            break
    cpu = time.process_time() - cpu0
    me.end("complete")
    out.put({"shards": n, "cpu_s": cpu, "refused": refused[0], "reads": reads[0]})


def run(shards: int, writers: int) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp(prefix="bench-join"))
    url = str(folder / "s.zarr")
    try:
        generation = _make(url, shards)
        ctx = mp.get_context("spawn")
        out: mp.Queue = ctx.Queue()
        procs = [ctx.Process(target=_writer, args=(url, generation, i * shards // writers, out))
                 for i in range(writers)]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        wall = time.perf_counter() - t0
        done = sum(r["shards"] for r in results)
        assert done == shards, f"{done} shards committed of {shards}"
        return {"writers": writers, "shards": shards, "wall_s": wall,
                "cpu_ms_per_shard": 1000 * sum(r["cpu_s"] for r in results) / done,
                "refused_per_shard": sum(r["refused"] for r in results) / done,
                "reads_per_shard": sum(r["reads"] for r in results) / done}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=4096)
    p.add_argument("--writers", default="1,4,16")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = [run(args.shards, int(w)) for w in args.writers.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"claims and commits of {args.shards} shards, a near-free model, on this machine's local disk "
          f"({os.cpu_count()} cores):")
    print(f"{'writers':>8} {'CPU ms/shard':>13} {'reads/shard':>12} {'swaps refused/shard':>20} {'wall s':>8}")
    for r in rows:
        print(f"{r['writers']:>8} {r['cpu_ms_per_shard']:>13.2f} {r['reads_per_shard']:>12.2f} "
              f"{r['refused_per_shard']:>20.2f} {r['wall_s']:>8.1f}")


if __name__ == "__main__":
    main()
