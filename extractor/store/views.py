"""The zarr stores through which a generation is read and written: a chunk's key mapped to the attempt that holds
it (numpy-free; zarr's store interface).

An array whose chunks belong to shards (a capture, a row's status, a shard's statistics) declares, in its own
metadata, the Zarr v3 storage transformer ``extractor-attempts`` with the slot of the ledger that names its
chunks' attempt (``data``: what a shard computed; ``rows``: its rows' source facts) and how its chunks fall in
shards (rows per chunk, rows per shard). The chunk ``<array>/c/<i>/...`` of shard ``s`` then lies at
``__attempts/<attempt>/<array>/c/<i>/...``, where ``attempt`` is what the ledger names for ``s``. A reader without
this package meets an unknown storage transformer and refuses the array (zarr-python's ``open_array``: "Arrays with
storage transformers are not supported"; the generation's root is not where a plain reader looks, so it finds no
group), never reading it as fill values; arrays without one (ids, paths, labels, the id index: written once, when
the generation is made) are plain Zarr.

- :func:`read_view`: a generation as one :class:`~.ledger.Table` names it: every chunk of a committed shard from
  its attempt (an object missing there is an error, never a fill value), a shard not committed reads as fill
  values (status pending, NaN); the root's attributes are the generation's state (``attrs``). Read-only.
- :func:`write_view`: an attempt's writes: its chunks put under its own name, read back from there (zarr's
  read-modify-write of a partial chunk); array metadata read without the transformer; metadata written with it
  (``slots``: the arrays that get one, when the generation is made).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from zarr.abc.buffer import Buffer, BufferPrototype
from zarr.abc.store import ByteRequest, Store
from zarr.buffer import default_buffer_prototype
from zarr.storage import WrapperStore

from ..errors import StoreError
from ._zarr_internal import sync
from .ledger import Table

__all__ = ["ATTEMPTS", "ROOT", "TRANSFORMER", "GenerationStore", "Slot", "attempt_prefix", "read_view", "write_view"]

TRANSFORMER = "extractor-attempts"
ROOT = "__root.json"  # the generation's root metadata, where zarr reads "zarr.json" of the root through a view: a plain
# reader opening the generation's folder finds no group there (an error), never its arrays as fill values
ATTEMPTS = "__attempts"  # an attempt's objects: __attempts/<attempt as 16 hex digits>/<key>
HIDDEN = "__"  # names of the generation's own bookkeeping (__txn, __attempts): not nodes of the hierarchy


def attempt_prefix(attempt: int) -> str:
    return f"{ATTEMPTS}/{attempt:016x}"


@dataclass(frozen=True)
class Slot:
    """An array's chunks as the ledger names them: ``slot`` (``data`` or ``rows``); the object of first chunk
    coordinate ``i`` holds rows from ``i * chunk_rows``, of shard ``i * chunk_rows // shard_rows``."""

    slot: str
    chunk_rows: int  # rows (or shards, of a per-shard array) an object's first coordinate steps by
    shard_rows: int  # rows (or 1) of a shard

    def shard(self, coord: int) -> int:
        return coord * self.chunk_rows // self.shard_rows

    def transformer(self) -> dict[str, Any]:
        return {"name": TRANSFORMER, "configuration": {"slot": self.slot, "chunk_rows": self.chunk_rows,
                                                       "shard_rows": self.shard_rows}}

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> Slot | None:
        """The slot an array's metadata declares (None: a plain array)."""
        for t in meta.get("storage_transformers") or ():
            if isinstance(t, Mapping) and t.get("name") == TRANSFORMER:
                conf = t.get("configuration") or {}
                return cls(str(conf["slot"]), int(conf["chunk_rows"]), int(conf["shard_rows"]))
        return None


def _chunk(key: str) -> tuple[str, int] | None:
    """A chunk key's array path and first chunk coordinate (``a/b/c/3/0`` -> ``("a/b", 3)``); None: not a chunk."""
    at = key.find("/c/")
    while at >= 0:
        rest = key[at + 3 :].split("/")
        if rest and all(p.isdigit() for p in rest):
            return key[:at], int(rest[0])
        at = key.find("/c/", at + 1)
    return None


def _strip(meta: dict[str, Any]) -> dict[str, Any]:
    """Metadata as zarr reads it: without the transformer (zarr-python refuses storage transformers)."""
    out = dict(meta)
    if Slot.of(out) is not None:
        out["storage_transformers"] = [t for t in out["storage_transformers"] if t.get("name") != TRANSFORMER]
        if not out["storage_transformers"]:
            del out["storage_transformers"]
    consolidated = out.get("consolidated_metadata")
    if isinstance(consolidated, dict) and isinstance(consolidated.get("metadata"), dict):
        out["consolidated_metadata"] = {**consolidated, "metadata": {
            k: _strip(v) if isinstance(v, dict) else v for k, v in consolidated["metadata"].items()}}
    return out


def _add(meta: dict[str, Any], path: str, slots: Mapping[str, Slot]) -> dict[str, Any]:
    """Metadata as it is stored: the transformer of its array (``path``), and of the arrays it consolidates."""
    out = dict(meta)
    if out.get("node_type") == "array" and path in slots:
        out["storage_transformers"] = [slots[path].transformer()]
    consolidated = out.get("consolidated_metadata")
    if isinstance(consolidated, dict) and isinstance(consolidated.get("metadata"), dict):
        base = f"{path}/" if path else ""
        out["consolidated_metadata"] = {**consolidated, "metadata": {
            k: _add(v, base + k, slots) if isinstance(v, dict) else v for k, v in consolidated["metadata"].items()}}
    return out


def _buffer(data: bytes) -> Buffer:
    return default_buffer_prototype().buffer.from_bytes(data)


class GenerationStore(WrapperStore[Store]):
    """A generation's objects (``store``: a zarr store at its prefix) seen through its ledger: a read view
    (``table``: the ledger as read, which names each shard's attempts) or an attempt's write view (``attempts``: per
    slot, the attempt whose name its chunks take, ``shards``: the shards it may write). See the module's docstring."""

    def __init__(self, store: Store, table: Table | None = None,
                 attempts: Mapping[str, int] | None = None, attrs: Mapping[str, Any] | None = None,
                 slots: dict[str, Slot] | None = None, shards: range | None = None, url: str = "",
                 hold_root: bool = False, missing: Callable[[str], None] | None = None,
                 plain: set[str] | None = None) -> None:
        super().__init__(store)
        self.table, self.attempts, self.attrs = table, dict(attempts or {}), attrs
        # known arrays' slots, read from their metadata as met, and the arrays known to have none: shared with the
        # copies zarr makes of this store (with_read_only)
        self.slots: dict[str, Slot] = slots if slots is not None else {}
        self.plain: set[str] = plain if plain is not None else set()
        self.shards = shards
        self.url = url
        self.hold_root = hold_root  # a generation being made: its root is written last (release_root)
        self._root: bytes | None = None
        self.missing = missing  # told of a committed shard's object that is not there (raises when that is wrong)

    def _with_store(self, store: Store) -> GenerationStore:
        return type(self)(store, self.table, self.attempts, self.attrs, self.slots, self.shards, self.url,
                          self.hold_root, self.missing, self.plain)

    @property
    def root(self) -> Any:  # a local generation's folder (chunks.ShardStream writes beside it)
        return getattr(self._store, "root", None)

    @property
    def fs(self) -> Any:
        return getattr(self._store, "fs", None)

    @property
    def path(self) -> str:
        return str(getattr(self._store, "path", ""))

    # the mapping

    async def _slot(self, path: str) -> Slot | None:
        """The slot of the array at ``path`` (None: plain), from its metadata, read once."""
        if path in self.slots:
            return self.slots[path]
        if path in self.plain:
            return None
        found = await self._store.get(f"{path}/zarr.json", default_buffer_prototype())
        slot = Slot.of(json.loads(found.to_bytes())) if found is not None else None
        if slot is None:
            self.plain.add(path)
        else:
            self.slots[path] = slot
        return slot

    def physical(self, key: str, slot: Slot | None, coord: int) -> str | None:
        """Where the chunk ``key`` (first coordinate ``coord``) of an array with ``slot`` lies (None: a shard not
        committed, read as fill values)."""
        if slot is None:
            return key
        shard = slot.shard(coord)
        if self.table is not None:
            attempts = self.table.attempts(slot.slot)
            attempt = int(attempts[shard]) if shard < len(attempts) else 0
            return f"{attempt_prefix(attempt)}/{key}" if attempt else None
        if slot.slot not in self.attempts:
            raise StoreError(f"{key}: this writer holds no attempt for the {slot.slot!r} arrays")
        if self.shards is not None and shard not in self.shards:
            raise StoreError(f"{key}: shard {shard} is not this attempt's (shards {self.shards.start} to "
                             f"{self.shards.stop - 1})")
        return f"{attempt_prefix(self.attempts[slot.slot])}/{key}"

    def physical_sync(self, key: str) -> str | None:
        """:meth:`resolve` from outside zarr's event loop (a writer's stream, a reader's direct file reads)."""
        found = _chunk(key)
        if found is None:
            return key
        if found[0] not in self.slots and found[0] not in self.plain:
            sync(self._slot(found[0]))
        return self.physical(key, self.slots.get(found[0]), found[1])

    async def resolve(self, key: str) -> str | None:
        """The physical key of ``key`` (see :meth:`physical`)."""
        found = _chunk(key)
        if found is None:
            return key
        return self.physical(key, await self._slot(found[0]), found[1])

    # reads

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        if key == "zarr.json" or key.endswith("/zarr.json"):
            return await self._metadata(key, prototype)
        found = _chunk(key)
        if found is None:
            return await self._store.get(key, prototype, byte_range)
        slot = await self._slot(found[0])
        where = self.physical(key, slot, found[1])
        if where is None:
            return None
        out = await self._store.get(where, prototype, byte_range)
        if out is None and slot is not None and self.missing is not None:
            self.missing(where)  # the store made again since it was opened: an error; else fill values
        return out

    async def _metadata(self, key: str, prototype: BufferPrototype) -> Buffer | None:
        if key == "zarr.json" and self._root is not None:
            meta = json.loads(self._root)
        else:
            found = await self._store.get(ROOT if key == "zarr.json" else key, prototype)
            if found is None:
                return None
            meta = json.loads(found.to_bytes())
        path = key[: -len("zarr.json")].rstrip("/")
        self._learn(path, meta)
        consolidated = (meta.get("consolidated_metadata") or {}).get("metadata") or {}
        for name, child in consolidated.items():  # what one read of the root tells of every array
            if isinstance(child, dict):
                self._learn(f"{path}/{name}" if path else name, child)
        meta = _strip(meta)
        if key == "zarr.json" and self.attrs is not None:  # the root: the generation's state
            meta["attributes"] = {**(meta.get("attributes") or {}), "extractor": dict(self.attrs)}
        return prototype.buffer.from_bytes(json.dumps(meta).encode())

    def _learn(self, path: str, meta: Mapping[str, Any]) -> None:
        """The slot of the array at ``path`` (or that it has none), from its metadata as read."""
        slot = Slot.of(meta)
        if slot is not None:
            self.slots.setdefault(path, slot)
        elif meta.get("node_type") == "array":
            self.plain.add(path)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def exists(self, key: str) -> bool:
        where = ROOT if key == "zarr.json" else await self.resolve(key)
        return where is not None and await self._store.exists(where)

    # writes

    async def set(self, key: str, value: Buffer) -> None:
        if self.table is not None:
            raise StoreError(f"{self.url} is open for reading; {key} is not written")
        if key == "zarr.json" or key.endswith("/zarr.json"):
            path = key[: -len("zarr.json")].rstrip("/")
            data = json.dumps(_add(json.loads(value.to_bytes()), path, self.slots)).encode()
            if key == "zarr.json" and self.hold_root:
                self._root = data
            else:
                await self._store.set(ROOT if key == "zarr.json" else key, _buffer(data))
            return
        where = await self.resolve(key)
        if where is None:  # pragma: no cover - a write view always maps
            raise StoreError(f"{key}: no attempt to write it under")
        await self._store.set(where, value)

    def release_root(self) -> None:
        """Write the root held back while the generation was made: from now on it is made."""
        if self._root is None:
            raise StoreError(f"{self.url}: no root to write")
        root, self.hold_root, self._root = self._root, False, None
        sync(self.set("zarr.json", _buffer(root)))

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        where = await self.resolve(key)
        if where is not None and not await self._store.exists(where):
            await self.set(key, value)

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        for key, value in values:
            await self.set(key, value)

    async def delete(self, key: str) -> None:
        """An attempt removes its own chunk (zarr does, for one of fill values only); nothing else is removed."""
        found = _chunk(key)
        if self.table is not None or found is None or await self._slot(found[0]) is None:
            raise StoreError(f"{self.url}: {key} is not removed: a generation's objects are never changed in place")
        where = await self.resolve(key)
        if where is not None:
            await self._store.delete(where)

    async def delete_dir(self, prefix: str) -> None:
        raise StoreError(f"{self.url}: {prefix} is not removed: a generation's objects are never changed in place")

    async def clear(self) -> None:
        raise StoreError(f"{self.url}: a generation is never cleared")

    # listing: the hierarchy without the generation's bookkeeping

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        async for name in self._store.list_dir(prefix):
            if not name.startswith(HIDDEN):
                yield name

    async def list(self) -> AsyncIterator[str]:
        async for name in self._store.list():
            if not name.startswith(HIDDEN):
                yield name

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        async for name in self._store.list_prefix(prefix):
            if not name.startswith(HIDDEN):
                yield name


def read_view(store: Store, table: Table, attrs: Mapping[str, Any] | None, url: str = "",
              missing: Callable[[str], None] | None = None) -> GenerationStore:
    """A generation read as ``table`` names its shards' attempts (see the module's docstring); ``missing`` is told
    of a committed shard's object that is not there (and raises where that means the store was made again)."""
    return GenerationStore(store, table=table, attrs=attrs, url=url, missing=missing)


def write_view(store: Store, attempts: Mapping[str, int], shards: range | None = None,
               slots: dict[str, Slot] | None = None, url: str = "", hold_root: bool = False) -> GenerationStore:
    """An attempt's writes into a generation (see the module's docstring); ``hold_root``: the generation is being
    made, its root written by :meth:`GenerationStore.release_root`."""
    return GenerationStore(store, attempts=attempts, shards=shards, slots=slots, url=url, hold_root=hold_root)
