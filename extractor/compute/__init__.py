"""A worker's computing: the model held for the job, the pipeline of shards through it, a shard's results on
the host. The same code runs in-process and in a Ray actor. Imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .pipeline import CallbackError, Pipeline, Ready, ShardQueue
    from .shard import ShardInput, ShardOutput, ShardSummary
    from .worker import PROBE_FORWARDS, Worker, decode_threads, host_array

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
