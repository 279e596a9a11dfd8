"""A store written without a job: tests, benchmarks and stores assembled by hand (numpy and zarr only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import zarr

from .._text import now
from ..data import Rows
from ..errors import StoreError
from .generation import read_head, swap_head
from .layout import StoreArrays, create_generation
from .ledger import new_id
from .objects import Objects
from .writer import Ticket

__all__ = ["create_store", "ticket"]


def create_store(url: str, rows: Rows, arrays: StoreArrays, attrs: Mapping[str, Any],
                 storage_options: Mapping[str, Any] | None = None, pending: bool = False) -> zarr.Group:
    """Make a store at ``url`` (replacing what is there) whose every shard is held by one attempt, committed at
    once: the group returned writes into that attempt (any array, any rows), and what it writes is read at once.
    ``attrs``: the store's record (at least ``n_rows``, ``n_shards``, ``captures``). ``pending``: every shard
    pending instead, for workers to write (:func:`ticket`); the group's writes are then read by no one."""
    objects = Objects.at(url, storage_options)
    name = swap_head(objects, read_head(objects), now())
    store = create_generation(objects, name, rows, arrays, {"created": now(), "spec": {}, "model": {}, **attrs},
                              committed=not pending)
    with zarr.config.set({"array.write_empty_chunks": True}):
        return zarr.open_group(store=store, mode="r+", use_consolidated=False)


def ticket(url: str, storage_options: Mapping[str, Any] | None = None) -> Ticket:
    """A ticket to write the pending shards of the store at ``url`` without a job (a claimant that keeps no record:
    its claims count as a dead claimant's for others)."""
    head = read_head(Objects.at(url, storage_options))
    if head is None or head.generation is None:
        raise StoreError(f"no store of format 2 at {url}")
    return Ticket(head.generation, new_id())
