"""Torch views of a store (imported only when asked for)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset


class StoreDataset(Dataset):
    """Map-style: item i is the i-th selected row, as a dict of tensors plus ``row`` and ``label``."""

    def __init__(self, store: Any, keys: list[str], only_ok: bool = True) -> None:
        self.store, self.keys = store, keys
        self.rows = store.ok_rows() if only_ok else np.arange(len(store))
        self.labels = store.labels

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        r = int(self.rows[i])
        out = {k: torch.from_numpy(np.asarray(self.store[k][r])) for k in self.keys}
        out["row"] = torch.tensor(r)
        out["label"] = torch.tensor(int(self.labels[r]))
        return out


class _Batches(IterableDataset):
    def __init__(self, store: Any, keys: list[str], batch_size: int, shuffle: bool, seed: int,
                 kwargs: dict[str, Any], tokens: bool = False, dtype: Any = None, drop_last: bool = False) -> None:
        self.store, self.keys, self.batch_size, self.shuffle, self.seed = store, keys, batch_size, shuffle, seed
        self.kwargs, self.tokens, self.dtype, self.drop_last = kwargs, tokens, dtype, drop_last
        self.epoch = 0

    def __len__(self) -> int:
        """Batches per epoch (``len(loader)``, for progress bars and schedules)."""
        rows = len(self.store._select_rows(self.kwargs.get("rows"), self.kwargs.get("only_ok", True)))
        if self.tokens:
            meta = self.store.captures[self.keys[0]]
            rows *= int(meta["shape"][0]) - self.store._prefix(self.kwargs.get("drop_prefix", False))
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def _tensor(self, v: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(v))
        return t if self.dtype is None else t.to(self.dtype)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        seed = self.seed + self.epoch
        self.epoch += 1
        if self.tokens:
            for index, x in self.store.token_batches(self.keys[0], self.batch_size, shuffle=self.shuffle, seed=seed,
                                                     drop_last=self.drop_last, **self.kwargs):
                yield {self.keys[0]: self._tensor(x), "row": torch.from_numpy(index[:, 0].copy()),
                       "token": torch.from_numpy(index[:, 1].copy())}
            return
        labels = self.store.labels
        for rows, data in self.store.batches(self.keys, self.batch_size, shuffle=self.shuffle, seed=seed,
                                             **self.kwargs):
            if self.drop_last and len(rows) < self.batch_size:
                return
            out = {k: self._tensor(v) for k, v in data.items()}
            out["row"] = torch.from_numpy(rows)
            out["label"] = torch.from_numpy(labels[rows])
            yield out


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
                 tokens: bool = False, dtype: Any = None, drop_last: bool = False) -> DataLoader:
    return DataLoader(_Batches(store, keys, batch_size, shuffle, seed, kwargs, tokens, float_dtype(dtype), drop_last),
                      batch_size=None)
