"""The Python entry: ``extractor.run(job, model=...)`` runs a job and returns its store.

    >>> import extractor
    >>> store = extractor.run("jobs/demo.yaml", overrides=["data.batch_size=16"])
    >>> store = extractor.run({"data": {"root": "imgs"}, "capture": [{"layer": "(model)"}]}, model=my_module)
    >>> store = extractor.run("jobs/demo.yaml", dataset=datasets.load_dataset("ORG/NAME", split="train"))
    >>> store.last_run.report()   # what `extractor run` prints
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._progress import Progress
from ._text import estimate
from .data import with_dataset
from .errors import SpecError
from .read import ActivationStore, open_store
from .spec import JobSpec, apply_overrides, parse_spec, read_spec

__all__ = ["run"]

log = logging.getLogger(__name__)

def _raw(job: str | Path | dict[str, Any] | JobSpec) -> tuple[dict[str, Any], set[str]]:
    """The job as a plain mapping, and which of model.name and model.factory it names itself."""
    if isinstance(job, JobSpec):
        return job.to_dict(), {k for k in ("name", "factory") if k in job.model.model_fields_set}
    if not isinstance(job, (str, Path, dict)):
        raise SpecError(f"extractor.run takes a job: a YAML path, a dict or a JobSpec, not {type(job).__name__}")
    raw = read_spec(job) if isinstance(job, (str, Path)) else dict(job)
    return raw, {k for k in ("name", "factory") if (raw.get("model") or {}).get(k)}


def _check_module(model: Any) -> None:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise SpecError(f"model= takes a torch.nn.Module, not {type(model).__name__}; wrap a function in a "
                        "Module whose forward calls it")


def _with_module(raw: dict[str, Any], named: set[str], model: Any) -> dict[str, Any]:
    """The job whose model section names the module ``model`` (``python:MODULE.CLASS``)."""
    if named:
        given = ", ".join(f"model.{k}" for k in sorted(named))
        raise SpecError(f"model= was given, and the job names a model too ({given}); remove it from the job, "
                        "or do not pass model=")
    section = dict(raw.get("model") or {})
    section.update(name=f"python:{type(model).__module__}.{type(model).__qualname__}", factory=None)
    return {**raw, "model": section}


def _spec(job: str | Path | dict[str, Any] | JobSpec, overrides: Sequence[str], model: Any,
          dataset: Any = None) -> JobSpec:
    """The job as a validated spec; with ``model``, its model section names that module; with ``dataset``, its
    data section reads that data set's files."""
    if isinstance(overrides, str):
        overrides = [overrides]  # one KEY=VALUE, not its characters
    if model is not None:
        _check_module(model)
    raw, named = _raw(job)
    raw = apply_overrides(raw, list(overrides))
    if model is not None:
        raw = _with_module(raw, named, model)
    if dataset is not None:
        raw = with_dataset(raw, dataset)
    return parse_spec(raw, source=str(job) if isinstance(job, (str, Path)) else "job spec")


def run(job: str | Path | dict[str, Any] | JobSpec, *, model: Any = None, dataset: Any = None,
        overrides: Sequence[str] = (), progress: bool = True) -> ActivationStore:
    """Run a job and return its store, opened for reading.

    ``job`` is a YAML path, a dict (as the YAML would be) or a :class:`JobSpec`; ``overrides``
    are ``--set`` items (``"data.batch_size=16"``). ``model`` is an ``nn.Module`` made in Python:
    the local backend uses it as it is (moved to the job's device; its modules' modes,
    ``requires_grad`` and memory format given back afterwards, also when the job fails); the
    Ray backend sends it to every worker with cloudpickle (or says why it cannot). The store
    records it as ``python:MODULE.CLASS`` with its state-dict hash.
    ``dataset`` is a ``datasets.Dataset`` whose rows live in files (loaded from the Hub or a folder, or
    ``load_from_disk``): the job reads those files (``data.source: parquet``), its Image column and its ClassLabel
    column; one held in memory only, or a selection of rows (``shuffle``, ``select``), is refused saying how.
    ``progress``: a bar in a terminal or a notebook, log lines otherwise. The run's report is
    ``store.last_run`` (a :class:`~extractor.runner.RunSummary`; ``.report()`` is what
    ``extractor run`` prints); a run in which every row failed raises :class:`DataError`.
    """
    from .driver import LocalBackend
    from .driver import run as run_spec
    from .errors import DataError

    spec = _spec(job, overrides, model, dataset)
    backend: Any = None
    if model is not None and spec.cluster.backend == "local":
        from .compute import Worker

        backend = LocalBackend(spec, Worker(spec, model=model))
    elif model is not None:
        from .driver import RayBackend

        backend = RayBackend(spec, model=model)
    bar = Progress(progress)

    def started(total: int, per_row: dict[str, int]) -> None:
        bar.start(total)
        bar.write(estimate(total, per_row))  # the size line `extractor run` prints

    try:
        summary = run_spec(spec, on_start=started, on_progress=bar.update, backend=backend)
    finally:
        bar.close()
    if summary.all_failed:
        from .spec import SOURCE_SETTINGS

        raise DataError(f"every row of {summary.store} failed: {summary.failures[0][2] if summary.failures else ''}; "
                        f"check the images of data.{SOURCE_SETTINGS[spec.data.source].places[0]}")
    store = open_store(summary.store, spec.output.storage_options or None)
    store.last_run = summary
    return store
