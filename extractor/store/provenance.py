"""The store's record of its job, and the contract for resuming it: one home.

A store records what made its values (:func:`store_attrs`: the spec, the model, the resolved
preprocessing, each capture's record, the per-row extras, the image list's digests, versions) from a
:class:`Probe`, what the worker measured with one blank image. :func:`check_resumable` decides whether a
job may resume a store (the same format, spec content, preprocessing, weights, captures and images read
from the same places); :func:`changed_rows` and :func:`moved_locators` find the rows whose images changed
or moved since. The driver decides what to do with the answers; nothing here writes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import re
from dataclasses import asdict, dataclass
from typing import Any, NotRequired, TypedDict

import numpy as np

from .._version import __version__
from ..data import BLOCK, Column, Rows, Stats, Streamed, of_store, paths_now, source
from ..errors import StoreError
from ..spec import (
    PLACES,
    JobSpec,
    auto_chunk_rows,
    auto_inner_rows,
    content_of,
    parse_spec,
    redact,
    redact_argv,
    spec_digest,
)
from .chunks import read_all
from .dtypes import numpy_dtype
from .forward import forward_differences
from .layout import (
    FORMAT_VERSION,
    OK,
    PENDING,
    PREPROCESS_FIELDS,
    READ_PRINT,
    CaptureRecord,
    ExtraRecord,
    NamesDigest,
    now,
)
from .recorded import source_digests

__all__ = [
    "Probe",
    "StoreRecord",
    "changed_rows",
    "check_half_made",
    "check_resumable",
    "committed_blocks",
    "differences",
    "kept_probe",
    "model_differences",
    "moved_locators",
    "owner",
    "store_attrs",
    "with_digests",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """What one blank image through the model measured, all the driver needs to create the store: each
    capture's record, the per-row extras of a gradient job, the model's facts (class, weights hash, logits)
    and the resolved preprocessing. Returned by ``Worker.probe()`` and every backend's ``probe()``."""

    captures: dict[str, CaptureRecord]
    extras: dict[str, ExtraRecord]
    model: dict[str, Any]
    preprocess: dict[str, Any]

    def bytes_per_row(self) -> dict[str, int]:
        return {k: math.prod(c["shape"]) * numpy_dtype(c["dtype"]).itemsize for k, c in self.captures.items()}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StoreRecord(TypedDict):
    """The store's ``extractor`` attributes, as :func:`store_attrs` makes them at its creation (the runner's
    end adds ``stats`` and ``error``, a resume ``resumed``)."""

    format_version: int
    created: str
    updated: str
    status: str  # creating, running, complete, incomplete, interrupted, failed
    spec: dict[str, Any]  # the public spec (no secrets)
    spec_digest: str
    model: dict[str, Any]
    preprocess: dict[str, Any]  # what resize, crop, interpolation, mean and std resolved to
    captures: dict[str, CaptureRecord]
    extras: dict[str, ExtraRecord]
    classes: list[str]
    n_rows: int
    n_shards: int
    shard_size: int
    chunk_rows: dict[str, int]  # per capture
    ids_digest: str | None  # None until needed: a resume's comparison (:func:`with_digests`), or a new store's
    paths_digest: str | None  # making, which hashes them from the bytes it writes
    versions: dict[str, str]
    reused_from: NotRequired[list[str]]  # output.reuse's stores
    listing: NotRequired[dict[str, Any]]  # the source's listing (Source.listing), to take the rows from the store
    stats: NotRequired[dict[str, Any]]
    error: NotRequired[str | None]
    resumed: NotRequired[str]


def versions() -> dict[str, str]:
    """The versions that made a store's values (recorded; a resume under others warns, see the reader)."""
    out = {"extractor": __version__, "python": platform.python_version()}
    for name in ("torch", "torchvision", "zarr", "numpy"):  # as each says (torch's with its build: 2.9.0+cu128)
        out[name] = _version(name)
    return out


def _version(name: str) -> str:
    """An installed package's version as its ``__version__`` says, found without importing it (importing
    torchvision for a job that does not use it was 3 s of CPU on every run and resume): torch's and torchvision's
    ``version.py`` (their metadata leaves out the build, ``+cu128``), else the package's metadata."""
    import re
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    spec = find_spec(name)
    if spec is None:
        return "not installed"
    for folder in spec.submodule_search_locations or []:
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                said = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.MULTILINE)
        except OSError:
            continue
        if said:
            return said.group(1)
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def owner() -> dict[str, Any]:
    """Who holds a lease: host, pid, user, start and the command (secrets redacted)."""
    import getpass
    import socket
    import sys

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        user = "?"
    return {"host": socket.gethostname(), "pid": os.getpid(), "user": user, "started": now(),
            "command": " ".join(redact_argv(sys.argv))[:500]}


def _digest(names: Any) -> str:
    """A short hash of ids or paths (an array of strings or a Joined), in order (:class:`~.layout.NamesDigest`)."""
    return NamesDigest.of(names)


def with_digests(record: StoreRecord, rows: Rows) -> StoreRecord:
    """``record`` with the digests of ``rows``' ids and paths that :func:`store_attrs` left out made (in place)."""
    if record["ids_digest"] is None:
        record["ids_digest"] = _digest(rows.ids)
    if record["paths_digest"] is None:
        record["paths_digest"] = _digest(rows.paths)
    return record


def chunking(spec: JobSpec, captures: dict[str, CaptureRecord]) -> dict[str, int]:
    """Rows per chunk of each capture array: output.chunk_rows, or ``auto``'s choice for the capture's row size."""
    if spec.output.chunk_rows != "auto":
        return dict.fromkeys(captures, spec.output.chunk_rows)
    auto = auto_inner_rows if spec.output.sharding else auto_chunk_rows
    return {k: auto(spec.data.shard_size, math.prod(c["shape"]) * numpy_dtype(c["dtype"]).itemsize)
            for k, c in captures.items()}


def store_attrs(spec: JobSpec, rows: Rows | Streamed, n_shards: int, probe: Probe) -> StoreRecord:
    """The store's ``extractor`` attributes at its creation (or, on resume, what it must match)."""
    record: StoreRecord = {
        "format_version": FORMAT_VERSION,
        "created": now(),
        "updated": now(),
        "status": "running",
        "spec": spec.public_dict(),  # secrets in storage options never reach the store
        "spec_digest": spec_digest(spec),
        "model": probe.model,
        "preprocess": probe.preprocess,  # what resize, crop, interpolation, mean and std resolved to
        "captures": probe.captures,
        "extras": probe.extras,
        "classes": rows.classes,
        "n_rows": len(rows),
        "n_shards": n_shards,
        "shard_size": spec.data.shard_size,
        "chunk_rows": chunking(spec, probe.captures),
        # where the images are read from, resolved; rows left in their store: the digests it recorded of them; else
        # made where they are needed (with_digests), or by the store's making from the bytes it writes
        "ids_digest": None if rows.stored is None else rows.stored["ids_digest"],
        "paths_digest": None if rows.stored is None else rows.stored["paths_digest"],
        "versions": versions(),
    }
    if spec.output.reuse:  # the reused array's stores
        record["reused_from"] = redact(list(spec.output.reuse))
    if rows.listing:  # a resume takes the rows from the store while it holds
        record["listing"] = rows.listing
    return record


# the model sources and weights whose module is a function of the spec and the installed versions: a torchvision
# builder with a random init (seed 0) or its own weights (by name; torchvision checks their file's hash). A
# factory's code, a checkpoint file, a hub's cache or a module made in Python can change under the same spec.
_FIXED_BY_SPEC = {"torchvision": ("random", "pretrained", "name")}


def kept_probe(spec: JobSpec, old: dict[str, Any] | None) -> Probe | None:
    """What the probe of a complete store measured, as the store recorded it, where building the model again
    would measure the same: the same spec (content digest) and versions, a model that both fix (``_FIXED_BY_SPEC``)
    and no other stores to take rows from. A resume with nothing to compute then decides from it without importing
    torch or building the model (6-10 s of CPU); None: the model is built and probed."""
    if old is None or old.get("status") != "complete" or old.get("format_version") != FORMAT_VERSION:
        return None
    if spec.model.weights_kind not in _FIXED_BY_SPEC.get(spec.model.source, ()) or spec.output.reuse:
        return None
    if old.get("spec_digest") != spec_digest(spec) or old.get("versions") != versions():
        return None
    if not all(isinstance(old.get(k), dict) for k in ("captures", "extras", "model", "preprocess")):
        return None
    return Probe(captures=old["captures"], extras=old["extras"], model=old["model"], preprocess=old["preprocess"])


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


def _outermost_lacking(k: str, lacking: dict[str, Any]) -> str:
    """The outermost entry holding setting ``k`` (``capture[1]`` for ``capture[1].layer``) that the side
    ``lacking`` has nothing of."""
    prefixes = [k[:m.start()] for m in re.finditer(r"[.\[]", k)] + [k]
    return next((p for p in prefixes if p and not any(x == p or x.startswith((p + ".", p + "[")) for x in lacking)), k)


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per changed setting; an entry (``capture[1]``) on one side only is one line."""
    a, b = _flatten(old), _flatten(new)
    diffs: list[str] = []
    for k in sorted(set(a) | set(b)):
        if k in a and k in b:
            if a[k] != b[k]:
                diffs.append(f"{k}: {json.dumps(a[k])} in the store, {json.dumps(b[k])} now")
            continue
        top = _outermost_lacking(k, b if k in a else a)
        if top == k:
            line = f"{k}: {json.dumps(a.get(k, '(unset)'))} in the store, {json.dumps(b.get(k, '(unset)'))} now"
        else:
            line = f"{top}: in the store, not in the spec now" if k in a else \
                f"{top}: in the spec now, not in the store"
        if line not in diffs:
            diffs.append(line)
    return diffs


def current_form(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored (public) spec as this version writes it: settings it lacks get their defaults."""
    model = stored.get("model")
    if isinstance(model, dict) and model.get("factory") and model.get("name") == "resnet18":
        stored = {**stored, "model": {k: v for k, v in model.items() if k != "name"}}  # the old default, unused
    try:
        return parse_spec(stored).public_dict()
    except Exception:  # noqa: BLE001 - a spec this version refuses: compared as stored
        return stored




def _moved(group: Any, paths: Any) -> str | None:
    """The first row whose image the store read from another path than ``paths`` (a relative
    ``data.root`` resolved in another folder, moved data), as 'STORED in the store, NOW now'."""
    stored = group["paths"]
    for start in range(0, min(len(paths), stored.shape[0]), BLOCK):
        stop = min(start + BLOCK, len(paths), stored.shape[0])
        was, now_ = np.asarray(stored[start:stop]), np.asarray(paths[start:stop])
        differ = np.flatnonzero(was != now_)
        if len(differ):
            i = int(differ[0])
            return f"row {start + i}'s image: {str(was[i])!r} in the store, {str(now_[i])!r} now"
    return None


def _spec_differences(old: dict[str, Any], new: dict[str, Any], same_places: bool) -> list[str]:
    """The stored spec against this job's, with the settings added since as their defaults: it differs in
    content, or only in what an older version of extractor did not write down. ``same_places``: the same
    images from the same places, so data.root spelt otherwise is the same."""
    old_spec, new_spec = content_of(current_form(old.get("spec", {}))), content_of(new["spec"])
    if same_places:
        for d in (old_spec, new_spec):
            for key in PLACES:  # compared by the paths they list, not by their spelling
                d.get("data", {}).pop(key, None)
    return differences(old_spec, new_spec)


def _value_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What makes the values besides the spec: the resolved preprocessing, the weights, the captures."""
    problems: list[str] = []
    was, now_ = of_store(old).to_dict(), new["preprocess"]
    problems += [f"preprocess {k}: {json.dumps(was[k])} in the store, {json.dumps(now_[k])} now"
                 for k in PREPROCESS_FIELDS if was[k] != now_[k]]
    if old.get("model", {}).get("state_dict_sha256") != new["model"]["state_dict_sha256"]:
        problems.append("the model's weights differ (state-dict hash)")
    elif moved := forward_differences(old.get("model", {}), new["model"]):
        problems.append(f"the model's forward differs (same weights, other values of {', '.join(moved)} on the "
                        "probe's fixed input: another activation or code)")
    if old.get("captures") != new["captures"]:
        problems += ["capture " + d for d in differences(old.get("captures", {}), new["captures"])]
    return problems


def model_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What makes a model built now (``new``: a probe's ``preprocess``, ``model`` and ``captures``, as JSON gives
    them back) give other values than the store's (``old``: its record): the preprocessing, the weights' digest, the
    forward on the probe's fixed input, the captures' records; [] where none."""
    return _value_differences(old, new)


REORDER_ROWS = 10_000_000  # up to this many rows, a refused image list is compared with the store's in any order


def _reordered(group: Any, ids: Any, n_rows: Any) -> str:
    """``"; the same ids in another order"`` where the listing's ids are the store's as a set (their hashes, as the
    store's id index holds them sorted), else "" (or where the store has no id index, or more than
    :data:`REORDER_ROWS` rows)."""
    from ..data import text_hashes
    from .id_index import ID_INDEX

    if ids is None or n_rows != len(ids) or len(ids) > REORDER_ROWS or f"{ID_INDEX}/hashes" not in group:
        return ""
    stored = np.asarray(group[f"{ID_INDEX}/hashes"][:])
    return "; the same ids in another order" if np.array_equal(np.sort(text_hashes(ids)), stored) else ""


def _first_difference(group: Any, ids: Any) -> str:
    """``"; the first that differs: row N, ID in the store, ID now"`` (a file renamed, added or removed: where the
    lists part), else "" (the store's ids or these not given, or more than :data:`REORDER_ROWS` of them)."""
    if ids is None or "ids" not in group or min(len(ids), group["ids"].shape[0]) > REORDER_ROWS:
        return ""
    n = min(len(ids), group["ids"].shape[0])
    for a, b in row_blocks(n):
        stored, listed = read_all(group["ids"], a, b), np.asarray(ids[a:b])
        differ = np.flatnonzero(stored != listed)
        if len(differ):
            r = int(differ[0])
            return f"; the first that differs: row {a + r}, {str(stored[r])!r} in the store, {str(listed[r])!r} now"
    if len(ids) == group["ids"].shape[0]:
        return ""
    longer, where = (ids, "now") if len(ids) > n else (group["ids"], "in the store")
    return f"; the first that differs: row {n}, {str(np.asarray(longer[n:n + 1])[0])!r} {where} only"


def check_resumable(url: str, old: dict[str, Any], new: dict[str, Any], group: Any, paths: Any,
                    ids: Any = None) -> None:
    """Refuse to resume a store made by another format, spec, model or data listing, or whose
    images the job would read from another place (``paths``: this run's, resolved; ``ids``: its ids, to say where a
    refused list holds the store's ids in another order). ``new``: this job's :func:`store_attrs` (as JSON would
    give them back)."""
    problems: list[str] = []
    if old.get("format_version") != FORMAT_VERSION:
        problems.append(f"format version {old.get('format_version')} in the store, {FORMAT_VERSION} now")
    else:
        moved = _moved(group, paths) if old.get("paths_digest") != new["paths_digest"] else None
        if old.get("spec_digest") != new["spec_digest"]:
            problems += _spec_differences(old, new, same_places=moved is None)
        problems += _value_differences(old, new)
        if old.get("ids_digest") != new["ids_digest"]:
            problems.append(f"the image list differs ({old.get('n_rows')} rows in the store, {new['n_rows']} now"
                            f"{_reordered(group, ids, old.get('n_rows')) or _first_difference(group, ids)})")
        elif moved is not None:
            problems.append(
                f"the images would be read from another place: {moved}; a relative data.root, data.manifest or "
                "data.tars means a place under the folder the job runs from: run it from the folder of its first "
                "run, or give that path absolute"
            )
    _refuse(url, problems)


def _refuse(url: str, problems: list[str]) -> None:
    if problems:
        listed = "\n  ".join(problems[:10])
        raise StoreError(
            f"cannot resume {url}: it was made by a different job:\n  {listed}\n"
            "Use --overwrite to replace it, or set output.store to write a new store."
        )


def check_half_made(url: str, old: dict[str, Any], new: dict[str, Any], group: Any, rows: Rows,
                    blocks: list[tuple[int, int]]) -> None:
    """:func:`check_resumable` for a store left half-made (its rows not all written, so no digest of them
    recorded): its format, spec, model and captures, its count of rows, and the ids and paths of the rows its
    committed shards computed (``blocks``: :func:`committed_blocks`) against this listing; its other rows are
    written again from this listing."""
    if old.get("n_rows") != len(rows):
        _refuse(url, [f"the image list differs ({old.get('n_rows')} rows in the store, {len(rows)} now)"])
    new = dict(new)
    for name in ("ids", "paths"):  # compared where both sides know them (a manifest's ids are hashed as listed)
        key = f"{name}_digest"
        if old.get(key) is None:
            new[key] = None
        elif new[key] is None:
            new[key] = _digest(getattr(rows, name))
    check_resumable(url, old, new, group, rows.paths, rows.ids)
    for start, stop in blocks:
        for name, what in (("ids", "the image list differs"), ("paths", "the images would be read from another "
                                                                        "place")):
            for a in range(start, stop, BLOCK):  # (BLOCK rows at a time: a million ids or paths as strings are 380 MB)
                b = min(a + BLOCK, stop)
                stored, listed = read_all(group[name], a, b), np.asarray(getattr(rows, name)[a:b])
                differ = np.flatnonzero(stored != listed)
                if len(differ):
                    r = int(differ[0])
                    _refuse(url, [f"{what} (row {a + r}, computed before: {str(stored[r])!r} in the store, "
                                  f"{str(listed[r])!r} now)"])


def committed_blocks(done: np.ndarray, shard_size: int, n_rows: int) -> list[tuple[int, int]]:
    """The rows of the committed shards (``done``), as runs of at most :data:`COMPARE_ROWS` rows."""
    shards = np.flatnonzero(done)
    cuts = np.flatnonzero(np.diff(shards) != 1) + 1
    out = []
    for run in np.split(shards, cuts) if len(shards) else []:
        first, last = int(run[0]) * shard_size, min((int(run[-1]) + 1) * shard_size, n_rows)
        out += [(a, min(a + COMPARE_ROWS, last)) for a in range(first, last, COMPARE_ROWS)]
    return out


def moved_locators(group: Any, rows: Rows) -> dict[str, np.ndarray] | None:
    """The source's locator arrays as listed now (``rows.locators``), when the source moved its rows' bytes since
    the store recorded them (a rewritten tar): the rows still to compute read them where they are now; computed
    ones whose bytes changed are found by :func:`changed_rows`. None: none moved, or the source has none."""
    if not rows.locators or any(name not in group for name in rows.locators):
        return None
    same = all(np.array_equal(column[a:b], read_all(group[name], a, b)) for name, column in rows.locators.items()
               for a, b in row_blocks(len(rows)))
    return None if same else dict(rows.locators)


def _say_gone(spec: JobSpec, group: Any, gone: np.ndarray) -> None:
    """Warn of computed rows whose image file cannot be seen now (removed, renamed, unreadable): their values are
    of the image as it was read, kept."""
    if len(gone):
        first = int(gone[0])
        log.warning("%d computed rows of %s name image files that cannot be seen now (removed, renamed or no longer "
                    "a file since; row %d: %s): their stored values are of the images as they were read; `extractor "
                    "inspect --verify` names every one", len(gone), spec.output.store, first,
                    str(np.asarray(group["paths"][first:first + 1])[0]))


COMPARE_ROWS = 1 << 20  # rows of the store's per-row arrays compared with the listing's at a time


def row_blocks(n: int) -> list[tuple[int, int]]:
    """Rows ``0:n`` in blocks of :data:`COMPARE_ROWS` (400M rows' fingerprints are 3.2 GB: never read at once)."""
    return [(a, min(a + COMPARE_ROWS, n)) for a in range(0, n, COMPARE_ROWS)]


def stored_prints(group: Any, a: int, b: int) -> np.ndarray:
    """The fingerprints the store holds of rows ``a:b``: its source's (``fingerprint``), else, where that is 0, the
    file's as its worker read it (``read_fingerprint``: a folder's or a manifest's, whose listing stats no file)."""
    stored = read_all(group["fingerprint"], a, b)
    unknown = stored == 0
    if READ_PRINT in group and unknown.any():
        stored = np.where(unknown, read_all(group[READ_PRINT], a, b), stored)
    return stored


def _prints_now(spec: JobSpec, rows: Rows) -> tuple[np.ndarray | None, bool]:
    """The source's fingerprints of the rows now (None: not given), and whether the files of the rows read are to be
    stat-ed instead (a source whose listing stats no file, a folder or a manifest: when listed again, or where
    data.verify: files asks; its rows taken from the store otherwise are taken as they were). Neither: not known
    (nothing is compared)."""
    given = rows.fingerprints
    stat = given is None and source(spec.data.source).prints_on_read and (rows.stored is None or
                                                                           spec.data.verify == "files")
    return given, stat


def _read_prints_now(rows: Rows, group: Any, a: int, b: int, read: np.ndarray, stats: Stats) -> np.ndarray:
    """The fingerprints now of the files of rows ``a:b`` that were read (``read``; 0 for the others), stat-ed
    :data:`~extractor.data.BLOCK` rows at a time (a block of a million paths as Python's and numpy's strings is
    380 MB: never held at once); their paths as listed now, or as the store holds them (rows taken from it)."""
    now = np.zeros(b - a, dtype=np.uint64)
    for c in range(a, b, BLOCK):
        d = min(c + BLOCK, b)
        at = np.flatnonzero(read[c - a:d - a])
        if len(at):
            paths = rows.paths[c:d] if rows.stored is None else read_all(group["paths"], c, d)
            now[c - a + at] = paths_now(np.asarray(paths)[at], stats)
    return now


def _zeros_to(column: Column, n: int) -> None:
    """``column`` made ``n`` long with 0s, :data:`~extractor.data.BLOCK` at a time."""
    while len(column) < n:
        column.extend(np.zeros(min(BLOCK, n - len(column)), dtype=np.uint64))


def changed_rows(spec: JobSpec, group: Any, rows: Rows,
                 blocks: list[tuple[int, int]]) -> tuple[list[int], np.ndarray | None]:
    """Rows already read (ok or failed) whose image is not the one they read: where the source's fingerprint
    (size, mtime, ETag) differs from the stored one, the bytes are read and their content digest compared
    (a file touched but unchanged passes). Also the source's fingerprints, when any differ (to record).
    ``blocks``: the rows to look at (:func:`row_blocks`; a half-made store's: :func:`committed_blocks`)."""
    if "digest" not in group:
        log.warning("%s predates content digests: images changed since its rows were computed cannot be told",
                    spec.output.store)
        return [], None
    given, stat = _prints_now(spec, rows)
    if given is None and not stat:
        return [], None
    stated = Column("Q")  # (the stats, on the disk: 8 bytes a row, 3.2 GB at 400M rows)
    unknown, moved, found, gone = 0, False, [], []
    with Stats() as stats:  # (one for every block: found slow once)
        for a, b in blocks:  # (a block at a time)
            stored = stored_prints(group, a, b)
            status = read_all(group["status"], a, b)
            read, computed = status != PENDING, status == OK  # (a failed row holds no values to say anything of)
            if given is not None:
                now = np.asarray(given[a:b], dtype=np.uint64)
            else:
                now = _read_prints_now(rows, group, a, b, read, stats)
                _zeros_to(stated, a)
                stated.extend(now)
            unknown += int((computed & (now == 0) & (stored == 0)).sum())
            gone.append(np.flatnonzero(computed & (now == 0) & (stored != 0)) + a)  # a file that cannot be seen now
            moved = moved or bool(((now != stored) & (read | (stored != 0))).any())  # (0 of a row not read: unknown)
            found.append(np.flatnonzero(read & (now != stored) & (now != 0)) + a)
    if unknown:
        log.warning("%d computed rows of %s have no cheap fingerprint (URLs in a manifest, or image files gone since "
                    "an earlier resume): not checked for changed images; `extractor inspect --verify` reads them",
                    unknown, spec.output.store)
    _say_gone(spec, group, np.concatenate(gone) if gone else np.zeros(0, np.int64))
    changed = _digests_differ(spec, group, rows, np.concatenate(found) if found else np.zeros(0, np.int64))
    if not moved:
        return changed, None
    if given is not None:
        return changed, np.asarray(given, dtype=np.uint64)
    _zeros_to(stated, len(rows))
    return changed, stated.array()


def _digests_differ(spec: JobSpec, group: Any, rows: Rows, suspects: np.ndarray) -> list[int]:
    """Of rows ``suspects`` (their fingerprints moved), those whose image's content digest differs now from the
    stored one (read where the source holds it now)."""
    if not len(suspects):
        return []
    digests = group["digest"].get_coordinate_selection(suspects)
    places = {name: column[suspects] for name, column in rows.locators.items()} if rows.locators else None
    now_digests = source_digests(group, suspects, spec.data.storage_options, places=places)  # where they are now
    return [int(r) for r, d, was in zip(suspects, now_digests, digests, strict=True) if d != was]
