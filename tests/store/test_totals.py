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
