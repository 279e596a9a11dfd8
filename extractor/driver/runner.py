"""Planning and running a job: list rows, plan shards, create or resume the store, run shards.

``run(spec)`` is the whole job on one machine (the ``local`` backend: the worker runs in this
process). The driver only ever holds shard descriptors and done flags, never activations.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import __version__
from .._text import count, table
from ..compute import ShardSummary, Worker
from ..data import Rows, Shard, absolute, list_rows, of_store, plan
from ..errors import DataError, FencedError, StoreError
from ..spec import JobSpec, auto_chunk_rows, content_of, parse_spec, redact_argv, spec_digest
from ..store import (
    FAILED,
    FORMAT_VERSION,
    PENDING,
    CaptureRecord,
    Layout,
    Lease,
    check_sources,
    consolidate,
    create_store,
    done_shards,
    get_array,
    half_created,
    now,
    open_group,
    read_attrs,
    reset_shards,
    source_digests,
    update_attrs,
)
from ..store import merge as merge_stats

__all__ = ["run", "RunSummary"]

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
Event = Callable[[str, dict[str, Any]], None]


@dataclass
class RunSummary:
    """What a run did; ``failures`` lists up to 20 failed rows as (row, id, error)."""

    store: str
    rows: int
    ok: int
    failed: int
    pending: int
    shards: int
    shards_skipped: int
    shards_run: int
    seconds: float  # the whole run: listing, model, store, shards, final attributes
    images_per_s: float  # rows processed over ``seconds``: the job's rate, end to end
    compute_images_per_s: float = 0.0  # rows processed over the time the shards ran
    bytes_per_row: dict[str, int] = field(default_factory=dict)
    failures: list[tuple[int, str, str]] = field(default_factory=list)
    per_shard: list[ShardSummary] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    nonfinite: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # key -> (rows, first rows)
    float16: list[str] = field(default_factory=list)  # captures stored as float16 (their Inf may be an overflow)
    reused: int = 0  # rows copied from other stores (output.reuse), not computed

    @property
    def all_failed(self) -> bool:
        """Every row failed: nothing usable was stored (a script must not go on)."""
        return bool(self.rows) and not self.ok and not self.pending

    def report(self) -> str:
        """What ``extractor run`` prints when a run ends: rows, shards, time, the worker table,
        NaN/Inf and failed rows."""
        lines = [
            f"{self.store}: {self.ok} ok, {self.failed} failed, {self.pending} pending rows; "
            f"{count(self.shards_run, 'shard')} run, {self.shards_skipped} already done; {self.seconds:.1f} s"
            + (f", {self.images_per_s:.1f} images/s end to end ({self.compute_images_per_s:.1f} while the shards "
               "ran)" if self.shards_run else "")
            + (f"; {count(self.reused, 'row')} taken from other stores (output.reuse)" if self.reused else "")
        ]
        if self.workers and self.shards_run:
            rows = [[str(w["worker"]), ",".join(w["nodes"]) or "-", ",".join(map(str, w["pids"])), str(w["shards"]),
                     str(w["images"]), f"{w['images_per_s']:.1f}", str(w["restarts"]), str(w["retries"])]
                    for w in self.workers]
            lines.append(table(rows, ["worker", "node", "pids", "shards", "images", "compute img/s", "restarts",
                                      "retries"]))
            lines.append("(compute img/s: a worker's images over the seconds its shards took, start to done marker)")
        for key, (rows_, first) in self.nonfinite.items():
            if key in self.float16:
                lines.append(f"warning: {count(rows_, 'row')} of {key} hold NaN or Inf; {key} is stored as float16, "
                             f"where finite values beyond +-65,504 become Inf (an overflow, unless the model gives Inf "
                             f"itself): set its capture's dtype: float32. First rows: {first[:10]}")
            else:
                lines.append(f"warning: {count(rows_, 'row')} of {key} hold NaN or Inf (stored as computed); first "
                             f"rows: {first[:10]}")
        if self.failures:
            lines.append(f"failed rows ({self.failed}):")
            lines += [f"  row {row} {id_}: {err}" for row, id_, err in self.failures]
            if self.failed > len(self.failures):
                lines.append(f"  ... and {self.failed - len(self.failures)} more (see the store's errors array)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["per_shard"] = [s.to_dict() for s in self.per_shard]
        return d


def _versions() -> dict[str, str]:
    import torch
    import torchvision
    import zarr

    return {
        "extractor": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "zarr": zarr.__version__,
        "numpy": np.__version__,
    }


def _owner() -> dict[str, Any]:
    import getpass
    import socket
    import sys

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        user = "?"
    return {"host": socket.gethostname(), "pid": os.getpid(), "user": user, "started": now(),
            "command": " ".join(redact_argv(sys.argv))[:500]}


def _digest(names: list[str]) -> str:
    """A short hash of a list of ids or paths, in order."""
    h = hashlib.sha256()
    for i in names:
        h.update(i.encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()[:16]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and (d or not prefix):  # an empty mapping is a value: {} -> {depth: 3} shows
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        out = {}
        for i, v in enumerate(d):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: d}


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per changed setting; an entry (``capture[1]``) on one side only is one line."""
    a, b = _flatten(old), _flatten(new)
    diffs: list[str] = []
    for k in sorted(set(a) | set(b)):
        if k in a and k in b:
            if a[k] != b[k]:
                diffs.append(f"{k}: {json.dumps(a[k])} in the store, {json.dumps(b[k])} now")
            continue
        lacking = b if k in a else a
        # the outermost entry holding k that the other side lacks entirely
        top = next((p for p in [k[:m.start()] for m in re.finditer(r"[.\[]", k)] + [k]
                    if p and not any(x == p or x.startswith((p + ".", p + "[")) for x in lacking)), k)
        line = (f"{top}: in the store, not in the spec now" if k in a else f"{top}: in the spec now, not in the store")
        if top == k:
            line = f"{k}: {json.dumps(a.get(k, '(unset)'))} in the store, {json.dumps(b.get(k, '(unset)'))} now"
        if line not in diffs:
            diffs.append(line)
    return diffs


def _current_form(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored (public) spec as this version writes it: settings it lacks get their defaults."""
    model = stored.get("model")
    if isinstance(model, dict) and model.get("factory") and model.get("name") == "resnet18":
        stored = {**stored, "model": {k: v for k, v in model.items() if k != "name"}}  # the old default, unused
    try:
        return parse_spec(stored).public_dict()
    except Exception:  # noqa: BLE001 - a spec this version refuses: compared as stored
        return stored


_LOCATIONS = ("root", "manifest", "tars")  # data settings compared by the paths they list, not their spelling


def _moved(group: Any, paths: list[str]) -> str | None:
    """The first row whose image the store read from another path than ``paths`` (a relative
    ``data.root`` resolved in another folder, moved data), as 'STORED in the store, NOW now'."""
    stored = group["paths"][:]
    for i, (was, now_) in enumerate(zip(stored, paths, strict=False)):
        if str(was) != now_:
            return f"row {i}'s image: {str(was)!r} in the store, {now_!r} now"
    return None


def _check_resumable(url: str, old: dict[str, Any], new: dict[str, Any], group: Any, paths: list[str]) -> None:
    """Refuse to resume a store made by another format, spec, model or data listing, or whose
    images the job would read from another place (``paths``: this run's, resolved)."""
    problems: list[str] = []
    if old.get("format_version") != FORMAT_VERSION:
        problems.append(f"format version {old.get('format_version')} in the store, {FORMAT_VERSION} now")
    else:
        moved = _moved(group, paths) if old.get("paths_digest") != new["paths_digest"] else None
        if old.get("spec_digest") != new["spec_digest"]:
            # the stored spec with the settings added since as their defaults: it differs in content, or
            # only in what an older version of extractor did not write down
            old_spec = content_of(_current_form(old.get("spec", {})))
            new_spec = content_of(new["spec"])
            if moved is None:  # the same images from the same places: data.root spelt otherwise is the same
                for d in (old_spec, new_spec):
                    for key in _LOCATIONS:
                        d.get("data", {}).pop(key, None)
            problems += _differences(old_spec, new_spec)
        was, now_ = of_store(old).to_dict(), new["preprocess"]
        for k in ("resize", "crop", "interpolation", "mean", "std", "crop_offset"):
            if was[k] != now_[k]:
                problems.append(f"preprocess {k}: {json.dumps(was[k])} in the store, {json.dumps(now_[k])} now")
        if old.get("model", {}).get("state_dict_sha256") != new["model"]["state_dict_sha256"]:
            problems.append("the model's weights differ (state-dict hash)")
        if old.get("captures") != new["captures"]:
            problems += ["capture " + d for d in _differences(old.get("captures", {}), new["captures"])]
        if old.get("ids_digest") != new["ids_digest"]:
            problems.append(f"the image list differs ({old.get('n_rows')} rows in the store, {new['n_rows']} now)")
        elif moved is not None:
            problems.append(
                f"the images would be read from another place: {moved}; a relative data.root, data.manifest or "
                "data.tars means a place under the folder the job runs from: run it from the folder of its first "
                "run, or give that path absolute"
            )
    if problems:
        listed = "\n  ".join(problems[:10])
        raise StoreError(
            f"cannot resume {url}: it was made by a different job:\n  {listed}\n"
            "Use --overwrite to replace it, or set output.store to write a new store."
        )


@dataclass(frozen=True)
class _Plan:
    """What a job will do to its store, decided from a read of it before anything is written."""

    create: bool  # create the store (replacing what is there when ``old`` is not None), or resume it
    old: dict[str, Any] | None  # its attributes as read (None: nothing there)
    todo: list[Shard]  # the shards to compute
    redo: list[Shard] = field(default_factory=list)  # done shards whose images changed: computed again
    fingerprints: np.ndarray | None = None  # the source's, to record on resume where they changed
    places: tuple[np.ndarray, np.ndarray] | None = None  # tar members' offsets and sizes now, where they moved

    @property
    def nothing_to_do(self) -> bool:
        """A resume of a complete store: nothing is computed, and nothing written."""
        return not self.create and not self.todo and (self.old or {}).get("status") == "complete"


def _decide(spec: JobSpec, rows: Rows, shards: list[Shard], attrs: dict[str, Any], old: dict[str, Any] | None) -> _Plan:
    """Whether the job may create, replace or resume the store, and what it would compute; refuses
    (another job's live lease, an existing store without --resume or --overwrite, a store made by
    another job) without writing anything."""
    url, so = spec.output.store, spec.output.storage_options
    if old is None:
        return _Plan(True, None, shards)
    Lease.check(url, so, spec.output.lease_timeout_s)  # another job running on it: refuse, whatever the mode
    mode = spec.output.if_exists
    if old.get("status") == "creating":  # holds no data (its job is gone): --resume starts it again
        if mode == "error":
            raise StoreError(half_created(url))
        return _Plan(True, old, shards)
    group = open_group(url, "r", so)
    if mode == "error":
        n_done = int(done_shards(group).sum())
        raise StoreError(
            f"store {url} already exists ({n_done} of {old.get('n_shards', '?')} shards done, status "
            f"{old.get('status', '?')}); pass --resume to finish it or --overwrite to replace it"
        )
    if mode == "overwrite":
        return _Plan(True, old, shards)
    _check_resumable(url, old, json.loads(json.dumps(attrs)), group, rows.paths)
    done = done_shards(group)
    changed, prints = _changed_rows(spec, group, rows)
    hit = {r // spec.data.shard_size for r in changed}  # shards are contiguous runs of shard_size rows
    redo = [s for s in shards if done[s.index] and s.index in hit]
    if changed and spec.output.on_change != "redo":
        named = ", ".join(f"{rows.ids[r]!r}" for r in changed[:10])
        raise StoreError(
            f"cannot resume {url}: the images of {count(len(changed), 'row')} computed before have changed since "
            f"(their content digest differs): {named}{' ...' if len(changed) > 10 else ''}. Their stored values are "
            "the old images'; resuming would mix both. Set output.on_change: redo (--set output.on_change=redo) to "
            "compute their shards again, or --overwrite"
        )
    redone = {s.index for s in redo}
    return _Plan(False, old, [s for s in shards if not done[s.index] or s.index in redone], redo, prints,
                 _moved_members(group, rows))


def _moved_members(group: Any, rows: Rows) -> tuple[np.ndarray, np.ndarray] | None:
    """A tar source's member offsets and sizes now, when a rewritten tar moved them (the rows still to
    compute read their bytes where they are now; computed ones whose bytes changed were named above)."""
    if rows.offsets is None or rows.sizes is None or "byte_offset" not in group:
        return None
    offsets, sizes = np.asarray(rows.offsets, dtype=np.int64), np.asarray(rows.sizes, dtype=np.int64)
    same = np.array_equal(offsets, group["byte_offset"][:]) and np.array_equal(sizes, group["byte_size"][:])
    return None if same else (offsets, sizes)


def _changed_rows(spec: JobSpec, group: Any, rows: Rows) -> tuple[list[int], np.ndarray | None]:
    """Rows already read (ok or failed) whose image is not the one they read: where the source's fingerprint
    (size, mtime, ETag) differs from the stored one, the bytes are read and their content digest compared
    (a file touched but unchanged passes). Also the source's fingerprints, when any differ (to record)."""
    if "digest" not in group or rows.fingerprints is None:
        if "digest" not in group:
            log.warning("%s predates content digests: images changed since its rows were computed cannot be told",
                        spec.output.store)
        return [], None
    now = np.asarray(rows.fingerprints, dtype=np.uint64)
    stored = np.asarray(group["fingerprint"][:])
    read = np.asarray(group["status"][:]) != PENDING
    unknown = int((read & (now == 0)).sum())
    if unknown:
        log.warning("%d computed rows of %s have no cheap fingerprint (URLs in a manifest): not checked for changed "
                    "images; `extractor inspect --verify` reads them", unknown, spec.output.store)
    suspects = np.flatnonzero(read & (now != stored) & (now != 0))
    changed: list[int] = []
    if len(suspects):
        digests = np.asarray(group["digest"][:])
        now_digests = source_digests(group, suspects, spec.data.storage_options)
        changed = [int(r) for r, d in zip(suspects, now_digests, strict=True) if d != digests[r]]
    return changed, (now if bool((now != stored).any()) else None)


def _claim(spec: JobSpec, rows: Rows, plan: _Plan, attrs: dict[str, Any], lease: Lease) -> Any:
    """Create, replace or resume the store under the job's lease, deciding again at that moment: a
    store that appeared, was replaced or whose lease another job took since :func:`_decide` read it
    is refused, naming that job. Returns the store's group (this job's from then on)."""
    url, so = spec.output.store, spec.output.storage_options
    now_there = read_attrs(url, so)
    if (now_there or {}).get("created") != (plan.old or {}).get("created"):
        Lease.check(url, so, spec.output.lease_timeout_s)  # names a live job that did it
        raise StoreError(f"store {url} was {'created' if plan.old is None else 'replaced'} by another job after this "
                         "one looked at it; run again (--resume finishes it)")
    if not plan.create:
        lease.acquire()  # a live lease refuses; a stale one is taken over
        group = open_group(url, "r+", so)
        reset_shards(group, [(s.index, s.start, s.stop) for s in plan.redo])  # before any new fingerprint
        if plan.fingerprints is not None:
            get_array(group, "fingerprint")[:] = plan.fingerprints
        if plan.places is not None:
            get_array(group, "byte_offset")[:], get_array(group, "byte_size")[:] = plan.places
        update_attrs(url, so, status="running", resumed=now())
        return group
    if plan.old is not None:
        Lease.check(url, so, spec.output.lease_timeout_s)
        log.info("%s %s", "creating again" if plan.old.get("status") == "creating" else "overwriting", url)
    layout = Layout(captures=attrs["captures"], extras=attrs["extras"], shard_size=spec.data.shard_size,
                    chunk_rows=attrs["chunk_rows"], compression=spec.output.compression,
                    compression_level=spec.output.compression_level, reuse=bool(spec.output.reuse))
    return create_store(url, rows, layout, attrs, so, lease=lease, fresh=plan.old is None)


def _check_targets(spec: JobSpec, rows: Rows, logits: int | None) -> None:
    """``target: label`` differentiates each row's label's logit: every row needs a label, and
    one the model has an output for."""
    if any(c.gradient and c.score_target == "label" for c in spec.capture):
        missing = [i for i, label in enumerate(rows.labels) if label < 0]
        if missing:
            raise DataError(
                f"target: label needs a label on every row, but {len(missing)} rows have none "
                f"(first: {rows.ids[missing[0]]}); use target: predicted or a class index"
            )
        beyond = [i for i, label in enumerate(rows.labels) if logits is not None and label >= logits]
        if beyond and logits is not None:
            first = beyond[0]
            raise DataError(
                f"target: label needs labels the model has outputs for (0 to {logits - 1}), but {len(beyond)} rows "
                f"have larger ones (first: {rows.ids[first]}, label {rows.labels[first]}). Labels must be the "
                "model's class indices; use target: predicted or a class index"
            )


def _bytes_per_row(captures: dict[str, dict[str, Any]]) -> dict[str, int]:
    return {k: int(np.prod(m["shape"], dtype=np.int64)) * np.dtype(m["dtype"]).itemsize for k, m in captures.items()}


class LocalBackend:
    """The worker in this process: shards run one after another."""

    def __init__(self, spec: JobSpec, worker: Worker | None = None) -> None:
        # builds the model and resolves every layer before any image is read
        self.worker = worker if worker is not None else Worker(spec)

    def probe(self) -> dict[str, Any]:
        return self.worker.layout()

    def warm_up(self) -> None:
        self.worker.warm_up()

    def run(self, todo: list[Shard], url: str, on_progress: Progress, on_event: Event,
            fence: str | None = None) -> list[ShardSummary]:
        summaries: list[ShardSummary] = []
        processed = [0]
        pid = os.getpid()

        def on_batch(n: int) -> None:
            processed[0] += n
            on_progress(processed[0])

        on_event("worker_started", {"worker": 0, "pid": pid})
        finishing: deque[tuple[Shard, Future[ShardSummary]]] = deque()

        def report(keep: int) -> None:
            """Report the shards whose done marker is written; wait while more than ``keep`` are not."""
            while finishing and (len(finishing) > keep or finishing[0][1].done()):
                shard, future = finishing.popleft()
                summary = future.result()
                on_event("shard_done", {"shard": shard.index, "worker": 0, "summary": summary})
                summaries.append(summary)

        def computed(shard: Shard, future: Future[ShardSummary]) -> None:
            # a shard's last writes and done marker are stored while the next one computes
            finishing.append((shard, future))
            report(keep=1)

        try:
            self.worker.run_shards(
                todo, url, on_batch=on_batch, on_computed=computed,
                on_started=lambda shard: on_event("shard_started", {"shard": shard.index, "worker": 0, "pid": pid}),
                fence=fence,
            )
            report(keep=0)
        except BaseException:
            for shard, future in finishing:  # what was computed is still written before the error goes up
                if future.exception() is None:
                    on_event("shard_done", {"shard": shard.index, "worker": 0, "summary": future.result()})
                    summaries.append(future.result())
            raise
        return summaries

    def close(self) -> None:
        self.worker.close()


def _backend(spec: JobSpec) -> Any:
    if spec.cluster.backend == "local":
        return LocalBackend(spec)
    from .ray_backend import RayBackend

    return RayBackend(spec)


def _worker_table(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per worker slot: shards, images, seconds, images/s, restarts (its process replaced) and
    retries (shards that failed on it and counted a retry), from the event log."""
    table: dict[int, dict[str, Any]] = {}
    for name, info in events:
        if "worker" not in info:
            continue
        row = table.setdefault(info["worker"], {"worker": info["worker"], "pids": [], "nodes": [], "shards": 0,
                                                "images": 0, "seconds": 0.0, "restarts": 0, "retries": 0})
        if name == "worker_started" and info["pid"] not in row["pids"]:
            row["pids"].append(info["pid"])
            if info.get("node") and info["node"] not in row["nodes"]:
                row["nodes"].append(info["node"])
        elif name == "shard_done":
            s = info["summary"]
            row["shards"] += 1
            row["images"] += s.rows
            row["seconds"] += s.seconds
        elif name == "shard_failed":
            row["retries"] += 1
        elif name == "worker_died":
            row["restarts"] += 1
            row["retries"] += info.get("charged") is not None
    for row in table.values():
        row["images_per_s"] = row["images"] / row["seconds"] if row["seconds"] else 0.0
    return [table[k] for k in sorted(table)]


def _chunking(spec: JobSpec, captures: dict[str, CaptureRecord]) -> dict[str, int]:
    """Rows per chunk of each capture array: output.chunk_rows, or ``auto``'s choice for the capture's row size."""
    if spec.output.chunk_rows != "auto":
        return dict.fromkeys(captures, spec.output.chunk_rows)
    return {k: auto_chunk_rows(spec.data.shard_size, math.prod(c["shape"]) * np.dtype(c["dtype"]).itemsize)
            for k, c in captures.items()}


def _store_attrs(spec: JobSpec, rows: Rows, n_shards: int, layout: dict[str, Any]) -> dict[str, Any]:
    """The store's ``extractor`` attributes at its creation (or, on resume, what it must match)."""
    return {
        "format_version": FORMAT_VERSION,
        "created": now(),
        "updated": now(),
        "status": "running",
        "spec": spec.public_dict(),  # secrets in storage options never reach the store
        "spec_digest": spec_digest(spec),
        "model": layout["model"],
        "preprocess": layout["preprocess"],  # what resize, crop, interpolation, mean and std resolved to
        "captures": layout["captures"],
        "extras": layout["extras"],
        "classes": rows.classes,
        "n_rows": len(rows),
        "n_shards": n_shards,
        "shard_size": spec.data.shard_size,
        "chunk_rows": _chunking(spec, layout["captures"]),
        "ids_digest": _digest(rows.ids),
        "paths_digest": _digest(rows.paths),  # where the images are read from, resolved
        "versions": _versions(),
        **({"reused_from": list(spec.output.reuse)} if spec.output.reuse else {}),  # the reused array's stores
    }


def _mark_stopped(spec: JobSpec, group: Any, url: str, err: BaseException) -> None:
    """Mark the store ``interrupted`` or ``failed`` with ``err`` and the statistics of the shards that
    finished; a storage that refuses (the one that failed the job may) only gets a warning."""
    status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
    try:
        stats = merge_stats(str(s) for s in group["shard_stats"][:])
        update_attrs(url, spec.output.storage_options, status=status, error=f"{type(err).__name__}: {err}"[:1000],
                     stats=stats)
    except Exception as mark:  # noqa: BLE001 - whatever the storage raises, its done shards are kept
        log.warning("could not mark %s %s (%s: %s); its done shards are kept", url, status, type(mark).__name__,
                    mark)


def _compute(spec: JobSpec, backend: Any, todo: list[Shard], on_progress: Progress, on_event: Event,
             lease: Lease) -> list[ShardSummary]:
    """Run the shards ``todo`` on ``backend`` while this job holds the store's ``lease``."""
    url = absolute(spec.output.store)  # for workers in another directory
    summaries = backend.run(todo, url, on_progress, on_event, fence=lease.token) if todo else []
    lease.verify()  # a job paused past its lease marks nothing complete in another job's store
    return summaries


# run is over 60 lines, a quarter of them its docstring: the job's steps, in order, read best in one place
def run(
    spec: JobSpec,
    *,
    on_start: Callable[[int, dict[str, int]], None] | None = None,
    on_progress: Progress | None = None,
    on_event: Event | None = None,
    backend: Any = None,
) -> RunSummary:
    """Run a whole job; returns when every shard is done.

    ``on_start(rows_to_process, bytes_per_row)`` is called once the plan is known,
    ``on_progress(rows_processed)`` as batches finish, and ``on_event(name, info)`` on
    worker and shard events (``worker_started``, ``shard_started``, ``shard_done``,
    ``shard_failed``, ``worker_died``): ``shard_started`` once a worker begins computing the
    shard (on Ray, as seen by the driver's next progress poll, or with its result),
    ``worker_died`` with the ``shards`` it held and the one ``charged`` a retry (None when it
    held several: each is redone alone). ``backend`` replaces the one ``spec.cluster`` names
    (benchmarks: a ``LocalBackend`` around a Worker subclass); it is closed at the end.
    """
    t0 = time.perf_counter()
    try:
        rows = list_rows(spec.data)
    except BaseException:
        if backend is not None:
            backend.close()
        raise
    shards = plan(len(rows), spec.data.shard_size)
    log.info("%d images in %d shards of %d", len(rows), len(shards), spec.data.shard_size)
    events: list[tuple[str, dict[str, Any]]] = []

    def event(name: str, info: dict[str, Any]) -> None:
        events.append((name, info))
        log.debug("%s %s", name, info)
        if on_event is not None:
            on_event(name, info)

    backend = backend if backend is not None else _backend(spec)
    lease: Lease | None = None
    group: Any = None
    summaries: list[ShardSummary] = []
    try:
        # everything that can fail before the first image (model, shapes, layouts, preprocessing, compile,
        # the estimate) happens before the store is touched
        layout = backend.probe()
        _check_targets(spec, rows, layout["model"].get("logits"))
        attrs = _store_attrs(spec, rows, len(shards), layout)
        if spec.output.reuse:  # every store to take rows from makes them as this job would
            check_sources(spec.output.reuse, attrs, spec.output.store, spec.output.storage_options)
        decided = _decide(spec, rows, shards, attrs, read_attrs(spec.output.store, spec.output.storage_options))
        if decided.todo:
            backend.warm_up()  # a resume with nothing left to compute compiles nothing
        per_row = _bytes_per_row(layout["captures"])
        if on_start is not None:
            on_start(sum(len(s) for s in decided.todo), per_row)
        if decided.nothing_to_do:  # exit 0 without writing: also on a read-only file system
            group = open_group(spec.output.store, "r", spec.output.storage_options)
            return _finish(spec, group, shards, [], [], per_row, time.perf_counter() - t0, write=False)
        lease = Lease(spec.output.store, spec.output.storage_options, spec.output.lease_timeout_s, _owner())
        group = _claim(spec, rows, decided, attrs, lease)  # from here on the store is this job's
        done = done_shards(group)  # read again under the lease
        todo = [s for s in shards if not done[s.index]]
        t_compute = time.perf_counter()
        summaries = _compute(spec, backend, todo, on_progress or (lambda n: None), event, lease)
        compute_s = time.perf_counter() - t_compute
    except BaseException as err:
        if group is not None and lease is not None and not (isinstance(err, FencedError) or lease.lost):
            _mark_stopped(spec, group, spec.output.store, err)  # else: not a word more into another job's store
            err.resumable = True  # type: ignore[attr-defined]  # the CLI prints the command that finishes it
        raise
    finally:
        backend.close()
        if lease is not None:
            lease.release()
    try:
        summary = _finish(spec, group, shards, todo, summaries, per_row, time.perf_counter() - t0,
                          compute_s=compute_s)
    except StoreError:
        raise
    except OSError as err:  # every shard is done; only the final attributes could not be written
        raise StoreError(f"cannot write the final attributes of {spec.output.store}: {type(err).__name__}: {err}; "
                         "its shards are done and kept: --resume finishes it once the storage works") from err
    summary.workers = _worker_table(events)
    return summary


def _finish(
    spec: JobSpec,
    group: Any,
    shards: list[Shard],
    todo: list[Shard],
    summaries: list[ShardSummary],
    per_row: dict[str, int],
    seconds: float,
    compute_s: float = 0.0,
    write: bool = True,
) -> RunSummary:
    """The run's summary; with ``write``, the store's final status and statistics (a resume with nothing
    to do reads them as they are)."""
    status = np.asarray(group["status"][:])
    failed_rows = np.flatnonzero(status == FAILED)
    failures = []
    if len(failed_rows):
        ids = group["ids"]
        errors = group["errors"]
        for r in failed_rows[:20]:
            failures.append((int(r), str(ids[int(r)]), str(errors[int(r)])))
    n_pending = int((status == PENDING).sum())
    if write:
        complete = bool(done_shards(group).all())
        stats = merge_stats(str(s) for s in group["shard_stats"][:])
        update_attrs(spec.output.store, spec.output.storage_options, status="complete" if complete else "incomplete",
                     error=None, stats=stats)
        consolidate(spec.output.store, spec.output.storage_options)
    else:
        stats = dict(group.attrs["extractor"].get("stats") or {})
    processed = sum(s.rows for s in summaries)
    return RunSummary(
        store=spec.output.store,
        rows=len(status),
        ok=int((status == 1).sum()),
        failed=len(failed_rows),
        pending=n_pending,
        shards=len(shards),
        shards_skipped=len(shards) - len(todo),
        shards_run=len(summaries),
        seconds=seconds,
        images_per_s=processed / max(seconds, 1e-9),
        compute_images_per_s=processed / max(compute_s, 1e-9),
        bytes_per_row=per_row,
        failures=failures,
        per_shard=summaries,
        nonfinite={k: (v["nonfinite_rows"], v["first_nonfinite_rows"]) for k, v in stats.items()
                   if v["nonfinite_rows"]},
        float16=[k for k, m in group.attrs["extractor"]["captures"].items() if m["dtype"] == "float16"],
        reused=sum(s.reused for s in summaries),
    )
