"""Statistics totals that a signal cuts short are never kept (issue 54: a SIGTERM while the driver merged a shard
left a partial whose capture had no sums, and every resume after it failed in the end merge with KeyError)."""

from __future__ import annotations

import numpy as np
import pytest

import extractor.store.stats as st
from extractor.store.stats import ShardStats, Totals, dumps


def _record(seed: int) -> str:
    one = ShardStats(["x.feature"], [3])
    one.update(np.random.default_rng(seed).standard_normal((4, 3)).astype(np.float32), np.arange(4))
    return dumps({"x": one})


def test_totals_cut_short_by_a_signal_are_torn_and_a_torn_partial_is_refused(monkeypatch: pytest.MonkeyPatch):
    whole = Totals(2)
    assert whole.add(0, _record(0)) and not whole.add(0, _record(0)) and not whole.torn
    cut = Totals(2)

    def interrupted(a, d):  # a SIGTERM's exception in the middle of a record's add
        raise KeyboardInterrupt

    monkeypatch.setattr(st, "_add_besides", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cut.add(0, _record(0))
    assert cut.torn  # the session neither leaves nor merges such totals
    monkeypatch.undo()
    again = Totals.from_bytes(whole.to_bytes(), 2)
    assert again is not None and again.summary() == whole.summary()
    torn = Totals(2)  # as an earlier version left it: a capture's entry made, its sums not yet
    torn.held[0] = True
    torn.acc["x"] = {"min": None, "max": None, "nonfinite_rows": [], **dict.fromkeys(st._SCALARS, 0)}
    assert Totals.from_bytes(torn.to_bytes(), 2) is None  # refused: its shards' records are read instead


def test_index_parts_merged_with_the_sums_travel_in_the_partials_and_are_absorbed_once():
    """Totals given a job's write-time indexes (``fresh``) merge each shard's parts with its record, write them in
    their bytes with the shards they hold, read them back only with ``fresh``, and absorb another's (the union of
    their shards); a part of a shard the totals do not hold is not taken."""
    from extractor.index.state import IndexState

    def fresh(key: str) -> IndexState | None:
        return IndexState(3, 2, k=2) if key == "x" else None

    def part(seed: int, rows: range) -> np.ndarray:
        state = IndexState(3, 2, k=2)
        state.update(np.random.default_rng(seed).standard_normal((len(rows), 2, 3)).astype(np.float32),
                     np.asarray(rows))
        return state.to_bytes()

    a, b, whole = Totals(4, fresh), Totals(4, fresh), IndexState(3, 2, k=2)
    for shard, totals in ((0, a), (1, a), (2, b), (3, b)):
        blob = part(shard, range(4 * shard, 4 * shard + 4))
        totals.add(shard, _record(shard), 7, {"x": blob, "other": blob})
        one = IndexState(3, 2, k=2)
        assert one.load(blob)
        whole.merge(one)
    assert list(a.parts) == ["x"] and a.parts_held["x"].tolist() == [True, True, False, False]
    assert Totals.from_bytes(a.to_bytes(), 4).parts == {}  # (without fresh: its shards' parts read at the end)
    back = Totals.from_bytes(b.to_bytes(), 4, fresh)
    assert back is not None and back.parts_held["x"].tolist() == [False, False, True, True]
    assert a.absorb(back) and a.parts_held["x"].all() and not a.absorb(Totals.from_bytes(b.to_bytes(), 4, fresh))
    merged, direct = a.parts["x"].finish(), whole.finish()  # each shard's part once (sums: to rounding)
    for name, value in vars(direct).items():
        np.testing.assert_allclose(getattr(merged, name), value, rtol=1e-12, err_msg=name)
    odd = Totals(4, fresh)
    odd.add(0, _record(0), 7, {"x": part(0, range(4))})
    odd.parts_held["x"][1] = True  # a part said to hold a shard the totals do not
    assert Totals.from_bytes(odd.to_bytes(), 4, fresh).parts == {}


def test_parts_that_find_the_merger_busy_are_left_to_the_end_and_the_rest_merged_once():
    """The driver's events never wait on a merge: parts offered while the merger's queue is full are left (the
    store's end reads them); those merged and those left make the whole index, each shard once."""
    from extractor.index.state import IndexState
    from extractor.store.stats import PartMerger

    def fresh(key: str) -> IndexState:
        return IndexState(3, 2, k=2)

    totals, whole = Totals(6, fresh), IndexState(3, 2, k=2)
    merger, blobs = PartMerger(totals, depth=2), {}
    with merger.held():  # the merger busy: at most one taken, two waiting
        for shard in range(6):
            state = IndexState(3, 2, k=2)
            state.update(np.random.default_rng(shard).standard_normal((4, 2, 3)).astype(np.float32),
                         np.arange(4 * shard, 4 * shard + 4))
            blobs[shard] = state.to_bytes()
            whole.merge(state)
            assert totals.add(shard, _record(shard), 7)
            merger.offer(shard, {"x": blobs[shard]})
    merger.drain()
    held = totals.parts_held["x"]
    assert merger.left >= 3 and int(held.sum()) + merger.left == 6
    end = totals.parts["x"]
    for shard in np.flatnonzero(~held).tolist():  # what the end reads from the store
        one = IndexState(3, 2, k=2)
        assert one.load(blobs[shard])
        end.merge(one)
    merged, direct = end.finish(), whole.finish()
    for name, value in vars(direct).items():
        np.testing.assert_allclose(getattr(merged, name), value, rtol=1e-12, err_msg=name)
