"""Jobs interrupted after a number of shards (a resumable store left behind)."""

from __future__ import annotations

import pytest

from extractor.driver.runner import run
from extractor.spec.load import parse_spec


def interrupted_after(raw: dict, shards: int) -> None:
    """Run ``raw`` until ``shards`` shards are done, then interrupt it (Ctrl-C)."""
    done = []

    def stop(name: str, info: dict) -> None:
        if name == "shard_done":
            done.append(info["shard"])
            if len(done) == shards:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(parse_spec(raw), on_event=stop)
