"""extractor.data.stream: batches decoded ahead in pieces (a task per run of rows, not per image), written into the
rows of reused buffers (Slots), a buffer taken again only once its batch is released."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from extractor.data.stream import BatchStream, Slots


class CountingPool(ThreadPoolExecutor):
    """A thread pool that counts the tasks it is given."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        self.tasks = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.tasks += 1
        return super().submit(fn, *args, **kwargs)


def decode(path: str) -> torch.Tensor:
    """A row's image: every pixel its row number (``bad``: fails; ``small``: the wrong size)."""
    if path.endswith("bad"):
        raise ValueError("not an image")
    side = 1 if path.endswith("small") else 2
    return torch.full((3, side, side), int(path.split("-")[1]), dtype=torch.uint8)


def paths(n: int, odd: dict[int, str] | None = None) -> list[str]:
    return [f"r-{i}" + (odd or {}).get(i, "") for i in range(n)]


def test_a_batch_is_decoded_in_pieces_into_its_buffer_and_the_buffer_is_used_again_once_released():
    slots = Slots(4, (3, 2, 2), torch.uint8)
    with CountingPool(2) as pool:
        stream = BatchStream(4, decode, pool, prefetch_batches=1, slots=slots, pieces=2)
        stream.add(paths(16))
        seen, batches = set(), 0
        while (batch := stream.next()) is not None:
            assert batch.images[:, 0, 0, 0].tolist() == batch.offsets  # each image in its own row
            seen.add(batch.images.data_ptr())
            batch.release()
            batches += 1
        assert pool.tasks == batches * 2 == 8  # two pieces a batch: no task per image
    assert len(seen) <= 3  # the batch taken, the one decoding ahead, and one more that was not yet released


def test_a_batch_never_released_keeps_its_images():
    slots = Slots(4, (3, 2, 2), torch.uint8)
    with ThreadPoolExecutor(2) as pool:
        stream = BatchStream(4, decode, pool, prefetch_batches=2, slots=slots)
        stream.add(paths(24))
        kept = []
        while (batch := stream.next()) is not None:
            kept.append(batch)
    assert [b.images[:, 0, 0, 0].tolist() for b in kept] == [b.offsets for b in kept]
    assert len({b.images.data_ptr() for b in kept}) == 6  # each in a buffer of its own


@pytest.mark.parametrize("pool_threads", [0, 2])
def test_rows_that_fail_are_left_out_and_the_others_gathered(pool_threads: int):
    slots = Slots(4, (3, 2, 2), torch.uint8)
    pool = ThreadPoolExecutor(pool_threads) if pool_threads else None
    try:
        stream = BatchStream(4, decode, pool, slots=slots)
        stream.add(paths(8, {1: "-bad", 6: "-small"}))
        first, second = stream.next(), stream.next()
    finally:
        if pool is not None:
            pool.shutdown()
    assert first.offsets == [0, 2, 3] and first.images[:, 0, 0, 0].tolist() == [0, 2, 3]
    assert first.failed == {1: "ValueError: not an image"}
    assert second.offsets == [4, 5, 7] and second.images[:, 0, 0, 0].tolist() == [4, 5, 7]
    assert second.failed == {6: "decoded to torch.Size([3, 1, 1]), not the model's input size"}
    assert first.give_back is None and second.give_back is None  # gathered rows are a copy: the buffers free at once
    assert slots.free
