"""Batches of decoded images, decoded ahead on a thread pool across shard boundaries."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..faults import describe_error
from .files import Locator, content_digest

__all__ = ["Batch", "BatchStream", "Slots", "iter_batches"]


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
    prints: dict[int, int] = field(default_factory=dict)  # row offset -> fingerprint of the file it read (local)
    give_back: Callable[[], None] | None = None  # gives ``images``' buffer back to the stream's slots (None: none)

    def release(self) -> None:
        """The caller is done with ``images`` (its values read, its copy to a device complete): the stream may
        write other images into its buffer. A batch never released keeps its buffer."""
        if self.give_back is not None:
            self.give_back()
            self.give_back = None


class Slots:
    """Batch buffers used again and again: the decode threads write each image into its row of one, so a batch is
    never stacked into fresh memory (at batch 256 of 224x224 images, 95 us of the main thread per image, against
    11 us into a buffer used before; issue 55). Page-locked where batches go to a CUDA device (their copy runs
    asynchronously). A buffer is lent to one batch at a time: it is taken again only once that batch was given
    back (:meth:`Batch.release`), so a batch that is never given back keeps its buffer (another one is made)."""

    def __init__(self, batch_size: int, shape: tuple[int, ...], dtype: Any, pin: bool = False) -> None:
        self.batch_size, self.shape, self.dtype, self.pin = batch_size, tuple(shape), dtype, pin
        self.free: deque[Any] = deque()  # buffers given back, (batch_size, *shape) torch tensors

    def take(self) -> Any:
        """A buffer no batch holds."""
        import torch

        if self.free:
            return self.free.pop()
        return torch.empty((self.batch_size, *self.shape), dtype=self.dtype, pin_memory=self.pin)

    def give_back(self, buffer: Any) -> None:
        self.free.append(buffer)

    def fits(self, img: Any) -> bool:
        """``img`` can be written into a row (a tensor of the buffers' row shape and dtype)."""
        return getattr(img, "shape", None) == self.shape and getattr(img, "dtype", None) == self.dtype


@dataclass
class _Piece:
    """What a decode thread made of a run of a batch's rows: the rows that decoded, each written into its row of
    the batch's buffer (``items`` None) or kept (``items``), and the others' errors, digests, reused values."""

    ok: list[int] = field(default_factory=list)  # positions in the batch, in order
    items: list[Any] | None = None  # the decoded items of ``ok`` where the batch has no buffer
    failed: dict[int, str] = field(default_factory=dict)  # row offset -> error text
    digests: dict[int, int] = field(default_factory=dict)
    reused: dict[int, Any] = field(default_factory=dict)
    prints: dict[int, int] = field(default_factory=dict)


@dataclass
class _Decoding:
    """A batch being decoded: rows ``start:stop`` of its shard, in ``pieces`` (futures, or done inline)."""

    start: int
    stop: int
    buffer: Any  # its Slots buffer, or None
    pieces: list[Any]  # Future[_Piece] (or _Piece, decoded inline)


class BatchStream:
    """Decoded batches of one shard's rows after another's.

    ``add(paths)`` queues a shard; ``next()`` returns the current shard's next batch, or
    None at its end (the call after that reads the following shard). A batch never spans
    two shards. Decoding runs ``prefetch_batches`` batches ahead on ``pool`` (inline when
    None), across shard boundaries: the next shard's first images decode while this shard's
    last batches compute. A batch is decoded in ``pieces`` runs of rows, one task each (not one per image).
    With ``slots`` (:class:`Slots`), each image is written into its row of a reused buffer by its decode thread;
    the batch gives the buffer back once released. Otherwise ``collate(items)`` turns a batch's decoded items into
    ``(images, {position: error})``; by default the items are uint8 tensors, stacked. With ``read``
    (a locator's bytes and the fingerprint of the file read: :func:`~extractor.data.sources.read_printed`),
    ``decode`` takes those bytes, and each row's bytes get a content digest (also those of a row that fails to
    decode) and its fingerprint is kept (where not 0); without, ``decode`` takes the locator. ``reuse(digest)``
    gives a row's values from another store instead of its decoded image (or None: decode it).
    """

    def __init__(self, batch_size: int, decode, pool: ThreadPoolExecutor | None, prefetch_batches: int = 2,
                 collate=None, read=None, reuse=None, slots: Slots | None = None, pieces: int = 4) -> None:
        self.batch_size, self.decode, self.pool, self.collate, self.read = batch_size, decode, pool, collate, read
        self.reuse, self.slots, self.pieces = reuse, slots, max(1, pieces)
        self.ahead = prefetch_batches + 1  # batches decoding or decoded, not yet returned
        self.shards: deque[Sequence[Locator]] = deque()  # queued shards; [0] is being read
        self.pending: deque[_Decoding] = deque()  # batches submitted, in row order across shards
        self.sub_shard = self.sub_row = 0  # the next row to submit: shards[sub_shard][sub_row]
        self.row = 0  # the next row of shards[0] to return

    def add(self, paths: Sequence[Locator]) -> None:
        self.shards.append(paths)
        self._fill()

    def _safe(self, path: Locator) -> tuple[Any, str | None, int, int]:
        """(decoded item, None, digest, fingerprint) or (None, error, digest, fingerprint): any failure fails its
        row only."""
        digest = printed = 0
        try:
            if self.read is None:
                return self.decode(path), None, 0, 0
            data, printed = self.read(path)
            digest = content_digest(data)
            reused = self.reuse(digest) if self.reuse is not None else None
            return (reused if reused is not None else self.decode(data)), None, digest, printed
        except Exception as err:  # noqa: BLE001 - any read or decode failure fails its row only
            return None, describe_error(err), digest, printed

    def _piece(self, paths: Sequence[Locator], start: int, first: int, stop: int, buffer: Any) -> _Piece:
        """On a decode thread: rows ``first:stop`` of a batch that begins at row ``start``, each written into its
        row of ``buffer`` where it has one and the image fits."""
        piece = _Piece(items=None if buffer is not None else [])
        for i in range(first, stop):
            img, err, digest, printed = self._safe(paths[i])
            if digest:
                piece.digests[i] = digest
            if printed:
                piece.prints[i] = printed
            if err is not None:
                piece.failed[i] = err
            elif isinstance(img, Reused):
                piece.reused[i] = img
            elif piece.items is not None:
                piece.ok.append(i - start)
                piece.items.append(img)
            elif self.slots is not None and self.slots.fits(img):
                buffer[i - start].copy_(img)
                piece.ok.append(i - start)
            else:  # the decoder's promise broken (its preprocessing's size): said, never stacked otherwise
                piece.failed[i] = f"decoded to {getattr(img, 'shape', type(img).__name__)}, not the model's input size"
        return piece

    def _fill(self) -> None:
        """Submit whole batches, in order across shards, until ``prefetch_batches`` are decoding ahead."""
        while self.pool is not None and len(self.pending) < self.ahead and self.sub_shard < len(self.shards):
            paths = self.shards[self.sub_shard]
            if self.sub_row == len(paths):
                self.sub_shard, self.sub_row = self.sub_shard + 1, 0
                continue
            self.pending.append(self._submit(paths, self.sub_row))
            self.sub_row = self.pending[-1].stop

    def _submit(self, paths: Sequence[Locator], start: int) -> _Decoding:
        """The batch of ``paths`` that begins at row ``start``, cut into pieces for the pool (inline without one)."""
        stop = min(start + self.batch_size, len(paths))
        buffer = self.slots.take() if self.slots is not None else None
        step = -(-(stop - start) // self.pieces)
        cuts = range(start, stop, step)
        if self.pool is None:
            return _Decoding(start, stop, buffer, [self._piece(paths, start, a, min(a + step, stop), buffer)
                                                   for a in cuts])
        return _Decoding(start, stop, buffer, [self.pool.submit(self._piece, paths, start, a, min(a + step, stop),
                                                                buffer) for a in cuts])

    def next(self) -> Batch | None:
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
        self._fill()
        decoding = self.pending.popleft() if self.pool is not None else self._submit(paths, self.row)
        self.row = decoding.stop
        self._fill()
        pieces = [p.result() for p in decoding.pieces] if self.pool is not None else decoding.pieces
        return self._batch(decoding, pieces)

    def _batch(self, decoding: _Decoding, pieces: list[_Piece]) -> Batch:
        """The batch its pieces make."""
        ok = [j for p in pieces for j in p.ok]
        failed, digests, reused, prints = {}, {}, {}, {}
        for p in pieces:
            failed.update(p.failed)
            digests.update(p.digests)
            reused.update(p.reused)
            prints.update(p.prints)
        offsets = [decoding.start + j for j in ok]
        if decoding.buffer is not None:
            images, release = self._from_buffer(decoding, ok)
        else:
            images, release = self._collated([x for p in pieces for x in p.items or ()], offsets, failed), None
            offsets = [o for o in offsets if o not in failed]
        return Batch(offsets, images, dict(sorted(failed.items())), digests, reused, prints, release)

    def _from_buffer(self, decoding: _Decoding, ok: list[int]) -> tuple[Any, _Release | None]:
        """The images of a batch decoded into its buffer (rows ``ok``), and what gives the buffer back."""
        import torch

        buffer = decoding.buffer
        assert self.slots is not None  # a buffer comes from the slots
        if len(ok) == decoding.stop - decoding.start:  # every row decoded (the usual case): the buffer itself
            return buffer[: len(ok)], _Release(self.slots, buffer)
        images = buffer[torch.as_tensor(ok, dtype=torch.long)] if ok else None  # the decoded rows gathered:
        self.slots.give_back(buffer)  # the buffer is free again at once
        return images, None

    def _collated(self, items: list[Any], offsets: list[int], failed: dict[int, str]) -> Any:
        """The images of a batch's decoded ``items`` (rows ``offsets``): stacked, or by ``collate``, whose
        rejected items join ``failed``."""
        import torch

        if not items:
            return None
        if self.collate is None:
            return torch.stack(items)
        images, bad = self.collate(items)
        for j, err in bad.items():
            failed[offsets[j]] = err
        return images


class _Release:
    """Gives a batch's buffer back to its slots, once."""

    def __init__(self, slots: Slots, buffer: Any) -> None:
        self.slots, self.buffer = slots, buffer

    def __call__(self) -> None:
        if self.buffer is not None:
            self.slots.give_back(self.buffer)
            self.buffer = None


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
