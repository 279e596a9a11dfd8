"""Listings streamed (issue 57), held at a part until a test lets them go, and compared with listings made whole."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

WAIT_S = 120  # a bound on waiting for an event, never a pause


class Held(threading.Event):
    """Set to let a listing held go on; ``reached``: set once the listing waits there."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = threading.Event()


def held_at(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, nth: int) -> Held:
    """``owner.name`` (a function, or a method of a class) waits at its call ``nth`` (from 0) until the event
    returned is set."""
    release, call, seen = Held(), getattr(owner, name), [0]

    def held(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        if seen[0] == nth + 1:
            release.reached.set()
            assert release.wait(WAIT_S), "the listing was never released: no shard ran while it listed"
        return call(*args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    return release


def same_rows(got: Any, want: Any, n: int, locators: Sequence[str] = ()) -> None:
    """Rows ``0:n`` of two listings hold the same ids, paths, labels, fingerprints (and ``locators``)."""
    assert n > 0
    assert np.asarray(got.ids[0:n]).tolist() == np.asarray(want.ids[0:n]).tolist()
    assert np.asarray(got.paths[0:n]).tolist() == np.asarray(want.paths[0:n]).tolist()
    assert np.asarray(got.labels[:n]).tolist() == np.asarray(want.labels[:n]).tolist()
    assert (got.fingerprints is None) == (want.fingerprints is None)  # (a manifest's: None, its workers take them)
    if want.fingerprints is not None:
        assert np.asarray(got.fingerprints[:n]).tolist() == np.asarray(want.fingerprints[:n]).tolist()
    for name in locators:
        assert np.asarray(got.locators[name][:n]).tolist() == np.asarray(want.locators[name][:n]).tolist()
