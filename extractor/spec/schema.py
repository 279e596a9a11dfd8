"""The job spec's schema: a frozen, strictly validated tree of pydantic models.

Unknown keys, wrong types and bad values raise :class:`~extractor.errors.SpecError` (through
:mod:`.load`) whose message names the field path (``capture[1].reduce: ...``).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .capture_spec import CaptureSpec
from .data_spec import DataSpec
from .identity import RUN_ONLY, _marked, redact
from .model_spec import ModelSpec, model_folder
from .section import _auto_or_at_least, _Section
from .sources import PLACES

__all__ = ["JobSpec"]


class OutputSpec(_Section):
    store: str = Field(default="out.zarr", json_schema_extra=RUN_ONLY)
    """Path or fsspec URL (``s3://bucket/run.zarr``) of the Zarr store to write."""
    storage_options: dict[str, Any] = Field(default_factory=dict, json_schema_extra=RUN_ONLY)
    """fsspec options for a remote store; secrets here are never written to the store or logs."""
    chunk_rows: int | Literal["auto"] = Field(default="auto", json_schema_extra=RUN_ONLY)  # never changes values
    """Rows per chunk of every capture array, a divisor of data.shard_size; or ``auto`` (the
    default), decided per capture when the store is made: the largest divisor of data.shard_size
    up to 256 (250 for shards of 1000, 100 for 100), or more for a capture with small rows, up to
    about 1 MiB per chunk and a whole shard (512 rows for 512 float32 features). Chunking never
    changes values: a resumed store keeps its own."""
    sharding: bool = Field(default=True, json_schema_extra=RUN_ONLY)  # never changes values
    """Each work shard of a capture is one storage object (a Zarr v3 shard) holding chunks of
    ``chunk_rows`` rows, read one at a time: a row's read costs its chunk, not the shard. With it,
    ``chunk_rows: auto`` makes chunks of about 1 MiB (fewer rows for large rows, at least one).
    false: every chunk its own object (stores before it: a resumed store keeps its own)."""
    compression: Literal["lz4", "zstd", "blosc", "gzip", "none"] = Field(default="lz4", json_schema_extra=RUN_ONLY)
    """How the capture arrays' chunks are compressed (never changes values: a resumed store keeps its own codecs,
    and reads with any of them). ``lz4`` (the default): blosc's lz4 after a shuffle (``shuffle``), the least CPU at a
    ratio within 5% of the best on extractor's activations (the docs' store layout, "Compression": measured per
    dtype); ``zstd`` (level 3; the default before 0.1.0's issue 55), ``blosc`` (zstd 5 after a bit shuffle),
    ``gzip`` (level 5), ``none``."""
    compression_level: int | None = Field(default=None, json_schema_extra=RUN_ONLY)
    shuffle: Literal["auto", "byte", "bit", "none"] = Field(default="auto", json_schema_extra=RUN_ONLY)
    """The byte or bit shuffle before ``lz4`` or ``blosc``: ``auto`` is the one measured best for the values' size
    with lz4 (byte shuffle for float32, bit shuffle for float16 and bfloat16; blosc: bit shuffle)."""
    if_exists: Literal["error", "resume", "overwrite", "join"] = Field(default="error", json_schema_extra=RUN_ONLY)
    """What to do when the store exists (``--resume`` / ``--overwrite`` / ``--join`` set this): ``join`` makes it
    where there is none (the first process to come, exactly once) and computes beside the other processes writing
    it, each shard claimed by one of them at a time; every one of them ends once the store is complete."""
    reuse: tuple[str, ...] = Field(default=(), json_schema_extra=RUN_ONLY)  # what it takes is checked to match
    """Other stores (paths or URLs, read with ``storage_options``) to take rows from instead of computing
    them: a row whose image has the content digest of an ok row there is copied, when the store was made
    by the same model weights, preprocessing and captures (checked before the job starts; a store that
    differs is refused, naming how). The store records where each row came from (``reused``)."""
    on_change: Literal["refuse", "redo"] = Field(default="refuse", json_schema_extra=RUN_ONLY)
    """What ``--resume`` does when images of rows already computed changed since (their content digest
    differs where the source's size, modification time or ETag did): ``refuse`` names them; ``redo``
    computes their shards again (also how rows that failed, their image fixed since, are computed). Never a store
    that mixes both versions."""
    lease_timeout_s: float = Field(default=60.0, gt=0, json_schema_extra=RUN_ONLY)
    """A running job's claimant renews its heartbeat record in the store; one silent this long is taken to be dead
    (its claimed shards are another's to compute; its late commits are refused)."""

    @field_validator("chunk_rows")
    @classmethod
    def _chunk_rows(cls, value: int | str) -> int | str:
        return _auto_or_at_least(value, 1)

    @field_validator("compression_level")
    @classmethod
    def _level_in_range(cls, level: int | None, info: ValidationInfo) -> int | None:
        compression = info.data.get("compression")
        if level is None or compression is None:  # unset, or compression itself is invalid (said already)
            return level
        if compression not in _LEVELS:
            raise ValueError("compression is none, so there is no level to set; remove compression_level")
        low, high = _LEVELS[compression]
        if not low <= level <= high:
            raise ValueError(f"{level} is out of range for {compression}: use {low} to {high}, "
                             "or leave it unset for the default")
        return level

    @field_validator("shuffle")
    @classmethod
    def _shuffled_codec(cls, shuffle: str, info: ValidationInfo) -> str:
        compression = info.data.get("compression")
        if shuffle != "auto" and compression not in (None, *_SHUFFLED):
            raise ValueError(f"compression {compression} does not shuffle; remove shuffle, or set compression: lz4 "
                             "or blosc")
        return shuffle


_LEVELS = {"lz4": (0, 9), "zstd": (-131072, 22), "blosc": (0, 9), "gzip": (0, 9)}  # what each codec accepts
_SHUFFLED = ("lz4", "blosc")  # the codecs that shuffle (blosc's)


class ClusterSpec(_Section):
    backend: Literal["ray", "local"] = "ray"
    """``ray`` runs one worker actor per GPU on a Ray cluster; ``local`` runs the worker in this process."""
    address: str | None = None
    """null starts an embedded local Ray for the job (loopback only); ``auto`` or ``HOST:PORT`` joins a cluster."""
    workers: int | Literal["auto"] = "auto"
    """Worker actors. ``auto``: as many as the cluster's free resources hold at the start (one per
    GPU; on CPU-only clusters one per ``cpus_per_worker``), and more as capacity frees or nodes
    join during the job, up to ``max_workers``. A number N: N workers; those that do not fit yet
    start when capacity appears. Either way the job goes on with the workers it has."""
    max_workers: int | None = Field(default=None, gt=0)
    """With ``workers: auto``, at most this many workers (default: no limit)."""
    gpus_per_worker: float | None = Field(default=None, ge=0)
    """GPUs per worker, fractions allowed (default: 1 when the cluster has GPUs, else 0)."""
    cpus_per_worker: float | None = Field(default=None, gt=0)
    """CPUs per worker for decoding and torch threads (default: the cluster's CPUs / workers, at most 8)."""
    max_retries: int = Field(default=3, ge=0)
    """Times a shard is retried after its worker died or raised, before the job fails."""
    local_cpus: int | None = Field(default=None, gt=0)
    """CPUs of the embedded local Ray (default: all of this machine's)."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    """How long to wait for the workers to build their models, and, when no worker is left (lost
    nodes), for one to be placed again before the job stops (resumable)."""

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        if value is None:  # specs written before workers: auto
            return "auto"
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"expected auto or a number >= 1, not {value}")
        return value

    @model_validator(mode="after")
    def _max_workers(self) -> ClusterSpec:
        if self.max_workers is not None and self.workers != "auto":
            raise ValueError(f"max_workers caps workers: auto; with workers: {self.workers} that number is the most "
                             "(remove one of them)")
        return self


class SubmitSpec(_Section):
    working_dir: str | None = None
    """A folder uploaded with the job (e.g. the code of a model.factory); the spec travels beside it."""
    pip: tuple[str, ...] = ()
    """Packages pip installs for the job on the cluster (e.g. extractor itself)."""
    env_vars: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the job on the cluster. A number is taken as its text (``OMP_NUM_THREADS: 4``;
    ``--set submit.env_vars.X=0022`` keeps the text as typed, YAML reads ``0022`` in a file as a number: quote it);
    true and false are refused (``"1"``, ``"true"``, ``"yes"``: say which)."""

    @field_validator("env_vars", mode="before")
    @classmethod
    def _env_text(cls, value: Any) -> Any:
        """An environment holds text: a number (YAML's ``4``) as its text; true or false refused, for the
        spelling a program reads varies."""
        if not isinstance(value, dict):
            return value
        for name, v in value.items():
            if isinstance(v, bool):
                raise ValueError(f"{name} is {v!r}: an environment variable holds text; quote the spelling the "
                                 f"program reads, e.g. {name}: \"1\" or \"{str(v).lower()}\"")
        return {name: str(v) if isinstance(v, int | float) else v for name, v in value.items()}


MAX_AUTO_CHUNK_ROWS = 256  # output.chunk_rows: auto goes beyond it only for captures with small rows
MIN_AUTO_CHUNK_ROWS = 16  # nor goes below it, unless the shard itself is smaller
AUTO_CHUNK_BYTES = 1 << 20  # rows of small captures fill chunks up to about this size


def auto_inner_rows(shard_size: int, row_bytes: int) -> int:
    """Rows per chunk of a sharded capture: the largest divisor of ``shard_size`` whose chunk of rows of
    ``row_bytes`` holds at most AUTO_CHUNK_BYTES (one row at least)."""
    return max(d for d in range(1, shard_size + 1) if shard_size % d == 0 and (d == 1 or d * row_bytes
                                                                                <= AUTO_CHUNK_BYTES))


def auto_chunk_rows(shard_size: int, row_bytes: int = 0) -> int:
    """The largest divisor of ``shard_size`` up to MAX_AUTO_CHUNK_ROWS rows, or up to AUTO_CHUNK_BYTES
    of rows of ``row_bytes`` when that is more. A shard size whose divisors are all too small for
    sensible chunks (a prime such as 1009) is refused, saying what to set."""
    divisors = sorted({d for i in range(1, math.isqrt(shard_size) + 1) if shard_size % i == 0
                       for d in (i, shard_size // i)})
    base = max(d for d in divisors if d <= MAX_AUTO_CHUNK_ROWS)
    if base < MIN_AUTO_CHUNK_ROWS and base != shard_size:
        raise ValueError(
            f"output.chunk_rows: auto needs a divisor of data.shard_size ({shard_size}) between "
            f"{MIN_AUTO_CHUNK_ROWS} and {MAX_AUTO_CHUNK_ROWS}, and the largest is {base}; choose a shard_size "
            "with one (1000, 1024...) or set output.chunk_rows to a divisor of it"
        )
    fill = AUTO_CHUNK_BYTES // row_bytes if row_bytes > 0 else 0
    return max(d for d in divisors if d <= max(base, fill))


class JobSpec(_Section):
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec
    capture: tuple[CaptureSpec, ...] = Field(min_length=1)
    output: OutputSpec = Field(default_factory=OutputSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, json_schema_extra=RUN_ONLY)
    submit: SubmitSpec = Field(default_factory=SubmitSpec, json_schema_extra=RUN_ONLY)

    @model_validator(mode="after")
    def _chunks_fit_shards(self) -> JobSpec:
        if self.output.chunk_rows == "auto":
            auto_chunk_rows(self.data.shard_size)  # a shard size without a sensible divisor is refused here
        elif self.data.shard_size % self.output.chunk_rows:
            raise ValueError(
                f"output.chunk_rows ({self.output.chunk_rows}) must divide data.shard_size "
                f"({self.data.shard_size}) so that no two shards share a chunk"
            )
        targets = {c.score_target for c in self.capture if c.gradient}
        if len(targets) > 1:
            raise ValueError(
                f"gradient captures must share one target, got {sorted(map(str, targets))}; "
                "run one job per target"
            )
        keys = [c.key for c in self.capture if c.key and "{" not in c.key]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"capture keys must be unique; repeated: {', '.join(dup)}")
        return self

    def local_paths(self) -> list[tuple[str, str]]:
        """Every setting that names a file or folder, as ``(setting, path)``: the store, the images' root, the
        manifest, each tar, a checkpoint file, a model folder (``hf:FOLDER``, ``open_clip:local-dir:FOLDER``: the
        folder), each store reused. URLs are among them (callers pass them by); relative paths mean a place under
        the folder the job runs from. The one list of them (workers elsewhere, jobs submitted elsewhere)."""
        d, m = self.data, self.model
        out: list[tuple[str, str | None]] = [("output.store", self.output.store)]
        for place in PLACES:
            value = getattr(d, place)
            out += [(f"data.{place}", v) for v in ([value] if isinstance(value, str | None) else value)]
        if m.weights_kind == "file":
            out.append(("model.weights", m.weights))
        folder = model_folder(m.name)
        if folder is not None:
            out.append(("model.name", folder[1]))
        out += [("output.reuse", u) for u in self.output.reuse]
        return [(k, v) for k, v in out if isinstance(v, str) and v]

    def to_dict(self) -> dict[str, Any]:
        """The resolved spec as plain JSON-able data, secrets included (for workers only)."""
        return self.model_dump(mode="json")

    def public_dict(self) -> dict[str, Any]:
        """The resolved spec with secrets (storage options, env_vars) redacted: what the store, logs and prints show."""
        return redact(self.to_dict())

    def content_dict(self) -> dict[str, Any]:
        """The parts of the spec that decide what the store contains (compared on resume)."""
        return content_of(self.to_dict())


def content_of(spec_dict: dict[str, Any]) -> dict[str, Any]:
    """``spec_dict`` (a resolved spec as plain data) without the fields marked run-only, and without the
    preprocessing settings (marked resolved): what they resolve to (the store's ``preprocess`` record) is
    compared instead, so that ``resize: auto`` and ``resize: 256`` that mean the same are the same."""
    d = copy.deepcopy(spec_dict)
    for section, info in JobSpec.model_fields.items():
        if _marked(info):
            d.pop(section, None)
            continue
        fields = getattr(info.annotation, "model_fields", {})
        if isinstance(d.get(section), dict):
            for name in [n for n, f in fields.items() if _marked(f)]:
                d[section].pop(name, None)
    return d

