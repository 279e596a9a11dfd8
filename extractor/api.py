"""The Python entry: ``extractor.run(job, model=...)`` runs a job and returns its store.

    >>> import extractor
    >>> store = extractor.run("jobs/demo.yaml", overrides=["data.batch_size=16"])
    >>> store = extractor.run({"data": {"root": "imgs"}, "capture": [{"layer": "(model)"}]}, model=my_module)
    >>> store.last_run.report()   # what `extractor run` prints
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import SpecError
from .read import ActivationStore, open_store
from .spec import JobSpec, apply_overrides, parse_spec, read_spec

__all__ = ["run"]

log = logging.getLogger(__name__)

PROGRESS_LOG_S = 10.0  # without a terminal or a notebook: a progress line this often


def _spec(job: str | Path | dict[str, Any] | JobSpec, overrides: Sequence[str], model: Any) -> JobSpec:
    """The job as a validated spec; with ``model``, its model section names that module."""
    if isinstance(overrides, str):
        overrides = [overrides]  # one KEY=VALUE, not its characters
    if not isinstance(job, (str, Path, dict, JobSpec)):
        raise SpecError(f"extractor.run takes a job: a YAML path, a dict or a JobSpec, not {type(job).__name__}")
    if model is not None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise SpecError(f"model= takes a torch.nn.Module, not {type(model).__name__}; wrap a function in a "
                            "Module whose forward calls it")
    if isinstance(job, JobSpec):
        raw, named = job.to_dict(), {k for k in ("name", "factory") if k in job.model.model_fields_set}
    else:
        raw = read_spec(job) if isinstance(job, (str, Path)) else dict(job)
        named = {k for k in ("name", "factory") if (raw.get("model") or {}).get(k)}
    raw = apply_overrides(raw, list(overrides))
    if model is not None:
        if named:
            given = ", ".join(f"model.{k}" for k in sorted(named))
            raise SpecError(f"model= was given, and the job names a model too ({given}); remove it from the job, "
                            "or do not pass model=")
        section = dict(raw.get("model") or {})
        section.update(name=f"python:{type(model).__module__}.{type(model).__qualname__}", factory=None)
        raw = {**raw, "model": section}
    return parse_spec(raw, source=str(job) if isinstance(job, (str, Path)) else "job spec")


class _Progress:
    """A progress bar where someone watches one (a terminal: tqdm; Jupyter: tqdm's widget), else a
    log line every PROGRESS_LOG_S seconds."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.bar, self.total, self.last = enabled, None, 0, 0.0

    def start(self, total: int, per_row: dict[str, int]) -> None:
        self.total, self.last = total, time.monotonic()
        if not self.enabled:
            return
        if sys.stderr.isatty() or "ipykernel" in sys.modules:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="img", dynamic_ncols=True)
        else:
            log.warning("%d images to process", total)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
        elif self.enabled and time.monotonic() - self.last >= PROGRESS_LOG_S:
            self.last = time.monotonic()
            log.warning("%d of %d images (%.0f%%)", n, self.total, 100 * n / max(self.total, 1))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(job: str | Path | dict[str, Any] | JobSpec, *, model: Any = None, overrides: Sequence[str] = (),
        progress: bool = True) -> ActivationStore:
    """Run a job and return its store, opened for reading.

    ``job`` is a YAML path, a dict (as the YAML would be) or a :class:`JobSpec`; ``overrides``
    are ``--set`` items (``"data.batch_size=16"``). ``model`` is an ``nn.Module`` made in Python:
    the local backend uses it as it is (moved to the job's device; its modules' modes,
    ``requires_grad`` and memory format given back afterwards, also when the job fails); the
    Ray backend sends it to every worker with cloudpickle (or says why it cannot). The store
    records it as ``python:MODULE.CLASS`` with its state-dict hash.
    ``progress``: a bar in a terminal or a notebook, log lines otherwise. The run's report is
    ``store.last_run`` (a :class:`~extractor.runner.RunSummary`; ``.report()`` is what
    ``extractor run`` prints); a run in which every row failed raises :class:`DataError`.
    """
    from .driver import LocalBackend
    from .driver import run as run_spec
    from .errors import DataError

    spec = _spec(job, overrides, model)
    backend: Any = None
    if model is not None and spec.cluster.backend == "local":
        from .compute import Worker

        backend = LocalBackend(spec, Worker(spec, model=model))
    elif model is not None:
        from .driver import RayBackend

        backend = RayBackend(spec, model=model)
    bar = _Progress(progress)
    try:
        summary = run_spec(spec, on_start=bar.start, on_progress=bar.update, backend=backend)
    finally:
        bar.close()
    if summary.all_failed:
        raise DataError(f"every row of {summary.store} failed: {summary.failures[0][2] if summary.failures else ''}; "
                        "check data.root and the images")
    store = open_store(summary.store, spec.output.storage_options or None)
    store.last_run = summary
    return store
