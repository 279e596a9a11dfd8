"""Streaming a store's rows in batches: every selected row (:meth:`Batching.batches`) or every token of a token
capture (:meth:`Batching.token_batches`) once per epoch, read in whole chunks on background threads, shuffled
in a buffer of chunks (no random reads), split into disjoint parts for DataLoader workers or ranks. Needs only
numpy and zarr."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import zarr

from .._threads import prefetched
from ..errors import StoreError
from ..store import (
    CaptureRecord,
    patch_span,
    read_at_once,
    read_rows,
    take_rows,
)
from .epoch import Part, Stream, check_part, epoch_runs, mix_seed, rank_part, skip_jobs

Rows = slice | Sequence[int] | np.ndarray | None
_Columns = tuple[np.ndarray, ...]  # arrays of one length: a batch's row numbers (or token index), then its data
_T = TypeVar("_T")
_R = TypeVar("_R")


def _prefetched(items: Iterable[_T], fn: Callable[[_T], _R], depth: int, threads: int = 2) -> Iterator[_R]:
    """``fn(item)`` for each item, computed up to ``depth`` ahead on ``threads`` background threads
    (chunks decode in parallel: zstd and zarr release the GIL), in order."""
    return prefetched(items, fn, depth, threads, name="extractor-read")


DEFAULT_RUNS = 8  # the default mixing buffer holds what this many read runs hold: up to 256 MiB of a sharded array
SCATTERED_SLICES = 32 << 10  # pieces from anywhere whose chunks are at least this many bytes are read as slices:
# zarr's oindex decodes them one by one (measured on 1 MiB inner chunks: 14 MiB/s against 235 MiB/s for slices, as
# fast as a sequential read); smaller ones in one oindex call (4 KiB chunks: 8.2 against 2.5 MiB/s; even at 32 KiB)
SCATTERED_AT_ONCE = 32  # slices of pieces from anywhere read in one round of zarr's event loop (their requests
# overlap; 8 threads of one slice each funnelled into that one loop: sharded stores' shuffled epochs 0.36-0.41x of a
# sequential read, 32 at once 0.50-0.54x, make bench --reader-only: each inner chunk is still a read of its shard's
# index)


def _check_sizes(batch_size: int, buffer_chunks: int | None, seed: int) -> None:
    """Refuse a batch or buffer size that is not a whole number >= 1 (a buffer may be left at its default, None),
    or a seed that is not one >= 0."""
    sizes = (("batch_size", batch_size, 1), ("seed", seed, 0))
    for name, value, low in (*sizes, *((("buffer_chunks", buffer_chunks, 1),) if buffer_chunks is not None else ())):
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, not {value!r}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, not {value}")


def _read_runs(arrays: Sequence[zarr.Array], runs: Sequence[np.ndarray],
               spare: list[np.ndarray] | None = None, scattered: bool = False) -> tuple[np.ndarray, _Columns]:
    """Runs of rows (each inside one chunk) of each array: the rows read (ascending for several runs, else
    in the run's order) and each array's values of them. ``spare``: arrays no longer used, of the first
    array's rows; one with room is read into (a fresh one costs first-touch page faults). ``scattered``: runs
    of single small chunks from anywhere, read in one call (zarr fetches them concurrently: 4x faster here
    than a call per chunk; chunks of SCATTERED_SLICES or more are read as slices all the same)."""
    if len(runs) > 1:  # the runs of one buffer hold distinct chunks: in order of their first rows, all ascending
        runs = sorted(runs, key=lambda run: int(run[0]))
    rows = np.concatenate(runs)
    into = None
    if spare:
        room = spare.pop()
        if len(room) >= len(rows) and room.shape[1:] == arrays[0].shape[1:] and room.dtype == arrays[0].dtype:
            into = room[: len(rows)]
    taken = [_take(arr, runs, rows, scattered, into if i == 0 else None) for i, arr in enumerate(arrays)]
    return rows, tuple(taken)


def _take(array: zarr.Array, runs: Sequence[np.ndarray], rows: np.ndarray, scattered: bool,
          into: np.ndarray | None = None) -> np.ndarray:
    """Rows ``rows`` of ``array`` (its ``runs`` joined): stretches of chunks as slices; with ``scattered`` (runs of
    single chunks from anywhere) small chunks in one oindex call, others as slices, SCATTERED_AT_ONCE at a time."""
    if not scattered:
        return take_rows(array, rows, into)
    if int(array.chunks[0]) * _row_bytes(array) < SCATTERED_SLICES:
        return np.asarray(array.oindex[rows])
    out = into if into is not None else np.empty((len(rows), *array.shape[1:]), dtype=array.dtype)
    joined = _joined(runs)  # chunks next to each other: one read
    at = 0
    for run, got in zip(joined, _spans_at_once(array, joined), strict=True):
        out[at : at + len(run)] = got[run - int(run[0])] if int(run[-1]) + 1 - int(run[0]) != len(run) else got
        at += len(run)
    return out


def _spans_at_once(array: zarr.Array, runs: Sequence[np.ndarray]) -> Iterator[np.ndarray]:
    """Each run's span of rows (first to last), SCATTERED_AT_ONCE spans in one round of zarr's event loop."""
    for a in range(0, len(runs), SCATTERED_AT_ONCE):
        part = runs[a : a + SCATTERED_AT_ONCE]
        yield from read_at_once([(array, slice(int(run[0]), int(run[-1]) + 1)) for run in part])


def _joined(runs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``runs`` (in order) with each run that goes on where the one before it ends joined to it: the same rows in
    the same order, in fewer reads (a buffer that holds much of a store holds neighbouring chunks)."""
    out: list[list[np.ndarray]] = []
    for run in runs:
        if out and len(run) and int(out[-1][-1][-1]) + 1 == int(run[0]):
            out[-1].append(run)
        else:
            out.append([run])
    return [parts[0] if len(parts) == 1 else np.concatenate(parts) for parts in out]


def _row_bytes(array: zarr.Array) -> int:
    return int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize


@dataclass(frozen=True)
class _Buffer:
    """Rows read at once, served in the order ``perm`` (None: as read)."""

    index: np.ndarray  # (n,) store row numbers; for tokens (n, 2): row and position in its sequence
    data: _Columns  # per key, in the order asked: its (n, ...) values
    perm: np.ndarray | None

    @classmethod
    def read(cls, arrays: Mapping[str, zarr.Array], runs: Sequence[np.ndarray], seed: list[int] | None,
             scattered: bool = False) -> _Buffer:
        """Read runs of rows (each inside one chunk; on the prefetch thread); with ``seed``, draw the
        order of their rows."""
        rows, data = _read_runs(list(arrays.values()), runs, scattered=scattered)
        perm = None if seed is None else np.random.default_rng(seed).permutation(len(rows))
        return cls(rows, data, perm)

    def __len__(self) -> int:
        return len(self.index)

    def take(self, lo: int, hi: int) -> _Columns:
        """Places ``lo:hi`` of the buffer's order: index, then each key's values."""
        at = slice(lo, hi) if self.perm is None else self.perm[lo:hi]
        return (self.index[at], *(x[at] for x in self.data))

    def take_into(self, lo: int, hi: int, out: _Columns, at: int) -> None:
        """Places ``lo:hi`` of the buffer's order written into rows ``at ...`` of ``out`` (as :meth:`take` gives
        them), each row copied once."""
        for o, x in zip(out, (self.index, *self.data), strict=True):
            if self.perm is None:
                o[at:at + hi - lo] = x[lo:hi]
            else:  # ("clip": the places are valid; the default buffers ``out``)
                np.take(x, self.perm[lo:hi], axis=0, out=o[at:at + hi - lo], mode="clip")


def _rebatch(buffers: Iterable[_Buffer | _Tokens], batch_size: int, drop_last: bool = False,
             start: int = 0) -> Iterator[_Columns]:
    """Batches of ``batch_size`` rows across buffers: a batch that one buffer leaves short is gathered into
    arrays of its own and completed from the start of the next (each row copied once: gathered, then joined,
    the 16 KB rows of batches wider than a buffer were copied twice); the last short batch comes unless
    ``drop_last``. ``start``: places of the first buffer already served (a resumed stream)."""
    carry: _Columns | None = None  # a batch being completed: arrays of batch_size rows, ``filled`` of them so far
    filled = 0
    for buffer in buffers:
        lo, start = start, 0
        if carry is not None:
            lo = min(batch_size - filled, len(buffer))
            buffer.take_into(0, lo, carry, filled)
            filled += lo
            if filled < batch_size:
                continue
            batch, carry = carry, None
            yield batch
        for a in range(lo, len(buffer), batch_size):
            hi = min(a + batch_size, len(buffer))
            if hi - a == batch_size:
                yield buffer.take(a, hi)
                continue
            carry = tuple(np.empty((batch_size, *c.shape[1:]), c.dtype) for c in buffer.take(a, a))
            buffer.take_into(a, hi, carry, 0)
            filled = hi - a
    if carry is not None and not drop_last:
        yield tuple(c[:filled] for c in carry)


@dataclass(frozen=True)
class _TokenSpan:
    """What a token stream serves of each row of one token capture: ``tokens`` tokens from ``skip`` of those stored,
    and where they lie in the layer's own sequence (what two captures streamed together must share)."""

    skip: int
    tokens: int
    first: int  # the position in the layer's sequence of the first stored token (a prefix stored without: its count)
    sampled: tuple[Any, ...] | None  # a sampled capture's (sample_tokens, seed): its KEY.token_index says where

    @property
    def positions(self) -> tuple[Any, ...]:
        """What fixes the positions served: the span of the layer's sequence, or for a sampled capture its draw."""
        if self.sampled is None:
            return (self.first + self.skip, self.tokens)
        return (self.first, self.skip, self.tokens, self.sampled)

    def said(self) -> str:
        if self.sampled is None:
            start = self.first + self.skip
            return f"tokens {start} to {start + self.tokens - 1} of its layer's sequence"
        count, seed = self.sampled
        return (f"{self.tokens} of {count} tokens sampled per row with seed {seed}"
                + (f" (the first {self.skip} left out)" if self.skip else ""))


class _Tokens:
    """The tokens ``skips[i] : skips[i] + tokens`` of rows read from ``(tokens, features)`` captures (one skip per
    capture: the same positions from each), served as single tokens in the order ``order`` (token numbers, row after
    row; None: as read). Each batch is gathered into an array of its own: no copy of the whole buffer (fresh at every
    buffer, its first-touch page faults cost more than the mixing), and a batch the caller keeps is never
    overwritten."""

    def __init__(self, rows: np.ndarray, xs: _Columns, positions: np.ndarray | int, skips: Sequence[int],
                 tokens: int, order: np.ndarray | None) -> None:
        # positions: (rows, stored tokens) of the first capture in the layer's sequence, or where the first token
        # served lies in it
        self.rows, self.xs, self.positions = rows, xs, positions
        self.skips, self.tokens, self.order = tuple(skips), tokens, order

    @classmethod
    def mixed(cls, rows: np.ndarray, columns: _Columns, spans: Sequence[_TokenSpan], seed: list[int] | None) -> _Tokens:
        """Of rows read (the values of the ``spans``' captures, then a sampled capture's ``KEY.token_index``), the
        tokens in a random order drawn from ``seed`` (None: in order)."""
        keys, tokens = len(spans), spans[0].tokens
        order = None if seed is None else np.random.default_rng(seed).permutation(len(rows) * tokens)
        positions = columns[keys] if len(columns) > keys else spans[0].first + spans[0].skip
        return cls(rows, columns[:keys], positions, [span.skip for span in spans], tokens, order)

    def __len__(self) -> int:
        return len(self.rows) * self.tokens

    @property
    def memory(self) -> np.ndarray:
        """The array the first capture's values were read into (which a later read may use again once this is
        served)."""
        x = self.xs[0]
        return x if x.base is None else x.base

    def take(self, lo: int, hi: int) -> _Columns:
        """Places ``lo:hi`` of the order: ``(index, *data)``; index holds each token's row and position."""
        r, t = np.divmod(np.arange(lo, hi) if self.order is None else self.order[lo:hi], self.tokens)
        position = t + self.positions if isinstance(self.positions, int) else self.positions[r, t + self.skips[0]]
        return (np.stack([self.rows[r], position], axis=1),
                *(x[r, t + skip] for x, skip in zip(self.xs, self.skips, strict=True)))

    def take_into(self, lo: int, hi: int, out: _Columns, at: int) -> None:
        """Places ``lo:hi`` of the order written into rows ``at ...`` of ``out`` (a batch across buffers: one a
        buffer of tokens)."""
        for o, x in zip(out, self.take(lo, hi), strict=True):
            o[at:at + hi - lo] = x


def _normalized(x: np.ndarray, shift: np.ndarray | None, scale: float | None) -> np.ndarray:
    """``(x - shift) / scale`` in float32 (either left out when None)."""
    out = x.astype(np.float32)
    if shift is not None:
        out -= shift
    if scale is not None:
        out /= np.float32(scale)
    return out


def _unit(array: zarr.Array, spread: bool) -> int:
    """Rows a stream takes as one piece: a run of chunks read at once (:func:`read_rows`), or with ``spread`` one
    (inner) chunk."""
    return max(int(array.chunks[0]), 1) if spread else read_rows(array)


def _pieces(arrays: Iterable[zarr.Array], spread: bool, buffer_chunks: int | None) -> int:
    """The pieces a mixing buffer holds: ``buffer_chunks``, or by default (None) what DEFAULT_RUNS read runs hold, as
    pieces of one (inner) chunk from anywhere in the epoch with ``spread``: the same memory, many more places."""
    if buffer_chunks is not None:
        return buffer_chunks
    if not spread:
        return DEFAULT_RUNS
    arrays = list(arrays)
    return DEFAULT_RUNS * max(min(read_rows(a) for a in arrays) // min(_unit(a, True) for a in arrays), 1)


@dataclass(frozen=True)
class _Plan:
    """One epoch of a stream: its runs of rows (each inside one chunk) in the order read, cut into buffers of
    ``per`` runs; the seeds that mix each buffer."""

    runs: list[np.ndarray]
    per: int
    shuffle: bool
    seed_: int
    part: Part
    worker: Part

    @classmethod
    def of(cls, idx: np.ndarray, step: int, shuffle: bool, seed: int, part: Part | None, worker: Part | None,
           per: int) -> _Plan:
        part, worker = rank_part(part), check_part(worker, "worker")
        return cls(epoch_runs(idx, step, shuffle, seed, part, worker), per, shuffle, seed, part, worker)

    @property
    def rows(self) -> int:
        return sum(len(r) for r in self.runs)

    def seed(self, n: int) -> list[int] | None:
        """The seed that mixes buffer ``n`` (None: not shuffled)."""
        return mix_seed(self.seed_, self.part, self.worker, n) if self.shuffle else None

    def jobs(self, start: int, per_row: int) -> tuple[list[tuple[int, list[np.ndarray]]], int]:
        """The buffers left to read (numbered from the epoch's first) once ``start`` items are served, ``per_row``
        items a row, and the places of the first of them already served."""
        groups = [self.runs[i : i + self.per] for i in range(0, len(self.runs), self.per)]
        sizes = [per_row * sum(len(r) for r in g) for g in groups]
        return skip_jobs(list(enumerate(groups)), sizes, start)

    def fixed(self, buffer_chunks: int, per_row: int) -> dict[str, Any]:
        """What fixes the epoch's order (a saved state is of this epoch only): plain ints and lists."""
        return {"seed": self.seed_, "shuffle": self.shuffle, "part": list(self.part), "worker": list(self.worker),
                "buffer_chunks": buffer_chunks, "items": self.rows * per_row}


class Batching:
    """The streaming reads of a store (:class:`~.reader.ActivationStore`, which these methods are part of): every
    selected row, or every token of a token capture, once per epoch in batches, read in whole chunks."""

    if TYPE_CHECKING:  # what the store view gives them

        @property
        def captures(self) -> dict[str, CaptureRecord]: ...

        @property
        def model(self) -> dict[str, Any]: ...

        @property
        def stats(self) -> dict[str, Any]: ...

        def __getitem__(self, key: str) -> zarr.Array: ...

        def _known(self) -> str: ...

        def _select_rows(self, rows: Rows, only_ok: bool, strict: bool = False) -> np.ndarray: ...

        def _opened_again(self) -> Any: ...

    def batches(
        self,
        keys: str | Sequence[str],
        batch_size: int = 1024,
        shuffle: bool = True,
        seed: int = 0,
        rows: Rows = None,
        only_ok: bool = True,
        buffer_chunks: int | None = None,
        prefetch: int = 2,
        part: Part | None = None,
        *,
        worker: Part | None = None,
        spread: bool = True,
        follow: bool = False,
    ) -> Stream:
        """Yield ``(row_indices, data)``: every selected row once per call (one epoch).

        ``data`` is an array for one key, a dict of arrays for several; ``data[i]`` is row
        ``row_indices[i]``. ``rows`` may come in any order and repeat a row (it then comes as
        often as listed); rows that are not ok are left out unless ``only_ok=False``. Reads
        are whole chunks, prefetched on a background thread. With ``shuffle`` the chunks come
        in a random order and rows are mixed in a buffer of chunks, so random order costs no
        reads smaller than a chunk; the same ``seed`` gives the same order. Without
        it rows come in the order given, and a chunk is read once per run of consecutive
        selected rows inside it: rows grouped by chunk (e.g. ascending) read each chunk once.

        ``part=(k, n)`` yields the k-th of n disjoint parts of the epoch, for distributed ranks; by default
        ``(rank, world size)`` when ``torch.distributed`` is initialised. Every part has the same length, as
        ``DistributedSampler(drop_last=True)`` gives: the epoch's last ``rows % n`` rows (of its shuffled order:
        other rows each epoch) are dropped, so that ranks run the same number of batches and none waits at
        the end. ``worker=(w, W)``: the w-th of W DataLoader workers of the part (none dropped);
        :meth:`dataloader` with ``num_workers`` does this for you.

        Mixing: the epoch's (inner) chunks come in one random order over the whole epoch, and a buffer holds
        ``buffer_chunks`` of them (``spread``, the default), so a batch draws on that many places of the store.
        By default the buffer holds what 8 read runs hold (a run: the chunks of a sharded array read at once, up
        to about 32 MiB: so up to 256 MiB), as some hundreds of chunks from anywhere: rows stored in class order
        (an ImageFolder) give batches whose largest class share is about a global permutation's where the store
        has fewer classes than the buffer has chunks (``make bench --reader-only`` measures it, and the read
        rate, as fast as a sequential read for chunks of 256 KiB and more). ``spread=False`` takes whole read
        runs as pieces (8 by default: the same memory in 8 places; batches of few classes when sorted).
        Memory: :meth:`buffer_bytes` per buffer, ``prefetch + 1`` buffers.

        The stream has ``state_dict()`` / ``load_state_dict()`` (torchdata's ``Stateful``): a stream made
        with the same arguments and given a saved state before its first batch yields exactly the rows the
        saved one had not yet yielded.

        ``follow=True``: over a store that a job writes now, the rows of each shard as its commit lands (in rounds,
        each mixed as an epoch of its own rows), ending once the store is complete (:mod:`.follow`).
        """
        if follow:
            return self._following("batches", locals())
        _check_sizes(batch_size, buffer_chunks, seed)
        spread = spread and shuffle  # in order, a piece is a whole read run
        arrays, step = self._arrays_of(keys, "batches", spread)
        buffer_chunks = _pieces(arrays.values(), spread, buffer_chunks)
        # the order is drawn anyway: a chunk's rows come together, so that a chunk is read once
        plan = _Plan.of(self._select_rows(rows, only_ok), step, shuffle, seed, part, worker,
                        buffer_chunks if shuffle else 1)

        def read(job: tuple[int, Sequence[np.ndarray]]) -> _Buffer:
            n, chunk_runs = job
            return _Buffer.read(arrays, chunk_runs, plan.seed(n), spread)

        def make(start: int) -> Iterator[tuple[np.ndarray, Any]]:
            jobs, offset = plan.jobs(start, 1)
            for index, *data in _rebatch(_prefetched(jobs, read, prefetch), batch_size, start=offset):
                yield index, (data[0] if isinstance(keys, str) else dict(zip(arrays, data, strict=True)))

        return Stream(make, {**plan.fixed(buffer_chunks, 1), "spread": spread})

    def _arrays_of(self, keys: str | Sequence[str], what: str, spread: bool
                   ) -> tuple[dict[str, zarr.Array], int]:
        """The arrays of ``keys`` and the rows a read takes: their smallest chunk (a capture with bigger chunks,
        small rows under ``chunk_rows: auto``, is read several times per chunk), or of sharded arrays a run of
        chunks of about 32 MiB (:func:`read_rows`); with ``spread`` one (inner) chunk."""
        names = [keys] if isinstance(keys, str) else list(keys)
        if not names:
            raise ValueError(f"{what} needs at least one capture key; {self._known()}")
        arrays = {k: self[k] for k in names}
        return arrays, min(_unit(a, spread) for a in arrays.values())

    def epoch_rows(self, keys: str | Sequence[str], shuffle: bool = True, seed: int = 0, rows: Rows = None,
                   only_ok: bool = True, part: Part | None = None, *, worker: Part | None = None,
                   spread: bool = True) -> int:
        """How many rows one epoch of :meth:`batches` (or the part ``part`` of it, of its ``worker``) yields."""
        _, step = self._arrays_of(keys, "epoch_rows", spread and shuffle)
        return _Plan.of(self._select_rows(rows, only_ok), step, shuffle, seed, part, worker, 1).rows

    def token_batches(
        self,
        key: str | Sequence[str],
        batch_size: int = 4096,
        shuffle: bool = True,
        seed: int = 0,
        rows: Rows = None,
        only_ok: bool = True,
        drop_prefix: bool | int = False,
        buffer_chunks: int | None = None,
        prefetch: int = 1,
        drop_last: bool = False,
        part: Part | None = None,
        *,
        worker: Part | None = None,
        spread: bool = True,
        normalize: str | Sequence[str] | None = None,
        follow: bool = False,
    ) -> Stream:
        """Yield ``(index, data)`` whose rows are single tokens of a ``(tokens, features)`` capture:
        ``data`` is ``(B, features)``, ``index`` is ``(B, 2)``: each token's store row and its
        position in the layer's sequence, however the capture was stored (whole, without its prefix
        tokens, or a ``sample_tokens`` capture's, from ``KEY.token_index``): the same patch has the same
        position in every capture of a layer. Every (row, token) comes once per call (one epoch), for
        sparse-autoencoder training. With ``shuffle`` tokens are mixed across the images of a
        buffer of chunks read whole in a random chunk order over the whole epoch (as :meth:`batches`
        reads rows; see its mixing and memory): the same ``seed`` gives the same order. ``drop_prefix=True`` serves the
        patch tokens only, as the capture's record says where they lie (CLS and registers before them,
        YOLOS's detection tokens after them); nothing more from a capture stored without them (its
        ``drop_prefix``); a count leaves out that many first tokens of each row as stored. ``drop_last``
        leaves out a last short batch. ``part=(k, n)``, ``worker=(w, W)``: parts of equal length for
        ranks, and of DataLoader workers; ``spread``, ``buffer_chunks``: mixing (see :meth:`batches`); the
        stream resumes from its ``state_dict()`` as :meth:`batches` does. ``prefetch``: buffers read ahead
        while one is served (each more holds a buffer's memory: one overlaps reading with serving).

        ``normalize`` (from the store's statistics of ``key``, over every stored token; data then float32):
        ``"mean"`` subtracts the per-feature mean; ``"norm"`` divides by the mean token L2 norm
        (``stats[key]["mean_token_l2"]``): tokens of unit mean norm, as SAELens and saev scale; both
        (``("mean", "norm")``) divide the centred tokens by their root mean square norm (the square root of
        the summed per-feature variances, exact from the statistics).

        Several captures that serve the same positions (``[k1, k2, ...]``: the layers of a multi-layer SAE or a
        crosscoder; one stored whole and one without its prefix, with ``drop_prefix=True``): ``data`` is a dict
        ``{key: (B, features_key)}`` of the same (row, token) positions from each, ``index`` those positions; each
        capture normalised by its own statistics.

        ``follow=True``: over a store that a job writes now, as :meth:`batches` follows one."""
        if follow:
            return self._following("token_batches", locals())
        _check_sizes(batch_size, buffer_chunks, seed)
        keys = self._token_keys(key, drop_prefix)
        spans = [self._span(k, drop_prefix) for k in keys]  # the same positions of each capture
        skip, tokens = spans[0].skip, spans[0].tokens
        arrays = [self[k] for k in keys]
        if spans[0].sampled:  # each stored token's position in the layer's sequence
            arrays.append(self[f"{keys[0]}.token_index"])
        norms = [self._normalizer(k, normalize, (span.skip, span.tokens)) for k, span in zip(keys, spans, strict=True)]
        spread = spread and shuffle  # in order, a piece is a whole read run
        buffer_chunks = _pieces(arrays[:1], spread, buffer_chunks)
        # whole chunks in a random order, read a buffer of them at once; their tokens mixed in it
        plan = _Plan.of(self._select_rows(rows, only_ok), _unit(arrays[0], spread), shuffle, seed, part, worker,
                        buffer_chunks if shuffle else 1)

        spare: list[np.ndarray] = []  # the memory of buffers served (their batches are copies), read into again

        def read(job: tuple[int, Sequence[np.ndarray]]) -> _Tokens:
            n, chunk_runs = job
            return _Tokens.mixed(*_read_runs(arrays, chunk_runs, spare, spread), spans, plan.seed(n))

        def served(buffers: Iterable[_Tokens]) -> Iterator[_Tokens]:
            for buffer in buffers:
                yield buffer  # asked for the next one: this one is served
                spare.append(buffer.memory)

        def make(start: int) -> Iterator[tuple[np.ndarray, Any]]:
            jobs, offset = plan.jobs(start, tokens)
            # one reading thread: a buffer is one zarr read that decodes its chunks concurrently already (and a
            # buffer more ahead is a fresh one: 0.65x of a sequential read with two ahead, against 0.97x with one)
            buffers = _prefetched(jobs, read, prefetch, threads=1)
            for index, *xs in _rebatch(served(buffers), batch_size, drop_last, offset):
                xs = [x if shift is None and scale is None else _normalized(x, shift, scale)
                      for x, (shift, scale) in zip(xs, norms, strict=True)]
                yield index, (xs[0] if isinstance(key, str) else dict(zip(keys, xs, strict=True)))

        return Stream(make, {**plan.fixed(buffer_chunks, tokens), "drop_prefix": skip, "spread": spread})

    def _following(self, method: str, args: dict[str, Any]) -> Any:
        """The stream of ``method`` with ``args`` (its own locals) over the store as it is written."""
        from .follow import Following

        kwargs = {k: v for k, v in args.items() if k not in ("self", "follow")}
        return Following(self, method, kwargs, self._opened_again)

    def normalization(self, key: str, normalize: str | Sequence[str] | None,
                      drop_prefix: bool | int = False) -> tuple[np.ndarray | None, float | None]:
        """What :meth:`token_batches` with ``normalize`` and ``drop_prefix`` subtracts from each token of ``key``
        (per feature, or None) and divides it by (or None): from the store's statistics of every stored token, or
        of the patches alone where the tokens besides them are left out (the feature index's ``normalize`` reads
        the same)."""
        return self._normalizer(key, normalize, self.token_span(key, drop_prefix))

    def _normalizer(self, key: str, normalize: str | Sequence[str] | None,
                    served: tuple[int, int]) -> tuple[np.ndarray | None, float | None]:
        """What ``normalize`` subtracts (per feature) and divides by, from the statistics of ``key``'s tokens as a
        stream that serves ``served`` (first, count) of each stored row serves them."""
        asked = {normalize} if isinstance(normalize, str) else set(normalize or ())
        if not asked:
            return None, None
        if not asked <= {"mean", "norm"}:
            raise ValueError(f"normalize takes 'mean', 'norm' or both, not {normalize!r}")
        stats = self._token_stats(key, normalize, served)
        if not stats or (asked == {"norm"} and stats.get("mean_token_l2") is None):
            raise StoreError(f"normalize={normalize!r} needs the store's per-token statistics of {key!r}, which it "
                             "does not have (a store of a run that did not end, or made before per-token norms): "
                             "run 'extractor run --resume' on it, or leave normalize out")
        mean = np.asarray(stats["mean"], np.float32)
        if asked == {"norm"}:
            return None, float(stats["mean_token_l2"])
        if asked == {"mean"}:
            return mean, None
        return mean, float(np.sqrt(np.sum(np.square(np.asarray(stats["std"], np.float64)))))

    def _token_stats(self, key: str, normalize: Any, served: tuple[int, int]) -> dict[str, Any] | None:
        """The statistics of the tokens a stream serves of ``key`` (``served``: first, count of each stored row): of
        every stored token, or of the patches alone (the tokens besides them left out: :func:`patch_span`); any
        other cut is refused (the store has no statistics of it)."""
        stats = self.stats.get(key)
        stored = int(self.captures[key]["shape"][0])
        if served == (0, stored) or not stats:
            return stats
        span = patch_span(self.captures[key], self.model.get("prefix_tokens"))
        if served != span:
            held = f"of its patches (tokens {span[0]} to {sum(span) - 1})" if span and span != (0, stored) else \
                "of no cut of them"
            raise StoreError(f"normalize={normalize!r} over tokens {served[0]} to {sum(served) - 1} of each row of "
                             f"{key!r}: the store's statistics are of every stored token, or {held}; leave out the "
                             "tokens besides the patches (drop_prefix=True) or none, or leave normalize out")
        if "patches" not in stats:
            raise StoreError(f"normalize={normalize!r} with the tokens besides the patches of {key!r} left out needs "
                             "the store's statistics of its patches alone, which it does not have (made before they "
                             "were kept): make the store again, or normalise over every token (drop_prefix=False)")
        return dict(stats["patches"])

    def buffer_bytes(self, key: str, buffer_chunks: int | None = None, spread: bool = True) -> int:
        """Bytes of one mixing buffer of :meth:`batches` / :meth:`token_batches` over ``key`` (at most: the last
        piece of a part may be shorter) with these options (their defaults: the streams'); a stream holds
        ``prefetch + 1`` of them."""
        array = self[key]
        return _pieces([array], spread, buffer_chunks) * _unit(array, spread) * _row_bytes(array)

    def _token_keys(self, key: str | Sequence[str], drop_prefix: bool | int) -> list[str]:
        """The token captures ``key`` names, checked to serve the same positions of their layers' sequences (each
        as it was stored: whole, without its prefix, or sampled)."""
        keys = [key] if isinstance(key, str) else list(key)
        if not keys or not all(isinstance(k, str) for k in keys):
            raise TypeError(f"token_batches takes a capture key or a list of them, not {key!r}")
        spans = {k: self._span(k, drop_prefix) for k in keys}
        if len({span.positions for span in spans.values()}) > 1:
            raise StoreError(f"token_batches of several captures serves the same tokens of each; with drop_prefix="
                             f"{drop_prefix!r} they differ ({'; '.join(f'{k}: {s.said()}' for k, s in spans.items())})"
                             ": stream them one by one, or give a drop_prefix that leaves the same tokens of each")
        return keys

    def _span(self, key: str, drop_prefix: bool | int) -> _TokenSpan:
        """What a token stream with ``drop_prefix`` serves of each row of ``key`` (:class:`_TokenSpan`)."""
        skip, tokens = self.token_span(key, drop_prefix)
        meta = self.captures[key]
        sampled = (meta.get("sample_tokens"), meta.get("seed")) if meta.get("sample_tokens") else None
        return _TokenSpan(skip, tokens, int(meta.get("drop_prefix") or 0), sampled)

    def token_span(self, key: str, drop_prefix: bool | int = False) -> tuple[int, int]:
        """Of each row of the token capture ``key`` as stored: how many first tokens ``drop_prefix``
        leaves out, and how many tokens remain (what :meth:`token_batches` yields per row): for ``True``, the
        capture's patch tokens, as its record says where they lie (tokens after them, YOLOS's detection
        tokens, left out too)."""
        meta = self.captures.get(key)
        if meta is None or len(meta["shape"]) != 2:
            shape = meta["shape"] if meta else None
            raise StoreError(f"token_batches needs a capture of (tokens, features) rows; {key!r} is "
                             f"{'not a capture' if meta is None else f'{shape}'}; {self._known()}")
        stored = int(meta["shape"][0])
        if isinstance(drop_prefix, bool):
            skip, tokens = self._patches(key) if drop_prefix else (0, stored)
        elif isinstance(drop_prefix, int) and drop_prefix >= 0:
            skip, tokens = int(drop_prefix), stored - int(drop_prefix)
        else:
            raise ValueError(f"drop_prefix must be True, False or a count >= 0, not {drop_prefix!r}")
        if tokens <= 0:
            raise StoreError(f"{key!r} has {stored} tokens per row; dropping {skip} leaves none")
        return skip, tokens

    def _patches(self, key: str) -> tuple[int, int]:
        """The stored tokens of each row of ``key`` that are patches, ``(first, count)``, as its record says."""
        span = patch_span(self.captures[key], self.model.get("prefix_tokens"))
        if span is not None:
            return span
        if "tokens" in self.captures[key]:
            raise StoreError(f"drop_prefix=True: which of {key!r}'s tokens are patches is not known (when the store "
                             "was written, its layer's tokens besides the patches could not be placed); pass the "
                             "count of tokens to leave out of each row, e.g. drop_prefix=1")
        raise StoreError("drop_prefix=True: the store does not record how many prefix tokens the model has "
                         "(CLS, registers); pass their count, e.g. drop_prefix=1")
