"""``extractor plan`` (also ``run --dry-run``): what a job would write, before anything is written.

The model is built and probed on this machine's CPU (shapes do not depend on the device), the rows
listed and the store read as a run would read it (``StoreSession.decide``, read-only): per capture
the stored shape, dtype, bytes per row, rows and bytes per chunk (a row's read costs one) and the
storage objects it makes (one per work shard when sharded); totals;
what the run would do to an existing store; free space at a local destination. Nothing is created,
replaced or locked.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .._text import count, estimate, size, table
from ..data import Rows, first_name, list_rows, plan, sample_of
from ..data import source as source_of
from ..errors import DataError, StoreError
from ..spec import JobSpec, parse_spec
from ..store import (
    ONCE_ARRAYS,
    ROW_ARRAYS,
    Decision,
    Probe,
    StoreSession,
    blocks_for,
    chunking,
    id_index_objects,
    numpy_dtype,
    once_rows,
)

__all__ = ["Preview", "preview"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CapturePlan:
    """One capture array as the job would store it."""

    key: str
    shape: list[int]  # per row
    dtype: str
    bytes_per_row: int
    chunk_rows: int
    chunk_bytes: int  # one chunk, uncompressed
    objects: int  # storage objects of the whole array: its shards (sharded), else its chunks


@dataclass(frozen=True)
class Listing:
    """The rows' listing on the driver: its CPU seconds, the bytes of its columns spilled to the local disk, the
    driver's peak memory once listed; where only a part of a large source was listed (``sampled``), the seconds and
    bytes are the whole source's, scaled from that part's."""

    cpu_s: float
    on_disk: int
    peak_bytes: int  # the driver process's peak resident memory when the listing ended (its imports included)
    sampled: str | None = None  # the part listed ("16 of 40,000 Parquet files"); None: every row
    rows_listed: int = 0
    counted: bool = False  # the whole source's rows counted (every Parquet file's footer), not scaled

    def report(self) -> str:
        held = (f"the driver peaked at {size(self.peak_bytes)} of resident memory, its imported libraries included "
                "(its columns spill to the disk past a megabyte each)")
        if self.sampled is None:
            return (f"the driver listed the rows in {self.cpu_s:.1f} s of CPU; {size(self.on_disk)} of the listing on "
                    f"its local disk (EXTRACTOR_SPILL_DIR or TMPDIR), not in its memory; {held}")
        what = "the listing's time and disk" if self.counted else "rows and sizes"
        return (f"{what} estimated from {self.sampled} ({self.rows_listed:,} rows listed; extractor plan "
                f"--full lists every row): listing them all takes about {_seconds(self.cpu_s)} of the driver's CPU and "
                f"{size(self.on_disk)} of its local disk (EXTRACTOR_SPILL_DIR or TMPDIR); listing the part, {held}")


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{s / 60:.0f} minutes" if s < 5400 else f"{s / 3600:.1f} hours"


def _peak_bytes() -> int:
    """This process's peak resident memory so far."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # (bytes on macOS, kilobytes elsewhere)


@dataclass
class Preview:
    """What ``extractor run`` would do with a job: rows, shards, captures, totals, the store's fate."""

    store: str
    rows: int
    shards: int
    shard_size: int
    todo_rows: int  # rows the run would compute (a resume: those of shards not done)
    action: str  # create, overwrite, resume (N shards to do), nothing to do, or the refusal
    captures: list[CapturePlan]
    per_row_objects: int  # objects besides the captures: ids, paths, status ..., the id index, shard markers
    per_row_bytes: int = 0  # a row's per-row results (KEY.token_index, target ...), uncompressed
    free_bytes: int | None = None  # at a local destination
    listing: Listing | None = None  # what listing the rows took on this machine (the driver's)
    warnings: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return (sum(c.bytes_per_row for c in self.captures) + self.per_row_bytes) * self.rows

    @property
    def objects(self) -> int:
        return sum(c.objects for c in self.captures) + self.per_row_objects

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes, "objects": self.objects}

    @property
    def _about(self) -> str:
        """"about " where the figures are scaled from a part of the source (they read as counts otherwise; as they
        are where the whole source's rows were counted)."""
        listing = self.listing
        return "about " if listing is not None and listing.sampled is not None and not listing.counted else ""

    @property
    def refused(self) -> bool:
        """Whether a run would refuse this store (the plan then says why, not what the run would write)."""
        return self.action.startswith("run would refuse")

    def report(self) -> str:
        if self.refused:  # (the new listing's table read as what the run would do)
            return "\n".join([f"{self.store}: {self.action}", *([self.listing.report()] if self.listing else []),
                              *(f"warning: {w}" for w in self.warnings)])
        rows = [[c.key, "x".join(map(str, c.shape)), c.dtype, size(c.bytes_per_row), str(c.chunk_rows),
                 size(c.chunk_bytes), f"{c.objects:,}", size(c.bytes_per_row * self.rows)] for c in self.captures]
        lines = [
            f"{self.store}: {self.action}",
            f"{self._about}{self.rows:,} rows in {count(self.shards, 'shard')} of {self.shard_size}"
            + (f" (estimated from {self.listing.sampled})" if self.listing is not None and self._about else ""),
            table(rows, ["capture", "shape per row", "dtype", "per row", "chunk rows", "chunk", "objects", "total"]),
            f"total {size(self.total_bytes)} before compression in {self.objects:,} objects "
            f"({self.per_row_objects:,} of them per-row arrays, the id index and shard markers"
            + (f", {size(self.per_row_bytes * self.rows)} per-row results" if self.per_row_bytes else "")
            + "; a shard with failed rows adds one for their errors)",
        ]
        if self.free_bytes is not None:
            lines.append(f"free at the destination: {size(self.free_bytes)}")
        if self.listing is not None:
            lines.append(self.listing.report())
        lines += [f"warning: {w}" for w in self.warnings]
        per_row = {c.key: c.bytes_per_row for c in self.captures}
        lines.append(self._about + estimate(self.todo_rows, per_row))  # the line `extractor run` prints
        return "\n".join(lines)


def _on_this_machine(spec: JobSpec) -> JobSpec:
    """The job's spec with its model on this machine's CPU, uncompiled, in this process (shapes only)."""
    raw = spec.to_dict()
    raw["model"] = {**raw["model"], "device": "cpu", "compile": False}
    raw["cluster"] = {"backend": "local"}
    raw["data"] = {**raw["data"], "decode_device": "cpu"}
    return parse_spec(raw)


def _free_bytes(url: str) -> int | None:
    """Free space where a local store would go (its nearest existing folder); None for URLs."""
    if "://" in url and not url.startswith("file://"):
        return None
    path = os.path.abspath(url.removeprefix("file://"))
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return shutil.disk_usage(path).free


def _action(decided: Decision) -> str:
    if decided.create:
        return "create" if decided.old is None else "overwrite"
    if decided.nothing_to_do:
        return "nothing to do (complete)"
    again = "; a half-made store: its rows written again" if decided.rows_again else ""
    return f"resume ({count(len(decided.todo), 'shard')} to do{again})"


def preview(spec: JobSpec, full: bool = False) -> Preview:
    """What ``run(spec)`` would write; creates, replaces and locks nothing. A source of many parts (Parquet files,
    tars, megabytes of a manifest: :func:`~extractor.data.sample_of`) is estimated from a part of it spread over it,
    unless ``full`` or a store is there (what a run would do to it is decided on every row): its rows and every
    figure that follows from them scaled by the part's share."""
    from .runner import LocalBackend, label_targets

    store = StoreSession(spec)
    # what a run would do to a store that is there is decided on every row (a resume, or a refusal)
    rows, listed, scale = _listing(spec, full or store.recorded() is not None)
    n_rows = round(len(rows) * scale)
    backend = LocalBackend(_on_this_machine(spec))
    try:
        probe = backend.probe()
    finally:
        backend.close()
    todo, action, layout = _decided(store, rows, probe) if listed.sampled is None else (n_rows, "create", None)
    if layout is None:
        chunk_rows = chunking(spec, probe.captures)
        layout = {k: (chunk_rows[k], spec.output.sharding) for k in probe.captures}
    planned = _planned(spec, probe, n_rows, len(rows.locators), todo, action, layout, listed)
    if spec.data.source in _FIRST_PART and spec.data.classes is None and rows.classes and \
            action in ("create", "overwrite") and not (spec.output.reuse or label_targets(spec)):  # (a run streams it)
        planned.warnings += _named_labels(spec, rows, listed.sampled)
    return planned


def _named_labels(spec: JobSpec, rows: Rows, sampled: str | None) -> list[str]:
    """The warning of a plan whose labels are class names, data.classes not given: how a run takes them (a listing
    streamed takes labels as class indices as they come: :func:`.runner._streamed`); none where they are all names
    and the run reads them first (:meth:`~..data.sources.Source.names_first`)."""
    found = first_name(rows)
    assert found is not None
    row, only_names = found
    if only_names and source_of(spec.data.source).names_first(spec.data):
        return []
    source = spec.data.source
    first = f"{rows.classes[int(rows.labels[row])]!r}, row {row + 1}{' of the part listed' if sampled else ''}"
    said = f"labels are class names (the first: {first})" if only_names else \
        f"labels are class indices beside class names (the first name: {first})"
    return [f"{said} and data.classes is not given: names are numbered once every label is read, so the run lists "
            f"this source whole before its first shard where its first {_FIRST_PART[source]} holds a name, and "
            "stops at the first name read after it (its rows taken as class indices until then); list the classes' "
            "names in data.classes to take them as they come"]


# the sources whose listing streamed takes labels as class indices where data.classes is not given (a name read
# after its first part stops it), and that first part
_FIRST_PART = {"manifest": "block (a megabyte)", "tar": "tar"}


def _listing(spec: JobSpec, full: bool) -> tuple[Rows, Listing, float]:
    """The rows listed (a large source's part, unless ``full``), what listing them took, and the whole source over
    them."""
    sampled = None if full else sample_of(spec.data)
    if sampled is not None:
        try:
            warm = sample_of(sampled.data, parts=1, over=0)  # the first listing's imports and first calls: not scaled
            list_rows(sampled.data if warm is None else warm.data)
            started = time.process_time()
            rows = list_rows(sampled.data)
            return rows, Listing((time.process_time() - started) * sampled.scale,
                                 round(rows.on_disk() * sampled.scale), _peak_bytes(), str(sampled), len(rows),
                                 sampled.rows is not None), \
                sampled.scale
        except DataError as err:  # a part cut where the whole is not (a newline in a quoted value): all of it
            log.info("the part of the source (%s) was not listed (%s): every row is", sampled, err)
    started = time.process_time()
    rows = list_rows(spec.data)
    return rows, Listing(time.process_time() - started, rows.on_disk(), _peak_bytes(), None, len(rows)), 1.0


def _decided(store: StoreSession, rows: Rows, probe: Probe) -> tuple[int, str, dict[str, tuple[int, bool]] | None]:
    """What a run would do to the store, from every row: the rows it would compute, its action, and the chunking and
    sharding of a store resumed (which keeps its own; None: the job's)."""
    try:
        decided = store.decide(rows, plan(len(rows), store.spec.data.shard_size), probe, sources=False)
        return sum(len(s) for s in decided.todo), _action(decided), \
            None if decided.create else store.stored_chunking(list(probe.captures))
    except StoreError as err:
        return 0, f"run would refuse: {err}", None


def _planned(spec: JobSpec, probe: Probe, n_rows: int, locators: int, todo: int, action: str,
             layout: dict[str, tuple[int, bool]], listed: Listing) -> Preview:
    """The plan of a job of ``n_rows`` rows (``locators``: the source's per-row arrays beside the paths)."""
    per_row = probe.bytes_per_row()
    n_shards = math.ceil(n_rows / spec.data.shard_size)

    def objects(chunk_rows: int, sharded: bool) -> int:  # sharded: one object per work shard; else one per chunk
        return n_shards if sharded else math.ceil(n_rows / chunk_rows)

    captures = [CapturePlan(k, list(c["shape"]), c["dtype"], per_row[k], layout[k][0], layout[k][0] * per_row[k],
                            objects(*layout[k])) for k, c in probe.captures.items()]
    # a chunk per shard of each per-row array (a shard's finish writes each of its chunks whole, errors too) and
    # its statistics; the ledger's blocks, the final record and the job's claimant's record
    n_per_row = len(ROW_ARRAYS) - len(ONCE_ARRAYS) + len(probe.extras) + locators + bool(spec.output.reuse) + 1
    once = len(ONCE_ARRAYS) * math.ceil(n_rows / once_rows(min(spec.data.shard_size, n_rows), n_rows))
    extras = sum(math.prod(e["shape"]) * numpy_dtype(e["dtype"]).itemsize for e in probe.extras.values())
    planned = Preview(spec.output.store, n_rows, n_shards, spec.data.shard_size, todo, action, captures,
                      n_per_row * n_shards + once + blocks_for(n_shards) + 2 + id_index_objects(n_rows),
                      extras, _free_bytes(spec.output.store), listed)
    if planned.free_bytes is not None and planned.total_bytes > planned.free_bytes:
        planned.warnings.append(f"the store may not fit: {size(planned.total_bytes)} before compression, "
                                f"{size(planned.free_bytes)} free; cut it with dtype: float16 or bfloat16, "
                                "sample_tokens or project, or write it elsewhere")
    return planned
