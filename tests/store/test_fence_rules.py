"""The fence's rule in this process, for `make check` (tests/store/test_fence.py proves it with paused job
processes and an S3 server, in `make test`): once another job's token is the store's, every write, replacement
and removal through the job's fenced store is refused and leaves the store's files as they were."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import zarr

from extractor.errors import FencedError
from extractor.store.fence import Fence, fenced_group, read_record, write_record


def files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def store(tmp_path: Path) -> tuple[str, zarr.Group]:
    """A local store job A holds (its lease record says A), with one array written through A's fence."""
    url = str(tmp_path / "s.zarr")
    zarr.open_group(url, mode="w")
    write_record(url, {"token": "A"})
    group = fenced_group(url, None, Fence(url, None, "A", read_token=lambda: None))
    group.create_array("x", shape=(4,), chunks=(2,), dtype="int32", fill_value=0)[:] = np.arange(4)
    return url, group


def test_the_holder_writes_and_a_job_whose_token_is_not_the_stores_writes_nothing(store: tuple[str, zarr.Group]):
    url, group = store
    group["x"][:2] = [7, 8]  # A holds the store: its writes land
    assert zarr.open_array(f"{url}/x", mode="r")[:].tolist() == [7, 8, 2, 3]

    write_record(url, {"token": "B"})  # B took the store over (A was paused past its lease)
    assert read_record(url)["token"] == "B"
    before = files(Path(url))
    with pytest.raises(FencedError):
        Fence(url, None, "A", read_token=lambda: None).check()
    for write in (lambda: group["x"].__setitem__(slice(0, 2), [1, 1]),  # a chunk replaced
                  lambda: group["x"].__setitem__(slice(2, 4), [0, 0]),  # a chunk removed (all fill values)
                  lambda: group.create_array("y", shape=(2,), dtype="int8"),  # a new array
                  lambda: group.attrs.update(status="complete")):  # the store's attributes
        with pytest.raises(FencedError):
            write()
        assert files(Path(url)) == before  # nothing landed, nothing removed
    assert zarr.open_array(f"{url}/x", mode="r")[:].tolist() == [7, 8, 2, 3]
