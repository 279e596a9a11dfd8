"""A shard's writer: one attempt at one shard, claimed in the ledger, its chunks written under the attempt's own
name, then committed (numpy and zarr only).

Nothing the writer writes is read until its commit, one swap of the shard's ledger entry that names the attempt:
a writer stopped anywhere (killed, paused past its claimant's timeout, its job stopped) leaves objects no one names,
removed later as garbage; one woken after another claimant took its shard finds its commit refused.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from zarr.storage import StorePath

from ..errors import FencedError, ShardTaken
from .chunks import ChunkCodec, ShardStream, read_at_once, write_chunks, write_whole
from .claimants import SUPERSEDED
from .generation import Generation, read_head
from .layout import INDEX_PARTS, READ_PRINT, WRITE_CONFIG, get_array, locator_arrays
from .ledger import Ledger, Verdict, commit, new_id
from .objects import Objects
from .views import GenerationStore, Slot, write_view

__all__ = ["ShardWriter", "Ticket"]


@dataclass(frozen=True)
class Ticket:
    """What a job's writers need to write its shards: the generation they write into, and the claimant (the job's
    process that claims shards: :mod:`.claimants`) whose claims they hold."""

    generation: str
    claimant: int
    timeout_s: float = 60.0  # the job's output.lease_timeout_s: a swap waits this long for another's to end
    join: bool = False  # a shard taken over while computed is another claimant's now, not the end of the job

class ShardWriter:
    """Writes one attempt at the rows ``start:stop`` of shard ``index``: claims it for ``ticket``'s claimant (raising
    :class:`ShardTaken` where another claimant holds it or committed it), writes each capture's chunks
    (:meth:`write`), then per-row arrays and the commit (:meth:`finish`). :class:`FencedError` when the claimant lost
    the shard meanwhile (taken over after it seemed dead) or the store was made again."""

    def __init__(self, url: str, start: int, stop: int, index: int, storage_options: Mapping[str, Any] | None = None,
                 ticket: Ticket | None = None):
        if ticket is None:
            raise ValueError("a shard is written for a claimant of the store's generation: give its Ticket")
        self.url, self.storage_options, self.ticket = url, storage_options, ticket
        self.start, self.stop, self.index = start, stop, index
        self.opened = _Opened.of(url, storage_options, ticket.generation, ticket.timeout_s)
        self.attempt = new_id()
        rows = self.opened.claim(index, ticket.claimant, self.attempt)
        self.view = self.opened.view({"data": self.attempt, "rows": rows}, index)
        self.bytes = 0
        # opened once per attempt (metadata read once per process), with how their whole chunks are encoded
        self._arrays: dict[str, tuple[zarr.Array, ChunkCodec | None]] = {}
        self._streams: dict[str, ShardStream] = {}  # sharded arrays: this shard's object of each, being written
        self._lock = threading.Lock()  # write() is called from several writer threads

    def opening(self, labels: bool = False) -> tuple[list[Any], np.ndarray | None]:
        """What the decoder reads for each row (its path, or where the source keeps locator arrays beside it
        (``data.Source.locators``), the path and their values: a tar member's (TAR_URL#MEMBER, offset, size)) and,
        with ``labels``, the rows' labels: the shard's rows of those arrays read in one round."""
        locators = list(self.opened.locators)
        names = ["paths", *locators, *(["labels"] if labels else [])]
        got = dict(zip(names, read_at_once([(self._array(n), slice(self.start, self.stop)) for n in names]),
                       strict=True))
        paths = got["paths"].tolist()
        found = np.asarray(got["labels"], dtype=np.int64) if labels else None
        if not locators:
            return paths, found
        return list(zip(paths, *(got[n].tolist() for n in locators), strict=True)), found

    def check_fence(self) -> None:
        """Raise :class:`FencedError` once this process found the store made again (a claimant's renewal reads the
        head: :mod:`.claimants`): what the writer would write goes to a generation no one reads."""
        if self.ticket.generation in SUPERSEDED:
            raise FencedError(f"{self.url} was made again by another job (--overwrite) while this one wrote into it; "
                              "this job stops. Look at the store with `extractor inspect`")

    def _array(self, name: str) -> zarr.Array:
        return self.opened.bound(name, self.view)

    def _open(self, key: str) -> tuple[zarr.Array, ChunkCodec | None]:
        """The capture array ``key`` and its chunk codec (callers hold ``_lock``)."""
        if key not in self._arrays:
            self._arrays[key] = self._array(key), self.opened.codec(key)
        return self._arrays[key]

    def chunk_rows(self, keys: Iterable[str]) -> dict[str, int]:
        """Rows per chunk of each capture array of ``keys``, as the store has them."""
        with self._lock:
            return {key: int(self._open(key)[0].chunks[0]) for key in keys}

    def write(self, offset: int, chunks: Mapping[str, np.ndarray]) -> None:
        """Write rows ``start+offset ...`` of each capture in ``chunks`` (one whole chunk of each)."""
        self.check_fence()
        with self._lock:
            opened = {key: (*self._open(key), data) for key, data in chunks.items()}
            for key, (_, codec, _) in opened.items():
                if codec is not None and codec.shard_rows is not None and key not in self._streams:
                    self._streams[key] = ShardStream(codec, self.start, self.view, self.opened.base_url,
                                                     self.storage_options)
        with self._moved_on():
            written = write_chunks(self.start + offset, opened, self._streams)
        with self._lock:
            self.bytes += written

    def abandon(self) -> None:
        """The shard will not finish here: its sharded objects being written are given up (what is written stays
        unnamed: garbage)."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.abort()

    def finish(
        self,
        status: np.ndarray,
        errors: Sequence[str],
        extras: Mapping[str, np.ndarray] | None = None,
        stats: str = "",
        digests: np.ndarray | None = None,
        reused: np.ndarray | None = None,
        index_parts: Mapping[str, np.ndarray] | None = None,
        prints: np.ndarray | None = None,
    ) -> None:
        """The shard's sharded objects made whole, its per-row and per-shard arrays written (every array of the
        attempt, fill values where nothing is given), then the commit. ``index_parts``: this shard's part of each
        write-time feature index; ``prints``: the fingerprint of each row's file as its bytes were read (0: none)."""
        self.check_fence()
        with self._moved_on():
            self._write_rest(status, errors, extras, stats, digests, reused, index_parts, prints)
        self._commit(int((status == 1).sum()), int((status == 2).sum()))

    def _write_rest(self, status: np.ndarray, errors: Sequence[str], extras: Mapping[str, np.ndarray] | None,
                    stats: str, digests: np.ndarray | None, reused: np.ndarray | None,
                    index_parts: Mapping[str, np.ndarray] | None, prints: np.ndarray | None) -> None:
        """:meth:`finish`'s writes: the sharded objects made whole, every per-row and per-shard array."""
        with self._lock:
            keys = list(self._streams)
        for key in keys:  # each sharded array's object of this shard made whole: its index, last
            self._streams[key].close()
            with self._lock:
                del self._streams[key]  # closed: what a failure leaves open, abandon() gives up
        rows, one = self.start, self.index  # where the per-row arrays' rows begin; the per-shard arrays' row
        given: dict[str, tuple[int, np.ndarray]] = {key: (rows, v) for key, v in (extras or {}).items()}
        if digests is not None:
            given["digest"] = (rows, digests)
        if reused is not None:
            given["reused"] = (rows, reused)
        if prints is not None:
            given[READ_PRINT] = (rows, prints)
        given.update({f"{INDEX_PARTS}/{key}": (one, np.asarray(part)[None])
                      for key, part in (index_parts or {}).items()})
        given.update(status=(rows, status), errors=(rows, np.asarray(errors, dtype=object)),
                     shard_stats=(one, np.asarray([stats], dtype=object)))
        writes = [(name, *given[name]) if name in given else self.opened.filled(name, rows, one, len(status))
                  for name in self.opened.per_row_data]
        write_whole([(*self._open_row(name), start, data) for name, start, data in writes])

    def _commit(self, ok: int, failed: int) -> None:
        """The commit: the shard's entry names this attempt, if the claim is still this claimant's."""
        claimant, attempt, nbytes = self.ticket.claimant, self.attempt, self.bytes
        verdict = self.opened.ledger.step(self.index, lambda e: commit(e, claimant, attempt, ok, failed, nbytes))
        if verdict is Verdict.LOST:
            raise self._taken()

    def _taken(self) -> Exception:
        if self.ticket.join:  # a joined store: the shard is the other claimant's now
            return ShardTaken(self.index, "taken")
        return FencedError(f"shard {self.index} of {self.url} was taken over by another process while this one "
                           "computed it (this one was paused or cut off for longer than output.lease_timeout_s); "
                           "what it wrote is not used. This process stops")

    @contextlib.contextmanager
    def _moved_on(self) -> Iterator[None]:
        """A write that fails because the store moved on under a stale writer (its generation made again and
        removed, its attempt's objects collected once another committed the shard) stops it as the commit would
        have: what failed is not the data's fault. Any other failure is itself."""
        try:
            yield
        except OSError as err:
            try:
                head = read_head(self.opened.objects)
                ours = head is not None and head.generation == self.ticket.generation
                e = self.opened.ledger.entry(self.index) if ours else None
            except Exception:  # noqa: BLE001 - the storage itself failing: the write's own error says more
                raise err from None
            if not ours:
                SUPERSEDED.add(self.ticket.generation)
                raise FencedError(f"{self.url} was made again by another job (--overwrite) while this one wrote "
                                  "into it; this job stops. Look at the store with `extractor inspect`") from err
            assert e is not None
            if int(e["claimant"]) != self.ticket.claimant or int(e["attempt"]) != self.attempt:
                raise self._taken() from err
            raise

    def _open_row(self, name: str) -> tuple[zarr.Array, ChunkCodec | None]:
        with self._lock:
            return self._open(name)


class _Opened:
    """A job's generation as this process opened it for writing: its ledger, its arrays' metadata (each read once:
    0.5-1 ms locally, a round trip on an object store) and chunk codecs; each attempt's arrays are those, bound to
    its own view. Kept for the shards of one generation that the process writes."""

    last: _Opened | None = None  # the generation whose shards this process writes now
    _guard = threading.Lock()

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, generation: str,
                 timeout_s: float = 60.0) -> None:
        self.key = (url, generation)
        self.objects = Objects.at(url, storage_options, timeout_s)
        self.generation = Generation(self.objects, generation)
        self.base_url = f"{self.objects.url}/{generation}"
        self.ledger: Ledger = self.generation.ledger()
        self.base = write_view(self.objects.zarr_store(generation, read_only=False), {}, url=url)
        self.group = zarr.open_group(store=self.base, mode="r", use_consolidated=True)
        self.names = set(self.group.array_keys()) | {f"{INDEX_PARTS}/{k}" for k in _index_parts(self.group)}
        self.locators = locator_arrays(self.group, self.names)  # the source's arrays beside paths, in its order
        self.slots: dict[str, Slot] = {}
        self.arrays: dict[str, zarr.Array] = {}
        self.codecs: dict[str, ChunkCodec | None] = {}
        self.lock = threading.Lock()
        self.rows = int(self.generation.root()["n_rows"])  # type: ignore[index]
        self.shard_size = int(self.generation.root()["shard_size"])  # type: ignore[index]
        # the arrays an attempt writes at finish (per row or per shard): every one of the data slot but captures
        captures = set((self.generation.root() or {}).get("captures") or {})
        self.per_row_data = sorted(n for n in self.names if n not in captures and self._slot(n) == "data")

    @classmethod
    def of(cls, url: str, storage_options: Mapping[str, Any] | None, generation: str,
           timeout_s: float = 60.0) -> _Opened:
        """The generation opened for writing (once per process and generation)."""
        with cls._guard:
            last = cls.last
            if last is not None and last.key == (url, generation):
                return last
            opened = cls.last = cls(url, storage_options, generation, timeout_s)
            return opened

    def _slot(self, name: str) -> str | None:
        slot = self.base.slots.get(name)
        if slot is None and name not in self.base.plain:
            self.array(name)  # its metadata read: its slot known
            slot = self.base.slots.get(name)
        return slot.slot if slot is not None else None

    def array(self, name: str) -> zarr.Array:
        with self.lock:
            if name not in self.arrays:
                self.arrays[name] = get_array(self.group, name).with_config(WRITE_CONFIG)
            return self.arrays[name]

    def bound(self, name: str, view: GenerationStore) -> zarr.Array:
        """Array ``name`` writing through ``view`` (an attempt's): the array opened once, bound to the view."""
        array = self.array(name)
        inner = copy.copy(array.async_array)
        object.__setattr__(inner, "store_path", StorePath(view, array.path))
        return zarr.Array(inner)

    def codec(self, name: str) -> ChunkCodec | None:
        array = self.array(name)
        with self.lock:
            if name not in self.codecs:
                self.codecs[name] = ChunkCodec.of(array)
            return self.codecs[name]

    def view(self, attempts: Mapping[str, int], shard: int) -> GenerationStore:
        """The writes of one attempt at ``shard``."""
        return GenerationStore(self.base._store, attempts=attempts, shards=range(shard, shard + 1), url=self.base.url,
                               slots=self.base.slots, plain=self.base.plain)  # known already: shared, read once

    def filled(self, name: str, rows: int, one: int, n: int) -> tuple[str, int, np.ndarray]:
        """A per-row or per-shard array the attempt was given nothing for: its fill values (every chunk of a
        committed shard is written)."""
        array = self.array(name)
        per_shard = array.shape[0] != self.rows  # (shards, ...) arrays: one row a shard
        count = 1 if per_shard else n
        data = np.full((count, *array.shape[1:]), array.fill_value, dtype=array.dtype)
        return name, one if per_shard else rows, data

    def claim(self, shard: int, claimant: int, attempt: int) -> int:
        """Claim ``shard`` for ``claimant``'s ``attempt`` (:meth:`.ledger.Ledger.claim`); the attempt holding its rows.
        :class:`ShardTaken` where it is not free, naming the other shards of its block that are not either."""
        verdict, rows, skip = self.ledger.claim(shard, claimant, attempt, self.generation.roster.dead)
        if verdict is not Verdict.OK:
            raise ShardTaken(shard, verdict.value, skip)
        return rows



def _index_parts(group: zarr.Group) -> list[str]:
    node = group.get(INDEX_PARTS)
    return list(node.array_keys()) if isinstance(node, zarr.Group) else []
