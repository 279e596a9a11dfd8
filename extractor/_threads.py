"""Work done a few items ahead, on background threads, taken in order (the ground floor: stdlib only)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

__all__ = ["InOrder", "prefetched"]

_T = TypeVar("_T")
_R = TypeVar("_R")


class InOrder(Generic[_R]):
    """Calls run up to ``depth`` ahead on ``threads`` background threads, their results given back in the order
    they were asked for (``with``: its threads end with it; ``depth`` 0: each call made at once, inline). For a
    loop that cannot be written as one iterable (a folder walk that asks for its files' stats as it goes)."""

    def __init__(self, depth: int, threads: int = 2, name: str = "extractor") -> None:
        self.depth = depth
        self._pending: deque[Future[_R]] = deque()
        self._pool = ThreadPoolExecutor(max(1, min(threads, depth)), thread_name_prefix=name) if depth > 0 else None

    def submit(self, fn: Callable[..., _R], *args: Any) -> list[_R]:
        """Ask for ``fn(*args)`` (begun now); the results now due (those more than ``depth`` behind), in order."""
        if self._pool is None:
            return [fn(*args)]
        self._pending.append(self._pool.submit(fn, *args))
        due = []
        while len(self._pending) > self.depth:
            due.append(self._pending.popleft().result())
        return due

    def rest(self) -> Iterator[_R]:
        """The results still to come, in order."""
        while self._pending:
            yield self._pending.popleft().result()

    def __enter__(self) -> InOrder[_R]:
        return self

    def __exit__(self, *exc: object) -> None:
        for future in self._pending:  # (an error stopped the loop: what is not begun is not done)
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def prefetched(items: Iterable[_T], fn: Callable[[_T], _R], depth: int, threads: int = 2,
               name: str = "extractor") -> Generator[_R, None, None]:
    """``fn(item)`` for each item, in order, computed up to ``depth`` ahead on ``threads`` background threads
    (``pool.map`` computes all of them at once, holding every result until it is taken); ``depth`` 0: inline."""
    with InOrder[_R](depth, threads, name) as ahead:
        for item in items:
            yield from ahead.submit(fn, item)
        yield from ahead.rest()
