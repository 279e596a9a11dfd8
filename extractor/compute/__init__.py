"""A worker's computing: the model held for the job, the pipeline of shards through it, a shard's results on
the host. The same code runs in-process and in a Ray actor. Imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:
    from .pipeline import CallbackError, Forwarder, Pipeline, ShardQueue
    from .shard import Forwarded, ShardInput, ShardOutput, ShardSummary
    from .worker import PROBE_FORWARDS, Worker, decode_threads

__all__ = [
    "Worker",
    "decode_threads",
    "PROBE_FORWARDS",
    "Pipeline",
    "ShardQueue",
    "CallbackError",
    "Forwarder",
    "ShardSummary",
    "ShardInput",
    "Forwarded",
    "ShardOutput",
]

# a name of the face is never a module's name too: the module, once imported, would shadow it
__getattr__ = face(
    __name__,
    {
        "Worker": "worker",
        "decode_threads": "worker",
        "PROBE_FORWARDS": "worker",
        "Pipeline": "pipeline",
        "ShardQueue": "pipeline",
        "CallbackError": "pipeline",
        "Forwarder": "pipeline",
        "ShardSummary": "shard",
        "ShardInput": "shard",
        "Forwarded": "shard",
        "ShardOutput": "shard",
    },
)
