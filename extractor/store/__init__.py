"""The Zarr store: its generations, ledger and claimants (how its changes become commits), its format and arrays,
a shard's writer, whole-chunk writes, statistics, rows taken from other stores (numpy and zarr only; bfloat16
through ml_dtypes); its record of the job and the resume contract (provenance).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._face import face

if TYPE_CHECKING:  # the face: what other layers may import, each name once
    from .chunks import ChunkCodec, array_objects, read_all, read_at_once, write_chunks
    from .claimants import Claimant, alive
    from .dtypes import BFLOAT16, is_bfloat16, numpy_dtype
    from .forward import ForwardRecord, forward_differences, forward_record
    from .generation import FORMAT, Generation, done_shards, open_group, read_head, read_state
    from .id_index import ID_INDEX, SortedIds, id_index_objects, read_id_index, write_id_index
    from .layout import (
        ATTR,
        FAILED,
        FORMAT_VERSION,
        OK,
        ONCE_ARRAYS,
        ROW_ARRAYS,
        STATUS_NAMES,
        CaptureRecord,
        ExtraRecord,
        RowsBehind,
        StoreArrays,
        create_generation,
        disk_usage,
        fill_value,
        get_array,
        locator_arrays,
        now,
        once_rows,
        read_rows,
        root_attrs,
        take_rows,
    )
    from .ledger import Ledger, Table, blocks_for, new_id
    from .objects import Objects
    from .provenance import (
        Probe,
        StoreRecord,
        changed_rows,
        check_resumable,
        chunking,
        differences,
        model_differences,
        owner,
        store_attrs,
    )
    from .recorded import StoredRows, current_places, source_digests, stored_rows
    from .reuse import ReuseIndex, check_sources
    from .sampling import BY_DIGEST, draw_keys, projection_matrix, rank_keys
    from .session import Decision, IndexHooks, Outcome, StoreSession, live_claimants
    from .snapshot import snapshot_store
    from .stats import Fresh, ShardStats, Totals, dumps, feature_axis, merge, merge_shards, shard_record
    from .synthetic import create_store
    from .tokens import TokenRecord, patch_span
    from .writer import ShardWriter, Ticket

# a name of the face is never a module's name too: the module, once imported, would shadow it
__all__, __getattr__ = face(__name__, __file__)
