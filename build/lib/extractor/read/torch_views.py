"""Torch views of a store (imported only when asked for)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ..store import is_bfloat16
from .epoch import rank_part

# DataLoader options dataloader() passes on (its own: dataset, batch_size=None, shuffle, sampler, collate)
LOADER_OPTIONS = ("pin_memory", "prefetch_factor", "persistent_workers", "timeout", "worker_init_fn",
                  "multiprocessing_context", "pin_memory_device", "in_order")


class StoreDataset(Dataset):
    """Map-style: item i is the i-th selected row, as a dict of tensors plus ``row`` and ``label``.

    Rows are read a whole chunk at a time, and each key keeps its last ``cache_chunks`` chunks
    (per process: every DataLoader worker has its own), so items in row order read each chunk
    once; ``__getitems__`` (a DataLoader's batch) reads each chunk its rows touch once."""

    def __init__(self, store: Any, keys: list[str], only_ok: bool = True, cache_chunks: int = 2) -> None:
        if not isinstance(cache_chunks, int) or cache_chunks < 1:
            raise ValueError(f"cache_chunks must be >= 1, not {cache_chunks!r}")
        self.store, self.keys, self.cache_chunks = store, keys, cache_chunks
        self.rows = store.ok_rows() if only_ok else np.arange(len(store))
        self.labels = store.labels
        self._chunks: dict[str, OrderedDict[int, np.ndarray]] = {k: OrderedDict() for k in keys}

    def __len__(self) -> int:
        return len(self.rows)

    def _chunk(self, key: str, c: int) -> np.ndarray:
        """Chunk ``c`` of ``key``, from the cache or read whole."""
        cache = self._chunks[key]
        if c in cache:
            cache.move_to_end(c)
            return cache[c]
        arr = self.store[key]
        step = int(arr.chunks[0])
        data = np.asarray(arr[c * step : (c + 1) * step])
        cache[c] = data
        while len(cache) > self.cache_chunks:
            cache.popitem(last=False)
        return data

    def _values(self, key: str, rows: np.ndarray) -> np.ndarray:
        step = int(self.store[key].chunks[0])
        out = np.empty((len(rows), *self.store[key].shape[1:]), dtype=self.store[key].dtype)
        chunk_of = rows // step
        for c in dict.fromkeys(chunk_of.tolist()):  # each chunk once, in the order first asked
            at = np.flatnonzero(chunk_of == c)
            out[at] = self._chunk(key, c)[rows[at] - c * step]
        return out

    def __getitems__(self, items: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        rows = self.rows[np.asarray(items, dtype=np.int64)]
        values = {k: tensor(self._values(k, rows)) for k in self.keys}
        return [{**{k: v[i] for k, v in values.items()}, "row": torch.tensor(int(r)),
                 "label": torch.tensor(int(self.labels[r]))} for i, r in enumerate(rows)]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([i])[0]


class _Batches(IterableDataset):
    """One epoch of :meth:`~extractor.reader.ActivationStore.batches` (or ``token_batches``) per
    iteration. In a DataLoader worker process, the worker's part of the epoch only: the workers
    split the epoch's rows, so every row (token) comes once per epoch whatever their number."""

    def __init__(self, store: Any, keys: list[str], batch_size: int, shuffle: bool, seed: int,
                 kwargs: dict[str, Any], tokens: bool = False, dtype: Any = None, drop_last: bool = False,
                 workers: int = 0) -> None:
        self.store, self.keys, self.batch_size, self.shuffle, self.seed = store, keys, batch_size, shuffle, seed
        self.kwargs, self.tokens, self.dtype, self.drop_last = kwargs, tokens, dtype, drop_last
        self.workers = workers  # the DataLoader's num_workers, when dataloader() made it: for __len__
        self.epoch = 0
        self.resume: dict[int, int] = {}  # worker -> items its part of the next epoch leaves out (served before)

    def set_epoch(self, epoch: int) -> None:
        """Use ``seed + epoch`` for the next iteration (a DataLoader of your own with worker processes
        iterates copies of this dataset: call it before each epoch, as with ``DistributedSampler``)."""
        self.epoch = epoch

    def items(self, worker: int, workers: int, epoch: int) -> int:
        """Rows (tokens) the part of ``worker`` of ``workers`` yields in epoch ``epoch``."""
        options = {k: self.kwargs[k] for k in ("rows", "only_ok", "part", "spread") if k in self.kwargs}
        per_row = 1
        if self.tokens:
            per_row = self.store.token_span(self.keys[0], self.kwargs.get("drop_prefix", False))[1]
        return per_row * self.store.epoch_rows(self.keys, shuffle=self.shuffle, seed=self.seed + epoch,
                                               worker=(worker, max(workers, 1)), **options)

    def worker_items(self, epoch: int) -> list[int]:
        """Rows (tokens) each worker gives in epoch ``epoch``."""
        return [self.items(w, self.workers, epoch) for w in range(max(self.workers, 1))]

    def batch_counts(self, items: Sequence[int]) -> list[int]:
        """Batches of ``items`` rows (tokens) each."""
        b = self.batch_size
        return [n // b if self.drop_last else -(-n // b) for n in items]

    def __len__(self) -> int:
        """Batches per epoch (``len(loader)``, for progress bars and schedules), summed over the workers."""
        return sum(self.batch_counts(self.worker_items(self.epoch)))

    def _tensor(self, v: np.ndarray) -> torch.Tensor:
        t = tensor(np.ascontiguousarray(v))
        return t if self.dtype is None else t.to(self.dtype)

    def _stream(self, seed: int, worker: tuple[int, int]) -> Any:
        if self.tokens:
            return self.store.token_batches(self.keys, self.batch_size, shuffle=self.shuffle, seed=seed,
                                            drop_last=self.drop_last, worker=worker, **self.kwargs)
        return self.store.batches(self.keys, self.batch_size, shuffle=self.shuffle, seed=seed, worker=worker,
                                  **self.kwargs)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        seed = self.seed + self.epoch
        self.epoch += 1
        info = get_worker_info()
        worker = (info.id, info.num_workers) if info is not None else (0, 1)
        stream = self._stream(seed, worker)
        start, self.resume = self.resume.get(worker[0], 0), {}
        if start:
            stream.load_state_dict({**stream.state_dict(), "served": start})
        if self.tokens:
            for index, xs in stream:
                yield {**{k: self._tensor(x) for k, x in xs.items()}, "row": torch.from_numpy(index[:, 0].copy()),
                       "token": torch.from_numpy(index[:, 1].copy())}
            return
        labels = self.store.labels
        for rows, data in stream:
            if self.drop_last and len(rows) < self.batch_size:
                return
            out = {k: self._tensor(v) for k, v in data.items()}
            out["row"] = torch.from_numpy(rows)
            out["label"] = torch.from_numpy(labels[rows])
            yield out


def delivered(per_worker: Sequence[int], batches: int) -> list[int]:
    """Of ``batches`` a DataLoader yielded (in order: from its workers in turn, 0, 1, ..., a worker with none
    left skipped), how many came from each worker, of ``per_worker`` batches each."""
    lo, hi = 0, max(per_worker, default=0)
    while lo < hi:  # the most whole rounds r that sum(min(n, r)) <= batches allows
        r = (lo + hi + 1) // 2
        lo, hi = (r, hi) if sum(min(n, r) for n in per_worker) <= batches else (lo, r - 1)
    got = [min(n, lo) for n in per_worker]
    left = batches - sum(got)
    for w, n in enumerate(per_worker):
        if left and n > lo:
            got[w], left = got[w] + 1, left - 1
    return got


class _Loader(DataLoader):
    """A DataLoader whose epochs each draw their own order also with worker processes: they iterate
    copies of the dataset made (or resumed) for each epoch, so the epoch count is kept here too. It knows
    its place in an epoch: :meth:`state_dict` and :meth:`load_state_dict` (torchdata ``StatefulDataLoader``'s
    protocol) resume an interrupted epoch with exactly the rows (tokens) it had not yet given."""

    _place: dict[str, int] | None = None  # {"epoch", "batches"}: the epoch under way and the batches it gave

    def __iter__(self) -> Any:
        dataset: Any = self.dataset
        epoch, done = dataset.epoch, (self._place or {}).get("batches", 0) if self._resuming else 0
        self._resuming = False
        it = super().__iter__()
        if self.num_workers > 0:
            dataset.epoch += 1  # what each worker's copy did for this epoch
            dataset.resume = {}  # the workers took it with their copies
        self._place = {"epoch": epoch, "batches": done}
        return _Counted(it, self._place)

    _resuming = False

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: the epoch under way and how many batches it has given (plain ints)."""
        dataset: Any = self.dataset
        place = self._place or {"epoch": dataset.epoch, "batches": 0}
        return {**place, "seed": dataset.seed, "batch_size": dataset.batch_size, "num_workers": self.num_workers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration finish the epoch ``state`` was saved in: each worker leaves out what it gave."""
        dataset: Any = self.dataset
        mine = {"seed": dataset.seed, "batch_size": dataset.batch_size, "num_workers": self.num_workers}
        differ = [f"{k} {state.get(k)!r} (now {v!r})" for k, v in mine.items() if state.get(k) != v]
        if differ:
            raise ValueError(f"this loader state is of another loader: {', '.join(differ)}; make the loader as "
                             "it was when the state was saved")
        if self.persistent_workers:
            raise ValueError("load_state_dict needs workers started for the resumed epoch: persistent_workers=False")
        epoch, batches = int(state["epoch"]), int(state["batches"])
        dataset.epoch = epoch
        items = dataset.worker_items(epoch)
        got = delivered(dataset.batch_counts(items), batches)
        dataset.resume = {w: min(n * dataset.batch_size, items[w]) for w, n in enumerate(got)}
        self._place, self._resuming = {"epoch": epoch, "batches": batches}, True


class _Counted:
    """A DataLoader's iterator that counts the batches it gives into ``place``."""

    def __init__(self, it: Any, place: dict[str, int]) -> None:
        self.it, self.place = it, place

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.it)
        except StopIteration:
            self.place.update(epoch=self.place["epoch"] + 1, batches=0)  # a state saved now starts the next epoch
            raise
        self.place["batches"] += 1
        return batch

    def __len__(self) -> int:
        return len(self.it)


def tensor(a: np.ndarray) -> torch.Tensor:
    """A numpy array as a tensor sharing its memory; bfloat16 (ml_dtypes') as torch.bfloat16."""
    if is_bfloat16(a.dtype):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


_FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def float_dtype(dtype: Any) -> torch.dtype | None:
    """A floating dtype (``torch.float32`` or its name), or None: activations are never made integers."""
    if dtype is None:
        return None
    found = _FLOATS.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise TypeError(f"dtype must be a floating torch dtype (torch.float32, torch.bfloat16, torch.float16 or "
                        f"their names), not {dtype!r}: activations would be truncated")
    return found


def batch_loader(store: Any, keys: list[str], batch_size: int, shuffle: bool, seed: int, kwargs: dict[str, Any],
                 tokens: bool = False, dtype: Any = None, drop_last: bool = False, num_workers: int = 0,
                 loader: dict[str, Any] | None = None) -> DataLoader:
    kwargs = {**kwargs, "part": rank_part(kwargs.get("part"))}  # this process's rank, at the call
    dataset = _Batches(store, keys, batch_size, shuffle, seed, kwargs, tokens, float_dtype(dtype), drop_last,
                       num_workers)
    return _Loader(dataset, batch_size=None, num_workers=num_workers, **(loader or {}))
