"""A source's own per-row arrays (``Source.locators``), written and read back by the store without knowing the
source: a toy source whose images are byte ranges of one file, named by (path, start, stop). The store writes the
arrays its rows carry as declared, a shard's writer and the reader hand back ``(path, *values)``, the digests are
of the bytes the source's own read gives, and a resume sees the arrays that moved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from extractor.data import LocatorArray, Rows
from extractor.data import sources as registry
from extractor.data.sources import Source
from extractor.read.reader import open_store
from extractor.store import ShardWriter, StoreArrays, create_store, source_digests
from extractor.store.provenance import moved_locators
from extractor.store.synthetic import ticket


class Ranges(Source):
    """Images as byte ranges ``[start, stop)`` of one file; its locator is ``(path, start, stop)``."""

    name = "ranges"
    locators = (LocatorArray("range_start", "int64", -1), LocatorArray("range_stop", "uint32", 0))

    def list(self, data: Any) -> Rows:
        raise NotImplementedError

    def reads(self, item: Any) -> bool:
        return isinstance(item, tuple) and len(item) == 3

    def read(self, item: Any, storage_options: dict | None, outside_root: bool) -> bytes:
        path, start, stop = item
        return Path(path).read_bytes()[start:stop]


@pytest.fixture
def ranges(monkeypatch: pytest.MonkeyPatch) -> Ranges:
    """The toy source registered first (its tuples read by it, not by a source that claims every tuple)."""
    source = Ranges()
    monkeypatch.setattr(registry, "REGISTRY", {"ranges": "ranges", **registry.REGISTRY})
    monkeypatch.setitem(registry._LOADED, "ranges", source)
    return source


def test_a_sources_locator_arrays_are_stored_and_read_back_as_it_declares(ranges: Ranges, tmp_path: Path):
    blob = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    blob.write_bytes(data)
    n = 10
    starts = np.arange(n) * 300 + 7
    stops = starts + np.arange(n) * 11 + 5
    rows = Rows(ids=[f"r{i}" for i in range(n)], paths=[str(blob)] * n, labels=[-1] * n,
                locators={"range_start": starts, "range_stop": stops})
    url = str(tmp_path / "s.zarr")
    arrays = StoreArrays(captures={}, extras={}, shard_size=4, chunk_rows={}, locators=ranges.locators)
    group = create_store(url, rows, arrays, attrs={"n_rows": n, "n_shards": 3, "captures": {}, "format_version": 1,
                                                   "spec": {"data": {"source": "ranges"}}, "model": {}}, pending=True)
    for declared in ranges.locators:  # as the source declares them: name, type, fill
        stored = group[declared.name]
        assert stored.dtype == np.dtype(declared.dtype) and stored.fill_value == declared.fill
    np.testing.assert_array_equal(group["range_start"][:], starts)
    np.testing.assert_array_equal(group["range_stop"][:], stops)

    expected = [(str(blob), int(a), int(b)) for a, b in zip(starts, stops, strict=True)]
    paths, _ = ShardWriter(url, 4, 8, 1, ticket=ticket(url)).opening()
    assert paths == expected[4:8]
    assert open_store(url).locator(9) == expected[9]

    digests = source_digests(group, np.array([0, 3, 9]))
    assert digests == [xxhash.xxh3_64_intdigest(data[a:b]) or 1 for _, a, b in (expected[i] for i in (0, 3, 9))]

    assert moved_locators(group, rows) is None  # as stored
    moved = Rows(ids=rows.ids, paths=rows.paths, labels=rows.labels,
                 locators={"range_start": starts + 1, "range_stop": stops})
    got = moved_locators(group, moved)
    assert got is not None and sorted(got) == ["range_start", "range_stop"]
    np.testing.assert_array_equal(got["range_start"], starts + 1)


def test_rows_without_a_declared_locator_are_refused(ranges: Ranges, tmp_path: Path):
    rows = Rows(ids=["a"], paths=["p"], labels=[-1], locators={"range_start": [0]})
    arrays = StoreArrays(captures={}, extras={}, shard_size=4, chunk_rows={}, locators=ranges.locators)
    with pytest.raises(ValueError, match="no 'range_stop' column"):
        create_store(str(tmp_path / "s.zarr"), rows, arrays, attrs={"spec": {"data": {"source": "ranges"}}})
