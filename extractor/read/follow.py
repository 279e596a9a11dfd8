"""Reading a store while its job writes it (issue 58): ``batches(..., follow=True)`` and ``token_batches(...,
follow=True)`` yield the rows of each shard as its commit lands, so that a trainer starts with the first shard, and
end once the store is complete, every ok row yielded once.

The stream goes in rounds. A round opens the store again at its ledger as it is now (the commits landed since),
takes the shards committed that no earlier round took, and streams their ok rows as the finished store would (the
same method and arguments, its order drawn with the round's own seed: ``seed + round``); then the next round, or,
where nothing new is committed, a wait (``poll_s``) until something is. A store made again meanwhile
(``--overwrite``) is refused, never mixed in; a store whose writers all stopped before it was complete ends the
stream with an error saying how many shards it holds and how to finish it.

Its ``state_dict()`` holds the shards of the rounds served, the shards of the current one and that round's own
state, so a stream made with the same arguments and given it yields exactly the rows not yet yielded.

One reader only: ranks and DataLoader workers (``part``, ``worker``) would each see the commits land at other moments,
so the rows of their parts would not add up to the epoch; they read the finished store.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import StoreError
from ..store import OK, alive, get_array, take_rows

__all__ = ["Following"]

POLL_S = 1.0  # between two reads of the ledger while nothing new is committed


def _pack(mask: np.ndarray) -> str:
    return base64.b64encode(np.packbits(mask).tobytes()).decode()


def _unpack(text: str, n: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(base64.b64decode(text), np.uint8))
    if len(bits) < n or bits[n:].any():
        raise ValueError(f"this state is of a store of another shard count (not {n})")
    return bits[:n].astype(bool)


class Following:
    """The stream of :meth:`~extractor.read.batching.Batching.batches` or ``token_batches`` (``method``, with
    ``kwargs``) over ``store`` as it is written (see the module's docstring). ``opened``: the store at its ledger
    now (``open_store`` again); ``poll_s``: the wait between two reads of the ledger."""

    def __init__(self, store: Any, method: str, kwargs: Mapping[str, Any], opened: Callable[[], Any],
                 poll_s: float | None = None) -> None:
        for name in ("part", "worker", "rows"):
            if kwargs.get(name) is not None:
                raise ValueError(f"follow=True serves one reader over the whole store: {name}= is not taken (ranks "
                                 "and DataLoader workers would see the shards commit at other moments); read the "
                                 "finished store with it")
        if kwargs.get("normalize"):
            raise ValueError("follow=True cannot normalize: the statistics are merged once the store is complete; "
                             "normalize the batches yourself, or read the finished store with normalize=")
        self.store, self.method, self.kwargs = store, method, dict(kwargs)
        self.opened, self.poll_s = opened, POLL_S if poll_s is None else poll_s
        self.generation = store.attrs.get("generation")
        self.n_shards, self.shard_size = int(store.attrs["n_shards"]), int(store.attrs["shard_size"])
        self.seed = int(kwargs.get("seed") or 0)
        self.seen = np.zeros(self.n_shards, bool)  # the shards of the rounds served whole
        self.current: np.ndarray | None = None  # the shards of the round being served
        self.round = 0
        self.inner: Any = None  # the round's own stream
        self.inner_state: Mapping[str, Any] | None = None  # to give the round's stream before its first batch
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Following:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = self._batches()
        return next(self._it)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def _batches(self) -> Iterator[Any]:
        while True:
            if self.current is None:
                store = self._next_round()
                if store is None:
                    return
            else:  # a round given by load_state_dict
                store = self._same(self.opened())
            shards = self.current
            assert shards is not None
            self.inner = self._stream(store, shards)
            if self.inner_state is not None:
                self.inner.load_state_dict(self.inner_state)
                self.inner_state = None
            yield from self.inner
            self.seen |= shards
            self.current, self.inner = None, None
            self.round += 1

    def _next_round(self) -> Any:
        """The store at its ledger now, once it holds shards no round took (``current`` set to them); None once the
        store is complete and every shard was taken."""
        while True:
            store = self._same(self.opened())
            done = np.asarray(store.done_shards, dtype=bool)
            new = done & ~self.seen
            if new.any():
                self.current = new
                return store
            if done.all():
                return None
            self._wait(store, done)

    def _wait(self, store: Any, done: np.ndarray) -> None:
        """Nothing new committed: wait, unless no one writes the store any more."""
        if not any(alive(c) for c in store.claimants()):
            time.sleep(self.poll_s)  # a job may be starting (its claimant not written yet): look once more
            again = self._same(self.opened())
            if not any(alive(c) for c in again.claimants()) and not (np.asarray(again.done_shards) & ~done).any():
                raise StoreError(f"no job writes {store.url} any more and {int((~done).sum())} of its "
                                 f"{self.n_shards} shards are not committed (the stream served the rows of the "
                                 f"{int(done.sum())} committed): "
                                 "finish the store with extractor run JOB --resume (or --join), then read on")
            return
        time.sleep(self.poll_s)

    def _same(self, store: Any) -> Any:
        if store.attrs.get("generation") != self.generation:
            raise StoreError(f"{self.store.url} was made again (or removed) while followed: its rows are another "
                             "store's now; open it again")
        return store

    def _stream(self, store: Any, shards: np.ndarray) -> Any:
        """The round's stream: the ok rows of ``shards``, as the finished store's method streams them."""
        n = len(store)
        rows = np.concatenate([np.arange(int(a), min(int(a) + self.shard_size, n), dtype=np.int64)
                               for a in np.flatnonzero(shards) * self.shard_size])
        rows = rows[take_rows(get_array(store.group, "status"), rows) == OK]  # those rows' status only
        kwargs = {**self.kwargs, "rows": rows, "seed": self.seed + self.round, "only_ok": False}
        return getattr(store, self.method)(**kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The shards of the rounds served, the current round's shards and its own state: plain JSON."""
        state: dict[str, Any] = {"follow": self.method, "round": self.round, "seen": _pack(self.seen)}
        if self.current is not None:
            state["current"] = _pack(self.current)
            state["inner"] = self.inner.state_dict() if self.inner is not None else self.inner_state
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (of :meth:`state_dict`), before the first batch."""
        if self._it is not None:
            raise RuntimeError("load_state_dict() must come before the stream's first batch; make a new stream")
        if not isinstance(state, Mapping) or state.get("follow") != self.method:
            raise ValueError(f"this state is not of a followed {self.method} stream: make the stream with the "
                             "arguments it was saved with")
        self.round = int(state["round"])
        self.seen = _unpack(state["seen"], self.n_shards)
        if "current" in state:
            self.current = _unpack(state["current"], self.n_shards)
            self.inner_state = state.get("inner")
