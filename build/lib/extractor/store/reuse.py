"""Rows taken from other stores by content (``output.reuse``): a row whose image bytes (content digest)
another store computed with the same model, preprocessing and captures is copied from there, not computed.

:func:`check_sources` decides, on the driver and before the store is touched, that each store listed can
give rows: every input of the values is compared (weights hash, the forward's summary, preprocessing, the
spec's settings that change values, each capture's record), so a stale reuse cannot happen; library versions
that differ are warned of, as on resume. :class:`ReuseIndex` is each worker's lookup, digest -> (store, row), and the
rows' values, read a chunk at a time. Needs only numpy and zarr.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zarr

from ..data import Reused, from_dict
from ..errors import StoreError
from ..spec import SOURCE_ONLY
from .forward import forward_differences
from .generation import open_group
from .layout import OK, PREPROCESS_FIELDS, get_array, root_attrs

__all__ = ["ReuseIndex", "check_sources"]

log = logging.getLogger(__name__)

# data settings that say where the images are, not what they become: they may differ between the stores
_PLACE_FIELDS = ("source", *SOURCE_ONLY, "split", "config", "extensions", "shard_size", "outside_root",
                 "max_image_pixels")


def _spec_inputs(attrs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The spec's model settings (not which model: the weights hash and class say it) and its data settings that
    change pixels, as a store recorded them."""
    from ..spec import content_of

    spec = content_of(copy.deepcopy(attrs.get("spec") or {}))
    model_spec = {k: v for k, v in (spec.get("model") or {}).items() if k not in ("name", "weights", "factory")}
    data_spec = {k: v for k, v in (spec.get("data") or {}).items() if k not in _PLACE_FIELDS}
    return model_spec, data_spec


def _value_inputs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """What decides the stored values of a store's rows, besides each row's image: the model (weights hash,
    class, the spec's model settings), the resolved preprocessing, the spec's data settings that change pixels,
    the captures' records (without their place in the spec) and the per-row extras."""
    model_spec, data_spec = _spec_inputs(attrs)
    model = attrs.get("model") or {}
    preprocess = from_dict(attrs["preprocess"]).to_dict() if attrs.get("preprocess") else {}  # older: runs
    captures = {k: {f: v for f, v in c.items() if f not in ("capture", "feature_index")}  # an index: not values
                for k, c in (attrs.get("captures") or {}).items()}
    return {
        "format_version": attrs.get("format_version"),
        "model weights (state-dict hash)": model.get("state_dict_sha256"),
        "model class": model.get("class"),
        "model settings": model_spec,
        "data settings": data_spec,
        "preprocess": {k: preprocess.get(k) for k in PREPROCESS_FIELDS},
        "captures": captures,
        "extras": attrs.get("extras") or {},
    }


def _open_source(url: str, storage_options: Mapping[str, Any] | None) -> tuple[zarr.Group, dict[str, Any]]:
    try:
        group = open_group(url, storage_options)
        attrs = root_attrs(group)
    except Exception as err:  # noqa: BLE001 - missing, not a store, unreachable: said the same way
        raise StoreError(f"output.reuse: cannot open {url} as an extractor store ({type(err).__name__}: {err})") \
            from None
    if "digest" not in group:
        raise StoreError(f"output.reuse: {url} predates content digests; its rows cannot be matched to images")
    return group, attrs


def _mismatches(want: dict[str, Any], have: dict[str, Any]) -> list[str]:
    """What of the values' inputs differs between this job (``want``) and a source store (``have``): a capture
    this job stores must be there, made alike; the source may hold more."""
    diffs = [k for k in want if k != "captures" and want[k] != have[k]]
    missing = [k for k in want["captures"] if have["captures"].get(k) != want["captures"][k]]
    if missing:
        diffs.append(f"captures {', '.join(missing)} (absent there, or made otherwise)")
    return diffs


def _warn_versions(url: str, now: Mapping[str, Any], there: Mapping[str, Any]) -> None:
    versions = {k: (v, there.get(k)) for k, v in now.items() if there.get(k) != v and k != "extractor"}
    if versions:
        log.warning("output.reuse: %s was made with %s; its values may differ from this run's in the last bits",
                    url, ", ".join(f"{k} {b} (now {a})" for k, (a, b) in versions.items()))


def check_sources(urls: Sequence[str], attrs: Mapping[str, Any], store: str,
                  storage_options: Mapping[str, Any] | None) -> None:
    """Refuse, naming the differences, a store of ``urls`` whose rows would not be what this job computes
    (``attrs``: the store record this job would write); warn of other library versions."""
    from ..data import absolute

    want = _value_inputs(attrs)
    for url in urls:
        if absolute(url).rstrip("/") == absolute(store).rstrip("/"):
            raise StoreError(f"output.reuse lists the job's own store {url}; --resume finishes it instead")
        _, other = _open_source(url, storage_options)
        diffs = _mismatches(want, _value_inputs(other))
        if moved := forward_differences(other.get("model") or {}, attrs.get("model") or {}):
            diffs.append(f"the model's forward (other values of {', '.join(moved)} on the probe's fixed input)")
        if diffs:
            raise StoreError(f"output.reuse: the rows of {url} are not what this job computes: it differs in "
                             f"{'; '.join(diffs)}. Remove it from output.reuse")
        _warn_versions(url, attrs.get("versions") or {}, other.get("versions") or {})


def _identity(group: zarr.Group) -> tuple[Any, Any]:
    """Which store generation ``group`` is: its name (an overwrite makes a new one; what a generation's commits name
    never changes), or, for a store of format 1, its ``created`` attribute."""
    attrs = root_attrs(group)
    return attrs.get("generation"), attrs.get("created")


class ReuseIndex:
    """The ok rows of the stores of ``output.reuse``, by content digest, and their values (the captures
    and extras ``keys``), read a whole chunk at a time with the last ``cache_chunks`` kept per array:
    rows of one source in order read each chunk once. Used from the decode threads (a lock guards reads).

    A source may be overwritten, resumed or redone while this job runs: values are taken only as they were
    when the index was built. Each time values are read from a source, its rows' status and digests and then
    its identity (:func:`_identity`) are read again, after the values: a row no longer ok with its digest is
    withdrawn, a source of another identity (or that cannot be read) is dropped; their rows are computed.
    With ``want`` (this job's store record, as :func:`check_sources` compared it), a source that no longer
    makes the rows this job computes when the index is built (replaced since the driver checked it) is left
    out the same way.
    """

    def __init__(self, urls: Sequence[str], storage_options: Mapping[str, Any] | None, keys: Sequence[str],
                 cache_chunks: int = 4, want: Mapping[str, Any] | None = None) -> None:
        self.urls, self.storage_options = list(urls), storage_options
        self.keys, self.cache_chunks = list(keys), cache_chunks
        self.groups = [open_group(u, storage_options) for u in urls]
        self.identity = [_identity(g) for g in self.groups]  # read before the rows: a change after them shows
        # per source row, the digest of its image where it is ok (0: not taken from there)
        self.expected = [self._rows(i, want) for i in range(len(self.groups))]
        digests, sources, rows = [], [], []
        for i, d in enumerate(self.expected):
            ok = np.flatnonzero(d)
            digests.append(d[ok])
            sources.append(np.full(len(ok), i, np.int32))
            rows.append(ok.astype(np.int64))
        digest = np.concatenate(digests) if digests else np.empty(0, np.uint64)
        order = np.argsort(digest, kind="stable")  # the first source listed wins a digest held twice
        self.digest = digest[order]
        self.source = (np.concatenate(sources) if sources else np.empty(0, np.int32))[order]
        self.row = (np.concatenate(rows) if rows else np.empty(0, np.int64))[order]
        self.arrays: dict[tuple[int, str], zarr.Array] = {}
        self.cache: dict[tuple[int, str], OrderedDict[int, np.ndarray]] = {}
        self.dropped: set[int] = set()  # sources replaced or written since the index was built: nothing taken
        self.lock = threading.Lock()

    def _rows(self, source: int, want: Mapping[str, Any] | None) -> np.ndarray:
        """The digest of each ok row of a source (0 elsewhere); none when it no longer makes this job's rows."""
        g = self.groups[source]
        if want is not None:
            other = root_attrs(g)
            diffs = _mismatches(_value_inputs(want), _value_inputs(other))
            diffs += forward_differences(other.get("model") or {}, want.get("model") or {})
            if diffs:
                log.warning("output.reuse: %s changed since the job checked it (it differs now in %s): its rows "
                            "are computed here", self.urls[source], "; ".join(map(str, diffs)))
                return np.zeros(get_array(g, "digest").shape[0], np.uint64)
        d = np.asarray(get_array(g, "digest")[:])
        return np.where(np.asarray(get_array(g, "status")[:]) == OK, d, 0).astype(np.uint64)

    def __len__(self) -> int:
        return len(self.digest)

    def lookup(self, digest: int) -> Reused | None:
        """The values of a row whose image has content digest ``digest``, or None when no source has one as it
        was when the index was built (then the row is computed)."""
        at = int(np.searchsorted(self.digest, np.uint64(digest)))
        if at == len(self.digest) or int(self.digest[at]) != digest:
            return None
        source, row = int(self.source[at]), int(self.row[at])
        with self.lock:
            if source in self.dropped or int(self.expected[source][row]) != digest:
                return None
            read: list[tuple[int, int]] = []  # the rows whose values were read from the source now
            try:
                values = {k: self._value(source, k, row, read) for k in self.keys}
                if read:
                    self._confirm(source, read)
            except Exception as err:  # noqa: BLE001 - a source being replaced: its rows are computed
                self._drop(source, f"it cannot be read ({type(err).__name__}: {err})")
            if source in self.dropped or int(self.expected[source][row]) != digest:
                return None
            return Reused(source, values)

    def _confirm(self, source: int, read: list[tuple[int, int]]) -> None:
        """After values of ``read`` (row ranges) were read: withdraw the rows there no longer ok with their
        digest, then drop the source when its identity changed (whatever was read may be another store's)."""
        g = open_group(self.urls[source], self.storage_options)  # as it is now, not as it was opened
        expected = self.expected[source]
        for start, stop in read:
            status = np.asarray(get_array(g, "status")[start:stop])
            digest = np.asarray(get_array(g, "digest")[start:stop])
            was = expected[start:start + len(status)]
            was[(status != OK) | (digest != was)] = 0
        if _identity(g) != self.identity[source]:
            self._drop(source, "it was replaced or written by another job since this job indexed it")

    def _drop(self, source: int, why: str) -> None:
        if source not in self.dropped:
            log.warning("output.reuse: %s: %s; its rows are computed here from now on", self.urls[source], why)
        self.dropped.add(source)
        for key in self.keys:
            self.cache.pop((source, key), None)

    def _value(self, source: int, key: str, row: int, read: list[tuple[int, int]]) -> np.ndarray:
        arr = self.arrays.get((source, key))
        if arr is None:
            arr = self.arrays[(source, key)] = get_array(self.groups[source], key)
        cache = self.cache.setdefault((source, key), OrderedDict())
        step = int(arr.chunks[0])
        c = row // step
        if c in cache:
            cache.move_to_end(c)
        else:
            cache[c] = np.asarray(arr[c * step : (c + 1) * step])
            read.append((c * step, c * step + len(cache[c])))
            while len(cache) > self.cache_chunks:
                cache.popitem(last=False)
        return cache[c][row - c * step]
