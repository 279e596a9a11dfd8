"""The plan of one streamed epoch: which runs of rows (each inside one chunk) a reader takes, in which order, and
its part of them (a rank's, a DataLoader worker's); and the stream that serves it, with a position that can be
saved and resumed. Needs only numpy."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

Part = tuple[int, int]  # (k, n): the k-th of n disjoint parts of an epoch (ranks; DataLoader workers of a rank)


def check_part(part: Part | None, what: str = "part") -> Part:
    """``part`` as (k, n): whole numbers (numpy's too) with 0 <= k < n; None is the whole epoch, (0, 1)."""
    if part is None:
        return (0, 1)
    try:
        k, n = part
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be (k, n), the k-th of n parts of an epoch, not {part!r}") from None
    if not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in (k, n)):
        raise TypeError(f"{what} (k, n) takes whole numbers (the k-th of n parts), not {part!r}")
    if not 0 <= k < n:
        raise ValueError(f"{what} (k, n) needs 0 <= k < n, not {part!r}: "
                         + (f"part {k} of {n} does not exist (the parts are 0 to {n - 1})" if n > 0 else
                            "an epoch is split in at least one part"))
    return int(k), int(n)


def rank_part(part: Part | None) -> Part:
    """The part of the epoch a rank reads: ``part`` when given, else (rank, world size) when torch.distributed is
    initialised in this process (looked up, never imported: the reader needs no torch), else the whole epoch."""
    if part is not None:
        return check_part(part)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return (0, 1)


def chunk_runs(idx: np.ndarray, step: int) -> list[np.ndarray]:
    """``idx`` cut into runs of consecutive entries inside one chunk of ``step`` rows."""
    return np.split(idx, np.flatnonzero(np.diff(idx // step)) + 1) if idx.size else []


def shuffled_chunks(idx: np.ndarray, step: int, seed: int) -> list[np.ndarray]:
    """The rows of ``idx`` grouped by chunk (ascending inside each), the chunks in a random order drawn
    from ``seed``: random order that costs no random reads."""
    runs = chunk_runs(np.sort(idx, kind="stable"), step)  # sorting takes linear time when already ascending
    return [runs[i] for i in np.random.default_rng(seed).permutation(len(runs))]


def _share(runs: list[np.ndarray], part: Part, equal: bool) -> list[np.ndarray]:
    """The k-th of n consecutive stretches of the rows of ``runs`` (a run cut at a stretch's edge is read by both
    sides: one chunk more per part). ``equal``: every part the same length, the last ``total % n`` rows of the
    epoch left out (``DistributedSampler(drop_last=True)``); else lengths differ by one at most, none left out."""
    k, n = part
    if n == 1:
        return runs
    ends = np.cumsum([len(r) for r in runs], dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if equal and 0 < total < n:
        raise ValueError(f"part {part}: the epoch's {total} rows make no {n} parts of equal length (one row each at "
                         f"least): every part would be empty, an epoch of nothing on every rank. Split it in at "
                         f"most {total} parts (ranks), or select more rows")
    lo, hi = (k * (total // n), (k + 1) * (total // n)) if equal else (k * total // n, (k + 1) * total // n)
    if hi <= lo:
        return []
    flat = np.concatenate(runs)[lo:hi]
    return np.split(flat, ends[(ends > lo) & (ends < hi)] - lo)


def epoch_runs(idx: np.ndarray, step: int, shuffle: bool, seed: int, part: Part, worker: Part) -> list[np.ndarray]:
    """The runs of rows (each inside one chunk of ``step`` rows) one epoch reads, in order: the chunks in a random
    order drawn from ``seed`` with ``shuffle``, else in the order given. ``part`` (a rank's) takes an equal
    stretch of them (the remainder left out: equal batch counts on every rank); ``worker`` (a DataLoader worker
    of the part) a stretch of the part's rows, none left out."""
    runs = shuffled_chunks(idx, step, seed) if shuffle else chunk_runs(idx, step)
    return _share(_share(runs, part, equal=True), worker, equal=False)


def mix_seed(seed: int, part: Part, worker: Part, n: int) -> list[int]:
    """The seed of the n-th buffer of a part (the whole epoch keeps the seeds it always had)."""
    whole = part == (0, 1) and worker == (0, 1)
    return [seed, n] if whole else [seed, *part, *worker, n]


def skip_jobs(jobs: list[tuple[int, Any]], sizes: list[int], start: int) -> tuple[list[tuple[int, Any]], int]:
    """Of an epoch's buffers (``jobs``, of ``sizes`` items each), those not wholly before item ``start``, and where
    in the first of them ``start`` falls: a resumed stream reads none of what was served."""
    ends = np.cumsum(sizes, dtype=np.int64)
    first = int(np.searchsorted(ends, start, side="right"))
    before = int(ends[first - 1]) if first else 0
    return jobs[first:], start - before


class Stream:
    """An epoch's batches as an iterator that knows its position: :meth:`state_dict` says how many items (rows,
    tokens) it has yielded; a stream made with the same arguments, given that state by :meth:`load_state_dict`
    before its first batch, yields exactly the items the first had not (torchdata's ``Stateful`` protocol)."""

    def __init__(self, make: Callable[[int], Iterator[Any]], fixed: Mapping[str, Any]) -> None:
        self._make = make  # start (items to leave out) -> the batches from there
        self._fixed = dict(fixed)  # what fixes the epoch's order: a state is refused for another one
        self._served = 0
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = self._make(self._served)
        batch = next(self._it)
        self._served += len(batch[0])
        return batch

    def close(self) -> None:
        """Stop reading ahead (as a generator's ``close``)."""
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def state_dict(self) -> dict[str, Any]:
        """``{"served": items yielded, ...what fixes the order}``: plain ints and lists (JSON, torch.save)."""
        return {**self._fixed, "served": self._served}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (of :meth:`state_dict`): the next batch starts at the first item not served."""
        if not isinstance(state, Mapping):
            raise TypeError(f"load_state_dict() takes the dict that state_dict() returned, not a "
                            f"{type(state).__name__} ({state!r:.60})")
        if self._it is not None:
            raise RuntimeError("load_state_dict() must come before the stream's first batch; make a new stream")
        differ = [f"{k} {state.get(k)!r} (now {v!r})" for k, v in self._fixed.items() if state.get(k) != v]
        if differ:
            raise ValueError(f"this state is of another epoch: {', '.join(differ)}; make the stream with the "
                             "arguments it was saved with")
        served = state.get("served")
        if not isinstance(served, int) or not 0 <= served <= self._fixed["items"]:
            raise ValueError(f"state['served'] must be a count from 0 to {self._fixed['items']}, not {served!r}")
        self._served = served
