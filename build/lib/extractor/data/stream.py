"""Batches of decoded images, decoded ahead on a thread pool across shard boundaries."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..faults import describe_error
from .files import Locator, content_digest

__all__ = ["Batch", "BatchStream", "iter_batches"]


@dataclass(frozen=True)
class Reused:
    """A row's values taken from another store instead of its decoded image (``output.reuse``): ``source``
    its place in that list; ``values`` per capture and extra, one row each."""

    source: int
    values: dict[str, Any]


@dataclass
class Batch:
    """Decoded images of one batch; ``offsets`` are row offsets within the shard."""

    offsets: list[int]  # rows that decoded, in order
    images: Any  # torch.Tensor (B, 3, H, W) uint8, or None when no image decoded (torch imported lazily)
    failed: dict[int, str]  # row offset -> error text
    digests: dict[int, int] = field(default_factory=dict)  # row offset -> content digest of the bytes it read
    reused: dict[int, Any] = field(default_factory=dict)  # row offset -> its values from another store (Reused)


class BatchStream:
    """Decoded batches of one shard's rows after another's.

    ``add(paths)`` queues a shard; ``next()`` returns the current shard's next batch, or
    None at its end (the call after that reads the following shard). A batch never spans
    two shards. Decoding runs ``prefetch_batches`` batches ahead on ``pool`` (inline when
    None), across shard boundaries: the next shard's first images decode while this shard's
    last batches compute. ``collate(items)`` turns a batch's decoded items into
    ``(images, {position: error})``; by default the items are uint8 tensors, stacked. With ``read``
    (a locator's bytes), ``decode`` takes those bytes, and each row's bytes get a content digest
    (also those of a row that fails to decode); without, ``decode`` takes the locator. ``reuse(digest)``
    gives a row's values from another store instead of its decoded image (or None: decode it).
    """

    def __init__(self, batch_size: int, decode, pool: ThreadPoolExecutor | None, prefetch_batches: int = 2,
                 collate=None, read=None, reuse=None) -> None:
        self.batch_size, self.decode, self.pool, self.collate, self.read = batch_size, decode, pool, collate, read
        self.reuse = reuse
        self.window = batch_size * (prefetch_batches + 1)  # rows decoding or decoded, not yet returned
        self.shards: deque[Sequence[Locator]] = deque()  # queued shards; [0] is being read
        self.pending: deque[Future] = deque()  # decodes in flight, in row order across shards
        self.sub_shard = self.sub_row = 0  # the next row to submit: shards[sub_shard][sub_row]
        self.row = 0  # the next row of shards[0] to return

    def add(self, paths: Sequence[Locator]) -> None:
        self.shards.append(paths)
        self._fill()

    def _safe(self, path: Locator) -> tuple[Any, str | None, int]:
        """(decoded item, None, digest) or (None, error, digest): any failure fails its row only."""
        digest = 0
        try:
            if self.read is None:
                return self.decode(path), None, 0
            data = self.read(path)
            digest = content_digest(data)
            reused = self.reuse(digest) if self.reuse is not None else None
            return (reused if reused is not None else self.decode(data)), None, digest
        except Exception as err:  # noqa: BLE001 - any read or decode failure fails its row only
            return None, describe_error(err), digest

    def _fill(self) -> None:
        while self.pool is not None and len(self.pending) < self.window and self.sub_shard < len(self.shards):
            paths = self.shards[self.sub_shard]
            if self.sub_row == len(paths):
                self.sub_shard, self.sub_row = self.sub_shard + 1, 0
                continue
            self.pending.append(self.pool.submit(self._safe, paths[self.sub_row]))
            self.sub_row += 1

    def next(self) -> Batch | None:
        import torch

        if not self.shards:
            return None
        paths = self.shards[0]
        if self.row == len(paths):  # this shard is over: the next call reads the following one
            self.shards.popleft()
            self.row = 0
            if self.sub_shard:
                self.sub_shard -= 1
            else:
                self.sub_row = 0
            return None
        start, stop = self.row, min(self.row + self.batch_size, len(paths))
        offsets, items, failed, digests, reused = [], [], {}, {}, {}
        for i in range(start, stop):
            self._fill()
            img, err, digest = self.pending.popleft().result() if self.pool is not None else self._safe(paths[i])
            if digest:
                digests[i] = digest
            if isinstance(img, Reused):
                reused[i] = img
            elif err is None:
                offsets.append(i)
                items.append(img)
            else:
                failed[i] = err
        self.row = stop
        self._fill()
        if self.collate is None or not items:
            images = torch.stack(items) if items else None
        else:
            images, bad = self.collate(items)
            for j, err in bad.items():
                failed[offsets[j]] = err
            offsets = [o for j, o in enumerate(offsets) if j not in bad]
        return Batch(offsets, images, dict(sorted(failed.items())), digests, reused)


def iter_batches(
    paths: Sequence[Locator],
    batch_size: int,
    decode,
    pool: ThreadPoolExecutor | None,
    prefetch_batches: int = 2,
    collate=None,
) -> Iterator[Batch]:
    """The batches of one shard's ``paths`` (see :class:`BatchStream`)."""
    stream = BatchStream(batch_size, decode, pool, prefetch_batches, collate)
    stream.add(paths)
    while (batch := stream.next()) is not None:
        yield batch
