"""``extractor submit`` and ``extractor jobs``: a job on a Ray cluster, and following it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from .._text import table
from ..errors import ExtractorError
from .common import _command


def _address(args: argparse.Namespace) -> str:
    return args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or "http://127.0.0.1:8265"


def cmd_submit(args: argparse.Namespace) -> int:
    import yaml

    from ..driver import client, follow_logs
    from ..driver import submit_job as submit
    from ..spec import load_spec, looks_secret

    spec = load_spec(args.job, list(args.set or []))
    address = _address(args)
    print("job spec (secrets redacted):", file=sys.stderr)
    print(yaml.safe_dump(spec.public_dict(), sort_keys=False), file=sys.stderr)
    secrets = [name for name, value in spec.submit.env_vars.items() if looks_secret(name, value)]
    if secrets:
        print(f"warning: submit.env_vars ({', '.join(secrets)}) travel in Ray's runtime environment, "
              "which Ray writes in plain text to its logs on the cluster (runtime_env_agent.log): give credentials "
              "through the cluster itself instead (instance roles, a credentials file or variables set on its "
              "nodes)", file=sys.stderr)
    again = ["submit", args.job, "--address", address, *[a for s in args.set or [] for a in ("--set", s)],
             "--set", "output.if_exists=resume"]
    job_id = submit(spec, address, job_id=args.job_id, resume_command=_command(*again), ship=args.ship,
                    name=Path(args.job).name)
    print(f"submitted {job_id}")
    print(f"dashboard: {address.rstrip('/')}/#/jobs/{job_id}")
    if not args.wait:
        print(f"follow it with: extractor jobs logs {job_id} --follow --address {address}")
        return 0
    c = client(address)
    for text in follow_logs(c, job_id):
        print(text, end="", flush=True)
    info = c.get_job_info(job_id)
    print(f"job {job_id}: {info.status}" + (f" ({info.message})" if info.message else ""))
    return 0 if str(info.status).endswith("SUCCEEDED") else 1


def _jobs_list(c: Any, args: argparse.Namespace) -> None:
    jobs = sorted(c.list_jobs(), key=lambda j: j.start_time or 0)
    rows = [[j.submission_id or j.job_id or "", str(j.status).rsplit(".", 1)[-1],
             (j.metadata or {}).get("extractor_job") or "-",
             (j.metadata or {}).get("extractor_store") or (j.entrypoint or "")[:60]] for j in jobs]
    print(table(rows, ["id", "status", "job", "store (or entrypoint)"]) if rows else "no jobs")


def _jobs_status(c: Any, args: argparse.Namespace) -> None:
    info = c.get_job_info(args.id)
    print(f"{args.id}: {str(info.status).rsplit('.', 1)[-1]}" + (f" ({info.message})" if info.message else ""))


def _jobs_logs(c: Any, args: argparse.Namespace) -> None:
    from ..driver import follow_logs

    if not args.follow:
        print(c.get_job_logs(args.id), end="")
        return
    for text in follow_logs(c, args.id):
        print(text, end="", flush=True)


def _jobs_stop(c: Any, args: argparse.Namespace) -> None:
    print(f"{args.id}: {'stop requested' if c.stop_job(args.id) else 'already finished'}")


_JOBS = {"list": _jobs_list, "status": _jobs_status, "logs": _jobs_logs, "stop": _jobs_stop}


def cmd_jobs(args: argparse.Namespace) -> int:
    from ..driver import client
    from ..errors import ClusterError

    c = client(_address(args))
    if args.action != "list" and not args.id:
        raise ExtractorError(f"extractor jobs {args.action} needs a job id (see extractor jobs list)")
    try:
        _JOBS[args.action](c, args)
    except RuntimeError as err:  # the Jobs API answers unknown ids with a RuntimeError
        raise ClusterError(f"{args.action} {args.id or ''}: {err}") from None
    return 0

