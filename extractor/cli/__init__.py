"""The ``extractor`` command line: ``build_parser`` lists its commands, ``main`` runs one; each command group in
a module of its own (:mod:`.run`, :mod:`.cluster`, :mod:`.stores`, :mod:`.index`, :mod:`.layers`, :mod:`.demo`).
Only this package prints."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Any

from ..errors import ExtractorError, missing_extra
from .cluster import cmd_jobs, cmd_submit
from .common import _at_least, _port
from .demo import cmd_demo
from .index import add_index_parser
from .layers import cmd_layers
from .run import cmd_plan, cmd_run
from .stores import cmd_compare, cmd_inspect, cmd_probe, cmd_show
from .view import cmd_view

log = logging.getLogger("extractor")

DESCRIPTION = """\
Push an image collection through a PyTorch vision model and keep what chosen layers computed
(outputs, inputs, gradients, Grad-CAM maps) in a Zarr store. Start with `extractor demo`.
List a model's layers with `extractor layers`; run a YAML job spec here with `extractor run`,
or on a Ray cluster with `extractor submit` and follow it with `extractor jobs`. Then
summarise a store with `extractor inspect`, draw it with `extractor show`, measure how
well each capture separates the labels with `extractor probe`, see what every feature responds
to with `extractor index` and browse it all in a web browser with `extractor view`.
`extractor COMMAND --help` gives a command's options."""


def verbosity(args: argparse.Namespace) -> int:
    """How many -v were given, before the command and after it."""
    return args.verbose + getattr(args, "verbose_after", 0)


# build_parser is long by nature: one add_argument per option, read top to bottom like the --help it makes
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="extractor", description=DESCRIPTION, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    # -v after the command too: counted apart and added (extractor -v run -v job.yaml is -vv)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", dest="verbose_after", action="count", default=0,
                        help="more log output (-vv for debug)")
    sub = p.add_subparsers(dest="command", required=True)
    remote = argparse.ArgumentParser(add_help=False)  # reading a store on S3 and the like
    remote.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                        help="an fsspec option of a remote store, e.g. endpoint_url=http://host:9000 (repeatable); "
                             "credentials also come from the usual environment (AWS_ACCESS_KEY_ID, ...)")

    r = sub.add_parser("run", parents=[common], help="run a job spec on this machine")
    r.add_argument("job", help="job spec (YAML)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec key, e.g. data.batch_size=16")
    r.add_argument("--resume", action="store_true", help="finish an existing store, skipping done shards")
    r.add_argument("--overwrite", action="store_true", help="replace an existing store")
    r.add_argument("--join", action="store_true",
                   help="compute beside the other processes writing the store (made by the first to come), each shard "
                        "once: a Slurm array's tasks, several clusters; exits once the store is complete")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    r.add_argument("--dry-run", action="store_true", help="print what the run would write (as extractor plan)")
    r.add_argument("--resume-command", help=argparse.SUPPRESS)  # submit: the command that finishes a cluster job
    r.set_defaults(func=cmd_run)

    pl = sub.add_parser("plan", parents=[common], help="what a job would write, before anything is written")
    pl.add_argument("job", help="job spec (YAML)")
    pl.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec key")
    pl.add_argument("--resume", action="store_true", help="as run --resume would finish the existing store")
    pl.add_argument("--overwrite", action="store_true", help="as run --overwrite would replace it")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--full", action="store_true",
                    help="list every row of a large source (of more than 64 Parquet files, tars or megabytes of a "
                         "manifest, a part of 16 spread over it is listed and scaled)")
    pl.set_defaults(func=cmd_plan)

    i = sub.add_parser("inspect", parents=[common, remote], help="summarise a store")
    i.add_argument("store")
    i.add_argument("--json", action="store_true")
    i.add_argument("--verify", action="store_true",
                   help="read every computed row's image again and compare its content digest (exit 1 on a change)")
    i.add_argument("--objects", action="store_true",
                   help="with --verify: check every object the store's commits name instead (present, decoding as its "
                        "array says; exit 1 on one missing or damaged)")
    i.add_argument("--du", action="store_true",
                   help="each capture's stored bytes and the store's bytes on disk: every object listed or stat-ed "
                        "(without it: the bytes of values the committed shards wrote, as their commits record them)")
    i.set_defaults(func=cmd_inspect)

    la = sub.add_parser("layers", parents=[common], help="list a model's modules with output shapes")
    la.add_argument("model", nargs="?", default=None,
                    help="a model name (resnet50, timm:NAME, hf:ID_OR_FOLDER, open_clip:ARCH) or a job spec (JOB.yaml)")
    la.add_argument("--factory", help="pkg.module:function building the model instead")
    la.add_argument("--kwargs", "--factory-kwargs", default=None, metavar="YAML",
                    help="keyword arguments of the builder or factory, e.g. '{img_size: 64}'")
    la.add_argument("--weights", default=None)
    la.add_argument("--input-size", type=int, default=None,
                    help="input size in pixels (default: the model's own, or the job's crop)")
    la.add_argument("--depth", type=int, default=None, help="show modules down to this nesting depth")
    la.add_argument("--json", action="store_true")
    la.set_defaults(func=cmd_layers)

    sh = sub.add_parser("show", parents=[common, remote],
                        help="pictures: Grad-CAM overlays, a PCA scatter, or the images of rows")
    sh.add_argument("store")
    sh.add_argument("--key", help="capture to draw (default: the first gradcam capture)")
    sh.add_argument("--rows", default=None, help="rows START:STOP: draw these images (gradcam default 0:16)")
    sh.add_argument("--columns", type=int, default=4)
    sh.add_argument("--max-rows", type=_at_least(2), default=5000, help="rows sampled for the PCA")
    sh.add_argument("--top", default=None, metavar="F|VECTOR.npy",
                    help="the images where feature F (a channel or feature index) or a direction (a .npy vector, "
                         "e.g. an SAE decoder row) is highest, with their values")
    sh.add_argument("--k", type=_at_least(1), default=16, help="images for --top (default 16)")
    sh.add_argument("--pool", choices=["max", "mean"], default="max", help="over positions or tokens, for --top")
    sh.add_argument("--out", default="show.png")
    sh.set_defaults(func=cmd_show)

    pr = sub.add_parser("probe", parents=[common, remote],
                        help="linear-probe accuracy of each capture against the labels")
    pr.add_argument("store")
    pr.add_argument("--keys", nargs="*", help="captures to probe (default: all)")
    pr.add_argument("--folds", type=_at_least(2), default=5, help="cross-validation folds (default 5)")
    pr.add_argument("--max-rows", type=_at_least(2), default=10000, help="rows sampled for the probe")
    pr.add_argument("--out", default=None, help="bar chart (PNG, PDF or SVG)")
    pr.add_argument("--json", action="store_true", help="the results as JSON (for scripts)")
    pr.set_defaults(func=cmd_probe)

    co = sub.add_parser("compare", parents=[common, remote],
                        help="linear CKA and RSA between captures of one store or of several (rows aligned by id)")
    co.add_argument("captures", nargs="+", metavar="STORE[:KEY]", help="a store's capture, or all of a store's")
    co.add_argument("--rows", type=_at_least(3), default=None,
                    help="rows sampled for CKA (default: every shared row; 2048 for captures too wide for the "
                         "feature form)")
    co.add_argument("--rsa-rows", type=_at_least(3), default=1000, help="rows of the RDMs (default 1000)")
    co.add_argument("--seed", type=int, default=0)
    co.add_argument("--json", action="store_true", help="the matrices as JSON")
    co.add_argument("--out", default=None, help="the matrices as heatmaps (PNG, PDF or SVG)")
    co.set_defaults(func=cmd_compare)

    add_index_parser(sub, [common, remote])

    v = sub.add_parser("view", parents=[common, remote],
                       help="browse a store and its feature indexes in the browser (or --export a static site)")
    v.add_argument("store")
    v.add_argument("--port", type=_port, default=8050, help="port to listen on (default 8050; 0: a free one)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    v.add_argument("--export", metavar="DIR", default=None,
                   help="write the pages and the thumbnails to DIR (a new or empty folder, or an earlier export) "
                        "instead of serving them: it opens from disk")
    v.add_argument("--api", action="store_true",
                   help="with --export: each page's data as JSON too (api/...json, as the app serves it; for scripts)")
    v.add_argument("--features", type=_at_least(1), default=None, metavar="N",
                   help="with --export: the first N feature pages of each index (default: all)")
    v.add_argument("--images", type=_at_least(0), default=1000, metavar="N",
                   help="with --export: image pages of the first N rows, besides those the feature pages show "
                        "(default 1000)")
    v.add_argument("--no-run", action="store_true", help="offer no \"run this image\" and no search by text (they "
                   "build the store's model on first use)")
    v.add_argument("--device", default="auto", help="where the store's model runs an image (default auto)")
    v.set_defaults(func=cmd_view)

    su = sub.add_parser("submit", parents=[common], help="submit a job spec to a Ray cluster (Ray Jobs API)")
    su.add_argument("job", help="job spec (YAML)")
    su.add_argument("--address", help="Ray dashboard address, e.g. http://HEAD:8265 (default: "
                    "$RAY_API_SERVER_ADDRESS or http://127.0.0.1:8265)")
    su.add_argument("--set", action="append", metavar="KEY=VALUE")
    su.add_argument("--job-id", help="submission id (default: chosen by Ray)")
    su.add_argument("--wait", action="store_true", help="follow the logs; exit with the job's outcome")
    su.add_argument("--no-ship", dest="ship", action="store_false",
                    help="do not send the installed extractor package with the job (the cluster's image has it)")
    su.set_defaults(func=cmd_submit)

    jb = sub.add_parser("jobs", parents=[common], help="list, inspect, follow or stop submitted jobs")
    jb.add_argument("action", choices=["list", "status", "logs", "stop"])
    jb.add_argument("id", nargs="?")
    jb.add_argument("--address")
    jb.add_argument("--follow", action="store_true")
    jb.set_defaults(func=cmd_jobs)

    d = sub.add_parser("demo", parents=[common], help="write sample images, run the demo job, show the store")
    d.add_argument("--dir", default="demo", help="folder for the images and the store (default: demo)")
    d.add_argument("--per-class", type=int, default=64, help="sample images per class (4 classes)")
    d.add_argument("--set", action="append", metavar="KEY=VALUE")
    d.add_argument("-q", "--quiet", action="store_true")
    d.set_defaults(func=cmd_demo)
    for command in sub.choices.values():  # no abbreviated options: --se would be --set, unredacted in logs
        command.allow_abbrev = False
    return p


def main(argv: list[str] | None = None) -> int:
    # torch's transparent-huge-page allocator: +26% CPU throughput measured here (NOTES.md)
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(verbosity(args), 2)
    # -vv debugs extractor, not the libraries under it: botocore's debug log prints access key ids
    logging.basicConfig(level=max(level, logging.INFO), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("extractor").setLevel(level)
    # progress lines are INFO (a library's progress is no warning); the command shows them unless asked to be quiet
    logging.getLogger("extractor.progress").setLevel(min(level, logging.INFO) if level <= logging.WARNING else level)
    if args.command == "layers" and not (args.model or args.factory):
        print("error: name a model (extractor layers resnet50), a job (extractor layers JOB.yaml) or pass --factory",
              file=sys.stderr)
        return 2
    signals = _Signals() if argv is None else None  # the real command line: SIGTERM stops like Ctrl-C
    code = 1  # (an error none of these catches: Python's own traceback, exit 1)
    try:
        code = _command(args)
        return code
    finally:
        if signals is not None:
            signals.settle(code)
        _quiet_teardown()


def _command(args: argparse.Namespace) -> int:
    """The command's exit code; an error it raises said in one line."""
    try:
        return int(args.func(args))
    except ExtractorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as err:
        hint = missing_extra(err)
        if hint is None:
            raise
        print(f"error: extractor {args.command} {hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _quiet_teardown() -> None:
    """The command is done: what the interpreter says of abandoned storage coroutines as it exits (zarr reads
    a store's metadata files at once; when the first fails, s3fs's others are left pending and print
    "Exception ignored in <coroutine ...>" and "Task was destroyed" tracebacks) is noise after the one line
    that said what failed."""
    def hook(unraisable: Any) -> None:
        if type(unraisable.object).__name__ not in ("coroutine", "Task", "Future"):
            sys.__unraisablehook__(unraisable)  # anything else is said as Python says it

    sys.unraisablehook = hook
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # "Task was destroyed but it is pending!"


class _Signals:
    """Ctrl-C and SIGTERM (cluster pre-emption) on the command line: the first stops the job cleanly
    (KeyboardInterrupt: the store marked interrupted, the resume command printed); a second one while
    that runs (a slow storage) ends the process at once, still with exit code 130; one that comes once the
    command is done ends the process at once with the command's exit code (:meth:`settle`)."""

    def __init__(self) -> None:
        import signal

        self.stopping = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.stopping:
            os.write(2, b"\ninterrupted again: exiting now (finished shards are kept; --resume finishes)\n")
            os._exit(130)
        self.stopping = True
        raise KeyboardInterrupt(f"signal {signum}")

    def settle(self, code: int) -> None:
        """The command is done, its exit code ``code``: a signal from now on ends the process at once with that
        code, its output flushed. What is left is the interpreter's exit (torch's and Ray's exit callbacks), where a
        KeyboardInterrupt printed a traceback, or made a complete job's exit 130 without a word."""
        import signal

        def done(signum: int, frame: object) -> None:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, done)


