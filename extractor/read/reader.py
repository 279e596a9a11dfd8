"""Opening a store for analysis: lazy arrays, ids, labels, status. Needs only numpy and zarr.

    >>> s = open_store("out.zarr")
    >>> s.captures            # key -> layer, what, reduce, dtype, shape, dims
    >>> s["layer3"][:8]       # a lazy zarr array: numpy slicing reads only what it needs
    >>> s.numpy("avgpool")    # ok rows only, as one numpy array
    >>> s.extras              # gradient jobs: per-row target, target_score, KEY.range; read like captures
    >>> s.stats["avgpool"]    # per-feature mean/std, min/max, NaN/Inf counts ({} until a run ends)
    >>> for rows, x in s.batches("avgpool", 1024): ...
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import Store

from ..errors import StoreError
from ..store import (
    ATTR,
    OK,
    STATUS_NAMES,
    CaptureRecord,
    Generation,
    Objects,
    SortedIds,
    alive,
    current_places,
    disk_usage,
    done_shards,
    get_array,
    locator_arrays,
    open_group,
    patch_span,
    projection_matrix,
    read_all,
    read_head,
    read_id_index,
    root_attrs,
    snapshot_store,
    source_digests,
    take_rows,
)
from .batching import (
    Batching,
    Rows,
)
from .epoch import check_part
from .ids import _IdIndex

__all__ = ["ActivationStore", "open_store", "zarr_store"]

_IDS_READ_ALONE = 64  # ids the id index checks a chunk each; more: all ids read at once (0.25 s at 1M rows)


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> ActivationStore:
    """Open a store written by extractor, read-only and lazily: its live generation as its ledger names its shards'
    attempts now (what is committed later is read by opening it again); a store of format 1 as it is."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # consolidated metadata "not part of the Zarr v3 specification"
            group = open_group(url, storage_options)
            if root_attrs(group).get("format_version") == 1:  # format 1: a local store's shards read from one
                local = url.removeprefix("file://") if "://" not in url.removeprefix("file://") else None  # version
                if local is not None and hasattr(os, "pread"):  # of their object each (store.snapshot)
                    group = zarr.open_group(snapshot_store(local), mode="r")
    except FileNotFoundError:
        parent = url.rstrip("/").rsplit("/", 1)[0]
        if parent != url.rstrip("/") and _is_store(parent, storage_options):
            raise StoreError(f"{url} is an array of a store, not a store: open the store ({parent}) and read the "
                             "array by its key") from None
        raise StoreError(f"no store at {url}") from None
    except zarr.errors.ContainsArrayError:
        parent = url.rstrip("/").rsplit("/", 1)[0]
        raise StoreError(f"{url} is an array of a store, not a store: open the store ({parent}) and read the array by "
                         "its key") from None
    except StoreError:
        raise
    except KeyError:
        raise StoreError(f"{url} is a Zarr group but not an extractor store (no '{ATTR}' attributes)") from None
    except Exception as err:
        raise StoreError(f"cannot open {url} as a Zarr store: {err}") from err
    return ActivationStore(group, url, storage_options)


def _arrays_of(group: zarr.Group) -> list[zarr.Array]:
    """Every array of a store's group and its subgroups (captures, per-row arrays, the id index, index parts)."""
    out = [a for _, a in group.arrays()]
    for name, sub in group.groups():
        if not name.startswith("__"):
            out += _arrays_of(sub)
    return out


def _is_store(url: str, storage_options: Mapping[str, Any] | None) -> bool:
    try:
        return read_head(Objects.at(url, storage_options)) is not None
    except Exception:  # noqa: BLE001 - nothing readable there: no store
        return False


def zarr_store(url: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store at ``url`` as a zarr store that reads what its commits name (numpy and zarr only), for tools that
    take one: ``xarray.open_zarr(zarr_store(url))``, ``zarr.open_array(zarr_store(url), path="layer3")``,
    ``dask.array.from_zarr``. (Opened by URL, zarr and xarray refuse its arrays: they declare the storage
    transformer that maps a chunk to the attempt holding it, which they do not know; never read as fill values.)"""
    return open_store(url, storage_options).group.store


def _need_torch(what: str) -> None:
    try:
        import torch  # noqa: F401
    except ImportError as err:
        raise ImportError(f"{what} needs torch: pip install torch (reading a store needs only numpy and zarr)") from err


def _row_numbers(rows: Rows, n: int) -> np.ndarray:
    """The row numbers (0 to n-1, int64, in the order given) a selection means: all (None), a slice, a boolean
    mask of n, or integers (negative ones from the end)."""
    if rows is None:
        return np.arange(n)
    if isinstance(rows, slice):
        return np.arange(n)[rows]
    idx = np.asarray(rows)
    if idx.dtype == bool:
        if idx.shape != (n,):
            raise IndexError(f"a boolean row mask needs shape ({n},) for this store, not {idx.shape}")
        idx = np.flatnonzero(idx)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
        raise IndexError(f"rows must be a slice, a boolean mask or a 1-d list of integers, not {rows!r:.80}")
    idx = idx.astype(np.int64)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"row index out of range for a store of {n} rows")
    return np.where(idx < 0, idx + n, idx)


class ActivationStore(Batching):
    """A read-only view of an extractor store."""

    def __init__(self, group: zarr.Group, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.group = group
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.attrs: dict[str, Any] = root_attrs(group)
        self._cache: dict[str, np.ndarray] = {}
        self._arrays: dict[str, zarr.Array] = {}  # opened once: each opening reads the array's metadata
        self._row_of: SortedIds | _IdIndex | None = None  # image id -> row, made on the first call of row()
        self._id_texts: np.ndarray | None = None  # the ids as read (Python strings), once the id index needs many
        self.last_run: Any = None  # extractor.run(): the RunSummary of the run that returned this store

    # ------------------------------------------------------------------ metadata
    @property
    def spec(self) -> dict[str, Any]:
        return self.attrs["spec"]

    @property
    def model(self) -> dict[str, Any]:
        return self.attrs["model"]

    @property
    def captures(self) -> dict[str, CaptureRecord]:
        """How each capture is stored (see :class:`~extractor.store.CaptureRecord`)."""
        return self.attrs["captures"]

    @property
    def keys(self) -> list[str]:
        """The capture keys: what dataloader, torch_dataset and probe use by default (not the extras)."""
        return list(self.captures)

    @property
    def extras(self) -> dict[str, dict[str, Any]]:
        """Per-row arrays of gradient jobs (``target``, ``target_score``, ``KEY.range``) -> dtype,
        shape, dims; ``{}`` for other jobs. _Read like captures: ``s[name]``, :meth:`numpy`,
        :meth:`batches`, :meth:`row`, :meth:`to_xarray`; they have no :attr:`stats`."""
        return dict(self.attrs.get("extras") or {})

    def _known(self) -> str:
        """The names ``s[name]`` accepts, for error messages."""
        extras = f"; per-row extras: {', '.join(self.extras)}" if self.extras else ""
        return f"captures: {', '.join(self.keys)}{extras}"

    @property
    def classes(self) -> list[str]:
        return list(self.attrs.get("classes") or [])

    @property
    def stats(self) -> dict[str, Any]:
        """Per capture statistics of the ok rows (docs/reference/store.md).

        ``{}`` until the first run on the store ends or is interrupted (so for a store whose run was
        killed): ``extractor run --resume`` finishes such a store and writes them.
        """
        return dict(self.attrs.get("stats") or {})

    def __len__(self) -> int:
        return int(self.attrs["n_rows"])

    def __contains__(self, key: object) -> bool:
        return key in self.captures or key in self.extras

    def __repr__(self) -> str:
        extras = f", extras {list(self.extras)}" if self.extras else ""
        counts = ", ".join(f"{n} {name}" for name, n in self.row_counts().items())
        return (f"<ActivationStore {self.url}: {len(self)} rows ({counts}), {self.attrs.get('status')}, "
                f"captures {self.keys}{extras}>")

    # ------------------------------------------------------------------ per-row arrays
    def _row_array(self, name: str) -> np.ndarray:
        if name not in self._cache:
            self._cache[name] = read_all(get_array(self.group, name))  # a local store's: a file a chunk
        return self._cache[name]

    @property
    def ids(self) -> np.ndarray:
        return self._row_array("ids")

    @property
    def paths(self) -> np.ndarray:
        return self._row_array("paths")

    @property
    def digests(self) -> np.ndarray | None:
        """Per row, the xxh3-64 content digest of the image's bytes as the row read them (0: not read yet);
        None for stores made before digests. Equal digests: the same image bytes."""
        return np.asarray(get_array(self.group, "digest")[:]) if "digest" in self.group else None

    def locator(self, row: int) -> Any:
        """Where row's image is read from: its path, or where the source keeps locator arrays beside it
        (``data.Source.locators``), the path and their values (a tar member: (TAR_URL#MEMBER, offset, size))."""
        path = str(self.paths[row])
        names = locator_arrays(self.group)
        if not names:
            return path
        return (path, *(np.asarray(get_array(self.group, n)[row]).item() for n in names))

    @property
    def labels(self) -> np.ndarray:
        return self._row_array("labels")

    @property
    def status(self) -> np.ndarray:
        """0 pending, 1 ok, 2 failed (read fresh each time: a running job updates it; a local store's a file a chunk:
        every epoch of :meth:`batches` reads it, through zarr 0.41 s at 1M rows, here 0.06 s). A store made again
        at its URL since it was opened (``--overwrite``) is refused here, before its rows are read under the ids of
        the one opened."""
        try:
            status = read_all(get_array(self.group, "status"))
        except (KeyError, FileNotFoundError):  # the store removed
            self._check_same(-1)
            raise
        self._check_same(len(status))
        return status

    def _made(self) -> Any:
        """Which store is at this URL now: the generation its head names (format 2) or when it was made (format 1);
        None: no store there now."""
        local = self.url.removeprefix("file://")
        key = "generation" if "generation" in self.attrs else "created"
        try:
            if "://" not in local:  # the root's metadata file, read and parsed (a zarr open took twice as long)
                with open(os.path.join(local, "zarr.json"), "rb") as f:
                    return json.load(f).get("attributes", {}).get(ATTR, {}).get(key)
            head = read_head(Objects.at(self.url, self.storage_options))
            return None if head is None else head.attrs.get(key)
        except (OSError, ValueError, AttributeError):  # StoreError is an OSError
            return None

    def check_current(self) -> None:
        """Raise StoreError where the store at this URL is no longer the one opened (made again, or removed): one
        small read of its head. A reader that serves many reads (the viewer) asks before each."""
        self._check_same(len(self))

    def _check_same(self, rows: int) -> None:
        """Raise StoreError where the store at this URL is not the one opened: another row count, or another
        generation (one small read of its head)."""
        key = "generation" if "generation" in self.attrs else "created"
        if rows != len(self) or self._made() != self.attrs.get(key):
            raise StoreError(f"{self.url} was made again (or removed) since it was opened: its rows are no longer "
                             "the ones this reader holds the ids of; open it again")

    @property
    def errors(self) -> np.ndarray:
        """Per row, why it failed ("" where it did not); read fresh each time, as :attr:`status`."""
        return read_all(get_array(self.group, "errors"))

    @property
    def done_shards(self) -> np.ndarray:
        return done_shards(self.group)

    def _opened_again(self) -> ActivationStore:
        """The store at its URL as it is now (its ledger read again): what a followed stream reads next."""
        return open_store(self.url, self.storage_options)

    def ok_rows(self) -> np.ndarray:
        return np.flatnonzero(self.status == OK)

    # ------------------------------------------------------------------ captures and extras
    def __getitem__(self, key: str) -> zarr.Array:
        """The lazy array of a capture or extra (numpy slicing reads only the chunks it touches)."""
        if key not in self._arrays:
            if key not in self:
                raise KeyError(f"{key!r} is not a capture or extra of {self.url}; {self._known()}")
            self._arrays[key] = get_array(self.group, key)
        return self._arrays[key]

    def _select_rows(self, rows: Rows, only_ok: bool, strict: bool = False) -> np.ndarray:
        """Store row numbers of ``rows``, in the order given (duplicates kept).

        ``only_ok`` leaves out rows that are not ok; with ``strict`` explicit rows must all be ok.
        """
        idx = _row_numbers(rows, len(self))
        if not only_ok:
            return idx
        status = self.status[idx]
        ok = status == OK
        if strict and rows is not None and not ok.all():
            bad = np.flatnonzero(~ok)
            names = ", ".join(f"{idx[i]} ({STATUS_NAMES.get(int(status[i]), status[i])})" for i in bad[:10])
            raise StoreError(
                f"{len(bad)} of the {len(idx)} rows asked of {self.url} are not ok: {names}"
                f"{' ...' if len(bad) > 10 else ''}; pass only_ok=False to get NaN in their place, or "
                "select among s.ok_rows() (s.errors[row] says why a row failed)"
            )
        return idx[ok]

    def numpy(self, key: str, rows: Rows = None, only_ok: bool = True) -> np.ndarray:
        """Rows of a capture or extra as one numpy array: item ``i`` is row ``rows[i]``.

        With ``rows=None`` all rows, of which only the ok ones by default. Explicit ``rows``
        (slice, mask, list) are never dropped: with ``only_ok`` (the default) a row that is not
        ok raises :class:`StoreError` naming it; ``only_ok=False`` gives such rows as stored:
        NaN (``target``: -1).
        """
        arr = self[key]
        return take_rows(arr, self._select_rows(rows, only_ok, strict=True))

    def projection(self, key: str) -> np.ndarray:
        """The ``(features, project)`` matrix a ``project`` capture was made with (regenerated from its seed):
        ``stored = original @ s.projection(key)``; its pseudo-inverse maps stored features back approximately."""
        meta = self.captures.get(key)
        if meta is None or not meta.get("project"):
            raise StoreError(f"{key!r} is not a projected capture (project: D) of {self.url}; {self._known()}")
        return projection_matrix(int(meta["seed"]), int(meta["projected_from"]), int(meta["project"]),
                                 str(meta["projection"]))

    def row_numbers(self, ids: Sequence[str]) -> np.ndarray:
        """The store rows of the image ids ``ids`` (KeyError naming the first one not in the store)."""
        if isinstance(ids, str):
            raise TypeError(f"row_numbers takes a list of image ids; of one: row_numbers([{ids!r}])")
        if self._row_of is None:
            self._row_of = self._id_index()
        rows = self._row_of.find(ids)
        missing = np.flatnonzero(rows < 0)
        if len(missing):
            raise KeyError(f"no row with id {ids[int(missing[0])]!r} in {self.url}")
        return rows

    def _id_index(self) -> SortedIds | _IdIndex:
        """The store's index of its ids (``id_index``), or, in a store made without one, its ids as read (Python
        strings: found without making numpy's strings first)."""
        ids = self._arrays.setdefault("ids", get_array(self.group, "ids"))
        stored = read_id_index(self.group, ids.shape[0], self.attrs.get("ids_digest"), self._ids_at)
        if stored is not None:
            return stored
        known = self._cache.get("ids")
        return _IdIndex(known if known is not None else read_all(ids, as_read=True))

    def _ids_at(self, rows: np.ndarray) -> list[str]:
        """The stored ids of ``rows`` (for the id index): a few read a chunk each, more all at once (kept)."""
        known = self._cache.get("ids", self._id_texts)
        if known is None and len(rows) > _IDS_READ_ALONE:
            known = self._id_texts = read_all(self._arrays["ids"], as_read=True)
        if known is not None:
            return known[rows].tolist()
        return [str(read_all(self._arrays["ids"], r, r + 1, as_read=True)[0]) for r in rows.tolist()]

    def row(self, id: str) -> dict[str, Any]:
        """All captures and extras of the row with image id ``id`` (random access by id)."""
        if not isinstance(id, str):
            raise TypeError(f"row takes an image id (a str), not {id!r}; a row by its number: numpy(key, rows=[n])")
        n = int(self.row_numbers([id])[0])
        self._check_same(len(self))  # the ids known are this store's (row reads its status alone, not through status)
        if "status" not in self._arrays:
            self._arrays["status"] = get_array(self.group, "status")
        status = STATUS_NAMES[int(np.asarray(self._arrays["status"][n]))]
        label = self._cache["labels"][n] if "labels" in self._cache else np.asarray(get_array(self.group, "labels")[n])
        out: dict[str, Any] = {"row": n, "id": id, "label": int(label), "status": status}  # (one label read)
        out.update({k: np.asarray(self[k][n]) for k in [*self.keys, *self.extras]})
        return out

    def torch_dataset(self, keys: str | Sequence[str] | None = None, only_ok: bool = True, cache_chunks: int = 2):
        """A map-style ``torch.utils.data.Dataset`` over the ok rows (torch is imported here only).

        Item ``i`` is a dict of tensors: one per key, plus ``row`` and ``label``. Rows are read a
        chunk at a time and the last ``cache_chunks`` chunks of each key are kept, so that items in
        row order read each chunk once; a DataLoader's batch of items is one read per chunk it touches
        (``__getitems__``). For streaming whole epochs, :meth:`dataloader` is faster still.
        """
        _need_torch("torch_dataset")
        from .torch_views import StoreDataset

        return StoreDataset(self, [keys] if isinstance(keys, str) else list(keys or self.keys), only_ok, cache_chunks)

    def dataloader(
        self, keys: str | Sequence[str] | None = None, batch_size: int = 1024, shuffle: bool = True, seed: int = 0,
        *, tokens: bool = False, dtype: Any = None, drop_last: bool = False, num_workers: int = 0,
        **options: Any,
    ):
        """A ``torch.utils.data.DataLoader`` of dict batches streamed by :meth:`batches` (chunk-aware
        shuffle): one tensor per key, plus ``row`` and ``label``. With ``tokens=True`` the rows are
        single tokens of ``(tokens, features)`` captures (:meth:`token_batches`; several of one token
        layout give the same positions of each): the batch holds each key, ``row`` and ``token``.
        ``dtype`` (e.g. ``torch.float32``, ``torch.bfloat16``) converts the stored values; ``drop_last``
        leaves out a last short batch (of each worker).

        ``num_workers=N`` reads in N worker processes, each a disjoint part of the epoch's chunks
        (every row, or token, once per epoch); ``pin_memory``, ``prefetch_factor``,
        ``persistent_workers``, ``timeout``, ``worker_init_fn`` and ``multiprocessing_context`` go to
        the DataLoader; the other options are those of :meth:`batches` or :meth:`token_batches`.
        Each iteration is one epoch; epoch ``e`` uses seed ``seed + e`` (a DataLoader of your own
        around ``.dataset`` calls ``loader.dataset.set_epoch(e)`` for that, as with
        ``DistributedSampler``).
        """
        import inspect

        _need_torch("dataloader")
        from .torch_views import LOADER_OPTIONS, batch_loader

        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
            raise ValueError(f"num_workers must be a count >= 0, not {num_workers!r}")
        loader = {k: options.pop(k) for k in list(options) if k in LOADER_OPTIONS}
        source = self.token_batches if tokens else self.batches
        allowed = set(inspect.signature(source).parameters) - {"key", "keys", "batch_size", "shuffle", "seed",
                                                                "drop_last", "worker"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(f"dataloader() got unknown option(s) {', '.join(unknown)}; it takes "
                            f"{', '.join(sorted(allowed))} (the options of {source.__name__}()), num_workers and "
                            f"the DataLoader's {', '.join(LOADER_OPTIONS)}")
        names = [keys] if isinstance(keys, str) else list(keys or self.keys)
        for k in names:
            self[k]  # an unknown key fails here, at the call
        if tokens:
            self._token_keys(names, options.get("drop_prefix", False))  # token captures of one layout, at the call
        check_part(options.get("part"))
        return batch_loader(self, names, batch_size, shuffle, seed, options, tokens=tokens, dtype=dtype,
                            drop_last=drop_last, num_workers=num_workers, loader=loader)

    def to_xarray(self, only_ok: bool = True, stack: Sequence[str] | None = None):
        """An ``xarray.Dataset`` (dask-backed, lazy): one DataArray per capture on dim ``row``, whose
        coordinate is the store's row number, with ``ids``, ``labels`` and ``status`` coordinates
        (the names ``xarray.open_zarr`` gives the store's own coordinate arrays), and ``class_name`` (the
        label's name; "" for none) when the store records class names.
        Extras of gradient jobs: per-row scalars (``target``, ``target_score``) are coordinates
        on ``row`` like ``labels``; ``KEY.range`` is a DataArray on (``row``, ``KEY.range.minmax``),
        labelled ``min``, ``max``. Rows that are not ok (failed: NaN; pending: not computed yet)
        are left out unless ``only_ok=False``, as in :meth:`numpy`.

        ``stack=[keys]``: one DataArray instead, with a ``layer`` dimension (labelled by key) before
        ``row``, of captures of one shape (a sweep across blocks); their feature dims lose the key
        (``channel``, ``token``, ``feature``...). Needs the ``analysis`` extra (xarray, dask).

        A token capture whose record says which of its tokens are patches has a ``KEY.patch`` coordinate on its
        ``KEY.token`` dim: True at the patch tokens (``ds[KEY].isel({"KEY.token": ds["KEY.patch"]})`` leaves out
        the CLS, register and YOLOS detection tokens, wherever they sit); stacked, a ``patch`` coordinate."""
        try:
            import xarray as xr
        except ImportError as err:
            raise ImportError("to_xarray needs xarray and dask: pip install 'extractor[analysis]'") from err
        ds = xr.open_zarr(self.group.store, consolidated=False)
        status = self.status
        extras = self.extras
        ds = ds[[*self.keys, *extras]].assign_coords(row=np.arange(len(status)),
                                                     ids=("row", np.asarray(self.ids, dtype=object)),
                                                     labels=("row", self.labels), status=("row", status))
        if self.classes:  # each row's class name ("" where a row has no label)
            names = np.asarray([*self.classes, ""], dtype=object)
            labels = self.labels
            ds = ds.assign_coords(class_name=("row", names[np.where((labels >= 0) & (labels < len(self.classes)),
                                                                     labels, len(self.classes))]))
        ds = ds.assign_coords({f"{k}.patch": (f"{k}.token", mask) for k, mask in self._patch_masks().items()})
        ds = ds.set_coords([k for k, m in extras.items() if not m["dims"]])  # per-row scalars: follow each capture
        ds = ds.assign_coords({m["dims"][0]: ["min", "max"] for k, m in extras.items() if k.endswith(".range")})
        ds.attrs = {"store": self.url, "model": self.model.get("name"), "format_version": self.attrs["format_version"]}
        if only_ok:
            ds = ds.isel(row=np.flatnonzero(status == OK))
        return ds if stack is None else self._stacked(ds, [stack] if isinstance(stack, str) else list(stack))

    def _patch_masks(self) -> dict[str, np.ndarray]:
        """Per token capture whose patch tokens are known: True at the stored tokens that are patches."""
        masks = {}
        for key, meta in self.captures.items():
            span = patch_span(meta, self.model.get("prefix_tokens")) if len(meta["shape"]) == 2 else None
            if span is not None and [d.rsplit(".", 1)[-1] for d in meta["dims"]] == ["token", "feature"]:
                first, count = span
                positions = np.arange(int(meta["shape"][0]))
                masks[key] = (positions >= first) & (positions < first + count)
        return masks

    def _stacked(self, ds: Any, keys: list[str]) -> Any:
        """Captures of one shape as one DataArray with a ``layer`` dimension (see :meth:`to_xarray`)."""
        import xarray as xr

        if not keys:
            raise ValueError("to_xarray(stack=...) needs at least one capture key")
        for k in keys:
            if k not in self.captures:
                raise KeyError(f"to_xarray(stack=...): {k!r} is not a capture of {self.url}; {self._known()}")
        shapes = {k: tuple(self.captures[k]["shape"]) for k in keys}
        dims = {k: tuple(d.removeprefix(f"{k}.") for d in self.captures[k]["dims"]) for k in keys}
        if len(set(shapes.values())) > 1 or len(set(dims.values())) > 1:
            raise ValueError("to_xarray(stack=...) needs captures of one shape and kind; got "
                             + ", ".join(f"{k} {list(shapes[k])} {list(dims[k])}" for k in keys))
        names = {k: {f"{k}.{d}": d for d in dims[k]} for k in keys}  # feature dims without the key; so the patch
        names = {k: n | ({f"{k}.patch": "patch"} if f"{k}.patch" in ds[k].coords else {}) for k, n in names.items()}
        parts = [ds[k].rename(names[k]) for k in keys]
        return xr.concat(parts, dim=xr.DataArray(keys, dims="layer", name="layer")).rename("stack")

    @property
    def stale(self) -> float | None:
        """Seconds since the last process writing this store renewed its record, when none of them is alive and the
        store is not finished (they were killed: ``--resume`` finishes the store); None otherwise."""
        import time

        if self.attrs.get("status") == "complete" or "generation" not in self.attrs:
            return None
        claimants = Generation(Objects.at(self.url, self.storage_options), self.attrs["generation"]).roster.all()
        if not claimants or any(m.get("ended") for m in claimants[-1:]):
            return None
        from ..store import alive

        if any(alive(m) for m in claimants):
            return None
        return time.time() - max(float(m.get("heartbeat", 0)) for m in claimants)

    def claimants(self) -> list[dict[str, Any]]:
        """The processes that wrote into this store's generation, the latest started last: host, pid, user,
        started, shards committed, and how each ended (``ended``; absent while it runs, or when it was killed)."""
        if "generation" not in self.attrs:
            return []
        return Generation(Objects.at(self.url, self.storage_options), self.attrs["generation"]).roster.all()

    def verify(self, source_options: Mapping[str, Any] | None = None, threads: int = 16) -> dict[str, Any]:
        """Read every row's image again from where the store read it (its ``paths``; ``source_options``:
        fsspec options of the images' storage, by default those the store was opened with) and compare
        its content digest with the one stored when the row was computed. Returns ``{"checked": n,
        "changed": [(row, id), ...], "unreadable": [(row, id), ...]}``; rows never read are not checked."""
        if "digest" not in self.group:
            raise StoreError(f"{self.url} predates content digests (format without a digest array): nothing to "
                             "verify against")
        stored = np.asarray(get_array(self.group, "digest")[:])
        rows = np.flatnonzero(stored != 0)
        options = self.storage_options if source_options is None else source_options
        moved = current_places(self.group, options)  # a source that moved its rows' bytes: read where they are now
        places = None if moved is None else {name: column[rows] for name, column in moved.items()}
        now = np.asarray(source_digests(self.group, rows, options, threads, places=places), dtype=np.uint64)
        ids = self.ids
        gone = rows[now == 0]
        changed = rows[(now != 0) & (now != stored[rows])]
        return {"checked": len(rows), "changed": [(int(r), str(ids[r])) for r in changed],
                "unreadable": [(int(r), str(ids[r])) for r in gone]}

    def verify_objects(self) -> dict[str, Any]:
        """Every object a commit of the store names (and those written when it was made) present, and decoding as
        its array says (a sharded object's index and chunks, each chunk's codecs): what a damaged copy, an object
        removed or cut short by hand, would break. Returns ``{"checked": n, "missing": [key, ...], "damaged":
        [(key, error), ...]}``; shards not committed are not checked (they hold nothing yet)."""
        from ..store import array_objects

        checked, missing, damaged = 0, [], []
        for array in _arrays_of(self.group):
            for key, where, rows in array_objects(array):
                checked += 1
                if not where.exists:
                    missing.append(key)
                    continue
                try:
                    np.asarray(array[rows])
                except Exception as err:  # noqa: BLE001 - what fails to decode, whatever the codec says
                    damaged.append((key, f"{type(err).__name__}: {err}"[:200]))
        return {"checked": checked, "missing": missing, "damaged": damaged}

    # ------------------------------------------------------------------ summary
    def row_counts(self) -> dict[str, int]:
        """Rows by status (pending, ok, failed): the sums of the ledger's commits where a job committed its shards
        (each records its shard's: read once when the store was opened, whatever its rows), else counted in the
        status array (every row read: a format-1 store, one with no shard committed yet, a synthetic one)."""
        done = self._commits()
        if done is not None:
            ok, failed = int(done["ok"].sum(dtype=np.int64)), int(done["failed"].sum(dtype=np.int64))
            return {"pending": len(self) - ok - failed, "ok": ok, "failed": failed}
        status = self.status
        return {STATUS_NAMES[v]: int((status == v).sum()) for v in STATUS_NAMES}

    def _commits(self) -> np.ndarray | None:
        """The ledger's entries of the committed shards where a job committed them (each records its shard's rows,
        bytes: read once when the store was opened); None: a format-1 store, one with no shard committed yet, or one
        written without a job's commits (a synthetic one)."""
        table = getattr(self.group.store, "table", None)
        done = table.entries[table.done] if table is not None else None
        if done is not None and len(done) and bool((done["ok"].astype(np.int64) + done["failed"] > 0).all()):
            return done
        return None

    def bytes_committed(self) -> int | None:
        """The bytes of the values the committed shards wrote, before compression, as their commits record them
        (no object listed); None where commits do not record them (:meth:`_commits`)."""
        done = self._commits()
        return None if done is None else int(done["nbytes"].sum(dtype=np.int64))

    def summary(self, du: bool = False) -> dict[str, Any]:
        """What ``extractor inspect`` shows: captures, row counts, shards, the bytes of the values the committed
        shards wrote (from their commits). ``du``: each capture's stored bytes and the store's bytes on disk too,
        every object listed or stat-ed (at 100,000 shards, a million objects: ``inspect --du``); None without it."""
        counts = self.row_counts()
        captures = {}
        for key, meta in self.captures.items():
            arr = self[key]
            captures[key] = {
                "layer": meta["layer"],
                "what": meta["what"],
                "index": meta.get("index"),
                "reduce": meta["reduce"],
                "dtype": str(arr.dtype),
                "shape": list(arr.shape),
                "chunks": list(arr.chunks),
                "dims": ["row", *meta["dims"]],
                "bytes_stored": int(arr.nbytes_stored()) if du else None,
            }
        return {
            "store": self.url,
            "format_version": self.attrs.get("format_version"),
            "status": self.attrs.get("status"),
            "silent_s": self.stale,  # "running", but its job died this long ago
            "created": self.attrs.get("created"),
            "updated": self.attrs.get("updated"),
            "model": self.model,
            "preprocess": self.attrs.get("preprocess"),  # with what the probe measured against the library (check)
            "rows": len(self),
            "row_status": counts,
            "shards": {"total": int(self.attrs["n_shards"]), "done": int(self.done_shards.sum())},
            "writing": [{k: c.get(k) for k in ("pid", "host", "user", "started", "shards", "join")}
                        for c in self.claimants() if alive(c)],
            "classes": self.classes,
            "captures": captures,
            "stats": self.stats,
            "bytes_committed": self.bytes_committed(),
            "bytes_on_disk": disk_usage(self.url) if du else None,
        }

