"""The post-hoc pass: a feature index of a capture made in one pass over the store's ok rows (its channels or
features, or a dictionary's latents), written into it as ``indexes/<name>`` (numpy and
zarr; the encoder in torch where it is installed).

    >>> ix = index("out.zarr", "blocks.11", dictionary="sae/")   # one pass; written into the store; read back
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .._machine import Machine
from .._threads import prefetched
from ..errors import StoreError
from ..read import ActivationStore, open_store
from ..spec import index_name_problem
from ..store import OK, Generation, Objects
from .dictionary import Dictionary, load_dictionary
from .feed import BLOCK_VALUES, ENCODE_VALUES, IndexFeed, Layout
from .layout import index_name, index_record, pointer, source_state, write_index
from .reader import FeatureIndex, _layout, _store, index_names, open_index

__all__ = ["index"]

log = logging.getLogger(__name__)
# A pass adds chunks on lanes, one per CPU while memory holds them (Machine.index_lanes; 2 cores, SAE of 4,096 latents
# over 2,000 images: 1.5x the bare loop's time on one lane, 1.2x on two; raw channels of a 1,024-channel map: 5.0 s on
# one, 3.5 s on two), each reading Machine.read_ahead chunks ahead (zarr decodes on the reading threads)


def _dictionary(dictionary: str | Path | Dictionary | None, activation: str | None) -> Dictionary | None:
    if dictionary is None or isinstance(dictionary, Dictionary):
        return dictionary
    return load_dictionary(dictionary, activation)


def index(store_or_path: ActivationStore | str | Path, key: str, dictionary: str | Path | Dictionary | None = None,
          k: int = 16, pool: str = "max", name: str | None = None, *, threshold: float = 0.0,
          activation: str | None = None, include_prefix: bool = False, normalize: str | Sequence[str] | None = None,
          atlas: bool = True, on_progress: Callable[[int], None] | None = None,
          storage_options: Mapping[str, Any] | None = None) -> FeatureIndex:
    """Index the features of capture ``key`` (its channels or features, or the latents of ``dictionary``: a file,
    see :func:`~extractor.index.dictionary.load_dictionary`) over the store's ok rows in one pass, write it into
    the store as ``indexes/<name>`` (default: ``key``, or ``key@<dictionary stem>``) and return it.

    ``k`` top rows per feature, ranked by the feature pooled over the row's positions by ``pool`` (max or mean); a
    feature fires where it is above ``threshold``. The positions of a token sequence are its patches: its prefix
    tokens (CLS, registers), which its heatmaps leave out, are left out of every count too, unless
    ``include_prefix`` (where the store does not record them, every token is indexed). ``normalize`` (``"mean"``,
    ``"norm"`` or both) scales each token first as ``token_batches(normalize=..., drop_prefix=...)`` of the same
    tokens does, from the same statistics (of the patches alone where the prefix tokens are left out): an SAE
    trained on normalised tokens sees its inputs at its scale. With ``atlas`` (the default), a bounded second pass
    adds each feature's neighbours and a map of all (:func:`~extractor.index.atlas.add_atlas`). The pass reads the
    store as it was committed when it was opened;
    the index is named in the store by one swap of its attributes (:func:`~.layout.write_index`): where another
    process wrote an index of that name meanwhile, this one is refused, and nothing of it is named.
    ``on_progress(rows)`` is called as rows are done; ``storage_options``: fsspec options of a remote store given
    by its URL."""
    if name is not None:
        _checked_name(name)  # before anything is read or said
    store = _store(store_or_path, storage_options)
    layout = _layout(store, key, include_prefix)
    dic, k = _settings(store, key, layout, dictionary, activation, k, threshold)
    scaled = _normalization(store, key, layout, normalize)
    feed = IndexFeed(layout, k, pool, threshold, dic, scaled)
    name = _checked_name(name or index_name(key, dic.stem if dic is not None else None))
    generation = _generation(store)
    at = _writable(store, lambda: pointer(generation, name))
    state = source_state(store.group)
    t0 = time.perf_counter()
    _pass(store, key, feed, on_progress)
    log.info("indexed %d features of %s over %d rows in %.1f s", feed.state.features, key, feed.state.rows,
             time.perf_counter() - t0)
    said = None if normalize is None else {
        "asked": [normalize] if isinstance(normalize, str) else list(normalize), "scale": scaled[1],
        "shifted": scaled[0] is not None, "over": "patches" if layout.covers == "patches" else "every token"}
    record = index_record(name, key, feed, dic.record() if dic is not None else None, state, "post-hoc",
                          include_prefix, said)
    _say_replaced(store, name)
    if not _writable(store, lambda: write_index(generation, name, feed.state.finish(), record, at)):
        raise StoreError(f"index {name} of {store.url} was written by another process while this one made it; open "
                         "that one (extractor index STORE --name ...), or run again to replace it")
    made = open_store(store.url, store.storage_options)
    if atlas:
        from .atlas import add_atlas

        return add_atlas(made, name)
    return open_index(made, name)


def _settings(store: ActivationStore, key: str, layout: Layout, dictionary: str | Path | Dictionary | None,
              activation: str | None, k: int, threshold: float) -> tuple[Dictionary | None, int]:
    """The dictionary an index encodes with, checked against the capture, and its k (at most the ok rows: the same
    index in slots that exist); a one-line error for settings that make no index."""
    if activation is not None and dictionary is None:
        raise StoreError(f"an activation ({activation}) applies to a dictionary's latents: give the dictionary too, "
                         f"or leave the activation out to index {key}'s own features")
    dic = _dictionary(dictionary, activation)
    if dic is not None:
        dic.check_input(layout.features, f"capture {key} {list(store.captures[key]['shape'])}")
    if k < 1:
        raise ValueError(f"k must be >= 1, not {k}")
    if not (math.isfinite(threshold) and threshold >= 0):
        raise StoreError(f"threshold must be a finite number >= 0 (a feature fires above it), not {threshold}")
    rows = max(int((store.status == OK).sum()), 1)
    if k > rows:
        log.warning("k %d is more than the %d ok rows of %s: the index keeps them all (k %d)", k, rows, store.url, rows)
    return dic, min(k, rows)


def _normalization(store: ActivationStore, key: str, layout: Layout,
                   normalize: str | Sequence[str] | None) -> tuple[np.ndarray | None, float | None]:
    """What the index subtracts and divides each position's features by: the store's statistics of the tokens it
    covers, as ``token_batches`` reads them (``extractor.read.batching``); nothing without ``normalize``."""
    if normalize is None:
        return None, None
    if layout.kind != "tokens":
        raise StoreError(f"normalize={normalize!r} scales the tokens of a token sequence as token_batches streams "
                         f"them; {key} is no token sequence: leave normalize out")
    return store.normalization(key, normalize, layout.skip)


def _generation(store: ActivationStore) -> Generation:
    """The generation the store was opened at (an index of a store made again since is refused)."""
    name = store.attrs.get("generation")
    if name is None:
        raise StoreError(f"{store.url} was made by an older extractor (format {store.attrs.get('format_version')}): "
                         "make it again (extractor run --overwrite) to index it")
    generation = Generation(Objects.at(store.url, store.storage_options), str(name))
    if not generation.still_live():
        raise StoreError(f"{store.url} was made again since it was opened: open it again")
    return generation


_T = TypeVar("_T")


def _writable(store: ActivationStore, step: Callable[[], _T]) -> _T:
    """``step``'s result; a storage that cannot be written here said in one line (the index is kept in the store)."""
    try:
        return step()
    except StoreError:
        raise
    except OSError as err:
        raise StoreError(f"{store.url}: the index is written into the store, which cannot be written here "
                         f"({err.strerror or err}); index a writable copy of it") from None


def _say_replaced(store: ActivationStore, name: str) -> None:
    """Warn that index ``name``, which the store holds, is about to be replaced (the new one written beside it,
    then named in its place)."""
    if name in index_names(store):
        old: dict[str, Any] = dict(open_index(store, name).attrs)
        dic = old.get("dictionary")
        log.warning("replacing index %s of %s (%s features of %s%s, k %s, pool %s, %s rows)", name, store.url,
                    old.get("features"), old.get("key"), f" through {dic['path']}" if dic else "", old.get("k"),
                    old.get("pool"), old.get("rows"))


def _checked_name(name: str) -> str:
    """``name``, when it can name an index group in the store (:func:`~extractor.spec.index_name_problem`)."""
    problem = index_name_problem(name)
    if problem is not None:
        raise StoreError(problem)
    return name


def _pass(store: ActivationStore, key: str, feed: IndexFeed, on_progress: Callable[[int], None] | None) -> None:
    """Feed the ok rows of ``key`` to ``feed``, a chunk at a time in row order (the blocks a job's writer meets).
    The chunks are added on lanes (threads: :meth:`Machine.index_lanes`), each adding every n-th chunk in order to a
    lane of the state
    (:meth:`~extractor.index.state.IndexState.lane`: counts of its own, the top rows and examples shared),
    joined at the end: the same index (slots hold the same rows in any order; the counts' partition is fixed), in
    the time the parts take side by side (the compiled passes, numpy's loops and the encoder's matmul let go of the
    GIL). Memory: one state's slots, counts per lane, and a block of latents per lane."""
    arr = store[key]
    step = int(arr.chunks[0])
    status = store.status
    starts = [a for a in range(0, len(status), step) if (status[a : a + step] == OK).any()]
    machine = Machine.here()
    chunk_bytes = step * int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
    block_bytes = 4 * (BLOCK_VALUES if feed.encoder is None else ENCODE_VALUES)  # float32 latents of one block
    lanes = [feed, *(feed.lane() for _ in range(machine.index_lanes(block_bytes + (machine.read_ahead + 1)
                                                                     * chunk_bytes) - 1))]
    lock = threading.Lock()

    def read(a: int) -> tuple[np.ndarray, np.ndarray]:
        ok = np.flatnonzero(status[a : a + step] == OK)
        return a + ok, np.asarray(arr[a : a + step])[ok]

    def lane(i: int) -> None:
        for rows, x in prefetched(starts[i :: len(lanes)], read, machine.read_ahead, threads=2,
                                  name="extractor-index"):
            lanes[i].add(x, rows)
            if on_progress is not None:
                with lock:
                    on_progress(len(rows))

    with ThreadPoolExecutor(len(lanes), thread_name_prefix="extractor-index-lane") as pool:
        for done in [pool.submit(lane, i) for i in range(len(lanes))]:
            done.result()
    for other in lanes[1:]:
        feed.state.join(other.state)
