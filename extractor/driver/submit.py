"""Sending jobs to a Ray cluster through the Ray Jobs API (``ray.job_submission``).

``submit`` packs the resolved job spec (and the spec's ``submit.working_dir``, if any) into
the job's runtime environment and runs ``python -m extractor.cli run`` on the cluster. The
installed ``extractor`` package travels with it (``py_modules``), and so does a
``model.factory`` module found in the current folder, so the cluster needs only Python and
extractor's dependencies (torch, torchvision, Ray, zarr...). On start, the job compares them
with the submitting machine's (:mod:`extractor._environment`). Ray is imported here only.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from ..errors import ClusterError
from ..spec import JobSpec
from .environment import SUBMITTED, environment

__all__ = ["JOB_FILE", "client", "follow_logs", "submit"]

JOB_FILE = ".extractor-job.yaml"


def _token() -> str | None:
    """The Ray auth token from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def _explain(address: str, err: BaseException) -> ClusterError:
    text = str(err)
    # an HTTP 401, not a port such as :40123 in the address the message repeats
    if re.search(r"(?<![\d:.])401(?!\d)", text) or "Authentication" in text or "Unauthorized" in text:
        return ClusterError(
            f"the Ray cluster at {address} requires a token (Ray token authentication): set RAY_AUTH_TOKEN, "
            "or put the token (`ray get-auth-token` on the head node) in ~/.ray/auth_token"
        )
    return ClusterError(f"cannot reach the Ray Jobs API at {address}: {type(err).__name__}: {err}")


def client(address: str) -> Any:
    """A JobSubmissionClient for ``address`` (http://HEAD:8265), with the auth token if one is set."""
    from ray.job_submission import JobSubmissionClient

    token = _token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except Exception as err:  # ConnectionError, RuntimeError, ValueError depending on the failure
        raise _explain(address, err) from err


def _check_paths(spec: JobSpec) -> None:
    """Refuse relative local paths: on the cluster the job runs in a temporary copy of
    ``submit.working_dir`` (which Ray deletes later), not in the directory submitting it. An
    input may be relative when it is inside that folder (uploaded with it)."""
    from ..data import expand_braces, is_relative

    if spec.output.store and is_relative(spec.output.store):
        raise ClusterError(
            f"output.store {spec.output.store} is a relative path: on the cluster it would be written inside the job's "
            "temporary copy of submit.working_dir, which Ray deletes. Give an absolute path on the cluster's shared "
            "file system, or a URL (s3://...)"
        )
    shipped = Path(spec.submit.working_dir) if spec.submit.working_dir else None
    for name, value in spec.local_paths():
        inside = shipped is not None and all((shipped / v).exists() for v in expand_braces(value))
        if name != "output.store" and is_relative(value) and not inside:
            raise ClusterError(
                f"{name} {value} is a relative path, and not inside submit.working_dir: on the cluster the job runs in "
                "a copy of that folder, not here. Give an absolute path that the cluster's nodes can read, a URL "
                "(s3://...), or a path inside submit.working_dir"
            )


def _factory_module(spec: JobSpec) -> Path | None:
    """The current folder's file or package of ``model.factory`` (``module:function``), if any."""
    if not spec.model.factory:
        return None
    top = spec.model.factory.split(":", 1)[0].split(".", 1)[0]
    for candidate in (Path(f"{top}.py"), Path(top)):
        if candidate.is_file() or (candidate / "__init__.py").is_file():
            return candidate
    return None


def submit(spec: JobSpec, address: str, job_id: str | None = None, resume_command: str | None = None,
           ship: bool = True, name: str | None = None) -> str:
    """Submit ``spec`` as a Ray job; returns the submission id. ``resume_command``: what the job
    prints when it stops unfinished (its own command names a file in Ray's temporary folder).
    ``ship``: send the installed extractor package with the job (False: the cluster has it). ``name``:
    the job file's, shown by ``extractor jobs list`` beside the store (job metadata)."""
    _check_paths(spec)
    c = client(address)
    sub = spec.submit
    with tempfile.TemporaryDirectory(prefix="extractor-submit-") as tmp:
        work = Path(tmp) / "job"
        if sub.working_dir:
            src = Path(sub.working_dir)
            if not src.is_dir():
                raise ClusterError(f"submit.working_dir {src} is not a folder")
            shutil.copytree(src, work, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.zarr"))
        else:
            work.mkdir()
        factory = _factory_module(spec)
        if factory is not None and not (work / factory.name).exists():  # the job runs in work/, on sys.path
            (shutil.copytree if factory.is_dir() else shutil.copy2)(factory, work / factory.name)
        (work / JOB_FILE).write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
        runtime_env: dict[str, Any] = {"working_dir": str(work)}
        if ship:
            runtime_env["py_modules"] = [str(Path(__file__).resolve().parents[1])]  # the extractor package
        if sub.pip:
            runtime_env["pip"] = list(sub.pip)
        # Ray writes the runtime environment to its logs on the cluster: said at submit (cli)
        runtime_env["env_vars"] = {**sub.env_vars, SUBMITTED: json.dumps(environment())}
        try:
            return c.submit_job(  # not quiet: a progress line every PROGRESS_LOG_S in the job's logs
                entrypoint=f"python -m extractor.cli run {JOB_FILE}"
                + (f" --resume-command {shlex.quote(resume_command)}" if resume_command else ""),
                runtime_env=runtime_env,
                submission_id=job_id,
                metadata={"extractor_store": spec.output.store, "extractor_job": name or ""},
            )
        except Exception as err:
            raise _explain(address, err) from err


def follow_logs(c: Any, job_id: str) -> Iterator[str]:
    """The job's log text as it comes (a chunk of lines at a time), until the job ends."""
    loop = asyncio.new_event_loop()
    chunks = c.tail_job_logs(job_id).__aiter__()
    try:
        while True:
            try:
                yield loop.run_until_complete(chunks.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
