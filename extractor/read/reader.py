"""Opening a store for analysis: lazy arrays, ids, labels, status. Needs only numpy and zarr.

    >>> s = open_store("out.zarr")
    >>> s.captures            # key -> layer, what, reduce, dtype, shape, dims
    >>> s["layer3"][:8]       # a lazy zarr array: numpy slicing reads only what it needs
    >>> s.numpy("avgpool")    # ok rows only, as one numpy array
    >>> s.extras              # gradient jobs: per-row target, target_score, KEY.range; read like captures
    >>> s.stats["avgpool"]    # per-feature mean/std, min/max, NaN/Inf counts ({} until a run ends)
    >>> for rows, x in s.batches("avgpool", 1024): ...
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import zarr

from .._threads import prefetched
from ..errors import StoreError
from ..store import (
    ATTR,
    OK,
    STATUS_NAMES,
    CaptureRecord,
    being_created,
    current_places,
    disk_usage,
    done_shards,
    get_array,
    lease_timeout,
    read_lease,
    read_rows,
    root_attrs,
    source_digests,
    take_rows,
)
from ..store.sampling import projection_matrix
from ..store.snapshot import snapshot_store

__all__ = ["open_store", "ActivationStore"]


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> ActivationStore:
    """Open a store written by extractor, read-only and lazily."""
    kwargs: dict[str, Any] = {"mode": "r"}
    if storage_options:
        kwargs["storage_options"] = dict(storage_options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # consolidated metadata "not part of the Zarr v3 specification"
            # consolidated metadata when present: one read opens it all; a local store's shards read from one version
            # of their object each (store.snapshot)
            local = url.removeprefix("file://") if "://" not in url.removeprefix("file://") else None
            snapshot = local is not None and hasattr(os, "pread") and os.path.isdir(local)  # POSIX's pread
            group = zarr.open_group(snapshot_store(local) if snapshot and local is not None else url, **kwargs)
    except FileNotFoundError:
        raise StoreError(f"no store at {url}") from None
    except Exception as err:
        raise StoreError(f"cannot open {url} as a Zarr store: {err}") from err
    if ATTR not in group.attrs:
        raise StoreError(f"{url} is a Zarr group but not an extractor store (no '{ATTR}' attributes)")
    attrs = root_attrs(group)
    if attrs.get("status") == "creating":
        raise StoreError(being_created(url, group, _lease_timeout(attrs)))
    return ActivationStore(group, url, storage_options)


def _lease_timeout(attrs: Mapping[str, Any]) -> float:
    """The lease timeout the store's job ran with, as its spec records it (leases record their own too, and
    theirs counts); 0 where neither says (no store extractor writes): such a lease counts as stale."""
    return float((attrs.get("spec") or {}).get("output", {}).get("lease_timeout_s") or 0.0)


Rows = slice | Sequence[int] | np.ndarray | None
_Columns = tuple[np.ndarray, ...]  # arrays of one length: a batch's row numbers (or token index), then its data
_Read = tuple[np.ndarray, np.ndarray]  # rows of one key: store row numbers, their values
_T = TypeVar("_T")
_R = TypeVar("_R")


def _prefetched(items: Iterable[_T], fn: Callable[[_T], _R], depth: int, threads: int = 2) -> Iterator[_R]:
    """``fn(item)`` for each item, computed up to ``depth`` ahead on ``threads`` background threads
    (chunks decode in parallel: zstd and zarr release the GIL), in order."""
    return prefetched(items, fn, depth, threads, name="extractor-read")


def _check_sizes(batch_size: int, buffer_chunks: int) -> None:
    """Refuse a batch or buffer size below one."""
    if batch_size < 1 or buffer_chunks < 1:
        raise ValueError(f"batch_size and buffer_chunks must be >= 1, not {batch_size} and {buffer_chunks}")


def _chunk_runs(idx: np.ndarray, step: int) -> list[np.ndarray]:
    """``idx`` cut into runs of consecutive entries inside one chunk of ``step`` rows."""
    return np.split(idx, np.flatnonzero(np.diff(idx // step)) + 1) if idx.size else []


def _shuffled_chunks(idx: np.ndarray, step: int, seed: int) -> list[np.ndarray]:
    """The rows of ``idx`` grouped by chunk (ascending inside each), the chunks in a random order drawn
    from ``seed``: random order that costs no random reads."""
    runs = _chunk_runs(np.sort(idx, kind="stable"), step)  # sorting takes linear time when already ascending
    return [runs[i] for i in np.random.default_rng(seed).permutation(len(runs))]


Part = tuple[int, int]  # (k, n): the k-th of n disjoint parts of an epoch (DataLoader workers, ranks)


def _check_part(part: Part | None) -> Part:
    """``part`` as (k, n) with 0 <= k < n; None is the whole epoch, (0, 1)."""
    if part is None:
        return (0, 1)
    try:
        k, n = (int(v) for v in part)
    except (TypeError, ValueError):
        raise ValueError(f"part must be (k, n), the k-th of n parts of an epoch, not {part!r}") from None
    if not 0 <= k < n:
        raise ValueError(f"part (k, n) needs 0 <= k < n, not {part!r}")
    return k, n


def _epoch_runs(idx: np.ndarray, step: int, shuffle: bool, seed: int, part: Part) -> list[np.ndarray]:
    """The runs of rows (each inside one chunk of ``step`` rows) one epoch reads, in order: the chunks
    in a random order drawn from ``seed`` with ``shuffle``, else in the order given. Of the epoch's
    runs, ``part`` (k, n) takes every n-th from the k-th: the n parts together read every run once,
    whatever the number of parts."""
    runs = _shuffled_chunks(idx, step, seed) if shuffle else _chunk_runs(idx, step)
    k, n = part
    return runs[k::n] if n > 1 else runs


def _mix_seed(seed: int, part: Part, n: int) -> list[int]:
    """The seed of the n-th buffer of a part (the whole epoch keeps the seeds it always had)."""
    return [seed, n] if part == (0, 1) else [seed, *part, n]


def _read_runs(arrays: Sequence[zarr.Array], runs: Sequence[np.ndarray],
               spare: list[np.ndarray] | None = None) -> tuple[np.ndarray, _Columns]:
    """Runs of rows (each inside one chunk) of each array: the rows read (ascending for several runs, else
    in the run's order) and each array's values of them. ``spare``: arrays no longer used, of the first
    array's rows; one with room is read into (a fresh one costs first-touch page faults)."""
    rows = np.sort(np.concatenate(runs)) if len(runs) > 1 else np.concatenate(runs)
    into = None
    if spare:
        room = spare.pop()
        if len(room) >= len(rows) and room.shape[1:] == arrays[0].shape[1:] and room.dtype == arrays[0].dtype:
            into = room[: len(rows)]
    return rows, (take_rows(arrays[0], rows, into), *(take_rows(arr, rows) for arr in arrays[1:]))


@dataclass(frozen=True)
class _Buffer:
    """Rows read at once, served in the order ``perm`` (None: as read)."""

    index: np.ndarray  # (n,) store row numbers; for tokens (n, 2): row and position in its sequence
    data: _Columns  # per key, in the order asked: its (n, ...) values
    perm: np.ndarray | None

    @classmethod
    def read(cls, arrays: Mapping[str, zarr.Array], runs: Sequence[np.ndarray], seed: list[int] | None) -> _Buffer:
        """Read runs of rows (each inside one chunk; on the prefetch thread); with ``seed``, draw the
        order of their rows."""
        rows, data = _read_runs(list(arrays.values()), runs)
        perm = None if seed is None else np.random.default_rng(seed).permutation(len(rows))
        return cls(rows, data, perm)

    def __len__(self) -> int:
        return len(self.index)

    def take(self, lo: int, hi: int) -> _Columns:
        """Places ``lo:hi`` of the buffer's order: index, then each key's values."""
        at = slice(lo, hi) if self.perm is None else self.perm[lo:hi]
        return (self.index[at], *(x[at] for x in self.data))


def _rebatch(buffers: Iterable[_Buffer | _Tokens], batch_size: int, drop_last: bool = False) -> Iterator[_Columns]:
    """Batches of ``batch_size`` rows across buffers: a batch that one buffer leaves short is completed
    from the start of the next (copying only the rows carried); the last short batch comes unless
    ``drop_last``."""
    carry: _Columns | None = None
    for buffer in buffers:
        lo = 0
        if carry is not None:
            lo = min(batch_size - len(carry[0]), len(buffer))
            carry = tuple(np.concatenate([c, h]) for c, h in zip(carry, buffer.take(0, lo), strict=True))
            if len(carry[0]) < batch_size:
                continue
            batch, carry = carry, None
            yield batch
        for a in range(lo, len(buffer), batch_size):
            batch = buffer.take(a, min(a + batch_size, len(buffer)))
            if len(batch[0]) < batch_size:
                carry = batch
            else:
                yield batch
    if carry is not None and not drop_last:
        yield carry


class _Tokens:
    """The tokens ``skip : skip + tokens`` of rows read from a ``(tokens, features)`` capture, served as single
    tokens in the order ``order`` (token numbers, row after row; None: as read). Each batch is gathered into an
    array of its own: no copy of the whole buffer (fresh at every buffer, its first-touch page faults cost more
    than the mixing), and a batch the caller keeps is never overwritten."""

    def __init__(self, rows: np.ndarray, x: np.ndarray, positions: np.ndarray | int, skip: int, tokens: int,
                 order: np.ndarray | None) -> None:
        # positions: (rows, stored tokens) in the layer's sequence, or where the stored tokens begin in it
        self.rows, self.x, self.positions = rows, x, positions
        self.skip, self.tokens, self.order = skip, tokens, order

    @classmethod
    def mixed(cls, rows: np.ndarray, columns: _Columns, origin: int, skip: int, tokens: int,
              seed: list[int] | None) -> _Tokens:
        """Of rows read (their values, then a sampled capture's ``KEY.token_index``; else ``origin``: the first
        stored token's position in the layer's sequence), the tokens in a random order drawn from ``seed``
        (None: in order)."""
        order = None if seed is None else np.random.default_rng(seed).permutation(len(rows) * tokens)
        return cls(rows, columns[0], columns[1] if len(columns) > 1 else origin, skip, tokens, order)

    def __len__(self) -> int:
        return len(self.rows) * self.tokens

    @property
    def memory(self) -> np.ndarray:
        """The array its values were read into (which a later read may use again once this is served)."""
        return self.x if self.x.base is None else self.x.base

    def take(self, lo: int, hi: int) -> _Columns:
        """Places ``lo:hi`` of the order: ``(index, data)``; index holds each token's row and position."""
        r, t = np.divmod(np.arange(lo, hi) if self.order is None else self.order[lo:hi], self.tokens)
        t += self.skip
        position = t + self.positions if isinstance(self.positions, int) else self.positions[r, t]
        return np.stack([self.rows[r], position], axis=1), self.x[r, t]


class _IdIndex:
    """Rows of image ids. The first few lookups compare the ids column whole (vectorised: 0.04 s at 1M rows); once
    they would cost more than an index, the ids' hashes are sorted once (1 s at 1M rows, 16 bytes a row; a dict of
    1M ids took 2-4.5 s) and each id found by a binary search, the few that share a hash compared as strings."""

    SCANS = 16  # lookups by comparison before the index is built

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids
        self.scans = 0
        self.order: np.ndarray | None = None  # rows by hash
        self.hashes: np.ndarray | None = None  # sorted

    def find(self, ids: Sequence[str]) -> np.ndarray:
        """The row of each of ``ids`` (its first, when an id is there twice), -1 where absent."""
        if self.order is None and self.scans + len(ids) <= self.SCANS:
            self.scans += len(ids)
            return np.array([next(iter(np.flatnonzero(self.ids == i)), -1) for i in ids], dtype=np.int64)
        if self.order is None:
            hashes = np.fromiter((hash(i) for i in self.ids.tolist()), np.int64, len(self.ids))
            self.order = np.argsort(hashes, kind="stable")
            self.hashes = hashes[self.order]
        assert self.hashes is not None
        out = np.full(len(ids), -1, dtype=np.int64)
        for n, i in enumerate(ids):
            at = int(np.searchsorted(self.hashes, hash(i)))
            while at < len(self.hashes) and self.hashes[at] == hash(i):
                row = int(self.order[at])
                if str(self.ids[row]) == i:
                    out[n] = row
                    break
                at += 1
        return out


def _need_torch(what: str) -> None:
    try:
        import torch  # noqa: F401
    except ImportError as err:
        raise ImportError(f"{what} needs torch: pip install torch (reading a store needs only numpy and zarr)") from err


def _row_numbers(rows: Rows, n: int) -> np.ndarray:
    """The row numbers (0 to n-1, int64, in the order given) a selection means: all (None), a slice, a boolean
    mask of n, or integers (negative ones from the end)."""
    if rows is None:
        return np.arange(n)
    if isinstance(rows, slice):
        return np.arange(n)[rows]
    idx = np.asarray(rows)
    if idx.dtype == bool:
        if idx.shape != (n,):
            raise IndexError(f"a boolean row mask needs shape ({n},) for this store, not {idx.shape}")
        idx = np.flatnonzero(idx)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
        raise IndexError(f"rows must be a slice, a boolean mask or a 1-d list of integers, not {rows!r:.80}")
    idx = idx.astype(np.int64)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"row index out of range for a store of {n} rows")
    return np.where(idx < 0, idx + n, idx)


class ActivationStore:
    """A read-only view of an extractor store."""

    def __init__(self, group: zarr.Group, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.group = group
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.attrs: dict[str, Any] = root_attrs(group)
        self._cache: dict[str, np.ndarray] = {}
        self._arrays: dict[str, zarr.Array] = {}  # opened once: each opening reads the array's metadata
        self._row_of: _IdIndex | None = None  # image id -> row, made on the first call of row()
        self.last_run: Any = None  # extractor.run(): the RunSummary of the run that returned this store

    # ------------------------------------------------------------------ metadata
    @property
    def spec(self) -> dict[str, Any]:
        return self.attrs["spec"]

    @property
    def model(self) -> dict[str, Any]:
        return self.attrs["model"]

    @property
    def captures(self) -> dict[str, CaptureRecord]:
        """How each capture is stored (see :class:`~extractor.store.CaptureRecord`)."""
        return self.attrs["captures"]

    @property
    def keys(self) -> list[str]:
        """The capture keys: what dataloader, torch_dataset and probe use by default (not the extras)."""
        return list(self.captures)

    @property
    def extras(self) -> dict[str, dict[str, Any]]:
        """Per-row arrays of gradient jobs (``target``, ``target_score``, ``KEY.range``) -> dtype,
        shape, dims; ``{}`` for other jobs. _Read like captures: ``s[name]``, :meth:`numpy`,
        :meth:`batches`, :meth:`row`, :meth:`to_xarray`; they have no :attr:`stats`."""
        return dict(self.attrs.get("extras") or {})

    def _known(self) -> str:
        """The names ``s[name]`` accepts, for error messages."""
        extras = f"; per-row extras: {', '.join(self.extras)}" if self.extras else ""
        return f"captures: {', '.join(self.keys)}{extras}"

    @property
    def classes(self) -> list[str]:
        return list(self.attrs.get("classes") or [])

    @property
    def stats(self) -> dict[str, Any]:
        """Per capture statistics of the ok rows (README "Store layout").

        ``{}`` until the first run on the store ends or is interrupted (so for a store whose run was
        killed): ``extractor run --resume`` finishes such a store and writes them.
        """
        return dict(self.attrs.get("stats") or {})

    def __len__(self) -> int:
        return int(self.attrs["n_rows"])

    def __contains__(self, key: object) -> bool:
        return key in self.captures or key in self.extras

    def __repr__(self) -> str:
        extras = f", extras {list(self.extras)}" if self.extras else ""
        status = self.status
        counts = ", ".join(f"{int((status == v).sum())} {name}" for v, name in STATUS_NAMES.items())
        return (f"<ActivationStore {self.url}: {len(self)} rows ({counts}), {self.attrs.get('status')}, "
                f"captures {self.keys}{extras}>")

    # ------------------------------------------------------------------ per-row arrays
    def _row_array(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = np.asarray(get_array(self.group, name)[:])
        return self._cache[name]

    @property
    def ids(self) -> np.ndarray:
        return self._row_array("ids")

    @property
    def paths(self) -> np.ndarray:
        return self._row_array("paths")

    @property
    def digests(self) -> np.ndarray | None:
        """Per row, the xxh3-64 content digest of the image's bytes as the row read them (0: not read yet);
        None for stores made before digests. Equal digests: the same image bytes."""
        return np.asarray(get_array(self.group, "digest")[:]) if "digest" in self.group else None

    def locator(self, row: int) -> Any:
        """Where row's image is read from: its path, or (tar URL#member, byte offset, byte size)."""
        path = str(self.paths[row])
        if "byte_offset" in self.group:
            offset, size = get_array(self.group, "byte_offset")[row], get_array(self.group, "byte_size")[row]
            return (path, int(np.asarray(offset)), int(np.asarray(size)))
        return path

    @property
    def labels(self) -> np.ndarray:
        return self._row_array("labels")

    @property
    def status(self) -> np.ndarray:
        """0 pending, 1 ok, 2 failed (read fresh each time: a running job updates it)."""
        return np.asarray(get_array(self.group, "status")[:])

    @property
    def errors(self) -> np.ndarray:
        return np.asarray(get_array(self.group, "errors")[:])

    @property
    def done_shards(self) -> np.ndarray:
        return done_shards(self.group)

    def ok_rows(self) -> np.ndarray:
        return np.flatnonzero(self.status == OK)

    # ------------------------------------------------------------------ captures and extras
    def __getitem__(self, key: str) -> zarr.Array:
        """The lazy array of a capture or extra (numpy slicing reads only the chunks it touches)."""
        if key not in self._arrays:
            if key not in self:
                raise KeyError(f"{key!r} is not a capture or extra of {self.url}; {self._known()}")
            self._arrays[key] = get_array(self.group, key)
        return self._arrays[key]

    def _select_rows(self, rows: Rows, only_ok: bool, strict: bool = False) -> np.ndarray:
        """Store row numbers of ``rows``, in the order given (duplicates kept).

        ``only_ok`` leaves out rows that are not ok; with ``strict`` explicit rows must all be ok.
        """
        idx = _row_numbers(rows, len(self))
        if not only_ok:
            return idx
        status = self.status[idx]
        ok = status == OK
        if strict and rows is not None and not ok.all():
            bad = np.flatnonzero(~ok)
            names = ", ".join(f"{idx[i]} ({STATUS_NAMES.get(int(status[i]), status[i])})" for i in bad[:10])
            raise StoreError(
                f"{len(bad)} of the {len(idx)} rows asked of {self.url} are not ok: {names}"
                f"{' ...' if len(bad) > 10 else ''}; pass only_ok=False to get NaN in their place, or "
                "select among s.ok_rows() (s.errors[row] says why a row failed)"
            )
        return idx[ok]

    def numpy(self, key: str, rows: Rows = None, only_ok: bool = True) -> np.ndarray:
        """Rows of a capture or extra as one numpy array: item ``i`` is row ``rows[i]``.

        With ``rows=None`` all rows, of which only the ok ones by default. Explicit ``rows``
        (slice, mask, list) are never dropped: with ``only_ok`` (the default) a row that is not
        ok raises :class:`StoreError` naming it; ``only_ok=False`` gives such rows as stored:
        NaN (``target``: -1).
        """
        arr = self[key]
        return take_rows(arr, self._select_rows(rows, only_ok, strict=True))

    def batches(
        self,
        keys: str | Sequence[str],
        batch_size: int = 1024,
        shuffle: bool = True,
        seed: int = 0,
        rows: Rows = None,
        only_ok: bool = True,
        buffer_chunks: int = 8,
        prefetch: int = 2,
        part: Part | None = None,
    ) -> Iterator[tuple[np.ndarray, Any]]:
        """Yield ``(row_indices, data)``: every selected row once per call (one epoch).

        ``data`` is an array for one key, a dict of arrays for several; ``data[i]`` is row
        ``row_indices[i]``. ``rows`` may come in any order and repeat a row (it then comes as
        often as listed); rows that are not ok are left out unless ``only_ok=False``. Reads
        are whole chunks, prefetched on a background thread. With ``shuffle`` the chunks come
        in a random order and rows are mixed in a buffer of ``buffer_chunks`` chunks, so
        random order costs no random reads; the same ``seed`` gives the same order. Without
        it rows come in the order given, and a chunk is read once per run of consecutive
        selected rows inside it: rows grouped by chunk (e.g. ascending) read each chunk once.

        ``part=(k, n)`` yields the k-th of n disjoint parts of the epoch (its chunks split among n
        readers: DataLoader worker processes, distributed ranks): the n parts of one seed together
        hold every selected row once. :meth:`dataloader` with ``num_workers`` does this for you.
        """
        _check_sizes(batch_size, buffer_chunks)
        part = _check_part(part)
        arrays, step = self._arrays_of(keys, "batches")
        idx = self._select_rows(rows, only_ok)
        # the order is drawn anyway: a chunk's rows come together, so that a chunk is read once
        runs = _epoch_runs(idx, step, shuffle, seed, part)
        per = buffer_chunks if shuffle else 1

        def read(job: tuple[int, Sequence[np.ndarray]]) -> _Buffer:
            n, chunk_runs = job
            return _Buffer.read(arrays, chunk_runs, _mix_seed(seed, part, n) if shuffle else None)

        jobs = enumerate(runs[i : i + per] for i in range(0, len(runs), per))
        for index, *data in _rebatch(_prefetched(jobs, read, prefetch), batch_size):
            yield index, (data[0] if isinstance(keys, str) else dict(zip(arrays, data, strict=True)))

    def _arrays_of(self, keys: str | Sequence[str], what: str) -> tuple[dict[str, zarr.Array], int]:
        """The arrays of ``keys`` and the rows a read takes: their smallest chunk (a capture with bigger chunks,
        small rows under ``chunk_rows: auto``, is read several times per chunk), or of sharded arrays a run of
        chunks of about 32 MiB (:func:`read_rows`)."""
        names = [keys] if isinstance(keys, str) else list(keys)
        if not names:
            raise ValueError(f"{what} needs at least one capture key; {self._known()}")
        arrays = {k: self[k] for k in names}
        return arrays, min(read_rows(a) for a in arrays.values())

    def epoch_rows(self, keys: str | Sequence[str], shuffle: bool = True, seed: int = 0, rows: Rows = None,
                   only_ok: bool = True, part: Part | None = None) -> int:
        """How many rows one epoch of :meth:`batches` (or the part ``part`` of it) yields."""
        _, step = self._arrays_of(keys, "epoch_rows")
        runs = _epoch_runs(self._select_rows(rows, only_ok), step, shuffle, seed, _check_part(part))
        return sum(len(r) for r in runs)

    def token_batches(
        self,
        key: str,
        batch_size: int = 4096,
        shuffle: bool = True,
        seed: int = 0,
        rows: Rows = None,
        only_ok: bool = True,
        drop_prefix: bool | int = False,
        buffer_chunks: int = 8,
        prefetch: int = 1,
        drop_last: bool = False,
        part: Part | None = None,
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(index, data)`` whose rows are single tokens of a ``(tokens, features)`` capture:
        ``data`` is ``(B, features)``, ``index`` is ``(B, 2)``: each token's store row and its
        position in the layer's sequence, however the capture was stored (whole, without its prefix
        tokens, or a ``sample_tokens`` capture's, from ``KEY.token_index``): the same patch has the same
        position in every capture of a layer. Every (row, token) comes once per call (one epoch), for
        sparse-autoencoder training. With ``shuffle`` tokens are mixed across the images of a
        buffer of ``buffer_chunks`` chunks read whole in a random chunk order (as :meth:`batches`
        reads rows): the same ``seed`` gives the same order. ``drop_prefix`` leaves out each
        row's first tokens: ``True`` the model's prefix tokens (CLS, registers; the store's
        ``model.prefix_tokens``), unless the capture was stored without them already (its
        ``drop_prefix``): then nothing more; or a count, of the tokens as stored. ``drop_last``
        leaves out a last short batch. ``part=(k, n)``: the k-th of n disjoint parts of the epoch
        (see :meth:`batches`). ``prefetch``: buffers read ahead while one is served (each more holds a
        buffer's memory: one overlaps reading with serving)."""
        if not isinstance(key, str):
            raise TypeError(f"token_batches streams the tokens of one capture: give its key, not {key!r}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool):
            raise TypeError(f"batch_size must be an int, not {batch_size!r}")
        skip, tokens = self.token_span(key, drop_prefix)
        _check_sizes(batch_size, buffer_chunks)
        part = _check_part(part)
        arrays = [self[key]]
        if self.captures[key].get("sample_tokens"):  # each stored token's position in the layer's sequence
            arrays.append(self[f"{key}.token_index"])
        origin = int(self.captures[key].get("drop_prefix") or 0)  # stored without its prefix: patches from there
        # whole chunks in a random order, read a buffer of them at once; their tokens mixed in it
        runs = _epoch_runs(self._select_rows(rows, only_ok), read_rows(arrays[0]), shuffle, seed, part)
        per = buffer_chunks if shuffle else 1

        spare: list[np.ndarray] = []  # the memory of buffers served (their batches are copies), read into again

        def read(job: tuple[int, Sequence[np.ndarray]]) -> _Tokens:
            n, chunk_runs = job
            return _Tokens.mixed(*_read_runs(arrays, chunk_runs, spare), origin, skip, tokens,
                                 _mix_seed(seed, part, n) if shuffle else None)

        def served(buffers: Iterable[_Tokens]) -> Iterator[_Tokens]:
            for buffer in buffers:
                yield buffer  # asked for the next one: this one is served
                spare.append(buffer.memory)

        jobs = enumerate(runs[i : i + per] for i in range(0, len(runs), per))
        # one reading thread: a buffer is one zarr read that decodes its chunks concurrently already (and a buffer
        # more ahead is a fresh one: 0.65x of a sequential read with two ahead, against 0.97x with one)
        buffers = _prefetched(jobs, read, prefetch, threads=1)
        yield from cast(Iterator[_Read], _rebatch(served(buffers), batch_size, drop_last))

    def projection(self, key: str) -> np.ndarray:
        """The ``(features, project)`` matrix a ``project`` capture was made with (regenerated from its seed):
        ``stored = original @ s.projection(key)``; its pseudo-inverse maps stored features back approximately."""
        meta = self.captures.get(key)
        if meta is None or not meta.get("project"):
            raise StoreError(f"{key!r} is not a projected capture (project: D) of {self.url}; {self._known()}")
        return projection_matrix(int(meta["seed"]), int(meta["projected_from"]), int(meta["project"]),
                                 str(meta["projection"]))

    def token_span(self, key: str, drop_prefix: bool | int = False) -> tuple[int, int]:
        """Of each row of the token capture ``key`` as stored: how many first tokens ``drop_prefix``
        leaves out, and how many tokens remain (what :meth:`token_batches` yields per row)."""
        meta = self.captures.get(key)
        if meta is None or len(meta["shape"]) != 2:
            shape = meta["shape"] if meta else None
            raise StoreError(f"token_batches needs a capture of (tokens, features) rows; {key!r} is "
                             f"{'not a capture' if meta is None else f'{shape}'}; {self._known()}")
        skip = self._prefix(key, drop_prefix)
        tokens = int(meta["shape"][0]) - skip
        if tokens <= 0:
            raise StoreError(f"{key!r} has {meta['shape'][0]} tokens per row; dropping {skip} leaves none")
        return skip, tokens

    def _prefix(self, key: str, drop_prefix: bool | int) -> int:
        """Tokens to leave out of each stored row of ``key``: a count, or for ``True`` the model's
        prefix-token count, none when the capture is stored without its prefix tokens already."""
        if isinstance(drop_prefix, bool):
            if not drop_prefix or self.captures[key].get("drop_prefix"):
                return 0  # not asked, or left out when the store was written: its rows are patch tokens
            n = self.model.get("prefix_tokens")
            if not isinstance(n, int):
                raise StoreError("drop_prefix=True: the store does not record how many prefix tokens the model has "
                                 "(CLS, registers); pass their count, e.g. drop_prefix=1")
            return n
        if not isinstance(drop_prefix, int) or drop_prefix < 0:
            raise ValueError(f"drop_prefix must be True, False or a count >= 0, not {drop_prefix!r}")
        return int(drop_prefix)

    def row_numbers(self, ids: Sequence[str]) -> np.ndarray:
        """The store rows of the image ids ``ids`` (KeyError naming the first one not in the store)."""
        if self._row_of is None:
            self._row_of = _IdIndex(self.ids)
        rows = self._row_of.find(ids)
        missing = np.flatnonzero(rows < 0)
        if len(missing):
            raise KeyError(f"no row with id {ids[int(missing[0])]!r} in {self.url}")
        return rows

    def row(self, id: str) -> dict[str, Any]:
        """All captures and extras of the row with image id ``id`` (random access by id)."""
        n = int(self.row_numbers([id])[0])
        if "status" not in self._arrays:
            self._arrays["status"] = get_array(self.group, "status")
        status = STATUS_NAMES[int(np.asarray(self._arrays["status"][n]))]
        out: dict[str, Any] = {"row": n, "id": id, "label": int(self.labels[n]), "status": status}
        out.update({k: np.asarray(self[k][n]) for k in [*self.keys, *self.extras]})
        return out

    def torch_dataset(self, keys: str | Sequence[str] | None = None, only_ok: bool = True, cache_chunks: int = 2):
        """A map-style ``torch.utils.data.Dataset`` over the ok rows (torch is imported here only).

        Item ``i`` is a dict of tensors: one per key, plus ``row`` and ``label``. Rows are read a
        chunk at a time and the last ``cache_chunks`` chunks of each key are kept, so that items in
        row order read each chunk once; a DataLoader's batch of items is one read per chunk it touches
        (``__getitems__``). For streaming whole epochs, :meth:`dataloader` is faster still.
        """
        _need_torch("torch_dataset")
        from .torch_views import StoreDataset

        return StoreDataset(self, [keys] if isinstance(keys, str) else list(keys or self.keys), only_ok, cache_chunks)

    def dataloader(
        self, keys: str | Sequence[str] | None = None, batch_size: int = 1024, shuffle: bool = True, seed: int = 0,
        *, tokens: bool = False, dtype: Any = None, drop_last: bool = False, num_workers: int = 0,
        **options: Any,
    ):
        """A ``torch.utils.data.DataLoader`` of dict batches streamed by :meth:`batches` (chunk-aware
        shuffle): one tensor per key, plus ``row`` and ``label``. With ``tokens=True`` the rows are
        single tokens of one ``(tokens, features)`` capture (:meth:`token_batches`): the batch holds
        that key, ``row`` and ``token``. ``dtype`` (e.g. ``torch.float32``, ``torch.bfloat16``)
        converts the stored values; ``drop_last`` leaves out a last short batch (of each worker).

        ``num_workers=N`` reads in N worker processes, each a disjoint part of the epoch's chunks
        (every row, or token, once per epoch); ``pin_memory``, ``prefetch_factor``,
        ``persistent_workers``, ``timeout``, ``worker_init_fn`` and ``multiprocessing_context`` go to
        the DataLoader; the other options are those of :meth:`batches` or :meth:`token_batches`.
        Each iteration is one epoch; epoch ``e`` uses seed ``seed + e`` (a DataLoader of your own
        around ``.dataset`` calls ``loader.dataset.set_epoch(e)`` for that, as with
        ``DistributedSampler``).
        """
        import inspect

        _need_torch("dataloader")
        from .torch_views import LOADER_OPTIONS, batch_loader

        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
            raise ValueError(f"num_workers must be a count >= 0, not {num_workers!r}")
        loader = {k: options.pop(k) for k in list(options) if k in LOADER_OPTIONS}
        source = self.token_batches if tokens else self.batches
        allowed = set(inspect.signature(source).parameters) - {"key", "keys", "batch_size", "shuffle", "seed",
                                                                "drop_last"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(f"dataloader() got unknown option(s) {', '.join(unknown)}; it takes "
                            f"{', '.join(sorted(allowed))} (the options of {source.__name__}()), num_workers and "
                            f"the DataLoader's {', '.join(LOADER_OPTIONS)}")
        names = [keys] if isinstance(keys, str) else list(keys or self.keys)
        if tokens and len(names) != 1:
            raise ValueError(f"dataloader(tokens=True) streams the tokens of one capture, not {names}")
        for k in names:
            self[k]  # an unknown key fails here, at the call
        _check_part(options.get("part"))
        return batch_loader(self, names, batch_size, shuffle, seed, options, tokens=tokens, dtype=dtype,
                            drop_last=drop_last, num_workers=num_workers, loader=loader)

    def to_xarray(self, only_ok: bool = True, stack: Sequence[str] | None = None):
        """An ``xarray.Dataset`` (dask-backed, lazy): one DataArray per capture on dim ``row``, whose
        coordinate is the store's row number, with ``ids``, ``labels`` and ``status`` coordinates
        (the names ``xarray.open_zarr`` gives the store's own coordinate arrays).
        Extras of gradient jobs: per-row scalars (``target``, ``target_score``) are coordinates
        on ``row`` like ``labels``; ``KEY.range`` is a DataArray on (``row``, ``KEY.range.minmax``),
        labelled ``min``, ``max``. Rows that are not ok (failed: NaN; pending: not computed yet)
        are left out unless ``only_ok=False``, as in :meth:`numpy`.

        ``stack=[keys]``: one DataArray instead, with a ``layer`` dimension (labelled by key) before
        ``row``, of captures of one shape (a sweep across blocks); their feature dims lose the key
        (``channel``, ``token``, ``feature``...). Needs the ``analysis`` extra (xarray, dask)."""
        try:
            import xarray as xr
        except ImportError as err:
            raise ImportError("to_xarray needs xarray and dask: pip install 'extractor[analysis]'") from err
        kwargs: dict[str, Any] = {"consolidated": False}
        if self.storage_options:
            kwargs["storage_options"] = dict(self.storage_options)
        ds = xr.open_zarr(self.url, **kwargs)
        status = self.status
        extras = self.extras
        ds = ds[[*self.keys, *extras]].assign_coords(row=np.arange(len(status)),
                                                     ids=("row", np.asarray(self.ids, dtype=object)),
                                                     labels=("row", self.labels), status=("row", status))
        ds = ds.set_coords([k for k, m in extras.items() if not m["dims"]])  # per-row scalars: follow each capture
        ds = ds.assign_coords({m["dims"][0]: ["min", "max"] for k, m in extras.items() if k.endswith(".range")})
        ds.attrs = {"store": self.url, "model": self.model.get("name"), "format_version": self.attrs["format_version"]}
        if only_ok:
            ds = ds.isel(row=np.flatnonzero(status == OK))
        return ds if stack is None else self._stacked(ds, [stack] if isinstance(stack, str) else list(stack))

    def _stacked(self, ds: Any, keys: list[str]) -> Any:
        """Captures of one shape as one DataArray with a ``layer`` dimension (see :meth:`to_xarray`)."""
        import xarray as xr

        if not keys:
            raise ValueError("to_xarray(stack=...) needs at least one capture key")
        for k in keys:
            if k not in self.captures:
                raise KeyError(f"to_xarray(stack=...): {k!r} is not a capture of {self.url}; {self._known()}")
        shapes = {k: tuple(self.captures[k]["shape"]) for k in keys}
        dims = {k: tuple(d.removeprefix(f"{k}.") for d in self.captures[k]["dims"]) for k in keys}
        if len(set(shapes.values())) > 1 or len(set(dims.values())) > 1:
            raise ValueError("to_xarray(stack=...) needs captures of one shape and kind; got "
                             + ", ".join(f"{k} {list(shapes[k])} {list(dims[k])}" for k in keys))
        parts = [ds[k].rename({f"{k}.{d}": d for d in dims[k]}) for k in keys]
        return xr.concat(parts, dim=xr.DataArray(keys, dims="layer", name="layer")).rename("stack")

    @property
    def stale(self) -> float | None:
        """Seconds since the job writing this store last renewed its lease, when the store says
        "running" but that job is silent for longer than its lease timeout (it was killed:
        ``--resume`` finishes the store); None otherwise."""
        import time

        if self.attrs.get("status") != "running":
            return None
        held = read_lease(self.group)
        if not held or held.get("released"):
            return None
        age = time.time() - float(held.get("heartbeat", 0))
        return age if age > lease_timeout(held, _lease_timeout(self.attrs)) else None

    def verify(self, source_options: Mapping[str, Any] | None = None, threads: int = 16) -> dict[str, Any]:
        """Read every row's image again from where the store read it (its ``paths``; ``source_options``:
        fsspec options of the images' storage, by default those the store was opened with) and compare
        its content digest with the one stored when the row was computed. Returns ``{"checked": n,
        "changed": [(row, id), ...], "unreadable": [(row, id), ...]}``; rows never read are not checked."""
        if "digest" not in self.group:
            raise StoreError(f"{self.url} predates content digests (format without a digest array): nothing to "
                             "verify against")
        stored = np.asarray(get_array(self.group, "digest")[:])
        rows = np.flatnonzero(stored != 0)
        options = self.storage_options if source_options is None else source_options
        moved = current_places(self.group, options)  # a rewritten tar: its members read where they are now
        places = None if moved is None else (moved[0][rows], moved[1][rows])
        now = np.asarray(source_digests(self.group, rows, options, threads, places=places), dtype=np.uint64)
        ids = self.ids
        gone = rows[now == 0]
        changed = rows[(now != 0) & (now != stored[rows])]
        return {"checked": len(rows), "changed": [(int(r), str(ids[r])) for r in changed],
                "unreadable": [(int(r), str(ids[r])) for r in gone]}

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict[str, Any]:
        """What ``extractor inspect`` shows: captures, row counts, shards, bytes."""
        status = self.status
        counts = {STATUS_NAMES[v]: int((status == v).sum()) for v in STATUS_NAMES}
        captures = {}
        for key, meta in self.captures.items():
            arr = self[key]
            captures[key] = {
                "layer": meta["layer"],
                "what": meta["what"],
                "index": meta.get("index"),
                "reduce": meta["reduce"],
                "dtype": str(arr.dtype),
                "shape": list(arr.shape),
                "chunks": list(arr.chunks),
                "dims": ["row", *meta["dims"]],
                "bytes_stored": int(arr.nbytes_stored()),
            }
        return {
            "store": self.url,
            "format_version": self.attrs.get("format_version"),
            "status": self.attrs.get("status"),
            "silent_s": self.stale,  # "running", but its job died this long ago
            "created": self.attrs.get("created"),
            "updated": self.attrs.get("updated"),
            "model": self.model,
            "preprocess": self.attrs.get("preprocess"),  # with what the probe measured against the library (check)
            "rows": len(self),
            "row_status": counts,
            "shards": {"total": int(self.attrs["n_shards"]), "done": int(self.done_shards.sum())},
            "classes": self.classes,
            "captures": captures,
            "stats": self.stats,
            "bytes_on_disk": disk_usage(self.url),
        }
