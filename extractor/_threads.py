"""Work done a few items ahead, on background threads, taken in order (the ground floor: stdlib only)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["prefetched"]

_T = TypeVar("_T")
_R = TypeVar("_R")


def prefetched(items: Iterable[_T], fn: Callable[[_T], _R], depth: int, threads: int = 2,
               name: str = "extractor") -> Generator[_R, None, None]:
    """``fn(item)`` for each item, in order, computed up to ``depth`` ahead on ``threads`` background threads
    (``pool.map`` computes all of them at once, holding every result until it is taken); ``depth`` 0: inline."""
    if depth <= 0:
        yield from (fn(i) for i in items)
        return
    pending: deque[Future[_R]] = deque()
    with ThreadPoolExecutor(max(1, min(threads, depth)), thread_name_prefix=name) as pool:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) > depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
