"""A job whose images take a while each (a slow toy model), for tests that act while it runs."""

from __future__ import annotations

from pathlib import Path

from helpers.jobs import job


def slow_job(root: Path, store: Path, **cluster) -> dict:
    return job(root, store, model={"name": None, "factory": "toy_models:slow_net", "device": "cpu"},
               data={"resize": None, "crop": 32, "shard_size": 2, "batch_size": 1, "decode_workers": 1},
               capture=[{"layer": "conv", "reduce": "mean"}, {"layer": "conv", "key": "map"}],
               output={"store": str(store), "chunk_rows": 1},
               cluster={"backend": "ray", **cluster})
