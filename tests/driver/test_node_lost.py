"""Which worker failures count as their node's loss (no shard blamed): a node killed at once with its workers is
heard of by the connection or by the GCS first, depending on the load; both are the node's."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError  # noqa: E402

from extractor.driver import schedule  # noqa: E402


class _Died(ActorDiedError):
    def __init__(self, message: str) -> None:
        super().__init__()
        self.error_msg = message


@pytest.mark.parametrize(("err", "nodes", "lost"), [
    (ActorUnavailableError("connection reset", b"\0" * 16), [], True),
    (_Died("The actor died because its node has died. Node Id: b0"), [{"NodeID": "b0", "Alive": True}], True),
    (_Died("The actor is dead because its worker process has died."), [{"NodeID": "b0", "Alive": False}], True),
    (_Died("The actor is dead because its worker process has died."), [{"NodeID": "b0", "Alive": True}], False),
    (_Died("The actor is dead because its worker process has died."), [{"NodeID": "a1", "Alive": False}], False),
    (RayTaskError("run_shard", "Traceback ...", ValueError("bad shard")), [{"NodeID": "b0", "Alive": False}], False),
])
def test_a_death_is_the_nodes_when_ray_says_so_or_counts_the_node_dead(monkeypatch, err, nodes, lost):
    monkeypatch.setattr(schedule.ray, "nodes", lambda: nodes)
    assert schedule._node_lost(err, "b0") is lost
