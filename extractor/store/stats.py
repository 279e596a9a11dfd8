"""Statistics of captured values, streamed per shard and merged across shards (numpy and zarr only).

Per capture: count, mean and standard deviation per feature (the channel of a map, the
feature of a token sequence, each element of a vector), global min and max, NaN and Inf
counts, rows holding any NaN/Inf, and the mean L2 norm of a row; of a token capture (its last dims
``token``, ``feature``) also the mean L2 norm of a token (``mean_token_l2``: what a sparse autoencoder
normalises by), and where its rows hold tokens besides the patches (CLS and registers before them, YOLOS's
detection tokens after them), the same per-token statistics of the patches alone (``patches``: the sums of the
tokens besides them are kept apart, the patches' are the rest). Non-finite values are counted, not folded into the
moments.

A shard's record (``shard_stats[s]``) is JSON whose per-feature sums are base64 of their bytes (records
written before hold lists of numbers: both are read). The driver merges records into :class:`Totals` as
shards are committed, and the store's end merges only those it did not: memory per capture and feature, never
per shard.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import queue
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import zarr

from .generation import committed_attempts, done_shards
from .layout import get_array, take_rows

log = logging.getLogger(__name__)

__all__ = ["ShardStats", "Totals", "feature_axis", "merge", "merge_shards"]

_SUMS = {"count": np.int64, "sum": np.float64, "sumsq": np.float64}  # per feature
_BESIDES_SUMS = {"besides_count": np.int64, "besides_sum": np.float64, "besides_sumsq": np.float64}  # not patches
_SCALARS = ("nan", "inf", "rows", "nonfinite_row_count", "l2_sum", "l2_rows", "token_l2_sum", "token_l2_count")
_BESIDES_SCALARS = ("besides_token_l2_sum", "besides_token_l2_count", "besides_rows")
_FIRST = 20  # rows holding NaN or Inf named, the first ones
MERGE_SLICE = 32  # shards' records read at once by a merge (24 x 1024 features: 800 KB each)


def feature_axis(dims: Sequence[str]) -> int | None:
    """Axis (in a batch-first array) whose entries get their own mean/std; None: one global."""
    names = [d.rsplit(".", 1)[-1] for d in dims]
    if names and names[0] == "channel":
        return 1
    if names and names[-1] == "feature":
        return len(names)
    return None


class ShardStats:
    """Running sums for one capture over one shard's ok rows; of a token capture whose patches are ``span``
    (first, count) of its stored tokens (:func:`~.tokens.patch_span`), the sums of the tokens besides them apart
    too."""

    def __init__(self, dims: Sequence[str], shape: Sequence[int], span: tuple[int, int] | None = None) -> None:
        self.axis = feature_axis(dims)
        names = [d.rsplit(".", 1)[-1] for d in dims]
        self.tokens = names[-2:] == ["token", "feature"]  # per-token norms too
        self.token_l2_sum, self.token_l2_count = 0.0, 0
        n_feat = int(shape[self.axis - 1]) if self.axis is not None else 1
        self.count = np.zeros(n_feat, np.int64)
        self.sum = np.zeros(n_feat, np.float64)
        self.sumsq = np.zeros(n_feat, np.float64)
        # the sums of the tokens besides the patches (none: not a token capture, all its tokens patches, not known)
        stored = int(shape[-2]) if self.tokens else 0
        kept = span is not None and self.tokens and 0 < span[1] <= stored - span[0] and tuple(span) != (0, stored)
        self.span: tuple[int, int] | None = (int(span[0]), int(span[1])) if kept and span is not None else None
        self.besides = np.ones(stored, bool)  # the stored tokens that are not patches
        if self.span is not None:
            self.besides[self.span[0] : sum(self.span)] = False
        self.besides_count = np.zeros(n_feat if self.span else 0, np.int64)
        self.besides_sum = np.zeros(n_feat if self.span else 0, np.float64)
        self.besides_sumsq = np.zeros(n_feat if self.span else 0, np.float64)
        self.besides_token_l2_sum, self.besides_token_l2_count = 0.0, 0
        self.min, self.max = np.inf, -np.inf
        self.nan = self.inf = 0
        self.rows = 0
        self.nonfinite_rows: list[int] = []  # the first _FIRST store rows holding NaN or Inf
        self.nonfinite_count = 0
        self.l2_sum, self.l2_rows = 0.0, 0

    def update(self, x: np.ndarray, rows: np.ndarray) -> None:
        """Add a batch ``x`` (B, *shape) whose store rows are ``rows``."""
        if not len(x):
            return
        if x.dtype.itemsize < 4:  # float16 and bfloat16: summed as float32
            x = x.astype(np.float32)
        self.rows += len(x)
        if self.axis is None:
            axes: tuple[int, ...] = tuple(range(x.ndim))
        else:
            axes = tuple(a for a in range(x.ndim) if a != self.axis)
        raw = x
        flat = x.reshape(len(x), -1)
        finite_rows = np.isfinite(flat).all(axis=1)
        if not finite_rows.all():  # rare: count the NaN/Inf, then zero them out of the moments
            x, count = self._count_nonfinite(x, rows, finite_rows, axes)
            good = x[finite_rows]
        else:
            count = np.full(self.count.shape, x.size // self.count.size, np.int64)
            good = x
            if x.size:
                self.min = min(self.min, float(x.min()))
                self.max = max(self.max, float(x.max()))
        # accumulate in float64 without float64 copies of the batch, unless squares would overflow float32
        big = x.size and max(abs(self.min), abs(self.max)) > 1e18
        sq = np.square(x, dtype=np.float64) if big or x.dtype.itemsize > 4 else np.square(x)
        self.count += count
        self.sum += x.sum(axis=axes, dtype=np.float64).reshape(-1)
        self.sumsq += sq.sum(axis=axes, dtype=np.float64).reshape(-1)
        if self.span:
            self._add_besides(raw, x, sq, axes)
        if len(good):
            self._add_norms(sq[finite_rows] if len(good) < len(x) else sq)

    def _add_norms(self, sq: np.ndarray) -> None:
        """Add the L2 norms of the finite rows whose squares are ``sq`` (and of each of their tokens)."""
        self.l2_sum += float(np.sqrt(sq.reshape(len(sq), -1).sum(axis=1, dtype=np.float64)).sum())
        self.l2_rows += len(sq)
        if self.tokens:  # (rows, ..., tokens, features): the norm of each token of the finite rows
            norms = np.sqrt(sq.sum(axis=-1, dtype=np.float64))
            self.token_l2_sum += float(norms.sum())
            self.token_l2_count += norms.size
            if self.span:
                self.besides_token_l2_sum += float(norms[..., self.besides].sum())
                self.besides_token_l2_count += norms[..., self.besides].size

    def _add_besides(self, raw: np.ndarray, x: np.ndarray, sq: np.ndarray, axes: tuple[int, ...]) -> None:
        """Add the sums of a batch's tokens besides the patches (``raw`` as given; ``x`` and its squares ``sq`` with
        non-finite values zeroed), counting their finite values per feature."""
        b = self.besides
        self.besides_count += np.isfinite(raw[..., b, :]).sum(axis=axes).reshape(-1).astype(np.int64)
        self.besides_sum += x[..., b, :].sum(axis=axes, dtype=np.float64).reshape(-1)
        self.besides_sumsq += sq[..., b, :].sum(axis=axes, dtype=np.float64).reshape(-1)

    def _count_nonfinite(self, x: np.ndarray, rows: np.ndarray, finite_rows: np.ndarray,
                         axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Count a batch's NaN and Inf (and the rows holding them); the batch with them zeroed, and the count of
        finite values per feature. The minimum and maximum are of the finite values."""
        finite = np.isfinite(x)
        bad_rows = ~finite_rows
        self.nonfinite_count += int(bad_rows.sum())
        isnan = np.isnan(x)
        self.nan += int(isnan.sum())
        self.inf += int((~finite & ~isnan).sum())
        self.nonfinite_rows = sorted(self.nonfinite_rows + [int(r) for r in rows[bad_rows]])[:_FIRST]
        count = finite.sum(axis=axes).reshape(-1).astype(np.int64)
        x = np.where(finite, x, 0)
        if finite.any():
            self.min = min(self.min, float(np.where(finite, x, np.inf).min()))
            self.max = max(self.max, float(np.where(finite, x, -np.inf).max()))
        return x, count

    def to_dict(self) -> dict[str, Any]:
        out = {
            "count": _pack(self.count), "sum": _pack(self.sum), "sumsq": _pack(self.sumsq),
            "min": self.min if np.isfinite(self.min) else None, "max": self.max if np.isfinite(self.max) else None,
            "nan": self.nan, "inf": self.inf, "rows": self.rows, "nonfinite_rows": self.nonfinite_rows,
            "nonfinite_row_count": self.nonfinite_count,
            "l2_sum": self.l2_sum, "l2_rows": self.l2_rows,
            "token_l2_sum": self.token_l2_sum, "token_l2_count": self.token_l2_count,
        }
        if self.span:
            out.update(patch_span=list(self.span), besides_count=_pack(self.besides_count),
                       besides_sum=_pack(self.besides_sum), besides_sumsq=_pack(self.besides_sumsq),
                       besides_token_l2_sum=self.besides_token_l2_sum,
                       besides_token_l2_count=self.besides_token_l2_count, besides_rows=self.rows)
        return out


def _pack(x: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(x, x.dtype.newbyteorder("<")).tobytes()).decode()


def _unpack(v: str | list[float], dtype: type) -> np.ndarray:
    """Sums as a record holds them: base64 of little-endian bytes, or (records written before) a list."""
    if isinstance(v, str):
        return np.frombuffer(base64.b64decode(v), np.dtype(dtype).newbyteorder("<")).astype(dtype)
    return np.asarray(v, dtype)


def dumps(stats: dict[str, ShardStats]) -> str:
    return json.dumps({key: st.to_dict() for key, st in stats.items()})


class Part(Protocol):
    """A shard's part of a capture's write-time index, as the store holds it (the index's ``IndexState``; the store
    does not import the index): read from its bytes, merged with another's, written as bytes."""

    def load(self, blob: np.ndarray) -> bool: ...

    def merge(self, other: Any) -> None: ...

    def to_bytes(self) -> np.ndarray: ...


Fresh = Callable[[str], "Part | None"]  # an empty part of capture KEY's write-time index (None: KEY has none)


class Totals:
    """Shards' records merged: per capture its sums (memory per capture and feature, never per shard), and
    which shards they hold. With ``fresh`` (the job's write-time indexes), also each index's parts of the shards
    given them (:attr:`parts`, and which shards each holds: :attr:`parts_held`): merged as the shards come and left
    in the partials with the sums, so that the store's end reads the parts of the shards in none (at 400M rows and
    a ViT-B's tokens, 390,000 parts of 14 MB, an hour and more at the end before)."""

    def __init__(self, n_shards: int, fresh: Fresh | None = None) -> None:
        self.held = np.zeros(n_shards, bool)
        self.attempts = np.zeros(n_shards, np.uint64)  # the attempt whose record each shard held is (0: not known)
        self.acc: dict[str, dict[str, Any]] = {}
        self.fresh = fresh
        self.parts: dict[str, Part] = {}
        self.parts_held: dict[str, np.ndarray] = {}
        self.torn = False  # an add stopped part way (a signal's exception): these totals are not to be kept or merged

    def add(self, index: int, text: str, attempt: int = 0, parts: Mapping[str, np.ndarray] | None = None) -> bool:
        """Add shard ``index``'s record, of ``attempt`` (once: a shard held already adds nothing; "" is a shard with
        none), and its ``parts`` of the write-time indexes (:meth:`add_parts`); whether it was added."""
        if self.held[index]:
            return False
        record = json.loads(text) if text else {}
        self.torn = True  # until the record is added whole (a SIGTERM's exception part way left a capture without sums)
        self.held[index] = True
        self.attempts[index] = attempt
        if parts:
            self.add_parts(index, parts)
        for key, d in record.items():
            a = self.acc.get(key)
            if a is None:
                a = self.acc[key] = {"min": None, "max": None, "nonfinite_rows": [], **dict.fromkeys(_SCALARS, 0)}
            for k, dtype in _SUMS.items():
                v = _unpack(d[k], dtype)
                a[k] = a[k] + v if k in a else v
            for k, f in (("min", min), ("max", max)):
                if d[k] is not None:
                    a[k] = d[k] if a[k] is None else f(a[k], d[k])
            for k in _SCALARS:
                a[k] = a.get(k, 0) + d.get(k, 0)  # records (totals) written before per-token norms have none
            a["nonfinite_rows"] = sorted(a["nonfinite_rows"] + d["nonfinite_rows"])[:_FIRST]
            _add_besides(a, d)
        self.torn = False
        return True

    def add_parts(self, index: int, parts: Mapping[str, np.ndarray]) -> None:
        """Shard ``index``'s parts of the write-time indexes merged, where these totals hold its record (one that is
        not a part of these indexes, or of a shard not held: left for the end, which reads it from the store)."""
        if self.fresh is None or not self.held[index]:
            return
        for key, blob in parts.items():
            one = self.fresh(key)
            if one is None or not one.load(np.asarray(blob)):
                continue
            self._merge_part(key, one, index)

    def _merge_part(self, key: str, part: Part, shards: int | np.ndarray) -> None:
        total = self.parts.get(key)
        if total is None:
            self.parts[key] = part
        else:
            try:
                total.merge(part)
            except BaseException:  # merged part way: none of its shards' parts kept (the end reads them)
                del self.parts[key], self.parts_held[key]
                raise
        self.parts_held.setdefault(key, np.zeros(len(self.held), bool))[shards] = True

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per capture: rows, mean and std per feature, min, max, NaN and Inf counts, the rows holding them."""
        out = {}
        for key, a in self.acc.items():
            count = np.maximum(a["count"], 1)
            mean = a["sum"] / count
            var = np.maximum(a["sumsq"] / count - mean**2, 0.0)
            out[key] = {
                "rows": a["rows"],
                "mean": [float(v) for v in np.atleast_1d(mean)],
                "std": [float(v) for v in np.atleast_1d(np.sqrt(var))],
                "min": a["min"],
                "max": a["max"],
                "nan": a["nan"],
                "inf": a["inf"],
                "nonfinite_rows": a["nonfinite_row_count"],
                "first_nonfinite_rows": a["nonfinite_rows"],
                "mean_l2": a["l2_sum"] / a["l2_rows"] if a["l2_rows"] else None,
            }
            if a.get("token_l2_count"):
                out[key]["mean_token_l2"] = a["token_l2_sum"] / a["token_l2_count"]
            if a.get("patch_span") and a.get("besides_rows") == a["rows"] and not a.get("span_mixed"):  # every row's
                out[key]["patches"] = _patches(a)
        return out

    def to_bytes(self) -> bytes:
        """The totals as one object: a CRC-32, then npz of the sums and JSON of the rest."""
        arrays = {f"{k}/{key}": a[k] for key, a in self.acc.items() for k in (*_SUMS, *_BESIDES_SUMS) if k in a}
        rest = {key: {k: v for k, v in a.items() if k not in _SUMS and k not in _BESIDES_SUMS}
                for key, a in self.acc.items()}
        out = io.BytesIO()
        arrays.update({f"part/{key}": part.to_bytes() for key, part in self.parts.items()})
        arrays.update({f"part_held/{key}": np.packbits(held) for key, held in self.parts_held.items()})
        np.savez(out, held=np.packbits(self.held), attempts=self.attempts,
                 rest=np.frombuffer(json.dumps(rest).encode(), np.uint8), **arrays)
        payload = out.getvalue()
        return zlib.crc32(payload).to_bytes(4, "little") + payload

    @classmethod
    def from_bytes(cls, blob: bytes, n_shards: int, fresh: Fresh | None = None) -> Totals | None:
        """Totals written by :meth:`to_bytes`; None when ``blob`` is not whole (a write cut short) or of another
        shard count. Their parts of the write-time indexes are read with ``fresh`` (none without it: the end reads
        their shards' parts from the store)."""
        if len(blob) < 4 or zlib.crc32(blob[4:]) != int.from_bytes(blob[:4], "little"):
            return None
        with np.load(io.BytesIO(blob[4:])) as z:
            totals = cls(n_shards, fresh)
            held = np.unpackbits(z["held"])
            if len(held) < n_shards or held[n_shards:].any():
                return None
            totals.held = held[:n_shards].astype(bool)
            if "attempts" in z.files:
                totals.attempts = z["attempts"].astype(np.uint64)
            for key, rest in json.loads(z["rest"].tobytes()).items():
                sums = {k: z[f"{k}/{key}"].astype(dtype) for k, dtype in (*_SUMS.items(), *_BESIDES_SUMS.items())
                        if f"{k}/{key}" in z.files}
                if not set(_SUMS) <= set(sums):  # left torn (an add stopped part way, before it was said so): its
                    return None  # shards' records are read from the store instead
                totals.acc[key] = {**rest, **sums}
            totals._load_parts(z)
        return totals

    def _load_parts(self, z: Any) -> None:
        for name in z.files:
            key = name.removeprefix("part/")
            if key == name or self.fresh is None or f"part_held/{key}" not in z.files:
                continue
            part, held = self.fresh(key), np.unpackbits(z[f"part_held/{key}"])[:len(self.held)].astype(bool)
            if part is not None and part.load(z[name]) and not (held & ~self.held).any():
                self._merge_part(key, part, held)

    def absorb(self, other: Totals) -> bool:
        """Add ``other``'s sums and parts (shards merged by another process; ``other`` is given up to these), unless
        it holds a shard these hold already (a sum cannot be taken back out): False then, nothing added."""
        if len(other.held) != len(self.held) or (other.held & self.held).any():
            return False
        for key, b in other.acc.items():
            a = self.acc.get(key)
            if a is None:
                self.acc[key] = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in b.items()}
                continue
            for k in _SUMS:
                a[k] = a[k] + b[k]
            for k, f in (("min", min), ("max", max)):
                if b[k] is not None:
                    a[k] = b[k] if a[k] is None else f(a[k], b[k])
            for k in _SCALARS:
                a[k] = a.get(k, 0) + b.get(k, 0)
            a["nonfinite_rows"] = sorted(a["nonfinite_rows"] + b["nonfinite_rows"])[:_FIRST]
            _add_besides(a, b)
        for key, part in other.parts.items():
            self._merge_part(key, part, other.parts_held[key])
        self.held |= other.held
        self.attempts[other.held] = other.attempts[other.held]
        return True


class PartMerger:
    """Shards' index parts merged into :attr:`totals` on a thread of their own, a few waiting at most: a part that
    finds them all waiting is left (the store's end reads it from the store), so that the driver's events never wait
    on a merge (a ViT-B token index's part: 17 ms; 64 GPUs commit more shards a second than one thread merges).
    Who reads or copies the totals holds :attr:`lock` (:meth:`held`)."""

    def __init__(self, totals: Totals, depth: int = 4) -> None:
        self.totals = totals
        self.lock = threading.Lock()
        self.left = 0  # parts left to the end: they found the queue full
        self._queue: queue.Queue[tuple[Totals, int, Mapping[str, np.ndarray]]] = queue.Queue(depth)
        self._thread: threading.Thread | None = None

    def offer(self, index: int, parts: Mapping[str, np.ndarray]) -> None:
        """Shard ``index``'s parts (its record added to :attr:`totals`), merged soon, or left to the end."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="extractor-index-parts", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait((self.totals, index, parts))
        except queue.Full:
            self.left += 1

    def _run(self) -> None:
        while True:
            totals, index, parts = self._queue.get()
            try:
                with self.lock:
                    if totals is self.totals:  # (totals started over meanwhile: their shards' parts read at the end)
                        totals.add_parts(index, parts)
            except Exception as err:  # noqa: BLE001 - a part not merged is read from the store by the end
                log.debug("index parts of shard %d not merged: %s", index, err)
            finally:
                self._queue.task_done()

    def restart(self, totals: Totals) -> PartMerger:
        """Merge into ``totals`` from now on (those before started over: their shards' parts read at the end)."""
        with self.lock:
            self.totals = totals
        return self

    def drain(self) -> None:
        """Until the parts offered so far are merged."""
        if self._thread is not None:
            self._queue.join()

    @contextlib.contextmanager
    def held(self) -> Any:
        """The totals, while no part is merged into them."""
        with self.lock:
            yield self.totals


def _add_besides(a: dict[str, Any], d: Mapping[str, Any]) -> None:
    """Add a shard record's sums of its tokens besides the patches (``d``, where it holds them) to a capture's totals
    ``a``: the rows they cover count (``besides_rows``), so patches' statistics are given only where every row's are
    apart."""
    if d.get("span_mixed"):
        a["span_mixed"] = True
    if not d.get("patch_span"):
        return
    if a.setdefault("patch_span", d["patch_span"]) != d["patch_span"]:  # never within one store: no patches' stats
        a["span_mixed"] = True
        return
    for k, dtype in _BESIDES_SUMS.items():
        v = _unpack(d[k], dtype)
        a[k] = a[k] + v if k in a else v
    for k in _BESIDES_SCALARS:
        a[k] = a.get(k, 0) + d.get(k, 0)


def _patches(a: Mapping[str, Any]) -> dict[str, Any]:
    """The per-token statistics of the patches alone: every token's sums less those of the tokens besides them."""
    count = np.maximum(a["count"] - a["besides_count"], 1)
    mean = (a["sum"] - a["besides_sum"]) / count
    var = np.maximum((a["sumsq"] - a["besides_sumsq"]) / count - mean**2, 0.0)
    tokens = a["token_l2_count"] - a["besides_token_l2_count"]
    return {"span": list(a["patch_span"]), "mean": [float(v) for v in mean], "std": [float(v) for v in np.sqrt(var)],
            "mean_token_l2": (a["token_l2_sum"] - a["besides_token_l2_sum"]) / tokens if tokens else None}


def shard_record(group: zarr.Group, index: int) -> str:
    """Shard ``index``'s record (read as a slice: zarr 3.1 reads one element of a long string 60x slower)."""
    return str(np.asarray(get_array(group, "shard_stats")[index : index + 1])[0])


def merge_shards(group: zarr.Group, totals: Totals | None = None, partials: Iterable[Totals] = ()) -> dict[str, Any]:
    """The store's statistics: ``totals`` (shards merged already) with other processes' ``partials`` (their own
    shards, merged as they committed them) and every committed shard's record in none of them added, read
    ``MERGE_SLICE`` shards at a time (``totals`` are updated): each record is read once, by whoever merged it first.
    Totals holding a shard that is not committed (made pending since, to be computed again), or whose commit names
    another attempt now (committed again by another process since: a joiner that redid it), are started over;
    partials holding such a shard are left out."""
    done, committed = done_shards(group), committed_attempts(group)
    totals = totals if totals is not None else Totals(len(done))
    known = totals.held & (totals.attempts != 0) & (committed != 0)  # (0: not known: records read from the store)
    if (totals.held & ~done).any() or (totals.attempts[known] != committed[known]).any():
        totals.__init__(len(done), totals.fresh)  # type: ignore[misc]  # started over, in place: the caller's object
    for partial in partials:  # of the shards as committed now: none made pending, or committed again, since
        if (partial.attempts[partial.held] == committed[partial.held]).all():
            totals.absorb(partial)
    todo = np.flatnonzero(done & ~totals.held)
    records = get_array(group, "shard_stats")
    for a in range(0, len(todo), MERGE_SLICE):
        part = todo[a : a + MERGE_SLICE]
        for index, text in zip(part.tolist(), take_rows(records, part).tolist(), strict=True):
            totals.add(index, str(text))
    return totals.summary()


def merge(shards: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Merge per-shard JSON records (as written by the workers) into the per-capture summary."""
    texts = list(shards)
    totals = Totals(len(texts))
    for index, text in enumerate(texts):
        totals.add(index, text)
    return totals.summary()
