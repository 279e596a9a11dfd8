"""``extractor run`` and ``extractor plan``: a job spec run here, or its plan printed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .._text import estimate
from ..errors import DataError, ExtractorError, FencedError, RemakeError
from .common import Estimate, _command


def _run_spec(spec: Any, resume: list[str], quiet: bool = False, resume_command: str | None = None) -> int:
    """Run ``spec`` with a progress bar; ``resume``: the arguments of the command that finishes it
    (``resume_command``: that whole command, as given by ``submit`` for a job on a cluster)."""
    finish = resume_command or _command(*resume)
    from .._progress import Progress
    from ..driver import run

    bar = Progress(enabled=not quiet)
    eta: list[Estimate] = []

    def on_start(total: int, per_row: dict[str, int]) -> None:
        if not quiet:
            print(estimate(total, per_row), file=sys.stderr)
        bar.start(total)
        eta.append(Estimate(total, spec.data.batch_size))

    def on_progress(n: int) -> None:
        bar.update(n)
        line = eta[0].update(n, time.perf_counter()) if eta else None
        if line:
            bar.write(line)

    try:
        summary = run(spec, on_start=on_start, on_progress=on_progress)
    except KeyboardInterrupt as err:
        bar.close()
        if not getattr(err, "resumable", False):
            print("\ninterrupted before the job touched its store: nothing was written", file=sys.stderr)
            return 130
        print(f"\ninterrupted; {_left(err, 'interrupted')}. To finish the job run:\n  {finish}", file=sys.stderr)
        return 130
    except (ExtractorError, OSError) as err:
        # the runner marks what stopped a job whose store it holds: said with the command that finishes it
        if not getattr(err, "resumable", False) or isinstance(err, FencedError):
            raise  # before the store was touched, or the store's own word: one line from main()
        if isinstance(err, OSError) and not isinstance(err, ExtractorError):  # a full disk, a dead endpoint
            print(f"error: the storage failed: {type(err).__name__}: {err}\n{_left(err, 'storage')}; once fixed, "
                  f"finish the job with:\n  {finish}", file=sys.stderr)
        else:
            print(_stopped(err, finish, resume, resume_command), file=sys.stderr)
        return 1
    finally:
        bar.close()
    print(summary.report())
    if summary.all_failed:
        from ..spec import SOURCE_SETTINGS

        print(f"error: every row of {summary.store} failed (reasons above); check the images of "
              f"data.{SOURCE_SETTINGS[spec.data.source].places[0]}", file=sys.stderr)
        return 1
    return 0


def _left(err: BaseException, how: str) -> str:
    """What a job stopped by ``err`` left of its store, said after an interrupt, a storage error or another error
    (``how``): its finished shards are kept, and where the store was half-made (its rows not all written) and what
    it held before (``err.creating``, ``err.replaced``: the store's session marks them)."""
    creating, replaced = getattr(err, "creating", False), getattr(err, "replaced", False)
    if how == "interrupted":
        if creating and replaced:
            return "the store was being created (what it held before is gone; its finished shards are kept)"
        return "the store's rows were being written (its finished shards are kept)" if creating else \
            "finished shards are kept"
    if how == "storage":
        return "The store is half-created, its finished shards kept" if creating else "Finished shards are kept"
    if not creating:
        return ""
    if isinstance(err, RemakeError):  # the store was made for what the rest of the listing contradicts
        return f" The store was made for {err.made_for}: once fixed, --overwrite makes it again."
    if isinstance(err, DataError):  # found as the rows were listed behind the first shards (a streamed listing)
        return (" The store is half-created: once the data is fixed in place (the same rows), --resume writes its "
                "rows again and keeps its finished shards; a fix that adds or removes rows, or one in the job's spec "
                "(data.classes, data.outside_root), needs --overwrite instead.")
    return " The store is half-created: --resume writes its rows again and keeps its finished shards."


def _stopped(err: ExtractorError, finish: str, resume: list[str], resume_command: str | None) -> str:
    """What an error that stopped a job whose store it holds says: itself, what it left, and the command that
    finishes the job (``finish``), or makes its store again where no resume can (a :class:`RemakeError`)."""
    kept = _left(err, "error")
    said = str(err) if not kept or str(err).endswith(".") else f"{err}."
    if isinstance(err, RemakeError) and getattr(err, "creating", False):
        again = _command(*resume[:-1], "--overwrite") if resume_command is None else \
            resume_command.replace("--resume", "--overwrite")
        return f"error: {said}{kept}\nOnce fixed, run the job again with:\n  {again}"
    return f"error: {said}{kept}\nOnce fixed, finish the job with:\n  {finish}"


def cmd_run(args: argparse.Namespace) -> int:
    from ..driver import check_submitted

    differs = check_submitted()  # a submitted job: the cluster's packages against the submitting machine's
    if differs:
        print(f"warning: this cluster runs {', '.join(differs)}; stored values may differ in their last bits "
              "from a run on the submitting machine", file=sys.stderr)
    spec = _job_spec(args)
    if args.dry_run:
        return _print_plan(spec, json_out=False)
    resume = ["run", args.job, *[a for s in args.set or [] for a in ("--set", s)], *(["-q"] if args.quiet else [])]
    again = "--join" if spec.output.if_exists == "join" else "--resume"  # a joined store: join it again
    return _run_spec(spec, [*resume, again], quiet=args.quiet, resume_command=args.resume_command)


def _print_plan(spec: Any, json_out: bool, full: bool = False) -> int:
    from ..driver import preview

    planned = preview(spec, full=full)
    print(json.dumps(planned.to_dict(), indent=2) if json_out else planned.report())
    return 1 if planned.refused else 0


def _job_spec(args: argparse.Namespace) -> Any:
    """The job of ``run`` and ``plan``: its YAML, ``--set`` overrides, and ``--resume``/``--overwrite``/``--join``."""
    from ..spec import load_spec

    overrides = list(args.set or [])
    modes = [m for m in ("resume", "overwrite", "join") if getattr(args, m, False)]
    if len(modes) > 1:
        both = " and ".join(f"--{m}" for m in modes)
        raise ExtractorError(f"choose one of --resume, --overwrite and --join, not {both}")
    if modes:
        overrides.append(f"output.if_exists={modes[0]}")
    return load_spec(args.job, overrides)


def cmd_plan(args: argparse.Namespace) -> int:
    return _print_plan(_job_spec(args), json_out=args.json, full=args.full)

